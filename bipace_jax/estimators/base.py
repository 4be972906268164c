"""What an estimator is: `EstimatorSpec` and the `StepInputs` -> `StepOutput` step-level interface.

Estimator modules build their `SPEC` from these; `registry` lists the specs by name (and re-exports
everything here). Contract: `docs/estimators.md`, sections "Step level" and "Registry".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

NO_GROUPS = "none"
"""No step level: no step groups, `A_step = 0` (grpo)."""
OBS_HASH = "obs_hash"
"""Step groups are the rows with equal `(group_id, obs_hash)` (gigpo)."""
CLUSTER = "cluster"
"""Step groups are greedy cosine clusters of the fingerprints per task group (bigpo, bipace_*)."""
GROUPINGS = (NO_GROUPS, OBS_HASH, CLUSTER)


class StepInputs(NamedTuple):
    """What the jitted step level sees; every array is [N] in canonical row order.

    returns: float32 discounted step returns (0 on rows that are not `include`).
    labels: int32 step group of each row, in [0, num_segments); -1 everywhere for `NO_GROUPS`.
    action_key: int32 PACE key ids (negative = unparsable), or None unless the spec sets
      `uses_action_keys`.
    include: bool, the valid real rows.
    num_segments: static number of label slots.
    norm: static "mean_std" or "mean" (`EstimatorConfig.norm`).
    step_norm, pace_fallback: static `EstimatorConfig.step_norm` / `pace_fallback` ("Protocol
      options"); only step levels whose spec sets `uses_pace_options` read them.
    step: int32 position of each row in its trajectory (0 for the first step); the rows of one
      trajectory are consecutive in canonical order, so row i - 1 is step `step[i] - 1` of the same
      trajectory whenever `step[i] > 0`.
    episode_advantage: float32 A_ep of each row (0 where not `include`), the episode level as
      configured (`norm`, `penalty`, `episode_stats`).
    options: static `((field, value), ...)` of the `EstimatorConfig` fields named by the spec's
      `options`, in that order; () for a spec without options.
    """

    returns: Any
    labels: Any
    action_key: Any
    include: Any
    num_segments: int
    norm: str
    step_norm: str = "none"
    pace_fallback: str = "same_key_cluster"
    step: Any = None
    episode_advantage: Any = None
    options: tuple = ()


class StepOutput(NamedTuple):
    """A step level's result, jitted (jax arrays [N]) or reference (numpy arrays, one step group).

    advantage: float32 A_step per row (0 where not `include`).
    loo_rows, pace_rows: bool rows that took the leave-one-out / PACE branch (the `loo_row_rate`
      and `pace_row_rate` diagnostics), or None for an estimator without those branches (rates 0).
    """

    advantage: Any
    loo_rows: Any = None
    pace_rows: Any = None


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator.

    Attributes:
      name: the `EstimatorConfig.name` that selects it.
      grouping: one of `GROUPINGS`: how rows are partitioned into step groups.
      step_advantage: jittable `fn(StepInputs) -> StepOutput` (jax arrays), the step level over the
        whole batch; traced once per compiled configuration.
      reference_step: `fn(returns, keys, norm, dtype) -> StepOutput` (numpy arrays), the plain NumPy
        step level of ONE step group: `returns` a list of `dtype` scalars in canonical order,
        `keys` the members' PACE keys (hashable; each unparsable key already unique to its row) or
        None unless `uses_action_keys`. Only called for estimators with step groups.
      uses_action_keys: the step level reads `StepBatch.action_key`; otherwise it is not passed.
      uses_pace_options: the step level honours `EstimatorConfig.step_norm` and `pace_fallback`
        (`StepInputs` always carries them; `reference_step` then also receives them as the keyword
        arguments `step_norm=` and `pace_fallback=`); otherwise both options are ignored.
      options: names of further `EstimatorConfig` fields the step level reads (e.g. hgpo's
        `hgpo_history`); they reach `StepInputs.options` (static: each value compiles once) and
        `reference_rows` as keyword arguments.
      owns_episode_level: the step level returns each row's whole advantage from
        `StepInputs.episode_advantage` and its own terms: A = A_step, `omega` is not applied.
      reference_rows: None, or the NumPy twin of a step level that looks across the rows of a
        trajectory (`reference_step` only sees one step group): `fn(task_groups, norm, dtype,
        **options) -> list`, `task_groups` a list (one per task group) of lists (one per trajectory,
        ascending traj_id) of lists (one per step, ascending) of `(obs_hash, R, A_ep)` in `dtype`;
        returns A_step with the same nesting. When set, the oracle calls it instead of `reference_step`.
    """

    name: str
    grouping: str
    step_advantage: Callable[[StepInputs], StepOutput]
    reference_step: Callable[..., StepOutput]
    uses_action_keys: bool = False
    uses_pace_options: bool = False
    options: tuple[str, ...] = ()
    owns_episode_level: bool = False
    reference_rows: Callable[..., list] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"EstimatorSpec.name: expected a Python identifier string, got {self.name!r}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"EstimatorSpec.grouping: expected one of {GROUPINGS}, got {self.grouping!r}")
        for field in ("step_advantage", "reference_step"):
            if not callable(getattr(self, field)):
                raise ValueError(f"EstimatorSpec.{field}: expected a callable, got {getattr(self, field)!r}")
        if self.reference_rows is not None and not callable(self.reference_rows):
            raise ValueError(f"EstimatorSpec.reference_rows: expected None or a callable, got {self.reference_rows!r}")
        if not isinstance(self.options, tuple) or not all(isinstance(f, str) for f in self.options):
            raise ValueError(f"EstimatorSpec.options: expected a tuple of field names, got {self.options!r}")
        for field in ("uses_action_keys", "uses_pace_options", "owns_episode_level"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"EstimatorSpec.{field}: expected a bool, got {getattr(self, field)!r}")

    @property
    def clusters(self) -> bool:
        """True when the step groups are fingerprint clusters (the batch needs its capacities)."""
        return self.grouping == CLUSTER
