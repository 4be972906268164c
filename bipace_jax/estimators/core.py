"""`compute_advantages`: the jitted entry point (`docs/estimators.md`, all sections).

The estimator's `registry.EstimatorSpec` chooses the step grouping and the step level; everything
else (canonical order, returns, episode level, diagnostics) is shared. One compiled function per
(estimator, norm, centroid, capacity, protocol options, the estimator's own options, batch shapes
and capacities, whether the batch has a penalty, mesh); gamma, omega and epsilon are traced scalars, so tuning them (e.g. `EpsilonController`) never recompiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bipace_jax.estimators import clustering, diagnostics, registry
from bipace_jax.estimators.batch import StepBatch
from bipace_jax.estimators.config import EstimatorConfig
from bipace_jax.estimators.episodes import (
    canonical_rows,
    discounted_returns,
    episode_advantage,
    hash_labels,
    trajectory_steps,
)

#: ``step_details`` row kinds: a valid row whose step term took neither PACE branch, the leave-one-out
#: fallback, the PACE value; -1 marks padding and invalid rows.
OTHER_ROW, LOO_ROW, PACE_ROW = 0, 1, 2


def _advantages(
    batch: StepBatch,
    gamma,
    omega,
    threshold,
    *,
    spec: registry.EstimatorSpec,
    norm: str,
    centroid: str,
    capacity: int | None,
    protocol: tuple[str, str, str, str],
    options: tuple,
    mesh,
    data_axis: str,
):
    penalty, episode_stats, step_norm, pace_fallback = protocol
    caps = (batch.group_capacity, batch.row_capacity) if spec.clusters else (None, None)
    rows = canonical_rows(batch, *caps)
    n = rows.reward.shape[0]
    include = rows.valid
    returns = discounted_returns(rows, gamma, penalty)
    a_ep = episode_advantage(rows, norm, penalty, episode_stats)
    hash_lab = hash_labels(rows)
    diag = diagnostics.partition_stats(hash_lab, include, n, prefix="hash_")
    over_rows = deg_rows = jnp.int32(0)
    if spec.grouping == registry.NO_GROUPS:
        step_label, num_segments = jnp.full((n,), -1, jnp.int32), n
        diag.update(diagnostics.empty_size_stats())
    elif spec.grouping == registry.OBS_HASH:
        step_label, num_segments = hash_lab, n
        diag.update(diagnostics.partition_stats(hash_lab, include, n))
    else:
        step_label, deg, over, num_segments = clustering.cluster_rows(
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
        deg_rows = jnp.sum(deg, dtype=jnp.int32)
        over_rows = jnp.sum(over, dtype=jnp.int32)
        diag.update(diagnostics.partition_stats(step_label, include, num_segments))
    action_key = rows.action_key if spec.uses_action_keys else None
    out = spec.step_advantage(
        registry.StepInputs(
            returns,
            step_label,
            action_key,
            include,
            num_segments,
            norm,
            step_norm,
            pace_fallback,
            step=trajectory_steps(rows),
            episode_advantage=a_ep,
            options=options,
        )
    )
    zero_rate = jnp.float32(0.0)
    diag.update(
        pace_row_rate=zero_rate if out.pace_rows is None else diagnostics.row_rate(out.pace_rows, include),
        loo_row_rate=zero_rate if out.loo_rows is None else diagnostics.row_rate(out.loo_rows, include),
        overflow_rows=over_rows,
        degenerate_rows=deg_rows,
        invalid_rows=rows.invalid_rows,
    )
    if spec.owns_episode_level:
        a = jnp.where(include, out.advantage, 0.0)
    else:
        a = jnp.where(include, a_ep + jnp.asarray(omega, jnp.float32) * out.advantage, 0.0)
    adv = jnp.zeros((n,), jnp.float32).at[rows.perm].set(a)
    labels = jnp.zeros((n,), jnp.int32).at[rows.perm].set(jnp.where(include, step_label, -1))
    kind = jnp.zeros((n,), jnp.int32)
    for flagged, value in ((out.loo_rows, LOO_ROW), (out.pace_rows, PACE_ROW)):
        kind = kind if flagged is None else jnp.where(flagged, value, kind)
    kinds = jnp.zeros((n,), jnp.int32).at[rows.perm].set(jnp.where(include, kind, -1))
    return adv, {k: diag[k] for k in diagnostics.DIAGNOSTIC_KEYS}, labels, kinds


@functools.cache
def _jitted(spec, norm, centroid, capacity, protocol, options, mesh, data_axis):
    # Keyed by the spec itself, so re-registering a name never reuses a stale compiled function.
    static = dict(
        spec=spec, norm=norm, centroid=centroid, capacity=capacity, protocol=protocol, options=options, mesh=mesh
    )
    return jax.jit(functools.partial(_advantages, data_axis=data_axis, **static))


def _protocol(cfg: EstimatorConfig) -> tuple[str, str, str, str]:
    """The protocol options as a static key; options a step level ignores are normalised to their
    defaults so they do not compile a second, identical function."""
    step_norm, pace_fallback = cfg.step_norm, cfg.pace_fallback
    if not cfg.spec.uses_pace_options:
        step_norm, pace_fallback = "none", "same_key_cluster"
    return (cfg.penalty, cfg.episode_stats, step_norm, pace_fallback)


def jitted_advantages(cfg: EstimatorConfig, *, mesh=None, data_axis: str = "data"):
    """(jitted fn, its traced scalar arguments) behind `compute_advantages(batch, cfg)`.

    `fn(batch, *scalars)` returns (advantages, diagnostics, step-group labels, row kinds as in
    `step_details`); for benchmarks that lower and compile it themselves.
    """
    spec = registry.get(cfg.name)
    options = tuple((field, getattr(cfg, field)) for field in spec.options)
    mesh = mesh if spec.clusters else None
    fn = _jitted(spec, cfg.norm, cfg.centroid, cfg.capacity, _protocol(cfg), options, mesh, data_axis)
    return fn, (jnp.float32(cfg.gamma), jnp.float32(cfg.omega), clustering.join_threshold(cfg.epsilon))


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
    fn, scalars = jitted_advantages(cfg, mesh=mesh, data_axis=data_axis)
    return fn(batch, *scalars)


def step_group_labels(batch: StepBatch, cfg: EstimatorConfig, *, mesh=None, data_axis: str = "data"):
    """The step group of every row: int32[N] in batch order, -1 for padding, invalid rows and grpo.

    Two rows share a label iff they are in the same step group of `cfg` (the values themselves are
    arbitrary). Shares the compiled function of `compute_advantages` (same arguments, same raises).
    """
    return _run(batch, cfg, mesh, data_axis)[2]


def step_details(batch: StepBatch, cfg: EstimatorConfig, *, mesh=None, data_axis: str = "data"):
    """(step-group labels int32[N] as in `step_group_labels`, row kinds int32[N]) in batch order.

    A row's kind says which step-level branch set its A_step: `PACE_ROW` (bipace_q/bipace_diff's PACE
    value), `LOO_ROW` (their leave-one-out fallback), `OTHER_ROW` (any other valid row: a singleton,
    a plain group baseline, or grpo's none), -1 for padding and invalid rows. Shares the compiled
    function of `compute_advantages` (same arguments, same raises).
    """
    _, _, labels, kinds = _run(batch, cfg, mesh, data_axis)
    return labels, kinds


def compute_advantages(batch: StepBatch, cfg: EstimatorConfig, *, mesh=None, data_axis: str = "data"):
    """Advantages of every row and the batch diagnostics, jitted (`docs/estimators.md`).

    A = A_ep + omega * A_step for valid real rows, 0 for padding and invalid rows: A_ep is GRPO over
    each task group's trajectories, A_step the step level of the registered estimator `cfg.name`
    (a spec with `owns_episode_level`, e.g. hgpo, returns the whole advantage: A = A_step). One
    compile per config (name, norm, centroid, capacity, protocol options), batch shapes/dtypes/capacities
    and mesh (gamma, omega and epsilon are traced); results do not depend on the row order.

    Args:
      batch: `StepBatch` with N rows (clustering estimators need its capacities, see `from_numpy`).
      cfg: `EstimatorConfig`.
      mesh: optional `jax.sharding.Mesh`; the clustering layout's task groups are sharded over
        `data_axis` (same result as one device).
    Returns:
      (advantages float32[N] in batch order, diagnostics dict[str, scalar jax.Array] with the keys
      `diagnostics.DIAGNOSTIC_KEYS`).
    Raises:
      TypeError: when `batch` is not a StepBatch or `cfg` not an EstimatorConfig.
      ValueError: when a clustering estimator gets a batch without capacities, or `mesh` lacks
        `data_axis`.
    """
    adv, diag, _, _ = _run(batch, cfg, mesh, data_axis)
    return adv, diag
