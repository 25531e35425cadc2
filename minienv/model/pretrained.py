"""``load_pretrained("smollm2-135m-instruct")``: a real model — weights, tokenizer and chat template — from a known
name, a Llama ``.gguf`` file or a Hugging Face folder, ready for :class:`~minienv.engine.InferenceEngine`.

The three sources end in the same three objects: a :class:`~minienv.model.LlamaModel` (float32), a
:class:`~minienv.tokenizer.BPETokenizer` whose end token is the chat model's end of turn, and a
:class:`~minienv.chat_template.ChatTemplate` (None for a model without one, e.g. the bundled toy).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from minienv.model.checkpoint import CheckpointError
from minienv.model.hub import ModelNotFoundError, resolve
from minienv.model.llama import LlamaModel

__all__ = ["Pretrained", "load_pretrained"]


@dataclass
class Pretrained:
    """A loaded real model: what the engine needs, plus its name and chat template."""

    name: str
    model: LlamaModel
    tokenizer: Any
    chat_template: Any  # minienv.chat_template.ChatTemplate | None
    path: Path


def _special_strings(tokenizer: Any, config: Any) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` as text, which templates may use (transformers passes them too)."""
    out = {}
    for key, tid in (("bos_token", config.bos_token_id), ("eos_token", tokenizer.eos_token_id)):
        if tid is not None:
            out[key] = tokenizer.id_to_token(tid)
    return out


def _hf_tokenizer(folder: Path) -> tuple[Any, str | None]:
    """minienv's BPE from a Hugging Face ``tokenizer.json`` with a standard byte-level pipeline, and the chat
    template from ``tokenizer_config.json`` (if any)."""
    from minienv.tokenizer import BPETokenizer, TokenizerError

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelNotFoundError(f"the folder {folder} has no tokenizer.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    pre = data.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [(p.get("type"), p.get("individual_digits"), p.get("use_regex")) for p in parts]
    if kinds == [("ByteLevel", None, True)]:
        name = "gpt2"
    elif kinds == [("Digits", True, None), ("ByteLevel", None, True)]:
        name = "smollm"
    else:
        return BPETokenizer.load(path), template  # minienv's own pipeline, or a clear TokenizerError
    model = data.get("model") or {}
    vocab = model.get("vocab") or {}
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        if not (isinstance(i, int) and 0 <= i < len(tokens)) or tokens[i] is not None:
            raise TokenizerError(f"{path}: vocab ids are not exactly 0..{len(vocab) - 1}")
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special = [a["id"] for a in data.get("added_tokens", []) if a.get("special")]
    eos = cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = vocab.get(eos) if isinstance(eos, str) else None
    return BPETokenizer.from_vocab(tokens, merges, special, pre_tokenizer=name, eos_token_id=eos_id,
                                   source=str(path)), template


def load_pretrained(spec: str | os.PathLike, *, stream: TextIO | None = None) -> Pretrained:
    """Load a real model by known name (downloaded once, with a progress bar on ``stream``), ``.gguf`` path, or
    Hugging Face folder. Errors name the file: :class:`ModelNotFoundError`, :class:`CheckpointError`,
    :class:`~minienv.model.hub.DownloadError`, :class:`~minienv.tokenizer.TokenizerError`."""
    from minienv.chat_template import ChatTemplate

    name, path = resolve(spec, stream=stream)
    if path.is_dir():
        tokenizer, template = _hf_tokenizer(path)
        model = LlamaModel.from_pretrained(path)
    else:
        from minienv.model.gguf_file import read_gguf

        g = read_gguf(path)
        model = LlamaModel(g.config, g.weights)
        g.weights.clear()  # one float32 copy: the model's own (pre-transposed) arrays
        tokenizer, template = g.tokenizer, g.chat_template
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {tokenizer.vocab_size} ids but the model only "
                              f"{model.config.vocab_size}")
    chat = None if template is None else ChatTemplate(template, special_tokens=_special_strings(
        tokenizer, model.config))
    return Pretrained(name=name, model=model, tokenizer=tokenizer, chat_template=chat, path=path)
