"""The house rules of ``docs/ARCHITECTURE.md``, read from the source (every ``import`` statement, at any depth):
no file in ``minienv/`` over 700 lines, no import circles, the engine path importing nothing above it, and no
``lab/`` module importing another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minienv"
#: the engine path: what ``InferenceEngine`` runs on; none of it may reach the floors built on top of it
ENGINE_PATH = ("minienv.engine", "minienv.kv", "minienv.model", "minienv.scheduler", "minienv.request",
               "minienv.sampling", "minienv.spec_decode", "minienv.kv_tier", "minienv.tokenizer")
ABOVE_THE_ENGINE = ("minienv.metrics", "minienv.serving", "minienv.lab", "minienv.exercises", "minienv.viz",
                    "minienv.sim", "minienv.cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported minienv module, names taken from it) for every import statement in the file."""
    own = _module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("minienv")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("minienv"):
                continue
            names = [a.name for a in node.names]
            for name in names:  # `from minienv.kv import block_pool` imports a module
                if f"{base}.{name}" in modules:
                    found.append((f"{base}.{name}", []))
            found.append((base, [n for n in names if f"{base}.{n}" not in modules]))
    return [(m, names) for m, names in found if m in modules and m != own]


def test_no_file_in_the_package_is_over_700_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 700}
    assert not long, f"split these (the limit is 700 lines): {long}"


def test_no_import_circles():
    modules = _sources()
    graph = {m: {dep for dep, _ in _imports(p, modules)} for m, p in modules.items()}
    # a package's __init__ re-exporting its own modules is not a circle between floors: leave out parent -> child
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"


def test_the_engine_path_imports_nothing_above_it():
    modules = _sources()
    bad = [(m, dep) for m, p in modules.items() if m.startswith(ENGINE_PATH)
           for dep, _ in _imports(p, modules) if dep.startswith(ABOVE_THE_ENGINE)]
    assert not bad, f"the engine path reaches up (metrics, serving, lab... subscribe from outside): {bad}"


def test_lab_imports_no_private_names():
    modules = _sources()
    bad = [(m, dep, name) for m, p in modules.items() if m.startswith("minienv.lab")
           for dep, names in _imports(p, modules) for name in names if name.startswith("_")]
    assert not bad, f"lab/ uses private names of other modules: {bad}"


def test_the_checks_see_what_they_should():
    """The rules above read real imports: a sample of edges they must find."""
    modules = _sources()
    deps = {m: {d for d, _ in _imports(p, modules)} for m, p in modules.items()}
    assert "minienv.model.linear" in deps["minienv.model.llama"]
    assert "minienv.kv.block_pool" in deps["minienv.kv.kv_cache_manager"]
    assert any(d.startswith("minienv.engine") for d in deps["minienv.metrics"])


def test_the_architecture_doc_stays_short():
    """A contributor reads it in one sitting: the diagram, the rules, the invariants, the seams (<= 250 lines)."""
    doc = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
    assert len(doc.read_text(encoding="utf-8").splitlines()) <= 250, "docs/ARCHITECTURE.md: say it in fewer lines"
