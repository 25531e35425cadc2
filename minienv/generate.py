"""Single-request generation: prefill the prompt, then decode one token per step — with or without a KV cache.

This is the loop every engine runs, stripped to one request so the KV cache's effect is visible on its own:

* ``use_cache=True``: the prompt is prefilled once into a :class:`~minienv.model.ContiguousKVCache`; every later
  step feeds *one* token and reads the cached K/V of all earlier ones.
* ``use_cache=False``: every step re-runs the whole sequence through ``model.forward`` — the same tokens, the same
  logits, but step t redoes the work of steps 0..t-1 (notebook 02 measures the difference).

Tokens are yielded as they are produced (streaming). Generation stops at ``max_tokens``, at the tokenizer's
end-of-sequence token (not yielded), or once the decoded output contains a stop string (the token completing it
*is* yielded; :func:`complete` trims the text at the stop string, as vLLM's output text does).
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from minienv.model.llama import LlamaModel
from minienv.sampling import Sampler, SamplingParams


class Tokenizer(Protocol):
    """What generation needs from a tokenizer (``minienv.tokenizer.BPETokenizer`` has it)."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def check_request(model: LlamaModel, prompt_ids: Sequence[int], params: SamplingParams) -> None:
    """Reject a request that cannot be served, before any compute: empty, or longer than the model's context."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt encodes to zero tokens; give at least one character")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + params.max_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{len(prompt_ids) + params.max_tokens} exceeds the model's max_position_embeddings ({limit}); "
            f"shorten the prompt or lower max_tokens"
        )


def generate_ids(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    use_cache: bool = True,
    eos_token_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> Iterator[int]:
    """Stream generated token ids for ``prompt_ids`` (validated up front; the work happens as you iterate)."""
    check_request(model, prompt_ids, params)
    ids = np.asarray(prompt_ids)
    model._check_tokens(ids)  # out-of-range ids fail now, not at the first next()
    if params.stop_strings and decode is None:
        raise ValueError("stop strings need a decode function (pass a tokenizer)")
    return _decode_loop(model, ids, params, use_cache, eos_token_id, decode)


def _decode_loop(model, ids, params, use_cache, eos_token_id, decode) -> Iterator[int]:
    sampler = Sampler(params)
    n = len(ids)
    if use_cache:
        cache = model.new_kv_cache(max_len=n + params.max_tokens)
        logits = model.forward_step(ids, np.arange(n), cache, logits_indices=[n - 1])[0]  # prefill
    else:
        seq = list(ids.tolist())
        logits = model.forward(seq)[-1]
    out: list[int] = []
    for step in range(params.max_tokens):
        token = int(sampler.sample(logits))
        if eos_token_id is not None and token == eos_token_id:
            return
        out.append(token)
        yield token
        if params.stop_strings and any(s in decode(out) for s in params.stop_strings):
            return
        if step == params.max_tokens - 1:
            return
        if use_cache:
            logits = model.forward_step([token], [n + step], cache)[0]  # decode: one token's work
        else:
            seq.append(token)
            logits = model.forward(seq)[-1]  # recompute everything


def generate(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompt: str,
    params: SamplingParams | None = None,
    use_cache: bool = True,
) -> Iterator[int]:
    """Stream the token ids that continue ``prompt``. Raises before any work on a bad request."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    return generate_ids(model, tokenizer.encode(prompt), params, use_cache=use_cache,
                        eos_token_id=getattr(tokenizer, "eos_token_id", None), decode=tokenizer.decode)


def complete(model: LlamaModel, tokenizer: Tokenizer, prompt: str, params: SamplingParams | None = None,
             use_cache: bool = True) -> str:
    """The whole continuation as text, cut before the first stop string."""
    params = SamplingParams() if params is None else params
    text = tokenizer.decode(list(generate(model, tokenizer, prompt, params, use_cache)))
    return trim_at_stop(text, params.stop_strings)


def trim_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]


class TextStream:
    """Turns a growing list of token ids into printable text increments.

    A byte-level token can end in the middle of a UTF-8 character; decoding it alone gives U+FFFD. The stream
    holds such a tail back until the next token completes the character, so streamed output equals the final
    decode.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted :], len(text)
        return new

    def flush(self) -> str:
        text = self.decode(self.ids)
        new, self.emitted = text[self.emitted :], len(text)
        return new


def dense_greedy(model: LlamaModel, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """The reference every cache is checked against: greedy tokens with no cache at all.

    The whole sequence is recomputed by the dense ``model.forward`` for every new token, and generation does not
    stop at an end-of-sequence token, so any cached, paged, shared or preempted path must give exactly these ids.
    """
    ids = [int(t) for t in prompt_ids]
    for _ in range(max_new_tokens):
        ids.append(int(np.argmax(model.forward(ids)[-1])))
    return ids[len(prompt_ids):]
