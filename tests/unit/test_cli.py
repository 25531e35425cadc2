"""``python -m minienv``: runs in a subprocess, as a user would run it."""

from __future__ import annotations

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


@pytest.mark.skipif(not (REPO / "assets" / "tokenizer.json").is_file() or not (REPO / "assets" / "target").is_dir(),
                    reason="bundled tokenizer/model not in assets/ yet")
def test_bundled_model_continues_hamlet():
    r = run("To be, or not to be", "--max-tokens", "20", "--temperature", "0", timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 0
