"""The OpenAI-compatible HTTP API over the wire, driven by the official ``openai`` client against a running server.

What must hold: streamed and non-streamed completions and chat completions equal the in-process engine's output
token for token (greedy, and sampled with a seed); the HTTP API and gRPC share one engine thread; /v1/models,
/health and /metrics answer; a client that disconnects mid-stream (or stops waiting for a whole response) has its
request aborted in the engine and its blocks returned.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from serving_harness import PROMPTS, finish_reason, kv_idle, make_engine, running_server

from minienv.sampling import SamplingParams
from minienv.serving import minienv_pb2 as pb
from minienv.serving import minienv_pb2_grpc as pb_grpc
from minienv.serving.openai_api import render_chat

MODEL = "minienv"
IDS = {"return_token_ids": True}  # vLLM's extension: each choice carries its generated token ids


@pytest.fixture(scope="module")
def server():
    with running_server(http_port=0, model_name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
                       timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    return make_engine()


def _want(reference, prompt, **params):
    return reference.generate([prompt], SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **params}))[0]


def _get(server, path: str) -> tuple[int, str, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


# ---------------------------------------------------------------------------------------------- completions
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_completion_equals_the_in_process_engines_greedy_output(server, client, reference, prompt):
    want = _want(reference, prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=IDS)
    (choice,) = r.choices
    assert choice.token_ids == list(want.token_ids) and len(want.token_ids) == 12
    assert choice.text == want.text and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert kv_idle(server) == 0


def test_streamed_completion_equals_the_in_process_output_chunk_by_chunk(server, client, reference):
    want = _want(reference, PROMPTS[3], max_tokens=20)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=IDS))
    *pieces, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert [t for c in pieces for t in c.choices[0].token_ids] == list(want.token_ids)
    assert "".join(c.choices[0].text for c in pieces) == want.text
    assert len({c.id for c in chunks}) == 1
    assert kv_idle(server) == 0


def test_token_id_prompt_seeded_sampling_and_stop_strings_match_the_engine(client, reference):
    ids = reference.tokenizer.encode(PROMPTS[4])
    want = _want(reference, ids)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body=IDS)
    assert r.choices[0].token_ids == list(want.token_ids)
    sampled = dict(temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=16)
    want = _want(reference, PROMPTS[5], **sampled)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=16, temperature=0.9, top_p=0.95,
                                  seed=7, extra_body={**IDS, "top_k": 40})
    assert r.choices[0].token_ids == list(want.token_ids) and r.choices[0].text == want.text
    want = _want(reference, PROMPTS[0], max_tokens=40, stop=["\n"])
    assert want.finish_reason == "stop"  # the case really stops on the string
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=["\n"])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"


def test_concurrent_http_and_grpc_clients_share_the_engine_and_get_their_own_outputs(server, client, reference):
    want = reference.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    got: dict[int, list[int]] = {}

    def over_http(i: int) -> None:
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0,
                                           stream=True, extra_body=IDS)
        got[i] = [t for c in stream for t in c.choices[0].token_ids]

    def over_grpc(i: int) -> None:
        with grpc.insecure_channel(server.address) as ch:
            responses = pb_grpc.MinienvEngineStub(ch).Generate(pb.GenerateRequest(
                text=PROMPTS[i], sampling_params=pb.SamplingParams(max_tokens=12, temperature=0.0)), timeout=30)
            got[i] = [r for r in responses if r.WhichOneof("response") == "complete"][0].complete.output_ids[:]

    threads = [threading.Thread(target=over_http if i % 2 else over_grpc, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: list(ids) for i, ids in got.items()} == {i: list(w.token_ids) for i, w in enumerate(want)}
    assert kv_idle(server) == 0


# ---------------------------------------------------------------------------------------------- chat
MESSAGES = [{"role": "system", "content": "A room in the castle."},
            {"role": "user", "name": "Hamlet", "content": "What news, my lord?"}]


def test_chat_template_is_a_play():
    assert render_chat(MESSAGES) == "A room in the castle.\n\nHAMLET.\nWhat news, my lord?\n\nASSISTANT.\n"
    assert render_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hail."},
                        {"role": "user", "content": "Bye"}]) == "USER.\nHi\n\nASSISTANT.\nHail.\n\nUSER.\nBye\n\nASSISTANT.\n"


def test_chat_completion_streamed_and_not_equals_the_engine_on_the_template(server, client, reference):
    want = _want(reference, render_chat(MESSAGES), max_tokens=16)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body=IDS)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.token_ids == list(want.token_ids) and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=16,
                                                 temperature=0, stream=True, extra_body=IDS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert [t for c in chunks for t in c.choices[0].token_ids] == list(want.token_ids)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert kv_idle(server) == 0


# ---------------------------------------------------------------------------------------------- disconnects
def test_a_client_that_disconnects_mid_stream_has_its_request_aborted_and_blocks_freed(server, client):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1000, temperature=0, stream=True)
    it = iter(stream)
    first = [next(it) for _ in range(3)]
    rid = first[0].id.removeprefix("cmpl-")
    assert server.call(lambda e: e.kv_cache_manager.pool.num_used_blocks) > 0  # it holds blocks now
    stream.close()  # the client goes away mid-stream
    reason, n = finish_reason(server, rid)
    assert reason == "abort" and n < 1000  # aborted for the gone client, not run to its end for nobody
    assert kv_idle(server) == 0
    assert server.call(lambda e: e.stats.num_blocks_in_use) == 0
    steps = server.call(lambda e: e.scheduler.num_steps)
    time.sleep(0.1)
    assert server.call(lambda e: e.scheduler.num_steps) == steps  # nothing keeps stepping


def test_a_client_that_stops_waiting_for_a_whole_response_has_its_request_aborted(server):
    generated = server.call(lambda e: e.stats.num_generated_tokens)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
                       timeout=0.5) as impatient:
        with pytest.raises(openai.APITimeoutError):  # 1000 tokens take > 1.5 s here
            impatient.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=1000, temperature=0)
    assert kv_idle(server, timeout=10) == 0  # the server noticed the closed connection and aborted the request
    assert 0 < server.call(lambda e: e.stats.num_generated_tokens) - generated < 1000


# ---------------------------------------------------------------------------------------------- the other routes
def test_models_health_and_metrics(server, client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "minienv"
    assert model.max_model_len == server.call(lambda e: e.model.config.max_position_embeddings)
    assert _get(server, "/health")[:2] == (200, '{"status":"ok"}')
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    status, text, headers = _get(server, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    line = [x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total{")][0]
    assert float(line.rsplit(" ", 1)[1]) == server.call(lambda e: e.stats.num_generated_tokens)


def test_health_is_503_while_loading_and_draining():
    release = threading.Event()

    def slow_factory():
        release.wait(10)
        return make_engine()

    with running_server(slow_factory, wait=False, http_port=0) as srv:
        status, body, _ = _get(srv, "/health")
        assert status == 503 and "loading" in json.loads(body)["error"]["message"]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0) as c:
            with pytest.raises(openai.APIStatusError) as err:
                c.completions.create(model="minienv", prompt="hi", max_tokens=2)
            assert err.value.status_code == 503
            release.set()
            srv.wait_until_serving()
            assert _get(srv, "/health")[0] == 200
            srv.draining = True  # what stop() sets first
            status, body, _ = _get(srv, "/health")
            assert status == 503 and "draining" in json.loads(body)["error"]["message"]
            with pytest.raises(openai.APIStatusError) as err:
                c.completions.create(model="minienv", prompt="hi", max_tokens=2)
            assert err.value.status_code == 503 and "draining" in err.value.message


def test_a_server_that_stops_mid_stream_ends_the_stream_with_an_error_event():
    with running_server(http_port=0) as srv:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=30) as c:
            stream = iter(c.completions.create(model="minienv", prompt=PROMPTS[0], max_tokens=1000, temperature=0,
                                               stream=True))
            next(stream)
            stopper = threading.Thread(target=srv.stop, kwargs={"grace": 0.2})
            stopper.start()
            with pytest.raises(openai.APIError, match="the server stopped"):
                list(stream)
            stopper.join(15)
        assert srv.engine_thread.engine.kv_cache_manager.pool.num_used_blocks == 0  # thread gone: safe to read


def test_n_and_best_of_of_1_or_null_are_accepted(client):
    for extra in ({"n": 1}, {"n": None}, {"best_of": 1}):
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0, extra_body=extra)
        assert r.usage.completion_tokens == 2


# ---------------------------------------------------------------------------------------------- the CLI
def test_cli_http_port_in_use_exits_2():
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = subprocess.run([sys.executable, "-m", "minienv", "serve", "--port", "0", "--http-port",
                               str(s.getsockname()[1])], cwd=repo, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(repo), OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 2 and "for HTTP: the port is in use" in proc.stderr, proc.stderr


def test_cli_serve_http_port_serves_the_openai_api_beside_grpc(reference):
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "minienv", "serve", "--port", "0", "--http-port", "0",
                             "--kv-budget-tokens", "2048"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        grpc_line, http_line = proc.stdout.readline(), proc.stdout.readline()
        m = re.search(r"HTTP API at (http://127\.0\.0\.1:\d+/v1)", http_line)
        assert m and "(health, reflection)" in grpc_line, grpc_line + http_line + (
            proc.stderr.read() if proc.poll() is not None else "")
        with openai.OpenAI(base_url=m[1], api_key="unused", max_retries=0, timeout=30) as c:
            (model,) = c.models.list().data
            r = c.completions.create(model=model.id, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert model.id == "minienv-bundled" and r.choices[0].text == _want(reference, PROMPTS[0]).text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metrics_without_the_extra_is_a_404_that_says_what_to_install():
    """A real interpreter where prometheus_client cannot be imported (None in sys.modules blocks the import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = """
import sys, urllib.request, urllib.error
sys.modules["prometheus_client"] = None
sys.path.insert(0, "tests/unit")
from serving_harness import running_server
with running_server(http_port=0) as srv:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10)
    except urllib.error.HTTPError as exc:
        print(exc.code, exc.read().decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo,
                         env=dict(os.environ, PYTHONPATH=str(repo), OPENBLAS_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    status, body = out.stdout.split(" ", 1)
    assert status == "404" and "pip install 'minienv[metrics]'" in json.loads(body)["error"]["message"]
