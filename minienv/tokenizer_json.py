"""Reading a Hugging Face ``tokenizer.json``: every field checked before it is used.

A tokenizer file is user input (a download, a hand edit, a file another tool wrote), so each reader here names the
file and the field that is wrong instead of failing later with a ``KeyError`` deep in encoding.
:class:`~minienv.tokenizer.BPETokenizer` builds itself from what these return.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TokenizerError", "check_dense_ids", "check_pipeline", "read_added_tokens", "read_bpe_model",
           "read_json_object", "read_merges", "read_vocab"]


class TokenizerError(ValueError):
    """A ``tokenizer.json`` is malformed or asks for a pipeline minienv does not implement.

    A ``ValueError``, so ``except ValueError`` around user input catches it; the message names the file."""


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters so a garbage file cannot flood the error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: object) -> bool:
    """A JSON integer (``true`` is not one, though Python's ``bool`` subclasses ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; undecodable bytes, bad JSON or a non-object are errors naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got a JSON {type(data).__name__}")
    return data


def read_bpe_model(path: Path, data: dict) -> dict:
    """The ``model`` object, which must be a BPE model."""
    model = data.get("model")
    if not isinstance(model, dict):
        raise TokenizerError(f"{path}: 'model' must be an object, got {_short(model)}")
    if model.get("type") != "BPE":
        raise TokenizerError(f"{path}: model.type must be 'BPE', got {_short(model.get('type'))}")
    return model


def check_pipeline(path: Path, data: dict, pattern: str) -> None:
    """The pre-tokenizer must be exactly ``Sequence[Split(pattern), ByteLevel]`` and no normalizer: the one pipeline
    :class:`~minienv.tokenizer.BPETokenizer` runs on its own files."""
    pre = data.get("pre_tokenizer")
    parts = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    ok = isinstance(parts, list) and len(parts) == 2 and all(isinstance(x, dict) for x in parts)
    if ok:
        split, byte_level = parts
        split_pattern = split.get("pattern")
        ok = (
            split.get("type") == "Split"
            and isinstance(split_pattern, dict) and split_pattern.get("Regex") == pattern
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
            and not byte_level.get("use_regex")
        )
    if not ok:
        raise TokenizerError(f"{path}: pre_tokenizer must be Sequence[Split(minienv pattern), ByteLevel]")
    if data.get("normalizer") is not None:
        raise TokenizerError(f"{path}: normalizers are not supported (normalizer must be null)")


def read_vocab(path: Path, model: dict) -> dict[str, int]:
    """``model.vocab``: token string -> integer id, every id distinct."""
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise TokenizerError(f"{path}: model.vocab must be an object mapping token -> id, got {_short(vocab)}")
    owner: dict[int, str] = {}
    for tok, i in vocab.items():
        if not _is_int(i):
            raise TokenizerError(f"{path}: model.vocab id of token {tok!r} must be an integer, got {_short(i)}")
        if i in owner:
            raise TokenizerError(f"{path}: model.vocab tokens {owner[i]!r} and {tok!r} share id {i}")
        owner[i] = tok
    return vocab


def read_added_tokens(path: Path, data: dict, vocab: dict[str, int]) -> dict[str, int]:
    """``added_tokens``: special token content -> id. A special may also appear in the vocab, with the same id."""
    added = data.get("added_tokens")
    if added is None:
        return {}
    if not isinstance(added, list):
        raise TokenizerError(f"{path}: added_tokens must be a list, got {_short(added)}")
    specials: dict[str, int] = {}
    vocab_owner = {i: tok for tok, i in vocab.items()}
    for n, entry in enumerate(added):
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not content:
            raise TokenizerError(f"{path}: added_tokens[{n}] needs a non-empty string 'content', got {_short(entry)}")
        i = entry.get("id")
        if not _is_int(i):
            raise TokenizerError(f"{path}: added token {content!r} needs an integer 'id', got {_short(i)}")
        if content in specials or i in specials.values():
            raise TokenizerError(f"{path}: added token {content!r} (id {i}) repeats a content or id of an earlier one")
        if vocab.get(content, i) != i or vocab_owner.get(i, content) != content:
            raise TokenizerError(
                f"{path}: added token {content!r} has id {i}, but the vocab gives {content!r} id "
                f"{vocab.get(content)} and id {i} to {vocab_owner.get(i)!r}"
            )
        specials[content] = i
    return specials


def check_dense_ids(path: Path, vocab: dict[str, int], specials: dict[str, int]) -> int:
    """The number of ids ``n``, after checking they are exactly ``0..n-1`` (without allocating anything of size n)."""
    ids = set(vocab.values()) | set(specials.values())
    n = len(ids)
    if n == 0:
        raise TokenizerError(f"{path}: the vocabulary is empty")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise TokenizerError(
            f"{path}: ids are not contiguous: the {n} token ids must be exactly 0..{n - 1}, but id {bad} is outside "
            f"that dense range"
        )
    return n


def read_merges(path: Path, model: dict, vocab: dict[str, int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Merge pairs (by rank) and the id each produces. A merge is ``"left right"`` or ``["left", "right"]``.

    The string form splits on its one space; byte-level tokens never contain a space (it is stored as ``Ġ``),
    so the split is unambiguous.
    """
    raw = model.get("merges", [])
    if not isinstance(raw, list):
        raise TokenizerError(f"{path}: model.merges must be a list, got {_short(raw)}")
    merges: list[tuple[int, int]] = []
    merged_ids: list[int] = []
    for rank, m in enumerate(raw):
        pair = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) and t for t in pair)):
            raise TokenizerError(
                f"{path}: merge #{rank} {_short(m)} must be a string 'left right' (exactly one space) "
                f"or a list [left, right] of two tokens"
            )
        left, right = pair
        for tok in (left, right, left + right):
            if tok not in vocab:
                raise TokenizerError(f"{path}: merge {left!r} + {right!r} refers to {tok!r}, which is not in the vocab")
        merges.append((vocab[left], vocab[right]))
        merged_ids.append(vocab[left + right])
    return merges, merged_ids
