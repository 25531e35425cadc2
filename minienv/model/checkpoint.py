"""Read and write ``model.safetensors`` with numpy alone.

The safetensors format is deliberately simple, which is why minienv can read it without the ``safetensors``
package: an 8-byte little-endian header length, a JSON header mapping each tensor name to its dtype, shape and
byte range, then the raw little-endian bytes. Reading is a ``np.frombuffer`` per tensor. minienv computes in
float32, so F16 and BF16 tensors are widened on load (BF16 is the top half of a float32, so widening is a shift).

``load_weights`` also checks the tensors against a :class:`LlamaConfig`: a missing tensor, a wrong shape or an
unexpected name is an error that names the tensor, not a broadcasting failure deep inside the forward pass.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Mapping

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


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a ``.safetensors`` file as float32 numpy arrays, keyed by name."""
    path = Path(path)
    # Memory-mapped: a real multi-GB checkpoint is paged in tensor by tensor, never held twice.
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    if len(data) < 8:
        raise CheckpointError(f"{path}: too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8].tobytes())
    if header_len > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise CheckpointError(f"{path}: header length {header_len} is larger than the file")
    try:
        header = json.loads(data[8 : 8 + header_len].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON: {exc}") from exc
    body = data[8 + header_len :]
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype")
        if dtype not in _READ_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unsupported dtype {dtype!r} (supported: {sorted(_READ_DTYPES)})"
            )
        shape = tuple(info.get("shape", ()))
        start, end = info.get("data_offsets", (0, -1))
        np_dtype = np.dtype(_READ_DTYPES[dtype])
        expected = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
        if not (0 <= start <= end <= len(body)) or end - start != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} byte range {start}..{end} does not hold a {dtype} tensor of shape {shape}"
            )
        raw = np.frombuffer(body[start:end].tobytes(), dtype=np_dtype).reshape(shape)
        arr = _bf16_to_f32(raw) if dtype == "BF16" else raw.astype(np.float32)
        tensors[name] = np.ascontiguousarray(arr)
    del body, data  # release the mapping
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
    """Check names and shapes against ``config``; return the tensors the model uses (float32)."""
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
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
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
