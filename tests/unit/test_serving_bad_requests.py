"""Bad requests over the wire, to both front ends of one running server: each gets the right status code (gRPC)
or HTTP status with OpenAI's error shape, no block is left behind, and the server keeps serving — after every
single one, a good request over the same front end succeeds.

Also here: the hardening a client cannot talk the server out of — the message-size limit (gRPC's receive limit,
HTTP 413), prompts refused on their length before the tokenizer runs (:class:`PromptLimits`), back-pressure (429),
and TLS with a certificate the test makes (both front ends, and the CLI's rule that only loopback may go without).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from serving_harness import PROMPTS, finish_reason, kv_idle, make_engine, running_server, self_signed_cert

from minienv.sampling import SamplingParams
from minienv.serving import PromptLimits, TLSConfig
from minienv.serving import minienv_pb2 as pb
from minienv.serving import minienv_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
MODEL = "minienv"
MAX_MESSAGE_BYTES = 256 * 1024  # small enough that an oversized request is cheap to send


@pytest.fixture(scope="module")
def server():
    with running_server(http_port=0, model_name=MODEL, max_message_bytes=MAX_MESSAGE_BYTES) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MinienvEngineStub(channel)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def limits(server) -> PromptLimits:
    return server.engine_thread.prompt_limits


def _grpc_request(prompt, max_tokens=4, **params) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=params.pop("temperature", 0.0), **params)
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling_params=sp)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=sp)


def _grpc_still_serving(server, stub) -> None:
    assert kv_idle(server) == 0
    done = [r for r in stub.Generate(_grpc_request("hi", max_tokens=2), timeout=30)
            if r.WhichOneof("response") == "complete"]
    assert len(done) == 1 and len(done[0].complete.output_ids) == 2


def _http_still_serving(server, http) -> None:
    assert kv_idle(server) == 0
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------------------- gRPC
def _too_long_text(limits: PromptLimits) -> str:
    return "a" * (limits.max_prompt_chars + 1)


GRPC_BAD = [  # (name, request or a function of the limits, status code, fragment of the message)
    ("bad parameter", _grpc_request("hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("empty prompt", _grpc_request(""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("empty token-id prompt", _grpc_request([]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("no prompt", pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    ("token id out of range", _grpc_request([1, 10**6]), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    ("max_tokens past the model", _grpc_request("hi", max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT,
     "max_position_embeddings"),
    ("too long text prompt", lambda lim: _grpc_request(_too_long_text(lim)), grpc.StatusCode.INVALID_ARGUMENT,
     "before tokenizing"),
    ("too many token ids", lambda lim: _grpc_request([5] * (lim.max_prompt_tokens + 1)),
     grpc.StatusCode.INVALID_ARGUMENT, "token ids"),
    ("oversized message", _grpc_request("a" * (MAX_MESSAGE_BYTES + 1)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
]


@pytest.mark.parametrize("name,request_msg,code,fragment", GRPC_BAD, ids=[b[0] for b in GRPC_BAD])
def test_grpc_bad_request_gets_its_status_and_the_server_keeps_serving(server, stub, limits, name, request_msg,
                                                                       code, fragment):
    msg = request_msg(limits) if callable(request_msg) else request_msg
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(msg, timeout=30))
    assert err.value.code() == code, err.value.details()
    assert fragment in err.value.details()
    _grpc_still_serving(server, stub)


def test_grpc_abort_of_an_unknown_id_is_not_found(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'no-such-request'" in err.value.details()
    _grpc_still_serving(server, stub)


def test_grpc_unknown_method_is_unimplemented(server, stub):
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary("/minienv.v1.MinienvEngine/NoSuchMethod", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    _grpc_still_serving(server, stub)


def test_grpc_deadline_of_1ms_is_deadline_exceeded(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_grpc_request(PROMPTS[1], max_tokens=800), timeout=0.001))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _grpc_still_serving(server, stub)


def test_grpc_client_cancel_mid_stream_is_cancelled_and_frees_the_blocks(server, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="bad-cancel", text=PROMPTS[2], sampling_params=pb.SamplingParams(
        max_tokens=1000, temperature=0.0)), timeout=30)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    reason, n = finish_reason(server, "bad-cancel")
    assert reason == "abort" and n < 1000
    _grpc_still_serving(server, stub)


def test_a_prompt_too_long_is_refused_before_the_tokenizer_runs(server, stub, http, limits):
    """The length check costs a ``len()``: the engine's tokenizer is never called for such a prompt."""
    calls = []

    def spy(engine):
        encode = engine.tokenizer.encode
        engine.tokenizer.encode = lambda text: (calls.append(len(text)), encode(text))[1]
        return encode

    original = server.call(spy)
    try:
        text = _too_long_text(limits)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_grpc_request(text), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 2})
        assert r.status_code == 400 and "before tokenizing" in r.json()["error"]["message"]
        assert calls == []
        list(stub.Generate(_grpc_request("a" * 40), timeout=30))  # a short one is tokenized: the spy sees it
        assert calls == [40]
    finally:
        server.call(lambda e: setattr(e.tokenizer, "encode", original))


def test_prompt_limits_refuse_only_prompts_that_cannot_fit(server, limits):
    """The character bound is sound: no text longer than it tokenizes to few enough tokens (a token is at most
    the longest token's bytes, a character at least one byte) — checked on the worst case, the longest token
    repeated, which tokenizes to the fewest tokens per character."""
    max_pos = server.call(lambda e: e.model.config.max_position_embeddings)
    assert limits.max_prompt_tokens == max_pos - 1
    tok = server.engine_thread.engine.tokenizer  # immutable: read-only use from the test thread is safe
    longest = max(range(tok.vocab_size), key=lambda i: len(tok.id_to_bytes(i)))
    assert limits.max_prompt_chars == limits.max_prompt_tokens * len(tok.id_to_bytes(longest))
    word = tok.id_to_bytes(longest).decode("utf-8", errors="replace")
    for text in (word * (limits.max_prompt_chars // len(word) + 1), "x" * (limits.max_prompt_chars + 1),
                 "é" * (limits.max_prompt_chars + 1)):
        assert limits.check(text) is not None and len(tok.encode(text)) > limits.max_prompt_tokens
    assert limits.check("a" * limits.max_prompt_chars) is None  # at the bound: the engine's exact check decides
    assert limits.check([1] * limits.max_prompt_tokens) is None
    assert "token ids" in limits.check([1] * (limits.max_prompt_tokens + 1))


# ---------------------------------------------------------------------------------------------- HTTP
def _body(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


HTTP_BAD = [  # (name, method, path, json body or raw bytes, status, param, fragment of the message)
    ("bad temperature", "POST", "/v1/completions", _body(temperature=-1), 400, "temperature", "temperature"),
    ("bad top_p", "POST", "/v1/completions", _body(top_p=0), 400, "top_p", "top_p"),
    ("empty prompt", "POST", "/v1/completions", _body(prompt=""), 400, None, "empty"),
    ("n=2", "POST", "/v1/completions", _body(n=2), 400, "n", "not supported"),
    ("best_of", "POST", "/v1/completions", _body(best_of=3), 400, "best_of", "not supported"),
    ("logprobs", "POST", "/v1/completions", _body(logprobs=2), 400, "logprobs", "not supported"),
    ("echo", "POST", "/v1/completions", _body(echo=True), 400, "echo", "not supported"),
    ("presence_penalty", "POST", "/v1/completions", _body(presence_penalty=0.5), 400, "presence_penalty",
     "not supported"),
    ("logit_bias", "POST", "/v1/completions", _body(logit_bias={"5": 10}), 400, "logit_bias", "not supported"),
    ("unknown parameter", "POST", "/v1/completions", _body(temprature=0.5), 400, "temprature", "Unrecognized"),
    ("wrong type max_tokens", "POST", "/v1/completions", _body(max_tokens="ten"), 400, "max_tokens", "int"),
    ("wrong type prompt", "POST", "/v1/completions", _body(prompt=5), 400, "prompt", "string or a list"),
    ("two prompts", "POST", "/v1/completions", _body(prompt=["a", "b"]), 400, "prompt", "one prompt"),
    ("wrong type stream", "POST", "/v1/completions", _body(stream="yes"), 400, "stream", "boolean"),
    ("stream_options without stream", "POST", "/v1/completions", _body(stream_options={"include_usage": True}),
     400, "stream_options", "stream=true"),
    ("token id out of range", "POST", "/v1/completions", _body(prompt=[1, 10**6]), 400, None, "out of range"),
    ("max_tokens past the model", "POST", "/v1/completions", _body(max_tokens=5000), 400, None,
     "max_position_embeddings"),
    ("missing model", "POST", "/v1/completions", {"prompt": "hi"}, 400, "model", "required"),
    ("missing prompt", "POST", "/v1/completions", {"model": MODEL}, 400, "prompt", "required"),
    ("invalid JSON", "POST", "/v1/completions", b'{"model": ', 400, None, "not valid JSON"),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("chat: content not a string", "POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", "string"),
    ("chat: unknown role", "POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "role"),
    ("chat: no messages", "POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages",
     "non-empty"),
    ("chat: tools", "POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools", "not supported"),
    ("unknown model", "POST", "/v1/completions", _body(model="gpt-4o"), 404, "model", "does not exist"),
    ("unknown path", "POST", "/v1/engines", _body(), 404, None, "no route"),
    ("wrong method", "GET", "/v1/completions", None, 405, None, "not allowed"),
    ("oversized body", "POST", "/v1/completions", _body(prompt="a" * MAX_MESSAGE_BYTES), 413, None, "larger than"),
]


@pytest.mark.parametrize("name,method,path,body,status,param,fragment", HTTP_BAD, ids=[b[0] for b in HTTP_BAD])
def test_http_bad_request_gets_its_status_in_openais_shape_and_the_server_keeps_serving(
        server, http, name, method, path, body, status, param, fragment):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = http.request(method, path, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    _http_still_serving(server, http)


def test_http_oversized_body_is_413_before_it_is_read_even_without_a_length(server, http):
    """A chunked body (no Content-Length) is counted as it arrives and refused once past the limit."""
    def chunks():
        yield b'{"model": "minienv", "prompt": "'
        for _ in range(MAX_MESSAGE_BYTES // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    _http_still_serving(server, http)


def test_http_errors_reach_the_openai_client_as_its_own_exceptions(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model=MODEL, prompt="hi", n=2)
        assert err.value.body["param"] == "n"
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="no-such-model", prompt="hi")
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True)
        assert err.value.body["param"] == "logprobs"


def test_http_client_disconnect_mid_stream_aborts_and_frees_the_blocks(server, http):
    """A raw socket: send a streaming request, read the first event, vanish."""
    generated = server.call(lambda e: e.stats.num_generated_tokens)
    body = json.dumps(_body(prompt=PROMPTS[3], max_tokens=1000, temperature=0, stream=True)).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        head = s.recv(65536)
        while b"data: " not in head:
            head += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200")
        rid = re.search(rb'"id":"cmpl-([0-9a-f]+)"', head + s.recv(65536))[1].decode()
    reason, n = finish_reason(server, rid)
    assert reason == "abort" and n < 1000
    assert server.call(lambda e: e.stats.num_generated_tokens) - generated < 1000
    _http_still_serving(server, http)


def test_a_full_waiting_queue_is_429_over_http_and_resource_exhausted_over_grpc():
    with running_server(lambda: make_engine(max_num_seqs=1), http_port=0, max_waiting=1) as srv:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.MinienvEngineStub(ch)
            running = stub.Generate(_grpc_request(PROMPTS[0], max_tokens=900), timeout=30)
            next(running)  # admitted and running; the one seat is taken
            waiting = stub.Generate(_grpc_request(PROMPTS[1], max_tokens=900), timeout=30)
            deadline = time.monotonic() + 5
            while srv.call(lambda e: len(e.scheduler.waiting)) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            with httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=30) as http:
                r = http.post("/v1/completions", json={"model": "minienv", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 429 and "waiting queue is full" in r.json()["error"]["message"]
                assert r.json()["error"]["type"] == "rate_limit_error"
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(_grpc_request("hi"), timeout=30))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                running.cancel()
                waiting.cancel()
                assert kv_idle(srv) == 0
                r = http.post("/v1/completions", json={"model": "minienv", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200  # the queue drained: served again


# ---------------------------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


def test_tls_serves_both_front_ends_and_refuses_plaintext(cert):
    cert_file, key_file = cert
    want = make_engine().generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))
    with running_server(http_port=0, tls=TLSConfig(cert_file, key_file), model_name=MODEL) as srv:
        creds = grpc.ssl_channel_credentials(root_certificates=cert_file.read_bytes())
        with grpc.secure_channel(srv.address, creds) as ch:
            out = [r for r in pb_grpc.MinienvEngineStub(ch).Generate(_grpc_request(PROMPTS[0], max_tokens=6),
                                                                     timeout=30)][-1].complete
        assert list(out.output_ids) == list(want[0].token_ids)
        with grpc.insecure_channel(srv.address) as ch:  # plaintext to a TLS port: no connection
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.MinienvEngineStub(ch).Generate(_grpc_request("hi"), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        context = ssl.create_default_context(cafile=str(cert_file))
        with openai.OpenAI(base_url=f"https://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(verify=context)) as c:
            r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
        assert r.choices[0].text == want[0].text
        with pytest.raises(httpx.HTTPError):  # an unverified certificate is refused by a default client
            httpx.get(f"https://127.0.0.1:{srv.http_port}/health", timeout=5)
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port gets no answer
            httpx.get(f"http://127.0.0.1:{srv.http_port}/health", timeout=5)


def test_tls_config_refuses_missing_or_mismatched_files(cert, tmp_path):
    cert_file, key_file = cert
    with pytest.raises(ValueError, match="does not exist"):
        TLSConfig(tmp_path / "nope.pem", key_file)
    other_cert, _ = self_signed_cert(tmp_path)
    with pytest.raises(ValueError, match="do not load as a PEM pair"):
        TLSConfig(other_cert, key_file)


def _cli(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "minienv", "serve", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_non_loopback_host_needs_tls_or_insecure_and_tls_needs_both_files(cert):
    cert_file, key_file = cert
    for args, message in [(["--host", "0.0.0.0"], "--tls-cert and --tls-key, or pass --insecure"),
                          (["--tls-cert", str(cert_file)], "go together"),
                          (["--tls-cert", str(key_file), "--tls-key", str(key_file)], "PEM pair"),
                          (["--max-message-bytes", "0"], "must be a positive integer")]:
        proc = _cli("--port", "0", *args)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and message in err, (args, err)


def test_cli_serves_tls_on_both_front_ends(cert):
    cert_file, key_file = cert
    proc = _cli("--port", "0", "--http-port", "0", "--tls-cert", str(cert_file), "--tls-key", str(key_file),
                "--kv-budget-tokens", "1024")
    try:
        grpc_line, http_line = proc.stdout.readline(), proc.stdout.readline()
        m = re.search(r"on (127\.0\.0\.1:\d+) \(health, reflection, TLS\)", grpc_line)
        h = re.search(r"HTTP API at (https://127\.0\.0\.1:\d+/v1)", http_line)
        assert m and h, grpc_line + http_line + (proc.stderr.read() if proc.poll() is not None else "")
        creds = grpc.ssl_channel_credentials(root_certificates=cert_file.read_bytes())
        with grpc.secure_channel(m[1], creds) as ch:
            info = pb_grpc.MinienvEngineStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert info.serving
        r = httpx.get(h[1].removesuffix("/v1") + "/health", verify=ssl.create_default_context(cafile=str(cert_file)),
                      timeout=10)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
