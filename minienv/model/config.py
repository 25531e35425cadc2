"""The model's shape, read from a Hugging Face Llama ``config.json``.

minienv loads the same directory layout ``transformers`` writes (``config.json`` + ``model.safetensors``), so the
bundled model is loadable by ``transformers`` and a real Llama-family checkpoint loads into minienv. Anything the
numpy model does not implement (rope scaling, attention biases, another activation) is rejected here, by field
name, instead of silently producing wrong logits later.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_MODEL_TYPES = ("llama",)


class ConfigError(ValueError):
    """A ``config.json`` asks for something minienv's Llama does not implement, or is inconsistent."""


_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings")


def _is_int(value: object) -> bool:
    """A JSON integer: Python's ``bool`` subclasses ``int``, but ``true`` is not a layer count."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    """A JSON number that is neither a boolean nor NaN/inf (Python's ``json`` accepts ``NaN`` and ``Infinity``)."""
    return (isinstance(value, float) or _is_int(value)) and math.isfinite(value)


def _optional_bool(raw: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field; the string ``"false"`` is truthy in Python, so anything but a JSON boolean is an error."""
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config field {name!r} must be true or false (a JSON boolean), got {value!r}")
    return value


def _as_float(value: object) -> object:
    """An int/float number as a float; anything else unchanged, for ``__post_init__`` to reject by name."""
    return float(value) if _is_finite_number(value) else value


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-style decoder (the subset minienv implements).

    Names follow ``transformers.LlamaConfig`` so a reader can put the two side by side.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        """Type-check every field: JSON's ``true`` is not an integer, ``"false"`` is not a boolean, and a NaN or
        infinite ``rope_theta`` would make every rotary angle NaN."""
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config fields 'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
                f"'num_key_value_heads' ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config field 'head_dim' must be even for RoPE, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (_is_finite_number(value) and value > 0):
                raise ConfigError(f"config field {name!r} must be a finite positive number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(
                f"config field 'tie_word_embeddings' must be true or false (a JSON boolean), "
                f"got {self.tie_word_embeddings!r}"
            )
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value < self.vocab_size):
                raise ConfigError(
                    f"config field {name!r} must be null or a token id in [0, vocab_size={self.vocab_size}), "
                    f"got {value!r}"
                )

    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size: how many query heads share one K/V head."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """KV-cache bytes one token occupies: K and V, in every layer, for every KV head."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element

    def num_parameters(self) -> int:
        """Parameter count (the LM head counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LlamaConfig":
        """Validate an HF Llama config dict and keep the fields minienv uses."""
        if not isinstance(raw, dict):
            raise ConfigError(f"a config must be a JSON object (dict), got {type(raw).__name__}")
        archs = raw.get("architectures")
        if archs is not None:
            if not isinstance(archs, list) or not archs or any(a not in SUPPORTED_ARCHITECTURES for a in archs):
                raise ConfigError(
                    f"config field 'architectures' is {archs!r}; minienv implements only {list(SUPPORTED_ARCHITECTURES)}"
                )
        model_type = raw.get("model_type")
        if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config field 'model_type' is {model_type!r}; minienv implements only 'llama'")
        if archs is None and model_type is None:
            raise ConfigError("config has neither 'architectures' nor 'model_type'; cannot tell it is a Llama model")

        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ConfigError(f"config is missing required field(s): {', '.join(repr(m) for m in missing)}")

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config field 'hidden_act' is {act!r}; minienv's SwiGLU MLP implements only 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if _optional_bool(raw, flag, False):
                raise ConfigError(f"config field {flag!r} is true; minienv's Llama has no biases")
        if raw.get("rope_scaling"):
            raise ConfigError(
                f"config field 'rope_scaling' is {raw['rope_scaling']!r}; minienv implements only plain RoPE"
            )
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise ConfigError(f"config field 'pretraining_tp' is {raw['pretraining_tp']!r}; only 1 is supported")

        # transformers 5 writes rope settings under 'rope_parameters'; older configs use a top-level 'rope_theta'.
        rope_theta = raw.get("rope_theta", 10000.0)
        rope_params = raw.get("rope_parameters")
        if rope_params is not None:
            if not isinstance(rope_params, dict):
                raise ConfigError(f"config field 'rope_parameters' must be an object, got {rope_params!r}")
            rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
            if rope_type != "default":
                raise ConfigError(
                    f"config field 'rope_parameters.rope_type' is {rope_type!r}; minienv implements only 'default'"
                )
            extra = sorted(set(rope_params) - {"rope_type", "type", "rope_theta"})
            if extra:
                raise ConfigError(f"config field 'rope_parameters' has unsupported key(s) {extra}")
            rope_theta = rope_params.get("rope_theta", rope_theta)

        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim")
        if head_dim is None:
            for name in ("hidden_size", "num_attention_heads"):
                if not _is_int(raw[name]) or raw[name] < 1:
                    raise ConfigError(f"config field {name!r} must be a positive integer, got {raw[name]!r}")
            if hidden % heads:
                raise ConfigError(
                    f"config has no 'head_dim' and 'hidden_size' ({hidden}) is not divisible by "
                    f"'num_attention_heads' ({heads})"
                )
            head_dim = hidden // heads
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):  # several stop ids: minienv stops on the first
            if not all(_is_int(e) for e in eos):
                raise ConfigError(f"config field 'eos_token_id' must be a token id or a list of them, got {eos!r}")
            eos = eos[0] if eos else None
        kv_heads = raw.get("num_key_value_heads")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=_as_float(rope_theta),
            rms_norm_eps=_as_float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=_optional_bool(raw, "tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "LlamaConfig":
        """Read and validate ``config.json`` (or ``path/config.json``); every error message names the file."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object, got a JSON {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """An HF-style config dict that ``transformers.LlamaConfig`` (and minienv) can read back."""
        d = asdict(self)
        d.pop("rope_theta")  # transformers 5 keeps it under rope_parameters
        d.update(architectures=list(SUPPORTED_ARCHITECTURES), model_type="llama", hidden_act="silu",
                 attention_bias=False, mlp_bias=False, torch_dtype="float32",
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        return d

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path
