"""The ceiling an engine is measured against: the model's forward pass over one fixed batch, with nothing around it.

:func:`bare_greedy` generates ``n_new`` greedy tokens for every prompt of a batch in the tightest loop this numpy
model allows — one batched ``forward_step`` per token, dense per-sequence K/V (:class:`DenseBatchDecode`), an
``argmax`` per row — and no engine: no scheduler, no block tables, no paging, no sampler, no detokenizer, no
outputs, no invariant checks, no admission or preemption. Whatever an engine adds to serve real traffic costs on
top of this, so its tokens/s is an upper bound for *any* engine running this model with numpy, and its BLAS share
is the largest a profile of such an engine can show. ``bench_engine.py`` part 3 times it next to the engine and
``transformers``; ``profile_engine.py --run ceiling`` samples it.

It computes the same logits as the engine to float32 rounding (the same model code; only the attention's K/V
live in a padded dense array instead of blocks), and its greedy tokens are checked against the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minienv.kv.paged_attention import batched_attention, hidden_bias
from minienv.model import LlamaModel, causal_attention


class DenseBatchDecode:
    """An attention backend for a fixed batch of S sequences: per layer, K and V in ``[S, T_max, Hkv, D]`` arrays
    (each sequence's keys contiguous from slot 0), the strongest dense layout for numpy's batched matmul.
    (minienv's own :class:`~minienv.model.kv_cache.ContiguousBatch` attends each sequence on its own, a loop of S
    calls per layer: a fair cache for ``generate``, too slow to bound an engine that batches attention.)

    The first step is the prefill (every prompt, flattened, each attended causally on its own); every later step
    is one decode token per sequence, written at slot ``lens[i]`` and attended over the first ``max(lens) + 1``
    slots with an additive mask hiding each shorter sequence's padding.
    """

    def __init__(self, model: LlamaModel, prompt_lens: Sequence[int], max_len: int):
        c = model.config
        shape = (c.num_hidden_layers, len(prompt_lens), max_len, c.num_key_value_heads, c.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.prompt_lens = [int(n) for n in prompt_lens]
        self.lens = np.zeros(len(prompt_lens), dtype=np.int64)  # keys cached per sequence before this step
        self.rows = np.arange(len(prompt_lens))
        self._bias: np.ndarray | None = None
        self._num_keys = 0

    def begin_step(self, positions: np.ndarray) -> None:
        if self.lens.any():  # a decode step: every sequence gains one key
            self._num_keys = int(self.lens.max()) + 1
            seen = np.arange(self._num_keys) < (self.lens + 1)[:, None]
            self._bias = None if seen.all() else hidden_bias(~seen[:, None, :])

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if not self.lens.any():  # the prefill: each prompt on its own, causal
            out = np.empty_like(q)
            start = 0
            for i, n in enumerate(self.prompt_lens):
                kc[i, :n], vc[i, :n] = k[start:start + n], v[start:start + n]
                out[start:start + n] = causal_attention(q[start:start + n], kc[i, :n], vc[i, :n], np.arange(n))
                start += n
            return out
        kc[self.rows, self.lens], vc[self.rows, self.lens] = k, v
        t = self._num_keys
        return batched_attention(q[:, None], kc[:, :t], vc[:, :t], bias=self._bias)[:, 0]

    def end_step(self) -> None:
        self.lens += np.array(self.prompt_lens) if not self.lens.any() else 1


def bare_greedy(model: LlamaModel, prompts: Sequence[Sequence[int]], n_new: int) -> list[list[int]]:
    """``n_new`` greedy tokens per prompt, the whole batch in lockstep: 1 prefill step + ``n_new - 1`` decodes."""
    lens = [len(p) for p in prompts]
    backend = DenseBatchDecode(model, lens, max(lens) + n_new)
    ids = np.fromiter((t for p in prompts for t in p), dtype=np.int64)
    positions = np.concatenate([np.arange(n) for n in lens])
    logits = model.forward_step(ids, positions, backend, logits_indices=np.cumsum(lens) - 1)
    out = np.empty((len(prompts), n_new), dtype=np.int64)
    for step in range(n_new):
        out[:, step] = tokens = logits.argmax(axis=-1)
        if step + 1 < n_new:
            logits = model.forward_step(tokens, backend.lens.copy(), backend)
    return out.tolist()


# ------------------------------------------------------------------------------------------ a continuous run's
@dataclass(frozen=True)
class TracedStep:
    """One engine step as the model saw it: the chunks it ran (request, first position, tokens), the requests
    that finished after it, and the token each sampling chunk produced (to check a replay against)."""

    chunks: tuple[tuple[str, int, tuple[int, ...]], ...]  # (request id, num_computed_tokens, token ids)
    samples: tuple[bool, ...]  # per chunk: its last row gives a token
    sampled: tuple[int, ...]  # the engine's token for each sampling chunk, in order
    finished: tuple[str, ...]


def trace_of(history) -> list[TracedStep]:
    """The steps of an engine run from its ``history`` (an engine built with ``history_size`` >= its steps)."""
    steps = []
    for record in history:
        sched = record.scheduler_output.scheduled
        steps.append(TracedStep(tuple((s.request_id, s.num_computed_tokens, tuple(s.token_ids)) for s in sched),
                                tuple(s.samples for s in sched),
                                tuple(record.sampled[s.request_id] for s in sched if s.samples),
                                tuple(record.finished)))
    return steps


@dataclass
class SlotStep:
    """A traced step laid out for :class:`DenseSlots`, computed before the replay's clock starts: the model's
    inputs, the prefill chunks ``(row, first token, tokens, first position)``, and the decode batch (token rows,
    slot rows, positions, the rows ``[0, hi)`` it spans, its key count and length mask)."""

    ids: np.ndarray
    positions: np.ndarray
    logits_rows: np.ndarray
    samples: bool
    chunks: list[tuple[int, int, int, int]]
    dec_tok: np.ndarray
    dec_row: np.ndarray
    dec_pos: np.ndarray
    hi: int = 0
    num_keys: int = 0
    bias: np.ndarray | None = None


def slot_steps(steps: list[TracedStep], num_slots: int) -> list[SlotStep]:
    """Lay out a traced run on ``num_slots`` dense rows: each request holds the lowest free row from its first
    chunk until it finishes (a static cache with slots). All the bookkeeping of the replay, done up front."""
    row_of: dict[str, int] = {}
    free = list(range(num_slots))
    out = []
    for step in steps:
        for rid, _, _ in step.chunks:
            if rid not in row_of:
                row_of[rid] = free.pop(0)
        chunks, dec_tok, dec_row, dec_pos = [], [], [], []
        t = 0
        for rid, ctx, toks in step.chunks:
            if len(toks) == 1 and ctx > 0:
                dec_tok.append(t), dec_row.append(row_of[rid]), dec_pos.append(ctx)
            else:
                chunks.append((row_of[rid], t, len(toks), ctx))
            t += len(toks)
        ends = np.cumsum([len(toks) for _, _, toks in step.chunks]) - 1
        samples = any(step.samples)
        ss = SlotStep(np.fromiter((t for _, _, toks in step.chunks for t in toks), dtype=np.int64),
                      np.concatenate([np.arange(ctx, ctx + len(toks)) for _, ctx, toks in step.chunks]),
                      ends[list(step.samples)] if samples else ends[:1], samples, chunks,
                      np.array(dec_tok, dtype=np.int64), np.array(dec_row, dtype=np.int64),
                      np.array(dec_pos, dtype=np.int64))
        if dec_row:
            ss.hi, ss.num_keys = max(dec_row) + 1, max(dec_pos) + 1
            seen = np.ones(ss.hi, dtype=np.int64)  # rows not decoding this step: key 0 only (their output dropped)
            seen[ss.dec_row] = ss.dec_pos + 1
            hidden = np.arange(ss.num_keys)[None, :] >= seen[:, None]
            ss.bias = hidden_bias(hidden[:, None, :]) if hidden.any() else None
        out.append(ss)
        for rid in step.finished:
            free.append(row_of.pop(rid))
        free.sort()
    return out


class DenseSlots:
    """An attention backend that replays a continuous run with dense caches: ``S`` slot rows of ``[T_max, Hkv, D]``
    per layer (:func:`slot_steps` assigns them). A step's decodes attend as one batch over rows ``[0, hi)`` — a
    view, no copy — with an additive mask for each row's length; prefill chunks attend one by one, causally, over
    their own row. No block tables, no gather, no per-step bookkeeping (:attr:`step` was laid out beforehand)."""

    def __init__(self, model: LlamaModel, num_slots: int, max_len: int):
        c = model.config
        shape = (c.num_hidden_layers, num_slots, max_len, c.num_key_value_heads, c.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.step: SlotStep | None = None

    def begin_step(self, positions: np.ndarray) -> None:
        pass

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        st = self.step
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        out = np.empty_like(q)
        for row, t, n, ctx in st.chunks:  # prefill chunks: causal over their own row
            kc[row, ctx:ctx + n], vc[row, ctx:ctx + n] = k[t:t + n], v[t:t + n]
            out[t:t + n] = causal_attention(q[t:t + n], kc[row, :ctx + n], vc[row, :ctx + n], np.arange(ctx, ctx + n))
        if st.hi:
            kc[st.dec_row, st.dec_pos], vc[st.dec_row, st.dec_pos] = k[st.dec_tok], v[st.dec_tok]
            qs = np.zeros((st.hi, 1) + q.shape[1:], dtype=np.float32)
            qs[st.dec_row, 0] = q[st.dec_tok]
            o = batched_attention(qs, kc[:st.hi, :st.num_keys], vc[:st.hi, :st.num_keys], bias=st.bias)
            out[st.dec_tok] = o[st.dec_row, 0]
        return out

    def end_step(self) -> None:
        pass


def replay(model: LlamaModel, steps: list[SlotStep], num_slots: int, max_len: int) -> list[list[int]]:
    """Run a traced continuous run's steps (laid out by :func:`slot_steps`) through the model with
    :class:`DenseSlots` and a bare ``argmax``: the same tokens at the same positions, step for step, with nothing of
    the engine. Returns each step's greedy tokens (one per sampling chunk), to compare with ``TracedStep.sampled``."""
    backend = DenseSlots(model, num_slots, max_len)
    out = []
    for st in steps:
        backend.step = st
        logits = model.forward_step(st.ids, st.positions, backend, logits_indices=st.logits_rows)
        out.append(logits.argmax(axis=-1).tolist() if st.samples else [])
    return out


# The continuous-batching run that profile_engine.py samples and bench_engine.py part 4 times against its replay.
CONTINUOUS = dict(kv_budget_tokens=8192, max_num_seqs=16, max_num_batched_tokens=512)


def continuous_run(model: LlamaModel, tok, seed: int = 0, history_size: int | None = None,
                   attention_kernel: str = "auto"):
    """An engine loaded with the continuous run's 48 seeded requests (prompts of 16-64 random tokens, 16-128 greedy
    tokens each, end-of-text ignored), not yet run: ``engine.run()`` runs it. The engine's defaults otherwise
    (its step history on, as served); ``history_size`` large enough keeps every step (for :func:`trace_of`)."""
    from minienv.engine import InferenceEngine
    from minienv.sampling import SamplingParams

    kw = {} if history_size is None else {"history_size": history_size}
    engine = InferenceEngine(model, tok, **kw, **CONTINUOUS, attention_kernel=attention_kernel)
    engine.eos_token_id = None
    rng = np.random.default_rng(seed)
    for _ in range(48):
        prompt = rng.integers(1, tok.vocab_size, int(rng.integers(16, 64))).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(16, 128)), temperature=0))
    return engine


def traced_continuous_run(model: LlamaModel, tok, seed: int = 0) -> list[TracedStep]:
    """Run :func:`continuous_run` once, keeping every step, and return its trace."""
    engine = continuous_run(model, tok, seed, history_size=1 << 20)
    engine.run()
    return trace_of(engine.history)
