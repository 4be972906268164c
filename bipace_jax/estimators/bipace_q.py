"""BiPACE_Q (the paper's default): Q - V inside a cluster (`docs/estimators.md`, "Step level").

Clusters C from BiGPO; for row i with key x_i: |C| = 1 -> 0; all keys of C equal -> leave-one-out
`R_i - mean_{j in C, j != i} R_j`; otherwise
  A_step = Q - V,  Q = mean_{j in C, x_j = x_i} R_j (i included),  V = mean_{j in C} R_j.
No std normalisation at the step level unless step_norm="std" (under norm="mean_std");
pace_fallback="singleton_pool" takes leave-one-out for a row whose key no other row of C shares
("Protocol options", `pace.py`).
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


def _pool_empty(t: pace.PaceTerms):
    return t.n_k <= 1  # no other row of C shares x_i


def _pool_empty_reference(keys, i):
    return sum(1 for k in keys if k == keys[i]) == 1


def step_advantage(inputs: StepInputs) -> StepOutput:
    """A_step with the leave-one-out and PACE rows (honours step_norm and pace_fallback)."""
    return pace.step_advantage(inputs, _q_minus_v, _pool_empty)


def reference_step(returns, keys, norm, dtype, **options) -> StepOutput:
    """NumPy twin for one cluster; `options`: step_norm, pace_fallback."""
    return pace.reference_step(returns, keys, norm, dtype, _q_minus_v_reference, _pool_empty_reference, **options)


SPEC = EstimatorSpec("bipace_q", CLUSTER, step_advantage, reference_step, uses_action_keys=True, uses_pace_options=True)
