"""Device mesh, logical axes and partition rules for the Qwen2 actor.

The mesh has three named axes (`MESH_AXES`):
  * ``data``   pure data parallelism: the batch is split, parameters are replicated;
  * ``fsdp``   fully-sharded data parallelism: the batch is split *and* every parameter is split
               along its embedding (D) dimension, gathered by XLA when a layer needs it;
  * ``tensor`` Megatron-style tensor parallelism: attention heads, the MLP width and the vocabulary
               are split; q/k/v/gate/up are column-parallel and o/down row-parallel.

Every array dimension carries a *logical axis* name ("batch", "embed", "heads", ...).
`LOGICAL_TO_MESH` maps logical axes to mesh axes; `PARAM_RULES` gives the logical axes of every
parameter of `Qwen2Actor` by path; `constrain` pins an activation's sharding inside a jitted
function when a mesh is set (`jax.set_mesh`) and does nothing otherwise. A mesh axis that does not
divide a dimension is dropped for that dimension (the dimension is replicated along it) rather
than producing an error or an uneven split.

Mesh axes are `AxisType.Auto`: XLA's sharding propagation places the collectives; `constrain` and
the parameter shardings anchor it. No pmap; `jax.jit` with `NamedSharding` throughout.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

__all__ = [
    "MESH_AXES", "LOGICAL_TO_MESH", "PARAM_RULES", "ACTIVATION_AXES",
    "make_mesh", "mesh_from_config", "logical_to_spec", "gather_param", "param_logical_axes", "param_spec",
    "param_shardings", "shard_params", "constrain", "batch_sharding", "cache_shardings",
    "count_params", "per_device_bytes",
]

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_TO_MESH: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "cache_seq": None,
    "embed": "fsdp",       # parameters: FSDP splits D; activations keep D whole ("act_embed").
    "act_embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "norm": None,
}

# Parameter path (joined with "/") -> logical axes, first match wins. Shapes in Qwen2Actor:
#   embed/embedding [V, D]; layers/i/attn/{q,k,v}_proj/kernel [D, N|K, Hd], bias [N|K, Hd];
#   o_proj/kernel [N, Hd, D]; mlp/{gate,up}_proj/kernel [D, F]; down_proj/kernel [F, D];
#   */scale [D]; lm_head/kernel [D, V].
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed/embedding$", ("vocab", "embed")),
    (r"attn/q_proj/kernel$", ("embed", "heads", "head_dim")),
    (r"attn/q_proj/bias$", ("heads", "head_dim")),
    (r"attn/[kv]_proj/kernel$", ("embed", "kv_heads", "head_dim")),
    (r"attn/[kv]_proj/bias$", ("kv_heads", "head_dim")),
    (r"attn/o_proj/kernel$", ("heads", "head_dim", "embed")),
    (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"norm/scale$", ("norm",)),
    (r"lm_head/kernel$", ("embed", "vocab")),
)

# Logical axes of the activations the actor constrains (names used in bipace_jax.models.qwen2).
ACTIVATION_AXES: dict[str, tuple[str | None, ...]] = {
    "hidden": ("batch", "seq", "act_embed"),            # [B, T, D]
    "q": ("batch", "seq", "heads", "head_dim"),         # [B, T, N, Hd]
    "kv": ("batch", "seq", "kv_heads", "head_dim"),     # [B, T, K, Hd]
    "mlp": ("batch", "seq", "mlp"),                     # [B, T, F]
    "logits": ("batch", "seq", "vocab"),                # [B, T, V]
    "last_logits": ("batch", "vocab"),                  # [B, V]
    "cache_k": ("layers", "batch", "kv_heads", "head_dim", "cache_seq"),   # keys [L, B, K, Hd, S]
    "cache_k_layer": ("batch", "kv_heads", "head_dim", "cache_seq"),        # [B, K, Hd, S] (per-layer form)
    "cache_v": ("layers", "batch", "kv_heads", "cache_seq", "head_dim"),  # values [L, B, K, S, Hd]
    "cache_v_layer": ("batch", "kv_heads", "cache_seq", "head_dim"),       # [B, K, S, Hd] (per-layer form)
    "cache_mask": ("batch", "cache_seq"),               # [B, S]
    "per_row": ("batch",),                              # [B]
}


# --------------------------------------------------------------------------------------------------
# Meshes.
def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` with axes ("data", "fsdp", "tensor") of the given sizes (Auto axis types).

    One size may be -1: it takes all remaining devices. The product must equal the device count.

    Raises:
      ValueError: a size is 0 or < -1, more than one is -1, or the product does not equal the
        number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, s in sizes.items():
        if not isinstance(s, (int, np.integer)) or s == 0 or s < -1:
            raise ValueError(f"mesh axis {name!r} size must be a positive int or -1, got {s!r}")
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis size may be -1, got {free}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices are not divisible by the fixed axis "
                             f"sizes {sizes} (product {known})")
        sizes[free[0]] = len(devices) // known
    shape = tuple(int(sizes[n]) for n in MESH_AXES)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape data*fsdp*tensor={shape} has {math.prod(shape)} devices, "
                         f"expected the device count {len(devices)}")
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_from_config(config: Mapping[str, Any] | Any) -> Mesh:
    """`make_mesh` from a mapping or ml_collections config with keys data, fsdp, tensor (default 1)."""
    get = (lambda k: config.get(k, 1)) if hasattr(config, "get") else (lambda k: getattr(config, k, 1))
    return make_mesh(data=get("data"), fsdp=get("fsdp"), tensor=get("tensor"))


def _axis_sizes(mesh: Mesh | Mapping[str, int] | Any) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        return {n: int(mesh.get(n, 1)) for n in MESH_AXES}
    return dict(zip(mesh.axis_names, mesh.axis_sizes)) if hasattr(mesh, "axis_sizes") else dict(mesh.shape)


# --------------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec.
def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int],
                    mesh: Mesh | Mapping[str, int] | Any, rules: Mapping[str, Any] | None = None) -> P:
    """The `PartitionSpec` for an array of `shape` whose dims have the `logical` axis names.

    Mesh axes that are absent from the mesh, of size 1, already used by an earlier dim, or that do
    not divide the dim are dropped (that dim is replicated along them).

    Raises:
      ValueError: `logical` and `shape` have different lengths, or a logical name is unknown.
    """
    rules = LOGICAL_TO_MESH if rules is None else rules
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match the array rank of shape {tuple(shape)}")
    sizes = _axis_sizes(mesh)
    used: set[str] = set()
    out = []
    for name, dim in zip(logical, shape):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(rules)}")
        target = rules[name]
        targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        kept = []
        remaining = dim
        for ax in targets:
            size = sizes.get(ax, 1)
            if size <= 1 or ax in used or remaining % size:
                continue
            kept.append(ax)
            used.add(ax)
            remaining //= size
        out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return P(*out)


def _path_str(path: Sequence[Any]) -> str:
    """"layers/0/attn/q_proj/kernel" from a pytree key path (a Variable's trailing `.value` dropped)."""
    parts = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
    if parts and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts = parts[:-1]
    return "/".join(parts)


def param_logical_axes(path: Sequence[Any] | str) -> tuple[str | None, ...]:
    """Logical axes of the actor parameter at `path` (an nnx state path or a "/"-joined string).

    Raises:
      KeyError: no rule in `PARAM_RULES` matches the path.
    """
    s = path if isinstance(path, str) else _path_str(path)
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, s):
            return axes
    raise KeyError(f"no partition rule for parameter {s!r}")


def param_spec(path: Sequence[Any] | str, shape: Sequence[int], mesh: Mesh | Mapping[str, int]) -> P:
    """The `PartitionSpec` of the actor parameter at `path` with `shape` on `mesh`."""
    return logical_to_spec(param_logical_axes(path), shape, mesh)


def param_shardings(state: Any, mesh: Mesh) -> Any:
    """A pytree like the nnx `state` (arrays or `jax.ShapeDtypeStruct`s) of `NamedSharding`s."""
    def one(path, leaf):
        return NamedSharding(mesh, param_spec(path, leaf.shape, mesh))
    return jax.tree_util.tree_map_with_path(one, state)


def shard_params(model: Any, mesh: Mesh) -> Any:
    """Moves every `nnx.Param` of `model` to its `NamedSharding` on `mesh` (in place); returns model."""
    from flax import nnx
    state = nnx.state(model, nnx.Param)
    shardings = param_shardings(state, mesh)
    nnx.update(model, jax.device_put(state, shardings))
    return model


# --------------------------------------------------------------------------------------------------
# Activations.
def _current_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", True) or not set(MESH_AXES) & set(mesh.axis_names):
        return None
    return mesh


def constrain(x: jax.Array, kind_or_axes: str | Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` of activation `x` to its logical axes when a mesh is set.

    `kind_or_axes` is a key of `ACTIVATION_AXES` (e.g. "hidden") or a tuple of logical names.
    Without a current mesh (`jax.set_mesh`) this returns `x` unchanged, so the model runs the same
    on one device.
    """
    mesh = _current_mesh()
    if mesh is None:
        return x
    axes = ACTIVATION_AXES[kind_or_axes] if isinstance(kind_or_axes, str) else tuple(kind_or_axes)
    spec = logical_to_spec(axes, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)


def gather_param(w: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """FSDP all-gather of a parameter at its point of use, when a mesh is set.

    Constrains `w` to its logical axes with "embed" (the FSDP-split dimension) replicated, so XLA
    gathers the weight over "fsdp" and keeps activations split over the batch, instead of
    resharding activations to follow the weight. Tensor-parallel splits are kept. No-op without
    a mesh.
    """
    mesh = _current_mesh()
    if mesh is None:
        return w
    axes = tuple(None if a == "embed" else a for a in logical)
    return jax.lax.with_sharding_constraint(w, logical_to_spec(axes, w.shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """`NamedSharding` splitting dim 0 (the batch) over ("data", "fsdp"), other dims replicated.

    Use it to `jax.device_put` input_ids/attention_mask [B, T] (ndim=2) or per-row arrays [B]
    (ndim=1); B must be divisible by data*fsdp.
    """
    return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """`NamedSharding`s for a `KVCache` (keys [L,B,K,Hd,S], values [L,B,K,S,Hd], or per-layer tuples
    of [B,K,Hd,S] / [B,K,S,Hd]; slot_mask [B,S], lengths [B], index [])."""
    def spec(kind, leaf):
        return NamedSharding(mesh, logical_to_spec(ACTIVATION_AXES[kind], leaf.shape, mesh))

    def kv(x, kind):
        if isinstance(x, (tuple, list)):
            return tuple(spec(kind + "_layer", a) for a in x)
        return spec(kind, x)
    return type(cache)(k=kv(cache.k, "cache_k"), v=kv(cache.v, "cache_v"),
                       slot_mask=spec("cache_mask", cache.slot_mask),
                       lengths=spec("per_row", cache.lengths), index=NamedSharding(mesh, P()))


# --------------------------------------------------------------------------------------------------
# Abstract sizes (nnx.eval_shape: nothing is allocated).
@functools.lru_cache(maxsize=8)
def _abstract_params(config: Any, param_dtype: Any):
    """nnx.State of `jax.ShapeDtypeStruct`s of the actor's parameters (cached per config and dtype)."""
    from flax import nnx
    from bipace_jax.models.qwen2 import Qwen2Actor
    abstract = nnx.eval_shape(lambda: Qwen2Actor(config, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    return nnx.state(abstract, nnx.Param)


def count_params(config: Any) -> int:
    """Number of parameters of `Qwen2Actor(config)`, counted abstractly with `nnx.eval_shape`.

    A tied head is counted once (the embedding), as HF counts it.
    """
    state = _abstract_params(config, jnp.float32)
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(state)))


def per_device_bytes(config: Any, mesh: Mesh | Mapping[str, int], param_dtype: Any = jnp.bfloat16) -> int:
    """Bytes of parameters held by one device when `Qwen2Actor(config)` is sharded on `mesh`.

    `mesh` may be a real `Mesh` or a mapping of axis sizes, e.g. {"fsdp": 64, "tensor": 4}, so pod
    layouts can be sized on a laptop. Shards are ceil-divided, so this is the largest shard.
    """
    sizes = _axis_sizes(mesh)
    state = _abstract_params(config, param_dtype)
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        spec = param_spec(path, leaf.shape, sizes)
        shard = list(leaf.shape)
        for i, entry in enumerate(spec):
            if entry is None:
                continue
            for ax in ((entry,) if isinstance(entry, str) else entry):
                shard[i] = -(-shard[i] // sizes[ax])
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return int(total)
