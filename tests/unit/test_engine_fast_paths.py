"""The engine's fast paths against its plain paths, and Ctrl-C handling with one SIGINT handler per step.

* A real SIGINT (``signal.raise_signal``) in each phase of a step: while planning it is held until planning ends,
  then the plan is rolled back; in the model call it lands at once and the step is rolled back; while committing
  it is held until the step is complete. Either way the engine's state is consistent and stepping on gives every
  request its alone output (``minienv.generate``).
* The scheduler on the KV cache manager's fast paths (``append_slot``, ``find_prefix`` + ``allocate_slots``,
  ``commit_step``) and on its plain, validated calls produce the same plans, block tables, stats and outputs.
* The model's precomputed RoPE rows equal ``rope_cos_sin`` bit for bit, and RMSNorm's reduction equals ``np.mean``'s.
"""

from __future__ import annotations

import signal
import sys
import threading

import numpy as np
import pytest

from engine_harness import alone, assert_rolled_back, fingerprint
from minienv.engine import InferenceEngine
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.kv.kv_pool import KVPool
from minienv.model.llama import RopeTable, rms_norm, rope_cos_sin
from minienv.sampling import SamplingParams

PROMPTS = ["To be, or not to be", "ROMEO:", "O Romeo, Romeo", "To be, or not"]
GREEDY = SamplingParams(max_tokens=24, temperature=0)

needs_default_sigint = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread()
    or signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
    reason="Ctrl-C deferral is only active in the main thread over Python's default SIGINT handler")


def _engine(model, tok, **kw):
    return InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=4, max_num_batched_tokens=16, **kw)


def _finish_and_compare(engine, model, tok, ids):
    before = signal.getsignal(signal.SIGINT)  # Python's default handler, or SIG_IGN under a job that ignores Ctrl-C
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        assert tuple(engine.output(rid).token_ids) == alone(model, tok.encode(prompt), GREEDY, tok.eos_token_id)
    assert signal.getsignal(signal.SIGINT) is before  # each step's handler was removed again


@needs_default_sigint
@pytest.mark.parametrize("phase", ["plan", "model", "commit"])
def test_sigint_in_each_phase_of_a_step(model, tok, phase):
    e = _engine(model, tok)
    ids = [e.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        e.step()
    before = fingerprint(e)
    reached: list[str] = []

    def interrupt(where: str) -> None:
        reached.append(where)
        signal.raise_signal(signal.SIGINT)
        reached.append(where + " continued")  # held (deferred) interrupts let the phase run on

    if phase == "plan":
        original = e.scheduler.schedule
        e.scheduler.schedule = lambda: (lambda plan: (interrupt("plan"), plan)[1])(original())
    elif phase == "model":
        original = e.model.forward_step

        class Interrupting:
            config = model.config

            def forward_step(self, *a, **k):
                interrupt("model")
                return original(*a, **k)
        e.model = Interrupting()
    else:
        e.add_step_listener(lambda record: interrupt("commit"))

    with pytest.raises(KeyboardInterrupt):
        e.step()
    if phase == "model":
        assert reached == ["model"]  # raised at once, inside the model call
        e.model = model
    else:
        assert reached == [phase, phase + " continued"]  # held until the phase ended
    if phase == "plan":
        e.scheduler.schedule = original
    if phase == "commit":
        e._step_listeners.clear()
        e.check_invariants()  # the step completed before the interrupt was raised
        assert e.scheduler.num_steps == before["stats"].num_steps + 1
    else:
        assert_rolled_back(before, e)
    _finish_and_compare(e, model, tok, ids)


class _PlainManager(KVCacheManager):
    """minienv's manager driven only through its public, validated calls (its fast paths switched off)."""

    fast_paths = False


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [1024, 48])  # 48 tokens: preemption and eviction
def test_scheduler_on_fast_paths_equals_plain_paths(model, tok, caching, budget):
    runs = {}
    for name, factory in (("fast", None), ("plain", lambda n, b, c: _PlainManager(n, b, enable_prefix_caching=c))):
        e = InferenceEngine(model, tok, kv_budget_tokens=budget, block_size=4, max_num_batched_tokens=16,
                            enable_prefix_caching=caching, kv_cache_manager_factory=factory)
        assert e.kv_cache_manager.fast_paths == (name == "fast")
        ids = [e.add_request(p, GREEDY) for p in PROMPTS]
        plans, snaps = [], []
        while e.has_unfinished_requests():
            e.step()
            e.check_invariants()
            rec = e.history[-1]
            plans.append([(s.request_id, s.kind, s.num_new_tokens, s.num_computed_tokens, s.token_ids,
                           s.slot_mapping.tolist(), s.blocks_to_copy) for s in rec.scheduler_output.scheduled])
            snaps.append((e.kv_cache_manager.snapshot(), rec.stats.num_cached_free_blocks))
        runs[name] = (plans, snaps, [tuple(e.output(i).token_ids) for i in ids])
    assert runs["fast"] == runs["plain"]
    for prompt, out in zip(PROMPTS, runs["fast"][2], strict=True):
        assert out == alone(model, tok.encode(prompt), GREEDY, tok.eos_token_id)


def test_rope_table_rows_equal_rope_cos_sin():
    table = RopeTable(48, 10000.0, 1024)
    for positions in ([0], [7], [1023], [0, 5, 300, 1023], list(range(40)), [900, 3]):
        pos = np.asarray(positions, dtype=np.int64)
        got, want = table(pos), rope_cos_sin(pos, 48, 10000.0)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert len(table.cos) <= 1024


def test_rms_norm_reduction_equals_np_mean():
    rng = np.random.default_rng(0)
    for shape in [(1, 192), (7, 192), (3, 5, 64)]:
        x = rng.standard_normal(shape).astype(np.float32) * 3
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        want = w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-5)))
        assert np.array_equal(rms_norm(x, w, 1e-5), want)


def test_decode_metadata_equals_the_general_constructor():
    """Every field of PagedAttentionMetadata (a field added later included), decode steps of 1..9 sequences."""
    import dataclasses

    from minienv.engine.inputs import decode_metadata
    from minienv.kv.block_table import pad_block_tables
    from minienv.kv.paged_attention import PagedAttentionMetadata

    rng = np.random.default_rng(3)
    for _ in range(50):
        s, B = int(rng.integers(1, 10)), int(rng.choice([1, 4, 16]))
        context = rng.integers(0, 60, s)
        tables = pad_block_tables([rng.integers(0, 99, -(-(int(c) + 1) // B)).tolist() for c in context])
        slots = rng.integers(0, 99 * B, s)
        fast = decode_metadata(tables, context.astype(np.int64), slots.astype(np.int64), B)
        plain = PagedAttentionMetadata(tables, context, np.ones(s, dtype=np.int64), slots, B)
        for f in dataclasses.fields(PagedAttentionMetadata):
            a, b = getattr(fast, f.name), getattr(plain, f.name)
            if isinstance(b, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f.name
            else:
                assert a == b and type(a) is type(b), f.name
        assert fast.num_tokens == plain.num_tokens == s


@needs_default_sigint
def test_generate_installs_one_handler_and_restores_it(model, tok):
    """generate() holds one SIGINT handler for its whole loop; a Ctrl-C in a model call still lands at once, the
    step is rolled back, and Python's default handler is back afterwards (also after a normal finish)."""
    e = _engine(model, tok)
    calls = {"n": 0}
    original = model.forward_step

    class InterruptOnce:
        config = model.config

        def forward_step(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 3:
                signal.raise_signal(signal.SIGINT)
            return original(*a, **k)
    e.model = InterruptOnce()
    with pytest.raises(KeyboardInterrupt):
        e.generate(PROMPTS, GREEDY)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    e.check_invariants()
    e.model = model
    outs = e.generate(["ROMEO:"], GREEDY)
    assert tuple(outs[0].token_ids) == alone(model, tok.encode("ROMEO:"), GREEDY, tok.eos_token_id)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    while e.has_unfinished_requests():  # the interrupted requests, handed to step()'s consumer, still finish
        e.step()
    e.check_invariants()


def test_kv_pool_write_lands_where_slot_arithmetic_says_also_in_a_copied_pool():
    import copy

    from minienv.kv.kv_pool import KVPool

    rng = np.random.default_rng(4)
    pool = KVPool(3, 5, 4, 2, 3)
    twin = copy.deepcopy(pool)  # its slot views were copied apart from its array: write must still reach it
    for target in (pool, twin):
        for n in (6, 1):  # a scatter, and one token (written through a plain index)
            target.kv_cache[...] = 0
            slots = rng.permutation(20)[:n]
            k, v = (rng.standard_normal((n, 2, 3)).astype(np.float32) for _ in range(2))
            target.write(2, slots, k, v)
            blocks, offsets = slots // 4, slots % 4
            assert np.array_equal(target.kv_cache[2, 0, blocks, offsets], k)
            assert np.array_equal(target.kv_cache[2, 1, blocks, offsets], v)
            assert not target.kv_cache[:2].any()  # other layers untouched
            assert np.count_nonzero(target.kv_cache[2].any(axis=(-1, -2))) == 2 * n  # and no other slot
    assert not np.shares_memory(pool.kv_cache, twin.kv_cache)


def test_fused_model_ops_equal_their_plain_forms():
    """SiLU-and-mul in place == silu(gate) * up; Q and K rotated in one call == rotated apart (bit for bit)."""
    from minienv.model.llama import apply_rope, silu, silu_and_mul

    rng = np.random.default_rng(6)
    for n in (1, 5):
        gate_up = rng.standard_normal((n, 2 * 64)).astype(np.float32) * 4
        assert np.array_equal(silu_and_mul(gate_up), silu(gate_up[:, :64]) * gate_up[:, 64:])
        q = rng.standard_normal((n, 4, 48)).astype(np.float32)
        k = rng.standard_normal((n, 2, 48)).astype(np.float32)
        cos, sin = rope_cos_sin(rng.integers(0, 1000, n), 48, 10000.0)
        qk = apply_rope(np.concatenate([q, k], axis=1), cos, sin)
        assert np.array_equal(qk[:, :4], apply_rope(q, cos, sin)) and np.array_equal(qk[:, 4:], apply_rope(k, cos, sin))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults are counted by Linux's getrusage")
def test_kv_pool_memory_is_reserved_at_construction_so_steps_never_fault_it_in():
    """A step's write into a fresh pool lands on pages the pool already touched: no page faults. The control, a
    plain ``np.zeros`` array of the same shape written the same way, shows what lazily mapped memory costs (each
    first write into a page faults it in, so a fresh engine's first steps paid for the pool piece by piece)."""
    import resource

    def faults_of(write) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        write()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    rng = np.random.default_rng(0)
    pool = KVPool(4, 4096, 16, 2, 48)  # 50 MB
    control = np.zeros(pool.kv_cache.shape, dtype=np.float32)  # allocated after the pool: not memory the pool could have reused
    slots = rng.permutation(pool.num_slots)[:512]  # scattered over the whole pool
    k = rng.standard_normal((512, 2, 48), dtype=np.float32)
    flat = control.reshape(pool.num_layers, 2, pool.num_slots, 2, 48)

    def write_control():
        for layer in range(pool.num_layers):
            flat[layer, 0, slots] = k
            flat[layer, 1, slots] = k

    lazy = faults_of(write_control)
    reserved = faults_of(lambda: [pool.write(layer, slots, k, k) for layer in range(pool.num_layers)])
    if lazy < 20:
        pytest.skip(f"this process's allocator handed out already-touched memory ({lazy} faults for the control)")
    assert reserved * 10 < lazy, f"{reserved} page faults writing into a constructed pool ({lazy} for np.zeros)"
    got_k, got_v = pool.read_slots(3, slots)
    assert np.array_equal(got_k, k) and np.array_equal(got_v, k)


def test_decode_step_inputs_equal_the_general_derivation(model, tok, monkeypatch):
    """``build_step_inputs``'s decode shortcut (every sequence decodes and samples one token: rows 0..n-1) gives
    the sampling indices, logits rows and logits counts the general derivation gives, and its slot mapping (the
    scheduler's one array for a whole decode step) the concatenation of every chunk's slots, on every step of a
    run with prefill chunks, mixed steps and decode steps; and the run's outputs are each request's alone output."""
    import minienv.engine.core as core
    from minienv.engine.inputs import _sampling_rows, build_step_inputs

    from minienv.kv.block_table import pad_block_tables

    kinds: list[bool] = []
    whole_runs: list[bool] = []
    carried: list[bool] = []

    def checked(plan, kv, pool, cache=None):
        assert cache is not None  # the engine passes its BlockTableCache
        inputs = build_step_inputs(plan, kv, pool, cache)
        tables = pad_block_tables([kv.request(s.request_id).block_ids for s in plan.scheduled])
        got_tables = inputs.metadata.block_tables
        assert got_tables.dtype == tables.dtype and np.array_equal(got_tables, tables)
        carried.append(got_tables is cache.array and not got_tables.flags.writeable)
        # the slot mapping: every chunk's slots concatenated in plan order, whether or not it came as the leading
        # decode run's one array (SchedulerOutput.decode_slots, whose one-element slices are those requests' own)
        want = np.concatenate([s.slot_mapping for s in plan.scheduled])
        got = inputs.metadata.slot_mapping
        assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want)
        assert len(inputs.token_ids) == plan.num_scheduled_tokens  # what the engine counts as computed
        run = plan.decode_slots
        if run is not None:
            assert run.dtype == np.int64 and 1 <= len(run) <= len(plan.scheduled)
            for k, s in enumerate(plan.scheduled[:len(run)]):
                assert s.num_new_tokens == 1 and s.slot_mapping.shape == (1,) and s.slot_mapping[0] == run[k]
                assert s.samples and not s.blocks_to_copy and not s.num_spec_tokens  # what the inputs skip checking
            whole_runs.append(got is run)
        sampling, rows, num_logits = _sampling_rows(plan.scheduled, inputs.metadata)
        assert inputs.sampling == sampling and inputs.num_logits == num_logits
        assert inputs.logits_indices.dtype == rows.dtype and np.array_equal(inputs.logits_indices, rows)
        shortcut = inputs.metadata.is_decode and all(s.samples for s in plan.scheduled)
        # the engine skips the model's row gather exactly when the rows are the metadata's 0..n-1 array itself
        assert (inputs.logits_indices is inputs.metadata.token_seq_idx) == shortcut
        kinds.append(shortcut)
        return inputs

    monkeypatch.setattr(core, "build_step_inputs", checked)
    e = _engine(model, tok, max_num_seqs=3)
    ids = [e.add_request(p, GREEDY) for p in PROMPTS]
    _finish_and_compare(e, model, tok, ids)
    assert any(kinds) and not all(kinds)  # both the shortcut and the general path ran
    assert any(whole_runs) and not all(whole_runs)  # the run's array as the slot mapping, and concatenated
    assert all(carried)  # the tables came from the engine's cache, read-only


def test_step_record_stats_equal_engine_stats_after_each_step(model, tok):
    """A step record's stats are built on first read from values taken at the step's end: equal to what
    ``engine.stats`` said right then, however many steps later they are read."""
    e = _engine(model, tok, max_num_seqs=2)
    eager = []
    e.add_step_listener(lambda record: eager.append(e.stats))
    ids = [e.add_request(p, GREEDY) for p in PROMPTS]
    _finish_and_compare(e, model, tok, ids)
    records = list(e.history)
    assert len(records) == len(eager) > 10
    assert eager[0] != eager[-1]
    for record, want in zip(records, eager, strict=True):
        assert record.stats == want and record.stats is record.stats  # built once


def test_all_greedy_sampling_equals_the_per_request_loop(model, tok):
    """``_sample``'s all-greedy shortcut gives the tokens and errors of its per-request loop: finite rows, rows with
    NaN / +inf / -inf (errors, token 0), ties (the first index), one row and several; a mixed batch (one sampled
    request) takes the loop either way."""
    e = _engine(model, tok)
    greedy = [e.scheduler.requests[e.add_request(p, GREEDY)] for p in PROMPTS]
    rng = np.random.default_rng(5)
    vocab = model.config.vocab_size
    for n in (1, 2, 4):
        for bad in (None, np.nan, np.inf, -np.inf):
            logits = rng.standard_normal((n, vocab)).astype(np.float32)
            logits[:, 7] = logits[:, 9] = logits.max() + 1  # a tie: argmax takes the first
            if bad is not None:
                logits[n - 1, 3] = bad
            reqs = greedy[:n]
            assert e._sample(reqs, logits) == e._sample(reqs, logits, fast=False)
    # finite rows whose float32 sum overflows to inf are finite: no error (the sum is only a first test)
    big = np.full((2, vocab), 3e37, dtype=np.float32)
    big[0, 5] = 3.1e37
    big[1, 2] = np.nan
    with np.errstate(over="ignore"):  # the overflow is the point
        assert not np.isfinite(np.add.reduce(big[:1], axis=-1)).all()
        assert e._sample(greedy[:2], big) == e._sample(greedy[:2], big, fast=False) == \
            ([5, 0], [None, e._NON_FINITE])
    sampled = e.scheduler.requests[e.add_request("x", SamplingParams(max_tokens=4, temperature=0.8, seed=1))]
    logits = rng.standard_normal((2, vocab)).astype(np.float32)
    twin = _engine(model, tok)
    twin_sampled = twin.scheduler.requests[twin.add_request("x", SamplingParams(max_tokens=4, temperature=0.8,
                                                                                seed=1))]
    assert e._sample([greedy[0], sampled], logits) == twin._sample([greedy[0], twin_sampled], logits, fast=False)


# ------------------------------------------------------------------ the steady decode step's lean path
def _plain_paths(monkeypatch) -> None:
    """Switch the lean decode-step paths off: the scheduler's general loop for every running request,
    ``ScheduledRequest``'s dataclass constructor, block tables padded anew every step (``pad_block_tables`` has
    its own equality test)."""
    from minienv.engine.inputs import BlockTableCache
    from minienv.kv.block_table import pad_block_tables
    from minienv.scheduler import ScheduledRequest, Scheduler

    monkeypatch.setattr(Scheduler, "_schedule_decodes", lambda self, out: 0)
    monkeypatch.setattr(BlockTableCache, "tables", lambda self, rows, epoch: pad_block_tables(rows))
    monkeypatch.setattr(ScheduledRequest, "one_token", classmethod(
        lambda cls, rid, kind, start, token, slots: cls(rid, kind, 1, start, True, token_ids=(token,),
                                                        slot_mapping=slots)))


def _observed_run(model, tok, engine_kw: dict, script: dict) -> list:
    """Everything observable after every step of a scripted run: the step's outputs, its record (the plan's every
    field, slot mappings included; tokens, finishes, KV events, stats), the KV manager's snapshot and each
    request's step metrics. ``script[step]``: ``("add", prompt, params)`` / ``("abort", index)`` before it."""
    import dataclasses

    e = InferenceEngine(model, tok, **engine_kw)
    ids: list[str] = []
    trace = []
    step = 0
    while step == 0 or e.has_unfinished_requests() or step in script:
        for action in script.get(step, ()):
            if action[0] == "add":
                prompt = action[1] if len(action) < 4 else tok.encode(action[1])[:action[3]]
                ids.append(e.add_request(prompt, action[2]))
            elif ids[action[1]] in e.scheduler.requests:
                e.abort(ids[action[1]])
        outs = [(o.request_id, o.token_ids, o.text, o.finished, o.finish_reason, o.delta_token_ids, o.delta_text,
                 o.metrics.first_token_step, o.metrics.finished_step, o.metrics.num_preemptions)
                for o in e.step()]
        e.check_invariants()
        rec = e.history[-1] if e.history and e.history[-1].step == step else None
        plan = None
        if rec is not None:
            p = rec.scheduler_output
            plan = ([{f.name: getattr(s, f.name) for f in dataclasses.fields(s)} | {"slot_mapping": (
                s.slot_mapping.dtype, s.slot_mapping.tolist())} for s in p.scheduled],
                p.preempted, p.admitted, p.waiting, p.running, p.max_num_batched_tokens, p.scheduling)
            plan = (rec.step, plan, rec.sampled, rec.finished, rec.kv_events,
                    dataclasses.replace(rec.stats, busy_time_s=0.0))
        trace.append((outs, plan, e.kv_cache_manager.snapshot()))
        step += 1
    return trace


_P = SamplingParams(max_tokens=12, temperature=0)
_LONG = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and arrows"
_LEAN_SCRIPT = {
    # 17 tokens with a budget of 16: the next step's leading run holds a one-token prefill chunk (kind "prefill")
    0: [("add", _LONG, SamplingParams(max_tokens=4, temperature=0), 17), ("add", "To be, or not to be", _P),
        ("add", "ROMEO:", SamplingParams(max_tokens=5, temperature=0))],
    # admitted while others decode: its first chunk is the budget the decodes leave
    3: [("add", _LONG, SamplingParams(max_tokens=3, temperature=0.8, seed=3))],
    6: [("abort", 2), ("add", "To be, or not", _P)],  # a prefix hit on the first prompt's blocks
    9: [("add", "ROMEO: wherefore", SamplingParams(max_tokens=7, temperature=0))],
    18: [("add", "To be, or not to be", _P)],  # after others finished: hits on cached-free blocks
}


@pytest.mark.parametrize("config", ["roomy", "preempting", "no-caching", "spec-ngram", "spec-draft", "kv-tier",
                                    "static", "plain-manager"])
def test_lean_decode_steps_equal_the_general_path(model, tok, config, monkeypatch, tmp_path):
    """The steady decode step's lean path (the scheduler's leading run of decodes, ``ScheduledRequest.one_token``,
    ``block_tables``) against the general path, on a scripted run with admissions mid-run, an abort, finishes,
    prefix hits and, per config, preemptions, speculative decoding, a KV tier or static batching: every step's
    outputs, record and KV state are identical. ``plain-manager``: the general path also drives the KV cache
    manager through its plain, validated calls only (no ``append_slot``, ``commit_step``, ...)."""
    from minienv.scheduler import Scheduler

    kw = dict(kv_budget_tokens=1024, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    kw |= {"roomy": {}, "preempting": dict(kv_budget_tokens=40), "no-caching": dict(enable_prefix_caching=False),
           "spec-ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
           "spec-draft": dict(speculative_config={"method": "draft", "num_speculative_tokens": 2}),
           "kv-tier": dict(kv_tier=tmp_path), "static": dict(scheduling="static"), "plain-manager": {}}[config]
    lean_runs = []
    original = Scheduler._schedule_decodes
    monkeypatch.setattr(Scheduler, "_schedule_decodes",
                        lambda self, out: (lambda n: (lean_runs.append(n), n)[1])(original(self, out)))
    lean = _observed_run(model, tok, kw, _LEAN_SCRIPT)
    assert any(lean_runs), "the lean path never ran"
    _plain_paths(monkeypatch)
    if config == "kv-tier":
        kw["kv_tier"] = tmp_path / "plain"  # a fresh, empty store, as the lean run had
    if config == "plain-manager":
        kw["kv_cache_manager_factory"] = lambda n, b, c: _PlainManager(n, b, enable_prefix_caching=c)
    plain = _observed_run(model, tok, kw, _LEAN_SCRIPT)
    assert len(lean) == len(plain)
    for step, (a, b) in enumerate(zip(lean, plain, strict=True)):
        assert a == b, f"step {step} differs"
    if config == "preempting":
        assert any(p and p[1][1] for _, p, _ in lean), "the run never preempted"


def test_one_token_equals_the_constructor():
    from minienv.scheduler import ScheduledRequest

    slots = np.array([37], dtype=np.int64)
    for kind, start in (("decode", 9), ("prefill", 0)):
        fast = ScheduledRequest.one_token("r7", kind, start, 101, slots)
        plain = ScheduledRequest("r7", kind, 1, start, True, token_ids=(101,), slot_mapping=slots)
        assert fast == plain and repr(fast) == repr(plain) and vars(fast) == vars(plain)
        assert list(vars(fast)) == list(vars(plain))  # the same fields in the same order
        with pytest.raises(AttributeError):  # still frozen
            fast.num_new_tokens = 2


def test_pad_block_tables_equals_a_per_row_copy():
    """``pad_block_tables`` (rows padded in Python, one ``np.array``: the engine pads every step) equals a zero
    array with each row copied in: lists and arrays, empty rows, a given width; a row wider than it is refused."""
    from minienv.kv.block_table import pad_block_tables

    def plain(rows, width=None):
        width = max(max((len(r) for r in rows), default=0) if width is None else width, 1)
        out = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return out

    rng = np.random.default_rng(8)
    cases = [[], [[]], [[], []], [[5]], [[1, 2, 3]], [[1], [2, 3, 4], []], [np.array([7, 8]), [9]]]
    cases += [[rng.integers(0, 500, rng.integers(0, 9)).tolist() for _ in range(rng.integers(1, 17))]
              for _ in range(200)]
    for rows in cases:
        copies = [list(r) for r in rows]
        for width in (None, 12):
            got, want = pad_block_tables(rows, width), plain(rows, width)
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), rows
        assert [list(r) for r in rows] == copies  # the engine's live tables are not changed
    with pytest.raises(ValueError, match="does not fit width 2"):
        pad_block_tables([[1, 2, 3]], width=2)


def test_manager_stats_values_count_what_a_scan_of_the_blocks_counts(model, tok):
    """``KVCacheManager.stats_values()`` (what a step record keeps) against counts taken by scanning every block's
    state, after every step of a run with preemption, eviction and prefix hits; ``stats()`` is the same values."""
    from minienv.kv.kv_cache_manager import BlockState, KVCacheStats

    e = InferenceEngine(model, tok, kv_budget_tokens=48, block_size=4, max_num_batched_tokens=16)
    for p in PROMPTS + PROMPTS[:2]:
        e.add_request(p, GREEDY)
    m = e.kv_cache_manager
    while e.has_unfinished_requests():
        e.step()
        values = m.stats_values()
        states = [m.block_state(b) for b in range(m.num_blocks)]
        s = m.prefix_stats
        assert values == (m.num_blocks, m.block_size, states.count(BlockState.FREE_EMPTY),
                          states.count(BlockState.CACHED_FREE), states.count(BlockState.IN_USE),
                          len(e.scheduler.running), s.requests, s.queries, s.hits, s.evicted_blocks,
                          s.evicted_tokens, m.cow_copies)
        assert m.stats() == KVCacheStats(*values)
    assert e.stats.num_preemptions and e.stats.evicted_blocks and e.stats.prefix_cache_hits_tokens


def test_step_record_stats_of_a_manager_that_overrides_stats(model, tok):
    """A manager whose ``stats()`` is its own is asked for it at every step's end (not for the raw tuple of
    minienv's manager): the record's stats are what its ``stats()`` said then."""
    from minienv.kv.kv_cache_manager import KVCacheManager
    import dataclasses

    class Shifted(KVCacheManager):
        def stats(self):
            return dataclasses.replace(super().stats(), evicted_blocks=1000 + self.pool.num_used_blocks)

    e = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=4, max_num_batched_tokens=16,
                        kv_cache_manager_factory=lambda n, b, c: Shifted(n, b, enable_prefix_caching=c))
    eager = []
    e.add_step_listener(lambda record: eager.append(e.kv_cache_manager.stats()))
    for p in PROMPTS:
        e.add_request(p, GREEDY)
    e.run()
    assert len(e.history) == len(eager) > 5
    for record, want in zip(e.history, eager, strict=True):
        assert record.stats.evicted_blocks == want.evicted_blocks
        assert record.stats.num_blocks_in_use == want.num_in_use
    assert {r.stats.evicted_blocks for r in e.history} != {1000}  # the override was read, and it varied


def test_step_record_of_equals_the_constructor(model, tok):
    """``StepRecord.of`` (the engine's, one per step) builds the record the dataclass constructor builds: the same
    fields in the same order, equal, still frozen, its raw stats built on first read; on every step of a run."""
    from minienv.engine.observe import StepRecord

    e = _engine(model, tok, max_num_seqs=2)
    for p in PROMPTS:
        e.add_request(p, GREEDY)
    e.run()
    assert len(e.history) > 10
    for rec in e.history:
        values = [object.__getattribute__(rec, name) for name in StepRecord.__dataclass_fields__]
        assert type(values[5]) is tuple  # the raw stats, not yet read
        fast, plain = StepRecord.of(*values), StepRecord(*values)
        assert list(vars(fast)) == list(vars(plain)) and vars(fast) == vars(plain) and fast == plain
        assert fast.stats == plain.stats == rec.stats and fast.stats is fast.stats
        with pytest.raises(AttributeError):
            fast.step = 0


def test_sampling_finiteness_check_equals_isfinite_per_row(model, tok):
    """``_sample``'s finiteness test (row sums as one product with a ones vector; rows whose sum is not finite
    checked element by element) flags exactly the rows ``np.isfinite(row).all()`` rejects: NaN, +inf, -inf, mixed,
    and finite rows whose float32 sum overflows (no error); 1-16 rows, and logits narrower than the vocabulary."""
    e = _engine(model, tok)
    reqs = [e.scheduler.requests[e.add_request("x", GREEDY)] for _ in range(16)]
    rng = np.random.default_rng(11)
    vocab = model.config.vocab_size
    flagged = overflowed = 0
    for _ in range(300):
        n, width = int(rng.integers(1, 17)), int(rng.choice([vocab, vocab, 37]))
        scale = rng.choice([1.0, 1e3, 1e36])  # 1e36: same-sign rows whose float32 sum overflows
        logits = ((np.abs if scale > 1e30 else np.asarray)(rng.standard_normal((n, width))) * scale).astype(np.float32)
        for row in range(n):
            if rng.random() < 0.3:
                logits[row, rng.integers(0, width, rng.integers(1, 3))] = rng.choice([np.nan, np.inf, -np.inf])
        with np.errstate(over="ignore", invalid="ignore"):  # overflowing sums and inf - inf are the point
            tokens, errors = e._sample(reqs[:n], logits)
        want = [bool(np.isfinite(row).all()) for row in logits]
        assert [err is None for err in errors] == want
        assert [t for t, ok in zip(tokens, want) if ok] == [int(np.argmax(r)) for r, ok in zip(logits, want) if ok]
        flagged += want.count(False)
        with np.errstate(over="ignore"):
            overflowed += sum(ok and not np.isfinite(r.sum(dtype=np.float32)) for r, ok in zip(logits, want))
    assert flagged and overflowed  # both kinds of row occurred


def test_block_table_cache_equals_padding_anew():
    """``BlockTableCache.tables`` against ``pad_block_tables`` of the same live tables, on a real KV cache manager
    driven through every kind of table change: decode appends (``append_slot``) and chunks (``append_slots``)
    that cross block boundaries, prefix hits, forks and the copy-on-write that follows, truncations, frees,
    admissions, and commits that deduplicate a block two requests computed at once; the tables asked for in the
    same order (carried, grown in place), a changed order and subsets. Arrays handed out earlier never change."""
    from minienv.engine.inputs import BlockTableCache
    from minienv.kv.block_table import pad_block_tables

    rng = np.random.default_rng(12)
    kv = KVCacheManager(96, 4)
    cache = BlockTableCache()
    handed: list[tuple[np.ndarray, np.ndarray]] = []
    stats = {"same": 0, "grown": 0, "anew": 0, "dedup": 0, "cow": 0}
    names = iter(range(10**6))
    prompts = [rng.integers(0, 50, 9).tolist(), rng.integers(0, 50, 6).tolist()]

    def live() -> list:
        return kv.request_ids()

    def admit() -> None:
        rid = f"r{next(names)}"
        prompt = list(prompts[rng.integers(0, 2)]) + rng.integers(0, 50, rng.integers(0, 4)).tolist()
        if kv.allocate(rid, prompt) is not None and rng.random() < 0.7:
            kv.commit(rid)

    for _ in range(3):
        admit()
    for _ in range(1500):
        ids = live()
        op = rng.random()
        if not ids or op < 0.06:
            admit()
        elif op < 0.60:  # a decode step: every request one token (a boundary takes a block)
            for rid in ids:
                if kv.append_slot(rid, int(rng.integers(0, 50))) is None:
                    kv.append_slots(rid, [int(rng.integers(0, 50))])  # copy-on-write (or no block: None)
                kv.commit(rid)
        elif op < 0.70:
            rid = ids[rng.integers(0, len(ids))]
            kv.append_slots(rid, rng.integers(0, 50, rng.integers(1, 7)).tolist())
            kv.commit(rid)
        elif op < 0.76:
            rid = ids[rng.integers(0, len(ids))]
            n = kv.request(rid).num_tokens
            if n > 1:
                kv.truncate(rid, int(rng.integers(max(1, n - 9), n)))
                if rng.random() < 0.7:  # regrown before the next step (a rolled-back step run again)
                    kv.append_slots(rid, rng.integers(0, 50, n - kv.request(rid).num_tokens).tolist())
                    kv.commit(rid)
        elif op < 0.82:
            kv.free(ids[rng.integers(0, len(ids))])
        elif op < 0.88:  # fork: the children share every block; their next write copies a partial last block
            parent = ids[rng.integers(0, len(ids))]
            if kv.request(parent).num_computed_tokens == kv.request(parent).num_tokens:
                child = f"r{next(names)}"
                kv.fork(parent, [child])
                before = kv.cow_copies
                kv.append_slots(child, [int(rng.integers(0, 50))])
                stats["cow"] += kv.cow_copies > before
        elif op < 0.94:  # two requests compute the same new prompt at once: the second commit deduplicates
            prompt = rng.integers(50, 99, 8).tolist()
            a, b = f"r{next(names)}", f"r{next(names)}"
            if kv.allocate(a, prompt) is not None and kv.allocate(b, prompt) is not None:
                before = kv.table_epoch
                kv.commit(a)
                kv.commit(b)
                stats["dedup"] += kv.table_epoch > before
        if len(live()) > 12:
            kv.free(live()[0])
        ids = live()
        if not ids:
            continue
        if rng.random() < 0.15:  # another order, or a subset
            ids = list(rng.permutation(ids))[:rng.integers(1, len(ids) + 1)]
        rows = [kv.request(rid).block_ids for rid in ids]
        previous = cache.array
        carried = previous is not None and cache.epoch == kv.table_epoch and len(rows) == len(cache.rows) \
            and all(a is b for a, b in zip(rows, cache.rows))
        got = cache.tables(rows, kv.table_epoch)
        want = pad_block_tables(rows)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        assert not got.flags.writeable
        stats["same" if got is previous else "grown" if carried and got.shape == previous.shape else "anew"] += 1
        handed.append((got, got.copy()))
        kv.check_invariants()
    for array, copy in handed:
        assert np.array_equal(array, copy)  # never changed after it was handed out
    assert all(v >= 5 for v in stats.values()), stats  # every kind of step occurred
