"""Where minienv finds its bundled assets.

The tokenizer and the trained tiny models live in ``assets/`` at the repository root (minienv is installed in
editable mode by both set-up commands, so the package and its assets stay side by side). ``MINIENV_ASSETS``
points elsewhere, e.g. for a packaged install.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def assets_dir() -> Path:
    """The folder holding ``tokenizer.json``, ``target/`` and ``draft/``."""
    override = os.environ.get("MINIENV_ASSETS")
    path = Path(override) if override else REPO_ROOT / "assets"
    if not path.is_dir():
        raise FileNotFoundError(
            f"minienv assets folder not found at {path}; set MINIENV_ASSETS to the folder holding tokenizer.json"
        )
    return path
