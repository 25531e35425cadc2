"""Block size 1 … 256 on three traces, the dynamic scheme against the best fixed size, and the auto-tuner's pick.

    .venv/bin/python benchmarks/bench_block_size.py            # 3 interleaved rounds, ~1-2 minutes
    .venv/bin/python benchmarks/bench_block_size.py --quick    # 3 rounds, one quarter-size trace (smoke run)

Each trace (ShareGPT-like long tails, Alpaca-like short outputs, shared system prompts; seeded) is served at every
block size, and with two configurations of the dynamic scheme, through minienv's real scheduler and KV cache
manager with a stub model (``minienv.lab.block_size.simulate``): internal fragmentation, prefix-hit tokens,
preemptions at a fixed budget of 4096 tokens, block-table entries at the peak (and their runs of consecutive ids),
and the scheduler + manager time per step. Attention: one decode step of the real paged-attention kernel
(``kernel="auto"``, the engine's) over 16 of the trace's sequences, laid out by the same manager, per layer.

Timings are taken in interleaved rounds (every configuration once per round, the order rotated) and reported as median (table) and
min (JSON), in process CPU time (steadier than the wall clock on a shared machine). ``J`` = frag + miss +
slowdown (``minienv.lab.block_size.objective``); "work" replaces the CPU
clock by the key reads of the real layouts (deterministic). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

import numpy as np  # noqa: E402
from _common import add_common_args, emit_json, print_settings, rounds_of  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.lab.dynamic_blocks import DynamicBlockConfig  # noqa: E402
from minienv.lab import block_size as bs  # noqa: E402

BUDGET = 4096
DYNAMIC = [bs.DEFAULT_DYNAMIC, DynamicBlockConfig(block_size=4, threshold_tokens=64, run_blocks=16)]
TUNER_MARGIN = 0.05
#: the vLLM paper's §7.2 ranges of good block sizes, and its (and vLLM's) default
PAPER = {"ShareGPT-like": (16, 128), "Alpaca-like": (16, 32)}
VLLM_DEFAULT = 16


def fitted_entry_cost(rows) -> float | None:
    """Key reads one block-table entry costs per step, from the measurements: the slope of scheduler + manager
    time over peak table entries, divided by the attention time per padded key of one layer."""
    fixed = [r for r in rows if r.scheme == "fixed" and r.attn_us is not None]
    if len(fixed) < 3:
        return None
    slope = np.polyfit([r.peak_table_entries for r in fixed], [r.manager_us for r in fixed], 1)[0]
    per_key = float(np.median([r.attn_us / r.extra["padded_keys"] for r in fixed]))
    return float(slope / per_key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, rounds=3)
    args = ap.parse_args()
    rounds = rounds_of(args)
    settings = print_settings()
    traces = bs.standard_traces(scale=0.25 if args.quick else 1.0)[:1 if args.quick else None]
    t0 = time.perf_counter()
    res = bs.sweep(traces, BUDGET, bs.BLOCK_SIZES, dynamic=DYNAMIC, rounds=rounds)
    elapsed = time.perf_counter() - t0
    print(f"block-size sweep: budget {BUDGET} tokens, {rounds} interleaved round(s), {elapsed:.0f} s, "
          f"BLAS threads {BLAS_THREADS}")
    for t in traces:
        s = bs.length_stats(t)
        print(f"  {t.name}: {len(t.requests)} requests, mean prompt {np.mean(s.prompt_lens):.0f}, mean output "
              f"{np.mean(s.output_lens):.0f}, shareable prompt tokens {sum(s.shared_prefix_lens)}")
    print()
    print(bs.format_table(res))

    out_traces = {}
    print("\ndynamic vs the best fixed size (by J, measured CPU time)")
    for t in traces:
        rows = res[t.name]
        obj, obj_w = bs.objective(rows), bs.objective(rows, "work")
        best = bs.best_fixed(rows)
        best_w = bs.best_fixed(rows, "work")
        rec = bs.recommend_block_size(t, BUDGET)
        fixed_obj = {k: v for k, v in obj.items() if isinstance(k, int)}
        fixed_w = {k: v for k, v in obj_w.items() if isinstance(k, int)}
        dyn_rows = [r for r in rows if r.scheme == "dynamic"]
        comparisons = []
        for d in dyn_rows:
            key = bs.row_key(d)
            st_d, st_b = bs.step_time_us(d), bs.step_time_us(best)
            comparisons.append(dict(
                config=key, frag=round(d.frag, 4), best_frag=round(best.frag, 4), hit_tokens=d.hit_tokens,
                best_hit_tokens=best.hit_tokens, preemptions=d.preemptions, best_preemptions=best.preemptions,
                step_us=round(st_d, 1), best_step_us=round(st_b, 1), table_segments=d.peak_table_segments,
                best_table_segments=best.peak_table_segments, runs_cut=d.runs_cut, runs_missed=d.runs_missed,
                J=round(obj[key], 4), best_J=round(obj[best.block_size], 4)))
            print(f"  {t.name:<22} {key:>13} vs B={best.block_size:<3}: frag {100 * d.frag:5.2f} % vs "
                  f"{100 * best.frag:5.2f} %, hits {d.hit_tokens} vs {best.hit_tokens}, preemptions {d.preemptions} "
                  f"vs {best.preemptions}, step {st_d:.0f} vs {st_b:.0f} us, table runs {d.peak_table_segments} vs "
                  f"{best.peak_table_segments}, runs cut/missed {d.runs_cut}/{d.runs_missed}, J {obj[key]:.3f} vs "
                  f"{obj[best.block_size]:.3f}")
        within = fixed_obj[rec.block_size] <= min(fixed_obj.values()) + TUNER_MARGIN
        within_w = fixed_w[rec.block_size] <= min(fixed_w.values()) + TUNER_MARGIN
        rank16 = sorted(fixed_obj, key=fixed_obj.get).index(VLLM_DEFAULT) + 1
        out_traces[t.name] = dict(
            rows=[dict(config=str(bs.row_key(r)), block_size=r.block_size, frag=round(r.frag, 5),
                       hit_tokens=r.hit_tokens, hit_rate=round(r.hit_rate, 4), preemptions=r.preemptions,
                       steps=r.steps, peak_table_entries=r.peak_table_entries,
                       peak_table_segments=r.peak_table_segments, peak_table_bytes=r.peak_table_bytes,
                       attn_us_median=round(r.attn_us, 1), attn_us_min=round(r.extra["attn_us_min"], 1),
                       manager_us_median=round(r.manager_us, 1), manager_us_min=round(r.extra["manager_us_min"], 1),
                       padded_keys=r.extra["padded_keys"], J=round(obj[bs.row_key(r)], 4),
                       J_work=round(obj_w[bs.row_key(r)], 4)) for r in rows],
            best_fixed=best.block_size, best_fixed_work=best_w.block_size, dynamic_vs_best=comparisons,
            tuner=dict(pick=rec.block_size, reasoning=rec.reasoning, within_margin=within,
                       within_margin_work=within_w, J_pick=round(fixed_obj[rec.block_size], 4),
                       J_best=round(min(fixed_obj.values()), 4)),
            vllm_default_rank=rank16, vllm_default_J_gap=round(fixed_obj[VLLM_DEFAULT] - min(fixed_obj.values()), 4),
            paper_range=PAPER.get(t.name), fitted_entry_cost_keys=fitted_entry_cost(rows))

    print(f"\nauto-tuner (margin {TUNER_MARGIN} in J) and vLLM's default {VLLM_DEFAULT}")
    for name, o in out_traces.items():
        tu = o["tuner"]
        paper = o["paper_range"]
        print(f"  {name:<22} tuner {tu['pick']:>3} (J {tu['J_pick']:.3f}; best measured {o['best_fixed']} J "
              f"{tu['J_best']:.3f}; within margin: cpu {tu['within_margin']}, work {tu['within_margin_work']}); "
              f"B=16 ranks {o['vllm_default_rank']} of 9 (J +{o['vllm_default_J_gap']:.3f})"
              + (f"; paper's best range {paper[0]}-{paper[1]}" if paper else "")
              + (f"; fitted entry cost {o['fitted_entry_cost_keys']:.1f} keys" if o['fitted_entry_cost_keys'] else ""))
    result = dict(benchmark="bench_block_size", kv_budget_tokens=BUDGET, rounds=rounds, quick=args.quick,
                  blas_threads=BLAS_THREADS,
                  block_sizes=list(bs.BLOCK_SIZES), entry_cost_keys_default=bs.ENTRY_COST_KEYS,
                  dynamic=[dict(block_size=d.block_size, threshold_tokens=d.threshold_tokens, run_blocks=d.run_blocks)
                           for d in DYNAMIC], tuner_margin=TUNER_MARGIN, seconds=round(elapsed, 1), traces=out_traces)
    emit_json(result, settings)


if __name__ == "__main__":
    main()
