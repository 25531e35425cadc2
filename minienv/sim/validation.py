"""The simulator against published measurements: each row a number someone measured on a real GPU with vLLM,
the same model, GPU and load run through :func:`~minienv.sim.run.simulate`, and the error.

The measurements were found by searching engine blogs and benchmark write-ups (cited per row); none was used to
set the clock's factors (``DEFAULT_MFU/MBU/OVERHEAD`` were stated before this table was made, and are not tuned
to it). Llama-3.1-8B has Llama-3-8B's shape. Rows whose workload is a concurrency sweep are run as closed loops
(``max_concurrency``) with the published number of prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minienv.sim.run import SimConfig, simulate
from minienv.sim.workloads import make_trace

MUSGRAVE = ("J. Musgrave, 'vLLM throughput-latency sweep on NVIDIA A100' (vLLM 0.23.0, vllm bench serve, random "
            "1024 in / 128 out, --max-concurrency C, C x 20 prompts): "
            "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on")
RAHMAN = ("M. Rahman, Mistral-7B-Instruct-v0.3 on one RTX 4090 with vLLM (256 in / 128 out, 300 prompts, "
          "request rate inf, --max-concurrency sweep): https://mushfiqrahman.dev/?p=1668")
AIMULTIPLE = ("AIMultiple, 'LLM inference engines' (vLLM with FlashInfer, Llama 3.1 8B-Instruct BF16, one H100 80GB, "
              "1,000 ShareGPT prompts offline, gpu_memory_utilization 0.8): https://research.aimultiple.com/"
              "inference-engines")


@dataclass(frozen=True)
class Measurement:
    """One published number and the run that predicts it. ``metric``: a key of the simulation's metrics, or
    ``"itl_tok_s"`` (1000 / median ITL: a lone stream's decode speed), or ``"ratio:C"`` (output throughput at this
    row's concurrency over that at concurrency C)."""

    label: str
    model: str
    gpu: str
    dataset: str
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None
    metric: str
    published: float
    unit: str
    source: str
    gpu_memory_utilization: float = 0.9


MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement("A100-40GB Llama-3-8B, 1 stream: decode speed", "Llama-3-8B", "A100-40GB", "random", 1024, 128,
                20, 1, "itl_tok_s", 75.0, "tok/s", MUSGRAVE),
    Measurement("A100-40GB Llama-3-8B, 8 streams vs 1: throughput gain", "Llama-3-8B", "A100-40GB", "random", 1024,
                128, 160, 8, "ratio:1", 6.6, "x", MUSGRAVE),
    Measurement("RTX 4090 Mistral-7B, 4 streams: output throughput", "Mistral-7B", "RTX-4090", "random", 256, 128,
                300, 4, "output_throughput", 210.0, "tok/s", RAHMAN),
    Measurement("RTX 4090 Mistral-7B, 16 streams: output throughput", "Mistral-7B", "RTX-4090", "random", 256, 128,
                300, 16, "output_throughput", 644.0, "tok/s", RAHMAN),
    Measurement("RTX 4090 Mistral-7B, 48 streams: output throughput", "Mistral-7B", "RTX-4090", "random", 256, 128,
                300, 48, "output_throughput", 1190.0, "tok/s", RAHMAN),
    Measurement("RTX 4090 Mistral-7B, 16 streams: median TTFT", "Mistral-7B", "RTX-4090", "random", 256, 128,
                300, 16, "median_ttft_ms", 97.0, "ms", RAHMAN),
    Measurement("H100 Llama-3-8B, 1,000 ShareGPT prompts at once: output throughput", "Llama-3-8B", "H100-SXM",
                "sharegpt", 0, 0, 1000, None, "output_throughput", 12553.0, "tok/s", AIMULTIPLE, 0.8),
)


def _run(m: Measurement, concurrency: int | None, seed: int) -> dict:
    cfg = SimConfig(model=m.model, gpu=m.gpu, gpu_memory_utilization=m.gpu_memory_utilization)
    trace = make_trace(m.dataset, m.num_prompts if concurrency == m.max_concurrency else 20 * (concurrency or 1),
                       math.inf, seed=seed, max_model_len=8192, input_len=m.input_len or 1024,
                       output_len=m.output_len or 128)
    return simulate(trace, cfg, max_concurrency=concurrency).metrics


def predict(m: Measurement, seed: int = 0) -> float:
    """What the simulator says for the measurement's metric."""
    metrics = _run(m, m.max_concurrency, seed)
    if m.metric == "itl_tok_s":
        return 1000.0 / metrics["median_itl_ms"]
    if m.metric.startswith("ratio:"):
        base = _run(m, int(m.metric.split(":")[1]), seed)
        return metrics["output_throughput"] / base["output_throughput"]
    return float(metrics[m.metric])


def validation_table(seed: int = 0) -> list[dict]:
    """One row per measurement: published, predicted, signed error (predicted / published - 1)."""
    rows = []
    for m in MEASUREMENTS:
        p = predict(m, seed)
        rows.append({"measurement": m.label, "unit": m.unit, "published": m.published, "predicted": p,
                     "error": p / m.published - 1, "source": m.source})
    return rows


def median_abs_error(rows: list[dict]) -> float:
    return float(np.median([abs(r["error"]) for r in rows]))


if __name__ == "__main__":  # python -m minienv.sim.validation
    table = validation_table()
    for r in table:
        print(f"{r['measurement']:<66} {r['published']:>9.1f} {r['predicted']:>9.1f} {r['unit']:<6} "
              f"{r['error']:+7.1%}")
    print(f"median |error| = {median_abs_error(table):.1%}")
