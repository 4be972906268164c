"""PACE: action-conditioned baselines inside a cluster, shared by BiPACE_Q and BiPACE_diff.

`docs/estimators.md`, "Step level" (`bipace_q`, `bipace_diff`), "PACE keys" and "Protocol options".
For row i in cluster C with key x_i: |C| = 1 -> singleton (0); then the fallback rule decides
between leave-one-out `R_i - mean_{j in C, j != i} R_j` (a LOO row) and the estimator's PACE branch
(a PACE row):
  pace_fallback="same_key_cluster" (default): leave-one-out when every row of C has the same key;
  pace_fallback="singleton_pool": leave-one-out when row i's own PACE pool is empty (the estimator's
    `pool_empty`: for bipace_q no other row with key x_i, for bipace_diff no row with another key).
A negative key is unparsable and matches no other row (each such row is its own key), so a cluster
of only unparsable rows has distinct keys. With step_norm="std" under norm="mean_std", the step term
of every row of a multi-row cluster is divided by the cluster's unbiased std of R + 1e-6, and a
cluster whose returns are all-equal (the span rule) gives 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bipace_jax.estimators import reference
from bipace_jax.estimators.base import StepInputs, StepOutput
from bipace_jax.estimators.episodes import STD_EPS, group_stats


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


def combine(returns, terms: PaceTerms, include, pace_branch, fallback):
    """Singleton / leave-one-out / PACE dispatch; returns (A_step, loo rows, pace rows), all [N].

    `pace_branch(returns, terms)` gives the estimator's value; `fallback` (bool [N]) marks the rows
    of multi-row clusters that take leave-one-out instead.
    """
    single = terms.n_c <= 1
    fc = terms.n_c.astype(jnp.float32)
    loo = returns - (terms.sum_c - returns) / jnp.maximum(fc - 1.0, 1.0)
    a = jnp.where(single, 0.0, jnp.where(fallback, loo, pace_branch(returns, terms)))
    return (jnp.where(include, a, 0.0), include & ~single & fallback, include & ~single & ~fallback)


def step_advantage(inputs: StepInputs, pace_branch, pool_empty) -> StepOutput:
    """The jitted PACE step level with the estimator's `pace_branch(returns, terms)` and, for
    pace_fallback="singleton_pool", its `pool_empty(terms)` (bool [N])."""
    terms = pace_terms(inputs.returns, inputs.labels, inputs.action_key, inputs.include, inputs.num_segments)
    fallback = pool_empty(terms) if inputs.pace_fallback == "singleton_pool" else terms.distinct <= 1
    a, loo_rows, pace_rows = combine(inputs.returns, terms, inputs.include, pace_branch, fallback)
    if inputs.step_norm == "std" and inputs.norm == "mean_std":
        st = group_stats(inputs.returns, inputs.labels, inputs.include, inputs.num_segments)
        lab = jnp.clip(inputs.labels, 0, inputs.num_segments - 1)
        # Singletons are already 0; an all-equal cluster's terms are float noise, which std + 1e-6 would blow up.
        a = jnp.where(inputs.include & ~st.all_equal[lab], a / (st.std[lab] + STD_EPS), 0.0)
    return StepOutput(a, loo_rows, pace_rows)


def reference_step(
    returns, keys, norm, dtype, pace_branch, pool_empty, *, step_norm="none", pace_fallback="same_key_cluster"
) -> StepOutput:
    """NumPy twin for one cluster: `pace_branch(returns, keys, i, dtype)` gives row i's PACE value,
    `pool_empty(keys, i)` whether row i's PACE pool is empty (read under "singleton_pool")."""
    n = len(returns)
    out = np.zeros(n, dtype)
    loo, pace = np.zeros(n, bool), np.zeros(n, bool)
    if n == 1:
        return StepOutput(out, loo, pace)
    for i in range(n):
        if pace_fallback == "singleton_pool":
            loo[i] = pool_empty(keys, i)
        else:
            loo[i] = len(set(keys)) == 1
        pace[i] = not loo[i]
        if loo[i]:
            others = [r for j, r in enumerate(returns) if j != i]
            out[i] = dtype(returns[i] - np.mean(others, dtype=dtype))
        else:
            out[i] = dtype(pace_branch(returns, keys, i, dtype))
    if step_norm == "std" and norm == "mean_std":
        v = np.asarray(returns, dtype)
        if reference.all_equal(v):
            out[:] = 0
        else:
            out = (out / (v.std(ddof=1, dtype=dtype) + dtype(reference.STD_EPS))).astype(dtype)
    return StepOutput(out, loo, pace)
