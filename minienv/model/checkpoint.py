"""Read and write ``model.safetensors`` with numpy alone.

The safetensors format is deliberately simple, which is why minienv can read it without the ``safetensors``
package: an 8-byte little-endian header length, a JSON header mapping each tensor name to its dtype, shape and
byte range, then the raw little-endian bytes. Reading is one ``np.fromfile`` per tensor. minienv computes in
float32, so F16 and BF16 tensors are widened on load (BF16 is the top half of a float32, so widening is a shift).

``load_weights`` also checks the tensors against a :class:`LlamaConfig`: a missing tensor, a wrong shape or an
unexpected name is an error that names the tensor, not a broadcasting failure deep inside the forward pass; so
is a NaN or infinite weight, which would otherwise turn every logit into NaN and make the model emit token 0.

Reader choice: minienv keeps this hand-written reader rather than ``safetensors.numpy.load_file`` because the core
must stay numpy-only (``safetensors`` is only in the ``reference`` extra). It validates the header as strictly as
the reference loader does (every byte range in bounds, sized for its dtype and shape, the ranges tiling the data
section with no overlap and no gap) and raises :class:`CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import BinaryIO, Mapping

import numpy as np

from minienv.model.config import LlamaConfig

SAFETENSORS_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype tag -> numpy little-endian dtype (BF16 is read as raw uint16 and widened)
_READ_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}
_WRITE_DTYPES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("float64"): "F64"}


class CheckpointError(ValueError):
    """A checkpoint file is malformed or does not match the model config (the message names the tensor)."""


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _is_int(value: object) -> bool:
    """A JSON integer (``true`` is not one, though Python's ``bool`` subclasses ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters so a garbage header cannot flood the error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise CheckpointError(f"header names {key!r} twice")
        seen[key] = value
    return seen


def _read_header(f: BinaryIO, path: Path, file_size: int) -> tuple[dict[str, object], int]:
    """The parsed JSON header and the file offset where tensor data starts."""
    if file_size < 8:
        raise CheckpointError(f"{path}: too short to be a safetensors file ({file_size} bytes)")
    (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
        raise CheckpointError(f"{path}: header length {header_len} is larger than the file")
    raw = f.read(header_len)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: header is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        header = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: header is not valid JSON: {exc}") from exc
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got a JSON {type(header).__name__}")
    return header, 8 + header_len


def _tensor_entry(path: Path, name: str, info: object, body_len: int) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one header entry; return (dtype tag, shape, start, end) with ``0 <= start <= end <= body_len``."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} header entry must be an object (dtype, shape, data_offsets), got {_short(info)}")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in _READ_DTYPES:
        raise CheckpointError(f"{where} has unsupported dtype {_short(dtype)} (supported: {sorted(_READ_DTYPES)})")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where} shape must be a list of non-negative integers, got {_short(shape)}")
    offsets = info.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise CheckpointError(
            f"{where} data_offsets must be a list of two integers [start, end], got {_short(offsets)}"
        )
    start, end = offsets
    if not 0 <= start <= end <= body_len:
        raise CheckpointError(
            f"{where} data_offsets [{start}, {end}] are not a byte range inside the {body_len}-byte data section"
        )
    expected = math.prod(shape) * np.dtype(_READ_DTYPES[dtype]).itemsize
    if end - start != expected:
        raise CheckpointError(
            f"{where} byte range {start}..{end} ({end - start} bytes) does not hold a {dtype} tensor of shape "
            f"{tuple(shape)} ({expected} bytes)"
        )
    return dtype, tuple(shape), start, end


def _check_layout(path: Path, ranges: dict[str, tuple[int, int]], body_len: int) -> None:
    """Byte ranges must tile the data section exactly: no two tensors share a byte and no byte is unowned.

    The reference ``safetensors`` loader demands the same, so a file this reader accepts, it accepts too.
    """
    pos, prev = 0, None
    for name, (start, end) in sorted(ranges.items(), key=lambda kv: kv[1]):
        if start < pos:
            raise CheckpointError(
                f"{path}: tensor {name!r} bytes {start}..{end} overlap tensor {prev!r} (which ends at {pos})"
            )
        if start > pos:
            raise CheckpointError(f"{path}: data bytes {pos}..{start} belong to no tensor")
        pos, prev = end, name
    if pos != body_len:
        raise CheckpointError(f"{path}: data bytes {pos}..{body_len} belong to no tensor")


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a ``.safetensors`` file as float32 numpy arrays, keyed by name.

    The whole header is validated before any tensor is read, so a malformed file raises
    :class:`CheckpointError` (naming the file and the tensor) and nothing is half-loaded. Each tensor is read
    straight from the file into its own array: a multi-GB checkpoint is never held twice.
    """
    path = Path(path)
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        header, data_start = _read_header(f, path, file_size)
        body_len = file_size - data_start
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        ):
            raise CheckpointError(f"{path}: __metadata__ must be an object of strings, got {_short(metadata)}")
        entries = {name: _tensor_entry(path, name, info, body_len) for name, info in header.items()}
        _check_layout(path, {name: (e[2], e[3]) for name, e in entries.items()}, body_len)
        tensors: dict[str, np.ndarray] = {}
        for name, (dtype, shape, start, end) in entries.items():
            np_dtype = np.dtype(_READ_DTYPES[dtype])
            f.seek(data_start + start)
            raw = np.fromfile(f, dtype=np_dtype, count=(end - start) // np_dtype.itemsize).reshape(shape)
            arr = _bf16_to_f32(raw) if dtype == "BF16" else raw.astype(np.float32, copy=False)
            tensors[name] = np.ascontiguousarray(arr)
    return tensors


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> Path:
    """Write numpy arrays (float32/float16/float64) as a safetensors file that ``safetensors``/``transformers`` read."""
    path = Path(path)
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        tag = _WRITE_DTYPES.get(arr.dtype)
        if tag is None:
            raise CheckpointError(f"tensor {name!r}: cannot write dtype {arr.dtype} (use float32 or float16)")
        blob = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # the body starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in chunks:
            f.write(blob)
    return path


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for every tensor a Llama checkpoint with this config must hold."""
    h, i = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weights(config: LlamaConfig, tensors: Mapping[str, np.ndarray], source: str = "checkpoint") -> dict[str, np.ndarray]:
    """Check names, shapes and values against ``config``; return the tensors the model uses (float32).

    Invariant of the result: exactly the tensors of :func:`expected_shapes`, float32, C-contiguous, all finite
    (checked after the float32 conversion, so a float64 value beyond float32's range counts as infinite).
    """
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}{more}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = [n for n in tensors if n not in shapes and n not in ignorable and not n.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {sorted(unexpected)[0]!r} (not part of a Llama model with this config)")
    out: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        arr = np.asarray(tensors[name])
        if arr.shape != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {arr.shape}, expected {shape} from config.json")
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {arr.dtype}, expected a float tensor")
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
        if not np.isfinite(out[name]).all():
            bad = int(np.size(out[name]) - np.count_nonzero(np.isfinite(out[name])))
            raise CheckpointError(
                f"{source}: tensor {name!r} holds {bad} non-finite value(s) (NaN or inf) after conversion to "
                f"float32; a single one makes every logit NaN"
            )
    return out


def load_weights(model_dir: str | Path, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Read ``model_dir/model.safetensors`` and check it against ``config``."""
    path = Path(model_dir) / SAFETENSORS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {SAFETENSORS_FILE} in {model_dir} (sharded checkpoints are not supported)")
    return check_weights(config, read_safetensors(path), source=str(path))


def random_weights(config: LlamaConfig, seed: int = 0, scale: float = 0.02) -> dict[str, np.ndarray]:
    """Random float32 weights with HF names (norm weights near 1), for tests and demos without torch."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def save_checkpoint(model_dir: str | Path, config: LlamaConfig, weights: Mapping[str, np.ndarray]) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (HF layout) into ``model_dir``; returns the directory."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    checked = check_weights(config, weights, source="save_checkpoint")
    config.save_json(model_dir / "config.json")
    write_safetensors(model_dir / SAFETENSORS_FILE, checked)
    return model_dir
