"""``python -m minienv``: runs in a subprocess, as a user would run it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from minienv.model import LlamaConfig, random_weights, save_checkpoint

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minienv", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A random model and a byte-level tokenizer with no merges (257 ids: 256 bytes + end-of-text)."""
    from minienv.tokenizer import BPETokenizer

    root = tmp_path_factory.mktemp("tiny")
    tok_path = BPETokenizer([]).save(root / "tokenizer.json")
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
    save_checkpoint(root / "model", cfg, random_weights(cfg, seed=0, scale=0.3))
    return root / "model", tok_path


def test_help():
    r = run("--help")
    assert r.returncode == 0
    for flag in ("--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--model", "--tokenizer"):
        assert flag in r.stdout


def test_streams_deterministic_greedy_text(tiny):
    model, tok = tiny
    a = run("hello", "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "8", "--temperature", "0")
    b = run("hello", "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "8", "--temperature", "0",
            "--no-cache")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.endswith("\n")
    s1 = run("hello", "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "8", "--seed", "3")
    s2 = run("hello", "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "8", "--seed", "3")
    assert s1.returncode == 0 and s1.stdout == s2.stdout


@pytest.mark.parametrize("args,msg", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-3"], "top_k"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "lots"], "--max-tokens"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_exit_nonzero_with_message(args, msg):
    r = run("hi", *args)
    assert r.returncode == 2
    assert msg in r.stderr and r.stdout == ""


def test_missing_prompt():
    r = run()
    assert r.returncode == 2 and "prompt" in r.stderr


def test_runtime_errors_exit_1(tiny, tmp_path):
    model, tok = tiny
    r = run("x", "--model", str(tmp_path / "nope"), "--tokenizer", str(tok))
    assert r.returncode == 1 and "minienv: error: model directory not found" in r.stderr
    r = run("x" * 60, "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "10")
    assert r.returncode == 1 and "max_position_embeddings" in r.stderr


def test_bundled_model_continues_hamlet():
    r = run("To be, or not to be", "--max-tokens", "20", "--temperature", "0", timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 0


# ---------------------------------------------------------------------------------------------- through the engine
def test_single_prompt_goes_through_the_engine_and_equals_the_engine_api(tiny):
    from minienv.engine import InferenceEngine
    from minienv.model import load_model
    from minienv.sampling import SamplingParams
    from minienv.tokenizer import load_tokenizer

    model, tok = tiny
    r = run("hello", "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "8", "--temperature", "0",
            "--kv-budget-tokens", "64", "--block-size", "4")
    assert r.returncode == 0, r.stderr
    engine = InferenceEngine(load_model(model), load_tokenizer(tok), kv_budget_tokens=64, block_size=4)
    (out,) = engine.generate(["hello"], SamplingParams(max_tokens=8, temperature=0))
    assert r.stdout == out.text + "\n"


def test_prompts_file_generates_together_and_prints_batching_statistics(tiny, tmp_path):
    model, tok = tiny
    prompts = ["The same long prefix, then one", "The same long prefix, then two", "", "short",
               "The same long prefix, then three"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    r = run("--prompts-file", str(f), "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "12",
            "--temperature", "0", "--kv-budget-tokens", "60", "--block-size", "4", "--max-num-seqs", "3")
    assert r.returncode == 0, r.stderr
    kept = [p for p in prompts if p]
    for i, p in enumerate(kept):  # blank lines are skipped; outputs in file order
        assert f"=== [{i}] {p}\n" in r.stdout
    for key in ("batching statistics", "throughput", "tokens/s", "TTFT", "TPOT", "prefix cache", "hit rate",
                "preemptions", "KV budget"):
        assert key in r.stdout, key
    m = re.search(r"preemptions\s+(\d+)", r.stdout)
    assert m and int(m.group(1)) > 0  # a 60-token budget for 4 requests of up to 45 tokens: it must preempt
    m = re.search(r"hit rate ([\d.]+)%", r.stdout)
    assert m and float(m.group(1)) > 0  # the shared prefix was served from the cache
    # batched output == each prompt alone
    for i, p in enumerate(kept):
        alone = run(p, "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "12", "--temperature", "0")
        text = r.stdout.split(f"=== [{i}] {p}\n", 1)[1].split("\n=== ", 1)[0].split("\n\n--- batching", 1)[0]
        assert alone.stdout == text + "\n"


def test_static_scheduling_and_no_prefix_caching_flags(tiny, tmp_path):
    model, tok = tiny
    f = tmp_path / "p.txt"
    f.write_text("one\ntwo\nthree\n")
    r = run("--prompts-file", str(f), "--model", str(model), "--tokenizer", str(tok), "--max-tokens", "4",
            "--temperature", "0", "--scheduling", "static", "--no-prefix-caching", "--max-num-seqs", "2")
    assert r.returncode == 0, r.stderr
    assert "static batching" in r.stdout and "hit rate 0.0%" in r.stdout


@pytest.mark.parametrize("args,code,msg", [
    (["--prompts-file", "MISSING"], 1, "minienv: error:"),
    (["hi", "--prompts-file", "x.txt"], 2, "not both"),
    (["--kv-budget-tokens", "3"], 2, "smaller than one block"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "8"], 2, "max_num_batched_tokens"),
    (["--scheduling", "fifo"], 2, "invalid choice"),
    (["--kv-budget-tokens", "32", "--block-size", "4", "--max-tokens", "40"], 1, "can never fit"),
])
def test_engine_argument_errors(tiny, tmp_path, args, code, msg):
    model, tok = tiny
    args = [str(tmp_path / "missing.txt") if a == "MISSING" else a for a in args]
    if args[0].startswith("--") and "--prompts-file" not in args:
        args = ["hi", *args]
    r = run(*args, "--model", str(model), "--tokenizer", str(tok))
    assert r.returncode == code, (r.returncode, r.stderr)
    assert msg in r.stderr


def test_empty_prompts_file_is_an_error(tiny, tmp_path):
    model, tok = tiny
    f = tmp_path / "blank.txt"
    f.write_text("\n  \n")
    r = run("--prompts-file", str(f), "--model", str(model), "--tokenizer", str(tok))
    assert r.returncode == 1 and "holds no prompts" in r.stderr


def test_help_lists_the_engine_flags():
    r = run("--help")
    assert r.returncode == 0
    for flag in ("--prompts-file", "--kv-budget-tokens", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
                 "--scheduling", "--no-prefix-caching", "--stop"):
        assert flag in r.stdout
