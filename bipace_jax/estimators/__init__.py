"""Advantage estimators: GRPO, GiGPO, BiGPO, BiPACE_Q, BiPACE_diff, HGPO (contract: `docs/estimators.md`).

    from bipace_jax.estimators import StepBatch, EstimatorConfig, compute_advantages, assign_ids
    batch = StepBatch.from_numpy(group_id=..., traj_id=..., step=..., reward=..., obs_hash=...,
                                 fingerprint=..., action_key=..., mask=...)
    adv, diag = compute_advantages(batch, EstimatorConfig(name="bipace_q"))

`registry` holds the estimators by name (`registry.names()`, `registry.register(spec)`);
`reference.compute_advantages_reference` is the plain NumPy oracle of the same contract;
`similarity_groups` is verl-agent's text-similarity `obs_hash` (`EstimatorConfig.similarity_thresh`).
"""

from bipace_jax.estimators import registry
from bipace_jax.estimators.batch import StepBatch, assign_ids
from bipace_jax.estimators.config import ActionKey, EstimatorConfig
from bipace_jax.estimators.core import compute_advantages, step_details, step_group_labels
from bipace_jax.estimators.diagnostics import DIAGNOSTIC_KEYS
from bipace_jax.estimators.epsilon import EpsilonController, calibrate_epsilon
from bipace_jax.estimators.registry import EstimatorSpec
from bipace_jax.estimators.similarity import similarity_groups

__all__ = [
    "ActionKey",
    "DIAGNOSTIC_KEYS",
    "EpsilonController",
    "EstimatorConfig",
    "EstimatorSpec",
    "StepBatch",
    "assign_ids",
    "calibrate_epsilon",
    "compute_advantages",
    "registry",
    "similarity_groups",
    "step_details",
    "step_group_labels",
]
