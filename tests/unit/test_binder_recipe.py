"""The Binder recipe, as repo2docker reads it: ``jupyter-repo2docker --no-build`` on a clean clone prints the image's
Dockerfile without building it (no Docker needed). What it must pick up: ``environment.yml`` (the conda env, every
Python package from its pip pins), ``postBuild`` (installs minienv) and ``start`` (one OpenBLAS thread) — and no
browser: a Binder image has no Chromium, which is what the student's-machine tier (``tools/student_machine.py``)
reproduces. That tier installs from the same pins the recipe uses, checked below."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _student_machine():
    spec = importlib.util.spec_from_file_location("student_machine", REPO / "tools" / "student_machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dockerfile(tmp_path_factory) -> str:
    repo2docker = shutil.which("repo2docker", path=str(Path(sys.executable).parent))
    if repo2docker is None:
        pytest.skip("binder tier: needs jupyter-repo2docker (the `binder` extra; MINIENV_TIERS=all installs it)")
    clone = tmp_path_factory.mktemp("binder") / "minienv"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    proc = subprocess.run([repo2docker, "--no-build", "--debug", "."], cwd=clone, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    assert "FROM " in text, text[-2000:]
    return text


@pytest.mark.binder
def test_repo2docker_builds_from_environment_yml(dockerfile):
    assert re.search(r"COPY .*src/environment\.yml \$\{REPO_DIR\}/environment\.yml", dockerfile)
    assert re.search(r"env update -p \$\{NB_PYTHON_PREFIX\} --file \"environment\.yml\"", dockerfile)


@pytest.mark.binder
def test_repo2docker_runs_postbuild_and_start(dockerfile):
    assert "RUN ./postBuild" in dockerfile
    assert 'ENV R2D_ENTRYPOINT="${REPO_DIR}/start"' in dockerfile
    assert "pip install --no-deps -e ." in (REPO / "postBuild").read_text()
    assert "OPENBLAS_NUM_THREADS" in (REPO / "start").read_text()


@pytest.mark.binder
def test_the_binder_image_has_no_browser(dockerfile):
    """No apt.txt: the image is the student's machine without Chromium — why figures must degrade at once."""
    assert not (REPO / "apt.txt").exists()
    assert "chromium" not in dockerfile.lower() and "apt.txt" not in dockerfile


def test_the_student_tier_installs_the_recipes_pins():
    """tools/student_machine.py installs minienv[lab] constrained to environment.yml's pip pins, and every lab
    requirement is among them at the same version (so the constraint pins each one)."""
    constraints = dict(line.split("==") for line in _student_machine().recipe_constraints().split())
    recipe = dict(re.findall(r"^\s*-\s*([A-Za-z0-9_.-]+)==([^\s#]+)", (REPO / "environment.yml").read_text(), re.M))
    assert constraints == recipe and constraints
    lab = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    for requirement in lab:
        name, version = requirement.split("==")
        assert constraints.get(name) == version, f"{name}: lab pins {version}, the recipe {constraints.get(name)}"
