"""The BiGPO clustering kernel: exact greedy cosine clustering per task group, jitted.

Contract: `docs/estimators.md`, section "Clustering". Layout: the rows of task group g sit at
`[g, 0:rows]` of a `[Gc, R]` table in canonical order; the kernel scans the R positions in blocks of B
rows, all task groups at once (the leading axis can be sharded over a mesh's data axis).

The greedy rule needs, for row i and every existing cluster c, `cos = f_i . s_c/||s_c||` (`s_c` the
plain sum of the members' re-normalised fingerprints) or `f_i . f_leader(c)`, without a matrix-vector
product per row: at the start of a block `X = F_block @ S^T` (fp32, precision=HIGHEST) over the
16-slot chunks of cluster slots in use, and `||s_c||^2`; inside the block, a row that joined (or, for
leaders, opened) cluster c adds its column of the block's Gram matrix to the later rows' `f . s_c`,
and `||s_c + f||^2 = ||s_c||^2 + 2 f.s_c + f.f`; the sums S get one scatter-add per block. Work: about
N * (B + K_used) * D multiply-adds plus R sequential row steps of O(Kp + B) vector work. Only the
order of fp32 additions differs from the oracle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST
JOIN_SLACK = 1e-6
"""Join when cos >= 1 - epsilon - JOIN_SLACK (`docs/estimators.md`, "Clustering")."""


def join_threshold(epsilon: float):
    """float32 threshold `1 - epsilon - 1e-6`, computed in float64 on the host then rounded once."""
    return jnp.float32(1.0 - float(epsilon) - JOIN_SLACK)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def slot_layout(capacity: int, chunk: int = 16) -> tuple[int, int]:
    """(slots per matmul chunk, padded number of cluster slots Kp >= capacity)."""
    kc = min(chunk, _round_up(capacity, 8))
    return kc, _round_up(capacity, kc)


def _block_size(r: int, limit: int = 16) -> int:
    return max(d for d in range(1, min(r, limit) + 1) if r % d == 0)


def row_scales(f):
    """Per-row factors of the robust re-normalisation `(f / max|f|) / ||f / max|f|| ||`, in fp32.

    Args: f float32/bfloat16 [..., D].
    Returns: (max_abs float32 [...], norm float32 [...], degenerate bool [...]); both factors are 1 on
    degenerate rows (a non-finite element, or all zeros). The kernel applies them to each block it loads.
    """
    f = f.astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(f), axis=-1)
    m = jnp.max(jnp.abs(jnp.where(jnp.isfinite(f), f, 0.0)), axis=-1)
    degenerate = ~finite | (m == 0)
    m = jnp.where(degenerate, 1.0, m)
    g = jnp.where(degenerate[..., None], 0.0, f / m[..., None])
    nrm = jnp.sqrt(jnp.sum(g * g, axis=-1))
    return m, jnp.where(degenerate, 1.0, nrm), degenerate


def greedy_cosine_clusters(
    fingerprint,
    row_index,
    max_abs,
    norm,
    ok,
    threshold,
    *,
    capacity: int,
    centroid: str = "mean",
    block: int | None = None,
    chunk: int = 16,
):
    """Greedy nearest-cluster cosine clustering of each task group's rows, in layout order.

    Args:
      fingerprint: float32/bfloat16 [M, D] raw fingerprints (any rows; only those named by
        `row_index` where `ok` are read).
      row_index: int32[Gc, R], the fingerprint row at each layout position (rows in canonical order).
      max_abs, norm: float32[Gc, R] the `row_scales` factors of those rows: the kernel clusters
        `(f / max_abs) / norm`, loaded block by block (the unit vectors are never materialised).
      ok: bool[Gc, R] rows to cluster (valid and not degenerate); other positions are skipped.
      threshold: float32 scalar, `1 - epsilon - 1e-6` (traced: changing epsilon does not recompile).
      capacity: K, the fixed number of clusters per task group.
      centroid: "mean" (re-normalised running sum) or "leader" (first member).
      block: rows per block (B, divides R; default the largest divisor of R up to 16).
      chunk: cluster slots per matmul chunk.
    Returns:
      slot: int32[Gc, R], the cluster (0..K-1, in order of creation) of each row, -1 when the row is
        not in a cluster (skipped, or overflowed).
      overflow: bool[Gc, R], rows that would have opened a cluster beyond K.
    """
    gc, r = row_index.shape
    d = fingerprint.shape[1]
    b = block or _block_size(r)
    if r % b:
        raise ValueError(f"greedy_cosine_clusters: block {b} must divide the row capacity {r}")
    kc, kp = slot_layout(capacity, chunk)
    mean = centroid == "mean"
    gidx = jnp.arange(gc)[:, None]
    slots_range = jnp.arange(kp)[None, :]

    def block_step(carry, start):
        s_sum, n2, n = carry  # [Gc, Kp, D], [Gc, Kp], [Gc]
        okb = lax.dynamic_slice_in_dim(ok, start, b, axis=1)  # [Gc, B]
        idx = lax.dynamic_slice_in_dim(row_index, start, b, axis=1)
        mb = lax.dynamic_slice_in_dim(max_abs, start, b, axis=1)[..., None]
        nb = lax.dynamic_slice_in_dim(norm, start, b, axis=1)[..., None]
        raw = jnp.take(fingerprint, idx, axis=0, mode="clip").astype(jnp.float32)
        fb = jnp.where(okb[..., None], (raw / mb) / nb, 0.0)  # [Gc, B, D] unit rows, zeros elsewhere

        def chunk_step(c, acc):
            x, n2 = acc
            sc = lax.dynamic_slice_in_dim(s_sum, c * kc, kc, axis=1)
            x = lax.dynamic_update_slice_in_dim(
                x, jnp.einsum("gbd,gkd->gbk", fb, sc, precision=HIGHEST), c * kc, axis=2
            )
            if mean:
                n2 = lax.dynamic_update_slice_in_dim(
                    n2, jnp.einsum("gkd,gkd->gk", sc, sc, precision=HIGHEST), c * kc, axis=1
                )
            return x, n2

        num_chunks = (jnp.max(n) + kc - 1) // kc
        x0, n2 = lax.fori_loop(0, num_chunks, chunk_step, (jnp.zeros((gc, b, kp), jnp.float32), n2))
        gram = jnp.einsum("gbd,gcd->gbc", fb, fb, precision=HIGHEST)  # [Gc, B, B]

        def row_step(state, j):
            n2, n, slot_b, contrib_b = state
            gj = gram[:, j, :]  # [Gc, B]
            x = x0[:, j, :].at[gidx, slot_b].add(jnp.where(contrib_b, gj, 0.0), mode="drop")
            cos = x / jnp.sqrt(n2) if mean else x
            cos = jnp.where(slots_range < n[:, None], cos, -jnp.inf)
            # First maximum = the earliest cluster on an exact tie (argmax without its slow CPU lowering).
            best_cos = jnp.max(cos, axis=1)
            best = jnp.min(jnp.where(cos == best_cos[:, None], slots_range, kp), axis=1).astype(jnp.int32)
            best = jnp.minimum(best, kp - 1)
            okj = okb[:, j]
            join = okj & (best_cos >= threshold)
            can_open = n < capacity
            opened = okj & ~join & can_open
            over = okj & ~join & ~can_open
            slot = jnp.where(join, best, jnp.where(opened, n, kp))
            gjj = gj[jnp.arange(gc), j]
            if mean:
                x_best = jnp.take_along_axis(x, best[:, None], axis=1)[:, 0]
                n2_best = jnp.take_along_axis(n2, best[:, None], axis=1)[:, 0]
                n2 = n2.at[jnp.arange(gc), slot].set(jnp.where(join, n2_best + 2.0 * x_best + gjj, gjj), mode="drop")
                contrib = join | opened
            else:
                contrib = opened
            n = n + opened.astype(jnp.int32)
            slot_b = slot_b.at[:, j].set(slot)
            contrib_b = contrib_b.at[:, j].set(contrib)
            return (n2, n, slot_b, contrib_b), (jnp.where(slot < kp, slot, -1), over)

        init = (n2, n, jnp.full((gc, b), kp, jnp.int32), jnp.zeros((gc, b), bool))
        (n2, n, slot_b, contrib_b), (slot, over) = lax.scan(row_step, init, jnp.arange(b))
        target = jnp.where(contrib_b, slot_b, kp)
        if mean:
            s_sum = s_sum.at[gidx, target].add(fb, mode="drop")
        else:
            s_sum = s_sum.at[gidx, target].set(fb, mode="drop")
        return (s_sum, n2, n), (slot.T, over.T)

    init = (jnp.zeros((gc, kp, d), jnp.float32), jnp.zeros((gc, kp), jnp.float32), jnp.zeros((gc,), jnp.int32))
    _, (slot, over) = lax.scan(block_step, init, jnp.arange(0, r, b))
    # [R/B, Gc, B] -> [Gc, R]
    slot = jnp.transpose(slot, (1, 0, 2)).reshape(gc, r)
    over = jnp.transpose(over, (1, 0, 2)).reshape(gc, r)
    return slot, over


def cluster_rows(
    rows,
    fingerprint,
    threshold,
    *,
    group_capacity: int,
    row_capacity: int,
    capacity: int | None,
    centroid: str,
    mesh=None,
    data_axis: str = "data",
):
    """Clusters the valid rows of every task group; returns per canonical row (all [N]):

    label int32 (step group id in [0, M), singletons get their own), degenerate bool, overflow bool,
    and M (static number of label slots).

    Args:
      rows: `episodes.Rows` (canonical order).
      fingerprint: [N, D] in batch order (float32 or bfloat16).
      threshold: float32 scalar join threshold.
      group_capacity, row_capacity: the batch's static capacities (layout [Gc, R]).
      capacity: K (None: row_capacity).
      mesh: optional `jax.sharding.Mesh`; the task-group axis of the layout is sharded over
        `data_axis` with `jax.shard_map` (whole task groups per device, same result as one device).
    """
    n = rows.reward.shape[0]
    k = jnp.arange(n, dtype=jnp.int32)
    ndev = 1 if mesh is None else mesh.shape[data_axis]
    gc = _round_up(group_capacity, ndev)
    r = _round_up(row_capacity, 8)
    cap = capacity or row_capacity
    gi = jnp.where(rows.valid, rows.group_idx, gc)
    pi = jnp.where(rows.valid, rows.pos, 0)
    table = jnp.full((gc, r), n, jnp.int32).at[gi, pi].set(k, mode="drop")
    present = table < n
    src = jnp.where(present, rows.perm[jnp.clip(table, 0, n - 1)], 0)
    max_abs, nrm, degenerate = row_scales(fingerprint)
    max_abs, nrm, degenerate = max_abs[src], nrm[src], degenerate[src]
    ok = present & ~degenerate
    kernel = functools.partial(greedy_cosine_clusters, capacity=cap, centroid=centroid)
    if mesh is None:
        slot, over = kernel(fingerprint, src, max_abs, nrm, ok, threshold)
    else:
        P, named = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
        by_group, replicated = named(mesh, P(data_axis)), named(mesh, P())
        sharded = jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=(P(), *([P(data_axis)] * 4), P()),
            out_specs=(P(data_axis), P(data_axis)),
            check_vma=False,
        )
        slot, over = sharded(
            jax.reshard(fingerprint, replicated),
            *(jax.reshard(x, by_group) for x in (src, max_abs, nrm, ok)),
            jax.reshard(threshold, replicated),
        )
        slot, over = jax.reshard(slot, replicated), jax.reshard(over, replicated)
    _, kp = slot_layout(cap)
    gq = jnp.clip(rows.group_idx, 0, gc - 1)
    pq = jnp.clip(rows.pos, 0, r - 1)
    slot_row = jnp.where(rows.valid, slot[gq, pq], -1)
    deg_row = rows.valid & (present & degenerate)[gq, pq]
    over_row = rows.valid & over[gq, pq]
    m = gc * kp + n
    label = jnp.where(slot_row >= 0, gq * kp + slot_row, gc * kp + k)
    return label, deg_row, over_row, m
