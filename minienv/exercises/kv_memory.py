"""Notebook 03's exercises: the waste of one request's last block, and one request's slots by category."""

from __future__ import annotations

from minienv.exercises._check import exercise, fail, require
from minienv.lab.memory_accounting import paged_internal_fragmentation


@exercise("write internal_frag(num_tokens, block_size): the never-used slots of the request's last block")
def check_internal_frag(fn) -> str:
    for b in (1, 4, 16):
        got = fn(2 * b, b)
        require(got == 0, "a last block that is exactly full wastes nothing",
                f"{2 * b} tokens in blocks of {b}: expected 0, got {got}")
    got = fn(9, 4)
    require(got == 3, "count the empty slots of the last block, not the used ones",
            f"9 tokens in blocks of 4 fill 2 blocks and 1 slot of a third: expected 3 empty, got {got}")
    cases = [(n, b) for n in range(1, 300) for b in (1, 2, 3, 4, 16, 64, 256)]
    wrong = [(n, b, fn(n, b), paged_internal_fragmentation(n, b)) for n, b in cases]
    wrong = [w for w in wrong if w[2] != w[3]]
    if wrong:
        n, b, got, want = wrong[0]
        fail("the waste is blocks × block_size − tokens, between 0 and block_size − 1",
             f"{len(wrong)} of {len(cases)} cases wrong, e.g. {n} tokens, block {b}: expected {want}, got {got}")
    return f"internal_frag is right in all {len(cases)} cases"


@exercise("write slot_categories(now, final, allocated) -> (token_states, reservation, internal_frag)")
def check_slot_categories(fn) -> str:
    """Cases in the order that isolates each rule: oracle (nothing over), Max (over), paged (under)."""

    def ask(now: int, final: int, allocated: int) -> tuple:
        try:
            got = fn(now, final, allocated)
        except Exception as err:  # noqa: BLE001
            fail("the function must answer every case", f"({now}, {final}, {allocated}): "
                 f"your function raised {type(err).__name__}: {err}")
        require(isinstance(got, tuple) and len(got) == 3, "return a tuple (token_states, reservation, internal_frag)",
                f"({now}, {final}, {allocated}): got {got!r}")
        return got

    where = "A request with 3 tokens now, 5 at the end"
    got = ask(3, 5, 5)
    require(got[0] == 3, "token states are the tokens computed so far", f"{where}, 5 allocated: got {got}")
    require(got == (3, 2, 0), "reservation is room this request will fill later", f"{where}, 5 allocated "
            f"(Oracle): expected (3, 2, 0), got {got}")
    got = ask(3, 5, 8)
    require(got == (3, 2, 3), "internal fragmentation is allocated room beyond the final length",
            f"{where}, 8 allocated (Max): expected (3, 2, 3), got {got}")
    got = ask(3, 5, 4)
    require(got[1] == 1, "reservation counts only allocated slots: min(allocated, final) − now",
            f"{where}, one block of 4 allocated (paged): expected reservation 1, got {got}")
    require(got[2] == 0, "internal fragmentation is never negative: allocated − min(allocated, final)",
            f"{where}, one block of 4 allocated (paged): expected internal fragmentation 0, got {got}")
    tried = 0
    for final in range(1, 20):
        for now in range(1, final + 1):
            for allocated in range(now, 40):
                got = ask(now, final, allocated)
                want = (now, min(allocated, final) - now, allocated - min(allocated, final))
                require(sum(got) == allocated, "the three categories add up to the allocated slots",
                        f"({now}, {final}, {allocated}): got {got}")
                require(got == want, "token states, reservation and internal fragmentation as in the table",
                        f"({now}, {final}, {allocated}): expected {want}, got {got}")
                tried += 1
    return f"every allocated slot in exactly one category, in all {tried} cases"
