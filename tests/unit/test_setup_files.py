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
        pins[name.strip().lower()] = version.split(";")[0].strip()
    return pins


def _environment_pins() -> tuple[dict[str, str], dict[str, str]]:
    """(conda-forge pins ``- name=version`` or bare ``- name``, pip-section pins ``- name==version``)."""
    conda, pip = {}, {}
    for line in (REPO / "environment.yml").read_text().splitlines():
        if match := re.match(r"^\s*-\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s#]+)", line):
            pip[match[1].lower()] = match[2]
        elif match := re.match(r"^\s*-\s*([A-Za-z0-9_.-]+)\s*(?:=\s*([^\s#]+))?\s*$", line):
            conda[match[1].lower()] = match[2] or ""
    return conda, pip


def test_every_pyproject_requirement_is_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["numpy==2.4.6"], "numpy is the only runtime dependency"
    loose = [r for extra in project["optional-dependencies"].values() for r in extra if "==" not in r]
    assert not loose, f"unpinned extras: {loose}"


def test_environment_yml_matches_pyproject():
    """conda-forge brings only Python and pip; the pip section carries exactly pyproject's runtime, lab and test
    pins (what CI installs), so Binder runs the versions the tests ran."""
    conda, pip = _environment_pins()
    assert set(conda) == {"python", "pip", "conda-forge", "nodefaults"}, conda
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["lab"] + [
        r for r in project["optional-dependencies"]["test"] if ";" not in r]  # tomli: only for Python < 3.11
    want = {name.strip().lower(): version.strip() for name, _, version in (r.partition("==") for r in wanted)}
    assert pip == want, f"environment.yml pip section vs pyproject.toml: {set(pip.items()) ^ set(want.items())}"
    assert conda["python"] == "3.11"


def test_environment_pin_parser_sees_a_mismatch(tmp_path, monkeypatch):
    """The comparison above can fail: a changed pin in the pip section is a difference."""
    text = (REPO / "environment.yml").read_text().replace("numpy==2.4.6", "numpy==2.4.5")
    assert "numpy==2.4.5" in text
    fake = tmp_path / "environment.yml"
    fake.write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "pyproject.toml").write_text((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    with pytest.raises(AssertionError):
        test_environment_yml_matches_pyproject()


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


def test_every_make_target_parses():
    """`make -n` reads the whole Makefile: a broken rule (a recipe line without its tab, a pasted target) fails
    every command of the README, not just its own."""
    import subprocess

    for target in ("lab", "test", "student", "venv", "notebooks", "check-notebooks", "binder-links", "clean"):
        proc = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, f"make -n {target}: {proc.stderr}"
