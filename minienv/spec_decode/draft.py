"""The draft model as a proposer: a small model with its own paged KV cache, kept in step with the target's.

Each engine step, :meth:`DraftProposer.propose` runs the draft ``k`` times over the batch of speculating requests:
the first call feeds every token the draft has not seen yet (the whole prompt the first time; afterwards the
tokens verification appended last step), each later call feeds the draft token just proposed. The draft's KV
cache lives in its own :class:`~minienv.kv.kv_pool.KVPool`, managed by its own
:class:`~minienv.kv.kv_cache_manager.KVCacheManager` — same block size, separate budget.

Rollback needs no message from the verifier: before feeding, the proposer compares what its cache holds (its own
:class:`~minienv.kv.interface.KVRequest` per request: the real tokens and drafts it fed, read by its manager) with
the request's real tokens and truncates to their common prefix (``KVCacheManager.truncate`` frees the blocks past
it).
Rejected drafts are exactly the tokens that differ, so the draft's cache follows the target's.

Invariant: after :meth:`propose`, the draft cache of a request holds its real tokens followed by the first
``k - 1`` drafts; a request the draft cannot fit (its budget is full) gets no proposal and holds no draft blocks —
the engine then decodes it plainly, so a small draft budget costs speed, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minienv.kv.block_table import pad_block_tables
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.kv.kv_pool import KVPool
from minienv.kv.paged_attention import PagedAttentionBackend, PagedAttentionMetadata
from minienv.model.llama import LlamaModel
from minienv.sampling import Sampler


@dataclass
class DraftInput:
    """One speculating request, as the proposer sees it."""

    request_id: str
    token_ids: Sequence[int]  # every real token so far (prompt + output); the last one is not yet computed
    k: int  # how many tokens to propose (>= 1)
    sampler: Sampler  # the request's sampler: its parameters shape q, its generator draws the drafts


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    probs: np.ndarray | None  # [k, V] the distributions the drafts were drawn from (None when greedy)


class DraftProposer:
    """Proposes tokens with a draft model; see the module docstring."""

    def __init__(self, model: LlamaModel, kv_budget_tokens: int, block_size: int, num_sampled_ids: int):
        self.model = model
        self.kv = KVCacheManager.from_budget(kv_budget_tokens, block_size, enable_prefix_caching=False)
        self.kv_pool = KVPool.for_model(model.config, self.kv.num_blocks * block_size, block_size)
        self.backend = PagedAttentionBackend(self.kv_pool)
        self.num_sampled_ids = num_sampled_ids  # ids past the tokenizer's vocabulary are never proposed
        self.num_forward_calls = 0
        #: what the draft cache holds per request: the real tokens and drafts fed to the draft model
        self.held: dict[str, KVRequest] = {}

    def free(self, request_id: str) -> None:
        """Forget a request (finished, aborted or preempted). Unknown ids are fine: it may never have fit."""
        if self.held.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def _sync(self, seq: DraftInput) -> list[int]:
        """Roll the draft cache back to the common prefix with the real tokens; return the tokens to feed."""
        rid, real = seq.request_id, list(seq.token_ids)
        held = self.held.get(rid)
        if held is not None:
            common = 0
            for a, b in zip(held.all_token_ids, real):  # the zip stops at the shorter: that is the point
                if a != b:
                    break
                common += 1
            common = min(common, len(real) - 1)  # always feed at least the last real token
            if common == 0:
                self.free(rid)
            else:
                self.kv.truncate(rid, common)
                del held.all_token_ids[common:]
                held.num_computed_tokens = min(held.num_computed_tokens, common)
                return real[common:]
        return real

    def _feed(self, rid: str, tokens: list[int]) -> bool:
        """Reserve the draft cache's slots for ``tokens`` after what it holds; False (nothing changed) if full."""
        held = self.held.get(rid)
        if held is None:
            held = KVRequest(rid, list(tokens))
            if self.kv.allocate(held) is None:
                return False
            self.held[rid] = held
            return True
        if self.kv.append_slots(held, len(tokens)) is None:
            return False
        held.all_token_ids.extend(tokens)
        return True

    def propose(self, batch: Sequence[DraftInput]) -> dict[str, Proposal]:
        """Run the draft up to ``max k`` times over the batch; every request that fits gets ``k`` drafts."""
        live: list[DraftInput] = []
        feeds: list[list[int]] = []
        for seq in batch:
            tokens = self._sync(seq)
            if not self._feed(seq.request_id, tokens):
                self.free(seq.request_id)  # no room in the draft's budget: this request decodes plainly
                continue
            live.append(seq)
            feeds.append(tokens)
        drafts: dict[str, list[int]] = {s.request_id: [] for s in live}
        probs: dict[str, list[np.ndarray]] = {s.request_id: [] for s in live}
        step = 0
        while live:
            logits = self._forward(live, feeds)
            nxt_live, nxt_feeds = [], []
            for seq, row in zip(live, logits, strict=True):
                row = row[: self.num_sampled_ids]
                if seq.sampler.params.greedy:
                    token = int(np.argmax(row))
                else:
                    q = seq.sampler.probs(row)
                    # the target's noise for this position: a draft equal to the target's sample is kept
                    token = seq.sampler.coupled_sample(q, len(seq.token_ids) + step)
                    probs[seq.request_id].append(q)
                drafts[seq.request_id].append(token)
                if step + 1 < seq.k:
                    if not self._feed(seq.request_id, [token]):
                        continue  # out of draft blocks mid-run: keep the drafts so far
                    nxt_live.append(seq)
                    nxt_feeds.append([token])
            live, feeds = nxt_live, nxt_feeds
            step += 1
        return {rid: Proposal(toks, np.stack(probs[rid]) if probs[rid] else None) for rid, toks in drafts.items()}

    def _forward(self, seqs: list[DraftInput], feeds: list[list[int]]) -> np.ndarray:
        kv = self.kv
        reqs = [kv.request(s.request_id) for s in seqs]
        query_lens = np.array([len(f) for f in feeds], dtype=np.int64)
        context = np.array([r.num_tokens for r in reqs], dtype=np.int64) - query_lens
        B = kv.block_size
        slots = []
        for r, c, n in zip(reqs, context, query_lens, strict=True):
            pos = np.arange(c, c + n)
            table = np.asarray(r.block_ids, dtype=np.int64)
            slots.append(table[pos // B] * B + pos % B)
        meta = PagedAttentionMetadata(pad_block_tables([r.block_ids for r in reqs]), context, query_lens,
                                      np.concatenate(slots), B)
        self.backend.set_metadata(meta)
        ids = np.fromiter((t for f in feeds for t in f), dtype=np.int64, count=int(query_lens.sum()))
        logits = self.model.forward_step(ids, meta.positions, self.backend,
                                         logits_indices=meta.query_start_loc[1:] - 1)
        for s, r in zip(seqs, reqs):
            held = self.held[s.request_id]
            held.num_computed_tokens = r.num_tokens  # every fed token now has K/V in the draft cache
            kv.commit(held)
        self.num_forward_calls += 1
        return logits
