"""A ``python -m minienv serve`` child dies with the process that started it, however that process ends.

Issue #36: killing notebook 10's kernel mid-run left its server running for an hour, twice (``atexit`` does not
run on SIGKILL). The first tests run notebook 10's own cells in a real Jupyter kernel, kill or restart that kernel
the way JupyterLab and CI do, and then look for the server; the others pin ``--parent-pid``'s rules."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("grpc")
REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "10_serving.ipynb"


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie (dead; a container's init may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return _gone(pid)


def _cells_through_start_server() -> list[str]:
    """Notebook 10's code cells up to and including the one that starts its first server."""
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    out = []
    for cell in cells:
        out.append("".join(cell["source"]))
        if "server, address = start_server(" in out[-1]:
            return out
    raise AssertionError("notebook 10 no longer starts a server with start_server(...)")


def _run(kc, code: str, timeout: float = 120) -> str:
    """Execute ``code`` in the kernel; return its stdout; fail on an error."""
    msg_id = kc.execute(code)
    text = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text.append(content["text"])
        elif kind == "error":
            raise AssertionError("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(text)


@pytest.fixture
def kernel_with_server():
    jupyter_client = pytest.importorskip("jupyter_client")
    km = jupyter_client.KernelManager(kernel_name="python3")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(REPO))
    km.start_kernel(cwd=str(REPO / "notebooks"), env=env)
    kc = km.client()
    kc.start_channels()
    server_pid = None
    try:
        kc.wait_for_ready(timeout=60)
        for code in _cells_through_start_server():
            _run(kc, code)
        server_pid = int(_run(kc, "print(server.pid)").strip())
        assert not _gone(server_pid), "the notebook's server is running"
        yield km, kc, server_pid
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        if server_pid is not None and not _gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)  # never leave one behind, even when the test fails


def test_killing_notebook_10s_kernel_with_sigkill_stops_its_server(kernel_with_server):
    km, _, server_pid = kernel_with_server
    os.kill(km.provisioner.process.pid, signal.SIGKILL)  # what a CI timeout does: no atexit runs
    assert _wait_gone(server_pid), f"server {server_pid} outlived its SIGKILLed kernel"


def test_restarting_notebook_10s_kernel_stops_its_server(kernel_with_server):
    km, _, server_pid = kernel_with_server
    km.restart_kernel(now=True)  # JupyterLab's Restart when the kernel does not answer: the old one is killed
    assert _wait_gone(server_pid), f"server {server_pid} outlived its restarted kernel"


def test_interrupting_a_cell_then_shutting_down_stops_its_server(kernel_with_server):
    km, kc, server_pid = kernel_with_server
    kc.execute("import time; time.sleep(60)")
    time.sleep(0.5)
    km.interrupt_kernel()  # Kernel → Interrupt: the kernel lives on, and so does its server ...
    time.sleep(0.5)
    assert not _gone(server_pid)
    km.shutdown_kernel(now=False)  # ... until the kernel ends
    assert _wait_gone(server_pid), f"server {server_pid} outlived its kernel after an interrupt"


def _spawn_parent_with_server() -> tuple[subprocess.Popen, int]:
    """A plain Python parent that launches one server with minienv.serving.launch and sleeps."""
    code = textwrap.dedent("""
        import sys, time
        from minienv.serving.launch import launch
        cluster = launch(1, ["--kv-budget-tokens", "256", "--grace", "0.5"])
        print(cluster.servers[0].pid, flush=True)
        time.sleep(120)
    """)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(REPO))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    line = parent.stdout.readline()
    assert line.strip().isdigit(), f"the parent did not start a server: {line!r}"
    return parent, int(line)


def test_a_launched_instance_dies_with_its_sigkilled_parent():
    parent, server_pid = _spawn_parent_with_server()
    try:
        assert not _gone(server_pid)
        parent.kill()
        parent.wait()
        assert _wait_gone(server_pid), f"server {server_pid} outlived its SIGKILLed parent"
    finally:
        if not _gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_parent_pid_must_be_the_parent():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "minienv", "serve", "--port", "0", "--parent-pid", "1"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1 and "--parent-pid 1 is not this process's parent" in done.stderr
