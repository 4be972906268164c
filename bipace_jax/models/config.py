"""Qwen2 / Qwen2.5 model configuration.

`Qwen2Config` is a frozen dataclass holding the architecture hyper-parameters of a Qwen2 decoder.
It is built from a Hugging Face `config.json` (both the transformers-5 layout, where the RoPE base
sits in `rope_parameters.rope_theta` and the dtype in `dtype`, and the older layout with top-level
`rope_theta` / `torch_dtype`), from a preset (`Qwen2Config.preset("0.5b" | "1.5b" | "3b" | "7b")`,
shapes from the published Qwen2.5 config.json files) or as a tiny test configuration
(`Qwen2Config.tiny(**overrides)`). The closed option sets of the run config's ``model`` section that
the actor reads (`DType`, `MatmulPrecision`, `Remat`) live here, beside the architecture.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

__all__ = ["DType", "MatmulPrecision", "Qwen2Config", "Remat"]


class DType(enum.StrEnum):
    """``model.dtype`` / ``model.param_dtype``."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def jnp(self):
        """The ``jnp`` dtype."""
        return jnp.dtype(self.value)


class MatmulPrecision(enum.StrEnum):
    """``model.matmul_precision``: ``jax.default_matmul_precision`` of every dot of the actor."""

    DEFAULT = "default"  # the backend's own (bf16 passes on TPU)
    HIGH = "high"
    HIGHEST = "highest"  # full fp32 matmuls


class Remat(enum.StrEnum):
    """``model.remat``: what each decoder layer keeps for the backward pass (``jax.checkpoint``)."""

    NONE = "none"  # all activations (fastest, most memory)
    FULL = "full"  # only the layer input: recomputes the layer, one extra forward
    SAVE_DOTS = "save_dots"  # the matmul outputs without a batch dimension: recomputes the elementwise work


# Values HF uses for a RoPE that is the plain (unscaled) rotary embedding.
_DEFAULT_ROPE_TYPES = (None, "default")

_PRESET_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)
# D, L, N, K, F, V, tied head (Hd = D // N) of the published Qwen2.5 config.json files.
_PRESETS = {
    "0.5b": (896, 24, 14, 2, 4864, 151936, True),  # ~494M params, Hd 64
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True),  # ~1.54B, Hd 128
    "3b": (2048, 36, 16, 2, 11008, 151936, True),  # ~3.09B, Hd 128
    "7b": (3584, 28, 28, 4, 18944, 152064, False),  # ~7.62B, Hd 128
}


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Architecture of a Qwen2 / Qwen2.5 decoder-only transformer.

    Attributes:
      vocab_size: V, rows of the token embedding and of the LM head (7B: 152064, others 151936).
      hidden_size: D, width of the residual stream.
      intermediate_size: F, width of the SwiGLU MLP.
      num_hidden_layers: L, number of decoder layers.
      num_attention_heads: N, query heads.
      num_key_value_heads: K, key/value heads (grouped-query attention; N must be a multiple of K).
      head_dim: Hd, per-head width (D // N unless the config says otherwise).
      rope_theta: RoPE base (Qwen2.5: 1e6).
      rms_norm_eps: epsilon of every RMSNorm (Qwen2.5: 1e-6).
      tie_word_embeddings: True when the LM head is the transposed token embedding.
      max_position_embeddings: longest position the model was trained for (informational).
      bos_token_id, eos_token_id: special token ids from config.json (eos may be a list).
      initializer_range: stddev of the normal initialiser for freshly built weights.
      torch_dtype: dtype name written to config.json on save ("float32", "bfloat16", ...).
    """

    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] | None = 151643
    initializer_range: float = 0.02
    torch_dtype: str = "bfloat16"

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Qwen2Config.{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"Qwen2Config.hidden_size={self.hidden_size} must be divisible by "
                    f"num_attention_heads={self.num_attention_heads} when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"Qwen2Config.head_dim must be a positive even int (RoPE rotates pairs), got {self.head_dim!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen2Config.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"Qwen2Config.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"Qwen2Config.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    # ----------------------------------------------------------------------------------------------
    # Derived sizes.
    @property
    def num_groups(self) -> int:
        """G = N // K: query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids as a tuple (empty when config.json has none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ----------------------------------------------------------------------------------------------
    # Hugging Face config.json.
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> Qwen2Config:
        """Builds the config from a HF `config.json` (a file, the folder holding it, or its dict).

        Both layouts are read: transformers >= 5 (`rope_parameters: {rope_theta, rope_type}`,
        `dtype`) and the older one (top-level `rope_theta`, `rope_scaling`, `torch_dtype`).

        Raises:
          FileNotFoundError: the path has no config.json.
          ValueError: `model_type` is not qwen2, a required field is missing, RoPE scaling other
            than the default is requested, or sliding-window attention is switched on (neither is
            used by Qwen2.5 and neither is implemented).
        """
        if isinstance(path_or_dict, Mapping):
            hf = dict(path_or_dict)
            where = "config dict"
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no HF config.json at {path}")
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
            where = path
        model_type = hf.get("model_type", "qwen2")
        if model_type != "qwen2":
            raise ValueError(f"{where}: model_type must be 'qwen2' (Qwen2/Qwen2.5), got {model_type!r}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"{where}: missing required field(s) {missing}")

        rope = hf.get("rope_parameters") or {}
        legacy_scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        legacy_type = legacy_scaling.get("rope_type", legacy_scaling.get("type"))
        for t in (rope_type, legacy_type):
            if t not in _DEFAULT_ROPE_TYPES:
                raise ValueError(
                    f"{where}: rope type {t!r} is not supported (only the default unscaled RoPE used by Qwen2.5)"
                )
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))  # 10000: HF's default
        if hf.get("use_sliding_window", False):
            raise ValueError(
                f"{where}: use_sliding_window=true is not supported (Qwen2.5 uses full attention in every layer)"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act must be 'silu', got {act!r}")
        dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
        num_heads = int(hf["num_attention_heads"])
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=hf.get("head_dim"),
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            # HF's Qwen2Config defaults to an untied head when the key is absent.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            torch_dtype=str(dtype).replace("torch.", ""),
        )

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict[str, Any]:
        """The config as a transformers-5 `config.json` dict for `Qwen2ForCausalLM`.

        Writes both `dtype` and the older `torch_dtype` and both `rope_parameters` and top-level
        `rope_theta`, so older and newer transformers (and vLLM) read it.
        """
        dtype = torch_dtype or self.torch_dtype
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "use_cache": True,
            "dtype": dtype,
            "torch_dtype": dtype,
        }

    @classmethod
    def preset(cls, name: str, **overrides) -> Qwen2Config:
        """A preset by name: "0.5b", "1.5b", "3b", "7b" (also "qwen2.5-7b", "qwen2_5_7b") or "tiny".

        Shapes are those of the published Qwen2.5 config.json files (`_PRESETS`); any field can be
        overridden, e.g. `Qwen2Config.preset("7b", eos_token_id=151645)`.

        Raises:
          ValueError: unknown name.
        """
        key = name.lower().replace("qwen2.5-", "").replace("qwen2_5_", "").replace("_", ".")
        if key == "tiny":
            return cls.tiny(**overrides)
        if key not in _PRESETS:
            raise ValueError(f"Qwen2Config.preset: name must be one of {sorted([*_PRESETS, 'tiny'])}, got {name!r}")
        return cls(**{**dict(zip(_PRESET_FIELDS, _PRESETS[key])), **overrides})

    @classmethod
    def tiny(cls, **overrides) -> Qwen2Config:
        """A tiny config for tests and CPU runs: V 512, D 64, F 128, L 2, N 4, K 2, Hd 16, fp32.

        Any field can be overridden, e.g. `Qwen2Config.tiny(num_key_value_heads=1)`.
        """
        base = dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            bos_token_id=None,
            eos_token_id=None,
            torch_dtype="float32",
        )
        return cls(**{**base, **overrides})
