"""The KV cache of incremental decoding and its shardings."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from bipace_jax import sharding
from bipace_jax.models.layers import ACTIVATION_AXES

Array = jax.Array


@flax.struct.dataclass
class KVCache:
    """Key/value cache for incremental decoding (a pytree; every field is an array).

    Attributes:
      k: [L, B, K, Hd, S] in the actor's `dtype`: keys (after RoPE) per layer and KV head, slots
        minor, so the decode step's scores q [G, Hd] @ k [Hd, S] read each (row, head) block as a
        plain [Hd, S] matrix (faster on XLA's CPU backend; docs/performance.md).
      v: [L, B, K, S, Hd]: values, slots second-minor, the layout of the probabilities-times-values
        contraction p [G, S] @ v [S, Hd]. Neither is transposed per step; a decode step writes one
        [Hd] column of k and one [Hd] row of v per (row, head).
        Per-layer form (`per_layer()`, `init_cache(..., per_layer=True)`): tuples of L arrays
        [B, K, Hd, S] / [B, K, S, Hd] instead. Same values; a compiled decode loop should carry
        this form: attention reads layer i's block in place, whereas `k[i]` of the stacked array
        is copied out on every step (XLA materialises the slice before the dot).
        `prefill` and `decode_step` return the form they were given.
      slot_mask: bool [B, S], True where a slot holds a real token of that row.
      lengths: int32 [B], real tokens so far per row = the position id of the row's next token.
      index: int32 [], the next slot to write, shared by all rows (prompt padding keeps rows aligned).
    """

    k: Array
    v: Array
    slot_mask: Array
    lengths: Array
    index: Array

    @property
    def max_length(self) -> int:
        """S, the number of slots."""
        return self.v[0].shape[-2]

    @property
    def batch_size(self) -> int:
        """B, the number of rows."""
        return self.k[0].shape[0]

    @property
    def is_per_layer(self) -> bool:
        """True when k, v are tuples of per-layer arrays (k [B, K, Hd, S], v [B, K, S, Hd])."""
        return isinstance(self.k, (tuple, list))

    def per_layer(self) -> KVCache:
        """The same cache with k, v as tuples of L arrays [B, K, Hd, S] / [B, K, S, Hd] (unchanged if
        already)."""
        if self.is_per_layer:
            return self
        return self.replace(
            k=tuple(self.k[i] for i in range(self.k.shape[0])), v=tuple(self.v[i] for i in range(self.v.shape[0]))
        )

    def stacked(self) -> KVCache:
        """The same cache with k, v as stacked [L, B, K, Hd, S] / [L, B, K, S, Hd] arrays (unchanged if
        already)."""
        if not self.is_per_layer:
            return self
        return self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))


def cache_shardings(cache: KVCache, mesh: jax.sharding.Mesh) -> KVCache:
    """`NamedSharding`s for a `KVCache` (stacked or per-layer form) on `mesh`, from `ACTIVATION_AXES`."""

    def spec(kind, leaf):
        return sharding.logical_sharding(ACTIVATION_AXES[kind], leaf.shape, mesh)

    def kv(x, kind):
        if isinstance(x, (tuple, list)):
            return tuple(spec(kind + "_layer", a) for a in x)
        return spec(kind, x)

    return KVCache(
        k=kv(cache.k, "cache_k"),
        v=kv(cache.v, "cache_v"),
        slot_mask=spec("cache_mask", cache.slot_mask),
        lengths=spec("per_row", cache.lengths),
        index=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    )
