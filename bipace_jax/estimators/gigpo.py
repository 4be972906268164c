"""GiGPO step level: anchor-state groups by exact observation (`docs/estimators.md`, "Step level").

Step groups S = rows with equal (group_id, obs_hash). For row i with discounted step return R_i:
  A_step = (R_i - mean_S(R)) / (std_S(R) + 1e-6)   (norm="mean_std", unbiased std)
  A_step =  R_i - mean_S(R)                         (norm="mean")
A singleton gets 0; a group whose returns span at most 1e-5 * max(1, max|R|) gets 0 ("Equal values
stay equal").
"""

from __future__ import annotations

import numpy as np

from bipace_jax.estimators import reference
from bipace_jax.estimators.base import OBS_HASH, EstimatorSpec, StepInputs, StepOutput
from bipace_jax.estimators.episodes import normalised_advantage


def step_advantage(inputs: StepInputs) -> StepOutput:
    """Normalised step advantage inside each step group (the formula above)."""
    return StepOutput(
        normalised_advantage(inputs.returns, inputs.labels, inputs.include, inputs.num_segments, inputs.norm)
    )


def reference_step(returns, keys, norm, dtype) -> StepOutput:
    """NumPy twin for one step group."""
    del keys
    return StepOutput(np.asarray(reference.normalise(returns, norm, dtype), dtype))


SPEC = EstimatorSpec("gigpo", OBS_HASH, step_advantage, reference_step)
