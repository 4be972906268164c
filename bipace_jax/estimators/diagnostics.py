"""Step-group size statistics and row rates (`docs/estimators.md`, "Diagnostics").

All statistics are over valid real rows (mask True and not counted in `invalid_rows`), pooled over
the step groups of the whole batch; an empty denominator gives 0.0. Counts are int32 scalars
(`pairs` overflows int32 only beyond ~65,000 rows in one step group), rates and sizes float32
scalars. `overflow_rows` and `degenerate_rows` are 0 for grpo and gigpo, which read no
fingerprints; `pace_row_rate` and `loo_row_rate` are 0.0 except for bipace_q and bipace_diff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SIZE_STATS = (
    "num_step_groups",
    "singleton_group_rate",
    "singleton_row_rate",
    "mean_group_size",
    "p90_group_size",
    "max_group_size",
    "pairs",
)
"""The seven size statistics of a partition (also reported with the prefix `hash_`)."""

ROW_RATES = ("pace_row_rate", "loo_row_rate")
COUNTS = ("overflow_rows", "degenerate_rows", "invalid_rows")
DIAGNOSTIC_KEYS = SIZE_STATS + ROW_RATES + COUNTS + tuple("hash_" + k for k in SIZE_STATS)
"""Every key of the diagnostics dict, for every estimator."""


def _ratio(num, den):
    num = jnp.asarray(num, jnp.float32)
    den = jnp.asarray(den, jnp.float32)
    return jnp.where(den > 0, num / jnp.maximum(den, 1.0), 0.0)


def partition_stats(labels, include, num_segments: int, prefix: str = "") -> dict[str, jax.Array]:
    """The seven size statistics of the partition `labels` over the rows where `include`.

    `labels` int32[N] in [0, num_segments) (static M); `include` bool[N] valid real rows. Returns
    num_step_groups, singleton_group_rate (groups of size 1 / groups), singleton_row_rate (rows in
    singletons / real rows), mean_group_size (real rows / groups), p90_group_size (numpy's linear
    interpolation at 0.9 * (n - 1), computed exactly in integers), max_group_size, pairs (sum |S|(|S|-1)/2).
    """
    ids = jnp.where(include, labels, num_segments)
    size = jax.ops.segment_sum(include.astype(jnp.int32), ids, num_segments)
    rows = jnp.sum(include, dtype=jnp.int32)
    groups = jnp.sum(size > 0, dtype=jnp.int32)
    singles = jnp.sum(size == 1, dtype=jnp.int32)
    ordered = jnp.sort(size)  # ascending; the `groups` non-empty sizes are the last ones
    h = 9 * jnp.maximum(groups - 1, 0)
    lo, frac = h // 10, (h % 10).astype(jnp.float32) / 10.0
    first = num_segments - groups
    a = ordered[jnp.clip(first + lo, 0, num_segments - 1)].astype(jnp.float32)
    b = ordered[jnp.clip(first + jnp.minimum(lo + 1, groups - 1), 0, num_segments - 1)].astype(jnp.float32)
    p90 = jnp.where(groups > 0, a + (b - a) * frac, 0.0)
    out = {
        "num_step_groups": groups,
        "singleton_group_rate": _ratio(singles, groups),
        "singleton_row_rate": _ratio(singles, rows),
        "mean_group_size": _ratio(rows, groups),
        "p90_group_size": p90,
        "max_group_size": jnp.max(size),
        "pairs": jnp.sum(size * (size - 1) // 2, dtype=jnp.int32),
    }
    return {prefix + k: v for k, v in out.items()}


def empty_size_stats() -> dict[str, jax.Array]:
    """The size statistics of an estimator without step groups (grpo): all 0."""
    return {
        k: (jnp.int32(0) if k in ("num_step_groups", "max_group_size", "pairs") else jnp.float32(0.0))
        for k in SIZE_STATS
    }


def row_rate(flags, include):
    """Share of the valid real rows where `flags` holds (0.0 when there are none)."""
    return _ratio(jnp.sum(flags & include, dtype=jnp.int32), jnp.sum(include, dtype=jnp.int32))
