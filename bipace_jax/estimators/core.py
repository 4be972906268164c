"""`compute_advantages`: the jitted entry point (spec: estimators.md, all sections).

One compiled function per (estimator name, norm, centroid, capacity, batch shapes and capacities,
mesh); gamma, omega and epsilon are traced scalars, so tuning them (e.g. `EpsilonController`)
never recompiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bipace_jax.estimators import bigpo, bipace_diff, bipace_q, clustering, diagnostics, gigpo, grpo
from bipace_jax.estimators.batch import StepBatch
from bipace_jax.estimators.config import EstimatorConfig
from bipace_jax.estimators.episodes import canonical_rows, discounted_returns, episode_advantage


def _advantages(
    batch: StepBatch,
    gamma,
    omega,
    threshold,
    *,
    name: str,
    norm: str,
    centroid: str,
    capacity: int | None,
    mesh,
    data_axis: str,
):
    clusters = name in ("bigpo", "bipace_q", "bipace_diff")
    caps = (batch.group_capacity, batch.row_capacity) if clusters else (None, None)
    rows = canonical_rows(batch, *caps)
    n = rows.reward.shape[0]
    include = rows.valid
    returns = discounted_returns(rows, gamma)
    a_ep = episode_advantage(rows, norm)
    hash_lab = gigpo.hash_labels(rows)
    diag = diagnostics.partition_stats(hash_lab, include, n, prefix="hash_")
    zero_rate = jnp.float32(0.0)
    loo_rate = pace_rate = zero_rate
    over_rows = deg_rows = jnp.int32(0)
    if name == "grpo":
        a_step = grpo.step_advantage(returns)
        step_label = jnp.full((n,), -1, jnp.int32)
        diag.update(diagnostics.empty_size_stats())
    elif name == "gigpo":
        a_step = gigpo.step_advantage(returns, hash_lab, include, n, norm)
        step_label = hash_lab
        diag.update(diagnostics.partition_stats(hash_lab, include, n))
    else:
        label, deg, over, m = clustering.cluster_rows(
            rows,
            batch.fingerprint,
            threshold,
            group_capacity=batch.group_capacity,
            row_capacity=batch.row_capacity,
            capacity=capacity,
            centroid=centroid,
            mesh=mesh,
            data_axis=data_axis,
        )
        step_label = label
        deg_rows = jnp.sum(deg, dtype=jnp.int32)
        over_rows = jnp.sum(over, dtype=jnp.int32)
        diag.update(diagnostics.partition_stats(label, include, m))
        if name == "bigpo":
            a_step = bigpo.step_advantage(returns, label, include, m, norm)
        else:
            module = bipace_q if name == "bipace_q" else bipace_diff
            a_step, loo, pace_rows = module.step_advantage(returns, label, rows.action_key, include, m)
            loo_rate = diagnostics.row_rate(loo, include)
            pace_rate = diagnostics.row_rate(pace_rows, include)
    diag.update(
        pace_row_rate=pace_rate,
        loo_row_rate=loo_rate,
        overflow_rows=over_rows,
        degenerate_rows=deg_rows,
        invalid_rows=rows.invalid_rows,
    )
    a = jnp.where(include, a_ep + jnp.asarray(omega, jnp.float32) * a_step, 0.0)
    adv = jnp.zeros((n,), jnp.float32).at[rows.perm].set(a)
    labels = jnp.zeros((n,), jnp.int32).at[rows.perm].set(jnp.where(include, step_label, -1))
    return adv, {k: diag[k] for k in diagnostics.DIAGNOSTIC_KEYS}, labels


@functools.cache
def _jitted(name, norm, centroid, capacity, mesh, data_axis):
    return jax.jit(
        functools.partial(
            _advantages, name=name, norm=norm, centroid=centroid, capacity=capacity, mesh=mesh, data_axis=data_axis
        )
    )


def _run(batch, cfg, mesh, data_axis):
    if not isinstance(batch, StepBatch):
        raise TypeError(f"compute_advantages: batch must be a StepBatch, got {type(batch).__name__}")
    if not isinstance(cfg, EstimatorConfig):
        raise TypeError(f"compute_advantages: cfg must be an EstimatorConfig, got {type(cfg).__name__}")
    if cfg.clusters and (batch.group_capacity is None or batch.row_capacity is None):
        raise ValueError(
            "StepBatch.group_capacity/row_capacity: required by the clustering estimator "
            f"{cfg.name!r}; build the batch with StepBatch.from_numpy or set them"
        )
    if mesh is not None and data_axis not in mesh.axis_names:
        raise ValueError(f"compute_advantages: mesh has no axis {data_axis!r} (axes {mesh.axis_names})")
    fn = _jitted(cfg.name, cfg.norm, cfg.centroid, cfg.capacity, mesh if cfg.clusters else None, data_axis)
    return fn(batch, jnp.float32(cfg.gamma), jnp.float32(cfg.omega), clustering.join_threshold(cfg.epsilon))


def step_group_labels(batch: StepBatch, cfg: EstimatorConfig, *, mesh=None, data_axis: str = "data"):
    """The step group of every row: int32[N] in batch order, -1 for padding, invalid rows and grpo.

    Two rows share a label iff they are in the same step group of `cfg` (the values themselves are
    arbitrary). Shares the compiled function of `compute_advantages` (same arguments, same raises).
    """
    return _run(batch, cfg, mesh, data_axis)[2]


def compute_advantages(batch: StepBatch, cfg: EstimatorConfig, *, mesh=None, data_axis: str = "data"):
    """Advantages of every row and the batch diagnostics, jitted (spec: estimators.md).

    A = A_ep + omega * A_step for valid real rows, 0 for padding and invalid rows. A_ep is GRPO over
    each task group's trajectories; A_step is the estimator's step level (`grpo`, `gigpo`, `bigpo`,
    `bipace_q`, `bipace_diff`; see each module). Pure and shape-stable: one compile per config
    (name, norm, centroid, capacity), batch shapes/dtypes and capacities, and mesh; gamma, omega and
    epsilon are traced. Results do not depend on the order of the rows.

    Args:
      batch: `StepBatch` with N rows; clustering estimators need its `group_capacity` and
        `row_capacity` (set by `StepBatch.from_numpy`).
      cfg: `EstimatorConfig`.
      mesh: optional `jax.sharding.Mesh`; the clustering layout's task-group axis is sharded over
        `data_axis` (whole task groups per device; same result as one device).
    Returns:
      (advantages float32[N] in batch order, diagnostics dict[str, scalar jax.Array] with the keys
      `diagnostics.DIAGNOSTIC_KEYS`).
    Raises:
      TypeError: when `batch` is not a StepBatch or `cfg` not an EstimatorConfig.
      ValueError: when a clustering estimator gets a batch without capacities, or `mesh` lacks
        `data_axis`.
    """
    adv, diag, _ = _run(batch, cfg, mesh, data_axis)
    return adv, diag
