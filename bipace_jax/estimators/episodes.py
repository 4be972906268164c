"""Canonical row order, row validity, discounted returns and the episode (GRPO) level, jitted.

`docs/estimators.md`, sections "Terms", "Inputs", "Returns", "Episode level" (with its
"Equal values stay equal" rule) and the `penalty` / `episode_stats` protocol options. Everything here runs on the rows sorted into the canonical order
(real rows first, ascending (group_id, traj_id, step)); `Rows.perm` maps back to the batch order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

STD_EPS = 1e-6
"""Added to the std before dividing (`docs/estimators.md`, "Episode level")."""
EQUAL_RTOL = 1e-5
"""Values spanning at most EQUAL_RTOL * max(1, max |value|) are all-equal (`docs/estimators.md`, "Episode level")."""


class Rows(NamedTuple):
    """The batch in canonical order (all arrays [N], position k = k-th row in canonical order)."""

    perm: jax.Array  # int32: batch row of canonical position k
    valid: jax.Array  # bool: real and its trajectory passed every check
    group_idx: jax.Array  # int32: 0-based rank of the task group among the real rows' groups
    traj_idx: jax.Array  # int32: 0-based rank of the (group, trajectory) segment among real rows
    pos: jax.Array  # int32: position of the row inside its task group (real rows)
    first_of_traj: jax.Array  # bool: valid and step 0 of its trajectory
    obs_hash: jax.Array  # int32
    action_key: jax.Array  # int32
    reward: jax.Array  # float32, 0 where not valid
    invalid_rows: jax.Array  # int32 scalar: real rows that are not valid
    penalty: jax.Array | None = None  # float32, 0 where not valid; None when the batch has none


def _shift_right(x, fill):
    return jnp.concatenate([jnp.full((1,), fill, x.dtype), x[:-1]])


def _shift_left(x, fill):
    return jnp.concatenate([x[1:], jnp.full((1,), fill, x.dtype)])


def canonical_rows(batch, group_capacity: int | None, row_capacity: int | None) -> Rows:
    """Sorts rows canonically and marks invalid trajectories (the jitted path never raises).

    A real row is invalid when its trajectory (all real rows with its traj_id) has a non-finite
    reward, a non-finite or negative penalty, rows in two task groups, steps that are not exactly 0..T-1 (negative, duplicate or
    missing steps), or, when capacities are given, a row beyond `group_capacity` task groups or
    beyond `row_capacity` rows of its task group. Invalid rows are treated as padding (advantage 0,
    in no statistic) and counted in `invalid_rows`.
    """
    n = batch.reward.shape[0]
    k = jnp.arange(n, dtype=jnp.int32)
    real_in = batch.mask.astype(bool)
    pad_key = (~real_in).astype(jnp.int32)
    _, g, t, s, perm = lax.sort((pad_key, batch.group_id, batch.traj_id, batch.step, k), num_keys=4, is_stable=True)
    real = real_in[perm]
    new_group = real & ((k == 0) | (g != _shift_right(g, 0)))
    new_traj = real & (new_group | (t != _shift_right(t, 0)))
    group_idx = jnp.cumsum(new_group, dtype=jnp.int32) - 1
    traj_idx = jnp.cumsum(new_traj, dtype=jnp.int32) - 1
    traj_start = lax.cummax(jnp.where(new_traj, k, 0))
    group_start = lax.cummax(jnp.where(new_group, k, 0))
    pos = k - group_start
    reward = batch.reward.astype(jnp.float32)[perm]

    bad = (s != k - traj_start) | ~jnp.isfinite(reward)
    penalty = None
    if batch.penalty is not None:
        penalty = batch.penalty.astype(jnp.float32)[perm]
        bad = bad | ~(jnp.isfinite(penalty) & (penalty >= 0))
    # A traj_id in two task groups: sort by (traj_id, group_id) and look for a change of group.
    _, t2, g2, perm2 = lax.sort((pad_key, batch.traj_id, batch.group_id, k), num_keys=3, is_stable=True)
    real2 = real_in[perm2]
    same_traj = real2 & (k > 0) & (t2 == _shift_right(t2, 0))
    seg2 = jnp.cumsum(real2 & ~same_traj, dtype=jnp.int32) - 1
    change = same_traj & (g2 != _shift_right(g2, 0))
    split_seg = jax.ops.segment_max(change.astype(jnp.int32), jnp.where(real2, seg2, n), n)
    split2 = real2 & (split_seg[jnp.clip(seg2, 0, n - 1)] > 0)
    split = jnp.zeros((n,), bool).at[perm2].set(split2)[perm]
    bad = bad | split
    if group_capacity is not None:
        bad = bad | (group_idx >= group_capacity)
    if row_capacity is not None:
        bad = bad | (pos >= row_capacity)
    seg = jnp.where(real, traj_idx, n)
    traj_bad = jax.ops.segment_max((real & bad).astype(jnp.int32), seg, n)
    valid = real & (traj_bad[jnp.clip(traj_idx, 0, n - 1)] <= 0)
    return Rows(
        perm=perm,
        valid=valid,
        group_idx=group_idx,
        traj_idx=traj_idx,
        pos=pos,
        first_of_traj=valid & new_traj,
        obs_hash=batch.obs_hash[perm],
        action_key=batch.action_key[perm],
        reward=jnp.where(valid, reward, 0.0),
        invalid_rows=jnp.sum(real & ~valid, dtype=jnp.int32),
        penalty=None if penalty is None else jnp.where(valid, penalty, 0.0),
    )


def _summed_reward(rows: Rows, penalty: str):
    """The reward that is summed and discounted: `reward - penalty` ("in_reward"), `reward` ("own_row")."""
    if rows.penalty is None or penalty == "own_row":
        return rows.reward
    return rows.reward - rows.penalty


def discounted_returns(rows: Rows, gamma, penalty: str = "in_reward") -> jax.Array:
    """R[t] = reward[t] + gamma * R[t+1] inside each trajectory (`docs/estimators.md`, "Returns"); float32[N].

    penalty="in_reward": the reward is `reward - penalty`, so the invalid-action charge is discounted
    back to earlier steps like any reward; "own_row": R of `reward` alone, minus the row's own penalty
    (verl-agent's reading). Computed as a segmented linear recurrence with `lax.associative_scan`
    (log-depth); gamma = 0 is exact because the coefficient of R[t+1] is then exactly 0.
    """
    nxt_same = (_shift_left(rows.traj_idx, -1) == rows.traj_idx) & _shift_left(rows.valid, False) & rows.valid
    a = jnp.where(nxt_same, jnp.asarray(gamma, jnp.float32), 0.0)
    # Reverse time: y[u] = a'[u] * y[u-1] + b[u] with a'[u] = a[u] (coefficient of the later row).
    a_rev, b_rev = a[::-1], _summed_reward(rows, penalty)[::-1]

    def combine(earlier, later):
        a1, b1 = earlier
        a2, b2 = later
        return a1 * a2, a2 * b1 + b2

    _, y = lax.associative_scan(combine, (a_rev, b_rev))
    y = y[::-1]
    if penalty == "own_row" and rows.penalty is not None:
        y = y - rows.penalty
    return jnp.where(rows.valid, y, 0.0)


class GroupStats(NamedTuple):
    count: jax.Array
    mean: jax.Array
    std: jax.Array  # unbiased (ddof = 1); 0 for groups of size < 2
    all_equal: jax.Array  # span <= EQUAL_RTOL * max(1, max |value|)


def group_stats(values, labels, include, num_segments: int) -> GroupStats:
    """Per-segment count, mean, unbiased std and the all-equal flag over rows where `include`.

    Args: values float32[N]; labels int32[N] in [0, num_segments); include bool[N].
    Returns: `GroupStats` of [num_segments] arrays.
    """
    ids = jnp.where(include, labels, num_segments)
    cnt = jax.ops.segment_sum(include.astype(jnp.int32), ids, num_segments)
    tot = jax.ops.segment_sum(jnp.where(include, values, 0.0), ids, num_segments)
    mean = tot / jnp.maximum(cnt, 1).astype(jnp.float32)
    dev = jnp.where(include, values - mean[jnp.clip(labels, 0, num_segments - 1)], 0.0)
    ss = jax.ops.segment_sum(dev * dev, ids, num_segments)
    std = jnp.sqrt(ss / jnp.maximum(cnt - 1, 1).astype(jnp.float32))
    hi = jax.ops.segment_max(jnp.where(include, values, -jnp.inf), ids, num_segments)
    lo = jax.ops.segment_min(jnp.where(include, values, jnp.inf), ids, num_segments)
    scale = jnp.maximum(1.0, jnp.maximum(jnp.abs(hi), jnp.abs(lo)))
    all_equal = (cnt > 0) & ((hi - lo) <= EQUAL_RTOL * scale)
    return GroupStats(cnt, mean, std, all_equal)


def normalised_advantage(values, labels, include, num_segments: int, norm: str) -> jax.Array:
    """`(v - mean_S) / (std_S + 1e-6)` ("mean_std") or `v - mean_S` ("mean") per segment S.

    Singletons and all-equal segments get 0 (`docs/estimators.md`, "Episode level"). float32[N], 0 where
    not `include`. Used by the episode level (values = episode returns, one row per trajectory) and
    the gigpo/bigpo step level (values = step returns).
    """
    st = group_stats(values, labels, include, num_segments)
    lab = jnp.clip(labels, 0, num_segments - 1)
    centred = values - st.mean[lab]
    if norm == "mean_std":
        centred = centred / (st.std[lab] + STD_EPS)
    keep = include & (st.count[lab] > 1) & ~st.all_equal[lab]
    return jnp.where(keep, centred, 0.0)


def episode_advantage(rows: Rows, norm: str, penalty: str = "in_reward", stats: str = "trajectory") -> jax.Array:
    """A_ep per row (`docs/estimators.md`, "Episode level" and "Protocol options"). float32[N] in canonical order.

    stats="trajectory": one value per trajectory (not per row): G = sum_t reward[t] (undiscounted),
    normalised inside the task group over its valid trajectories; a group with one trajectory gets 0;
    every row of a trajectory carries its trajectory's A_ep. stats="rows": every valid row's own
    episode score (G, and with penalty="own_row" G of `reward` minus the row's own penalty) is
    normalised over the task group's valid rows.
    """
    n = rows.reward.shape[0]
    seg = jnp.where(rows.valid, rows.traj_idx, n)
    ep_return = jax.ops.segment_sum(_summed_reward(rows, penalty), seg, n)
    traj = jnp.clip(rows.traj_idx, 0, n - 1)
    g_row = ep_return[traj]
    if penalty == "own_row" and rows.penalty is not None:
        g_row = g_row - rows.penalty
    if stats == "rows":
        return normalised_advantage(g_row, rows.group_idx, rows.valid, n, norm)
    a_first = normalised_advantage(g_row, rows.group_idx, rows.first_of_traj, n, norm)
    a_traj = jax.ops.segment_sum(a_first, jnp.where(rows.first_of_traj, rows.traj_idx, n), n)
    return jnp.where(rows.valid, a_traj[traj], 0.0)


def trajectory_steps(rows: Rows) -> jax.Array:
    """Position of each valid row in its trajectory (its `step`); int32[N], 0 where not valid.

    A valid trajectory's rows are consecutive in canonical order with steps 0..T-1, so the position
    is the distance to the trajectory's first row.
    """
    k = jnp.arange(rows.reward.shape[0], dtype=jnp.int32)
    start = lax.cummax(jnp.where(rows.first_of_traj, k, 0))
    return jnp.where(rows.valid, k - start, 0)


def hash_labels(rows: Rows):
    """Dense ids of the exact-hash partition over (group_id, obs_hash); int32[N] in [0, N).

    gigpo's step groups, and the `hash_` diagnostics partition of every estimator.
    """
    n = rows.reward.shape[0]
    k = jnp.arange(n, dtype=jnp.int32)
    _, g, h, idx = lax.sort(
        ((~rows.valid).astype(jnp.int32), rows.group_idx, rows.obs_hash, k), num_keys=3, is_stable=True
    )
    first = (k == 0) | (g != jnp.roll(g, 1)) | (h != jnp.roll(h, 1))
    dense = jnp.cumsum(first, dtype=jnp.int32) - 1
    return jnp.zeros((n,), jnp.int32).at[idx].set(dense)
