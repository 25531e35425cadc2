"""Link every source path a notebook's "where this lives" section cites to that file in the pinned release.

A path written as `` `vllm/v1/core/block_pool.py` `` in such a section becomes
``[`vllm/v1/core/block_pool.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/block_pool.py)``:
a reader lands on the exact file of the release the text describes, not on whatever ``main`` holds today. A path
the text itself says is *not* in the pinned release stays plain. Idempotent: linked paths are left alone.

Usage: ``python tools/link_sources.py notebooks/*.py`` (then rebuild the notebooks); ``--check`` lists the plain
paths instead of rewriting (tests/unit/test_prose_numbers.py runs it over the notebooks).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: path prefix -> (repository URL, pinned release) — the pins the notebooks state
PINS = {
    "vllm/": ("https://github.com/vllm-project/vllm", "v0.11.0"),
    "csrc/": ("https://github.com/vllm-project/vllm", "v0.11.0"),  # vLLM's C++/CUDA kernels (SGLang's: sgl-kernel/)
    "python/sglang/": ("https://github.com/sgl-project/sglang", "v0.5.3"),
    "sgl-router": ("https://github.com/sgl-project/sglang", "v0.5.3"),
    "nanovllm/": ("https://github.com/GeeeekExplorer/nano-vllm", "bb823b3"),
    "lmcache/": ("https://github.com/LMCache/LMCache", "v0.3.8"),
    # the release pyproject.toml pins for the realmodel tier (tests/unit/test_source_links.py checks they agree)
    "src/transformers/": ("https://github.com/huggingface/transformers", "v5.24.0"),
}
#: cited as coming *after* the pinned release (the text says so): no link to a file the release does not have
NOT_IN_RELEASE = {"vllm/v1/spec_decode/draft_model.py"}

_SECTION = re.compile(r"^# ## (Where (this|it) lives|The map: every)")
_NEXT_SECTION = re.compile(r"^# ## ")
_PLAIN = re.compile(r"(?<!\[)`((?:vllm/|csrc/|python/sglang/|sgl-router|nanovllm/|lmcache/|src/transformers/)[A-Za-z0-9_./-]*)`(?!\]\()")


def url(path: str) -> str:
    prefix = next(p for p in PINS if path.startswith(p))
    repo, tag = PINS[prefix]
    kind = "tree" if path.endswith("/") or "." not in path.rsplit("/", 1)[-1] else "blob"
    return f"{repo}/{kind}/{tag}/{path.rstrip('/')}"


def _sections(lines: list[str]) -> list[range]:
    out, start = [], None
    for i, line in enumerate(lines + ["# ## end"]):
        if start is not None and _NEXT_SECTION.match(line) and not _SECTION.match(line):
            out.append(range(start, i))
            start = None
        if _SECTION.match(line):
            start = i
    return out


def link(text: str) -> tuple[str, list[str]]:
    """``(text with the sections' plain paths linked, the paths that stay plain)``."""
    lines = text.split("\n")
    kept = []
    for section in _sections(lines):
        for i in section:
            def sub(m: re.Match) -> str:
                path = m.group(1)
                if path in NOT_IN_RELEASE:
                    kept.append(path)
                    return m.group(0)
                return f"[`{path}`]({url(path)})"
            lines[i] = _PLAIN.sub(sub, lines[i])
    return "\n".join(lines), kept


def plain_paths(text: str) -> list[str]:
    """The sections' paths that are not linked (and should be)."""
    lines = text.split("\n")
    return [m.group(1) for s in _sections(lines) for i in s for m in _PLAIN.finditer(lines[i])
            if m.group(1) not in NOT_IN_RELEASE]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"]
    missing = []
    for p in paths:
        text = p.read_text()
        if check:
            missing += [f"{p}: {x}" for x in plain_paths(text)]
            continue
        new, _ = link(text)
        if new != text:
            p.write_text(new)
            print(f"linked {p}")
    if missing:
        print("\n".join(missing))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
