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
import numpy as np

from bipace_jax.stats import HostStats

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


def host_stats(diag: dict) -> HostStats:
    """One host's diagnostics (`DIAGNOSTIC_KEYS`, plus any partition under another prefix such as
    the trainer's `cluster_`) as a `HostStats`, so a multi-host run reports the pooled partition of all
    hosts' step groups (step groups never span hosts: a host's groups are its own task groups).

    Each rate's integer numerator and denominator are recovered from the rate and its count
    (`round(rate * count)`, exact below ~8e6 rows per host): singleton_group_rate = singletons /
    groups, singleton_row_rate = singletons / rows, mean_group_size = rows / groups, pace_row_rate and
    loo_row_rate = flagged rows / rows (the hash partition's rows: every valid real row). Counts
    (num_step_groups, pairs, overflow/degenerate/invalid_rows) are summed, max_group_size is the max;
    p90_group_size is the max of the hosts' p90s (an upper bound of the pooled p90; exact with one host).

    Raises:
      ValueError: a key that is none of these (named), or no `hash_` partition.
    """
    d = {k: float(np.asarray(v)) for k, v in diag.items()}
    if "hash_num_step_groups" not in d:
        raise ValueError(f"diagnostics.host_stats: expected the hash_ partition's statistics, got keys {sorted(d)}")
    counts, rates, maxima = {}, {}, {}
    for p in [k[: -len("num_step_groups")] for k in d if k.endswith("num_step_groups")]:
        groups = d[p + "num_step_groups"]
        rows = float(round(d[p + "mean_group_size"] * groups))
        singles = float(round(d[p + "singleton_group_rate"] * groups))
        counts.update({p + "num_step_groups": groups, p + "pairs": d[p + "pairs"]})
        rates[p + "singleton_group_rate"] = (singles, groups)
        rates[p + "singleton_row_rate"] = (singles, rows)
        rates[p + "mean_group_size"] = (rows, groups)
        maxima.update({p + "max_group_size": d[p + "max_group_size"], p + "p90_group_size": d[p + "p90_group_size"]})
    rows = rates["hash_mean_group_size"][0]
    for k in ROW_RATES:
        if k in d:
            rates[k] = (float(round(d[k] * rows)), rows)
    counts.update({k: d[k] for k in COUNTS if k in d})
    unknown = sorted(set(d) - set(counts) - set(rates) - set(maxima))
    if unknown:
        raise ValueError(f"diagnostics.host_stats: no pooling rule for {unknown}")
    return HostStats(counts, rates, maxima)
