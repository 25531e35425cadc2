"""``python -m minienv "To be, or not to be"`` — stream a continuation from the bundled model, through the engine.

``python -m minienv --prompts-file prompts.txt`` generates every line of the file *together* (continuous
batching over a paged, prefix-cached KV budget) and prints each completion, then the batching statistics:
throughput, time to first token, time per output token, prefix-cache hit rate, preemptions, KV use.

Both go through :class:`minienv.engine.InferenceEngine` (``--kv-budget-tokens``, ``--block-size``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--scheduling``, ``--no-prefix-caching``); ``--no-cache`` is the
one exception: it bypasses the engine and recomputes the whole sequence every token (notebook 02's slow baseline).

``python -m minienv serve --port 50051 [--http-port 8000] [--metrics-port 9090] [engine options]`` serves the
engine over gRPC and, with ``--http-port``, the OpenAI-compatible HTTP API (:mod:`minienv.serving`, the ``serve``
extra) on 127.0.0.1 until SIGTERM or Ctrl-C, then drains (``--grace``). Another host needs ``--tls-cert`` and
``--tls-key``, or ``--insecure``.
``python -m minienv client "prompt" [--address HOST:PORT]`` streams a completion from such a server to stdout.
``python -m minienv simulate --model Llama-3-8B --gpu H100-SXM ...`` runs the engine on a simulated GPU
(:mod:`minienv.sim.cli`, flags like vLLM's ``benchmark_serving``).
A prompt that is literally ``serve`` or ``client`` is written after ``--``: ``python -m minienv -- serve``.

Bad arguments exit with status 2 and a usage message on stderr (argparse's convention); a request the model
cannot serve (missing files, prompt too long, a prompt that can never fit the KV budget) exits with status 1 and a
one-line ``minienv: error:`` message.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Sequence


def positive_int(text: str) -> int:
    """argparse type for sizes: a bad value is a usage error (exit 2) naming the flag, not a failure deep inside."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine's flags (shared by generation and ``serve``)."""
    eng = p.add_argument_group("engine")
    eng.add_argument("--kv-budget-tokens", type=positive_int, default=None,
                     help="KV cache size in tokens, for all requests together (default: 16384; 2048 for a real "
                          "model given by --model NAME|.gguf|HF folder)")
    eng.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16)")
    eng.add_argument("--max-num-seqs", type=positive_int, default=16, help="most requests running at once (default: 16)")
    eng.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                     help="most tokens computed per engine step (default: 512)")
    eng.add_argument("--scheduling", choices=("continuous", "static"), default="continuous",
                     help="continuous batching, or the static-batching baseline (default: continuous)")
    eng.add_argument("--no-prefix-caching", action="store_true", help="do not reuse K/V of shared prefixes")
    eng.add_argument("--kv-tier", default=None, metavar="DIR|redis://HOST:PORT/DB",
                     help="a persistent KV tier: full blocks are kept there and loaded instead of recomputed, "
                          "across runs (a directory: embedded SQLite store; a redis:// URL: a shared Redis)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minienv",
        description="Continue a prompt (or every line of a file, batched) with minienv's numpy Llama.",
        epilog="python -m minienv serve --help: serve the engine over gRPC and HTTP instead.",
    )
    p.add_argument("prompt", nargs="?", default=None, help="text to continue (or use --prompts-file)")
    p.add_argument("--prompts-file", type=Path, default=None, metavar="FILE",
                   help="generate for every non-blank line of FILE together and print batching statistics")
    p.add_argument("--max-tokens", type=int, default=100, help="most tokens to generate (default: 100)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: 0.8; with --chat 0.2, SmolLM2's recommended setting: a 135M model "
                        "rambles at 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1 = off (default: 0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass in (0, 1] (default: 0.95; with --chat 0.9)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed for reproducible sampling (with --prompts-file, line i uses seed + i)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable)")
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="a real model: 'smollm2-135m-instruct' (downloaded once into ~/.cache/minienv/models), a "
                        "Llama .gguf file or a Hugging Face folder; or a minienv model directory with "
                        "--tokenizer (default: the bundled toy, assets/target)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="FILE",
                   help="tokenizer.json (default: bundled assets/tokenizer.json)")
    p.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="ask a chat model (--model NAME) one question: the message is rendered with the model's "
                        "chat template, and the answer ends at its end-of-turn token")
    add_engine_options(p)
    p.add_argument("--no-cache", action="store_true",
                   help="no KV cache at all: recompute the whole sequence every token (slow; single prompt only)")
    return p


def _read_prompts(path: Path) -> list[str]:
    """The non-blank lines of ``path``; a missing, unreadable or non-UTF-8 file is an error naming it."""
    try:
        text = path.read_text(encoding="utf-8")  # OSError if missing: exit 1 with its message
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts (one prompt per line; blank lines are skipped)")
    return prompts


def _is_utf8_encodable(text: str) -> bool:
    """False for a command-line argument that held invalid UTF-8 (Python keeps those bytes as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _percentile(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(xs, q)) if xs else 0.0


def format_batch_stats(engine, outputs, wall_s: float) -> str:
    """The batching statistics block printed after ``--prompts-file`` runs (also handy in notebooks)."""
    s = engine.stats
    n_tok = sum(len(o.token_ids) for o in outputs)
    ttft = [o.metrics.ttft * 1e3 for o in outputs if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot * 1e3 for o in outputs if o.metrics.tpot is not None and len(o.token_ids) > 1]
    ttft_steps = [o.metrics.ttft_steps for o in outputs if o.metrics.ttft_steps is not None]
    reasons: dict[str, int] = {}
    for o in outputs:
        reasons[o.finish_reason or "?"] = reasons.get(o.finish_reason or "?", 0) + 1
    lines = [
        "--- batching statistics ---",
        f"requests            {len(outputs)} ({', '.join(f'{k}: {v}' for k, v in sorted(reasons.items()))})",
        f"generated tokens    {n_tok} in {wall_s:.2f} s over {s.num_steps} engine steps "
        f"({engine.scheduling} batching, max_num_seqs={engine.max_num_seqs})",
        f"throughput          {n_tok / wall_s if wall_s > 0 else 0.0:.1f} tokens/s",
        f"TTFT                mean {sum(ttft) / max(len(ttft), 1):.1f} ms, p50 {_percentile(ttft, 50):.1f} ms, "
        f"max {max(ttft, default=0.0):.1f} ms (mean {sum(ttft_steps) / max(len(ttft_steps), 1):.1f} steps)",
        f"TPOT                mean {sum(tpot) / max(len(tpot), 1):.2f} ms/token",
        f"prefix cache        hit rate {s.prefix_cache_hit_rate:.1%} ({s.prefix_cache_hits_tokens} of "
        f"{s.prefix_cache_queries_tokens} prompt tokens), evicted {s.evicted_blocks} blocks",
        f"preemptions         {s.num_preemptions}",
        f"KV budget           {s.kv_budget_tokens} tokens ({s.num_blocks} blocks of {s.block_size}), "
        f"peak use {s.peak_kv_usage:.1%}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    if argv[:1] == ["download"]:
        return download_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from minienv.sim.cli import simulate_main

        return simulate_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.prompt, args.prompts_file, args.chat)) != 1:
        parser.error("give a prompt, --prompts-file FILE or --chat MESSAGE (one of them, not both)")
    if args.chat is not None and args.model is None:
        parser.error("--chat needs a chat model: --model smollm2-135m-instruct (or a .gguf / HF folder)")
    if args.no_cache and args.prompts_file is not None:
        parser.error("--no-cache runs a single prompt without the engine; it cannot be used with --prompts-file")
    if args.prompt is not None and not _is_utf8_encodable(args.prompt):
        parser.error("the prompt is not valid UTF-8 text")
    # One BLAS thread unless the user says otherwise: at these matrix sizes a second thread costs more in hand-off
    # than it saves, and on a busy machine OpenBLAS threads spin (measured: 100x slower). Must precede numpy.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    from minienv.sampling import SamplingParams

    def params_for(i: int) -> SamplingParams:
        seed = None if args.seed is None else args.seed + i
        chat = args.chat is not None
        temperature = args.temperature if args.temperature is not None else (0.2 if chat else 0.8)
        top_p = args.top_p if args.top_p is not None else (0.9 if chat else 0.95)
        return SamplingParams(max_tokens=args.max_tokens, temperature=temperature, top_k=args.top_k,
                              top_p=top_p, seed=seed, stop=args.stop)

    try:
        params = params_for(0)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))  # exits 2

    from minienv.model import load_model
    from minienv.tokenizer import load_tokenizer

    try:
        prompts = None if args.prompts_file is None else _read_prompts(args.prompts_file)  # fail before loading
        chat_template = None
        budget = args.kv_budget_tokens
        if _is_real_model(args.model, args.tokenizer):
            from minienv.model.pretrained import load_pretrained

            pre = load_pretrained(args.model)
            model, tokenizer, chat_template = pre.model, pre.tokenizer, pre.chat_template
            budget = budget or 2048
        else:
            tokenizer = load_tokenizer(args.tokenizer)  # the cheaper file first: a bad one fails fast
            model = load_model(args.model)
        budget = budget or 16384
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}")
        if args.chat is not None:
            if chat_template is None:
                raise ValueError(f"the model {args.model} has no chat template: give a prompt to continue instead")
            args.prompt = chat_template.render([{"role": "user", "content": args.chat}])
        if args.no_cache:
            return _run_no_cache(model, tokenizer, args.prompt, params)

        from minienv.engine import InferenceEngine

        try:
            engine = InferenceEngine(
                model, tokenizer, kv_budget_tokens=budget, block_size=args.block_size,
                enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, scheduling=args.scheduling,
                kv_tier=args.kv_tier)
        except ValueError as exc:  # bad engine sizes or a bad --kv-tier are argument errors
            parser.error(str(exc))
        if prompts is None:
            for out in engine.stream([args.prompt], params):
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
            return 0
        start = time.perf_counter()
        outputs = engine.generate(prompts, [params_for(i) for i in range(len(prompts))])
        wall = time.perf_counter() - start
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            sys.stdout.write(f"=== [{i}] {prompt}\n{out.text}\n")
        sys.stdout.write("\n" + format_batch_stats(engine, outputs, wall) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError, ImportError) as exc:
        print(f"minienv: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _is_real_model(model: str | None, tokenizer: Path | None) -> bool:
    """``--model`` names a known model, a ``.gguf`` file, or a folder that carries its own tokenizer.json (and no
    ``--tokenizer`` was given): the real-model path; otherwise the minienv model directory + tokenizer path."""
    if model is None or tokenizer is not None:
        return False
    from minienv.model.hub import KNOWN_MODELS

    path = Path(model)
    has = (lambda name: (path / name).is_file()) if path.is_dir() else (lambda name: False)
    return model in KNOWN_MODELS or path.is_file() or not path.exists() or has("tokenizer.json") \
        or not has("config.json")


def download_main(argv: Sequence[str]) -> int:
    """``python -m minienv download NAME``: fetch a known model into the cache (a progress bar on stderr) and print
    its path. Exit 1 with one ``minienv download: error:`` line when offline or a checksum does not match."""
    from minienv.model.hub import KNOWN_MODELS, cache_dir

    p = argparse.ArgumentParser(prog="python -m minienv download",
                                description=f"Download a known model into {cache_dir()} (MINIENV_MODELS_DIR "
                                            "overrides) once; later runs use the cached, checksum-verified file.")
    p.add_argument("name", help=f"one of {sorted(KNOWN_MODELS)}")
    p.add_argument("--force", action="store_true", help="download again even when a good copy is cached")
    args = p.parse_args(list(argv))
    from minienv.model.hub import download

    try:
        path = download(args.name, force=args.force)
    except (OSError, ValueError) as exc:
        print(f"minienv download: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(path)
    return 0


def port_number(text: str) -> int:
    """argparse type for a TCP port: an int in [0, 65535] (0 picks a free one and prints it)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port: {text!r} (an int in [0, 65535])") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535] (0 picks a free one), got {value}")
    return value


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minienv serve",
        description="Serve the engine over gRPC (minienv.v1.MinienvEngine, with grpc.health.v1 and reflection) "
                    "and, with --http-port, the OpenAI-compatible HTTP API, until SIGTERM or Ctrl-C.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, loopback only; any other needs TLS or --insecure)")
    p.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                   help="serve gRPC and HTTP over TLS with this certificate chain (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without TLS: the APIs are then plaintext and unauthenticated")
    p.add_argument("--port", type=port_number, default=50051, help="gRPC port; 0 picks a free one (default: 50051)")
    p.add_argument("--http-port", type=port_number, default=None, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics) on this port; 0 picks a free one")
    p.add_argument("--max-message-bytes", type=positive_int, default=4 * 1024 * 1024, metavar="N",
                   help="largest request accepted, in bytes: gRPC's receive limit, and HTTP bodies (413) "
                        "(default: 4 MiB)")
    p.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                   help="a gRPC stream's chunk carries at least N new tokens (the last may carry fewer): fewer, "
                        "larger messages, less serving CPU per token (default: 1, every token as it comes)")
    p.add_argument("--metrics-port", type=port_number, default=None, metavar="PORT",
                   help="also serve Prometheus /metrics on this port (needs the metrics extra)")
    p.add_argument("--max-waiting", type=positive_int, default=64,
                   help="most requests waiting for admission; one more gets RESOURCE_EXHAUSTED (default: 64)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds in-flight requests get to finish on shutdown before they are aborted (default: 5)")
    p.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                   help="stop (as on SIGTERM) as soon as process PID, which must be this server's parent, is gone: "
                        "a server started by a notebook or a test dies with its kernel however the kernel ends")
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="a real model ('smollm2-135m-instruct', a Llama .gguf file, a Hugging Face folder): "
                        "/v1/chat/completions then applies its chat template; or a minienv model directory with "
                        "--tokenizer (default: the bundled toy)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="FILE",
                   help="tokenizer.json (default: bundled assets/tokenizer.json)")
    add_engine_options(p)
    return p


def _say(line: str, stream=None) -> None:
    """Print a status line, and never fail on it: when the process that read our output is gone (a killed kernel
    held the pipe), a write raises BrokenPipeError — and a stopping server must still stop."""
    try:
        print(line, file=stream or sys.stdout, flush=True)
    except (OSError, ValueError):
        pass


def _served_name(model: str | None) -> str:
    """What ``/v1/models`` reports: the known name, or the file's / folder's name, or ``minienv-bundled``."""
    if model is None:
        return "minienv-bundled"
    from minienv.model.hub import KNOWN_MODELS

    return model if model in KNOWN_MODELS else Path(model).stem


def serve_main(argv: Sequence[str]) -> int:
    """``python -m minienv serve``: bind (a bad or busy port exits 2 before anything loads), load the model on the
    engine thread (health NOT_SERVING until then), serve until SIGTERM / SIGINT, drain for ``--grace`` seconds."""
    parser = build_serve_parser()
    args = parser.parse_args(list(argv))
    if not args.grace >= 0:
        parser.error(f"--grace must be a number of seconds >= 0, got {args.grace}")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together: give both, or neither")
    if not args.insecure and args.tls_cert is None and not _is_loopback(args.host):
        parser.error(f"--host {args.host} is not a loopback address: anyone who reaches it could use the engine over "
                     "plaintext, unauthenticated gRPC and HTTP; give --tls-cert and --tls-key, or pass --insecure to "
                     "do that anyway")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy (see main)
    import signal
    import threading

    try:
        from minienv.serving import EngineServer, ServerBindError, TLSConfig
        if args.http_port is not None:
            import minienv.serving.openai_api  # noqa: F401 - Starlette and uvicorn, checked before anything binds
    except ImportError as exc:
        print(f"minienv serve: error: serving needs the serve extra (pip install 'minienv[serve]'): {exc}",
              file=sys.stderr)
        return 1
    if args.parent_pid is not None:
        from minienv.serving.lifeline import ParentPidError, watch_parent

        def parent_gone() -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # the same path as any stop: drain for --grace seconds, exit
            _say(f"minienv serve: the process that started this server (pid {args.parent_pid}) is gone: stopping",
                 sys.stderr)

        try:
            watch_parent(args.parent_pid, parent_gone)
        except ParentPidError as exc:
            print(f"minienv serve: error: {exc}", file=sys.stderr)
            return 1
    metrics_servers: list = []

    def build_engine():
        from minienv.engine import InferenceEngine
        from minienv.metrics import serve_metrics
        from minienv.model import load_model
        from minienv.tokenizer import load_tokenizer

        if _is_real_model(args.model, args.tokenizer):
            model, tokenizer, budget = args.model, None, args.kv_budget_tokens  # the engine loads it by name
        else:
            model, tokenizer = load_model(args.model), load_tokenizer(args.tokenizer)
            budget = args.kv_budget_tokens or 16384
        engine = InferenceEngine(
            model, tokenizer, kv_budget_tokens=budget,
            block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            scheduling=args.scheduling, kv_tier=args.kv_tier)
        if args.metrics_port is not None:
            metrics_servers.append(serve_metrics(engine, args.metrics_port, args.host))
        return engine

    try:
        tls = None if args.tls_cert is None else TLSConfig(args.tls_cert, args.tls_key)
        server = EngineServer(build_engine, host=args.host, port=args.port, max_waiting=args.max_waiting,
                              model_name=_served_name(args.model),
                              http_port=args.http_port, max_message_bytes=args.max_message_bytes, tls=tls,
                              stream_interval=args.stream_interval)
    except (ServerBindError, ValueError) as exc:
        parser.error(str(exc))  # exits 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    try:
        server.wait_until_serving(timeout=600)
    except OSError as exc:  # MetricsServerError (port in use) is an OSError too: an argument problem
        server.stop(grace=0)
        from minienv.metrics import MetricsServerError

        if isinstance(exc, MetricsServerError):
            parser.error(str(exc))
        print(f"minienv serve: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # bad engine sizes, a bad --kv-tier
        server.stop(grace=0)
        parser.error(str(exc))
    metrics = f", metrics at {metrics_servers[0].url}" if metrics_servers else ""
    secure = ", TLS" if tls is not None else ""
    print(f"minienv serve: serving minienv.v1.MinienvEngine on {server.address} (health, reflection{secure}){metrics}",
          flush=True)
    if server.http_port is not None:
        scheme = "https" if tls is not None else "http"
        http_host = f"[{args.host}]" if ":" in args.host else args.host  # a URL brackets an IPv6 host
        print(f"minienv serve: OpenAI-compatible HTTP API at {scheme}://{http_host}:{server.http_port}/v1", flush=True)
    # Wait in short slices, not one untimed wait: a SIGTERM the kernel hands to one of gRPC's threads only sets
    # Python's pending-signal flag, and the main thread runs the handler when it next wakes — an untimed wait
    # never wakes, so the server ignored the signal until SIGKILL (seen under load, about once in 40 stops).
    while not stop.wait(0.2):
        pass
    _say(f"minienv serve: draining (grace {args.grace:g} s)")
    server.stop(grace=args.grace)
    for m in metrics_servers:
        m.close()
    return 0


def build_client_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minienv client",
                                description="Stream a completion from a running `python -m minienv serve` to stdout.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--address", default="127.0.0.1:50051", metavar="HOST:PORT",
                   help="the server (default: 127.0.0.1:50051, the local `serve`'s default)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (with --temperature > 0)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS", help="give up after this long")
    p.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                   help="speak TLS, trusting this certificate (the server's own, if it is self-signed)")
    return p


def client_main(argv: Sequence[str]) -> int:
    """``python -m minienv client "prompt"``: stream the text to stdout. Exit 0 when the server finished the
    request, 1 with ``minienv client: error: CODE: message`` on stderr when it failed (a server that is not there
    is ``UNAVAILABLE``), 2 for bad arguments, 130 on Ctrl-C (the request is cancelled, so the server aborts it)."""
    parser = build_client_parser()
    args = parser.parse_args(list(argv))
    if args.deadline is not None and not args.deadline > 0:
        parser.error(f"--deadline must be a number of seconds > 0, got {args.deadline}")
    try:
        from minienv.serving.client import Client, ServingError
    except ImportError as exc:
        print(f"minienv client: error: the client needs the serve extra (pip install 'minienv[serve]'): {exc}",
              file=sys.stderr)
        return 1
    try:
        if args.tls_ca is not None and not args.tls_ca.is_file():
            parser.error(f"--tls-ca {str(args.tls_ca)!r} does not exist")
        with Client(args.address, tls_ca=args.tls_ca) as client:
            stream = client.stream(args.prompt, args.max_tokens, temperature=args.temperature, seed=args.seed,
                                   deadline=args.deadline)
            try:
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                stream.cancel()
                return 130
    except ValueError as exc:  # a malformed --address
        parser.error(str(exc))
    except ServingError as exc:
        sys.stdout.write("\n")
        hint = f" (is `python -m minienv serve` running on {args.address}?)" if exc.code.name == "UNAVAILABLE" else ""
        print(f"minienv client: error: {exc.code.name}: {exc.details}{hint}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    if stream.completion is not None and stream.completion.finish_reason == "error":
        print(f"minienv client: error: the request failed in the engine: {stream.completion.error}", file=sys.stderr)
        return 1
    return 0


def _run_no_cache(model, tokenizer, prompt: str, params) -> int:
    from minienv.generate import TextStream, generate, trim_at_stop

    tokens = generate(model, tokenizer, prompt, params, use_cache=False)
    stream = TextStream(tokenizer.decode)
    text = ""
    for token in tokens:
        text += stream.push(token)
    text += stream.flush()
    sys.stdout.write(trim_at_stop(text, params.stop_strings) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
