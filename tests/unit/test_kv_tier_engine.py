"""The persistent KV tier in the engine (embedded SQLite store): differential against the tier off, restarts in a
new process, corrupt records, other models and block sizes, a full store, bad configuration.

The Redis store's engine tests (a killed server, two instances sharing) are in ``test_kv_tier_redis.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from engine_harness import FlakyModel, bundled
from minienv.engine import InferenceEngine
from minienv.kv_tier import SQLiteStore, TierConfigError, TierWarning, block_keys, decode_record
from minienv.model import LlamaModel, random_weights
from minienv.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("kv_tier_child.py")


def _prompts(n: int = 6, prefix_len: int = 150, seed: int = 0) -> list[list[int]]:
    """n prompts sharing a long prefix, each with its own tail of a different length (seeded)."""
    rng = np.random.default_rng(seed)
    prefix = [int(t) for t in rng.integers(0, 2000, prefix_len)]
    return [prefix + [int(t) for t in rng.integers(0, 2000, 5 + 13 * i)] for i in range(n)]


def _params(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampling mixed: any K/V difference would show in either."""
    return [SamplingParams(max_tokens=6, temperature=0.0) if i % 2 == 0 else
            SamplingParams(max_tokens=6, temperature=0.8, top_k=50, seed=100 + i) for i in range(n)]


def _serve(engine: InferenceEngine, prompts, params) -> list[tuple[int, ...]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    return [tuple(engine.output(i).token_ids) for i in ids]


def _engine(tier=None, model=None, **kw) -> InferenceEngine:
    m, tok = bundled()
    return InferenceEngine(model or m, tok, kv_tier=tier, **kw)


ENGINE_SHAPES = {
    "ample": dict(kv_budget_tokens=4096, max_num_batched_tokens=512),
    # tight: preemption and chunked prefill; loads land in admissions that also get evicted and resumed
    "tight": dict(kv_budget_tokens=640, max_num_batched_tokens=96, max_num_seqs=4),
    "no-prefix-cache": dict(kv_budget_tokens=4096, max_num_batched_tokens=128, enable_prefix_caching=False),
}


@pytest.mark.parametrize("shape", sorted(ENGINE_SHAPES))
@pytest.mark.parametrize("block_size", [8, 16])
def test_tier_on_gives_the_outputs_of_tier_off(tmp_path, shape, block_size):
    kw = dict(ENGINE_SHAPES[shape], block_size=block_size)
    prompts, params = _prompts(), _params(6)
    off = _serve(_engine(**kw), prompts, params)
    first = _engine(tmp_path, **kw)
    assert _serve(first, prompts, params) == off
    assert first.kv_tier.stats.stores > 0 and first.kv_tier.stats.errors == 0
    second = _engine(tmp_path, **kw)  # a "restart": a fresh engine (same process) on the same store
    assert _serve(second, prompts, params) == off
    s = second.kv_tier.stats
    assert s.hit_tokens >= 150 // block_size * block_size and s.loads * block_size == s.hit_tokens
    assert s.errors == 0
    second.kv_tier.store.check_invariants()


def _child(spec, *args, hashseed="0"):
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(CHILD), str(spec), *map(str, args)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_restart_in_a_new_process_loads_the_prefill_with_identical_output(tmp_path):
    """Two processes with different PYTHONHASHSEED: same keys; the second loads >= 90 % of its prefill."""
    first = _child(tmp_path, hashseed="1")
    second = _child(tmp_path, hashseed="4242")
    assert first["pythonhashseed"] != second["pythonhashseed"] and first["keys"] == second["keys"]
    assert first["prefill_loaded"] == 0 and first["stats"]["stores"] == 800 // 16
    assert second["prefill_loaded"] >= 0.9 * second["prompt_tokens"], second
    assert second["prefill_loaded"] + second["prefill_computed"] == second["prompt_tokens"]
    assert second["token_ids"] == first["token_ids"]
    m, tok = bundled()
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 2000, 800)]
    ref = InferenceEngine(m, tok).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert list(ref.token_ids) == second["token_ids"]


def test_a_flipped_byte_is_detected_counted_recomputed_and_repaired(tmp_path):
    prompts, params = _prompts(1, prefix_len=200), _params(1)
    off = _serve(_engine(), prompts, params)
    _serve(_engine(tmp_path), prompts, params)
    store = SQLiteStore(tmp_path)
    fp = _engine(tmp_path).kv_tier.fingerprint
    keys = block_keys(prompts[0], 16, fp)
    victim = keys[5]
    raw = bytearray(store.raw(victim))
    raw[len(raw) // 2] ^= 0x01  # one bit of the payload
    store.overwrite_raw(victim, bytes(raw))

    eng = _engine(tmp_path)
    assert _serve(eng, prompts, params) == off
    s = eng.kv_tier.stats
    assert s.corrupt_records == 1 and s.hit_tokens == 5 * 16  # blocks 0..4 loaded, 5.. recomputed
    # the recomputed block replaced the bad record: the next engine loads the whole prefix again
    decode_record(store.raw(victim), fingerprint=fp, key=victim, parent_key=keys[4],
                  token_ids=prompts[0][80:96], shape=eng.kv_tier.block_shape)
    again = _engine(tmp_path)
    assert _serve(again, prompts, params) == off and again.kv_tier.stats.hit_tokens == (len(prompts[0]) - 1) // 16 * 16
    store.check_invariants()


def test_other_weights_with_the_same_shapes_get_zero_hits(tmp_path):
    m, _ = bundled()
    prompts, params = _prompts(2), _params(2)
    _serve(_engine(tmp_path), prompts, params)
    other = LlamaModel(m.config, random_weights(m.config, seed=7))
    eng = _engine(tmp_path, model=other)
    assert _serve(eng, prompts, params) == _serve(_engine(model=other), prompts, params)
    assert eng.kv_tier.stats.hit_tokens == 0 and eng.kv_tier.stats.stores > 0


def test_another_block_size_gets_zero_hits(tmp_path):
    prompts, params = _prompts(2), _params(2)
    _serve(_engine(tmp_path, block_size=16), prompts, params)
    eng = _engine(tmp_path, block_size=8)
    assert _serve(eng, prompts, params) == _serve(_engine(block_size=8), prompts, params)
    assert eng.kv_tier.stats.hit_tokens == 0


def test_get_num_new_matched_tokens_has_no_side_effects(tmp_path):
    prompts, params = _prompts(1), _params(1)
    _serve(_engine(tmp_path), prompts, params)
    eng = _engine(tmp_path)
    before = (eng.kv_tier.store.records(), dict(vars(eng.kv_tier.stats)))
    n = eng.kv_tier.get_num_new_matched_tokens(prompts[0], 32)
    assert n == (len(prompts[0]) - 1) // 16 * 16 - 32
    assert (eng.kv_tier.store.records(), dict(vars(eng.kv_tier.stats))) == before


def test_capacity_bound_evicts_tails_and_outputs_stay_identical(tmp_path):
    prompts, params = _prompts(6, seed=3), _params(6)
    off = _serve(_engine(), prompts, params)
    store = SQLiteStore(tmp_path, capacity_bytes=12 * 50_000)  # ~12 blocks of 16 tokens (49,365 bytes each)
    eng = _engine(store)
    assert _serve(eng, prompts, params) == off
    assert eng.kv_tier.stats.evictions > 0 and store.evictions() == eng.kv_tier.stats.evictions
    store.check_invariants()
    again = _engine(store)
    assert _serve(again, prompts, params) == off and again.kv_tier.stats.hit_tokens > 0


def test_a_full_store_warns_switches_the_tier_off_and_every_request_finishes(tmp_path):
    prompts, params = _prompts(4, prefix_len=300), _params(4)
    off = _serve(_engine(), prompts, params)
    store = SQLiteStore(tmp_path)
    store._db.execute("PRAGMA max_page_count=40")  # SQLite's own "database or disk is full" once 40 pages are used
    eng = _engine(store)
    with pytest.warns(TierWarning, match="switched off"):
        out = _serve(eng, prompts, params)
    assert out == off
    assert not eng.kv_tier.enabled and "full" in eng.kv_tier.disabled_reason
    assert eng.kv_tier.stats.backend_errors == 1
    store.check_invariants()


def test_bad_tier_configuration_is_a_clear_error_at_construction(tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    with pytest.raises(TierConfigError, match="is a file"):
        _engine(f)
    with pytest.raises(TierConfigError, match="cannot create"):
        _engine("/proc/minienv_tier")
    with pytest.raises(TierConfigError, match="kv_tier must be"):
        _engine(42)
    with pytest.raises(TierConfigError, match="bad Redis URL"):
        _engine("redis://127.0.0.1:notaport/0")
    with pytest.raises(TierConfigError, match="Port out of range"):
        _engine("redis://127.0.0.1:70000/0")
    assert f.read_text() == "keep me"


def test_a_failed_step_after_a_tier_load_rolls_back_and_outputs_stay_identical(tmp_path):
    m, tok = bundled()
    prompts, params = _prompts(3), _params(3)
    off = _serve(_engine(), prompts, params)
    _serve(_engine(tmp_path), prompts, params)
    flaky = FlakyModel(m, {1: RuntimeError, 3: RuntimeError})
    eng = InferenceEngine(flaky, tok, kv_tier=tmp_path)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while eng.has_unfinished_requests():
        try:
            eng.step()
        except RuntimeError:
            pass
        eng.check_invariants()
    assert flaky.failures == 2
    assert [tuple(eng.output(i).token_ids) for i in ids] == off
    assert eng.kv_tier.stats.hit_tokens > 0


def test_stats_are_a_plain_dataclass_an_exporter_can_read(tmp_path):
    import dataclasses

    eng = _engine(tmp_path)
    _serve(eng, _prompts(1), _params(1))
    d = dataclasses.asdict(eng.kv_tier.stats)
    assert {"lookups", "hit_tokens", "loads", "stores", "bytes_loaded", "bytes_stored", "backend_errors",
            "load_seconds", "evictions"} <= set(d)
    assert d["lookups"] == 1 and d["stores"] > 0


def test_warnings_are_not_raised_when_all_is_well(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TierWarning)
        _serve(_engine(tmp_path), _prompts(2), _params(2))
        _serve(_engine(tmp_path), _prompts(2), _params(2))


def test_loaded_kv_are_bit_identical_to_computed_kv(tmp_path):
    """Stronger than equal outputs (a small perturbation of K/V may not change an argmax): the pool's bytes."""
    prompts, params = _prompts(1, prefix_len=300), _params(1)

    def cached_kv(engine):
        hit = engine.kv_cache_manager.lookup(prompts[0])
        assert hit.num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16
        return engine.kv_pool.kv_cache[:, :, list(hit.block_ids)].copy()

    off = _engine()
    _serve(off, prompts, params)
    _serve(_engine(tmp_path), prompts, params)
    loaded = _engine(tmp_path)
    _serve(loaded, prompts, params)
    assert loaded.kv_tier.stats.hit_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert np.array_equal(cached_kv(off), cached_kv(loaded))


def test_a_record_from_a_future_format_version_is_a_clean_miss(tmp_path):
    prompts, params = _prompts(1), _params(1)
    off = _serve(_engine(), prompts, params)
    _serve(_engine(tmp_path), prompts, params)
    store = SQLiteStore(tmp_path)
    eng = _engine(tmp_path)
    first = block_keys(prompts[0], 16, eng.kv_tier.fingerprint)[0]
    raw = store.raw(first)
    store.overwrite_raw(first, raw[:8] + (2).to_bytes(2, "little") + raw[10:])  # written by a "future" minienv
    assert _serve(eng, prompts, params) == off
    s = eng.kv_tier.stats
    assert s.version_records == 1 and s.hit_tokens == 0 and s.backend_errors == 0


def test_another_kv_layout_version_gets_zero_hits(tmp_path, monkeypatch):
    from minienv.kv_tier import record

    prompts, params = _prompts(2), _params(2)
    _serve(_engine(tmp_path), prompts, params)
    monkeypatch.setattr(record, "KV_LAYOUT_VERSION", record.KV_LAYOUT_VERSION + ".next")  # a later pool layout
    eng = _engine(tmp_path)
    assert _serve(eng, prompts, params) == _serve(_engine(), prompts, params)
    assert eng.kv_tier.stats.hit_tokens == 0 and eng.kv_tier.stats.errors == 0


def test_an_engine_built_in_one_thread_serves_from_another(tmp_path):
    import threading

    prompts, params = _prompts(1), _params(1)
    _serve(_engine(tmp_path), prompts, params)
    eng = _engine(tmp_path)
    out: list = []
    t = threading.Thread(target=lambda: out.append(_serve(eng, prompts, params)))
    t.start()
    t.join(120)
    assert out and out[0] == _serve(_engine(), prompts, params)
    assert eng.kv_tier.stats.hit_tokens > 0 and eng.kv_tier.stats.backend_errors == 0


def test_cli_kv_tier_flag(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "minienv", "ROMEO.\nBut soft, what light through yonder window breaks? " * 4,
           "--max-tokens", "6", "--temperature", "0", "--kv-tier", str(tmp_path / "tier")]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout and SQLiteStore(tmp_path / "tier").usage()[0] > 0
    bad = subprocess.run(cmd[:-1] + ["/proc/minienv_tier"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot create the KV tier directory" in bad.stderr
