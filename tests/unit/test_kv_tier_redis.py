"""The Redis KV tier against a real ``redis-server`` (the redis tier): store invariants, the engine on Redis, a
server killed mid-run, two engine processes sharing one server, concurrent writers, a full server, bad URLs.

Each test starts its own server on 127.0.0.1 (a random free port, a temporary directory) and stops it. Without
Debian's ``redis-server`` the tests skip with the reason; with MINIENV_REQUIRE_TIERS=1 (CI) that skip fails the run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import warnings

import pytest

from engine_harness import bundled
import numpy as np

from minienv.engine import InferenceEngine
from minienv.kv.hashing import ROOT_HASH
from minienv.kv_tier import RedisStore, TierConfigError, TierWarning, block_keys, decode_record
from minienv.kv_tier.local_redis import LocalRedis, free_port, redis_server_binary
from test_kv_tier_engine import CHILD, _params, _prompts, _serve
from test_kv_tier_store import _chain

pytestmark = pytest.mark.redis


def child_env(hashseed: str) -> dict[str, str]:
    return {**os.environ, "PYTHONHASHSEED": hashseed, "OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture
def redis_server(tmp_path):
    if redis_server_binary() is None:
        pytest.skip("redis tier: Debian's redis-server is not installed (apt-get install redis-server; CI does)")
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


def _engine(url, **kw):
    m, tok = bundled()
    return InferenceEngine(m, tok, kv_tier=url, **kw)


# ------------------------------------------------------------------------------------------------ the store
def test_redis_store_put_get_orphans_and_invariants(redis_server):
    store = RedisStore(redis_server.url)
    chain = _chain(4)
    assert store.put(*chain[1]).status == "orphan"
    for item in chain:
        assert store.put(*item).status == "stored"
    assert store.put(*chain[0]).status == "present"
    keys = [k for k, _, _ in chain]
    assert store.contains_prefix(keys) == 4 and store.contains_prefix([bytes(32)] + keys) == 0
    assert store.get_many(keys + [bytes(32)]) == [r for _, _, r in chain] + [None]
    assert store.usage() == (4, sum(len(r) for _, _, r in chain))
    store.check_invariants()


def test_redis_store_evicts_chain_tails_first_with_lru_refresh(redis_server):
    a, b = _chain(3, start=0), _chain(3, start=100, seed=10)
    size = len(a[0][2])
    store = RedisStore(redis_server.url, capacity_bytes=6 * size)
    for item in a + b:
        store.put(*item)
    store.get_many([k for k, _, _ in a])
    evicted = sum(store.put(*item).evicted for item in _chain(2, start=200, seed=20))
    assert evicted == 2 and store.evictions() == 2
    assert store.contains_prefix([k for k, _, _ in b]) == 1
    assert store.contains_prefix([k for k, _, _ in a]) == 3
    store.check_invariants()


def test_redis_store_random_operations_keep_invariants(redis_server):
    rng = random.Random(1)
    chains = [_chain(5, start=100 * i, seed=i) for i in range(6)]
    store = RedisStore(redis_server.url, capacity_bytes=9 * len(chains[0][0][2]))
    for _ in range(120):
        chain = rng.choice(chains)
        if rng.random() < 0.6:
            for item in chain[:rng.randint(1, 5)]:
                store.put(*item)
        else:
            store.get_many([k for k, _, _ in chain[:rng.randint(1, 5)]])
        store.check_invariants()


def test_bad_redis_urls_hosts_and_ports_are_clear_errors():
    with pytest.raises(TierConfigError, match="bad Redis URL"):
        RedisStore("redis://127.0.0.1:notaport/0")
    with pytest.raises(TierConfigError, match="bad Redis URL"):
        RedisStore("redis://127.0.0.1:99999/0")
    with pytest.raises(TierConfigError, match="cannot reach Redis"):
        RedisStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.5)  # nobody listens there
    with pytest.raises(TierConfigError, match="cannot reach Redis"):
        RedisStore("redis://no-such-host.invalid:6379/0", socket_timeout_s=0.5)
    with pytest.raises(TierConfigError, match="must be a non-empty str"):
        RedisStore("")


# ------------------------------------------------------------------------------------------------ the engine
def test_engine_on_redis_gives_the_outputs_of_tier_off(redis_server):
    prompts, params = _prompts(), _params(6)
    m, tok = bundled()
    off = _serve(InferenceEngine(m, tok), prompts, params)
    first = _engine(redis_server.url)
    assert _serve(first, prompts, params) == off and first.kv_tier.stats.stores > 0
    second = _engine(redis_server.url)
    assert _serve(second, prompts, params) == off
    assert second.kv_tier.stats.hit_tokens >= 144 and second.kv_tier.stats.errors == 0
    second.kv_tier.store.check_invariants()


def test_a_flipped_byte_in_redis_is_detected_and_recomputed(redis_server):
    prompts, params = _prompts(1, prefix_len=200), _params(1)
    m, tok = bundled()
    off = _serve(InferenceEngine(m, tok), prompts, params)
    eng = _engine(redis_server.url)
    _serve(eng, prompts, params)
    from minienv.kv_tier import block_keys

    victim = block_keys(prompts[0], 16, eng.kv_tier.fingerprint)[3]
    raw = bytearray(eng.kv_tier.store.raw(victim))
    raw[-100] ^= 0x80
    eng.kv_tier.store.overwrite_raw(victim, bytes(raw))
    again = _engine(redis_server.url)
    assert _serve(again, prompts, params) == off
    assert again.kv_tier.stats.corrupt_records == 1 and again.kv_tier.stats.hit_tokens == 3 * 16


def test_redis_killed_mid_run_engine_keeps_serving_counts_failures_and_reconnects(redis_server):
    prompts, params = _prompts(6, prefix_len=200, seed=5), _params(6)
    m, tok = bundled()
    off = _serve(InferenceEngine(m, tok), prompts, params)
    eng = _engine(redis_server.url, max_num_batched_tokens=64, max_num_seqs=3)
    eng.kv_tier.retry_interval_s = 0.05
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for _ in range(3):
        eng.step()
    assert eng.kv_tier.stats.stores > 0
    redis_server.kill()
    with pytest.warns(TierWarning, match="unavailable"):
        while eng.has_unfinished_requests():
            eng.step()
            eng.check_invariants()
            time.sleep(0.01)  # let retry intervals pass, so the dead server is tried again and again
    assert [tuple(eng.output(i).token_ids) for i in ids] == off  # no request failed because of the tier
    assert all(eng.output(i).finish_reason == "length" for i in ids)
    failures = eng.kv_tier.stats.backend_errors
    assert failures >= 2

    redis_server.start()  # back on the same port, empty (nothing persisted)
    time.sleep(0.06)
    stores_before = eng.kv_tier.stats.stores
    assert _serve(eng, prompts, params) == off  # local prefix hits now; new blocks of tails get stored again
    eng.reset_prefix_cache()
    assert _serve(eng, prompts, params) == off
    assert eng.kv_tier.stats.stores > stores_before and eng.kv_tier.stats.backend_errors == failures
    fresh = _engine(redis_server.url)
    assert _serve(fresh, prompts, params) == off and fresh.kv_tier.stats.hit_tokens > 0


def test_a_full_redis_warns_switches_the_tier_off_and_requests_finish(tmp_path):
    if redis_server_binary() is None:
        pytest.skip("redis tier: Debian's redis-server is not installed (apt-get install redis-server; CI does)")
    with LocalRedis(tmp_path / "r", maxmemory="1mb") as server:
        prompts, params = _prompts(4, prefix_len=300), _params(4)
        m, tok = bundled()
        off = _serve(InferenceEngine(m, tok), prompts, params)
        eng = _engine(server.url)
        with pytest.warns(TierWarning, match="switched off"):
            assert _serve(eng, prompts, params) == off
        assert not eng.kv_tier.enabled and "maxmemory" in eng.kv_tier.disabled_reason
        RedisStore(server.url).check_invariants()  # a refused write left nothing half done


# ------------------------------------------------------------------------------------------------ two processes
def _run_child(url, *args):
    out = subprocess.run([sys.executable, str(CHILD), url, *map(str, args)], env=child_env("0"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_engine_processes_share_one_redis(redis_server):
    """The second instance gets prefix hits on blocks the first computed, with identical outputs."""
    first = _run_child(redis_server.url)
    second = _run_child(redis_server.url)
    assert first["prefill_loaded"] == 0 and first["stats"]["stores"] == 50
    assert second["prefill_loaded"] >= 0.9 * second["prompt_tokens"] and second["token_ids"] == first["token_ids"]


def test_concurrent_writers_never_produce_a_record_that_fails_its_checks(redis_server):
    procs = [subprocess.Popen([sys.executable, str(CHILD), redis_server.url, "--prompt-seed", str(seed % 2)],
                              env=child_env(str(seed)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in range(3)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0]["token_ids"] == outs[2]["token_ids"]  # same prompt, same output, whoever wrote first
    store = RedisStore(redis_server.url)
    store.check_invariants()
    eng = _engine(redis_server.url)
    fp, checked = eng.kv_tier.fingerprint, 0
    for seed in (0, 1):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 2000, 800)]
        keys = block_keys(prompt, 16, fp)
        for j, key in enumerate(keys):
            decode_record(store.raw(key), fingerprint=fp, key=key, parent_key=keys[j - 1] if j else ROOT_HASH,
                          token_ids=prompt[16 * j:16 * j + 16], shape=eng.kv_tier.block_shape)
            checked += 1
    assert checked == 100


def test_nothing_warns_when_redis_is_healthy(redis_server):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TierWarning)
        _serve(_engine(redis_server.url), _prompts(2), _params(2))


def test_fixture_server_listens_only_on_loopback(redis_server):
    assert redis_server.url.startswith("redis://127.0.0.1:") and os.path.isdir(redis_server.directory)
