"""The engine's side of speculative decoding: who speculates, how much, and what verification decided.

The engine owns one :class:`Speculator` when it is built with a ``speculative_config``. Each step:

1. after sampling, :meth:`Speculator.propose` gives every running request that is decoding next step up to ``k``
   draft tokens (``request.spec_token_ids``), fewer when the request is close to ``max_tokens`` (a draft past the
   last token it may emit is wasted work);
2. the scheduler reserves slots for the last token *and* the drafts, so the target scores ``k + 1`` positions in
   the same batched call as every other request (speculating and plain requests share the step);
3. :meth:`Speculator.verify` turns those rows into the tokens to append (:func:`~minienv.spec_decode.rejection.verify`);
   the scheduler truncates the KV of the rejected drafts *before* committing, so a block holding an unverified
   token is never hashed into the prefix cache.

Counters follow vLLM's spec-decode metrics: drafts, draft tokens, accepted tokens, accepted tokens per position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np

from minienv.request import Request
from minienv.spec_decode.draft import DraftInput, DraftProposer
from minienv.spec_decode.ngram import NgramProposer
from minienv.spec_decode.rejection import VerifyResult, verify, verify_coupled

SpecMethod = Literal["draft", "ngram"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate (names follow vLLM's ``speculative_config``).

    method: ``"draft"`` (a small model proposes; the bundled draft by default) or ``"ngram"`` (prompt lookup).
    num_speculative_tokens: ``k``, drafts proposed per request per step.
    draft_model: a loaded model or a model directory (``"draft"`` only; default: the bundled draft).
    draft_tokenizer: the draft's tokenizer, if it has its own; it must be the target's (same ids, same bytes).
    prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried, longest first (``"ngram"`` only).
    draft_kv_budget_tokens: the draft's own KV budget (default: the target's).
    """

    method: SpecMethod
    num_speculative_tokens: int
    draft_model: Any = None
    draft_tokenizer: Any = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    draft_kv_budget_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("draft", "ngram"):
            raise ValueError(f"speculative_config: method must be 'draft' or 'ngram', got {self.method!r}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.draft_kv_budget_tokens is not None:
            _positive_int("draft_kv_budget_tokens", self.draft_kv_budget_tokens)
        if self.method == "ngram" and (self.draft_model is not None or self.draft_tokenizer is not None):
            raise ValueError("speculative_config: method 'ngram' uses no draft model; drop draft_model / "
                             "draft_tokenizer or use method 'draft'")

    @classmethod
    def coerce(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """Accept a config, a vLLM-style dict (``{"method": "ngram", "num_speculative_tokens": 3}``), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; "
                                 f"known: {sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise ValueError(f"speculative_config must be a SpeculativeConfig, a dict or None, got {value!r}")


@dataclass
class SpecDecodingStats:
    """Acceptance counters (vLLM: ``vllm:spec_decode_num_drafts`` and friends)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verifications of a non-empty proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted_per_pos[i]: drafts kept at position i
    num_rejections: int = 0  # verifications that rejected a draft (the others kept all of theirs)
    num_failed_proposals: int = 0  # proposal rounds that raised (rolled back: those requests decode plainly)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def conditional_acceptance_rate(self) -> float:
        """P(a draft is kept | every draft before it was): kept / drafts actually judged (a draft after the first
        rejection is never judged). The alpha of the i.i.d. model, whose expected tokens per verification is
        ``(1 - alpha^(k+1)) / (1 - alpha)``."""
        judged = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / judged if judged else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts + the one the target always adds (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def observe(self, result: VerifyResult) -> None:
        if result.num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += result.num_draft_tokens
        self.num_accepted_tokens += result.num_accepted
        self.num_rejections += result.num_accepted < result.num_draft_tokens
        for i in range(result.num_accepted):
            self.accepted_per_pos[i] += 1


def _same_tokenizer(a: Any, b: Any) -> bool:
    if a is b:
        return True
    n = getattr(a, "vocab_size", None)
    if n is None or n != getattr(b, "vocab_size", None):
        return False
    return all(a.id_to_bytes(i) == b.id_to_bytes(i) if i not in a.special_tokens.values()
               else a.id_to_token(i) == b.id_to_token(i) for i in range(n))


class Speculator:
    """Proposes and verifies for one engine (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, *, target_model: Any, tokenizer: Any, block_size: int,
                 kv_budget_tokens: int, num_sampled_ids: int, max_num_batched_tokens: int):
        self.config = config
        k = config.num_speculative_tokens
        if k + 1 > max_num_batched_tokens:
            raise ValueError(f"speculative_config: num_speculative_tokens ({k}) + 1 must fit max_num_batched_tokens "
                             f"({max_num_batched_tokens}): verification feeds k + 1 tokens of one request at once")
        if k + 1 > kv_budget_tokens:
            raise ValueError(f"speculative_config: num_speculative_tokens ({k}) + 1 exceeds the KV budget "
                             f"({kv_budget_tokens} tokens): the drafts of one request could never get slots")
        limit = target_model.config.max_position_embeddings
        if k >= limit:
            raise ValueError(f"speculative_config: num_speculative_tokens ({k}) must be below the model's context "
                             f"({limit} positions)")
        self.k = k
        self.num_sampled_ids = num_sampled_ids
        self.stats = SpecDecodingStats(k)
        #: what verification decided in the latest step, by request id (views read it; cleared every step)
        self.last_results: dict[str, VerifyResult] = {}
        self.ngram: NgramProposer | None = None
        self.draft: DraftProposer | None = None
        if config.method == "ngram":
            self.ngram = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
            return
        draft = config.draft_model
        if draft is None or isinstance(draft, (str, Path)):
            from minienv.model import load_model
            from minienv.paths import assets_dir

            draft = load_model(assets_dir() / "draft" if draft is None else draft)
        if draft.config.vocab_size != target_model.config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.config.vocab_size} ids) "
                             f"differs from the target's ({target_model.config.vocab_size}); a draft must share "
                             "the target's tokenizer")
        if config.draft_tokenizer is not None and not _same_tokenizer(config.draft_tokenizer, tokenizer):
            raise ValueError("speculative_config: the draft's tokenizer differs from the target's (ids map to "
                             "different bytes); its proposals would be other tokens than they look")
        budget = config.draft_kv_budget_tokens or kv_budget_tokens
        self.draft = DraftProposer(draft, budget, block_size, num_sampled_ids)

    # ------------------------------------------------------------------ propose
    def propose(self, requests: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` (and ``spec_probs``) of each request; [] where nothing is proposed.

        ``requests`` are running and about to decode (every token but the last is computed). ``k`` shrinks near
        ``max_tokens``: a request that may emit ``r`` more tokens gets at most ``r - 1`` drafts.
        """
        try:
            self._propose(requests)
        except BaseException:  # a proposal is all or nothing: no drafts, no draft KV of this batch survive
            for req in requests:
                req.spec_token_ids, req.spec_probs = [], None
                self.free(req.request_id)
            self.stats.num_failed_proposals += 1
            raise

    def _propose(self, requests: Sequence[Request]) -> None:
        todo: list[DraftInput] = []
        for req in requests:
            req.spec_token_ids, req.spec_probs = [], None
            k = min(self.k, req.sampling_params.max_tokens - req.num_output_tokens - 1)
            if k < 1:
                continue
            if self.ngram is not None:
                req.spec_token_ids = self.ngram.propose(req.all_token_ids, k)
            else:
                todo.append(DraftInput(req.request_id, req.all_token_ids, k, req.sampler))
        if todo:
            assert self.draft is not None
            by_id = {r.request_id: r for r in requests}
            for rid, proposal in self.draft.propose(todo).items():
                by_id[rid].spec_token_ids, by_id[rid].spec_probs = proposal.token_ids, proposal.probs

    def free(self, request_id: str) -> None:
        """The request left the running set (finished, aborted, preempted): drop its draft KV."""
        if self.draft is not None:
            self.draft.free(request_id)

    # ------------------------------------------------------------------ verify
    def verify(self, req: Request, drafts: Sequence[int], logits: np.ndarray) -> VerifyResult:
        """The tokens ``req`` appends, from the target's ``[len(drafts) + 1, V]`` logits (padded ids masked).

        Greedy: :func:`~minienv.spec_decode.rejection.verify`. Sampled (also with no drafts at all):
        :func:`~minienv.spec_decode.rejection.verify_coupled` with the request's noise for the positions it fills,
        so its text is a function of (seed, position) only (see that module)."""
        logits = logits[:, : self.num_sampled_ids]
        if req.sampling_params.greedy:
            result = verify(list(drafts), logits, None, None, True)
        else:
            probs = req.sampler.probs(logits)
            start = req.num_tokens  # the position of the first token this verification emits
            noise = np.stack([req.sampler.noise(start + i, probs.shape[-1]) for i in range(len(drafts) + 1)])
            result = verify_coupled(list(drafts), probs, noise)
        self.stats.observe(result)
        self.last_results[req.request_id] = result
        return result
