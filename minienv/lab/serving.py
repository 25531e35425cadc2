"""The demo model, and greedy serving of token-id prompts through the real engine.

* :func:`load_demo_model` — the bundled model + tokenizer, or a small random model with a byte "tokenizer" when the
  assets are absent (same code path, nonsense text).
* :func:`serve_greedy` — submits token-id prompts to :class:`~minienv.engine.InferenceEngine` (greedy, exactly
  ``max_new_tokens`` each) and reports what the prefix cache did. It is a *client* of the engine, not a copy of
  its loop: it only decides when each request arrives (``arrival_steps``, at most ``max_running`` in flight) and
  offers a hook just before each arrival (notebook 05 poisons cached K/V there, to prove that attention reads
  a hit's cached K/V).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

from minienv.engine import InferenceEngine
from minienv.kv.block_table import cdiv
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.kv.kv_pool import KVPool
from minienv.sampling import SamplingParams

__all__ = ["DemoModel", "load_demo_model", "ServeResult", "serve_greedy"]


# ====================================================================== the model the demos run on
@dataclass
class DemoModel:
    """A model plus ``encode`` / ``decode``; ``bundled`` says whether it is the trained model from ``assets/``."""

    model: object
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    name: str
    bundled: bool


def load_demo_model() -> DemoModel:
    """The bundled target model and tokenizer; if they are not in this checkout, a small seeded random Llama.

    The fallback "tokenizer" maps each word or punctuation mark to ``crc32(word) % vocab`` (about as many tokens as
    the BPE tokenizer gives): prompts built from the same text still share the same token prefix, so every sharing
    demo behaves the same; only the generated text is nonsense.
    """
    try:
        from minienv.model import load_model
        from minienv.tokenizer import load_tokenizer

        model, tok = load_model(), load_tokenizer()
        return DemoModel(model, tok.encode, tok.decode, "the bundled target model", True)
    except (FileNotFoundError, OSError):
        from minienv.model import LlamaConfig, LlamaModel, random_weights

        cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
        model = LlamaModel(cfg, random_weights(cfg, seed=0, scale=0.3))

        def encode(text: str) -> list[int]:
            return [zlib.crc32(w.encode("utf-8")) % 97 for w in re.findall(r"\w+|[^\w\s]", text)]

        def decode(ids: Sequence[int]) -> str:
            return "[" + " ".join(str(int(i)) for i in ids) + "]"

        return DemoModel(model, encode, decode, "a small random model (assets/ not found)", False)


# ====================================================================== greedy serving through the engine
class _TokenIds:
    """The engine's tokenizer slot for token-id prompts: no end-of-sequence token, ids shown as numbers."""

    eos_token_id = None

    @staticmethod
    def encode(text: str) -> list[int]:  # pragma: no cover - serve_greedy only sends token ids
        raise TypeError("serve_greedy serves token-id prompts")

    @staticmethod
    def decode(ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


@dataclass
class ServeResult:
    """Outputs of :func:`serve_greedy` and what the prefix cache did.

    ``prefill_tokens_computed`` counts the prompt tokens each request ran through the model at its first admission
    (its prompt minus ``cached_tokens_per_request``); recomputation after a preemption is in ``engine.stats``.
    """

    outputs: list[list[int]]
    prefill_tokens_computed: int
    prompt_tokens: int
    cached_tokens_per_request: list[int]
    evicted_blocks: int
    steps: int
    engine: InferenceEngine = field(repr=False)

    @property
    def manager(self) -> KVCacheManager:
        return self.engine.kv_cache_manager


def serve_greedy(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    caching: bool = True,
    max_running: int = 4,
    before_admit: Callable[[KVCacheManager, KVPool, int], None] | None = None,
    check_invariants: bool = False,
    arrival_steps: Sequence[int] | None = None,
) -> ServeResult:
    """Serve token-id ``prompts`` greedily with :class:`InferenceEngine`, ``max_new_tokens`` each, first come first
    served; request ``i`` is ``str(i)`` in the engine.

    The engine gets ``num_blocks`` blocks (default: every request's whole life at once), ``max_num_seqs =
    max_running`` and a token budget per step large enough that every prompt prefills in one step. Request ``i``
    arrives at engine step ``arrival_steps[i]`` (default all 0; e.g. ``range(n)`` for one arrival per step, a steady
    rate under which each prompt can hit the blocks of every request computed before it), and not before fewer
    than ``max_running`` requests are in flight. ``before_admit(manager, kv_pool, i)`` is called just before request
    ``i`` is added. ``check_invariants`` (tests) re-checks the engine's invariants after every step.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    arrivals = [0] * len(prompts) if arrival_steps is None else [int(a) for a in arrival_steps]
    if len(arrivals) != len(prompts) or any(a < 0 for a in arrivals):
        raise ValueError(f"arrival_steps needs one step >= 0 per prompt ({len(prompts)}), got {list(arrivals)}")
    if num_blocks is None:
        num_blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
    engine = InferenceEngine(model, _TokenIds(), kv_budget_tokens=num_blocks * block_size, block_size=block_size,
                             enable_prefix_caching=caching, max_num_seqs=max_running,
                             max_num_batched_tokens=max(max_running, sum(len(p) for p in prompts) + max_running),
                             history_size=0)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0)
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    in_flight: set[str] = set()
    clock = nxt = 0
    while nxt < len(order) or in_flight:
        while nxt < len(order) and arrivals[order[nxt]] <= clock and len(in_flight) < max_running:
            i = order[nxt]
            if before_admit is not None:
                before_admit(engine.kv_cache_manager, engine.kv_pool, i)
            in_flight.add(engine.add_request(prompts[i], params, request_id=str(i)))
            nxt += 1
        if not in_flight:  # idle until the next arrival
            clock = arrivals[order[nxt]]
            continue
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
        if check_invariants:
            engine.check_invariants()
        clock += 1
    outs = [engine.output(str(i)) for i in range(len(prompts))]
    cached = [o.num_cached_tokens for o in outs]
    stats = engine.stats
    return ServeResult([list(o.token_ids) for o in outs], sum(len(p) for p in prompts) - sum(cached),
                       sum(len(p) for p in prompts), cached, stats.evicted_blocks, stats.num_steps, engine)
