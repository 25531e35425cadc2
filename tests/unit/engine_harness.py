"""Shared helpers of the engine regression and fuzz tests (``test_engine_regressions.py``, ``test_engine_fuzz.py``).

Not a test module (no ``test_`` prefix): the bundled model and tokenizer, loaded once; plain wrapper classes that
delegate to the real model / tokenizer and fail on demand; the "generated alone" reference
(:func:`minienv.generate.generate_ids`: a contiguous cache, one request, no scheduler — cached per
(prompt, params)); a per-consumer output collector that checks the streaming contract (every token exactly once,
exactly one final output); and a fingerprint of the engine's state for "the failed step changed nothing" checks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Sequence

from minienv.generate import generate_ids
from minienv.sampling import SamplingParams


# ------------------------------------------------------------------------------------------------ bundled assets
@functools.lru_cache(maxsize=None)
def bundled() -> tuple[Any, Any]:
    """(model, tokenizer): minienv's bundled ones (vocab 2048, 1024 positions), loaded once per process."""
    from minienv.model import load_model
    from minienv.tokenizer import load_tokenizer

    return load_model(), load_tokenizer()


# ------------------------------------------------------------------------------------------------ wrappers
class FlakyModel:
    """The real model, except that its ``forward_step`` raises on chosen calls (1-based call numbers).

    ``fail_at`` maps a call number to the exception type raised *instead of* that call (the wrapped model is not
    called at all, so nothing of the failing step reached the KV pool through it). ``calls`` counts every call,
    failed ones included.
    """

    def __init__(self, model: Any, fail_at: dict[int, type[BaseException]] | None = None):
        self.model = model
        self.config = model.config
        self.fail_at = dict(fail_at or {})
        self.calls = 0
        self.failures = 0

    def next_call_fails(self) -> bool:
        return self.calls + 1 in self.fail_at

    def forward_step(self, *args: Any, **kwargs: Any):
        self.calls += 1
        exc = self.fail_at.get(self.calls)
        if exc is not None:
            self.failures += 1
            raise exc(f"injected failure on forward_step call {self.calls}")
        return self.model.forward_step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # anything else (forward, new_kv_cache, ...) is the real model's
        return getattr(self.model, name)


class HalfwayFlakyModel(FlakyModel):
    """Like :class:`FlakyModel`, but the failing call first runs the real ``forward_step`` — so the step's K/V
    *are* written into the pool — and raises afterwards: a rollback must not trust those slots."""

    def forward_step(self, *args: Any, **kwargs: Any):
        self.calls += 1
        exc = self.fail_at.get(self.calls)
        out = self.model.forward_step(*args, **kwargs)
        if exc is not None:
            self.failures += 1
            raise exc(f"injected failure after forward_step call {self.calls}")
        return out


class TokenizerProxy:
    """Delegates everything to the real tokenizer; subclasses override one method to misbehave."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


# ------------------------------------------------------------------------------------------------ references
_ALONE: dict[tuple, tuple[int, ...]] = {}


def tiny_engine_factory() -> Callable[[], Any]:
    """A fresh engine per call on a 2-layer random model (block size 4, 16 blocks, at most 4 sequences): steps
    in microseconds, preempts with a handful of prompts (the metrics views' tests)."""
    from minienv.engine import InferenceEngine
    from minienv.model import LlamaConfig, LlamaModel, random_weights
    from minienv.tokenizer import BPETokenizer

    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=96, tie_word_embeddings=True)
    model = LlamaModel(cfg, random_weights(cfg, seed=1, scale=0.3))
    return lambda: InferenceEngine(model, BPETokenizer([]), kv_budget_tokens=64, block_size=4, max_num_seqs=4,
                                   max_num_batched_tokens=32)


def params_key(sp: SamplingParams) -> tuple:
    return (sp.max_tokens, float(sp.temperature), sp.top_k, float(sp.top_p), sp.seed, tuple(sp.stop_strings))


def alone(model: Any, prompt_ids: Sequence[int], sp: SamplingParams, eos_token_id: int | None) -> tuple[int, ...]:
    """The request generated alone: ``minienv.generate.generate_ids`` (one request, a contiguous KV cache, no
    engine, no scheduler, no batching), cached per (model, prompt, params, eos)."""
    key = (id(model), tuple(int(t) for t in prompt_ids), params_key(sp), eos_token_id)
    ref = _ALONE.get(key)
    if ref is None:
        ref = _ALONE[key] = tuple(generate_ids(model, list(prompt_ids), sp, eos_token_id=eos_token_id))
    return ref


def alone_text(tok: Any, ids: Sequence[int]) -> str:
    return tok.decode(list(ids))


# ------------------------------------------------------------------------------------------------ consumers
class Received:
    """What one consumer received for its requests: deltas, in order, and the final output of each.

    :meth:`take` enforces the per-output part of the contract (no output after the final one); :meth:`check`
    the per-request part (the deltas concatenate to the final ``token_ids`` / ``text``; exactly one final).
    """

    def __init__(self, name: str):
        self.name = name
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.final: dict[str, Any] = {}
        self.count: dict[str, int] = {}
        self.first: dict[str, Any] = {}  # each request's first output received (its prompt, its id)

    def take(self, out: Any) -> None:
        rid = out.request_id
        self.first.setdefault(rid, out)
        assert rid not in self.final, (f"{self.name}: output for request {rid} after its final output "
                                       f"(finished={out.finished}, delta {out.delta_token_ids})")
        self.tokens.setdefault(rid, []).extend(out.delta_token_ids)
        self.text[rid] = self.text.get(rid, "") + out.delta_text
        self.count[rid] = self.count.get(rid, 0) + 1
        if out.finished:
            self.final[rid] = out

    def take_all(self, outs: Iterable[Any]) -> None:
        for o in outs:
            self.take(o)

    def check(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        extra = set(self.tokens) - set(ids)
        assert not extra, f"{self.name} received outputs of requests that are not its own: {sorted(extra)}"
        for rid in ids:
            fin = self.final.get(rid)
            assert fin is not None, (f"{self.name}: request {rid} never got a final output (received "
                                     f"{len(self.tokens.get(rid, []))} tokens in {self.count.get(rid, 0)} outputs)")
            got = tuple(self.tokens.get(rid, []))
            assert got == tuple(fin.token_ids), (
                f"{self.name}: request {rid}: concatenated delta_token_ids ({len(got)} tokens) != final token_ids "
                f"({len(fin.token_ids)} tokens)\n  deltas: {list(got)}\n  final:  {list(fin.token_ids)}")
            assert self.text.get(rid, "") == fin.text, (
                f"{self.name}: request {rid}: concatenated delta_text != final text\n"
                f"  deltas: {self.text.get(rid, '')!r}\n  final:  {fin.text!r}")


# ------------------------------------------------------------------------------------------------ state
def fingerprint(engine: Any) -> dict[str, Any]:
    """Everything a failed step must leave unchanged, by part: the public snapshot (queues and their requests,
    block tables with refcounts, the free queue in LRU order, each block's state, the stats minus wall time), the
    history length and the set of request ids."""
    snap = engine.snapshot()
    parts = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
    parts["stats"] = dataclasses.replace(snap.stats, busy_time_s=0.0, num_failed_steps=0)  # counts the failure
    parts["history_len"] = len(engine.history)
    parts["request_ids"] = tuple(sorted(engine.requests))
    parts["padding_slots"] = tuple(getattr(engine.scheduler, "padding_slots", ()))
    return parts


def diff_fingerprints(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the parts that differ, each with a short description."""
    out = []
    for k in before:
        if before[k] != after.get(k):
            b, a = before[k], after.get(k)
            if dataclasses.is_dataclass(b) and dataclasses.is_dataclass(a) and type(a) is type(b):
                fields = [f.name for f in dataclasses.fields(b) if getattr(b, f.name) != getattr(a, f.name)]
                out.append(f"{k} (fields {fields}: {[(getattr(b, f), getattr(a, f)) for f in fields][:3]})")
            else:
                out.append(f"{k}: {str(b)[:80]} -> {str(a)[:80]}")
    return out


def assert_rolled_back(before: dict[str, Any], engine: Any, take: Callable[[], dict[str, Any]] | None = None) -> None:
    """After a step raised: the engine is as it was before the step (``take``: how ``before`` was taken, when not
    ``fingerprint(engine)``).

    Two documented exceptions (``minienv.engine.core``): evicted cached blocks stay evicted, and a preemption (or a static padding slot released) the failed step's plan made stands (the
    victim's freed blocks may already hold the failed step's K/V, so they cannot be handed back); then the state
    differs by exactly that preemption, which the caller's later output comparison covers, and only the invariants
    and the set of requests are compared here.
    """
    after = fingerprint(engine) if take is None else take()
    engine.check_invariants()
    if (after["stats"].num_preemptions > before["stats"].num_preemptions
            or set(after["padding_slots"]) < set(before["padding_slots"])):  # a padding slot released: the same
        assert after["request_ids"] == before["request_ids"]
        return
    if after["stats"].evicted_blocks > before["stats"].evicted_blocks:
        # Also documented: cached-free blocks evicted while planning stay evicted (a cache hint, never an output).
        for part in ("free_queue", "block_states", "stats"):
            before, after = {**before, part: None}, {**after, part: None}
    changed = diff_fingerprints(before, after)
    assert not changed, f"the failed step changed the engine: {changed}"
