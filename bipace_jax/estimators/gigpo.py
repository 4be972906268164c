"""GiGPO step level: anchor-state groups by exact observation (spec: estimators.md, "Step level").

Step groups S = rows with equal (group_id, obs_hash). For row i with discounted step return R_i:
  A_step = (R_i - mean_S(R)) / (std_S(R) + 1e-6)   (norm="mean_std", unbiased std)
  A_step =  R_i - mean_S(R)                         (norm="mean")
A singleton gets 0; a group whose returns span at most 1e-5 * max(1, max|R|) gets 0 ("Equal values
stay equal").
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from bipace_jax.estimators.episodes import Rows, normalised_advantage


def hash_labels(rows: Rows):
    """Dense step-group ids of the exact-hash partition over (group_id, obs_hash); int32[N] in [0, N).

    Also the `hash_` diagnostics partition for every estimator.
    """
    n = rows.reward.shape[0]
    k = jnp.arange(n, dtype=jnp.int32)
    _, g, h, idx = lax.sort(
        ((~rows.valid).astype(jnp.int32), rows.group_idx, rows.obs_hash, k), num_keys=3, is_stable=True
    )
    first = (k == 0) | (g != jnp.roll(g, 1)) | (h != jnp.roll(h, 1))
    dense = jnp.cumsum(first, dtype=jnp.int32) - 1
    return jnp.zeros((n,), jnp.int32).at[idx].set(dense)


def step_advantage(returns, labels, include, num_segments: int, norm: str):
    """Normalised step advantage inside each step group `labels` (the formula above); float32[N]."""
    return normalised_advantage(returns, labels, include, num_segments, norm)
