"""Print one Binder link per notebook for *this* repository's own GitHub remote.

    python tools/binder_links.py                  # origin, current branch
    python tools/binder_links.py --remote upstream --branch main

Each link opens JupyterLab at that notebook: https://mybinder.org/v2/gh/OWNER/REPO/BRANCH?urlpath=lab/tree/...
The README carries no hard-coded links because a fork's links must point at the fork.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

REPO = Path(__file__).resolve().parent.parent
BINDER = "https://mybinder.org/v2/gh"
_GITHUB = re.compile(r"^(?:https?://(?:[^@/]+@)?github\.com/|git@github\.com:|ssh://git@github\.com/)"
                     r"(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+?)(?:\.git)?/?$")


def parse_github_remote(url: str) -> tuple[str, str]:
    """(owner, repo) of a GitHub remote URL in https or ssh form; ValueError for anything else."""
    match = _GITHUB.match(url.strip())
    if not match:
        raise ValueError(f"remote URL {url!r} is not a GitHub repository; Binder's gh provider needs one")
    return match["owner"], match["repo"]


def binder_links(owner: str, repo: str, branch: str, notebooks: list[str]) -> list[str]:
    return [f"{BINDER}/{owner}/{repo}/{quote(branch, safe='')}?urlpath=lab/tree/notebooks/{quote(name)}"
            for name in notebooks]


def _git(*args: str, cwd: Path) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ValueError(f"git {' '.join(args)} failed: {result.stderr.strip() or 'no output'}")
    return result.stdout.strip()


def main(argv: list[str] | None = None, repo_dir: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--remote", default="origin")
    parser.add_argument("--branch", help="default: the current branch")
    args = parser.parse_args(argv)
    try:
        owner, repo = parse_github_remote(_git("remote", "get-url", args.remote, cwd=repo_dir))
        branch = args.branch or _git("symbolic-ref", "--short", "HEAD", cwd=repo_dir)
    except ValueError as exc:
        print(f"binder-links: {exc}", file=sys.stderr)
        return 1
    notebooks = sorted(p.name for p in (repo_dir / "notebooks").glob("*.ipynb"))
    print(f"{BINDER}/{owner}/{repo}/{quote(branch, safe='')}?urlpath=lab  (the whole series)")
    for link in binder_links(owner, repo, branch, notebooks):
        print(link)
    return 0


if __name__ == "__main__":
    sys.exit(main())
