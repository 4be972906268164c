"""Qwen2 / Qwen2.5 actor in Flax NNX: logits + BiPACE fingerprints, KV cache, HF checkpoint I/O.

Public API (COMMON interface):
  Qwen2Config, Qwen2Actor, ActorOutput, KVCache,
  load_hf_checkpoint, save_hf_checkpoint, load_tokenizer, CheckpointError;
  sizes: abstract_params, count_params, per_device_bytes.
"""

from bipace_jax.models.checkpoint import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from bipace_jax.models.config import Qwen2Config
from bipace_jax.models.qwen2 import ActorOutput, KVCache, Qwen2Actor
from bipace_jax.models.sizes import abstract_params, count_params, per_device_bytes
from bipace_jax.models.tokenizer import load_tokenizer

__all__ = [
    "Qwen2Config",
    "Qwen2Actor",
    "ActorOutput",
    "KVCache",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "load_tokenizer",
    "CheckpointError",
    "abstract_params",
    "count_params",
    "per_device_bytes",
]
