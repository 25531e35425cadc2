"""Serving over gRPC: routing across instances, a load test, serving overhead, and a crash mid-run.

    .venv/bin/python benchmarks/bench_serving.py            # a few minutes
    .venv/bin/python benchmarks/bench_serving.py --quick    # small: correctness, not figures

Every server is a real ``python -m minienv serve`` process on 127.0.0.1 (started by
:func:`minienv.serving.launch`, fresh for every measured run so no prefix cache carries over); every client is
:class:`minienv.serving.Client`; loads are closed loops of client threads (:mod:`minienv.serving.loadgen`).

**(a) Routing.** A workload of ``--system-prompts`` shared system prompts (~6 blocks each), each request one of them
plus its own short question, 8 greedy tokens, 16 client threads, with 1, 2 and 4 instances whose KV budget
(``--kv-budget-tokens``, 1024 = 64 blocks) cannot hold every system prompt beside the running requests. Three
policies (``--quick``: the first two): round robin (gRPC's own ``round_robin`` policy over one channel);
prefix-aware routing (the chain hash of the first two full blocks picks the instance; the least-loaded one when
that instance has 8 requests in flight — the servers' ``--max-num-seqs``, below which a request is batched at
once, not queued — and twice the others' mean); and prefix routing with no load fallback. Reported per setting:
prefix-cache hit rate (prompt tokens served from cache / prompt tokens, from the servers' final messages) and
throughput (output tokens/s and requests/s, from the min and median wall time over the rounds). Round robin shows
every instance every system prompt; prefix routing shows each instance only its share, so its cache can hold
them.

**(b) Load test.** ``--load-requests`` requests (default 1024) of mixed prompt lengths and ``max_tokens``, from 64
client threads to one instance; ~10 % cancelled after 1-3 chunks, ~10 % with a deadline of 20-300 ms. Checked:
nothing lost (every request ends completed, cancelled or with a status code), every completed greedy output equal
to the in-process engine's for the same prompt, every cancelled or expired stream a prefix of it, no KV block in
use afterwards. Reported: counts per outcome, client-side p50/p99 time to first token and end-to-end latency.

**(c) Serving overhead.** The load's plain requests (no cancel, no deadline; ``--overhead-requests`` of them) run
by the in-process engine (``InferenceEngine.generate``, all at once) and over gRPC, with a chunk per token and a
chunk per 4 tokens (``--stream-interval 4``: fewer, larger messages; not with ``--quick``), each on one fresh
instance with the same engine options and 3 x ``max_num_seqs`` client streams (enough that requests always
wait, so the server steps the same schedule — the step counts are reported —, few enough that the client process
takes little of the cores), in interleaved rounds in the harness's balanced order. Two figures, each from the min and the
median round: wall tokens/s (overhead = 1 - gRPC / in-process), and the CPU time per token of the engine's process
(this one in-process; the server's, from ``/proc``, over gRPC), split into the server's engine thread and its other
threads, with the client process's beside it. On a shared machine the wall figure moves with whatever the
neighbours run; the CPU per token is the serving cost itself (gRPC, protobuf, GIL hand-offs).

**(d) Kill one instance mid-run.** 3 instances (2 with ``--quick``), 4 running requests each and more waiting;
when the first instance runs its maximum and has requests waiting, it is killed (SIGKILL). Requests it had not
started must be retried on another instance (gRPC's retry policy for ``UNAVAILABLE`` under round robin, the
client's failover under prefix routing) and complete there; those it was streaming end with ``UNAVAILABLE``.
Checked and reported for both routings.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _common import add_common_args, emit_json, print_settings, rounds_of, schedule, settle  # noqa: E402

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.serving import Client, PrefixRouter, launch  # noqa: E402
from minienv.serving.loadgen import (Job, LoadResult, latency_summary, mixed_jobs, run_load,  # noqa: E402
                                     shared_prefix_jobs)

ENGINE_ARGS = {"kv_budget_tokens": 8192, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 512}


def serve_args(kv_budget_tokens: int, max_num_seqs: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--kv-budget-tokens", str(kv_budget_tokens), "--max-num-seqs", str(max_num_seqs), "--max-waiting", "256",
            "--grace", "1", *extra]


def wait_idle(client: Client, timeout: float = 10.0) -> dict[str, list[int]]:
    """Per instance [blocks in use, running, waiting], once all are 0 or at ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        infos = {a: [i.num_blocks_in_use, i.num_running, i.num_waiting] for a, i in client.server_infos().items()}
        if all(v == [0, 0, 0] for v in infos.values()) or time.monotonic() > end:
            return infos
        time.sleep(0.05)


def reference_outputs(jobs: list[Job]) -> dict[tuple, tuple[int, ...]]:
    """(prompt, max_tokens) -> the in-process engine's greedy output ids."""
    keys = sorted({(j.prompt, j.max_tokens) for j in jobs})
    engine = InferenceEngine(**ENGINE_ARGS)
    outs = engine.generate([p for p, _ in keys], [SamplingParams(max_tokens=m, temperature=0.0) for _, m in keys])
    return {k: tuple(o.token_ids) for k, o in zip(keys, outs, strict=True)}


def check_outputs(jobs: list[Job], result: LoadResult, want: dict) -> int:
    """Mismatches: a completed output different from the engine's, or a cut-short one that is not its prefix."""
    bad = 0
    for o in result.outcomes:
        ref = want[(jobs[o.index].prompt, jobs[o.index].max_tokens)]
        if o.status == "completed":
            bad += o.completion.token_ids != ref or o.token_ids != ref
        else:
            bad += o.token_ids != ref[:len(o.token_ids)]
    return bad


# ---------------------------------------------------------------------------------------------- (a) routing
#: the routing variants: how a Client is built for each (name -> routing, router factory or None)
ROUTINGS = {
    "round_robin": ("round_robin", None),
    # gives way to the least-loaded instance from 8 in flight (the servers' --max-num-seqs) and 2x the others' mean
    "prefix": ("prefix", lambda: PrefixRouter(prefix_blocks=2, overload_min=8)),
    # affinity only: never overloaded (what the load fallback costs and buys)
    "prefix_no_fallback": ("prefix", lambda: PrefixRouter(prefix_blocks=2, overload_factor=float("inf"))),
}


def bench_routing(args, rounds: int) -> dict:
    jobs = shared_prefix_jobs(args.routing_requests, args.system_prompts, max_tokens=8, seed=args.seed)
    out: dict = {}
    print(f"\n(a) routing: {len(jobs)} requests over {args.system_prompts} system prompts, 16 client threads, "
          f"per instance --kv-budget-tokens {args.kv_budget_tokens} --max-num-seqs 8; {rounds} rounds")
    print(f"{'instances':>9} {'routing':>18} {'hit rate':>9} {'tok/s min-t':>12} {'tok/s med':>10} "
          f"{'req/s med':>10}  requests per instance (last round)")
    for n in args.instances:
        # one instance: every policy is the same; --quick: the two policies the lesson compares
        names = list(ROUTINGS) if n > 1 and not args.quick else ["round_robin", "prefix"]
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for order in schedule(names, rounds, seed=args.seed):
            for name in order:
                settle()
                routing, make_router = ROUTINGS[name]
                with launch(n, serve_args(args.kv_budget_tokens, 8), cwd=REPO) as cluster, \
                        Client(cluster.addresses, routing=routing,
                               router=make_router() if make_router else None) as client:
                    client.wait_until_serving()
                    result = run_load(client, jobs, concurrency=16, time_limit=args.time_limit)
                    done = result.completed()
                    assert not result.lost and len(done) == len(jobs), (result.counts, result.lost)
                    runs[name].append({
                        "wall": result.wall_s, "tokens": result.output_tokens,
                        "hit": sum(o.completion.cached_tokens for o in done) / sum(o.completion.prompt_tokens
                                                                                   for o in done),
                        "per": [sum(o.completion.address == a for o in done) for a in cluster.addresses],
                        "decisions": dict(client.router.decisions) if client.router is not None else None})
        for name, rs in runs.items():
            walls = [r["wall"] for r in rs]
            tokens = rs[0]["tokens"]
            assert all(r["tokens"] == tokens for r in rs)  # greedy: the same outputs every round
            hit = statistics.median(r["hit"] for r in rs)
            row = {"hit_rate": round(hit, 4), "hit_rates": [round(r["hit"], 4) for r in rs],
                   "tokens_per_s_min_time": round(tokens / min(walls), 1),
                   "tokens_per_s_median": round(tokens / statistics.median(walls), 1),
                   "requests_per_s_median": round(len(jobs) / statistics.median(walls), 2),
                   "requests_per_instance_last_round": rs[-1]["per"]}
            if rs[-1]["decisions"] is not None:
                row["router_decisions_last_round"] = rs[-1]["decisions"]
            out[f"{n}x_{name}"] = row
            print(f"{n:>9} {name:>18} {hit:>9.1%} {row['tokens_per_s_min_time']:>12.1f} "
                  f"{row['tokens_per_s_median']:>10.1f} {row['requests_per_s_median']:>10.2f}  {rs[-1]['per']}"
                  + (f"  router: {rs[-1]['decisions']}" if rs[-1]["decisions"] is not None else ""))
    return out


# ---------------------------------------------------------------------------------------------- (b) load
def bench_load(args, jobs: list[Job], want: dict) -> dict:
    print(f"\n(b) load test: {len(jobs)} requests from 64 client threads to 1 instance "
          f"(engine {ENGINE_ARGS}), time limit {args.time_limit:g} s")
    with launch(1, serve_args(ENGINE_ARGS["kv_budget_tokens"], ENGINE_ARGS["max_num_seqs"]), cwd=REPO) as cluster, \
            Client(cluster.addresses) as client:
        client.wait_until_serving()
        result = run_load(client, jobs, concurrency=64, time_limit=args.time_limit)
        left = wait_idle(client)
    mismatches = check_outputs(jobs, result, want)
    lat = latency_summary(result.outcomes)
    counts = dict(result.counts)
    ended = sum(counts.values())
    print(f"requests {len(jobs)}: {counts}; lost {len(result.lost)}, not started {len(result.not_started)}; "
          f"outputs != in-process engine: {mismatches}; [blocks in use, running, waiting] after: {left}")
    print(f"TTFT p50 {lat['ttft_p50_s'] * 1e3:.1f} ms, p99 {lat['ttft_p99_s'] * 1e3:.1f} ms; end-to-end p50 "
          f"{lat['e2e_p50_s'] * 1e3:.1f} ms, p99 {lat['e2e_p99_s'] * 1e3:.1f} ms; wall {result.wall_s:.1f} s, "
          f"{result.output_tokens / result.wall_s:.1f} tokens/s")
    ok = (not result.lost and not result.not_started and ended == len(jobs) and mismatches == 0
          and all(v == [0, 0, 0] for v in left.values())
          and set(counts) <= {"completed", "cancelled", "DEADLINE_EXCEEDED"})
    return {"requests": len(jobs), "outcomes": counts, "cancelled": counts.get("cancelled", 0),
            "deadline_exceeded": counts.get("DEADLINE_EXCEEDED", 0), "lost": len(result.lost),
            "not_started": len(result.not_started), "output_mismatches": mismatches, "kv_after": left,
            **{k: round(v, 5) for k, v in lat.items()}, "wall_s": round(result.wall_s, 2),
            "tokens_per_s": round(result.output_tokens / result.wall_s, 1), "ok": ok}


# ---------------------------------------------------------------------------------------------- (c) overhead
def process_cpu_s(pid: int, stat: str | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (or of the task whose ``stat`` file is given) so far (Linux
    ``/proc``; nan elsewhere)."""
    import os

    try:
        fields = Path(stat or f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def thread_cpu_s(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of process ``pid`` so far (Linux ``/proc``; {} elsewhere)."""
    import os

    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            out[int(tid)] = process_cpu_s(pid, f"/proc/{pid}/task/{tid}/stat")
    except OSError:
        pass
    return out


#: the overhead part's variants: None runs the engine in-process; a number serves it with that --stream-interval
OVERHEAD_VARIANTS = {"in_process": None, "grpc": 1, "grpc_stream_interval_4": 4}


def bench_overhead(args, plain: list[Job], want: dict, rounds: int) -> dict:
    # max_num_seqs streams keep every batch full only if requests always wait: with 3x that many the server runs
    # the in-process engine's schedule (the step counts are reported; with 1.5x a fast engine outran the clients
    # and ran ~10 % more, smaller steps). Not more: the client process shares the server's cores.
    concurrency = 3 * ENGINE_ARGS["max_num_seqs"]
    print(f"\n(c) serving overhead: {len(plain)} plain requests, in-process engine vs gRPC ({concurrency} client "
          f"streams, 1 instance; a chunk per token, and per 4 tokens: --stream-interval 4); {rounds} interleaved "
          "rounds")
    params = [SamplingParams(max_tokens=j.max_tokens, temperature=0.0) for j in plain]
    tokens = sum(len(want[(j.prompt, j.max_tokens)]) for j in plain)
    variants = {k: v for k, v in OVERHEAD_VARIANTS.items() if not args.quick or v in (None, 1)}  # quick: 2 of 3
    runs: dict[str, list[dict]] = {k: [] for k in variants}  # per round: wall s, CPU s, engine steps
    for order in schedule(list(runs), rounds, seed=args.seed):
        for name in order:
            settle()
            interval = variants[name]
            if interval is None:
                engine = InferenceEngine(**ENGINE_ARGS)
                t0, c0 = time.perf_counter(), time.process_time()
                outs = engine.generate([j.prompt for j in plain], params)
                runs[name].append({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                                   "steps": engine.stats.num_steps})
                assert [tuple(o.token_ids) for o in outs] == [want[(j.prompt, j.max_tokens)] for j in plain]
                continue
            extra = ("--stream-interval", str(interval))
            with launch(1, serve_args(ENGINE_ARGS["kv_budget_tokens"], ENGINE_ARGS["max_num_seqs"], extra),
                        cwd=REPO) as cluster, Client(cluster.addresses) as client:
                client.wait_until_serving()
                pid, steps0 = cluster.servers[0].pid, client.server_info().num_steps
                c0, t0, client0 = process_cpu_s(pid), thread_cpu_s(pid), time.process_time()
                result = run_load(client, plain, concurrency=concurrency, time_limit=args.time_limit)
                cpu, t1, client_cpu = process_cpu_s(pid) - c0, thread_cpu_s(pid), time.process_time() - client0
                # the engine thread does most of the work: the busiest thread of the run is it
                per_thread = sorted((t1[t] - t0.get(t, 0.0) for t in t1), reverse=True) or [float("nan")]
                runs[name].append({"wall": result.wall_s, "cpu": cpu, "engine_thread_cpu": per_thread[0],
                                   "client_cpu": client_cpu,
                                   "steps": client.server_info().num_steps - steps0})
                assert len(result.completed()) == len(plain) and check_outputs(plain, result, want) == 0
    stats: dict[str, dict] = {}
    for k, rs in runs.items():
        walls, cpus = [r["wall"] for r in rs], [r["cpu"] for r in rs]
        st = stats[k] = {"tokens_per_s_min_time": tokens / min(walls),
                         "tokens_per_s_median": tokens / statistics.median(walls),
                         "cpu_ms_per_token_min": 1e3 * min(cpus) / tokens,
                         "cpu_ms_per_token_median": 1e3 * statistics.median(cpus) / tokens,
                         "steps": [r["steps"] for r in rs]}
        print(f"{k:>22}: {tokens} tokens in {st['steps']} steps; {st['tokens_per_s_min_time']:.1f} tokens/s (min "
              f"time), {st['tokens_per_s_median']:.1f} (median); CPU of the engine's process "
              f"{st['cpu_ms_per_token_min']:.3f} ms/token (min), {st['cpu_ms_per_token_median']:.3f} (median)")
        if variants[k] is not None:  # the split: the engine thread's own CPU, every other thread's
            eng = [r["engine_thread_cpu"] for r in rs]
            rest = [r["cpu"] - r["engine_thread_cpu"] for r in rs]
            st.update({"engine_thread_cpu_ms_per_token_min": 1e3 * min(eng) / tokens,
                       "engine_thread_cpu_ms_per_token_median": 1e3 * statistics.median(eng) / tokens,
                       "other_threads_cpu_ms_per_token_min": 1e3 * min(rest) / tokens,
                       "other_threads_cpu_ms_per_token_median": 1e3 * statistics.median(rest) / tokens,
                       "client_cpu_ms_per_token_median": 1e3 * statistics.median(r["client_cpu"] for r in rs) / tokens})
            print(f"{'':>24}split: engine thread {st['engine_thread_cpu_ms_per_token_min']:.3f} ms/token (min), "
                  f"{st['engine_thread_cpu_ms_per_token_median']:.3f} (median); all other threads (gRPC, protobuf) "
                  f"{st['other_threads_cpu_ms_per_token_min']:.3f} (min), "
                  f"{st['other_threads_cpu_ms_per_token_median']:.3f} (median); the client process (this one, on "
                  f"the same cores) {st['client_cpu_ms_per_token_median']:.3f} (median)")
    ip = stats["in_process"]
    overheads = {}
    for k in (k for k, v in variants.items() if v is not None):
        g = stats[k]
        o = overheads[k] = {
            "wall_min_time": 1 - g["tokens_per_s_min_time"] / ip["tokens_per_s_min_time"],
            "wall_median": 1 - g["tokens_per_s_median"] / ip["tokens_per_s_median"],
            "cpu_per_token_min": g["cpu_ms_per_token_min"] / ip["cpu_ms_per_token_min"] - 1,
            "cpu_per_token_median": g["cpu_ms_per_token_median"] / ip["cpu_ms_per_token_median"] - 1,
            "engine_thread_cpu_per_token_min": g["engine_thread_cpu_ms_per_token_min"] / ip["cpu_ms_per_token_min"] - 1,
            # the same work? a server whose clients lag runs more, smaller steps (more CPU for the same tokens)
            "extra_steps_median": statistics.median(g["steps"]) / statistics.median(ip["steps"]) - 1}
        print(f"overhead of {k} (target <= 10 %): {o['wall_min_time']:.1%} fewer tokens/s (min times), "
              f"{o['wall_median']:.1%} (median times); the server's CPU per token {o['cpu_per_token_min']:+.1%} "
              f"(min), {o['cpu_per_token_median']:+.1%} (median) over the in-process engine's — of which the engine "
              f"thread {o['engine_thread_cpu_per_token_min']:+.1%} (min; it shares the cores with the client process "
              f"and the server's other threads); engine steps {o['extra_steps_median']:+.1%} (median)")
    return {"requests": len(plain), "tokens": tokens, "client_streams": concurrency,
            **{k: {m: (round(v, 4) if isinstance(v, float) else v) for m, v in st.items()} for k, st in stats.items()},
            "overhead": {k: {m: round(v, 4) for m, v in o.items()} for k, o in overheads.items()}}


# ---------------------------------------------------------------------------------------------- (d) kill
KILL_ATTEMPTS = 3


def _kill_once(args, routing: str, n: int, jobs: list, max_num_seqs: int):
    """One run of (d) on a fresh cluster: SIGKILL instance 0 once it runs ``max_num_seqs`` with requests waiting."""
    with launch(n, serve_args(4096, max_num_seqs), cwd=REPO) as cluster, \
            Client(cluster.addresses, routing=routing) as client:
        client.wait_until_serving()
        victim, holder = cluster.servers[0], []
        # 8 in flight per instance: 4 running and 4 waiting each, so the victim has requests it has not started.
        load = threading.Thread(target=lambda: holder.append(run_load(client, jobs, concurrency=8 * n,
                                                                      time_limit=args.time_limit)))
        load.start()
        end, mid_run, waiting = time.monotonic() + 60, False, 0
        while time.monotonic() < end and load.is_alive():
            info = client.server_info(victim.address)
            if info.num_running == max_num_seqs and info.num_waiting >= 1:
                mid_run, waiting = True, info.num_waiting
                break
            time.sleep(0.005)
        victim.kill()
        load.join(args.time_limit + 30)
        survivors = [s.address for s in cluster.servers[1:]]
        with Client(survivors) as rest:
            left = wait_idle(rest)
    return mid_run, waiting, holder[0], left, survivors, victim


def bench_kill(args, routing: str, n: int, want_fn) -> dict:
    max_num_seqs = 4
    jobs = [Job(f"Scene {i}. " + "Friends, Romans, countrymen, lend me your ears. " * (1 + i % 4), 64)
            for i in range(12 * n)]
    want = want_fn(jobs)
    # The kill must land while the victim runs its maximum with requests waiting, or it tests no failover. On a
    # busy machine the run can end (or the balancer can favour the other instances) before the victim gets there:
    # such an attempt is repeated on a fresh cluster, at most KILL_ATTEMPTS times, and reported.
    for attempt in range(1, KILL_ATTEMPTS + 1):
        mid_run, waiting, result, left, survivors, victim = _kill_once(args, routing, n, jobs, max_num_seqs)
        if mid_run:
            break
    failed = [o for o in result.outcomes if o.status != "completed"]
    done = result.completed()
    mismatches = check_outputs(jobs, result, want)
    mid_stream = sum(o.status == "UNAVAILABLE" and o.num_chunks > 0 for o in failed)
    on_survivors = sum(o.completion.address in survivors for o in done)
    print(f"{routing:>12}, {n} instances, {len(jobs)} requests: killed {victim.address} running {max_num_seqs} with "
          f"{waiting} waiting; completed {len(done)} ({on_survivors} on the survivors), failed {len(failed)} "
          f"({mid_stream} UNAVAILABLE mid-stream: {sorted({o.details[:60] for o in failed})}), "
          f"lost {len(result.lost)}, outputs != engine {mismatches}, survivors after: {left}"
          + (f" (attempt {attempt}: the kill came too late in the runs before)" if attempt > 1 else ""))
    if not mid_run:
        print(f"  in {KILL_ATTEMPTS} attempts the victim never ran its maximum with requests waiting: the kill did not "
              "test failover")
    ok = (mid_run and not result.lost and mismatches == 0 and mid_stream == len(failed) <= max_num_seqs
          and all(v == [0, 0, 0] for v in left.values()))
    return {"instances": n, "requests": len(jobs), "attempts": attempt, "killed_mid_run": mid_run,
            "victim_waiting_at_kill": waiting,
            "completed": len(done), "completed_on_survivors": on_survivors, "failed_unavailable_mid_stream": mid_stream,
            "failed_other": len(failed) - mid_stream, "lost": len(result.lost), "output_mismatches": mismatches,
            "ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, rounds=3)
    ap.add_argument("--instances", type=int, nargs="+", default=None,
                    help="routing: instance counts (default 1 2 4; quick 2)")
    ap.add_argument("--system-prompts", type=int, default=16)
    ap.add_argument("--routing-requests", type=int, default=None, help="routing workload size (192; quick 32)")
    ap.add_argument("--kv-budget-tokens", type=int, default=1024, help="per instance, routing part (default 1024)")
    ap.add_argument("--parts", default="routing,load,overhead,kill",
                    help="which parts to run, comma-separated (default: all: routing,load,overhead,kill)")
    ap.add_argument("--load-requests", type=int, default=None, help="load test size (1024; quick 96)")
    ap.add_argument("--overhead-requests", type=int, default=None, help="overhead workload (256; quick 32)")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds a load may take before the rest is lost")
    args = ap.parse_args()
    rounds = rounds_of(args)
    args.instances = args.instances or ([2] if args.quick else [1, 2, 4])
    args.routing_requests = args.routing_requests or (32 if args.quick else 192)
    args.load_requests = args.load_requests or (96 if args.quick else 1024)
    args.overhead_requests = args.overhead_requests or (32 if args.quick else 256)
    settings = print_settings()
    t_start = time.perf_counter()

    parts = set(args.parts.split(","))
    if not parts <= {"routing", "load", "overhead", "kill"}:
        ap.error(f"--parts takes routing, load, overhead, kill; got {args.parts!r}")
    result: dict = {"benchmark": "bench_serving", "quick": args.quick, "rounds": rounds}
    checks: list[bool] = []
    if "routing" in parts:
        result["routing"] = bench_routing(args, rounds)
    if parts & {"load", "overhead"}:
        jobs = mixed_jobs(args.load_requests, seed=args.seed)
        plain = [j for j in jobs if j.cancel_after is None and j.deadline is None][:args.overhead_requests]
        want = reference_outputs(jobs if "load" in parts else plain)
        if "load" in parts:
            result["load"] = bench_load(args, jobs, want)
            checks.append(result["load"]["ok"])
        if "overhead" in parts:
            result["overhead"] = bench_overhead(args, plain, want, rounds)
    if "kill" in parts:
        print("\n(d) kill one instance mid-run (SIGKILL)")
        n_kill = 2 if args.quick else 3
        result["kill"] = {r: bench_kill(args, r, n_kill, reference_outputs) for r in ("round_robin", "prefix")}
        checks += [k["ok"] for k in result["kill"].values()]

    ok = all(checks)
    print(f"\nall checks {'passed' if ok else 'FAILED'} in {time.perf_counter() - t_start:.0f} s")
    result["ok"] = ok
    emit_json(result, settings)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
