"""The standard byte-level pre-tokenizers a GGUF file can name in ``tokenizer.ggml.pre``.

A byte-level BPE vocabulary is only correct together with the splitter its merges were learned behind: merges never
cross a pre-token boundary, so splitting differently gives different ids (and a model that never saw them).
GPT-2's splitter is a regular expression over Unicode classes — letters ``\\p{L}``, numbers ``\\p{N}`` — which
Python's ``re`` cannot express; the ``regex`` package (the same one ``transformers`` uses) can, so it is imported
here, only when a real model's tokenizer is built. minienv's own tokenizer (:mod:`minienv.tokenizer`) keeps its
ASCII-only pattern and needs nothing.

* ``gpt2`` (also ``default``): contractions, `` ?\\p{L}+``, `` ?\\p{N}+``, other symbols, whitespace runs.
* ``smollm``: every number character on its own first (SmolLM2's ``Digits(individual_digits=True)``; llama.cpp's
  ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` does the same with ``\\p{N}``), then GPT-2's expression on the rest.
"""

from __future__ import annotations

from typing import Callable

#: GPT-2's pre-tokenizer expression, as ``tokenizers``' ``ByteLevel(use_regex=True)`` spells it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

PRE_TOKENIZERS = ("default", "gpt2", "smollm")


def get_pre_tokenizer(name: str) -> Callable[[str], list[str]]:
    """``text -> pre-tokens`` (which join back to ``text``) for the pre-tokenizer ``name``; ValueError if unknown."""
    if name not in PRE_TOKENIZERS:
        raise ValueError(f"pre-tokenizer {name!r} is not implemented (minienv implements {list(PRE_TOKENIZERS)}): "
                         "its merges would be applied to the wrong pieces")
    try:
        import regex
    except ImportError as exc:  # pragma: no cover - regex comes with the lab/test/realmodel extras
        raise ImportError("a real model's tokenizer needs the `regex` package (pip install 'minienv[realmodel]')"
                          ) from exc
    gpt2 = regex.compile(GPT2_PATTERN).findall
    if name in ("default", "gpt2"):
        return gpt2
    numbers = regex.compile(r"(\p{N})")

    def smollm(text: str) -> list[str]:
        out: list[str] = []
        for i, part in enumerate(numbers.split(text)):
            if i % 2:  # a captured number character: a pre-token of its own
                out.append(part)
            elif part:
                out.extend(gpt2(part))
        return out

    return smollm
