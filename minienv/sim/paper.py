"""The vLLM paper's serving result, re-run in shape on the GPU clock (Kwon et al., SOSP '23, §6.2, Fig. 12).

The paper serves OPT-13B on one A100-40GB with ShareGPT and Alpaca traces at rising Poisson request rates and
plots *normalized latency* (each request's end-to-end latency divided by its output length, averaged; s/token)
for vLLM against three Orca variants that reserve each request's future contiguously (Max, Pow2, Oracle; see
:mod:`minienv.sim.reservation`). A system's *capacity* is the rate it sustains before the latency curve turns up;
the paper reports vLLM sustaining 1.7-2.7x the rate of Orca (Oracle) and 2.7-8x Orca (Max) at the same latency.

Here every system is minienv's engine with a different KV layout or scheduler, on the same roofline clock and
the same seeded trace; capacity is the highest rate whose normalized latency stays under ``threshold``
(interpolated linearly between the two sweep points around it).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from minienv.sim.run import SimConfig, simulate
from minienv.sim.workloads import make_trace

#: label -> the SimConfig fields that make the system
SYSTEMS: dict[str, dict] = {
    "vLLM (paged)": {"kv_layout": "paged"},
    "Orca (Oracle)": {"kv_layout": "reserve-oracle"},
    "Orca (Pow2)": {"kv_layout": "reserve-pow2"},
    "Orca (Max)": {"kv_layout": "reserve-max"},
    "static batching": {"scheduling": "static"},
}
PAPER = {"model": "OPT-13B", "gpu": "A100-40GB", "max_num_batched_tokens": 2560}


def sweep(dataset: str, rates: Sequence[float], *, num_prompts: int = 300, seed: int = 0,
          systems: dict[str, dict] | None = None, block_size: int = 16, **overrides) -> dict[str, list[float]]:
    """Normalized latency (s/token) of each system at each rate: ``{label: [latency per rate]}``."""
    systems = SYSTEMS if systems is None else systems
    base = {**PAPER, "block_size": block_size, **overrides}
    out: dict[str, list[float]] = {name: [] for name in systems}
    for rate in rates:
        trace = make_trace(dataset, num_prompts, rate, seed=seed, max_model_len=2048)
        for name, fields in systems.items():
            m = simulate(trace, SimConfig(**{**base, **fields})).metrics
            out[name].append(m["normalized_latency_s_per_token"])
    return out


def capacity(rates: Sequence[float], latencies: Sequence[float], threshold: float) -> float:
    """The highest request rate with normalized latency <= ``threshold`` (linear between sweep points); 0 if even
    the lowest rate is over it, the highest rate if none is."""
    rates, lat = list(rates), list(latencies)
    if lat[0] > threshold:
        return 0.0
    for i in range(1, len(rates)):
        if lat[i] > threshold:
            f = (threshold - lat[i - 1]) / (lat[i] - lat[i - 1])
            return rates[i - 1] + f * (rates[i] - rates[i - 1])
    return rates[-1]


def factors(rates: Sequence[float], curves: dict[str, list[float]], threshold: float,
            reference: str = "vLLM (paged)") -> dict[str, float]:
    """Capacity of ``reference`` over each other system's (inf when the other sustains none of the rates)."""
    caps = {name: capacity(rates, lat, threshold) for name, lat in curves.items()}
    return {name: (caps[reference] / c if c else math.inf) for name, c in caps.items() if name != reference}


if __name__ == "__main__":  # python -m minienv.sim.paper: the full sweep (a few minutes)
    import json

    for dataset, rates in (("sharegpt", [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0]),
                           ("alpaca", [5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0])):
        curves = sweep(dataset, rates, num_prompts=400 if dataset == "sharegpt" else 1000)
        print(json.dumps({"dataset": dataset, "rates": rates, "curves": curves,
                          "factors_at_0.1s_per_token": factors(rates, curves, 0.1)}))
        for name, lat in curves.items():
            print(f"{dataset:<9} {name:<16} " + " ".join(f"{x:7.3f}" for x in lat))
