"""Seeded synthetic request traces shaped like the datasets vLLM's ``benchmark_serving`` replays — no network.

The vLLM paper (Kwon et al., SOSP '23, §6.1 and Fig. 11) reports its two traces' length statistics under the OPT
tokenizer: ShareGPT prompts average 161.31 tokens and outputs 337.99 (long, heavy-tailed conversations); Alpaca
prompts average 19.31 and outputs 58.45 (short instructions). We draw both from log-normal distributions whose
*means match those reported means* (``mu = ln(mean) - sigma^2 / 2``); the spread ``sigma`` is a choice, made to
give the wide, right-skewed histograms of the paper's Fig. 11 — the raw datasets were not fitted. Both
distributions are :mod:`minienv.lab.workload`'s (``SHAREGPT``, ``ALPACA``: one definition for the notebooks and
the simulator). Unlike there, lengths are then *filtered* like ``benchmark_serving``'s ShareGPT loader: prompt and
output >= 4 tokens, prompt <= 1024, prompt + output <= the model's context (redrawn, so the means shift a little;
:func:`describe` prints what a trace really holds). ``random`` is fixed lengths, like its ``--dataset-name random``.

Arrivals are a Poisson process of ``rate`` requests/s (exponential gaps), or all at time 0 for ``inf``.
Prompt tokens are random ids, so two prompts share a block only when a shared prefix is asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minienv.lab.workload import ALPACA, SHAREGPT
from minienv.sim.simulated_model import SIM_VOCAB

SHAPES = {"sharegpt": SHAREGPT, "alpaca": ALPACA}
DATASETS = ("sharegpt", "alpaca", "random")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def lengths(dataset: str, n: int, rng: np.random.Generator, max_model_len: int, *, input_len: int = 1024,
            output_len: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) lengths of ``dataset``, filtered like ``benchmark_serving`` (see the module doc)."""
    if dataset == "random":
        if input_len + output_len > max_model_len:
            raise ValueError(f"--random-input-len {input_len} + --random-output-len {output_len} exceeds the "
                             f"model's context of {max_model_len} tokens")
        return np.full(n, input_len), np.full(n, output_len)
    if dataset not in SHAPES:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    shape = SHAPES[dataset]
    ps: list[int] = []
    os_: list[int] = []
    while len(ps) < n:
        k = 2 * (n - len(ps)) + 16
        p, o = shape.prompt.sample(rng, k), shape.output.sample(rng, k)
        ok = (p >= 4) & (o >= 4) & (p <= 1024) & (p + o <= max_model_len)
        ps.extend(p[ok].tolist())
        os_.extend(o[ok].tolist())
    return np.array(ps[:n]), np.array(os_[:n])


def make_trace(dataset: str, num_prompts: int, request_rate: float, *, seed: int = 0, max_model_len: int = 2048,
               input_len: int = 1024, output_len: int = 128, shared_prefix_len: int = 0,
               num_prefixes: int = 1) -> list[TraceRequest]:
    """A seeded trace: lengths from ``dataset``, Poisson arrivals at ``request_rate`` (``inf``: all at 0).

    ``shared_prefix_len`` > 0 puts one of ``num_prefixes`` common prefixes (a system prompt, few-shot examples) of
    that many tokens in front of every prompt (request i gets prefix ``i % num_prefixes``)."""
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts must be an int >= 1, got {num_prompts!r}")
    if not (request_rate > 0):  # also NaN
        raise ValueError(f"request rate must be > 0 requests/s (or inf: all at once), got {request_rate!r}")
    rng = np.random.default_rng(seed)
    # benchmark_serving keeps ShareGPT pairs with prompt + output <= 2048 whatever the model
    cap = max_model_len if dataset == "random" else min(2048, max_model_len)
    p_len, o_len = lengths(dataset, num_prompts, rng, cap - shared_prefix_len, input_len=input_len,
                           output_len=output_len)
    if math.isinf(request_rate):
        arrivals = np.zeros(num_prompts)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, num_prompts))
        arrivals -= arrivals[0]  # the first request arrives at t = 0
    prefixes = [rng.integers(1, SIM_VOCAB, shared_prefix_len).tolist() for _ in range(num_prefixes)]
    ids = rng.integers(1, SIM_VOCAB, int(p_len.sum())).tolist()
    out, at = [], 0
    for i in range(num_prompts):
        n = int(p_len[i])
        out.append(TraceRequest(float(arrivals[i]), prefixes[i % num_prefixes] + ids[at:at + n], int(o_len[i])))
        at += n
    return out


def describe(trace: list[TraceRequest]) -> dict[str, float]:
    """Mean prompt / output lengths of a trace (what the notebook and the CLI print)."""
    return {"mean_prompt_len": float(np.mean([r.prompt_len for r in trace])),
            "mean_output_len": float(np.mean([r.output_len for r in trace]))}
