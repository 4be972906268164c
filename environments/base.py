"""The text-environment contract shared by every game (TextCraft, ALFWorld, WebShop).

Environments are plain Python: they know nothing of JAX, tokenizers or trainers. Games are
registered with a ``GameSpec`` in ``environments.registry``.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import hashlib
import math
import numbers
from typing import Any


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a game shows after a reset or a step.

    Attributes:
      text: what the game shows the agent this turn (feedback or page), without history or template.
      anchor: the raw current observation used for GiGPO's exact step grouping (equal text, same
        state); for most games equal to ``text``; WebShop drops the instruction from it.
      task: the task description, shown in every prompt (ALFWorld: "put a clean mug on desk";
        TextCraft: its whole first observation, the crafting commands and the goal, since the
        agent needs the recipes at every step).
      admissible_actions: the commands the game accepts now, or None when the game lists none.
      won: True once the task is solved.
      inventory: what the agent carries, as the game's own inventory command prints it
        (TextCraft: ``"Inventory: [oak planks] (4) "``), or None when the game does not track it.
        Shown in prompts only with ``build_prompt(..., show_inventory=True)``.
    """

    text: str
    anchor: str
    task: str
    admissible_actions: list[str] | None = None
    won: bool = False
    inventory: str | None = None


class ReplayDivergedError(RuntimeError):
    """A restored game (``TextEnv.restore``) does not show what the snapshotted game showed: its replay
    of the action prefix gave another observation (the game is not deterministic for its seed), or its
    restored state shows another one. Never a silent wrong state: the fork is refused."""


def observation_digest(obs: Observation) -> str:
    """Hex SHA-256 of ``repr(obs)`` (every field): equal observations, equal digests."""
    return hashlib.sha256(repr(obs).encode("utf-8", "surrogatepass")).hexdigest()


@dataclasses.dataclass(frozen=True)
class EnvSnapshot:
    """A running episode, restorable into another instance of the same game (``TextEnv.restore``).

    Attributes:
      task_id, seed: the episode's reset.
      actions: the commands stepped since the reset, oldest first.
      digests: ``observation_digest`` of the reset's observation and of each step's (len(actions) + 1).
      obs: the observation the game shows now (the last of them).
      state: the game's own deep-copied state (``TextEnv._snapshot_state``), or None: ``restore``
        replays ``actions`` from the reset instead and checks every observation against ``digests``.
    """

    task_id: int
    seed: int
    actions: tuple[str, ...]
    digests: tuple[str, ...]
    obs: Observation
    state: Any = None


class TextEnv(abc.ABC):
    """A multi-turn text game with a step cap enforced here, not trusted to the game.

    Subclasses implement ``_reset`` and ``_step``; ``reset``/``step`` add the step cap:
    after ``max_steps`` steps the episode ends with ``info["truncated"] = True``.

    A step's reward must be a finite real number (an int, float or NumPy number): ``step`` raises
    ValueError naming the game class and task id for NaN, inf or anything else (a str, None), so in an
    ``EnvPool`` an unscorable step ends THAT game with ``Fault.EXCEPTION`` (counted in
    ``rollout/env_errors``, its rows left out of the batch), never the run.
    """

    def __init__(self, max_steps: int):
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self.max_steps = max_steps
        self._steps = 0
        self._done = True
        self._task_id: int | None = None
        # the episode's reset (task_id, seed), commands and observation digests, for snapshot()
        self._fork_trail: tuple[int, int] | None = None
        self._fork_actions: list[str] = []
        self._fork_digests: list[str] = []
        self._fork_shown: Observation | None = None

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

    def oracle_action(self) -> str | None:
        """The expert's next command from the current state (warm start, DAgger labels), or None.

        None when the game has no expert (this default), the episode is over, or the expert has no
        move; games with an expert override it.
        """
        return None

    def reset(self, task_id: int, seed: int) -> Observation:
        """Start task ``task_id`` (0 <= task_id < num_tasks) with ``seed``; raises ValueError otherwise."""
        if not 0 <= int(task_id) < self.num_tasks:
            raise ValueError(f"task_id must lie in [0, {self.num_tasks}), got {task_id}")
        obs = self._reset(int(task_id), int(seed))
        self._task_id = int(task_id)
        self._steps = 0
        self._done = False
        self._fork_trail, self._fork_actions, self._fork_digests, self._fork_shown = (
            (int(task_id), int(seed)),
            [],
            [],
            obs,
        )
        self._fork_digests.append(observation_digest(obs))
        return obs

    def step(self, action: str) -> tuple[Observation, float, bool, dict[str, Any]]:
        """Apply ``action``; returns (observation, reward as float, done, info).

        Raises:
          RuntimeError: called after done (or before any reset).
          ValueError: the game's reward is not a finite real number (the episode is over: reset next).
        """
        if self._done:
            raise RuntimeError("step() called on a finished episode: call reset() first")
        obs, reward, done, info = self._step(action)
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            self._done = True
            raise ValueError(
                f"{type(self).__name__} task {self._task_id}: step {self._steps + 1} gave reward {reward!r} "
                f"({type(reward).__name__}); a reward must be a finite real number"
            )
        self._steps += 1
        info = dict(info)
        if not done and self._steps >= self.max_steps:
            done = True
            info["truncated"] = True
        self._done = done
        self._fork_actions.append(action)
        self._fork_digests.append(observation_digest(obs))
        self._fork_shown = obs
        return obs, float(reward), bool(done), info

    # -- forking (branching rollouts) --------------------------------------------------------
    def _snapshot_state(self) -> Any:
        """The game's own episode state, restorable by ``_restore_state``; None (this default): the game
        has none, ``restore`` replays the action prefix from the reset. Games with a cheap state override
        both (TextCraft, WebShop)."""
        return None

    def _restore_state(self, state: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} snapshots no state to restore")

    def snapshot(self) -> EnvSnapshot:
        """The running episode as an ``EnvSnapshot`` (deep-copied: later steps leave it unchanged).

        Raises:
          RuntimeError: no running episode (never reset, or done).
        """
        if self._done or self._fork_trail is None:
            raise RuntimeError(f"{type(self).__name__}: snapshot() needs a running episode (reset it first)")
        task_id, seed = self._fork_trail
        state = self._snapshot_state()
        return EnvSnapshot(
            task_id, seed, tuple(self._fork_actions), tuple(self._fork_digests), self._fork_shown, copy.deepcopy(state)
        )

    def restore(self, snap: EnvSnapshot) -> Observation:
        """Puts this game in ``snap``'s state and returns the observation it shows (``snap.obs``).

        With ``snap.state`` the game's state is restored (a deep copy); without it the episode is replayed:
        ``reset(task_id, seed)``, then every action, each observation checked against ``snap.digests``.

        Raises:
          ReplayDivergedError: the replay showed another observation than the snapshotted game at some
            step, or ended early (the game is not deterministic for its seed).
        """
        if snap.state is None:
            obs = self.reset(snap.task_id, snap.seed)
            for k, action in enumerate(("<reset>", *snap.actions)):
                if k:
                    if self._done:
                        raise ReplayDivergedError(
                            f"{type(self).__name__} task {snap.task_id} seed {snap.seed}: the replay ended at step "
                            f"{k - 1} of {len(snap.actions)}"
                        )
                    obs = self.step(action)[0]
                if observation_digest(obs) != snap.digests[k]:
                    raise ReplayDivergedError(
                        f"{type(self).__name__} task {snap.task_id} seed {snap.seed}: the replay's observation "
                        f"after step {k} ({action!r}) differs from the snapshotted game's"
                    )
            return obs
        self._restore_state(copy.deepcopy(snap.state))
        self._task_id, self._steps, self._done = snap.task_id, len(snap.actions), False
        self._fork_trail, self._fork_actions, self._fork_digests = (
            (snap.task_id, snap.seed),
            list(snap.actions),
            list(snap.digests),
        )
        self._fork_shown = snap.obs
        return snap.obs
