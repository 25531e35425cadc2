"""The set-up files agree with each other: environment.yml pins == pyproject pins; Binder links are right."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for requirement in project["dependencies"] + [r for extra in project["optional-dependencies"].values()
                                                  for r in extra]:
        name, _, version = requirement.partition("==")
        pins[name.strip().lower().replace("_", "-")] = version.split(";")[0].strip()
    return pins


def _environment_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "environment.yml").read_text().splitlines():
        match = re.match(r"^\s*-\s*([A-Za-z0-9_.-]+)\s*=\s*([^\s#]+)", line)
        if match:
            pins[match[1].lower().replace("_", "-")] = match[2]  # conda-forge spells prometheus_client
    return pins


def test_every_pyproject_requirement_is_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["numpy==2.4.6"], "numpy is the only runtime dependency"
    loose = [r for extra in project["optional-dependencies"].values() for r in extra if "==" not in r]
    assert not loose, f"unpinned extras: {loose}"


def test_environment_yml_matches_pyproject():
    env, py = _environment_pins(), _pyproject_pins()
    env.pop("python")
    lab_and_test = {"numpy", "jupyterlab", "ipywidgets", "plotly", "anywidget", "pytest", "nbval", "jupytext",
                    "hypothesis", "prometheus-client"}
    assert set(env) == lab_and_test
    mismatched = {name: (env[name], py.get(name)) for name in env if env[name] != py.get(name)}
    assert not mismatched, f"environment.yml vs pyproject.toml (env, pyproject): {mismatched}"


def test_postbuild_installs_minienv_and_stops_on_error():
    text = (REPO / "postBuild").read_text()
    assert "set -e" in text and "pip install" in text and "-e ." in text


@pytest.mark.parametrize("url", ["https://github.com/ada/minienv.git", "https://github.com/ada/minienv",
                                 "git@github.com:ada/minienv.git", "ssh://git@github.com/ada/minienv.git"])
def test_binder_remote_parsing(url):
    assert _load_tool("binder_links").parse_github_remote(url) == ("ada", "minienv")


def test_binder_rejects_non_github_remote():
    with pytest.raises(ValueError, match="not a GitHub repository"):
        _load_tool("binder_links").parse_github_remote("https://gitlab.com/ada/minienv.git")


def test_binder_links_for_a_clone(tmp_path, capsys):
    (tmp_path / "notebooks").mkdir()
    for name in ["00_tour.ipynb", "01_tokenizer.ipynb"]:
        (tmp_path / "notebooks" / name).write_text("{}")
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    run("init", "-q", "-b", "main")
    run("remote", "add", "origin", "git@github.com:ada/minienv.git")
    assert _load_tool("binder_links").main([], repo_dir=tmp_path) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "https://mybinder.org/v2/gh/ada/minienv/main?urlpath=lab/tree/notebooks/00_tour.ipynb",
        "https://mybinder.org/v2/gh/ada/minienv/main?urlpath=lab/tree/notebooks/01_tokenizer.ipynb",
    ]


def test_binder_links_without_remote_is_a_clear_error(tmp_path, capsys):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    assert _load_tool("binder_links").main([], repo_dir=tmp_path) == 1
    assert "remote get-url origin failed" in capsys.readouterr().err
