"""Synthetic step batches for the estimator tests and `launch.bench_estimators` (numpy only).

`random_step_arrays` draws small adversarial batches (padding anywhere with garbage, ties, exact
duplicates, degenerate fingerprints, fingerprints whose normalisation and dot products are exact
in float32); `rollout_like_arrays` draws rollout-shaped batches (task groups of G trajectories
walking a small latent state graph, noisy fingerprints around each latent state, observation texts
finer than the latent states, a few novel states).
"""

from __future__ import annotations

import numpy as np

REWARDS = np.array([-0.1, 0.0, 0.0, 1.0, 10.0, 0.5], np.float32)


def _palette(rng, dim: int, size: int) -> np.ndarray:
    """Vectors with entries in {0, +-1} and 1 or 4 non-zeros: unit or norm-2, so re-normalising and
    every dot product of sums of them is exact in float32."""
    out = np.zeros((size, dim), np.float32)
    for i in range(size):
        nnz = 1 if rng.random() < 0.5 or dim < 4 else 4
        idx = rng.choice(dim, nnz, replace=False)
        out[i, idx] = rng.choice([-1.0, 1.0], nnz) if nnz == 4 else 1.0
    return out


def random_step_arrays(
    rng: np.random.Generator,
    *,
    num_rows: int = 64,
    dim: int = 8,
    max_groups: int = 4,
    max_trajs: int = 4,
    max_steps: int = 5,
    fingerprints: str | None = None,
    penalty: bool = False,
) -> dict[str, np.ndarray]:
    """A padded random batch as `StepBatch.from_numpy` keyword arrays (rows shuffled).

    Args:
      rng: numpy Generator.
      num_rows: N (must hold max_groups * max_trajs * max_steps rows).
      fingerprints: "onehot" (one-hot of obs_hash, times a power of two), "palette" (exact
        structured vectors, duplicates likely), "gaussian" (generic), or None to draw one.
      penalty: also draw a `penalty` array (0, 0.1 or 0.5 on real rows, NaN or negative garbage on
        padding); drawn after everything else, so the other arrays are those of penalty=False.
    """
    kind = fingerprints or rng.choice(["onehot", "palette", "gaussian"])
    rows = []
    traj = int(rng.integers(0, 1000))
    for g in rng.choice(1000, int(rng.integers(1, max_groups + 1)), replace=False):
        for _ in range(int(rng.integers(1, max_trajs + 1))):
            traj += int(rng.integers(1, 5))
            for t in range(int(rng.integers(1, max_steps + 1))):
                rows.append((int(g) - 500, traj, t))
    real = len(rows)
    if real > num_rows:
        raise ValueError(f"random_step_arrays: {real} rows do not fit num_rows={num_rows}")
    n = num_rows
    group_id = rng.integers(-600, 600, n).astype(np.int32)  # padding: ids colliding with real rows
    traj_id = rng.integers(0, 1200, n).astype(np.int32)
    step = rng.integers(-2, 6, n).astype(np.int32)
    for i, (g, t, s) in enumerate(rows):
        group_id[i], traj_id[i], step[i] = g, t, s
    num_obs = int(rng.integers(1, 6))
    obs_hash = rng.integers(0, num_obs, n).astype(np.int32)
    num_keys = int(rng.integers(1, 4))
    action_key = rng.integers(-1, num_keys, n).astype(np.int32)
    reward = rng.choice(REWARDS, n).astype(np.float32)
    if kind == "onehot":
        fp = np.eye(dim, dtype=np.float32)[obs_hash % dim] * np.float32(2.0 ** int(rng.integers(-3, 4)))
    elif kind == "palette":
        pal = _palette(rng, dim, int(rng.integers(1, 7)))
        fp = pal[rng.integers(0, len(pal), n)] * np.float32(2.0 ** int(rng.integers(-2, 3)))
    else:
        fp = rng.standard_normal((n, dim)).astype(np.float32)
        dup = rng.random(n) < 0.3
        fp[dup] = fp[rng.integers(0, n, int(dup.sum()))]
    fp = fp.astype(np.float32)
    degenerate = rng.random(n) < 0.08
    fp[degenerate] = 0.0
    fp[degenerate & (rng.random(n) < 0.5), 0] = np.nan
    mask = np.zeros(n, bool)
    mask[:real] = True
    pad = ~mask
    reward[pad & (rng.random(n) < 0.5)] = np.nan
    fp[pad & (rng.random(n) < 0.3)] = np.nan
    perm = rng.permutation(n)
    extra = {}
    if penalty:
        pen = rng.choice(np.array([0.0, 0.0, 0.1, 0.5], np.float32), n)
        pen[pad] = rng.choice(np.array([np.nan, -1.0, 0.1], np.float32), int(pad.sum()))
        extra["penalty"] = pen
    out = dict(
        group_id=group_id,
        traj_id=traj_id,
        step=step,
        reward=reward,
        obs_hash=obs_hash,
        fingerprint=fp,
        action_key=action_key,
        mask=mask,
        **extra,
    )
    return {k: v[perm] for k, v in out.items()}


def rollout_like_arrays(
    num_groups: int,
    *,
    group_size: int = 8,
    steps: int = 50,
    dim: int = 1536,
    num_states: int = 30,
    noise: float = 0.15,
    novel: float = 0.04,
    obs_variants: int = 3,
    num_actions: int = 4,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A rollout-shaped batch of num_groups * group_size * steps rows (no padding).

    Each task group has `num_states` latent states with random directions and a random successor
    per (state, action); each trajectory starts in state 0 and takes uniform actions (5% unparsable,
    key -1). A row's fingerprint is its latent direction plus Gaussian noise of relative size `noise`
    (cosine ~0.98 between visits of one state), or with probability `novel` a fresh random direction
    with a unique observation text. Observation ids split each latent state into `obs_variants`
    texts (e.g. inventory differences), so the exact-hash partition is finer than the clusters.
    Rewards: -0.1 invalid-action penalty with probability 0.1, +10 at the last step for half of the
    trajectories.
    """
    rng = np.random.default_rng(seed)
    n = num_groups * group_size * steps
    group_id = np.repeat(np.arange(num_groups, dtype=np.int32), group_size * steps)
    traj_id = np.repeat(np.arange(num_groups * group_size, dtype=np.int32), steps)
    step = np.tile(np.arange(steps, dtype=np.int32), num_groups * group_size)
    actions = rng.integers(0, num_actions, n).astype(np.int32)
    action_key = np.where(rng.random(n) < 0.05, -1, actions).astype(np.int32)
    is_novel = rng.random(n) < novel
    variant = rng.integers(0, obs_variants, n)
    state = np.zeros(n, np.int64)
    for g in range(num_groups):
        succ = rng.integers(0, num_states, (num_states, num_actions))
        for tr in range(group_size):
            base = (g * group_size + tr) * steps
            s = 0
            for t in range(steps):
                state[base + t] = s
                s = succ[s, actions[base + t]]
    directions = rng.standard_normal((num_groups, num_states, dim)).astype(np.float32)
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
    fp = directions[group_id, state] + (noise / np.sqrt(dim)) * rng.standard_normal((n, dim)).astype(np.float32)
    fp[is_novel] = rng.standard_normal((int(is_novel.sum()), dim)).astype(np.float32)
    fp /= np.linalg.norm(fp, axis=-1, keepdims=True)
    obs_hash = np.where(is_novel, 1_000_000 + np.arange(n), state * obs_variants + variant).astype(np.int32)
    reward = np.where(rng.random(n) < 0.1, -0.1, 0.0).astype(np.float32)
    last = step == steps - 1
    reward[last] += np.where(rng.random(int(last.sum())) < 0.5, 10.0, 0.0).astype(np.float32)
    return dict(
        group_id=group_id,
        traj_id=traj_id,
        step=step,
        reward=reward,
        obs_hash=obs_hash,
        fingerprint=fp.astype(np.float32),
        action_key=action_key,
        mask=np.ones(n, bool),
    )
