"""Notebook 15's two exercises: the solution passes, each typical wrong answer fails naming the rule it breaks, the
committed stub is "not implemented", and the notebook runs each check on its stub."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from minienv.exercises._check import NOT_IMPLEMENTED, PASSED, ExerciseFailed
from minienv.exercises.real_model import check_kv_bytes_per_token, check_prefix_hit_tokens

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "15_real_model.py"


def _solution(name: str):
    spec = importlib.util.spec_from_file_location("solutions_15", REPO / "solutions" / "15_real_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _kv(c, k=2, heads="kv", layers=True, nbytes=4):
    h = c.num_key_value_heads if heads == "kv" else c.num_attention_heads
    return k * (c.num_hidden_layers if layers else 1) * h * c.head_dim * nbytes


def _hits(shared, lens, b, first=False, whole=True, cap=True):
    total = 0
    for i, n in enumerate(lens):
        if i == 0 and not first:
            continue
        blocks = shared // b if whole else shared / b
        if cap:
            blocks = min(blocks, (n - 1) // b)
        total += blocks * b
    return total


WRONG = [
    (check_kv_bytes_per_token, "kv_bytes_per_token", [
        (lambda c: _kv(c, k=1), "store K and V"),
        (lambda c: _kv(c, heads="q"), "only the KV heads are cached"),
        (lambda c: _kv(c, layers=False), "every layer keeps its own K and V"),
        (lambda c: _kv(c, nbytes=1), "float32 is 4 bytes"),
    ]),
    (check_prefix_hit_tokens, "prefix_hit_tokens", [
        (lambda s, lens, b: _hits(s, lens, b, first=True), "the first request finds nothing cached"),
        (lambda s, lens, b: _hits(s, lens, b, whole=False, cap=False), "only whole blocks are hits"),
        (lambda s, lens, b: _hits(s, lens, b, cap=False), "the prompt's last token is never a hit"),
    ]),
]


@pytest.mark.parametrize("check, name", [(c, n) for c, n, _ in WRONG])
def test_solution_passes(check, name, capsys):
    assert check(_solution(name)) == PASSED
    assert capsys.readouterr().out.startswith("✓ ")


@pytest.mark.parametrize("check, wrong, words", [(c, w, words) for c, _, ws in WRONG for w, words in ws])
def test_wrong_answer_fails_naming_the_rule(check, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        check(wrong)
    assert words in str(info.value).splitlines()[0]


@pytest.mark.parametrize("check, name", [(c, n) for c, n, _ in WRONG])
def test_committed_stub_is_not_implemented_and_the_notebook_checks_it(check, name, capsys):
    source = NOTEBOOK.read_text()
    defs = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == name]
    assert len(defs) == 1
    namespace: dict = {}
    exec(compile(ast.Module(body=defs, type_ignores=[]), "15_real_model.py", "exec"), namespace)
    assert check(namespace[name]) == NOT_IMPLEMENTED
    assert f"{check.__name__}({name})" in source
    assert source.count("<details>") >= 4 and "_solution(" not in source
