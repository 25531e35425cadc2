"""Notebook 16's exercise check: the solution passes, the stub is 'not implemented', each wrong answer names its rule."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from minienv.exercises import NOT_IMPLEMENTED, PASSED, ExerciseFailed
from minienv.exercises.at_scale import RULES, check_decode_prediction

REPO = Path(__file__).resolve().parents[2]


def _solution():
    spec = importlib.util.spec_from_file_location("sol16", REPO / "solutions" / "16_at_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.predict_decode_ms


def _read(model):
    return model.num_layers * model.layer_params + model.lm_head_params + model.hidden_size


def test_solution_passes(capsys):
    assert check_decode_prediction(_solution()) == PASSED
    assert capsys.readouterr().out.startswith("✓")


def test_stub_is_not_implemented(capsys):
    source = (REPO / "notebooks" / "16_at_scale.py").read_text()
    (stub,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "predict_decode_ms"]
    ns: dict = {}
    exec(compile(ast.Module([stub], []), "stub", "exec"), ns)
    assert check_decode_prediction(ns["predict_decode_ms"]) == NOT_IMPLEMENTED
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, rule", [
    (lambda m, g, mbu, o: (_read(m) * m.dtype_bytes / (g.bandwidth_gbs * 1e9 * mbu) + o), "ms"),
    (lambda m, g, mbu, o: (_read(m) / (g.bandwidth_gbs * 1e9 * mbu) + o) * 1e3, "bytes"),
    (lambda m, g, mbu, o: (m.num_params * m.dtype_bytes / (g.bandwidth_gbs * 1e9 * mbu) + o) * 1e3, "embedding"),
    (lambda m, g, mbu, o: (_read(m) * m.dtype_bytes / (g.bandwidth_gbs * 1e9) + o) * 1e3, "mbu"),
    (lambda m, g, mbu, o: _read(m) * m.dtype_bytes / (g.bandwidth_gbs * 1e9 * mbu) * 1e3, "overhead"),
    (lambda m, g, mbu, o: "6 ms", "number"),
])
def test_wrong_answers_name_their_rule(wrong, rule):
    with pytest.raises(ExerciseFailed) as err:
        check_decode_prediction(wrong)
    assert str(err.value).splitlines()[0] == f"✗ {RULES[rule]}"
