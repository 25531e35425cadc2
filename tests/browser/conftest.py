"""Browser tier: one JupyterLab server + one headless Chromium for the whole module (see tools/lab_check.py).

Needs the Python package playwright (`pip install -e '.[browser]'`, never `playwright install`) and Debian's
chromium at /usr/bin/chromium (`apt-get install -y chromium`). Without them the tests skip, unless
MINIENV_REQUIRE_TIERS=1 (CI), which turns a missing dependency into a failure that says what to install.

MINIENV_BROWSER_NOTEBOOKS_DIR=/some/folder checks the notebooks of another folder instead of notebooks/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_support import (  # noqa: E402
    RESULTS, SELFTEST_DIR, MissingDependency, lab_check, notebooks_dir, require_browser_tier,
    write_selftest_notebooks)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(server, browser): JupyterLab serving a temp copy of the notebooks folder (+ the self-test notebooks in a
    subfolder), and one Chromium. Shut down after the module."""
    try:
        require_browser_tier()  # skips the module's tests when a dependency is missing...
    except pytest.fail.Exception as e:  # ...unless MINIENV_REQUIRE_TIERS=1: then each test *fails* (not errors)
        yield MissingDependency(str(e.msg))
        return
    selftest = tmp_path_factory.mktemp("lab_check_selftest")
    write_selftest_notebooks(selftest)
    src = notebooks_dir()
    folders = {"": src} if src.is_dir() else {}
    folders[SELFTEST_DIR] = selftest
    log = tmp_path_factory.mktemp("lab_log") / "jupyter.log"
    with lab_check.LabServer(folders, log_path=log) as server, lab_check.Browser() as browser:
        yield server, browser


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("browser tier: seconds per notebook (screenshots in tests/browser/screenshots/)")
    for res in RESULTS:
        steps = ", ".join(f"{k} {v:.1f}" for k, v in res.timings.items())
        status = "ok" if res.ok else "FAIL"
        if res.name.startswith(SELFTEST_DIR):
            status = "self-test, failures expected"
        terminalreporter.line(f"{res.seconds:6.1f}s  {res.name}: {status}  ({steps})")
