"""Requests in: every prompt and its sampling parameters checked before anything is queued.

A rejected request raises :class:`~minienv.request.InvalidRequestError` naming the problem (and, in a batch, the
prompt's index) and leaves the engine exactly as it was. Token ids are range-checked whatever the prompt's form:
an id the model has no embedding for would otherwise fail inside a step, for every request in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from minienv.request import InvalidRequestError, check_token_ids
from minienv.sampling import SamplingParams

#: the engine (``minienv.engine.core.InferenceEngine``), which calls into this module: annotated loosely so that
#: nothing here imports the engine back
InferenceEngine = Any

Checked = tuple[list[int], "str | None", SamplingParams]


def _encode(engine: InferenceEngine, prompt: str) -> list[int]:
    if not prompt:
        raise InvalidRequestError("the prompt is empty; give at least one character")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"the prompt is not valid Unicode text: {prompt[exc.start]!r} at character {exc.start} is a lone "
            "surrogate (half of a UTF-16 pair), which no encoding can represent") from None
    try:
        ids = engine.tokenizer.encode(prompt)
    except Exception as exc:  # noqa: BLE001 - a tokenizer's failure becomes this request's error
        raise InvalidRequestError(f"the tokenizer could not encode the prompt: {type(exc).__name__}: {exc}") from exc
    try:
        return check_token_ids(ids, engine.model.config.vocab_size)
    except ValueError as exc:
        raise InvalidRequestError(f"the tokenizer produced a bad id for this prompt: {exc}") from exc


def _check_1d(prompt: np.ndarray) -> None:
    if prompt.ndim != 1:
        raise InvalidRequestError(f"a numpy prompt must be a 1-D array of token ids, got shape {prompt.shape}"
                                  + (" (pass a list of 1-D prompts for a batch)" if prompt.ndim > 1 else ""))


def _token_prompt(engine: InferenceEngine, prompt: Any) -> list[int]:
    if isinstance(prompt, np.ndarray):
        _check_1d(prompt)
    try:
        return check_token_ids(list(prompt), engine.model.config.vocab_size)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def validate_request(engine: InferenceEngine, prompt: Any, params: Any) -> Checked:
    """``(token ids, prompt text or None, a private copy of the params)``, or :class:`InvalidRequestError`."""
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be a minienv.SamplingParams, got {type(params).__name__}")
    try:  # re-run SamplingParams' checks on a private copy (a caller may have mutated theirs since)
        params = dataclasses.replace(params)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"bad sampling parameters: {exc}") from exc
    text: str | None = None
    if isinstance(prompt, str):
        text, ids = prompt, _encode(engine, prompt)
    elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise InvalidRequestError(f"a prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    else:
        ids = _token_prompt(engine, prompt)
    if not ids:
        raise InvalidRequestError("the prompt is empty (zero tokens); give at least one token")
    need = len(ids) + params.max_tokens  # the most slots it may hold (the last sampled token is never fed: -1 would do)
    limit = engine.model.config.max_position_embeddings
    if need > limit:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the model's "
            f"max_position_embeddings ({limit}); shorten the prompt or lower max_tokens")
    if need > engine.kv_budget_tokens:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} tokens can never fit in the "
            f"KV budget of {engine.kv_budget_tokens} tokens ({engine.num_blocks} blocks of {engine.block_size}), "
            "even alone; raise kv_budget_tokens or lower max_tokens")
    return ids, text, params


def validate_batch(engine: InferenceEngine, prompts: Any, sampling_params: Any) -> list[Checked]:
    """Every prompt of a ``generate`` / ``stream`` call checked; the first bad one raises with its index."""
    if isinstance(prompts, np.ndarray):
        _check_1d(prompts)
        prompts = [prompts]
    elif isinstance(prompts, str) or (isinstance(prompts, Sequence) and len(prompts) > 0
                                      and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]  # one prompt (a string, or one list of token ids)
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise InvalidRequestError(f"prompts must be a str or a list of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise InvalidRequestError("no prompts given")
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(
                f"{len(prompts)} prompts but {len(sampling_params)} sampling params; give one, or one per prompt")
        params = list(sampling_params)
    else:
        params = [sampling_params] * len(prompts)
    checked = []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        try:
            checked.append(validate_request(engine, p, sp))
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), index=i) from exc
    return checked
