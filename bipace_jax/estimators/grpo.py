"""GRPO: the episode level only (`docs/estimators.md`, "Episode level" and "Step level").

A = A_ep, with A_ep = (G - mean(G)) / (std(G) + 1e-6) over the trajectories of a task group
(unbiased std; `norm="mean"`: G - mean(G)), G the undiscounted episode return. No step groups.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bipace_jax.estimators.base import NO_GROUPS, EstimatorSpec, StepInputs, StepOutput


def step_advantage(inputs: StepInputs) -> StepOutput:
    """A_step = 0 for every row (GRPO has no step level)."""
    return StepOutput(jnp.zeros_like(inputs.returns))


def reference_step(returns, keys, norm, dtype) -> StepOutput:
    """NumPy twin: zeros (never called in practice: GRPO has no step groups)."""
    del keys, norm
    return StepOutput(np.zeros(len(returns), dtype))


SPEC = EstimatorSpec("grpo", NO_GROUPS, step_advantage, reference_step)
