"""Several ``python -m minienv serve`` instances behind one client: a small load test and a crash mid-run.

What must hold (correctness only, never timings): under load with cancellations and deadlines, every request ends
— completed, cancelled or with a status code — and none is lost; completed greedy outputs equal the in-process
engine's, a cancelled stream's tokens are a prefix of them; no block stays in use afterwards. When an instance is
killed mid-run, requests it had not started are retried on another instance (gRPC's retry policy under round
robin, the client's failover under prefix routing) and complete there; only those it was streaming fail, with
``UNAVAILABLE`` after some output.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from minienv.engine import InferenceEngine
from minienv.sampling import SamplingParams
from minienv.serving import Client, launch
from minienv.serving.loadgen import Job, mixed_jobs, run_load

REPO = Path(__file__).resolve().parents[2]
KV = 4096


@pytest.fixture(scope="module")
def reference():
    engine = InferenceEngine(kv_budget_tokens=KV)
    cache: dict = {}

    def run(jobs):
        """The in-process greedy output ids of each job (computed once per (prompt, max_tokens))."""
        todo = sorted({(j.prompt, j.max_tokens) for j in jobs} - set(cache))
        if todo:
            outs = engine.generate([p for p, _ in todo], [SamplingParams(max_tokens=m, temperature=0.0)
                                                          for _, m in todo])
            cache.update({key: tuple(o.token_ids) for key, o in zip(todo, outs, strict=True)})
        return [cache[(j.prompt, j.max_tokens)] for j in jobs]

    return run


def _assert_idle(client: Client, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while True:
        infos = {a: (i.num_blocks_in_use, i.num_running, i.num_waiting) for a, i in client.server_infos().items()}
        if all(v == (0, 0, 0) for v in infos.values()):
            return
        assert time.monotonic() < end, f"blocks in use / running / waiting left after the run: {infos}"
        time.sleep(0.05)


@pytest.mark.parametrize("routing", ["round_robin", "prefix"])
def test_a_small_load_loses_nothing_and_serves_the_engines_output(reference, routing):
    jobs = mixed_jobs(96, seed=1, cancel_fraction=0.15, deadline_fraction=0.15)
    want = reference(jobs)
    with launch(2, ["--kv-budget-tokens", str(KV), "--max-waiting", "64", "--grace", "1"], cwd=REPO) as cluster, \
            Client(cluster.addresses, routing=routing) as client:
        client.wait_until_serving()
        result = run_load(client, jobs, concurrency=24, time_limit=120)
        assert result.lost == [] and result.not_started == []
        assert len(result.outcomes) == len(jobs)
        assert set(result.counts) <= {"completed", "cancelled", "DEADLINE_EXCEEDED"}, result.counts
        assert result.counts["completed"] > len(jobs) // 2 and result.counts["cancelled"] > 0
        for o in result.outcomes:
            job, ids = jobs[o.index], want[o.index]
            if o.status == "completed":
                assert o.completion.token_ids == o.token_ids == ids, job
                assert o.completion.address in cluster.addresses
            else:  # cancelled or past its deadline: what arrived is the start of the engine's output
                assert o.token_ids == ids[:len(o.token_ids)], job
            if o.status == "DEADLINE_EXCEEDED":
                assert job.deadline is not None
        assert {o.completion.address for o in result.completed()} == set(cluster.addresses)
        _assert_idle(client)


@pytest.mark.parametrize("routing", ["round_robin", "prefix"])
def test_killing_an_instance_mid_run_retries_what_it_had_not_started(reference, routing):
    max_num_seqs = 2
    jobs = [Job(f"Scene {i}. " + "Friends, Romans, countrymen, lend me your ears. " * (1 + i % 3), 150)
            for i in range(16)]
    want = reference(jobs)
    with launch(2, ["--kv-budget-tokens", str(KV), "--max-num-seqs", str(max_num_seqs)], cwd=REPO) as cluster, \
            Client(cluster.addresses, routing=routing) as client:
        client.wait_until_serving()
        victim = cluster.servers[0]
        results: list = []
        load = threading.Thread(target=lambda: results.append(run_load(client, jobs, concurrency=16,
                                                                       time_limit=120)))
        load.start()
        end = time.monotonic() + 30
        while True:  # kill it once it runs some requests and has more waiting
            info = client.server_info(victim.address)
            if info.num_running == max_num_seqs and info.num_waiting >= 1:
                break
            assert time.monotonic() < end and load.is_alive(), "the victim never had requests waiting"
            time.sleep(0.01)
        victim.kill()
        load.join(150)
        result = results[0]
        assert result.lost == [] and len(result.outcomes) == len(jobs)
        failed = [o for o in result.outcomes if o.status != "completed"]
        # Only what the victim was streaming fails: at most its running requests, each after some output.
        assert len(failed) <= max_num_seqs, [(o.status, o.details) for o in failed]
        for o in failed:
            assert o.status == "UNAVAILABLE" and o.num_chunks > 0 and "went away" in o.details, o
        survivor = cluster.servers[1].address
        done = result.completed()
        assert len(done) == len(jobs) - len(failed) >= len(jobs) - max_num_seqs
        assert all(o.completion.token_ids == want[o.index] for o in done)
        assert sum(o.completion.address == survivor for o in done) > sum(o.completion.address == victim.address
                                                                         for o in done)
        with Client(survivor) as alone:
            _assert_idle(alone)


def test_stopping_a_cluster_drains_every_instance_to_a_clean_exit():
    """LocalCluster.stop sends each instance one SIGTERM: each drains and exits 0. (A second SIGTERM, sent while an
    instance was already exiting, killed it mid-exit with status -15.)"""
    statuses, logs = [], []
    for _ in range(3):
        cluster = launch(3, ["--kv-budget-tokens", "256", "--grace", "1"], cwd=REPO)
        for s in cluster.servers:
            s.terminate()  # as LocalCluster.stop does, but keep each log for the failure message
        statuses.append([s.stop() for s in cluster.servers])
        logs += [f"--- {s.address} exit {s.proc.returncode}:\n{s.log()[-2000:]}" for s in cluster.servers
                 if s.proc.returncode != 0]
        cluster.stop()
    assert statuses == [[0, 0, 0]] * 3, "\n".join(logs)
