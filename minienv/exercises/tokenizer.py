"""Notebook 01's exercises: one step of BPE training, and BPE encoding of one pre-token."""

from __future__ import annotations

import copy
from collections import Counter

from minienv.exercises._check import exercise, fail, require
from minienv.tokenizer import BPETokenizer, pretokenize

# A short text with enough repetition for a few dozen merges (the notebook's passage is Hamlet; any text does).
TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them. "
        "The thatcher thatched the thistles; then the rat sat on the mat, and the cat sat on the hat.")


def _as_answer(got):
    """A student's answer in the shape the rules compare: a list where a tuple is asked for counts as the tuple."""
    if isinstance(got, (list, tuple)) and len(got) == 3:
        pair, new_id, new_words = got
        return (tuple(pair) if isinstance(pair, (list, tuple)) else pair), new_id, new_words
    return got


def _expect(fn, words: dict, want, rule: str) -> None:
    """One case: ``fn(words)`` must equal ``want``; a different answer (or an exception) breaks ``rule``."""
    given = copy.deepcopy(words)
    try:
        got = _as_answer(fn(given))
    except Exception as err:  # noqa: BLE001 - the student's code failing on this case is this rule's failure
        fail(rule, f"words={words}: your function raised {type(err).__name__}: {err}")
    require(given == words, "do not modify the input dict (the trainer still needs it)",
            f"words={words} became {given}")
    require(got == want, rule, f"words={words}\n  expected {want}\n  got      {got}")


@exercise("write merge_step(words) -> (pair, new_id, new_words), or None when no word has two tokens",
          none_ok=True)
def check_merge_step(fn) -> str:
    """Each case isolates one rule the notebook states, in an order where a wrong answer fails first on the rule it
    breaks (a case that needs weights comes after the ones that do not, and so on)."""
    _expect(fn, {(1, 2): 1}, ((1, 2), 256, {(256,): 1}),
            "one word, one pair: merge it into id 256 (the first id after the 256 bytes)")
    _expect(fn, {(1, 2): 3}, ((1, 2), 256, {(256,): 3}), "new_words keeps each word's count")
    _expect(fn, {(3, 4): 1, (5, 3, 4): 1, (1, 2): 1}, ((3, 4), 256, {(256,): 1, (5, 256): 1, (1, 2): 1}),
            "pick the most frequent pair: (3, 4) occurs twice, (1, 2) once")
    _expect(fn, {(1, 2): 5, (3, 4, 3, 4): 1}, ((1, 2), 256, {(256,): 5, (3, 4, 3, 4): 1}),
            "count pairs weighted by the word's count: (1, 2) occurs 5 times, (3, 4) only twice")
    _expect(fn, {(3, 4, 3, 4): 1, (1, 2): 1}, ((3, 4), 256, {(256, 256): 1, (1, 2): 1}),
            "count every occurrence of a pair in a word: (3, 4, 3, 4) holds (3, 4) twice")
    _expect(fn, {(9, 8): 1, (1, 2): 1}, ((1, 2), 256, {(9, 8): 1, (256,): 1}),
            "break ties by the smallest pair")
    _expect(fn, {(1, 3): 1, (1, 2): 1}, ((1, 2), 256, {(1, 3): 1, (256,): 1}),
            "break ties by the smallest pair: compare whole tuples, (1, 2) < (1, 3)")
    _expect(fn, {(5, 5, 5): 1}, ((5, 5), 256, {(256, 5): 1}), "merge left to right, without overlaps")
    _expect(fn, {(7, 7, 7): 1, (6, 8): 1}, ((7, 7), 256, {(256, 7): 1, (6, 8): 1}),
            "count every adjacent pair, overlapping ones too: (7, 7, 7) holds (7, 7) twice")
    _expect(fn, {(5, 5, 5, 5): 1, (6, 7): 1}, ((5, 5), 256, {(256, 256): 1, (6, 7): 1}),
            "merge every occurrence of the pair in a word")
    _expect(fn, {(300, 7): 2, (300,): 1}, ((300, 7), 301, {(301,): 2, (300,): 1}),
            "the new id is the largest id in any word + 1 (at least 256)")
    _expect(fn, {(1, 2): 1, (400,): 1}, ((1, 2), 401, {(401,): 1, (400,): 1}),
            "the new id is the largest id in any word + 1 — a one-token word's id counts too")
    _expect(fn, {(1, 2, 1): 1, (3, 1, 2): 1}, ((1, 2), 256, {(256, 1): 1, (3, 256): 1}),
            "keep the other tokens, in place")
    _expect(fn, {(4, 1, 2): 2, (4, 256): 1}, ((1, 2), 257, {(4, 257): 2, (4, 256): 1}),
            "(4, 1) and (1, 2) tie at 2 and the smaller pair wins; the new id is 257 since 256 is taken")
    _expect(fn, {(7,): 3, (8,): 1}, None, "nothing to merge: return None")
    _expect(fn, {}, None, "nothing to merge: return None")
    real = {tuple(w.encode("utf-8")): c for w, c in Counter(pretokenize(TEXT)).items()}
    first = BPETokenizer.train(TEXT, vocab_size=258).merges[0]
    got = _as_answer(fn(copy.deepcopy(real)))
    require(got is not None and got[0] == first, "on real text, the first merge is the trainer's first merge",
            f"expected {first}, got {None if got is None else got[0]}")
    return "merge_step is one step of BPE training"


def _ids(got):
    """A student's ids as plain ints (any sequence of integers will do); anything else as it is, to be shown."""
    try:
        return [int(t) for t in got]
    except (TypeError, ValueError):
        return got


@exercise("write encode_word(word, merges): the ids of one pre-token's bytes after BPE (lowest-rank merge first)")
def check_encode_word(fn) -> str:
    """Hand-made cases, one per rule (a wrong answer fails first on the rule it breaks; an exception in the
    student's code is reported as breaking the case's rule), then every pre-token of a text against minienv's
    encoder."""
    cases = [  # (word, merges, expected ids, the rule the case isolates)
        (b"a", [(97, 98)], [97], "with no merge that applies, the ids are the bytes"),
        (b"xyz", [(97, 98)], [120, 121, 122], "with no merge that applies, the ids are the bytes"),
        (b"ab", [(97, 98)], [256], "merge i of the list creates id 256 + i"),
        (b"abc", [(98, 99), (97, 98)], [97, 256], "apply the lowest-rank merge present first, not the leftmost pair"),
        (b"abc", [(97, 98), (256, 99)], [257], "keep merging until no merge applies (a merge can enable a later one)"),
        (b"aaa", [(97, 97)], [256, 97], "merge left to right, without overlaps: b'aaa' with (a, a) is [256, 97]"),
        (b"abab", [(97, 98)], [256, 256], "a merge replaces every occurrence of its pair"),
    ]
    for word, merges, want, rule in cases:
        fn.rule = rule
        got = fn(word, list(merges))
        require(_ids(got) == want, rule,
                f"word {word!r}, merges {merges}: expected {want}, got {got}")
    fn.rule = "the ids equal the tokenizer's on every pre-token"
    tok = BPETokenizer.train(TEXT, vocab_size=320)
    pieces = sorted(set(pretokenize(TEXT)))
    for piece in pieces:
        want = tok.encode(piece)
        got = fn(piece.encode("utf-8"), list(tok.merges))
        require(_ids(got) == want, fn.rule,
                f"pre-token {piece!r}: expected {want}, got {got}")
    return f"encode_word gives minienv's ids on all {len(pieces)} pre-tokens"
