"""BiPACE_diff, the diff-peer variant (`docs/estimators.md`, "Step level").

As BiPACE_Q (singleton 0, leave-one-out when every key of the cluster is equal), except the PACE
branch compares with the rows of the cluster that took a different action:
  A_step = R_i - mean_{j in C, x_j != x_i} R_j.
step_norm="std" (under norm="mean_std") divides it by the cluster's std; pace_fallback="singleton_pool"
takes leave-one-out for a row with no different-key peer, which selects the same rows as the
default rule ("Protocol options", `pace.py`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bipace_jax.estimators import pace
from bipace_jax.estimators.base import CLUSTER, EstimatorSpec, StepInputs, StepOutput


def _diff_peers(returns, t: pace.PaceTerms):
    others = jnp.maximum(t.n_c - t.n_k, 1).astype(jnp.float32)
    return returns - (t.sum_c - t.sum_k) / others


def _diff_peers_reference(returns, keys, i, dtype):
    other = [r for r, k in zip(returns, keys) if k != keys[i]]
    return returns[i] - np.mean(other, dtype=dtype)


def _pool_empty(t: pace.PaceTerms):
    return t.n_c - t.n_k <= 0  # no row of C has another key


def _pool_empty_reference(keys, i):
    return all(k == keys[i] for k in keys)


def step_advantage(inputs: StepInputs) -> StepOutput:
    """A_step with the leave-one-out and PACE rows (honours step_norm and pace_fallback)."""
    return pace.step_advantage(inputs, _diff_peers, _pool_empty)


def reference_step(returns, keys, norm, dtype, **options) -> StepOutput:
    """NumPy twin for one cluster; `options`: step_norm, pace_fallback."""
    return pace.reference_step(returns, keys, norm, dtype, _diff_peers_reference, _pool_empty_reference, **options)


SPEC = EstimatorSpec(
    "bipace_diff", CLUSTER, step_advantage, reference_step, uses_action_keys=True, uses_pace_options=True
)
