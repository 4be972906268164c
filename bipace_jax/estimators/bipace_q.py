"""BiPACE_Q (the paper's default): Q - V inside a cluster (spec: estimators.md, "Step level").

Clusters C from BiGPO; for row i with key x_i: |C| = 1 -> 0; all keys of C equal -> leave-one-out
`R_i - mean_{j in C, j != i} R_j`; otherwise
  A_step = Q - V,  Q = mean_{j in C, x_j = x_i} R_j (i included),  V = mean_{j in C} R_j.
No std normalisation at the step level.
"""

from __future__ import annotations

import jax.numpy as jnp

from bipace_jax.estimators import pace


def _q_minus_v(returns, t: pace.PaceTerms):
    del returns
    return t.sum_k / jnp.maximum(t.n_k, 1).astype(jnp.float32) - t.sum_c / jnp.maximum(t.n_c, 1).astype(jnp.float32)


def step_advantage(returns, cluster_labels, action_key, include, num_segments: int):
    """Returns (A_step float32[N], loo rows bool[N], pace rows bool[N])."""
    terms = pace.pace_terms(returns, cluster_labels, action_key, include, num_segments)
    return pace.combine(returns, terms, include, _q_minus_v)
