"""Notebook 12's exercises: the acceptance step of speculative sampling, and n-gram prompt lookup."""

from __future__ import annotations

import numpy as np

from minienv.exercises._check import exercise, fail, require
from minienv.lab.speculation import chi_square_check
from minienv.spec_decode.ngram import NgramProposer
from minienv.spec_decode.rejection import VerifyResult


def _as_verifier(attempt):
    """The student's ``accept_step(drafts, target_probs, draft_probs, rng)`` as a verifier for the chi-square
    check, after checking the shape of what it returns on every call (rule 1)."""
    def verifier(drafts, target_probs, draft_probs, rng, greedy):
        out = attempt(list(drafts), target_probs, draft_probs, rng)
        out = [int(t) for t in out]
        n = len(out) - 1
        require(0 <= n <= len(drafts) and out[:n] == list(drafts[:n]),
                "return the kept drafts (a prefix of the drafts) followed by exactly one token of the target's",
                f"drafts {list(drafts)}, you returned {out}")
        return VerifyResult(out, len(drafts), n)
    return verifier


@exercise("write accept_step(drafts, target_probs, draft_probs, rng) -> the tokens to append")
def check_accept_step(fn) -> str:
    """Hand-made cases, one per rule, then the chi-square test on the enumerable bigram world."""
    rng = np.random.default_rng(0)
    verifier = _as_verifier(fn)
    # rule 2: a draft the target rules out is never kept; a draft with p >= q is always kept
    p = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    q = np.array([[0.9, 0.05, 0.05]])
    for _ in range(50):
        r = verifier([0], p, q, rng, False)
        require(r.num_accepted == 0, "keep a draft with probability min(1, p/q): p = 0 means never",
                f"draft 0 has p = 0, q = 0.9, and you kept it: {r.token_ids}")
    p = np.array([[0.1, 0.8, 0.1], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    q = np.array([[0.3, 0.4, 0.3], [0.2, 0.3, 0.5]])
    for _ in range(50):
        r = verifier([1, 2], p, q, rng, False)
        # a correct answer never ends on draft 2 here: p - q is 0 at position 2, so no fix token can be 2
        require(r.token_ids != [1, 2], "return the kept drafts (a prefix of the drafts) followed by exactly one "
                "token of the target's", f"drafts [1, 2] are both kept (p >= q), and you returned only {r.token_ids}")
        require(r.num_accepted == 2, "keep a draft with probability min(1, p/q): p >= q means always",
                f"drafts [1, 2] have p/q = 2 and 1, and you kept {r.num_accepted}")
        # rule 4: all kept -> the bonus comes from p at position k + 1 (here: token 0 for sure)
        require(r.token_ids[-1] == 0, "when every draft is kept, draw the bonus from p at position k + 1",
                f"p at position 3 puts all its mass on token 0; your bonus was {r.token_ids[-1]}")
    # rule 3: on rejection draw from normalise(max(p - q, 0)); that residual is 0 on the rejected draft
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[1.0, 0.0, 0.0]])
    for _ in range(200):
        r = verifier([0], p, q, rng, False)
        if r.num_accepted == 0:
            require(r.token_ids == [1], "on rejection draw from normalise(max(p - q, 0)), not from p",
                    f"p = [0.5, 0.5, 0], q = [1, 0, 0]: the residual is all on token 1; you drew {r.token_ids}")
    # the distribution, end to end (the rule the others serve)
    result = chi_square_check(verifier, k=2, seed=1)
    require(result.passed, "the output must be distributed exactly as the target's samples", str(result))
    return f"your acceptance step keeps the target's distribution ({result})"


@exercise("write propose(token_ids, k, min_n, max_n) -> the tokens that followed the latest longest match")
def check_ngram(fn) -> str:
    cases = [
        # (tokens, k, min_n, max_n, rule the case tests)
        ([1, 2, 3, 4, 1, 2, 3], 4, 1, 3, "match the suffix and propose the tokens that followed it"),
        ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, "propose at most k tokens"),
        ([8, 9, 5, 6, 9, 7, 8, 9], 3, 1, 3, "try the longest n first (max_n down to min_n)"),
        ([4, 1, 4, 2, 4], 2, 1, 3, "among matches of the same length, the most recent wins"),
        ([5, 6, 7], 2, 1, 3, "no match: propose nothing ([])"),
        ([1, 5, 6, 1], 2, 2, 3, "never use an n below min_n"),
        ([7, 7], 3, 1, 3, "a match may overlap the suffix, but must end before the last token"),
        ([1, 1, 2, 1, 1, 1], 2, 1, 2, "a match may overlap the suffix, but must end before the last token"),
        ([3], 2, 1, 3, "no match: propose nothing ([])"),
    ]
    for tokens, k, lo, hi, rule in cases:
        want = NgramProposer(k, lo, hi).propose(tokens)
        got = fn(list(tokens), k, lo, hi)
        got = None if got is None else [int(t) for t in got]
        require(got == want, rule, f"tokens {tokens}, k={k}, n in [{lo}, {hi}]: expected {want}, got {got}")
    rng = np.random.default_rng(5)
    for _ in range(300):  # random sequences over a small vocabulary: many repeats
        tokens = [int(t) for t in rng.integers(0, 4, int(rng.integers(0, 14)))]
        k, lo = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        want = NgramProposer(k, lo, hi).propose(tokens)
        got = [int(t) for t in (fn(list(tokens), k, lo, hi) or [])]
        if got != want:
            fail("the latest occurrence of the longest suffix n-gram (n from max_n down to min_n), then up to k "
                 "tokens after it", f"tokens {tokens}, k={k}, n in [{lo}, {hi}]: expected {want}, got {got}")
    return "your n-gram lookup proposes what minienv's NgramProposer does on 308 sequences"
