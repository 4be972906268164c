"""HGPO: hierarchy-of-groups step advantages (`docs/estimators.md`, "HGPO").

He, Feng, Wei, Cheng, Feng, An, "Hierarchy-of-Groups Policy Optimization for Long-Horizon Agentic
Tasks", ICLR 2026; the formulas are those of verl-agent's `recipe/hgpo/core_hgpo.py` at 796ed31
(`hgpo_advantage_estimate`, `aggregate_items`), held to recorded outputs of that code in
`tests/test_estimators_hgpo.py`.

Row i is step t of its trajectory, whose anchor observations (`obs_hash`) are o_0 .. o_t. For each
level k = 1 .. min(H + 1, t + 1), H = `EstimatorConfig.hgpo_history`, its level-k group S_k(i) is
the rows j of the same task group whose last k observations equal i's: (o_{t_j-k+1} .. o_{t_j}) =
(o_{t-k+1} .. o_t) (level 1 is GiGPO's step group). With R the discounted step returns:

  a_k(i) = (R_i - mean_S R) / (std_S R + 1e-6)   norm="mean_std", std over S with ddof 0
  a_k(i) =  R_i - mean_S R                        norm="mean"

A level gives row i an item (k, a_k(i)) when |S_k(i)| >= 2 and a_k(i) is not zero; here zero means
S's returns are all-equal or R_i equals mean_S R, both up to the span rule's tolerance
1e-5 * max(1, max_S |R|) (verl-agent drops items whose float32 value is exactly 0). With
`hgpo_base_group`, the episode advantage A_ep (as configured: `norm`, `penalty`, `episode_stats`)
is an extra item (0, A_ep) when A_ep != 0. The row's advantage is the whole advantage (no A_ep +
omega * A_step; `omega` is not read):

  A_i = sum_items w_k a_k / (sum_items w_k + 1e-6),  w_k = (k + 1) ** alpha   (0 without items)

alpha = `EstimatorConfig.hgpo_alpha`. The reported step groups (diagnostics, `step_group_labels`)
are the level-1 groups.
"""

from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bipace_jax.estimators import reference
from bipace_jax.estimators.base import OBS_HASH, EstimatorSpec, StepInputs, StepOutput
from bipace_jax.estimators.episodes import EQUAL_RTOL, STD_EPS

OPTIONS = ("hgpo_history", "hgpo_alpha", "hgpo_base_group")
"""The `EstimatorConfig` fields HGPO reads (history levels H, length-weight exponent, base item)."""


def _extend_labels(prev, obs, valid):
    """Dense ids of the pairs (prev, obs) over the rows `valid`; -1 elsewhere. int32[N]."""
    n = obs.shape[0]
    k = jnp.arange(n, dtype=jnp.int32)
    _, p, o, idx = lax.sort(((~valid).astype(jnp.int32), prev, obs, k), num_keys=3, is_stable=True)
    first = (k == 0) | (p != jnp.roll(p, 1)) | (o != jnp.roll(o, 1))
    dense = jnp.zeros((n,), jnp.int32).at[idx].set(jnp.cumsum(first, dtype=jnp.int32) - 1)
    return jnp.where(valid, dense, -1)


def _level_advantage(returns, labels, valid, norm: str):
    """a_k of every row of one level (0 where no item: singleton, all-equal group, or R_i at the mean)."""
    n = returns.shape[0]
    ids = jnp.where(valid, labels, n)
    lab = jnp.clip(labels, 0, n - 1)
    cnt = jax.ops.segment_sum(valid.astype(jnp.int32), ids, n)
    tot = jax.ops.segment_sum(jnp.where(valid, returns, 0.0), ids, n)
    mean = tot / jnp.maximum(cnt, 1).astype(jnp.float32)
    dev = jnp.where(valid, returns - mean[lab], 0.0)
    std = jnp.sqrt(jax.ops.segment_sum(dev * dev, ids, n) / jnp.maximum(cnt, 1).astype(jnp.float32))
    hi = jax.ops.segment_max(jnp.where(valid, returns, -jnp.inf), ids, n)
    lo = jax.ops.segment_min(jnp.where(valid, returns, jnp.inf), ids, n)
    tol = EQUAL_RTOL * jnp.maximum(1.0, jnp.maximum(jnp.abs(hi), jnp.abs(lo)))
    spread = (cnt > 1) & (hi - lo > tol)
    keep = valid & spread[lab] & (jnp.abs(dev) > tol[lab])
    a = dev / (std[lab] + STD_EPS) if norm == "mean_std" else dev
    return jnp.where(keep, a, 0.0), keep


def step_advantage(inputs: StepInputs) -> StepOutput:
    """The whole HGPO advantage of every row (the formula above); float32[N], 0 where not `include`."""
    opts = dict(inputs.options)
    include = inputs.include
    num = jnp.zeros_like(inputs.returns)
    den = jnp.zeros_like(inputs.returns)
    if opts["hgpo_base_group"]:
        base = include & (inputs.episode_advantage != 0)
        num = jnp.where(base, inputs.episode_advantage, 0.0)  # weight (0 + 1) ** alpha = 1
        den = base.astype(jnp.float32)
    obs = jnp.where(include, inputs.labels, -1)  # level-1 labels: (task group, anchor observation)
    key, valid = obs, include
    for k in range(1, opts["hgpo_history"] + 2):
        if k > 1:
            valid = include & (inputs.step >= k - 1)
            # Last k observations = (last k - 1 observations of the previous row, this row's).
            key = _extend_labels(jnp.roll(key, 1), obs, valid)
        a, keep = _level_advantage(inputs.returns, key, valid, inputs.norm)
        w = jnp.float32(float(k + 1) ** float(opts["hgpo_alpha"]))
        num = num + jnp.where(keep, w * a, 0.0)
        den = den + jnp.where(keep, w, 0.0)
    return StepOutput(jnp.where(include & (den > 0), num / (den + STD_EPS), 0.0))


def reference_step(returns, keys, norm, dtype) -> StepOutput:
    """NumPy twin of one level group: a_k of each member (0 where the member has no item)."""
    del keys
    v = np.asarray(returns, dtype)
    out = np.zeros(len(v), dtype)
    if len(v) < 2 or reference.all_equal(v):
        return StepOutput(out)
    dev = v - v.mean(dtype=dtype)
    a = dev / (v.std(ddof=0, dtype=dtype) + dtype(STD_EPS)) if norm == "mean_std" else dev
    tie = np.abs(dev) <= EQUAL_RTOL * max(1.0, float(np.abs(v).max()))
    out[~tie] = a[~tie]
    return StepOutput(out)


def reference_rows(task_groups, norm, dtype, *, hgpo_history, hgpo_alpha, hgpo_base_group) -> list:
    """NumPy twin over whole task groups (`EstimatorSpec.reference_rows`): plain loops."""
    result = []
    for trajs in task_groups:
        groups = defaultdict(list)  # (k, last k observations) -> [(trajectory, step)]
        for ti, traj in enumerate(trajs):
            obs = [o for o, _, _ in traj]
            for t in range(len(traj)):
                for k in range(1, min(hgpo_history + 1, t + 1) + 1):
                    groups[(k, tuple(obs[t - k + 1 : t + 1]))].append((ti, t))
        items = defaultdict(list)
        if hgpo_base_group:
            for ti, traj in enumerate(trajs):
                for t, (_, _, a_ep) in enumerate(traj):
                    items[(ti, t)].append((0, dtype(a_ep)))
        for (k, _), members in groups.items():
            level = reference_step([trajs[ti][t][1] for ti, t in members], None, norm, dtype).advantage
            for (ti, t), a in zip(members, level):
                items[(ti, t)].append((k, a))
        out = []
        for ti, traj in enumerate(trajs):
            row = []
            for t in range(len(traj)):
                kept = [(k, a) for k, a in items[(ti, t)] if a != 0]
                w = [dtype(float(k + 1) ** float(hgpo_alpha)) for k, _ in kept]
                total = sum((wk * a for wk, (_, a) in zip(w, kept)), dtype(0.0))
                row.append(dtype(total / (sum(w, dtype(0.0)) + dtype(STD_EPS))) if kept else dtype(0.0))
            out.append(row)
        result.append(out)
    return result


SPEC = EstimatorSpec(
    "hgpo",
    OBS_HASH,
    step_advantage,
    reference_step,
    options=OPTIONS,
    owns_episode_level=True,
    reference_rows=reference_rows,
)
