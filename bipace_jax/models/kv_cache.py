"""The KV cache of incremental decoding, its per-row slot writes and its shardings."""

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


def write_per_row(k_cache: Array, v_cache: Array, k: Array, v: Array, index: Array, *, scatter: bool):
    """One layer's new keys/values written at each row's own slot (the continuous scheduler's cache).

    Args:
      k_cache: [B, K, Hd, S] one layer's keys; v_cache: [B, K, S, Hd] its values.
      k: [B, K, Hd, 1] and v: [B, K, 1, Hd], the decode step's new key/value per row (cast to the
        cache's dtype).
      index: int32 [B], row b's slot, in [0, S) (not checked: inside jit an out-of-range write is dropped
        by the scatter and clamped by the slice writes).
      scatter: static. True: one scatter per array (one kernel each, what accelerators want). False:
        a loop of B in-place slice writes (XLA's CPU backend: a scatter there costs ~40% more per decode
        step at 16 rows; on a GPU each loop iteration would be a kernel launch and a host sync).

    Returns:
      (k_cache, v_cache) with the writes, the same values either way (pure data movement).
    """
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    b = k_cache.shape[0]
    if scatter:
        # vmap of a slice write: a scatter whose row dim is a batching dim, so a mesh splitting the rows
        # keeps each row's write on its own device
        k_cache = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (0, 0, i)))(k_cache, k, index)
        v_cache = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (0, i, 0)))(v_cache, v, index)
        return k_cache, v_cache

    def put(r, kv):
        kc, vc = kv
        kr = jax.lax.dynamic_slice_in_dim(k, r, 1, 0)
        vr = jax.lax.dynamic_slice_in_dim(v, r, 1, 0)
        kc = jax.lax.dynamic_update_slice(kc, kr, (r, 0, 0, index[r]))
        return kc, jax.lax.dynamic_update_slice(vc, vr, (r, 0, index[r], 0))

    return jax.lax.fori_loop(0, b, put, (k_cache, v_cache))
