"""The student's-machine tier: every notebook re-executed the way a student's machine runs it.

A Binder image (repo2docker's base image) and many laptops have no Chrome or Chromium, no ``redis-server``, no
``prometheus`` and no torch. CI's machine has all of them, so a test run there cannot see what a student sees —
notebooks once hung forever at their first figure on a machine without a browser while every test stayed green.
This tier recreates the student's machine and runs every notebook on it:

1. **Only the lab extra, from the recipe's pins.** A fresh venv (``.cache/student-venv``) gets ``pip install -e
   .[lab]`` — the ``make lab`` path — constrained to the pins of ``environment.yml``'s pip section, the file
   repo2docker builds Binder's image from. No test extra, no torch.
2. **No browser, no Redis, no Prometheus.** The run happens in a private mount namespace (``unshare --mount``,
   root or user namespaces needed) where ``/dev/null`` is bind-mounted over every ``chromium``/``chrome``,
   ``redis-server`` and ``prometheus`` binary on ``PATH`` or in the usual install paths, and ``BROWSER_PATH`` is
   unset. Before any notebook runs, the tier checks from inside that kaleido's own lookup finds no browser and
   that neither server is reachable by name; if anything is still visible it stops — it never passes by
   running on the wrong machine.
3. **Every notebook, Run All, timed.** Each notebook is executed top to bottom by ``nbclient`` (what JupyterLab's
   Run All does: one kernel, every cell in order) with a wall-clock limit, so a hang is a failure with a name, not
   a stuck CI job. A cell that errs fails the tier; so does a traceback printed to a cell's stderr.

Usage: ``python tools/student_machine.py [--reuse-venv] [--timeout S] [NOTEBOOK ...]``. It prints one line per
notebook with its Run All time, and last one JSON line. Exit status 0 only when every notebook finished cleanly.
``python tools/student_machine.py --run make test`` runs any other command on the same machine (browser and servers
hidden; your own environment otherwise): a fresh clone's ``make test`` as a student runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".cache" / "student-venv"
HIDDEN_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome",
                "redis-server", "prometheus")
HIDDEN_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome",
                "/usr/bin/google-chrome-stable", "/usr/bin/chrome", "/usr/lib/chromium/chromium",
                "/opt/google/chrome/chrome", "/snap/bin/chromium", "/usr/bin/redis-server", "/usr/bin/prometheus")
RUN_ALL_GOAL_S = 20.0  # the series' goal per notebook on 2 cores; reported, not enforced (CI machines vary)
INSIDE = "MINIENV_STUDENT_MACHINE_INSIDE"

# Runs in the student venv's Python, inside the namespace: execute one notebook as Run All does.
RUNNER = r"""
import json, sys, time
import nbformat
from nbclient import NotebookClient
path, timeout = sys.argv[1], float(sys.argv[2])
nb = nbformat.read(path, as_version=4)
client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                        resources={"metadata": {"path": str(__import__("pathlib").Path(path).parent)}})
t0 = time.perf_counter()
problems, notes = [], 0
try:
    client.execute()
except Exception as exc:  # a cell that timed out, a kernel that died: name it
    running = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("execution_count") is None]
    first = running[0] if running else "?"
    source = nb.cells[first].source.splitlines()[:2] if running else []
    problems.append(f"{type(exc).__name__} at cell {first} {source}: {str(exc).strip().splitlines()[0][:200]}")
elapsed = time.perf_counter() - t0
for i, cell in enumerate(nb.cells):
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            problems.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}"[:300])
        elif out.get("output_type") == "stream":
            text = out.get("text", "")
            notes += text.count("static images are off in this kernel")
            if out.get("name") == "stderr" and "Traceback (most recent call last)" in text:
                problems.append(f"cell {i}: a traceback on stderr: {text.strip().splitlines()[-1][:200]}")
print(json.dumps({"seconds": elapsed, "problems": problems, "image_notes": notes}))
"""


def recipe_constraints() -> str:
    """The pip pins of environment.yml (what repo2docker installs on Binder), as a pip constraints file."""
    pins = []
    for line in (REPO / "environment.yml").read_text().splitlines():
        if match := re.match(r"^\s*-\s*([A-Za-z0-9_.-]+==[^\s#]+)", line):
            pins.append(match[1])
    if not pins:
        raise SystemExit("environment.yml has no pip pins: cannot install from the recipe's pins")
    return "\n".join(pins) + "\n"


def make_venv(reuse: bool) -> Path:
    python = VENV / "bin" / "python"
    if reuse and python.exists():
        return python
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(recipe_constraints())
    t0 = time.perf_counter()
    for args in (["--upgrade", "pip"], ["-c", constraints.name, "-e", f"{REPO}[lab]"]):
        pip = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True)
        if pip.returncode != 0:
            raise SystemExit(f"pip install {' '.join(args)} failed:\n{pip.stdout}{pip.stderr}")
    os.unlink(constraints.name)
    print(f"student venv: minienv[lab] from environment.yml's pins in {time.perf_counter() - t0:.0f} s")
    return python


def _to_hide() -> list[str]:
    found = {p for p in HIDDEN_PATHS if os.path.exists(p)}
    for name in HIDDEN_NAMES:
        if where := shutil.which(name):
            found.add(where)
    return sorted(found)


def enter_namespace(argv: list[str]) -> None:
    """Re-run this script inside a private mount namespace with the browsers and servers hidden."""
    hide = _to_hide()
    binds = "".join(f"mount --bind /dev/null {shlex_quote(p)} && " for p in hide)
    script = f"mount --make-rprivate / && {binds}exec \"$@\""
    # the test-tier switches are CI's, not a student's; where downloaded models are cached (MINIENV_MODELS_DIR) is
    # a student's choice too, and lets CI reuse the copy it fetched once
    env = {k: v for k, v in os.environ.items()
           if k != "BROWSER_PATH" and (not k.startswith("MINIENV_") or k == "MINIENV_MODELS_DIR")}
    env[INSIDE] = "1"
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # as `make lab` and Binder's `start` set it
    cmd = ["unshare", "--mount", "sh", "-c", script, "sh", sys.executable, *argv]
    if os.geteuid() != 0:
        cmd[1:1] = ["--map-root-user"]
    print(f"hiding {', '.join(hide) or 'nothing (none installed)'} in a private mount namespace")
    try:
        raise SystemExit(subprocess.run(cmd, env=env).returncode)
    except FileNotFoundError:
        raise SystemExit("unshare (util-linux) is needed to hide the browser and servers") from None


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def check_hidden(python: Path) -> None:
    """Inside the namespace: nothing a notebook could find. Stops the tier otherwise."""
    visible = [p for p in _to_hide() if os.access(p, os.X_OK) and os.path.isfile(p)]
    probe = subprocess.run(
        [str(python), "-c", "from choreographer.browsers.chromium import Chromium as C; "
                            "print(C.find_browser(skip_local=False) or '')"],
        capture_output=True, text=True, check=True)
    found = probe.stdout.strip()
    if found and os.path.isfile(found):
        visible.append(f"kaleido's lookup: {found}")
    if visible:
        raise SystemExit(f"not a student's machine: still visible: {visible}")
    torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    if torch.returncode == 0:
        raise SystemExit("not a student's machine: torch is importable in the student venv")
    print("checked: no browser (kaleido's own lookup finds none), no redis-server, no prometheus, no torch")


def run_notebooks(python: Path, notebooks: list[Path], timeout: float) -> int:
    rows, failed = [], 0
    for path in notebooks:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([str(python), "-c", RUNNER, str(path), str(timeout)], capture_output=True,
                                  text=True, timeout=timeout * 3, cwd=path.parent)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                err = [l for l in proc.stderr.splitlines() if "Error" in l or "Timeout" in l] or proc.stderr.splitlines()[-3:]
                result = {"seconds": wall, "problems": [f"the runner failed: {err[-1][:400] if err else proc.returncode}"]}
            else:
                result = json.loads(proc.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            result = {"seconds": time.perf_counter() - t0, "problems": [f"did not finish in {timeout * 3:.0f} s"]}
        ok = not result["problems"]
        failed += not ok
        over = "" if result["seconds"] <= RUN_ALL_GOAL_S else f"  (over the {RUN_ALL_GOAL_S:.0f} s goal)"
        print(f"{'ok  ' if ok else 'FAIL'} {path.name:32s} Run All {result['seconds']:6.1f} s{over}", flush=True)
        for problem in result["problems"]:
            print(f"       {problem}")
        if result.get("image_notes", 0) > 1:
            failed += 1
            print(f"       the no-static-images note appeared {result['image_notes']} times (at most once)")
        rows.append({"notebook": path.stem, "ok": ok, "run_all_s": round(result["seconds"], 2)})
    print(f"{len(rows) - failed}/{len(rows)} notebooks finished cleanly with no browser, no redis-server, "
          f"no prometheus, only the lab extra")
    print(json.dumps({"student_machine": rows, "finished": len(rows) - failed, "total": len(rows)}))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/NN_*.ipynb")
    parser.add_argument("--reuse-venv", action="store_true", help="keep .cache/student-venv if it exists")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per cell (the notebook: 3x)")
    parser.add_argument("--run", nargs=argparse.REMAINDER, help="run this command with the browser and servers "
                                                                 "hidden instead of the notebooks")
    args = parser.parse_args(argv)
    if args.run:
        if os.environ.get(INSIDE) != "1":
            enter_namespace([str(Path(__file__).resolve()), "--run", *args.run])
        visible = [p for p in _to_hide() if os.access(p, os.X_OK) and os.path.isfile(p)]
        if visible:
            raise SystemExit(f"not a student's machine: still visible: {visible}")
        return subprocess.run(args.run).returncode
    notebooks = [p.resolve() for p in args.notebooks] or sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if os.environ.get(INSIDE) != "1":
        make_venv(args.reuse_venv)
        enter_namespace([str(Path(__file__).resolve()), "--reuse-venv", "--timeout", str(args.timeout),
                         *map(str, notebooks)])
    python = VENV / "bin" / "python"
    check_hidden(python)
    return run_notebooks(python, notebooks, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
