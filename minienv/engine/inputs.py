"""Building one step's model inputs from the scheduler's plan.

The plan lists, in batch order, each scheduled request's new tokens and where they start; the KV manager holds
the blocks it reserved for them. Their pool slots are computed here, once, from the block tables
(:meth:`~minienv.kv.paged_attention.PagedAttentionMetadata.from_tables`). The model wants them flattened: one token array, one :class:`~minienv.kv.paged_attention.PagedAttentionMetadata` (block tables,
context and query lengths, slot mapping) and the rows whose logits are needed — the last token of every chunk
that reaches the end of its request, plus a speculative decode's draft rows. Copy-on-write copies the manager
asked for are applied to the KV pool here, before the step writes into it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from minienv.kv.block_table import pad_block_tables
from minienv.kv.interface import KVManager
from minienv.kv.kv_pool import KVPool
from minienv.kv.paged_attention import PagedAttentionMetadata
from minienv.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    token_ids: np.ndarray  # [N] the step's tokens, chunks concatenated in plan order
    metadata: PagedAttentionMetadata
    sampling: list[int]  # indices into plan.scheduled of the chunks that produce a token
    logits_indices: np.ndarray  # the rows of token_ids whose logits are computed (>= 1 row)
    #: logits rows per sampling chunk, in order: 1, or 1 + its drafts for a speculative decode (verification)
    num_logits: list[int]


def build_step_inputs(plan: SchedulerOutput, kv: KVManager, kv_pool: KVPool) -> StepInputs:
    """The model inputs of one step."""
    sched = plan.scheduled
    kv_pool.copy_blocks(pair for s in sched for pair in s.blocks_to_copy)
    meta = PagedAttentionMetadata.from_tables(
        pad_block_tables([kv.request(s.request_id).block_ids for s in sched]),
        [s.num_computed_tokens for s in sched], [s.num_new_tokens for s in sched], kv.block_size)
    token_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in sched), dtype=np.int64,
                            count=meta.num_tokens)
    sampling = [i for i, s in enumerate(sched) if s.samples]
    num_logits = [1 + sched[i].num_spec_tokens for i in sampling]
    if not sampling:  # every sequence mid-prefill: K/V only; one logits row keeps shapes simple (never sampled)
        return StepInputs(token_ids, meta, sampling, np.zeros(1, dtype=np.int64), num_logits)
    # each sampling chunk's last 1 + drafts rows: chunk i's rows are ends[i] - m_i, ..., ends[i] - 1 (a short list:
    # one or a few rows per sequence, built in Python faster than numpy's calls start)
    ends = meta.query_start_loc[1:].tolist()
    rows = [ends[i] - k for i, m in zip(sampling, num_logits) for k in range(m, 0, -1)]
    return StepInputs(token_ids, meta, sampling, np.array(rows, dtype=np.int64), num_logits)
