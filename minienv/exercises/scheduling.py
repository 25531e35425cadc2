"""Notebook 07's exercises: a victim policy for preemption, and how one step's token budget is split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minienv.engine import InferenceEngine
from minienv.exercises._check import exercise, fail, require
from minienv.generate import generate_ids
from minienv.lab.tiny import TokenIdTokenizer, tiny_model
from minienv.sampling import SamplingParams


@dataclass
class Candidate:
    """What a victim policy reads from a request (the engine passes its real requests)."""

    request_id: str
    num_computed_tokens: int


def _pick(fn, cands: list[Candidate]) -> Candidate:
    got = fn(list(cands))
    require(any(got is c for c in cands), "return one of the candidates (the request object itself)",
            f"candidates {[(c.request_id, c.num_computed_tokens) for c in cands]}: got {got!r}")
    return got


@exercise("write fewest_computed(candidates): the candidate with the fewest num_computed_tokens; among equals "
          "the latest in the list")
def check_victim_policy(fn) -> str:
    """Hand-made candidate lists (one rule each), then tight workloads on a real engine with your policy."""
    table = [
        ([("a", 10), ("b", 3), ("c", 7)], "b", "preempt the candidate with the fewest computed tokens (least work "
                                              "to redo)"),
        ([("a", 2), ("b", 9), ("c", 5)], "a", "preempt the candidate with the fewest computed tokens, wherever it "
                                              "is in the list"),
        ([("a", 10), ("b", 3), ("c", 3), ("d", 5)], "c", "among equals, preempt the most recently admitted (the "
                                                         "latest in the list)"),
        ([("a", 4), ("b", 4), ("c", 4)], "c", "among equals, preempt the most recently admitted (the latest in "
                                              "the list)"),
        ([("d", 5), ("r7", 2), ("r10", 2), ("b", 9)], "r10", "among equals, the latest in the LIST — the list is "
                                                              "admission order, not the order of the ids"),
        ([("z", 2), ("m", 2), ("a", 6)], "m", "among equals, the latest in the LIST — the list is admission order, "
                                             "not the order of the ids"),
        ([("a", 6)], "a", "a single candidate is the victim"),
    ]
    for pairs, want, rule in table:
        cands = [Candidate(rid, n) for rid, n in pairs]
        got = _pick(fn, cands)
        require(got.request_id == want, rule, f"candidates (id, computed) {pairs}: expected {want}, "
                                              f"got {got.request_id}")
    model, tok = tiny_model(), TokenIdTokenizer()
    recomputed: dict[str, int] = {}
    for seed in range(3):
        r = np.random.default_rng(100 + seed)
        ps = [r.integers(0, 128, int(r.integers(8, 30))).tolist() for _ in range(5)]
        sp = SamplingParams(max_tokens=20, temperature=0)
        choices = []

        def recording(cands):
            pick = fn(list(cands))
            choices.append(([(c.request_id, c.num_computed_tokens) for c in cands], getattr(pick, "request_id", pick)))
            return pick

        for name, policy in (("yours", recording), ("default", None)):
            e = InferenceEngine(model, tok, kv_budget_tokens=80, block_size=8, max_num_seqs=5,
                                max_num_batched_tokens=64, victim_policy=policy)
            try:
                outs = e.generate(ps, sp)
            except ValueError as err:
                fail("return one of the candidates (the request object itself)", f"the engine said: {err}")
            for p, o in zip(ps, outs, strict=True):
                assert list(o.token_ids) == list(generate_ids(model, p, sp)), "preemption changed an output"
            recomputed[name] = recomputed.get(name, 0) + e.stats.num_computed_tokens
        assert choices, "no preemption happened: the check's budget is too large"
        for cands, picked in choices:
            least = min(n for _, n in cands)
            expected = [rid for rid, n in cands if n == least][-1]
            require(picked == expected, "in the engine too: the fewest computed tokens, the latest among equals",
                    f"seed {seed}, candidates (id, computed) {cands}: expected {expected}, got {picked}")
    return (f"fewest_computed picks every victim right; tokens computed {recomputed['yours']} with your policy vs "
            f"{recomputed['default']} with the default, and no output changed")


def plan_reference(needs: list[int], budget: int) -> list[int]:
    """minienv's rule (``Scheduler._plan``, without memory): decodes are reserved first, prefill chunks take the
    rest of the budget in running order."""
    decodes_after = sum(1 for n in needs if n == 1)
    out = []
    for need in needs:
        if need == 1:
            decodes_after -= 1
            n = 1
        else:
            n = max(0, min(need, budget - decodes_after))
        budget -= n
        out.append(n)
    return out


def plan_rule_broken(needs: list[int], budget: int, got) -> str | None:
    """The first of Exercise 2's rules that ``got`` (a plan for ``needs`` and ``budget``) breaks, or None; the
    capstone holds the student's ``plan_step`` to the same rules inside the engine."""
    want = plan_reference(needs, budget)
    if got is None or len(got) != len(needs):
        return "one number per running request, in order"
    if sum(got) > budget:
        return "a step never computes more tokens than the budget"
    if not all(0 <= g <= n for g, n in zip(got, needs)):
        return "a request computes at most what it still needs"
    if not all(g == 1 for g, n in zip(got, needs) if n == 1):
        return "every decode gets its token, even after a long prefill (decodes never stall)"
    if list(got) != want:
        return ("prefill chunks take the rest of the budget in running order: the earlier request first, as much as "
                "it needs")
    return None


@exercise("write plan_step(needs, budget): tokens each running request computes this step (decodes first, then "
          "prefill chunks in order)")
def check_plan_step(fn) -> str:
    def case(needs: list[int], budget: int) -> None:
        want = plan_reference(needs, budget)
        got = fn(list(needs), budget)
        got = None if got is None else list(got)
        broken = plan_rule_broken(needs, budget, got)
        require(broken is None, broken or "", f"needs {needs}, budget {budget}: expected {want}, got {got}")

    case([1, 1, 1], 8)
    case([5, 1], 16)
    case([30, 1, 1], 16)
    case([30, 20], 16)
    case([1, 12, 1, 9, 1], 16)
    rng = np.random.default_rng(7)
    for _ in range(200):
        needs = [1 if rng.random() < 0.5 else int(rng.integers(2, 60)) for _ in range(int(rng.integers(1, 7)))]
        case(needs, int(rng.integers(sum(n == 1 for n in needs) or 1, 80)))
    return "plan_step splits the budget as minienv's scheduler does: decodes first, chunks in order"
