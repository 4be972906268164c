"""BiPACE_Q (the paper's default): Q - V inside a cluster (`docs/estimators.md`, "Step level").

Clusters C from BiGPO; for row i with key x_i: |C| = 1 -> 0; all keys of C equal -> leave-one-out
`R_i - mean_{j in C, j != i} R_j`; otherwise
  A_step = Q - V,  Q = mean_{j in C, x_j = x_i} R_j (i included),  V = mean_{j in C} R_j.
No std normalisation at the step level.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bipace_jax.estimators import pace
from bipace_jax.estimators.base import CLUSTER, EstimatorSpec, StepInputs, StepOutput


def _q_minus_v(returns, t: pace.PaceTerms):
    del returns
    q = t.sum_k / jnp.maximum(t.n_k, 1).astype(jnp.float32)
    return q - t.sum_c / jnp.maximum(t.n_c, 1).astype(jnp.float32)


def _q_minus_v_reference(returns, keys, i, dtype):
    same = [r for r, k in zip(returns, keys) if k == keys[i]]
    return np.mean(same, dtype=dtype) - np.mean(returns, dtype=dtype)


def step_advantage(inputs: StepInputs) -> StepOutput:
    """A_step with the leave-one-out and PACE rows."""
    return pace.step_advantage(inputs, _q_minus_v)


def reference_step(returns, keys, norm, dtype) -> StepOutput:
    """NumPy twin for one cluster."""
    del norm
    return pace.reference_step(returns, keys, dtype, _q_minus_v_reference)


SPEC = EstimatorSpec("bipace_q", CLUSTER, step_advantage, reference_step, uses_action_keys=True)
