"""The gRPC server over the wire: a real :class:`EngineServer` on 127.0.0.1 (a free port), real grpc clients.

What must hold: streamed greedy output equals the in-process engine's, for concurrent requests; a cancelled call
or an expired deadline frees the request's blocks and the server keeps serving; bad requests get
INVALID_ARGUMENT with the engine's message, a flood RESOURCE_EXHAUSTED; health goes NOT_SERVING -> SERVING ->
NOT_SERVING (draining); reflection lists the service; the committed stubs are what grpcio-tools generates.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from minienv.engine import InferenceEngine
from minienv.sampling import SamplingParams
from minienv.serving import SERVICE_NAME, EngineServer, ServerBindError
from minienv.serving import minienv_pb2 as pb
from minienv.serving import minienv_pb2_grpc as pb_grpc
from serving_harness import finish_reason, kv_idle

REPO = Path(__file__).resolve().parents[2]
ENGINE_KW = dict(kv_budget_tokens=2048, block_size=16, max_num_seqs=4)
PROMPTS = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter", "O Romeo, Romeo",
           "All the world's a stage", "Once more unto the breach"]


def _engine(**kw) -> InferenceEngine:
    return InferenceEngine(**{**ENGINE_KW, **kw})


@pytest.fixture(scope="module")
def server():
    srv = EngineServer(_engine, max_waiting=64).start()
    srv.wait_until_serving()
    yield srv
    srv.stop(grace=0)


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MinienvEngineStub(channel)


def _request(prompt, max_tokens=12, **params) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=params.pop("temperature", 0.0), **params)
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling_params=sp)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=sp)


def _collect(responses) -> tuple[list[int], str, pb.GenerateComplete]:
    """The chunks' ids and text, and the one complete message (which must come last, exactly once)."""
    ids: list[int] = []
    text = ""
    complete = None
    for r in responses:
        assert complete is None, "a message after the complete message"
        if r.WhichOneof("response") == "chunk":
            ids += r.chunk.token_ids
            text += r.chunk.text
        else:
            complete = r.complete
    assert complete is not None, "the stream ended without a complete message"
    return ids, text, complete


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


# ---------------------------------------------------------------------------------------------- the proto
def test_committed_stubs_equal_what_grpcio_tools_generates(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "tools" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    assert [p.name for p in written] == list(gen.FILES)
    for p in written:
        committed = REPO / "minienv" / "serving" / p.name
        assert p.read_bytes() == committed.read_bytes(), f"{committed} is stale: run python tools/gen_proto.py"


# ---------------------------------------------------------------------------------------------- outputs
def test_concurrent_streams_equal_the_in_process_engines_greedy_output(server, stub):
    want = _engine().generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    got: dict[int, tuple] = {}

    def run(i: int) -> None:
        got[i] = _collect(stub.Generate(_request(PROMPTS[i]), timeout=30))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(len(PROMPTS)))
    for i, w in enumerate(want):
        ids, text, complete = got[i]
        assert len(w.token_ids) == 12
        assert ids == list(complete.output_ids) == list(w.token_ids), PROMPTS[i]
        assert text == complete.text == w.text
        assert complete.finish_reason == "length" and complete.prompt_tokens == len(w.prompt_token_ids)
        assert complete.ttft_s > 0 and complete.e2e_s >= complete.ttft_s
    assert kv_idle(server) == 0


def test_token_id_prompt_and_a_shared_prefix_reports_cached_tokens(server, stub):
    ids = server.call(lambda e: e.tokenizer.encode("The quality of mercy is not strained; it droppeth as the "
                                                   "gentle rain from heaven upon the place beneath"))
    assert len(ids) >= 16
    first = _collect(stub.Generate(_request(ids, max_tokens=4), timeout=30))[2]
    second = _collect(stub.Generate(_request(ids, max_tokens=4), timeout=30))[2]
    assert list(first.output_ids) == list(second.output_ids)
    assert second.cached_tokens >= 16 > first.cached_tokens


# ---------------------------------------------------------------------------------------------- cancellation
def _long(request_id: str, prompt: str = PROMPTS[0]) -> pb.GenerateRequest:
    """A request that runs for ~1000 steps (>= 1 s here) unless something stops it."""
    return pb.GenerateRequest(request_id=request_id, text=prompt,
                              sampling_params=pb.SamplingParams(max_tokens=1000, temperature=0.0))


def test_cancel_mid_stream_aborts_and_frees_the_blocks(server, stub):
    call = stub.Generate(_long("cancel-me"), timeout=30)
    got = [next(call) for _ in range(3)]
    assert all(r.WhichOneof("response") == "chunk" for r in got)
    assert server.call(lambda e: e.kv_cache_manager.pool.num_used_blocks) > 0  # the request holds blocks now
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    reason, n = finish_reason(server, "cancel-me")
    assert reason == "abort" and n < 1000  # aborted by the cancel, not run to its end for nobody
    assert kv_idle(server) == 0
    steps = server.call(lambda e: e.scheduler.num_steps)
    time.sleep(0.1)
    assert server.call(lambda e: e.scheduler.num_steps) == steps  # nothing keeps stepping for the gone client


def test_deadline_of_1ms_is_deadline_exceeded_and_the_server_keeps_serving(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_request(PROMPTS[1], max_tokens=800), timeout=0.001))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert kv_idle(server) == 0
    assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING
    ids, _, complete = _collect(stub.Generate(_request(PROMPTS[1], max_tokens=5), timeout=30))
    assert len(ids) == 5 and complete.finish_reason == "length"


def test_a_deadline_mid_stream_aborts_the_request_in_the_engine(server, stub):
    call = stub.Generate(_long("deadline-me", PROMPTS[3]), timeout=0.5)  # 1000 tokens take > 1.5 s here
    assert next(call).WhichOneof("response") == "chunk"  # it reached the engine and runs
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    reason, n = finish_reason(server, "deadline-me")
    assert reason == "abort" and n < 1000
    assert kv_idle(server) == 0


def test_abort_rpc_ends_the_stream_with_finish_reason_abort(server, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="to-abort", text=PROMPTS[2], sampling_params=pb.SamplingParams(
        max_tokens=800, temperature=0.0)), timeout=30)
    first = next(call)
    assert first.request_id == "to-abort"
    stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5)
    ids, _, complete = _collect(call)
    assert complete.finish_reason == "abort" and 1 <= len(complete.output_ids) < 800
    assert list(first.chunk.token_ids) + ids == list(complete.output_ids)
    assert kv_idle(server) == 0
    with pytest.raises(grpc.RpcError) as err:  # finished now: a second abort finds nothing
        stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------------------------------- bad requests
BAD = [
    (_request("hi", max_tokens=0), "max_tokens must be at least 1"),
    (_request("hi", temperature=-1.0), "temperature must be a finite number >= 0"),
    (_request("hi", top_p=0.0), "top_p must be in (0, 1]"),
    (_request("hi", top_k=-2), "top_k must be -1, 0 (off) or a positive int"),
    (_request("hi", seed=-1), "seed must be >= 0"),
    (_request(""), "empty"),
    (_request([5, 99999]), "token id 99999 out of range"),
    (_request([-3]), "out of range"),
    (pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=3)), "the request has no prompt"),
    (_request("hi", max_tokens=5000), "max_position_embeddings"),
]


@pytest.mark.parametrize("request_msg,message", BAD, ids=[m for _, m in BAD])
def test_bad_request_is_invalid_argument_with_the_engines_message(server, stub, request_msg, message):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_msg, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert kv_idle(server) == 0
    assert len(_collect(stub.Generate(_request("hi", max_tokens=2), timeout=30))[0]) == 2  # still serving


def test_abort_of_an_unknown_id_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(pb.AbortRequest(request_id="never-seen"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'never-seen'" in err.value.details()


def test_a_request_id_in_use_is_invalid_argument(server, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="dup", text="hi", sampling_params=pb.SamplingParams(
        max_tokens=800, temperature=0.0)), timeout=30)
    next(call)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(request_id="dup", text="hi"), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already used" in err.value.details()
    call.cancel()
    assert kv_idle(server) == 0


# ---------------------------------------------------------------------------------------------- back-pressure
def test_a_flood_gets_resource_exhausted_and_every_request_ends_one_way_or_the_other():
    srv = EngineServer(lambda: _engine(max_num_seqs=1), max_waiting=1).start()
    srv.wait_until_serving()
    n = 8
    results: dict[int, object] = {}
    barrier = threading.Barrier(n)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.MinienvEngineStub(ch)

            def run(i: int) -> None:
                barrier.wait()
                try:
                    results[i] = _collect(stub.Generate(_request(PROMPTS[i % len(PROMPTS)], max_tokens=150),
                                                        timeout=60))[2]
                except grpc.RpcError as exc:
                    results[i] = exc.code()

            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        assert len(results) == n  # nothing lost
        refused = [r for r in results.values() if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
        done = [r for r in results.values() if isinstance(r, pb.GenerateComplete)]
        assert len(refused) + len(done) == n, results
        assert refused and done  # the first is always admitted; the rest depends on when each arrives
        assert all(c.finish_reason == "length" and len(c.output_ids) == 150 for c in done)
        assert info.max_waiting == 1 and info.num_blocks_in_use == 0 and info.serving
        assert kv_idle(srv) == 0
    finally:
        srv.stop(grace=0)


# ---------------------------------------------------------------------------------------------- health, drain
def test_health_not_serving_until_loaded_then_serving_then_draining():
    release = threading.Event()

    def slow_factory() -> InferenceEngine:
        release.wait(10)  # the model "loads" until the test says so
        return _engine()

    srv = EngineServer(slow_factory).start()
    try:
        assert _health(srv.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _health(srv.address, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(srv.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.MinienvEngineStub(ch).Generate(_request("hi"), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
        release.set()
        srv.wait_until_serving()
        assert _health(srv.address) == _health(srv.address, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING

        with grpc.insecure_channel(srv.address) as ch:  # drain with a request in flight
            stub = pb_grpc.MinienvEngineStub(ch)
            call = stub.Generate(_request("hi", max_tokens=900), timeout=30)
            next(call)
            stopper = threading.Thread(target=srv.stop, kwargs={"grace": 0.5})
            stopper.start()
            deadline = time.monotonic() + 5
            while srv.draining is False and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _health(srv.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(_request("hi"), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:  # not finished within the grace period: ended, clearly
                list(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "stopped" in err.value.details()
            stopper.join(10)
        assert srv.engine_thread.engine.kv_cache_manager.pool.num_used_blocks == 0  # thread gone: safe to read
    finally:
        release.set()
        srv.stop(grace=0)


def test_reflection_lists_the_service_and_its_methods(server):
    with grpc.insecure_channel(server.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
        fd = db.FindFileContainingSymbol(SERVICE_NAME)
        assert fd.name == "minienv/v1/minienv.proto"
        (svc,) = [s for s in fd.service if s.name == "MinienvEngine"]
        assert [m.name for m in svc.method] == ["Generate", "Abort", "GetModelInfo", "GetServerInfo"]
        assert svc.method[0].server_streaming


def test_model_and_server_info(server, stub):
    m = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (m.vocab_size, m.eos_token_id, m.num_layers) == server.call(
        lambda e: (e.num_sampled_ids, e.eos_token_id, e.model.config.num_hidden_layers))
    s = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert s.serving and not s.draining and s.block_size == 16 and s.kv_budget_tokens == 2048 and s.max_waiting == 64


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ServerBindError, match="in use"):
            EngineServer(_engine, port=s.getsockname()[1])
    with pytest.raises(ValueError, match="port must be an int"):
        EngineServer(_engine, port=70000)


# ---------------------------------------------------------------------------------------------- the CLI
def _cli(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "minienv", "serve", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_serve_streams_then_drains_on_sigterm():
    proc = _cli("--port", "0", "--metrics-port", "0", "--kv-budget-tokens", "1024")
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (127\.0\.0\.1:\d+) \(health, reflection\), metrics at (http://\S+)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        with grpc.insecure_channel(m[1]) as ch:
            ids, text, complete = _collect(pb_grpc.MinienvEngineStub(ch).Generate(_request(PROMPTS[0]), timeout=30))
        want = _engine().generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))[0]
        assert ids == list(want.token_ids) and text == want.text
        import urllib.request

        assert "vllm:generation_tokens_total" in urllib.request.urlopen(m[2], timeout=5).read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "draining" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args,message", [
    (["--port", "70000"], "port must be in [0, 65535]"),
    (["--port", "abc"], "invalid port"),
    (["--max-waiting", "0"], "must be a positive integer"),
    (["--kv-budget-tokens", "0"], "must be a positive integer"),
    (["--host", "0.0.0.0"], "not a loopback address"),
    (["--grace", "-1"], "--grace must be"),
])
def test_cli_serve_bad_arguments_exit_2(args, message):
    proc = _cli(*args)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and message in err, err


def test_cli_serve_port_in_use_exits_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = _cli("--port", str(s.getsockname()[1]))
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "the port is in use" in err, err


def test_a_handler_that_fell_behind_sends_what_it_missed_as_one_chunk():
    """The engine's real per-step outputs, all queued before the handler reads: one batch, one chunk whose ids and
    text are the concatenation of the steps' deltas (= the finished output)."""
    import asyncio

    from minienv.serving.server import AsyncSink, _chunk

    engine = _engine()
    rid = engine.add_request("Friends, Romans, countrymen", SamplingParams(max_tokens=10, temperature=0.0))

    async def run() -> tuple[list, bool]:
        sink = AsyncSink(asyncio.get_running_loop())
        while engine.has_unfinished_requests():
            for out in engine.step():
                sink.queue.put_nowait(out)
        return await sink.batch(), sink.queue.empty()

    outs, drained = asyncio.run(run())
    assert drained and len(outs) >= 2 and outs[-1].finished
    msg = _chunk(rid, outs)
    assert msg.request_id == rid
    assert list(msg.chunk.token_ids) == list(outs[-1].token_ids)
    assert msg.chunk.text == outs[-1].text
    one = _chunk(rid, outs[:1])  # a handler that keeps up: one step's delta
    assert list(one.chunk.token_ids) == list(outs[0].delta_token_ids) and one.chunk.text == outs[0].delta_text


def test_stream_interval_sends_chunks_of_at_least_that_many_tokens_and_the_same_output():
    """stream_interval=4: every chunk but the last carries >= 4 new tokens; chunks concatenated == complete ==
    the in-process engine; stream_interval=0 is refused."""
    with pytest.raises(ValueError, match="stream_interval"):
        EngineServer(_engine, stream_interval=0)
    srv = EngineServer(_engine, stream_interval=4).start()
    try:
        srv.wait_until_serving()
        want = _engine().generate(PROMPTS[:3], SamplingParams(max_tokens=13, temperature=0.0))
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.MinienvEngineStub(ch)
            for prompt, ref in zip(PROMPTS[:3], want):
                chunks, complete = [], None
                for msg in stub.Generate(_request(prompt, max_tokens=13), timeout=30):
                    if msg.WhichOneof("response") == "chunk":
                        chunks.append(list(msg.chunk.token_ids))
                    else:
                        complete = msg.complete
                assert all(len(c) >= 4 for c in chunks[:-1]) and len(chunks) <= -(-13 // 4)
                assert [t for c in chunks for t in c] == list(complete.output_ids) == list(ref.token_ids)
    finally:
        srv.stop(grace=0)
