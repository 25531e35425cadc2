"""minienv.lab.scheduling_demos: notebook 07's bench and the readers of what the engine recorded."""

from __future__ import annotations

import numpy as np
import pytest

from minienv.engine import InferenceEngine
from minienv.lab.scheduling_demos import (EngineScene, latency_table, mixed_workload, preemptions_and_resumes,
                                          step_budget_rows, time_runs, tiny_model)
from minienv.sampling import SamplingParams


@pytest.fixture(scope="module")
def bench():
    model, tok = tiny_model(seed=0)
    return model, tok


def test_mixed_workload_is_seeded_and_keeps_drawing_from_the_callers_generator():
    lens, prompts, params = mixed_workload(8, seed=0)
    again = mixed_workload(8, seed=0)
    assert (lens, prompts) == (again[0], again[1]) and len(prompts) == len(params) == 8
    assert [p.max_tokens for p in params] == lens and all(p.temperature == 0 for p in params)
    rng = np.random.default_rng(0)
    _, shared_rng_prompts, _ = mixed_workload(8, seed=0, rng=rng)
    assert shared_rng_prompts == prompts  # same draws as the default generator ...
    assert rng.integers(0, 128, 4).tolist() == np.random.default_rng(0).integers(0, 128, 10_000)[
        sum(map(len, prompts)):sum(map(len, prompts)) + 4].tolist()  # ... and the caller's generator moved on


def test_latency_table_in_steps(bench):
    model, tok = bench
    lens, prompts, params = mixed_workload(6, seed=1)
    engine = InferenceEngine(model, tok, kv_budget_tokens=2048, block_size=8, max_num_seqs=2)
    outs = engine.generate(prompts, params)
    table = latency_table(outs)
    assert table["tpot_mean"] == 1.0  # every running request decodes every step
    assert table["ttft_mean"] == np.mean([o.metrics.ttft_steps for o in outs])
    assert table["ttft_p90"] >= table["ttft_mean"] and table["e2e_p90"] >= table["e2e_mean"] > 0
    with pytest.raises(ValueError, match="at least one"):
        latency_table([])


def test_step_budget_rows_read_the_plan_of_each_step(bench):
    model, tok = bench
    rng = np.random.default_rng(1)
    engine = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    for _ in range(3):
        engine.add_request(rng.integers(0, 128, 6).tolist(), SamplingParams(max_tokens=14, temperature=0))
    engine.run(max_steps=2)
    long_id = engine.add_request(rng.integers(0, 128, 100).tolist(), SamplingParams(max_tokens=3, temperature=0))
    rows = step_budget_rows(engine, long_id)
    assert [r.chunk for r in rows] == [29, 29, 29, 13]
    assert all(r.decode_tokens == 3 and r.total == r.decode_tokens + r.chunk <= 32 for r in rows)
    assert engine.output(long_id).token_ids and [r.step for r in rows] == [2, 3, 4, 5]  # steps 0, 1 came before


def test_preemptions_and_resumes_pair_up(bench):
    model, tok = bench
    rng = np.random.default_rng(2)
    tight = InferenceEngine(model, tok, kv_budget_tokens=128, block_size=8, max_num_seqs=5, max_num_batched_tokens=64)
    tight.generate([rng.integers(0, 128, 24).tolist() for _ in range(5)], SamplingParams(max_tokens=24, temperature=0))
    events = preemptions_and_resumes(tight)
    pre = [e for e in events if e.kind == "preempted"]
    res = [e for e in events if e.kind == "resumed"]
    assert len(pre) == len(res) == tight.stats.num_preemptions > 0
    assert [e.step for e in events] == sorted(e.step for e in events)
    for p in pre:  # each preemption comes before its request's resume, and the victim is no longer running
        assert p.request_id not in p.running_after
        assert any(r.request_id == p.request_id and r.step > p.step for r in res)
    assert sum(r.cached for r in res) <= tight.stats.prefix_cache_hits_tokens


def test_engine_scene_replays_the_same_requests(bench):
    model, tok = bench
    lens, prompts, params = mixed_workload(5, seed=3)
    scene = EngineScene(model, tok, prompts, params, kv_budget_tokens=2048, block_size=8, max_num_seqs=2)
    with pytest.raises(RuntimeError, match="reset"):
        scene.step()
    steps = {}
    for mode in ("static", "continuous", "static"):
        scene.reset(mode)
        captions = []
        while (c := scene.step()) is not None:
            captions.append(c)
        assert captions[0].startswith(f"{mode}, step 1: ") and len(captions) == scene.engine.stats.num_steps
        assert scene.engine.stats.num_generated_tokens == sum(lens)  # every request, every token, each time
        assert steps.setdefault(mode, len(captions)) == len(captions)  # a reset replays exactly
    assert steps["continuous"] <= steps["static"]
    with pytest.raises(ValueError, match="sampling params"):
        EngineScene(model, tok, prompts, params[:-1])


def test_time_runs_returns_one_row_per_variant(bench):
    model, tok = bench
    _, prompts, params = mixed_workload(3, seed=4)

    def run(scheduling, **kw):
        engine = InferenceEngine(model, tok, scheduling=scheduling, kv_budget_tokens=1024, block_size=8, **kw)
        return engine, engine.generate(prompts, params)

    rows = time_runs(run, [("s", "static", {}), ("c", "continuous", {})])
    assert [r[0] for r in rows] == ["s", "c"] and all(r[1] > 0 and len(r[3]) == 3 for r in rows)
