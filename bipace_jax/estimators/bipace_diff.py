"""BiPACE_diff (diff-peer variant) (spec: estimators.md, "Step level").

As BiPACE_Q (singleton 0, leave-one-out when every key of the cluster is equal), except the PACE
branch compares with the rows of the cluster that took a different action:
  A_step = R_i - mean_{j in C, x_j != x_i} R_j.
"""

from __future__ import annotations

import jax.numpy as jnp

from bipace_jax.estimators import pace


def _diff_peers(returns, t: pace.PaceTerms):
    others = jnp.maximum(t.n_c - t.n_k, 1).astype(jnp.float32)
    return returns - (t.sum_c - t.sum_k) / others


def step_advantage(returns, cluster_labels, action_key, include, num_segments: int):
    """Returns (A_step float32[N], loo rows bool[N], pace rows bool[N])."""
    terms = pace.pace_terms(returns, cluster_labels, action_key, include, num_segments)
    return pace.combine(returns, terms, include, _diff_peers)
