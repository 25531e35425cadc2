"""Speculative decoding, side by side with plain decoding: acceptance, target calls per token, wall-clock speed.

    .venv/bin/python benchmarks/bench_spec_decode.py [--rounds 3] [--max-tokens 64] [--ks 1,2,3,4,5,6,7,8]

For k = 1 … 8 draft tokens, two proposers (the bundled draft model; n-gram prompt lookup with n in 1..3) and two
tasks — **free** Shakespeare continuation (8 play openings) and an **input-grounded** one (the answer is already
in the prompt, see :func:`grounded_prompts`: where prompt lookup shines) — greedy, every
request generating exactly ``--max-tokens`` tokens (end-of-text ignored), in two batch shapes: one request at a
time (latency: where speculation is meant to pay) and all 8 together (throughput). Reported per row:

* the acceptance rate (kept / proposed drafts), the conditional rate α (kept / drafts actually judged: a draft
  after a rejection is never judged) and the fraction of verifications that kept each draft position;
* the mean acceptance length (tokens emitted per verification) beside the i.i.d. prediction
  ``(1 - α^(k+1)) / (1 - α)`` — real acceptances are not independent across positions (easy stretches accept
  runs, hard ones reject early), so the two differ;
* target-model calls (engine steps) per generated token of one stream: 1.0 for plain decoding;
* tokens/s relative to plain decoding in the same round (min and median over interleaved rounds).

Every speculative output is checked equal to the plain one (greedy speculation must not change a token).
BLAS is pinned to one thread; each round runs plain and every configuration once, on a fresh engine, in the
harness's seeded, balanced order (``benchmarks/_common.py``). Ends with exactly one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

from _common import add_common_args, emit_json, print_settings, rounds_of, schedule, settle  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.model import load_model  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.tokenizer import load_tokenizer  # noqa: E402

FREE = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "MACBETH:\nTo-morrow, and to-morrow, and to-morrow,",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "PORTIA:\nThe quality of mercy is not strain'd,",
    "MARK ANTONY:\nFriends, Romans, countrymen, lend me your ears;",
    "PROSPERO:\nOur revels now are ended. These our actors,",
]


def grounded_prompts(model, tok, max_tokens: int) -> list[str]:
    """Input-grounded: each play opening, the target's own greedy continuation of it, a blank line, and the
    opening again — the answer to the repeated question is already in the prompt (a user pasting an earlier reply
    back, an edit of a draft, code completion in a file that holds the pattern). Prompt lookup can find it."""
    e = InferenceEngine(model, tok, kv_budget_tokens=16384, history_size=0)
    e.eos_token_id = None
    conts = [o.text for o in e.generate(FREE, SamplingParams(max_tokens=max_tokens, temperature=0))]
    return [p + c + "\n\n" + p for p, c in zip(FREE, conts, strict=True)]


def run(model, tok, prompts, max_tokens, batch, spec):
    """Generate; returns (seconds, outputs, engine steps, spec stats or None)."""
    e = InferenceEngine(model, tok, kv_budget_tokens=16384, block_size=16, max_num_seqs=16, history_size=0,
                        speculative_config=spec)
    e.eos_token_id = None  # exactly max_tokens per request
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += [o.token_ids for o in e.generate(prompts[i:i + batch], sp)]
    dt = time.perf_counter() - t0
    return dt, outs, e.stats.num_steps, (e.speculator.stats if e.speculator else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--ks", default=None, help="draft lengths (default 1,...,8; 2 with --quick)")
    add_common_args(ap, rounds=3)
    args = ap.parse_args()
    rounds = rounds_of(args)
    settings = print_settings()
    ks = [int(k) for k in (args.ks or ("2" if args.quick else "1,2,3,4,5,6,7,8")).split(",")]
    max_tokens = args.max_tokens or (8 if args.quick else 64)
    free = FREE[:3] if args.quick else FREE
    model, tok = load_model(), load_tokenizer()
    run(model, tok, FREE[:2], 8, 2, None)  # warm-up
    rows = []
    for task, prompts in (("free", free), ("grounded", grounded_prompts(model, tok, max_tokens)[:len(free)])):
        for batch in (1, len(prompts)):
            configs = [(m, k) for m in ("draft", "ngram") for k in ks]
            times = {c: [] for c in configs}
            plain_times = []
            measured = {}
            for order in schedule(["plain", *configs], rounds, args.seed):  # interleaved, balanced order
                for c in order:
                    settle()
                    if c == "plain":
                        dt, ref_r, plain_steps, _ = run(model, tok, prompts, max_tokens, batch, None)
                        plain_times.append(dt)
                        ref = ref_r
                        continue
                    m, k = c
                    dt, outs, steps, st = run(model, tok, prompts, max_tokens, batch,
                                              {"method": m, "num_speculative_tokens": k})
                    times[c].append(dt)
                    measured[c] = (steps, st, outs)
            for c, (_, _, outs) in measured.items():  # plain is deterministic: every round's output is the same
                if outs != ref:
                    raise SystemExit(f"greedy speculation changed the output ({task}, {c[0]}, k={c[1]})")
            n_tokens = len(prompts) * max_tokens
            streams = len(prompts) / batch  # plain: steps ~ streams * max_tokens (+ prefills)
            for (m, k), ts in times.items():
                steps, st, _ = measured[(m, k)]
                a = st.conditional_acceptance_rate
                predicted = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
                ratios = [p / t for p, t in zip(plain_times, ts, strict=True)]
                rows.append({
                    "task": task, "batch": batch, "method": m, "k": k,
                    "acceptance_rate": round(st.acceptance_rate, 3),
                    "conditional_acceptance": round(a, 3),
                    "acceptance_per_pos": [round(x / st.num_drafts, 3) if st.num_drafts else 0.0
                                           for x in st.accepted_per_pos],
                    "mean_acceptance_length": round(st.mean_acceptance_length, 3),
                    "iid_prediction": round(predicted, 3),
                    "target_calls_per_token": round(steps / (n_tokens / batch / streams) / streams, 3),
                    "plain_calls_per_token": round(plain_steps / (n_tokens / batch / streams) / streams, 3),
                    "speed_vs_plain_min": round(min(ratios), 3),
                    "speed_vs_plain_median": round(statistics.median(ratios), 3),
                })
            print(f"\n{task}, batch {batch}: plain {n_tokens} tokens in {min(plain_times):.3f} s (min), "
                  f"{plain_steps} target calls")
            print(f"{'method':>6} {'k':>2} {'rate':>6} {'alpha':>6} {'len':>5} {'iid':>5} {'calls/tok':>9} {'speed min':>9} "
                  f"{'median':>6}  per-position acceptance")
            for r in rows:
                if r["task"] == task and r["batch"] == batch:
                    print(f"{r['method']:>6} {r['k']:>2} {r['acceptance_rate']:>6.3f} {r['conditional_acceptance']:>6.3f} "
                          f"{r['mean_acceptance_length']:>5.2f} {r['iid_prediction']:>5.2f} "
                          f"{r['target_calls_per_token']:>9.3f} {r['speed_vs_plain_min']:>9.3f} "
                          f"{r['speed_vs_plain_median']:>6.3f}  {r['acceptance_per_pos']}")
    emit_json({"benchmark": "spec_decode", "rounds": rounds, "max_tokens": max_tokens, "quick": args.quick,
               "blas_threads": BLAS_THREADS, "rows": rows}, settings)


if __name__ == "__main__":
    main()
