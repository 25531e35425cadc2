"""Notebook 15's exercises: what a KV budget holds once a system prompt is shared, and the prefix-cache hits that
prompt earns — both in blocks, the way the engine counts (notebook 02 counted bytes per token; this is what blocks
and sharing do to those bytes).

Each check runs hand-made cases at the edges of every rule (a system prompt exactly a block long, one shorter than a
block, a partial last block, one user, a pool exactly full...). A wrong answer is named by the rule it breaks: the
check recomputes each case with one rule broken at a time and reports the rule whose broken version explains the
answers, not merely the first case that differs. Pure arithmetic: no model is loaded.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from minienv.exercises._check import exercise, fail


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Raised:
    """A case on which the student's code raised: kept, so that the rule their other answers break is named first."""

    def __init__(self, err: Exception, rule: str) -> None:
        self.err, self.rule = err, rule

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


def _diagnose(got: list, want: list, variants: list[tuple[str, list]], cases: list, fallback: str, show) -> None:
    """Fail naming the rule whose broken versions explain the most wrong answers (ties: the first listed); else the
    rule of the first case the student's code raised on, with their error; else ``fallback``."""
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if not wrong:
        return
    score: dict[str, int] = {}
    for rule, values in variants:
        score[rule] = max(score.get(rule, 0), sum(got[i] == values[i] for i in wrong))
    best = max(score, key=lambda r: score[r]) if score else None
    if best is not None and score[best] > 0:
        i = next(i for i in wrong if any(got[i] == v[i] for r, v in variants if r == best))
        fail(best, f"{show(cases[i])}: expected {want[i]}, got {got[i]}")
    raised = [got[i] for i in wrong if isinstance(got[i], _Raised)]
    if raised:
        r = raised[0]
        _, call = r.err._minienv_student
        fail(r.rule, f"your code raised {type(r.err).__name__}: {r.err}\n  while the check called {call}")
    i = wrong[0]
    fail(fallback, f"{show(cases[i])}: expected {want[i]}, got {got[i]}")


def _answers(fn, cases: list, rules_of_cases: list[str], type_rule: str) -> list:
    """The student's answer to every case (a :class:`_Raised` where their code raised: reported under that case's
    rule unless another rule explains their wrong answers)."""
    out: list = []
    for case, rule in zip(cases, rules_of_cases):
        fn.rule = rule
        try:
            got = fn(*case)
        except Exception as err:  # noqa: BLE001 - the student's; the stub's NotImplementedError is not caught
            if not hasattr(err, "_minienv_student"):
                raise
            out.append(_Raised(err, rule))
            continue
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            fail(type_rule, f"{fn._describe(case, {})} returned {got!r}")
        out.append(int(got))
    fn.rule = None
    return out


# ------------------------------------------------------------------------------------------ exercise 1
FIT_RULES = {
    "blocks": "memory is handed out in whole blocks: a conversation's last, partly filled block takes a whole block",
    "shared": "the system prompt's full blocks are stored once, shared by every conversation — but they take room "
              "in the pool too",
    "partial": "only full blocks are shared: the system prompt's partly filled last block is each conversation's own",
    "whole": "count whole conversations only: 0 when not even one fits, never a negative count",
    "int": "return one int: the number of conversations",
}


def conversations_that_fit_reference(num_blocks: int, block_size: int, system_len: int, conversation_len: int) -> int:
    """Conversations of ``conversation_len`` tokens each, the first ``system_len`` of them one system prompt shared by
    all (prefix caching on), that fit together in ``num_blocks`` blocks of ``block_size`` tokens."""
    shared = system_len // block_size
    own = _ceil(conversation_len, block_size) - shared
    return 0 if num_blocks < shared + own else (num_blocks - shared) // own


#: (num_blocks, block_size, system_len, conversation_len), and the rule each case is at the edge of
FIT_CASES = [
    ((48, 16, 64, 200), "partial"),    # a system prompt of exactly 4 blocks: no partial block
    ((48, 16, 70, 200), "partial"),    # 4 full blocks + a partial one
    ((48, 16, 10, 100), "partial"),    # a system prompt shorter than one block: nothing shared
    ((48, 16, 0, 96), "blocks"),       # no system prompt; conversations exactly 6 blocks long
    ((48, 16, 0, 97), "blocks"),       # one token more: 7 blocks each
    ((50, 16, 64, 96), "shared"),      # pool = 4 shared + 23 × 2 own: exactly full
    ((5, 16, 64, 96), "whole"),        # 4 shared + 2 own do not fit: 0
    ((3, 16, 64, 96), "whole"),        # smaller than the shared blocks alone: 0, not negative
    ((6, 16, 64, 96), "whole"),        # exactly one fits
    ((100, 4, 30, 31), "partial"),     # 7 full blocks shared; the 8th block (2 + 1 tokens) each one's own
    ((1000, 1, 300, 320), "shared"),   # blocks of one token: every system-prompt token shared
    ((256, 16, 200, 1000), "blocks"),  # a long conversation: 63 blocks, 12 of them shared
]


def _fit_slips(nb: int, b: int, s: int, n: int) -> list[tuple[str, int]]:
    """One case answered with one rule broken at a time: what a student who misses that rule gets."""
    shared, own = s // b, _ceil(n, b) - s // b
    up = _ceil(s, b)  # the partial block counted as shared
    own_up = max(_ceil(n, b) - up, 1)
    tokens, own_tokens = (nb - shared) * b, n - shared * b
    own_down = max(n // b - shared, 1)
    return [
        ("shared", nb // _ceil(n, b)),  # nothing shared
        ("shared", nb // own),  # shared, but the shared blocks take no room
        ("partial", 0 if nb < up + own_up else (nb - up) // own_up),
        ("partial", 0 if nb < shared + _ceil(n - s, b) else (nb - shared) // _ceil(n - s, b)),
        ("blocks", 0 if tokens < own_tokens else tokens // own_tokens),  # tokens, not blocks
        ("blocks", 0 if nb < shared + own_down else (nb - shared) // own_down),  # the last partial block dropped
        ("whole", (nb - shared) // own),  # negative when the shared blocks alone do not fit
        ("whole", _ceil(nb - shared, own)),  # a partial conversation counted
    ]


@exercise("write conversations_that_fit(num_blocks, block_size, system_len, conversation_len): how many such "
          "conversations the pool holds at once, the system prompt's full blocks shared")
def check_conversations_that_fit(fn) -> str:
    cases = [c for c, _ in FIT_CASES]
    got = _answers(fn, cases, [FIT_RULES[r] for _, r in FIT_CASES], FIT_RULES["int"])
    want = [conversations_that_fit_reference(*c) for c in cases]
    slips = [_fit_slips(*c) for c in cases]
    variants = [(FIT_RULES[rule], [case_slips[k][1] for case_slips in slips]) for k, (rule, _) in enumerate(slips[0])]
    show = lambda c: (f"{c[0]} blocks of {c[1]}, system prompt {c[2]} tokens, "  # noqa: E731
                      f"conversations of {c[3]}")
    _diagnose(got, want, variants, cases, "the shared full blocks once, then every conversation's own blocks, "
              "whole conversations only", show)
    return (f"conversations_that_fit is right in all {len(cases)} cases: a shared system prompt is paid once, in "
            "whole blocks")


# ------------------------------------------------------------------------------------------ exercise 2
HIT_RULES = {
    "first": "the first request finds nothing cached: it computes the shared prefix",
    "whole": "only whole blocks are hits: a partly filled block is not hashed",
    "last": "the prompt's last token is never a hit (its logits are needed): a prompt that is all shared prefix "
            "recomputes its last block",
    "every": "every later request hits the shared blocks: sum over all of them",
    "tokens": "count tokens (blocks × block_size), not blocks",
    "int": "return one int: the hit tokens of all the requests together",
}


def prefix_hit_tokens_reference(shared_len: int, prompt_lens: list[int], block_size: int) -> int:
    """Prompt tokens served from the prefix cache when requests sharing their first ``shared_len`` tokens (and
    differing after) run one after another: every request after the first finds the shared prefix's full blocks,
    never its own last token."""
    return sum(min(shared_len // block_size, (n - 1) // block_size) * block_size for n in prompt_lens[1:])


#: (shared_len, prompt lengths, block_size), and the rule each case is at the edge of
HIT_CASES = [
    ((40, [50], 16), "first"),                    # one user: nothing to hit
    ((40, [50, 60], 16), "whole"),                # a partial shared block (40 = 2 blocks + 8)
    ((32, [40, 33, 50], 16), "whole"),            # a shared prefix of exactly 2 blocks
    ((48, [48, 48], 16), "last"),                 # the whole prompt is shared, a block multiple: 2 of 3 blocks hit
    ((16, [16, 16, 16], 16), "last"),             # a prompt exactly one block long: no hit at all
    ((10, [20, 30], 16), "whole"),                # a shared prefix shorter than a block
    ((17, [17, 40], 16), "last"),                 # a partial last block after a full one
    ((100, [120, 140, 160, 180], 4), "every"),    # four users, small blocks
    ((64, [65, 200, 80], 32), "every"),
    ((5, [5, 9, 5], 1), "last"),                  # blocks of one token: the last token alone is recomputed
]


def _hit_slips(s: int, lens: list[int], b: int) -> list[tuple[str, int]]:
    """One case answered with one rule broken at a time."""
    def total(prompts: list[int], per: Callable[[int], int]) -> int:
        return sum(per(n) for n in prompts)
    right = lambda n: min(s // b, (n - 1) // b) * b  # noqa: E731
    return [
        ("first", total(lens, right)),
        ("whole", total(lens[1:], lambda n: min(s, n - 1))),  # partial blocks hit
        ("whole", total(lens[1:], lambda n: min(_ceil(s, b), (n - 1) // b) * b)),  # the partial block rounded up
        ("last", total(lens[1:], lambda n: s // b * b)),  # no cap
        ("last", total(lens[1:], lambda n: min(s // b, n // b) * b)),  # capped at the prompt, not below its last
        ("last", total(lens[1:], lambda n: min((s - 1) // b, (n - 1) // b) * b)),  # the cap on the shared part
        ("every", total(lens[1:2], right)),  # the second request only
        ("tokens", total(lens[1:], lambda n: min(s // b, (n - 1) // b))),  # blocks, not tokens
    ]


@exercise("write prefix_hit_tokens(shared_len, prompt_lens, block_size): prompt tokens the prefix cache serves")
def check_prefix_hit_tokens(fn) -> str:
    cases = [c for c, _ in HIT_CASES]
    got = _answers(fn, [(s, list(lens), b) for s, lens, b in cases], [HIT_RULES[r] for _, r in HIT_CASES],
                   HIT_RULES["int"])
    want = [prefix_hit_tokens_reference(*c) for c in cases]
    slips = [_hit_slips(*c) for c in cases]
    variants = [(HIT_RULES[rule], [case_slips[k][1] for case_slips in slips]) for k, (rule, _) in enumerate(slips[0])]
    show = lambda c: f"shared {c[0]}, prompts {c[1]}, blocks of {c[2]}"  # noqa: E731
    _diagnose(got, want, variants, cases, "every later request hits the shared prefix's full blocks, capped below "
              "its own last token", show)
    return f"prefix_hit_tokens is right in all {len(cases)} cases"
