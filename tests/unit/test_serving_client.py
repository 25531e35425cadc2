"""The client (:class:`minienv.serving.Client`), the launcher and ``python -m minienv client``, against real
``python -m minienv serve`` processes on loopback.

What must hold: a completion over the wire equals the in-process engine's greedy output under either routing,
and its chunks concatenate to it; cancel, abort and deadlines end the request and give its blocks back; errors
arrive as ``ServingError`` with the status code and the server's message; round robin uses every instance; prefix
routing sends a shared prefix to one instance (which then serves it from its cache) and gives way when that
instance is overloaded, and ranks an instance that refused a call last for a while (it is still tried); the CLI
streams and exits with clear codes.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from minienv.engine import InferenceEngine
from minienv.sampling import SamplingParams
from minienv.serving import Client, PrefixRouter, ServingError, launch
from minienv.serving.router import rendezvous_order

REPO = Path(__file__).resolve().parents[2]
KV = 2048
PROMPTS = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter of our discontent",
           "O Romeo, Romeo", "All the world's a stage", "Once more unto the breach, dear friends"]
SYSTEM = ("You are a player in a company of actors. Speak your lines in the manner of the old plays, with "
          "kings and fools and lovers in them. ")


@pytest.fixture(scope="module")
def cluster():
    with launch(2, ["--kv-budget-tokens", str(KV), "--grace", "1"], cwd=REPO) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    engine = InferenceEngine(kv_budget_tokens=KV)

    def run(prompts, max_tokens=12):
        return engine.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0))

    return run


def _idle(client: Client, timeout: float = 5.0) -> dict[str, tuple[int, int]]:
    """Per instance (blocks in use, requests running + waiting), once every instance is idle or at ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        infos = {a: (i.num_blocks_in_use, i.num_running + i.num_waiting) for a, i in client.server_infos().items()}
        if all(v == (0, 0) for v in infos.values()) or time.monotonic() > end:
            return infos


@pytest.mark.parametrize("routing", ["round_robin", "prefix"])
def test_concurrent_completions_equal_the_in_process_engine(cluster, reference, routing):
    want = reference(PROMPTS)
    got: dict[int, object] = {}
    with Client(cluster.addresses, routing=routing) as client:
        def run(i: int) -> None:
            got[i] = client.generate(PROMPTS[i], 12)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(got) == list(range(len(PROMPTS)))
        for i, w in enumerate(want):
            c = got[i]
            assert c.token_ids == tuple(w.token_ids) and c.text == w.text, PROMPTS[i]
            assert c.finish_reason == "length" and c.prompt_tokens == len(w.prompt_token_ids)
            assert c.address in cluster.addresses and c.ttft_s > 0
        assert client.in_flight == {a: 0 for a in cluster.addresses}
        assert _idle(client) == {a: (0, 0) for a in cluster.addresses}


def test_stream_chunks_concatenate_to_the_completion_and_token_id_prompts_work(cluster, reference):
    # 120 tokens: a handler that falls behind sends what it missed as one chunk (by design), so 10 tokens came as
    # one chunk on a loaded CI host once the one-token decode got faster; 120 take long enough to stream in pieces
    want = reference([PROMPTS[0]], 120)[0]
    with Client(cluster.addresses[0]) as client:
        stream = client.stream(list(want.prompt_token_ids), 120)
        chunks = list(stream)
    assert len(chunks) >= 2
    assert tuple(t for c in chunks for t in c.token_ids) == stream.completion.token_ids == tuple(want.token_ids)
    assert "".join(c.text for c in chunks) == stream.completion.text == want.text
    assert stream.completion.address == cluster.addresses[0] == stream.address


def test_cancel_ends_the_stream_quietly_and_frees_the_blocks(cluster):
    with Client(cluster.addresses[0]) as client:
        stream = client.stream(PROMPTS[0], 1000)
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 3:
                stream.cancel()
        assert stream.cancelled and stream.completion is None and seen >= 3
        assert _idle(client) == {cluster.addresses[0]: (0, 0)}
        assert client.generate(PROMPTS[1], 4).finish_reason == "length"  # still serving


def test_abort_by_id_from_another_thread_ends_with_finish_reason_abort(cluster):
    with Client(cluster.addresses, routing="round_robin") as client:
        stream = client.stream(PROMPTS[2], 1000, request_id="abort-me")
        it = iter(stream)
        next(it)  # running
        client.abort("abort-me")  # the balanced client does not know the instance: it asks each
        for _ in it:
            pass
        assert stream.completion.finish_reason == "abort" and len(stream.completion.token_ids) < 1000
        with pytest.raises(ServingError) as err:
            client.abort("abort-me")
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "abort-me" in err.value.details
        assert _idle(client) == {a: (0, 0) for a in cluster.addresses}


def test_a_deadline_is_deadline_exceeded_and_the_request_leaves_the_engine(cluster):
    with Client(cluster.addresses[1]) as client:
        with pytest.raises(ServingError) as err:
            client.generate(PROMPTS[0], 1000, deadline=0.3)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.request_id
        assert _idle(client)[cluster.addresses[1]] == (0, 0)
        with pytest.raises(ValueError, match="deadline must be"):
            client.stream(PROMPTS[0], 4, deadline=0)


@pytest.mark.parametrize("kwargs,code,message", [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt=[10**9]), grpc.StatusCode.INVALID_ARGUMENT, "token id"),
])
def test_bad_requests_raise_serving_error_with_the_servers_message(cluster, kwargs, code, message):
    with Client(cluster.addresses) as client:
        with pytest.raises(ServingError) as err:
            client.generate(**kwargs)
        assert err.value.code == code and message in err.value.details, err.value
        assert err.value.address in cluster.addresses
        assert client.generate(PROMPTS[0], 2).finish_reason == "length"


def test_round_robin_uses_every_instance(cluster):
    with Client(cluster.addresses, routing="round_robin") as client:
        client.wait_until_serving()  # round_robin picks among connected instances: connect to every one first
        served = {client.generate(PROMPTS[i % len(PROMPTS)], 2).address for i in range(8)}
    assert served == set(cluster.addresses)


def test_prefix_routing_sends_a_shared_prefix_to_one_instance_which_serves_it_from_cache(cluster, reference):
    prompts = [SYSTEM + p for p in PROMPTS]
    router = PrefixRouter(prefix_blocks=2)
    with Client(cluster.addresses, routing="prefix", router=router) as client:
        done = [client.generate(p, 4) for p in prompts]
    assert len({c.address for c in done}) == 1
    assert all(c.cached_tokens >= 2 * 16 for c in done[1:])
    assert [c.token_ids for c in done] == [tuple(w.token_ids) for w in reference(prompts, 4)]
    assert router.decisions["prefix"] == len(prompts)
    key = router.prefix_key(router.tokenizer.encode(prompts[0]))
    assert done[0].address == rendezvous_order(key, cluster.addresses)[0]


def test_prefix_routing_gives_way_when_the_chosen_instance_is_overloaded(cluster):
    router = PrefixRouter(prefix_blocks=1, overload_factor=2.0, overload_min=2)
    prompt = SYSTEM + "And what says the king?"
    with Client(cluster.addresses, routing="prefix", router=router) as client:
        router.block_size = client.server_info().block_size
        chosen = rendezvous_order(router.prefix_key(load_ids(prompt)), cluster.addresses)[0]
        held = [client.stream(prompt, 900) for _ in range(2)]
        its = [iter(s) for s in held]
        for it in its:
            next(it)  # both running on the chosen instance
        assert [s.address for s in held] == [chosen, chosen] and client.in_flight[chosen] == 2
        other = client.generate(prompt, 2)
        assert other.address != chosen and router.decisions["overloaded"] == 1
        for s in held:
            s.cancel()
        assert _idle(client) == {a: (0, 0) for a in cluster.addresses}


def load_ids(text: str) -> list[int]:
    from minienv.tokenizer import load_tokenizer

    return load_tokenizer().encode(text)


def test_prefix_router_rejects_bad_settings():
    with pytest.raises(ValueError, match="prefix_blocks"):
        PrefixRouter(prefix_blocks=0)
    with pytest.raises(ValueError, match="overload_factor"):
        PrefixRouter(overload_factor=0.5)


def test_rendezvous_moves_only_the_keys_of_a_removed_instance():
    addrs = [f"127.0.0.1:{5000 + i}" for i in range(4)]
    keys = [bytes([i]) * 32 for i in range(64)]
    before = {k: rendezvous_order(k, addrs)[0] for k in keys}
    after = {k: rendezvous_order(k, addrs[:3])[0] for k in keys}
    assert len(set(before.values())) == 4
    assert all(after[k] == before[k] for k in keys if before[k] != addrs[3])


def test_info_and_health(cluster):
    with Client(cluster.addresses) as client:
        assert client.model_info().vocab_size > 0
        info = client.server_info(cluster.addresses[1])
        assert info.serving and info.block_size == 16 and info.kv_budget_tokens == KV
        assert [client.health(a) for a in cluster.addresses] == ["SERVING", "SERVING"]
        with pytest.raises(ValueError, match="not one of this client's addresses"):
            client.server_info("127.0.0.1:1")


@pytest.mark.parametrize("args,message", [
    (dict(addresses=[]), "at least one address"),
    (dict(addresses="localhost"), "HOST:PORT"),
    (dict(addresses="127.0.0.1:5", routing="random"), "routing must be one of"),
    (dict(addresses=["127.0.0.1:5", "127.0.0.1:5"]), "duplicate"),
    (dict(addresses="127.0.0.1:5", max_attempts=9), "max_attempts"),
    (dict(addresses="127.0.0.1:5", eject_seconds=-1), "eject_seconds"),
    (dict(addresses=["127.0.0.1:5", "[::1]:6"]), "one IP family"),
    (dict(addresses=["no-such-host.invalid:5"]), "cannot resolve the host of 'no-such-host.invalid:5'"),
    (dict(addresses="127.0.0.1:5", eject_seconds="2"), "eject_seconds"),
])
def test_client_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        Client(**args)


def test_nothing_listening_is_unavailable():
    with Client("127.0.0.1:1") as client:
        with pytest.raises(ServingError) as err:
            client.generate("hi", 2, deadline=10)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert client.health() == "UNREACHABLE"


def test_launch_rejects_bad_arguments_and_reports_a_server_that_cannot_start():
    with pytest.raises(ValueError, match="n must be"):
        launch(0)
    with pytest.raises(ValueError, match="picks the ports itself"):
        launch(1, ["--port", "5"])
    with pytest.raises(RuntimeError, match="exited with status 2"):
        launch(1, ["--kv-budget-tokens", "0"])


# ---------------------------------------------------------------------------------------------- the CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minienv", "client", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_cli_client_streams_the_engines_output(cluster, reference):
    want = reference([PROMPTS[0]], 10)[0]
    r = _cli(PROMPTS[0], "--address", cluster.addresses[0], "--max-tokens", "10")
    assert r.returncode == 0 and r.stdout == want.text + "\n", r.stderr


@pytest.mark.parametrize("args,code,message", [
    (["", "--address", None], 1, "INVALID_ARGUMENT: the prompt is empty"),
    (["hi", "--address", "127.0.0.1:1"], 1, "UNAVAILABLE"),
    (["hi", "--address", "nowhere"], 2, "HOST:PORT"),
    (["hi", "--max-tokens", "0"], 2, "must be a positive integer"),
    (["hi", "--deadline", "-1"], 2, "--deadline must be"),
])
def test_cli_client_errors(cluster, args, code, message):
    r = _cli(*[cluster.addresses[0] if a is None else a for a in args])
    assert r.returncode == code and message in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- TLS
def test_tls_servers_behind_either_routing_and_the_cli(tmp_path, reference):
    from serving_harness import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    want = reference([PROMPTS[0]], 6)[0]
    with launch(2, ["--kv-budget-tokens", str(KV), "--tls-cert", cert, "--tls-key", key], cwd=REPO) as cluster:
        for routing in ("round_robin", "prefix"):
            with Client(cluster.addresses, routing=routing, tls_ca=cert) as client:
                client.wait_until_serving()
                done = client.generate(PROMPTS[0], 6)
                assert done.token_ids == tuple(want.token_ids) and done.address in cluster.addresses
        with Client(cluster.addresses[0]) as plaintext:  # a plaintext client gets no answer from a TLS server
            with pytest.raises(ServingError) as err:
                plaintext.generate(PROMPTS[0], 2, deadline=10)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        r = _cli(PROMPTS[0], "--address", cluster.addresses[1], "--max-tokens", "6", "--tls-ca", str(cert))
        assert r.returncode == 0 and r.stdout == want.text + "\n", r.stderr
    r = _cli("hi", "--tls-ca", str(tmp_path / "missing.pem"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_cli_client_ctrl_c_exits_130_and_the_server_aborts_the_request(cluster):
    import signal

    # Ctrl-C in a terminal: SIGINT at its default disposition in the child, even when this test runs under a job
    # that ignores it (a background shell job starts with SIGINT ignored, and children inherit that)
    proc = subprocess.Popen([sys.executable, "-m", "minienv", "client", PROMPTS[0], "--address", cluster.addresses[0],
                             "--max-tokens", "900"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.read(10)  # streaming
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with Client(cluster.addresses[0]) as client:
        assert _idle(client) == {cluster.addresses[0]: (0, 0)}


def test_prefix_routing_reads_the_block_size_from_an_instance_that_answers(cluster):
    with Client(["127.0.0.1:1", *cluster.addresses], routing="prefix") as client:
        done = client.generate(SYSTEM + "Who is there?", 2)
        assert done.address in cluster.addresses and client.router.block_size == 16


def test_prefix_routing_ejects_an_instance_that_refused_so_later_requests_go_straight_to_a_live_one(cluster):
    dead = "127.0.0.1:1"  # nothing listens there: every call to it is refused (UNAVAILABLE, nothing sent)
    with Client([dead, *cluster.addresses], routing="prefix", eject_seconds=60) as client:
        router = client.router
        prompt = next(p for p in (f"Scene {i}. " + SYSTEM for i in range(64))
                      if router.rank(client, p)[0] == dead)  # a prefix whose first choice is the dead address
        assert client.ejected == set()
        first = client.stream(prompt, 2)
        done = first.result()
        assert first.attempts == 2 and done.address in cluster.addresses  # refused, then served by the next one
        assert client.ejected == {dead}
        before = router.decisions["ejected"]
        again = client.stream(prompt, 2)
        assert again.result().token_ids == done.token_ids and again.attempts == 1  # no refused call first
        assert router.decisions["ejected"] == before + 1
        assert router.rank(client, prompt)[-1] == dead  # ranked last, never dropped


def test_ejection_only_reorders_and_ends_after_its_time():
    """Every instance down: each call still tries all of them (nothing is lost to ejection); an ejection lasts
    ``eject_seconds`` per consecutive refusal, then the instance ranks by its prefix again."""
    dead = ["127.0.0.1:1", "127.0.0.1:2"]
    with Client(dead, routing="prefix", eject_seconds=0.5, router=PrefixRouter(block_size=16)) as client:
        for _ in range(2):
            stream = client.stream(SYSTEM, 2, deadline=10)
            with pytest.raises(ServingError) as err:
                stream.result()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and stream.attempts == 2
        assert client.ejected == set(dead)
        time.sleep(0.5 * 2 + 0.2)  # two refusals each: ejected for 2 x 0.5 s
        assert client.ejected == set()


def test_servers_on_ipv6_loopback_behind_either_routing(reference):
    """``serve --host ::1`` prints ``[::1]:PORT``; round robin balances over an ``ipv6:`` target, prefix routing
    over one channel per instance, and both serve the engine's output."""
    want = reference(PROMPTS[:2])
    with launch(2, ["--host", "::1", "--kv-budget-tokens", str(KV), "--grace", "1"], cwd=REPO) as six:
        assert all(a.startswith("[::1]:") for a in six.addresses), six.addresses
        for routing in ("round_robin", "prefix"):
            with Client(six.addresses, routing=routing) as client:
                client.wait_until_serving()
                for w, p in zip(want, PROMPTS[:2]):
                    done = client.generate(p, 12)
                    assert done.token_ids == tuple(w.token_ids) and done.address in six.addresses
