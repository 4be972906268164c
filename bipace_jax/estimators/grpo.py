"""GRPO: episode level only (spec: estimators.md, "Episode level" and "Step level": `grpo`).

A = A_ep, with A_ep = (G - mean(G)) / (std(G) + 1e-6) over the trajectories of a task group
(unbiased std; `norm="mean"`: G - mean(G)), G the undiscounted episode return. The step level is 0.
"""

from __future__ import annotations

import jax.numpy as jnp


def step_advantage(returns):
    """A_step = 0 for every row (GRPO has no step level). float32[N]."""
    return jnp.zeros_like(returns)
