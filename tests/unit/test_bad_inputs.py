"""Bad inputs give typed errors that name the problem, never an exception leaking from inside a loader.

Each case starts from a bundled file (``assets/target/model.safetensors``, ``assets/target/config.json``,
``assets/tokenizer.json``), corrupts one thing, and checks the error type *and* a message fragment naming the
problem. The CLI cases run ``python -m minienv`` in subprocesses (all at once, so the file stays fast) and check
the exit status (2 = bad argument, 1 = bad file) and the one-line ``error:`` message with no traceback.

The case tables are plain ``pytest.param`` lists, so ``tools``/ad-hoc scripts can replay them and print outcomes.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from minienv.model import CheckpointError, ConfigError, LlamaConfig, LlamaModel, load_model, read_safetensors
from minienv.model.checkpoint import load_weights
from minienv.sampling import Sampler, SamplingParams
from minienv.tokenizer import BPETokenizer, TokenizerError

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets"
TARGET = ASSETS / "target"
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
DOWN = "model.layers.2.mlp.down_proj.weight"


# ---------------------------------------------------------------------- safetensors
@functools.lru_cache(maxsize=1)
def _bundled_safetensors() -> tuple[dict, bytes]:
    raw = (TARGET / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st(header: dict | list | bytes, body: bytes) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    return len(head).to_bytes(8, "little") + head + body


def _with(name: str, **fields: object) -> Callable[[dict, bytes], bytes]:
    """A corruption that replaces fields of tensor ``name``'s header entry."""
    def corrupt(h: dict, b: bytes) -> bytes:
        h[name].update(fields)
        return _st(h, b)
    return corrupt


def _without_offsets(h: dict, b: bytes) -> bytes:
    del h[EMBED]["data_offsets"]
    return _st(h, b)


def _duplicate_name(h: dict, b: bytes) -> bytes:
    text = json.dumps(h)
    return _st((text[:-1] + f', "{NORM}": ' + json.dumps(h[NORM]) + "}").encode(), b)


def _nonfinite(name: str, value: float) -> Callable[[dict, bytes], bytes]:
    """Write ``value`` into the middle of tensor ``name``'s bytes."""
    def corrupt(h: dict, b: bytes) -> bytes:
        start, end = h[name]["data_offsets"]
        mid = start + (end - start) // 8 * 4
        return _st(h, b[:mid] + np.float32(value).tobytes() + b[mid + 4 :])
    return corrupt


SAFETENSORS_CASES = [
    pytest.param(lambda h, b: _st(list(h), b), "header must be a JSON object, got a JSON list", id="header-is-list"),
    pytest.param(lambda h, b: _st({**h, "w": 3}, b), "tensor 'w' header entry must be an object", id="entry-is-int"),
    pytest.param(_with(EMBED, data_offsets=[0, 1572864, 9]), "data_offsets must be a list of two integers",
                 id="offsets-three-numbers"),
    pytest.param(_with(EMBED, data_offsets=["0", "1572864"]), "data_offsets must be a list of two integers",
                 id="offsets-strings"),
    pytest.param(_with(EMBED, data_offsets=[0.0, 1572864.0]), "data_offsets must be a list of two integers",
                 id="offsets-floats"),
    pytest.param(_with(EMBED, data_offsets=[False, 1572864]), "data_offsets must be a list of two integers",
                 id="offsets-bool"),
    pytest.param(_with(EMBED, data_offsets=7), "data_offsets must be a list of two integers", id="offsets-int"),
    pytest.param(_without_offsets, "data_offsets must be a list of two integers", id="offsets-missing"),
    pytest.param(_with(EMBED, data_offsets=[-8, 1572856]), "data_offsets [-8, 1572856] are not a byte range",
                 id="offsets-negative"),
    pytest.param(_with(EMBED, data_offsets=[1572864, 0]), "data_offsets [1572864, 0] are not a byte range",
                 id="offsets-end-before-start"),
    pytest.param(lambda h, b: _st(h, b[:-4]), "are not a byte range inside the 8067836-byte data section",
                 id="file-truncated"),
    pytest.param(_with(NORM, data_offsets=[0, 768]), f"tensor '{EMBED}' bytes 0..1572864 overlap tensor '{NORM}'",
                 id="two-tensors-alias"),
    pytest.param(lambda h, b: _st(h, b + b"\0" * 8), "data bytes 8067840..8067848 belong to no tensor",
                 id="trailing-bytes"),
    pytest.param(_duplicate_name, f"header names '{NORM}' twice", id="duplicate-name"),
    pytest.param(lambda h, b: _st(b'{"\xff\xfe": 1}', b), "header is not UTF-8 text", id="header-not-utf8"),
    pytest.param(lambda h, b: _st(b'{"w": {"dtype": ', b), "header is not valid JSON", id="header-not-json"),
    pytest.param(_with(EMBED, dtype="I64"), "has unsupported dtype 'I64'", id="dtype-i64"),
    pytest.param(_with(EMBED, dtype=["F32"]), "has unsupported dtype ['F32']", id="dtype-list"),
    pytest.param(_with(EMBED, shape=[2048, 191]), "does not hold a F32 tensor of shape (2048, 191)",
                 id="shape-size-mismatch"),
    pytest.param(_with(EMBED, shape=[-2048, -192]), "shape must be a list of non-negative integers",
                 id="shape-negative"),
    pytest.param(_with(EMBED, shape="2048x192"), "shape must be a list of non-negative integers", id="shape-string"),
    pytest.param(lambda h, b: _st({**h, "__metadata__": {"format": 1}}, b), "__metadata__ must be an object of strings",
                 id="metadata-not-strings"),
    pytest.param(lambda h, b: (10**9).to_bytes(8, "little") + b"{}", "header length 1000000000 is larger than the file",
                 id="header-length-too-big"),
    pytest.param(lambda h, b: b"\x01\x02", "too short to be a safetensors file", id="file-too-short"),
]

WEIGHT_CASES = [
    pytest.param(_nonfinite(DOWN, np.nan), f"tensor '{DOWN}' holds 1 non-finite value(s)", id="nan-weight"),
    pytest.param(_nonfinite(EMBED, np.inf), f"tensor '{EMBED}' holds 1 non-finite value(s)", id="inf-weight"),
    pytest.param(_nonfinite(NORM, -np.inf), f"tensor '{NORM}' holds 1 non-finite value(s)", id="neg-inf-weight"),
]


def write_bad_safetensors(directory: Path, corrupt: Callable[[dict, bytes], bytes]) -> Path:
    header, body = _bundled_safetensors()
    path = directory / "model.safetensors"
    path.write_bytes(corrupt(copy.deepcopy(header), body))
    return path


def write_bad_model_dir(directory: Path, corrupt: Callable[[dict, bytes], bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(TARGET / "config.json", directory / "config.json")
    write_bad_safetensors(directory, corrupt)
    return directory


@pytest.mark.parametrize("corrupt,fragment", SAFETENSORS_CASES)
def test_bad_safetensors_header(tmp_path, corrupt, fragment):
    path = write_bad_safetensors(tmp_path, corrupt)
    with pytest.raises(CheckpointError) as info:
        read_safetensors(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("corrupt,fragment", WEIGHT_CASES)
def test_nonfinite_weights_rejected_at_load(tmp_path, corrupt, fragment):
    model_dir = write_bad_model_dir(tmp_path / "m", corrupt)
    with pytest.raises(CheckpointError) as info:
        load_model(model_dir)
    assert fragment in str(info.value)
    # a model built from in-memory weights is checked too
    config = LlamaConfig.from_json(model_dir)
    weights = load_weights(TARGET, config)
    name = fragment.split("'")[1]
    weights[name] = weights[name].copy()
    weights[name].flat[3] = np.nan
    with pytest.raises(CheckpointError, match="non-finite"):
        LlamaModel(config, weights)


# ---------------------------------------------------------------------- config.json
def _cfg(**changes: object) -> Callable[[dict], bytes]:
    def corrupt(raw: dict) -> bytes:
        raw.update(changes)
        return json.dumps(raw).encode("utf-8")
    return corrupt


def _rope(theta: object) -> Callable[[dict], bytes]:
    return _cfg(rope_parameters={"rope_type": "default", "rope_theta": theta})


def _top_level_rope(theta: object) -> Callable[[dict], bytes]:
    def corrupt(raw: dict) -> bytes:
        del raw["rope_parameters"]
        raw["rope_theta"] = theta
        return json.dumps(raw).encode("utf-8")
    return corrupt


def _no_head_dim(**changes: object) -> Callable[[dict], bytes]:
    def corrupt(raw: dict) -> bytes:
        del raw["head_dim"]
        raw.update(changes)
        return json.dumps(raw).encode("utf-8")
    return corrupt


CONFIG_CASES = [
    pytest.param(lambda raw: b"{ not json", "config.json is not valid JSON", id="not-json"),
    pytest.param(lambda raw: b'{"vocab_size": "\xff\xfe"}', "config.json is not UTF-8 text", id="not-utf8"),
    pytest.param(lambda raw: b"[1, 2]", "config.json must hold a JSON object, got a JSON list", id="json-list"),
    pytest.param(_cfg(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false", id="tie-string"),
    pytest.param(_cfg(tie_word_embeddings=1), "'tie_word_embeddings' must be true or false", id="tie-int"),
    pytest.param(_cfg(attention_bias="false"), "'attention_bias' must be true or false", id="bias-string"),
    pytest.param(_rope(float("inf")), "'rope_theta' must be a finite positive number, got inf", id="rope-inf"),
    pytest.param(_rope(float("nan")), "'rope_theta' must be a finite positive number, got nan", id="rope-nan"),
    pytest.param(_rope(0), "'rope_theta' must be a finite positive number, got 0", id="rope-zero"),
    pytest.param(_rope(-10000.0), "'rope_theta' must be a finite positive number, got -10000", id="rope-negative"),
    pytest.param(_rope(True), "'rope_theta' must be a finite positive number, got True", id="rope-bool"),
    pytest.param(_rope("10000"), "'rope_theta' must be a finite positive number, got '10000'", id="rope-string"),
    pytest.param(_top_level_rope(1e400), "'rope_theta' must be a finite positive number, got inf",
                 id="rope-top-level-1e400"),
    pytest.param(_cfg(rms_norm_eps=float("nan")), "'rms_norm_eps' must be a finite positive number",
                 id="eps-nan"),
    pytest.param(_no_head_dim(hidden_size="192"), "'hidden_size' must be a positive integer, got '192'",
                 id="hidden-string-no-head-dim"),
    pytest.param(_cfg(vocab_size=True), "'vocab_size' must be a positive integer, got True", id="vocab-bool"),
    pytest.param(_cfg(num_hidden_layers=4.0), "'num_hidden_layers' must be a positive integer, got 4.0",
                 id="layers-float"),
    pytest.param(_cfg(num_key_value_heads=0), "'num_key_value_heads' must be a positive integer, got 0",
                 id="kv-heads-zero"),
    pytest.param(_cfg(eos_token_id="2047"), "'eos_token_id' must be null or a token id", id="eos-string"),
    pytest.param(_cfg(eos_token_id=[2047, "x"]), "'eos_token_id' must be a token id or a list", id="eos-list-bad"),
    pytest.param(_cfg(bos_token_id=5000), "'bos_token_id' must be null or a token id in [0, vocab_size=2048)",
                 id="bos-out-of-vocab"),
]


def write_bad_config(directory: Path, corrupt: Callable[[dict], bytes]) -> Path:
    raw = json.loads((TARGET / "config.json").read_text(encoding="utf-8"))
    path = directory / "config.json"
    path.write_bytes(corrupt(raw))
    return path


@pytest.mark.parametrize("corrupt,fragment", CONFIG_CASES)
def test_bad_config(tmp_path, corrupt, fragment):
    path = write_bad_config(tmp_path, corrupt)
    with pytest.raises(ConfigError) as info:
        LlamaConfig.from_json(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


# ---------------------------------------------------------------------- tokenizer.json
def _tok(change: Callable[[dict], None]) -> Callable[[dict], bytes]:
    def corrupt(data: dict) -> bytes:
        change(data)
        return json.dumps(data, ensure_ascii=False).encode("utf-8")
    return corrupt


def _set(path: str, value: object) -> Callable[[dict], bytes]:
    """Set ``data[a][b]...`` for ``path`` "a.b..." (``value`` is ``...`` to delete it)."""
    *parents, last = path.split(".")

    def change(data: dict) -> None:
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is ...:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return _tok(change)


def _rename_token(old: str, new: str) -> Callable[[dict], bytes]:
    def change(data: dict) -> None:
        vocab = data["model"]["vocab"]
        vocab[new] = vocab.pop(old)
    return _tok(change)


TOKENIZER_CASES = [
    pytest.param(lambda data: b"[1, 2, 3]", "tokenizer.json must hold a JSON object, got a JSON list", id="json-list"),
    pytest.param(lambda data: b'{"model": ', "tokenizer.json is not valid JSON", id="not-json"),
    pytest.param(lambda data: b'{"model": "\xff"}', "tokenizer.json is not UTF-8 text", id="not-utf8"),
    pytest.param(_set("model", ...), "'model' must be an object, got None", id="no-model"),
    pytest.param(_set("model.vocab", ...), "model.vocab must be an object mapping token -> id", id="no-vocab"),
    pytest.param(_set("model.vocab", [["a", 0]]), "model.vocab must be an object mapping token -> id",
                 id="vocab-is-list"),
    pytest.param(_set("added_tokens.0.content", ...), "added_tokens[0] needs a non-empty string 'content'",
                 id="added-without-content"),
    pytest.param(_set("added_tokens.0.id", "2047"), "added token '<|endoftext|>' needs an integer 'id'",
                 id="added-string-id"),
    pytest.param(_set("added_tokens.0.id", 5), "added token '<|endoftext|>' has id 5, but the vocab gives",
                 id="added-id-conflicts-with-vocab"),
    pytest.param(_set("added_tokens", {"id": 2047}), "added_tokens must be a list", id="added-not-list"),
    pytest.param(_set("model.merges.0", "Ġt"), "merge #0 'Ġt' must be a string 'left right' (exactly one space)",
                 id="merge-without-space"),
    pytest.param(_set("model.merges.0", "Ġ t h"), "merge #0 'Ġ t h' must be a string 'left right'",
                 id="merge-two-spaces"),
    pytest.param(_set("model.merges.0", ["Ġ", "t", "h"]), "merge #0 ['Ġ', 't', 'h'] must be a string",
                 id="merge-list-of-three"),
    pytest.param(_set("model.merges.0", 7), "merge #0 7 must be a string 'left right'", id="merge-int"),
    pytest.param(_set("model.merges", "Ġ t"), "model.merges must be a list", id="merges-not-list"),
    pytest.param(_set("model.merges.0", ["Ġ", "zz"]), "refers to 'zz', which is not in the vocab",
                 id="merge-unknown-token"),
    pytest.param(_set("model.vocab.a", "5"), "model.vocab id of token 'a' must be an integer, got '5'",
                 id="vocab-string-id"),
    pytest.param(_set("model.vocab.a", True), "model.vocab id of token 'a' must be an integer, got True",
                 id="vocab-bool-id"),
    pytest.param(_set("model.vocab.a", 30_000_000), "id 30000000 is outside that dense range", id="vocab-id-30M"),
    pytest.param(_set("model.vocab.a", -1), "id -1 is outside that dense range", id="vocab-id-negative"),
    pytest.param(_set("model.vocab.a", 98), "model.vocab tokens 'a' and 'b' share id 98", id="vocab-shared-id"),
    pytest.param(_rename_token("Ġwomen", "€uro"), "tokenizer.json: token '€uro' is not in the byte-level alphabet",
                 id="token-outside-byte-alphabet"),
    pytest.param(_set("pre_tokenizer", ["Split"]), "pre_tokenizer must be Sequence", id="pre-tokenizer-list"),
    pytest.param(_set("pre_tokenizer.pretokenizers.0", "Split"), "pre_tokenizer must be Sequence",
                 id="pre-tokenizer-part-string"),
]


def write_bad_tokenizer(directory: Path, corrupt: Callable[[dict], bytes]) -> Path:
    data = json.loads((ASSETS / "tokenizer.json").read_text(encoding="utf-8"))
    path = directory / "tokenizer.json"
    path.write_bytes(corrupt(data))
    return path


@pytest.mark.parametrize("corrupt,fragment", TOKENIZER_CASES)
def test_bad_tokenizer(tmp_path, corrupt, fragment):
    path = write_bad_tokenizer(tmp_path, corrupt)
    with pytest.raises(TokenizerError) as info:
        BPETokenizer.load(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


def test_huge_token_id_is_rejected_without_allocating(tmp_path):
    path = write_bad_tokenizer(tmp_path, _set("model.vocab.a", 30_000_000))
    tracemalloc.start()
    try:
        with pytest.raises(TokenizerError, match="dense range"):
            BPETokenizer.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"loading peaked at {peak / 2**20:.0f} MiB before failing"


# ---------------------------------------------------------------------- sampling
SAMPLING_PARAM_CASES = [
    pytest.param({"temperature": 1e400}, "temperature must be a finite number >= 0", id="temperature-1e400"),
    pytest.param({"temperature": 10**400}, "temperature must be a finite number >= 0", id="temperature-huge-int"),
    pytest.param({"temperature": float("nan")}, "temperature must be a finite number >= 0", id="temperature-nan"),
    pytest.param({"temperature": -float("inf")}, "temperature must be a finite number >= 0", id="temperature--inf"),
    pytest.param({"temperature": True}, "temperature must be a number, got bool", id="temperature-bool"),
    pytest.param({"temperature": None}, "temperature must be a number, got NoneType", id="temperature-none"),
    pytest.param({"temperature": 1 + 0j}, "temperature must be a number, got complex", id="temperature-complex"),
    pytest.param({"top_p": float("nan")}, "top_p must be in (0, 1], got nan", id="top-p-nan"),
    pytest.param({"top_p": float("inf")}, "top_p must be in (0, 1], got inf", id="top-p-inf"),
    pytest.param({"top_p": 10**400}, "top_p must be in (0, 1], got inf", id="top-p-huge-int"),
    pytest.param({"top_p": "0.9"}, "top_p must be a number, got str", id="top-p-string"),
    pytest.param({"top_k": True}, "top_k must be an int", id="top-k-bool"),
    pytest.param({"top_k": np.bool_(True)}, "top_k must be an int", id="top-k-numpy-bool"),
    pytest.param({"max_tokens": True}, "max_tokens must be an int, got bool", id="max-tokens-bool"),
    pytest.param({"max_tokens": -5}, "max_tokens must be at least 1, got -5", id="max-tokens-negative"),
    pytest.param({"seed": True}, "seed must be an int or None, got bool", id="seed-bool"),
    pytest.param({"seed": -1}, "seed must be >= 0", id="seed-negative"),
]


@pytest.mark.parametrize("kwargs,fragment", SAMPLING_PARAM_CASES)
def test_bad_sampling_params(kwargs, fragment):
    with pytest.raises(ValueError) as info:  # SamplingTypeError is a ValueError too; a bare TypeError is not
        SamplingParams(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize("temperature", [1e-30, 1e-300, 1e-308, 5e-324])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (2, 0.5)])
def test_tiny_temperature_samples_the_argmax(temperature, top_k, top_p):
    """As temperature -> 0+ the distribution tends to the argmax (split evenly over exact ties); a tiny positive
    temperature must give that limit, not NaN."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    logits = np.array([[1.0, 5.0, 3.0, -2.0], [300.0, -700.0, 700.0, 699.0]], dtype=np.float32)
    sampler = Sampler(params)
    probs = sampler.probs(logits)
    np.testing.assert_array_equal(probs, np.eye(4)[[1, 2]])
    for _ in range(20):
        np.testing.assert_array_equal(sampler.sample(logits), [1, 2])
    tied = Sampler(SamplingParams(temperature=temperature, seed=0)).probs(np.array([4.0, 9.0, 9.0]))
    np.testing.assert_array_equal(tied, [0.0, 0.5, 0.5])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=0)])
@pytest.mark.parametrize("logits", [[1.0, np.nan, 0.0], [1.0, np.inf, 0.0], [-np.inf, -np.inf]])
def test_nonfinite_logits_are_a_clear_error(params, logits):
    with pytest.raises(ValueError, match="logits contain NaN or \\+inf, or a row that is all -inf"):
        Sampler(params).sample(np.array(logits))


# ---------------------------------------------------------------------- CLI
def _model_dir(corrupt: Callable[[dict, bytes], bytes] | None = None, config: Callable[[dict], bytes] | None = None):
    def build(root: Path) -> list[str]:
        d = root / "model"
        write_bad_model_dir(d, corrupt or (lambda h, b: _st(h, b)))
        if config is not None:
            write_bad_config(d, config)
        return ["hi", "--model", str(d)]
    return build


def _tokenizer(corrupt: Callable[[dict], bytes]):
    return lambda root: ["hi", "--tokenizer", str(write_bad_tokenizer(root, corrupt))]


def _prompts(content: bytes | None):
    def build(root: Path) -> list[str]:
        path = root / "prompts.txt"
        if content is not None:
            path.write_bytes(content)
        return ["--prompts-file", str(path)]
    return build


def _args(*args: str):
    return lambda root: ["hi", *args]


CLI_CASES = [
    pytest.param(lambda root: ["hi", "--model", str(root / "nope")], 1, "no such file or folder", id="model-missing"),
    # --model takes a folder or a .gguf file: any other file is refused by what it is not
    pytest.param(lambda root: ["hi", "--model", str(TARGET / "config.json")], 1, "is not a GGUF file",
                 id="model-is-a-file"),
    pytest.param(_model_dir(config=lambda raw: b"{ nope"), 1, "config.json is not valid JSON", id="config-not-json"),
    pytest.param(_model_dir(config=_cfg(tie_word_embeddings="false")), 1, "'tie_word_embeddings' must be true or",
                 id="config-tie-string"),
    pytest.param(_model_dir(SAFETENSORS_CASES[0].values[0]), 1, "header must be a JSON object",
                 id="safetensors-header-list"),
    pytest.param(_model_dir(SAFETENSORS_CASES[11].values[0]), 1, "overlap tensor", id="safetensors-alias"),
    pytest.param(_model_dir(WEIGHT_CASES[0].values[0]), 1, "non-finite value(s)", id="nan-weights"),
    pytest.param(lambda root: ["hi", "--tokenizer", str(root / "nope.json")], 1, "No such file or directory",
                 id="tokenizer-missing"),
    pytest.param(_tokenizer(lambda data: b"[]"), 1, "must hold a JSON object", id="tokenizer-json-list"),
    pytest.param(_tokenizer(lambda data: b"\xff\xfe"), 1, "tokenizer.json is not UTF-8 text", id="tokenizer-not-utf8"),
    pytest.param(_tokenizer(_set("model.vocab.a", 30_000_000)), 1, "dense range", id="tokenizer-id-30M"),
    pytest.param(_tokenizer(_set("model.merges.0", "Ġt")), 1, "must be a string 'left right'",
                 id="tokenizer-merge-no-space"),
    pytest.param(_prompts(None), 1, "No such file or directory", id="prompts-missing"),
    pytest.param(_prompts(b"caf\xe9\n"), 1, "prompts.txt is not UTF-8 text", id="prompts-not-utf8"),
    pytest.param(_prompts(b"\n  \n"), 1, "holds no prompts", id="prompts-blank"),
    pytest.param(lambda root: ["--prompts-file", str(root)], 1, "Is a directory", id="prompts-is-a-directory"),
    pytest.param(_args("--max-tokens", "-5"), 2, "max_tokens must be at least 1, got -5", id="max-tokens-negative"),
    pytest.param(_args("--temperature", "nan"), 2, "temperature must be a finite number", id="temperature-nan"),
    pytest.param(_args("--temperature", "1e400"), 2, "temperature must be a finite number", id="temperature-1e400"),
    pytest.param(_args("--temperature", "hot"), 2, "argument --temperature: invalid float value",
                 id="temperature-word"),
    pytest.param(_args("--top-p", "nan"), 2, "top_p must be in (0, 1]", id="top-p-nan"),
    pytest.param(_args("--top-k", "1.5"), 2, "argument --top-k: invalid int value", id="top-k-float"),
    pytest.param(_args("--seed", "-1"), 2, "seed must be >= 0", id="seed-negative"),
    pytest.param(_args("--stop", ""), 2, "stop must be a non-empty string", id="stop-empty"),
    pytest.param(_args("--block-size", "0"), 2, "argument --block-size: must be a positive integer, got 0",
                 id="block-size-zero"),
    pytest.param(_args("--kv-budget-tokens", "-1"), 2, "argument --kv-budget-tokens: must be a positive integer",
                 id="kv-budget-negative"),
    pytest.param(_args("--max-num-seqs", "x"), 2, "argument --max-num-seqs: invalid int value: 'x'",
                 id="max-num-seqs-word"),
    pytest.param(lambda root: [os.fsdecode(b"caf\xe9")], 2, "the prompt is not valid UTF-8 text",
                 id="prompt-not-utf8"),
]


def run_cli_cases(root: Path, cases: list) -> dict[str, subprocess.CompletedProcess]:
    """Run every case's ``python -m minienv`` at once (each in its own folder); results by case id."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}
    procs = {}
    for case in cases:
        folder = root / case.id
        folder.mkdir()
        # short greedy runs by default; the case's own flags come later, so argparse keeps those
        argv = [sys.executable, "-m", "minienv", "--max-tokens", "2", "--temperature", "0", *case.values[0](folder)]
        procs[case.id] = (argv, subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True, errors="replace"))
    results = {}
    for case_id, (argv, proc) in procs.items():
        out, err = proc.communicate(timeout=120)
        results[case_id] = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    return results


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    return run_cli_cases(tmp_path_factory.mktemp("cli"), CLI_CASES)


@pytest.mark.parametrize("build,status,fragment", CLI_CASES)
def test_cli_bad_input_is_one_line_error(cli_results, request, build, status, fragment):
    result = cli_results[request.node.callspec.id]
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == status, result.stderr
    assert result.stdout == ""
    last = result.stderr.rstrip("\n").splitlines()[-1]
    prefix = "minienv: error: " if status == 1 else "python -m minienv: error: "
    assert last.startswith(prefix), result.stderr
    assert fragment in last
    if status == 1:  # a bad file: exactly one line, nothing else
        assert result.stderr.count("\n") == 1
