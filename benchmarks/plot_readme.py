"""The README's two pictures, drawn from the JSON lines the benchmarks print (never from typed-in numbers).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/bench_kv_memory.py > kv_memory.out
    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engine.py --rounds 3 > engine.out
    .venv/bin/python benchmarks/plot_readme.py kv_memory.out engine.out      # writes assets/measured_*.png

Each input is a benchmark's output; its last line is the JSON this script reads. The PNGs are exported with the
same exporter as the notebooks' static images (`minienv.viz.static`); without a browser it stops with the reason
instead of writing nothing silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.viz import static  # noqa: E402

SCHEMES = (("orca_max", "reserve max length<br>(Orca Max)"), ("orca_pow2", "reserve next power of 2<br>(Orca Pow2)"),
           ("orca_oracle", "reserve exact output<br>(Orca Oracle)"), ("paged", "paged, block 16<br>(vLLM / minienv)"))


def last_json(path: Path) -> dict:
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{path}: no JSON line (is it a benchmark's output?)")
    return json.loads(lines[-1])


def kv_memory_figure(result: dict):
    import plotly.graph_objects as go

    ours, paper = result["token_states_pct"], result["paper_token_states_pct"]
    labels = [label for _, label in SCHEMES]
    fig = go.Figure([
        go.Bar(name="minienv (bench_kv_memory.py)", x=labels, y=[ours[k] for k, _ in SCHEMES], marker_color="#4e79a7",
               text=[f"{ours[k]:.1f} %" for k, _ in SCHEMES], textposition="outside"),
        go.Bar(name="vLLM paper, Figure 2", x=labels, y=[paper[k] for k, _ in SCHEMES], marker_color="#bab0ac",
               text=[f"{paper[k]:.1f} %" for k, _ in SCHEMES], textposition="outside")])
    fig.update_layout(title="KV memory holding real tokens (ShareGPT-like, 1,000 requests)", barmode="group",
                      yaxis=dict(title="% of KV memory", range=[0, 110]), width=760, height=380,
                      legend=dict(orientation="h", y=-0.28), margin=dict(t=50, b=110))
    return fig


def batching_figure(result: dict):
    import plotly.graph_objects as go

    workloads = result["continuous_vs_static"]["workloads"]
    names = [w["name"].replace(" (means / 4)", "") for w in workloads.values()]
    fig = go.Figure([
        go.Bar(name="fewer model calls (deterministic)", x=names,
               y=[w["model_calls_ratio"] for w in workloads.values()], marker_color="#59a14f",
               text=[f"{w['model_calls_ratio']:.2f}×" for w in workloads.values()], textposition="outside"),
        go.Bar(name=f"tokens/s, paired over {result['rounds']} rounds (this CPU)", x=names,
               y=[w["throughput_ratio"] for w in workloads.values()], marker_color="#4e79a7",
               text=[f"{w['throughput_ratio']:.2f}×" for w in workloads.values()], textposition="outside")])
    fig.add_hline(y=1, line_dash="dot", line_color="#888")
    fig.update_layout(title="Continuous vs static batching, 48 requests each (same outputs)", barmode="group",
                      yaxis=dict(title="continuous ÷ static", range=[0, 3.4]), width=760, height=380,
                      legend=dict(orientation="h", y=-0.18), margin=dict(t=50, b=80))
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kv_memory_output", type=Path, help="the output of bench_kv_memory.py")
    ap.add_argument("engine_output", type=Path, help="the output of bench_engine.py")
    ap.add_argument("--out-dir", type=Path, default=REPO / "assets")
    args = ap.parse_args(argv)
    kv, engine = last_json(args.kv_memory_output), last_json(args.engine_output)
    if kv.get("benchmark") != "bench_kv_memory" or engine.get("benchmark") != "bench_engine":
        raise SystemExit("expected bench_kv_memory's output, then bench_engine's")
    for name, fig in (("measured_kv_memory.png", kv_memory_figure(kv)),
                      ("measured_batching.png", batching_figure(engine))):
        png = static.png_bytes(fig)
        if png is None:
            raise SystemExit(f"no PNG exporter here: {static.exporter_problem() or 'the export failed'}")
        (args.out_dir / name).write_bytes(png)
        print(f"wrote {args.out_dir / name} ({len(png):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
