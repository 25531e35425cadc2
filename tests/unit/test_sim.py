"""The GPU clock (minienv.sim): the roofline's arithmetic by hand, bad input, the simulated engine run, the CLI."""

from __future__ import annotations

import json
import math

import pytest

from minienv.kv.interface import KVRequest
from minienv.cli import main
from minienv.sim import ModelDoesNotFitError, RooflineClock, get_gpu, get_model
from minienv.sim.hardware import GIB, GPUSpec
from minienv.sim.models import ModelSpec
from minienv.sim.reservation import ReservationKVManager, next_pow2, reservation_tokens
from minienv.sim.run import SimConfig, simulate
from minienv.sim.workloads import describe, make_trace

TINY = ModelSpec("tiny", num_layers=2, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2, intermediate_size=8,
                 vocab_size=10, max_model_len=64)
UNIT_GPU = GPUSpec("unit", peak_tflops=1e-12, bandwidth_gbs=1e-9, memory_gib=1.0, link_gbs=1e-9, source="test")


# ---------------------------------------------------------------------- the clock's arithmetic, by hand
def test_tiny_model_parameter_count_by_hand():
    # attention 4*4 (q) + 2*4*2 (k, v) + 4*4 (o) = 48; SwiGLU 3*4*8 = 96; two RMSNorms 2*4 = 8
    assert TINY.layer_params == 152
    # 2 layers + embedding 10*4 + untied head 10*4 + final norm 4
    assert TINY.num_params == 2 * 152 + 40 + 40 + 4
    assert TINY.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2  # K and V, 2 layers, 1 KV head, dim 2, 2 bytes


def test_step_cost_by_hand():
    # a GPU of 1 FLOP/s and 1 byte/s, factors 1, no overhead: the times ARE the counts
    clock = RooflineClock(TINY, UNIT_GPU, mfu=1.0, mbu=1.0, overhead_s=0.0)
    cost = clock.step_cost([(3, 0), (1, 5)])  # a 3-token prefill, and a decode after 5 cached tokens
    tokens, keys, rows = 4, (0 + 1 + 2 + 3) + (5 + 1), 2
    flops = 2 * 2 * 152 * tokens + 2 * 4 * 10 * rows + 4 * 2 * 2 * 2 * keys
    weights = (2 * 152 + 40 + 4) * 2  # layers + LM head + final norm, 2 bytes each
    nbytes = weights + 16 * (3 + 6) + 16 * tokens  # read each request's context (incl. new), write the new tokens
    assert (cost.flops, cost.bytes) == (flops, nbytes) == (2976, 904)
    assert cost.compute_s == pytest.approx(2976) and cost.memory_s == pytest.approx(904)
    assert cost.time_s == pytest.approx(2976) and cost.bound == "compute"


def test_efficiency_factors_overhead_and_an_empty_step():
    clock = RooflineClock(TINY, UNIT_GPU, mfu=0.5, mbu=0.25, overhead_s=7.0)
    cost = clock.step_cost([(1, 0)])
    assert cost.compute_s == pytest.approx(cost.flops / 0.5)
    assert cost.memory_s == pytest.approx(cost.bytes / 0.25)
    assert cost.time_s == pytest.approx(max(cost.compute_s, cost.memory_s) + 7.0)
    assert clock.step_cost([]).time_s == 0.0


def test_batch1_decode_is_the_weights_over_the_bandwidth():
    clock = RooflineClock("Llama-3-8B", "H100-SXM", mbu=0.8, overhead_s=0.0)
    m = clock.model
    weights = (m.num_layers * m.layer_params + m.lm_head_params + m.hidden_size) * 2
    assert clock.decode_time(1, 0) == pytest.approx((weights + 2 * m.kv_bytes_per_token) / (3350e9 * 0.8))
    # ~15 GB of weights at 2.68 TB/s: ~5.6 ms; batching 64 streams costs far less than 64x
    assert 5e-3 < clock.decode_time(1, 0) < 6.5e-3
    assert clock.decode_time(64, 512) < 2 * clock.decode_time(1, 512)


def test_published_parameter_counts():
    assert get_model("Llama-3-8B").num_params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert get_model("Llama-3-70B").num_params / 1e9 == pytest.approx(70.55, abs=0.05)
    assert get_model("OPT-13B").num_params / 1e9 == pytest.approx(12.85, abs=0.05)
    assert get_model("Qwen2.5-7B").num_params / 1e9 == pytest.approx(7.62, abs=0.01)
    assert get_model("Llama-2-13B").num_params / 1e9 == pytest.approx(13.02, abs=0.01)
    assert get_model("minienv-target").num_layers == 4  # read from assets/target/config.json


def test_tensor_parallelism_splits_the_work_and_pays_an_all_reduce():
    one = RooflineClock("Llama-3-70B", "H100-SXM", tensor_parallel_size=1).step_cost([(1, 100)] * 8)
    four = RooflineClock("Llama-3-70B", "H100-SXM", tensor_parallel_size=4).step_cost([(1, 100)] * 8)
    assert four.memory_s == pytest.approx(one.memory_s / 4) and four.compute_s == pytest.approx(one.compute_s / 4)
    assert one.comm_s == 0 and four.comm_s > 0


def test_kv_budget_is_what_the_weights_leave():
    clock = RooflineClock("Llama-3-8B", "H100-SXM")
    m = clock.model
    expected = (80 * GIB * 0.9 - m.weight_bytes - 1 * GIB) // m.kv_bytes_per_token
    assert clock.kv_budget_tokens(0.9) == expected
    assert RooflineClock("Llama-3-70B", "H100-SXM", tensor_parallel_size=4).kv_budget_tokens() > 0


# ---------------------------------------------------------------------- bad input
def test_unknown_gpu_and_model_name_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown GPU 'B300'.*H100-SXM"):
        get_gpu("B300")
    with pytest.raises(ValueError, match=r"unknown model 'GPT-5'.*Llama-3-8B"):
        get_model("GPT-5")


def test_a_model_that_does_not_fit_names_both_sizes():
    with pytest.raises(ModelDoesNotFitError) as err:
        RooflineClock("Llama-3-70B", "H100-SXM").kv_budget_tokens()
    msg = str(err.value)
    assert "Llama-3-70B" in msg and "H100-SXM" in msg
    assert "131.4 GiB" in msg and "72.0 GiB" in msg  # the weights, and what the GPU offers


def test_tp_that_does_not_divide_the_heads():
    with pytest.raises(ValueError, match="does not divide"):
        RooflineClock("Llama-3-8B", "H100-SXM", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        RooflineClock("Llama-3-8B", "H100-SXM", tensor_parallel_size=0)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan")])
def test_zero_negative_or_nan_rate_is_refused(rate):
    with pytest.raises(ValueError, match="rate"):
        make_trace("sharegpt", 4, rate)


# ---------------------------------------------------------------------- workloads
def test_traces_are_seeded_and_shaped():
    a, b = make_trace("sharegpt", 500, 2.0, seed=3), make_trace("sharegpt", 500, 2.0, seed=3)
    assert a == b and a != make_trace("sharegpt", 500, 2.0, seed=4)
    d = describe(a)
    assert 100 < d["mean_prompt_len"] < 200 and 250 < d["mean_output_len"] < 400  # the paper: 161 / 338
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048 for r in a)
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and 500 / arrivals[-1] == pytest.approx(2.0, rel=0.15)
    al = describe(make_trace("alpaca", 500, math.inf))
    assert 12 < al["mean_prompt_len"] < 30 and 40 < al["mean_output_len"] < 80  # the paper: 19 / 58


# ---------------------------------------------------------------------- the engine on the clock
def _small(**kw) -> SimConfig:
    return SimConfig(model="Llama-3-8B", gpu="H100-SXM", **kw)


def test_every_request_gets_exactly_its_trace_output_length():
    trace = make_trace("sharegpt", 60, 20.0, seed=1)
    m = simulate(trace, _small()).metrics
    assert m["completed"] == 60 and m["total_output_tokens"] == sum(r.output_len for r in trace)
    assert m["num_steps"] >= max(r.output_len for r in trace)
    assert m["mean_ttft_ms"] > 0 and m["median_itl_ms"] > 0


def test_simulation_is_deterministic_with_a_seed():
    def run(seed):
        m = simulate(make_trace("sharegpt", 40, 10.0, seed=seed), _small()).metrics
        return {k: v for k, v in m.items() if not k.startswith("sim_")}
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_one_stream_decodes_at_the_batch1_roofline():
    trace = make_trace("random", 1, math.inf, input_len=128, output_len=64)
    res = simulate(trace, _small())
    assert res.metrics["median_itl_ms"] == pytest.approx(res.clock.decode_time(1, 128 + 32) * 1e3, rel=0.01)


def test_a_tight_pool_preempts_and_still_finishes_everything():
    trace = make_trace("sharegpt", 120, math.inf, seed=0)
    m = simulate(trace, _small(gpu_memory_utilization=0.22)).metrics  # ~1 GiB of KV
    assert m["num_preemptions"] > 0 and m["completed"] == 120 and m["kv_usage_peak"] > 0.9


def test_reservation_baselines_admit_fewer_and_never_preempt():
    trace = make_trace("sharegpt", 150, math.inf, seed=0, max_model_len=2048)
    cfg = dict(model="OPT-13B", gpu="A100-40GB")
    paged = simulate(trace, SimConfig(**cfg)).metrics
    oracle = simulate(trace, SimConfig(kv_layout="reserve-oracle", **cfg)).metrics
    worst = simulate(trace, SimConfig(kv_layout="reserve-max", **cfg)).metrics
    assert oracle["num_preemptions"] == worst["num_preemptions"] == 0
    assert paged["output_throughput"] > oracle["output_throughput"] > worst["output_throughput"]


def test_reservation_manager_refuses_what_does_not_fit_and_changes_nothing():
    mgr = ReservationKVManager(10, 16, reserve=lambda rid: 100)  # 7 blocks each
    assert mgr.allocate(KVRequest("a", list(range(20)))) is not None and mgr.reserved_blocks == 7
    before = mgr.snapshot()
    assert mgr.allocate(KVRequest("b", list(range(100, 120)))) is None  # 7 + 7 > 10
    assert mgr.snapshot() == before and mgr.reserved_blocks == 7
    mgr.free("a")
    assert mgr.reserved_blocks == 0 and mgr.allocate(KVRequest("b", list(range(100, 120)))) is not None
    assert next_pow2(25) == 32 and reservation_tokens("reserve-pow2", 10, 25, 2048) == 42
    assert reservation_tokens("reserve-max", 10, 25, 2048) == 2048


def test_shared_prefixes_hit_the_cache():
    trace = make_trace("alpaca", 200, 20.0, seed=0, shared_prefix_len=512)
    on = simulate(trace, _small(enable_prefix_caching=True)).metrics
    off = simulate(trace, _small()).metrics
    assert on["prefix_cache_hit_rate"] > 0.8 and off["prefix_cache_hit_rate"] == 0
    assert on["mean_ttft_ms"] < off["mean_ttft_ms"]


def test_static_batching_is_slower_than_continuous_all_at_once():
    trace = make_trace("sharegpt", 200, math.inf, seed=0)
    cont = simulate(trace, _small(max_num_seqs=64)).metrics
    stat = simulate(trace, _small(max_num_seqs=64, scheduling="static")).metrics
    assert stat["output_throughput"] < cont["output_throughput"]


def test_max_concurrency_caps_the_streams():
    trace = make_trace("random", 40, math.inf, input_len=64, output_len=32)
    res = simulate(trace, _small(), max_concurrency=4, keep_steps=True)
    assert res.steps[:, 3].max() == 4



def _client_between_steps(trace, cfg: SimConfig, cap: int) -> dict:
    """A reference benchmark client: step, read the clock, send what has arrived (the listener only charges)."""
    import numpy as np

    from minienv.engine import InferenceEngine
    from minienv.sampling import SamplingParams
    from minienv.sim.simulated_model import SimTokenizer, SimulatedModel

    clock = RooflineClock(cfg.model, cfg.gpu)
    blocks = clock.kv_budget_tokens(cfg.gpu_memory_utilization) // cfg.block_size
    eng = InferenceEngine(SimulatedModel(clock.model.max_model_len), SimTokenizer(), block_size=cfg.block_size,
                          kv_budget_tokens=blocks * cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens, history_size=0)
    now, first, done, sent, arrival = [0.0], {}, {}, 0, [r.arrival_s for r in trace]

    def charge(record):
        plan = record.scheduler_output
        now[0] += clock.step_cost([(s.num_new_tokens, s.num_computed_tokens) for s in plan.scheduled],
                                  sum(s.samples for s in plan.scheduled)).time_s
        for rid in record.sampled:
            first.setdefault(int(rid), now[0])
        for rid in record.finished:
            done[int(rid)] = now[0]
    eng.add_step_listener(charge)
    steps = 0
    while sent < len(trace) or eng.has_unfinished_requests():
        while sent < len(trace) and trace[sent].arrival_s <= now[0] and sent - eng.counters.finished < cap:
            arrival[sent] = max(arrival[sent], now[0])
            eng.add_request(trace[sent].prompt, SamplingParams(max_tokens=trace[sent].output_len, temperature=0.0),
                            request_id=str(sent))
            sent += 1
        if not eng.has_unfinished_requests():
            now[0] = max(now[0], trace[sent].arrival_s)
            continue
        eng.step()
        steps += 1
    ttft = [(first[i] - arrival[i]) * 1e3 for i in range(len(trace))]
    e2e = [(done[i] - arrival[i]) * 1e3 for i in range(len(trace))]
    return {"num_steps": steps, "mean_ttft_ms": float(np.mean(ttft)), "mean_e2el_ms": float(np.mean(e2e)),
            "p99_ttft_ms": float(np.percentile(ttft, 99))}


@pytest.mark.parametrize("cap", [None, 6])
def test_the_client_on_the_clock_equals_a_client_between_steps(cap):
    """simulate() sends arrivals from its step listener and runs the engine in one call per busy stretch: the same
    steps, and so the same figures, as a client that steps the engine one step at a time and sends in between."""
    trace = make_trace("sharegpt", 40, 25.0, seed=3)
    cfg = _small(max_num_seqs=16)
    m = simulate(trace, cfg, max_concurrency=cap).metrics
    ref = _client_between_steps(trace, cfg, cap or len(trace))
    assert {k: m[k] for k in ref} == ref


def test_the_simulation_builds_each_request_output_once(monkeypatch):
    """A client that reads no outputs must not pay for them every step (profiled: ~12 % of notebook 16's sweep
    when every running request's output was built after every step)."""
    import minienv.engine.outputs as outputs

    built = []
    real = outputs.make_output
    monkeypatch.setattr(outputs, "make_output", lambda req, **kw: built.append(req.request_id) or real(req, **kw))
    trace = make_trace("sharegpt", 30, 20.0, seed=2)
    m = simulate(trace, _small()).metrics
    assert m["num_steps"] > 100 and sorted(built, key=int) == [str(i) for i in range(30)]


# ---------------------------------------------------------------------- the CLI
def test_cli_prints_a_table_then_one_json_line(capsys):
    assert main(["simulate", "--num-prompts", "30", "--request-rate", "10", "--seed", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "median_itl_ms", "median_tpot_ms", "median_e2el_ms", "num_preemptions", "kv_usage_peak",
                "prefix_cache_hit_rate"):
        assert key in result
    assert result["completed"] == 30 and any("Median ITL (ms)" in line for line in out)


@pytest.mark.parametrize("argv, needle", [
    (["--request-rate", "0"], "must be > 0"), (["--request-rate", "-2"], "must be > 0"),
    (["--gpu", "B300"], "unknown GPU"), (["--model", "GPT-5"], "unknown model"),
    (["--model", "Llama-3-8B", "--tensor-parallel-size", "3"], "does not divide"),
])
def test_cli_bad_arguments_exit_2_naming_the_problem(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--num-prompts", "2", *argv])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_cli_model_that_does_not_fit_exits_1_naming_both_sizes(capsys):
    assert main(["simulate", "--model", "Llama-3-70B", "--gpu", "L4", "--num-prompts", "2"]) == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "GiB" in err and "L4" in err


# ---------------------------------------------------------------------- the engine's per-step costs (profiled)
def test_make_output_equals_the_constructor():
    import copy
    import dataclasses

    from minienv.engine.outputs import RequestOutput, make_output
    from minienv.request import RequestStatus
    from minienv.sim.simulated_model import SimTokenizer, SimulatedModel
    from minienv.engine import InferenceEngine
    from minienv.sampling import SamplingParams

    eng = InferenceEngine(SimulatedModel(256), SimTokenizer(), kv_budget_tokens=256, block_size=16)
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, stop=["zz"]))
    for _ in range(3):
        eng.step()
        req = eng.requests.get(rid) or eng.retained[rid]
        made = make_output(req, advance=False)
        fields = {f.name: getattr(made, f.name) for f in dataclasses.fields(RequestOutput)}
        assert made == RequestOutput(**fields) and made.metrics == copy.copy(req.metrics)
        assert made.metrics is not req.metrics and made.finished == req.is_finished
    for status in RequestStatus:
        assert status.is_finished == status.value.startswith("finished")
