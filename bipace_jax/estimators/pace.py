"""PACE: action-conditioned baselines inside a cluster, shared by BiPACE_Q and BiPACE_diff.

`docs/estimators.md`, "Step level" (`bipace_q`, `bipace_diff`) and "PACE keys". For row i in cluster C with key x_i:
|C| = 1 -> singleton (0); every row of C has the same key -> leave-one-out
`R_i - mean_{j in C, j != i} R_j`; otherwise the PACE branch (estimator specific). A negative key
is unparsable and matches no other row (each such row is its own key), so a cluster of only
unparsable rows has distinct keys and takes the PACE branch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bipace_jax.estimators.base import StepInputs, StepOutput


class PaceTerms(NamedTuple):
    """Per-row sums (all [N]): cluster size/sum, same-key size/sum, distinct keys in the cluster."""

    n_c: jax.Array
    sum_c: jax.Array
    n_k: jax.Array
    sum_k: jax.Array
    distinct: jax.Array


def pace_terms(returns, labels, action_key, include, num_segments: int) -> PaceTerms:
    """Segment sums over clusters `labels` and over (cluster, key) sub-groups of the rows `include`."""
    n = returns.shape[0]
    k = jnp.arange(n, dtype=jnp.int32)
    neg = action_key < 0
    key = jnp.where(neg, k, action_key)  # an unparsable key is unique to its row
    _, lab, ng, ky, idx = lax.sort(
        ((~include).astype(jnp.int32), labels, neg.astype(jnp.int32), key, k), num_keys=4, is_stable=True
    )
    new = (k == 0) | (lab != jnp.roll(lab, 1)) | (ng != jnp.roll(ng, 1)) | (ky != jnp.roll(ky, 1))
    sub = jnp.zeros((n,), jnp.int32).at[idx].set(jnp.cumsum(new, dtype=jnp.int32) - 1)
    first_of_key = jnp.zeros((n,), bool).at[idx].set(new) & include
    seg_c = jnp.where(include, labels, num_segments)
    seg_k = jnp.where(include, sub, n)
    r = jnp.where(include, returns, 0.0)
    one = include.astype(jnp.int32)
    lab_c = jnp.clip(labels, 0, num_segments - 1)
    n_c = jax.ops.segment_sum(one, seg_c, num_segments)[lab_c]
    sum_c = jax.ops.segment_sum(r, seg_c, num_segments)[lab_c]
    distinct = jax.ops.segment_sum(first_of_key.astype(jnp.int32), seg_c, num_segments)[lab_c]
    n_k = jax.ops.segment_sum(one, seg_k, n)[sub]
    sum_k = jax.ops.segment_sum(r, seg_k, n)[sub]
    return PaceTerms(n_c, sum_c, n_k, sum_k, distinct)


def combine(returns, terms: PaceTerms, include, pace_branch):
    """Singleton / leave-one-out / PACE dispatch; returns (A_step, loo rows, pace rows), all [N].

    `pace_branch(returns, terms)` gives the estimator's value where C has more than one key.
    """
    single = terms.n_c <= 1
    same_key = terms.distinct <= 1
    fc = terms.n_c.astype(jnp.float32)
    loo = returns - (terms.sum_c - returns) / jnp.maximum(fc - 1.0, 1.0)
    a = jnp.where(single, 0.0, jnp.where(same_key, loo, pace_branch(returns, terms)))
    return (jnp.where(include, a, 0.0), include & ~single & same_key, include & ~single & ~same_key)


def step_advantage(inputs: StepInputs, pace_branch) -> StepOutput:
    """The jitted PACE step level with the estimator's `pace_branch(returns, terms)`."""
    terms = pace_terms(inputs.returns, inputs.labels, inputs.action_key, inputs.include, inputs.num_segments)
    return StepOutput(*combine(inputs.returns, terms, inputs.include, pace_branch))


def reference_step(returns, keys, dtype, pace_branch) -> StepOutput:
    """NumPy twin for one cluster: `pace_branch(returns, keys, i, dtype)` gives row i's PACE value."""
    n = len(returns)
    out = np.zeros(n, dtype)
    loo, pace = np.zeros(n, bool), np.zeros(n, bool)
    if n == 1:
        return StepOutput(out, loo, pace)
    if len(set(keys)) == 1:
        loo[:] = True
        for i in range(n):
            others = [r for j, r in enumerate(returns) if j != i]
            out[i] = dtype(returns[i] - np.mean(others, dtype=dtype))
        return StepOutput(out, loo, pace)
    pace[:] = True
    for i in range(n):
        out[i] = dtype(pace_branch(returns, keys, i, dtype))
    return StepOutput(out, loo, pace)
