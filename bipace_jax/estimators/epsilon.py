"""Choosing the clustering slack epsilon: the paper's one-shot sweep and an online controller.

`docs/estimators.md`, "Clustering" (epsilon in [0, 1); default 0.05, 0.10 at 7B). The paper
fixes epsilon for all of training after a one-shot sweep (its named limitation); the controller is
the opt-in alternative.
"""

from __future__ import annotations

import dataclasses
import math

from bipace_jax.estimators.config import EstimatorConfig
from bipace_jax.estimators.core import compute_advantages

DEFAULT_GRID = tuple(round(0.01 * i, 2) for i in range(31))
"""0.00, 0.01, ..., 0.30."""


def calibrate_epsilon(
    batch,
    *,
    target_singleton_rate: float = 0.25,
    grid=DEFAULT_GRID,
    centroid: str = "mean",
    capacity: int | None = None,
    mesh=None,
    return_rates: bool = False,
):
    """The smallest epsilon on `grid` whose singleton step-group rate is at most the target.

    Clusters one batch (`StepBatch` with capacities) with BiGPO at each `grid` value (each in [0, 1),
    strictly ascending; the sweep compiles once) and reads its `singleton_group_rate` diagnostic.
    `target_singleton_rate` lies in [0, 1]; `centroid`, `capacity` as `EstimatorConfig`;
    `return_rates` also returns {epsilon: singleton_group_rate} for the values tried.

    Returns:
      epsilon (float), or (epsilon, rates) with `return_rates`.
    Raises:
      ValueError: on a target outside [0, 1], an empty, unsorted or out-of-range grid, or when no
        grid value reaches the target (the message lists the rates).
    """
    if not 0.0 <= target_singleton_rate <= 1.0:
        raise ValueError(f"calibrate_epsilon: target_singleton_rate must lie in [0, 1], got {target_singleton_rate}")
    grid = tuple(float(e) for e in grid)
    if not grid or any(b <= a for a, b in zip(grid, grid[1:])):
        raise ValueError(f"calibrate_epsilon: grid must be non-empty and strictly ascending, got {grid}")
    rates = {}
    for eps in grid:
        cfg = EstimatorConfig(name="bigpo", epsilon=eps, centroid=centroid, capacity=capacity)
        _, diag = compute_advantages(batch, cfg, mesh=mesh)
        rates[eps] = float(diag["singleton_group_rate"])
        if rates[eps] <= target_singleton_rate:
            return (eps, rates) if return_rates else eps
    raise ValueError(
        f"calibrate_epsilon: no epsilon in the grid reaches singleton_group_rate <= "
        f"{target_singleton_rate}; rates: {rates}"
    )


@dataclasses.dataclass
class EpsilonController:
    """Nudges epsilon between iterations toward a target singleton step-group rate (opt-in).

    After each iteration call `update(diag["singleton_group_rate"])`:
      epsilon <- clip(epsilon + clip(gain * (rate - target), -max_step, max_step), min, max)
    (too many singletons -> a larger epsilon merges more). A run without a controller keeps the
    paper's fixed epsilon (``estimator.controller.enabled = False``). epsilon is a traced input of `compute_advantages`, so a change does
    not recompile.

    Raises:
      ValueError: on construction when bounds are not 0 <= min_epsilon <= epsilon <= max_epsilon < 1,
        the target is outside [0, 1], or gain/max_step are negative or not finite.
    """

    epsilon: float = 0.05
    target_singleton_rate: float = 0.25
    gain: float = 0.05
    max_step: float = 0.01
    min_epsilon: float = 0.0
    max_epsilon: float = 0.3

    def __post_init__(self):
        if not 0.0 <= self.min_epsilon <= self.epsilon <= self.max_epsilon < 1.0:
            raise ValueError(
                "EpsilonController.epsilon: expected 0 <= min_epsilon <= epsilon <= max_epsilon < 1, "
                f"got {self.min_epsilon}, {self.epsilon}, {self.max_epsilon}"
            )
        if not 0.0 <= self.target_singleton_rate <= 1.0:
            raise ValueError(
                f"EpsilonController.target_singleton_rate: expected [0, 1], got {self.target_singleton_rate}"
            )
        for name in ("gain", "max_step"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"EpsilonController.{name}: expected a finite value >= 0, got {v}")

    def update(self, singleton_rate: float) -> float:
        """Moves epsilon one step toward the target; returns the new epsilon.

        Raises: ValueError when `singleton_rate` is not a finite value in [0, 1].
        """
        rate = float(singleton_rate)
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise ValueError(f"EpsilonController.update: singleton_rate must lie in [0, 1], got {singleton_rate}")
        delta = min(max(self.gain * (rate - self.target_singleton_rate), -self.max_step), self.max_step)
        self.epsilon = min(max(self.epsilon + delta, self.min_epsilon), self.max_epsilon)
        return self.epsilon

    def state_dict(self) -> dict:
        return {"epsilon": self.epsilon}

    def load_state_dict(self, state: dict) -> None:
        self.epsilon = float(state["epsilon"])
