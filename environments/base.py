"""The text-environment contract shared by every game (TextCraft, ALFWorld, WebShop).

Environments are plain Python: they know nothing of JAX, tokenizers or trainers.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a game shows after a reset or a step.

    Attributes:
      text: what the game shows the agent this turn (feedback or page), without history or template.
      anchor: the raw current observation used for GiGPO's exact step grouping (equal text, same
        state); for most games equal to ``text``; WebShop drops the instruction from it.
      task: the task description (e.g. "craft stone pickaxe").
      admissible_actions: the commands the game accepts now, or None when the game lists none.
      won: True once the task is solved.
    """

    text: str
    anchor: str
    task: str
    admissible_actions: list[str] | None = None
    won: bool = False


class TextEnv(abc.ABC):
    """A multi-turn text game with a step cap enforced here, not trusted to the game.

    Subclasses implement ``_reset`` and ``_step``; ``reset``/``step`` add the step cap:
    after ``max_steps`` steps the episode ends with ``info["truncated"] = True``.
    """

    def __init__(self, max_steps: int):
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self.max_steps = max_steps
        self._steps = 0
        self._done = True

    @property
    @abc.abstractmethod
    def num_tasks(self) -> int:
        """Number of task ids this environment accepts in ``reset``."""

    @abc.abstractmethod
    def _reset(self, task_id: int, seed: int) -> Observation: ...

    @abc.abstractmethod
    def _step(self, action: str) -> tuple[Observation, float, bool, dict[str, Any]]: ...

    def task_info(self, task_id: int) -> dict[str, Any]:
        """Per-task metadata for metrics (e.g. ``{"task_type": ..., "depth": ...}``)."""
        return {}

    def reset(self, task_id: int, seed: int) -> Observation:
        """Start task ``task_id`` (0 <= task_id < num_tasks) with ``seed``; raises ValueError otherwise."""
        if not 0 <= int(task_id) < self.num_tasks:
            raise ValueError(f"task_id must lie in [0, {self.num_tasks}), got {task_id}")
        obs = self._reset(int(task_id), int(seed))
        self._steps = 0
        self._done = False
        return obs

    def step(self, action: str) -> tuple[Observation, float, bool, dict[str, Any]]:
        """Apply ``action``; returns (observation, reward, done, info). Raises RuntimeError after done."""
        if self._done:
            raise RuntimeError("step() called on a finished episode: call reset() first")
        obs, reward, done, info = self._step(action)
        self._steps += 1
        info = dict(info)
        if not done and self._steps >= self.max_steps:
            done = True
            info["truncated"] = True
        self._done = done
        return obs, float(reward), bool(done), info


_REGISTRY: dict[str, Callable[..., TextEnv]] = {}


def register(name: str):
    """Decorator registering an environment factory under ``name`` for ``make``."""

    def deco(factory):
        if name in _REGISTRY:
            raise ValueError(f"environment {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def make(name: str, **options) -> TextEnv:
    """Build a registered environment; raises ValueError naming the known environments."""
    import environments  # noqa: F401  (imports the game modules, which register themselves)

    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**options)


def registered() -> list[str]:
    return sorted(_REGISTRY)
