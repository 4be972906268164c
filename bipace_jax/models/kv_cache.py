"""The KV cache of incremental decoding and its shardings."""

from __future__ import annotations

import flax.struct
import jax

from bipace_jax import sharding
from bipace_jax.models.layers import ACTIVATION_AXES

Array = jax.Array


@flax.struct.dataclass
class KVCache:
    """Key/value cache for incremental decoding (a pytree; every field is an array).

    Attributes:
      k: a tuple of L arrays [B, K, Hd, S] in the actor's `dtype`: keys (after RoPE) per layer and KV
        head, slots minor, so the decode step's scores q [G, Hd] @ k [Hd, S] read each (row, head)
        block as a plain [Hd, S] matrix (faster on XLA's CPU backend; docs/performance.md).
      v: a tuple of L arrays [B, K, S, Hd]: values, slots second-minor, the layout of the
        probabilities-times-values contraction p [G, S] @ v [S, Hd]. Neither is transposed per step;
        a decode step writes one [Hd] column of k and one [Hd] row of v per (row, head). One array
        per layer, not one stacked [L, ...] array: the compiled decode loop's attention then reads
        layer i's block in place (`k[i]` of a stacked array is copied out before the dot every step).
      slot_mask: bool [B, S], True where a slot holds a real token of that row.
      lengths: int32 [B], real tokens so far per row = the position id of the row's next token.
      index: int32 [], the next slot to write, shared by all rows (prompt padding keeps rows aligned).
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
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


def cache_shardings(cache: KVCache, mesh: jax.sharding.Mesh) -> KVCache:
    """`NamedSharding`s for a `KVCache` on `mesh`, from `ACTIVATION_AXES`."""

    def spec(kind, leaf):
        return sharding.logical_sharding(ACTIVATION_AXES[kind], leaf.shape, mesh)

    return KVCache(
        k=tuple(spec("cache_k", a) for a in cache.k),
        v=tuple(spec("cache_v", a) for a in cache.v),
        slot_mask=spec("cache_mask", cache.slot_mask),
        lengths=spec("per_row", cache.lengths),
        index=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    )
