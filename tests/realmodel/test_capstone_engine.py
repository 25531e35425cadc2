"""Notebook 14's last cell with ``REAL_MODEL = True``: the student's engine — the reference manager, the 07 victim
policy and plan_step — serves SmolLM2-135M-Instruct, and the cell after it proves minienv's engine answers the
same, token for token. The session's model is handed to the cell, so the process keeps one float32 copy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.realmodel
REPO = Path(__file__).resolve().parents[2]


def test_your_engine_serves_the_real_model(smol, monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    try:
        import test_capstone as tc
    finally:
        sys.path.pop(0)
    import minienv.model.pretrained as pretrained
    from minienv.engine import InferenceEngine
    from minienv.exercises import PASSED
    from minienv.exercises import capstone as cap

    monkeypatch.setattr(pretrained, "load_pretrained", lambda name: smol)  # the session's copy, not a second one
    source = (REPO / "notebooks" / "14_capstone.py").read_text()
    serve = tc._cell(source, "REAL_MODEL = False").replace("REAL_MODEL = False", "REAL_MODEL = True")
    proof = tc._cell(source, "assert hits > 0 and preempted > 0")
    fewest, plan = tc._solution_of("07_scheduling", "fewest_computed"), tc._solution_of("07_scheduling", "plan_step")
    assert cap.check_rules(tc.Good) == cap.check_random_ops(tc.Good) == PASSED
    assert cap.check_in_engine(tc.Good, victim_policy=fewest, plan_step=plan) == PASSED
    ns = {"capstone": cap, "InferenceEngine": InferenceEngine, "MyKVCacheManager": tc.Good,
          "fewest_computed": fewest, "plan_step": plan}
    exec(serve, ns)  # noqa: S102 - the repository's own notebook
    assert ns["yours"] and ns["engine"].chat_template is not None
    assert "serving with your pieces" in capsys.readouterr().out
    exec(proof, ns)  # noqa: S102 - hits, a preemption, and minienv's answers token for token
    assert ns["outputs"][1].text == "The ticket is 12 euros."
