"""minienv.lab.sharing_demos: the scripted scenes notebook 05 steps through, on the real manager."""

from __future__ import annotations

import pytest

from minienv.lab.sharing_demos import (ArrivalScript, ForkScript, SHARING_SCRIPT, common_prefix_len,
                                       sharing_trap_checks)

B = 4
SYSTEM = list(range(100, 117))  # 17 tokens: 4 full blocks + 1
PROMPTS = {f"r{i}": SYSTEM + [200 + i] * (3 + i) for i in range(6)}


def test_common_prefix_len():
    assert common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_len([[5, 6], [5, 6]]) == 2
    assert common_prefix_len([[1], [2]]) == 0
    with pytest.raises(ValueError, match="at least one"):
        common_prefix_len([])


def test_arrival_script_refcounts_follow_the_running_requests():
    script = ArrivalScript(PROMPTS, num_blocks=48, block_size=B, system_blocks=len(SYSTEM) // B)
    for i in range(len(SHARING_SCRIPT)):
        caption = script.step(i)
        assert caption.startswith(f"step {i + 1}: ")
    assert len(script.log) == len(SHARING_SCRIPT)
    running = [rec.num_running for rec in script.log]
    assert running == [1, 2, 3, 3, 3, 3, 1, 2, 1, 0, 1, 1, 0]
    for rec in script.log:
        assert len(rec.system_refcounts) == len(SYSTEM) // B
        assert all(rc == rec.num_running for rc in rec.system_refcounts.values()), rec
    hits = {r: h for rec in script.log for r, h in rec.hits.items()}
    assert hits["r0"] == 0 and all(hits[r] == len(SYSTEM) // B * B for r in PROMPTS if r != "r0")
    assert script.log[10].hits == {"r5": 16}  # r5 arrives after everyone left and still hits: cached-free
    script.reset()
    assert script.log == [] and script.mgr.stats().num_in_use == 0


def test_arrival_script_rejects_an_unknown_action():
    script = ArrivalScript(PROMPTS, 16, B, system_blocks=1, script=[("?r0",)])
    with pytest.raises(ValueError, match="unknown action"):
        script.step(0)


def test_fork_script_copies_once_per_other_holder_and_never_a_full_block():
    fork = ForkScript(list(range(10)), num_blocks=16, block_size=B)
    captions = [fork.step(i) for i in range(len(fork.script))]
    copies = [rec.copies for rec in fork.log]
    assert copies[:5] == [(), (), ((2, 3),), ((2, 4),), ()]
    assert all(c == () for c in copies[5:])
    assert "block 2 copied to 3" in captions[2] and "copy-on-write" not in captions[4]
    assert fork.log[1].refcounts[:3] == [3, 3, 3] and fork.log[-1].refcounts[:2] == [3, 3]
    assert fork.mgr.stats().cow_copies == 2
    with pytest.raises(IndexError):
        fork.step(len(fork.script))


class _RecordingView:
    def __init__(self):
        self.calls = []

    def attach(self, mgr, *, caption=""):
        self.calls.append(("attach", mgr, caption))

    def update(self, caption=None):
        self.calls.append(("update", caption))


def test_driving_redraws_the_view_and_reset_reattaches_a_fresh_manager():
    fork = ForkScript(list(range(10)), num_blocks=16, block_size=B)
    view = _RecordingView()
    step, reset = fork.driving(view)
    first = fork.mgr
    reset()
    assert view.calls[-1][0] == "attach" and view.calls[-1][1] is fork.mgr is not first
    assert step(0) == "step 1: prefill P" and view.calls[-1] == ("update", "step 1: prefill P")


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_sharing_trap_checks_all_hold(block_size):
    checks = sharing_trap_checks(block_size)
    assert len(checks) == 6 and all(checks.values()), checks
