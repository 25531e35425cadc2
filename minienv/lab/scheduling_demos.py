"""The scheduling bench of notebook 07: a tiny seeded model, a mixed workload, and readers of what the engine did.

Scheduling depends only on token *counts*, so a tiny random Llama (two layers, vocabulary 128) drives the real
:class:`~minienv.engine.InferenceEngine` in milliseconds per step; the nothing-lost proof is repeated on the bundled
model in the notebook.

* :class:`TokenIds`, :func:`tiny_model` — the model and its tokenizer stand-in (prompts are token ids).
* :func:`mixed_workload` — sixteen seeded requests, prompts ~24 tokens, outputs long-tailed around 16.
* :func:`latency_table` — TTFT / TPOT / end-to-end in steps, mean and p90.
* :func:`step_budget_rows` — what each step spent on decodes and on one request's prefill chunk.
* :func:`preemptions_and_resumes` — the preemptions and resumes an engine recorded, in step order.
* :class:`EngineScene` — the same requests on a fresh engine at each reset, stepped one engine step at a time.
* :func:`time_runs` — wall times of a few engine runs (printed by the notebook, never checked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minienv.engine import InferenceEngine
from minienv.lab.workload import LengthDistribution, WorkloadConfig, generate_workload
from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.sampling import SamplingParams

__all__ = ["TokenIds", "TINY_CONFIG", "tiny_model", "MIXED", "mixed_workload", "latency_table", "StepBudgetRow",
           "step_budget_rows", "SchedulingEvent", "preemptions_and_resumes", "EngineScene", "time_runs"]


class TokenIds:
    """A tokenizer stand-in: prompts are token ids; no end-of-text, so every request makes exactly max_tokens."""

    eos_token_id, vocab_size = None, 128

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f" {i}" for i in ids)


TINY_CONFIG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def tiny_model(seed: int = 0) -> tuple[LlamaModel, TokenIds]:
    """A seeded random two-layer Llama and its :class:`TokenIds` stand-in."""
    return LlamaModel(TINY_CONFIG, random_weights(TINY_CONFIG, seed=seed, scale=0.3)), TokenIds()


#: prompts ~24 tokens (mild spread), outputs long-tailed around 16 (log-normal sigma 1).
MIXED = WorkloadConfig("mixed", LengthDistribution(24.0, 0.5), LengthDistribution(16.0, 1.0))


def mixed_workload(num_requests: int = 16, seed: int = 0, *, rng: np.random.Generator | None = None
                   ) -> tuple[list[int], list[list[int]], list[SamplingParams]]:
    """``(output lengths, prompts as token ids, greedy sampling params)`` of a seeded :data:`MIXED` workload.

    The lengths come from ``seed``; the prompt tokens from ``rng`` (default: a generator seeded with ``seed``), so a
    caller can keep drawing from the same generator afterwards.
    """
    specs = generate_workload(num_requests, MIXED, max_len=160, seed=seed)
    rng = np.random.default_rng(seed) if rng is None else rng
    prompts = [rng.integers(0, TINY_CONFIG.vocab_size, s.prompt_len).tolist() for s in specs]
    params = [SamplingParams(max_tokens=s.output_len, temperature=0) for s in specs]
    return [s.output_len for s in specs], prompts, params


def latency_table(outputs) -> dict[str, float]:
    """Mean and p90 of TTFT, mean TPOT, mean and p90 end-to-end latency, all in engine steps."""
    if not outputs:
        raise ValueError("latency_table needs at least one finished request")
    ttft, tpot, e2e = (np.array([getattr(o.metrics, f"{k}_steps") for o in outputs], dtype=float)
                       for k in ("ttft", "tpot", "e2e"))
    return dict(ttft_mean=ttft.mean(), ttft_p90=np.percentile(ttft, 90), tpot_mean=tpot.mean(),
                e2e_mean=e2e.mean(), e2e_p90=np.percentile(e2e, 90))


@dataclass(frozen=True)
class StepBudgetRow:
    """One step's token budget as spent: decode tokens, the watched request's prefill chunk, the total."""

    step: int
    decode_tokens: int
    chunk: int
    total: int


def step_budget_rows(engine, request_id) -> list[StepBudgetRow]:
    """Step ``engine`` until ``request_id`` has sampled its first token; one row per step taken.

    Raises ``RuntimeError`` if the request is preempted meanwhile (the rows would no longer be one prefill).
    """
    rows = []
    while not engine.output(request_id).token_ids:
        if engine.output(request_id).num_preemptions:
            raise RuntimeError(f"request {request_id} was preempted while prefilling")
        engine.step()
        plan = engine.history[-1].scheduler_output
        mine = plan.by_id().get(request_id)
        rows.append(StepBudgetRow(plan.step, plan.num_decode_tokens, mine.num_new_tokens if mine else 0,
                                  plan.num_scheduled_tokens))
    return rows


@dataclass(frozen=True)
class SchedulingEvent:
    """A preemption (``cached``/``recomputed`` are 0) or a resume, as the engine's history recorded it."""

    step: int
    kind: str  # "preempted" or "resumed"
    request_id: object
    running_after: tuple = ()  # for a preemption: who still runs
    cached: int = 0  # for a resume: prompt+output tokens taken from the prefix cache
    recomputed: int = 0  # for a resume: tokens computed again


def preemptions_and_resumes(engine) -> list[SchedulingEvent]:
    """Every preemption and resume in ``engine.history``, in step order."""
    events = []
    for rec in engine.history:
        plan = rec.scheduler_output
        events += [SchedulingEvent(rec.step, "preempted", rid, tuple(plan.running)) for rid in plan.preempted]
        events += [SchedulingEvent(rec.step, "resumed", s.request_id, (), s.num_cached_tokens, s.num_new_tokens)
                   for s in plan.scheduled if s.is_resume]
    return events


class EngineScene:
    """The same requests on a fresh :class:`~minienv.engine.InferenceEngine` at every :meth:`reset`, stepped one
    engine step at a time (what notebook 07's live timeline drives)."""

    def __init__(self, model, tokenizer, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 **engine_kwargs) -> None:
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        self.model, self.tokenizer, self.engine_kwargs = model, tokenizer, engine_kwargs
        self.prompts, self.params = [list(p) for p in prompts], list(params)
        self.engine = None

    def reset(self, scheduling: str = "continuous"):
        """A new engine with every request added (none run yet); returned and kept as :attr:`engine`."""
        self.scheduling = scheduling
        self.engine = InferenceEngine(self.model, self.tokenizer, scheduling=scheduling, **self.engine_kwargs)
        for p, sp in zip(self.prompts, self.params):
            self.engine.add_request(p, sp)
        return self.engine

    def step(self) -> str | None:
        """One engine step and a caption of it; ``None`` once every request has finished."""
        if self.engine is None:
            raise RuntimeError("call reset() before step()")
        if not self.engine.has_unfinished_requests():
            return None
        self.engine.step()
        s = self.engine.stats
        return f"{self.scheduling}, step {s.num_steps}: {s.num_running} running, {s.num_waiting} waiting"


def time_runs(run, variants: Sequence[tuple[str, str, dict]]) -> list[tuple[str, float, object, list]]:
    """Wall time of ``run(scheduling, **kwargs)`` (which returns ``(engine, outputs)``) for each ``(label,
    scheduling, kwargs)``: ``(label, seconds, engine, outputs)`` rows. Timings are for reading, never for asserting."""
    rows = []
    for label, scheduling, kwargs in variants:
        t0 = time.perf_counter()
        engine, outs = run(scheduling, **kwargs)
        rows.append((label, time.perf_counter() - t0, engine, outs))
    return rows
