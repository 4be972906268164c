"""Abstract sizes of a `Qwen2Actor`: parameter counts and per-device bytes, nothing allocated."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bipace_jax import sharding
from bipace_jax.models.config import Qwen2Config
from bipace_jax.models.qwen2 import Qwen2Actor

__all__ = ["abstract_params", "count_params", "per_device_bytes"]


@functools.lru_cache(maxsize=8)
def abstract_params(config: Qwen2Config, param_dtype: Any = jnp.float32) -> nnx.State:
    """The `nnx.Param` state of `Qwen2Actor(config)` as `jax.ShapeDtypeStruct`s, with each parameter's
    logical axes (`nnx.eval_shape`; cached per config and dtype)."""
    abstract = nnx.eval_shape(lambda: Qwen2Actor(config, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    return nnx.state(abstract, nnx.Param)


def count_params(config: Qwen2Config) -> int:
    """Number of parameters of `Qwen2Actor(config)`; a tied head is counted once, as HF counts it."""
    state = abstract_params(config, jnp.float32)
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(state)))


def per_device_bytes(
    config: Qwen2Config, mesh: jax.sharding.Mesh | Mapping[str, int], param_dtype: Any = jnp.bfloat16
) -> int:
    """Bytes of parameters held by one device when `Qwen2Actor(config)` is sharded on `mesh`.

    `mesh` may be a real `Mesh` or a mapping of axis sizes, e.g. {"fsdp": 64, "tensor": 4}, so pod
    layouts can be sized on a laptop. Shards are ceil-divided, so this is the largest shard.
    """
    total = 0
    for _, var in nnx.to_flat_state(abstract_params(config, param_dtype)):
        spec = sharding.logical_to_spec(sharding.logical_axes(var), var.shape, mesh)
        total += math.prod(sharding.shard_shape(var.shape, spec, mesh)) * jnp.dtype(var.dtype).itemsize
    return int(total)
