"""The README's first command, `make lab`, really starts JupyterLab serving notebooks/ (HTTP 200 on /lab).

Install tier: `make lab` creates .venv and pip-installs minienv[lab] from the network, so this runs only with
MINIENV_INSTALL_TESTS=1 (set by .ci/run and by `MINIENV_TIERS=all make test`); see tests/conftest.py."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_lab_serves_the_notebooks(tmp_path):
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    lab_args = f"--no-browser --port={port} --IdentityProvider.token={token}"
    proc = subprocess.Popen(["make", "lab", f"LAB_ARGS={lab_args}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, status = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=5) as r:
                    status = r.status
                    break
            except OSError:
                time.sleep(0.5)
        assert status == 200, f"/lab never answered 200; make lab said:\n{_drain(proc)}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=10) as r:
            served = {item["name"] for item in json.load(r)["content"]}
        committed = {p.name for p in (REPO / "notebooks").glob("*.ipynb")}
        assert committed and committed <= served, (committed, served)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _drain(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    return proc.communicate(timeout=20)[0].decode(errors="replace")[-3000:]
