"""``RolloutConfig``: how games are played and scored, and the scheduler that batches the engine."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from bipace_jax.estimators import ActionKey
from environments.registry import GameSpec, game_spec

__all__ = [
    "ActionKey",
    "FIRST_TOKENS",
    "INVALID_ACTIONS",
    "LENGTH_FINISH",
    "RESEED_STRIDE",
    "RolloutConfig",
    "Scheduler",
]

#: Number of response tokens in the ``first_tokens`` PACE key (``docs/estimators.md``, "PACE keys").
FIRST_TOKENS = 8
#: How a response is scored when it used the whole token budget (finish reason ``length``).
LENGTH_FINISH = ("parse", "invalid", "unpenalised")
INVALID_ACTIONS = ("fallback", "projected")
RESEED_STRIDE = 1_000_003  # retry k of a task group's reset uses seed + k * RESEED_STRIDE


class Scheduler(enum.StrEnum):
    """How ``collect`` batches the engine: ``lockstep`` (one ``Engine.generate`` per turn over every live
    game, then every env step) or ``continuous`` (``Engine.slots``: a finished response goes to its game
    while the other slots keep decoding). Both run ``schedule.run``, the one event loop."""

    LOCKSTEP = "lockstep"
    CONTINUOUS = "continuous"


def _enum_field(cls, value, name: str):
    """``value`` as a member of the StrEnum ``cls``, or a one-line ValueError naming ``RolloutConfig.name``."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"RolloutConfig.{name} must be one of {tuple(map(str, cls))}, got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How games are played and scored.

    Attributes:
      game: a registered game (``environments.registered()``); its ``GameSpec`` gives the prompt
        template and the default fallback action.
      group_size: G, rollouts per task group (all from the same task id and seed).
      max_steps: turns per game at most; a game still running after it ends (``truncated``).
      history_length: earlier (observation, action) pairs shown in the prompt (verl-agent: 2).
      max_prompt_length: most prompt tokens (>= 16; chat template included); must not exceed the engine's
        largest length bucket. A game whose prompt does not fit even with no history ends with
        ``Episode.env_error = "prompt_too_long"`` (``turns.PROMPT_TOO_LONG``).
      invalid_penalty: (>= 0) subtracted from a step's reward when its response has no parsable action.
      success_reward: (> 0) multiplies the game's own reward (1.0 on success) (verl-agent: 10).
      fallback_action: the command sent to the game for an invalid response; None (default): the
        game's ``GameSpec.fallback_action`` (``RolloutConfig.fallback``).
      require_think: a response without ``<think>...</think>`` before the action is invalid.
      reject_cjk: a response holding a CJK ideograph is invalid (verl-agent's rule).
      invalid_action: what the game receives for an invalid response: ``"fallback"`` sends
        ``fallback_action``; ``"projected"`` (verl-agent) the parsed action when the tags were there,
        else the response's last ``projection_chars`` characters, lower-cased (also what the history
        shows).
      projection_chars: (>= 1) the tail kept by ``"projected"`` (verl-agent: ALFWorld 30, WebShop 20).
      length_finish: a response cut by the token budget (finish reason ``length``): ``"parse"`` scores
        it like any other (valid when its action parses), ``"invalid"`` makes it an invalid action
        (fallback sent, penalty charged), ``"unpenalised"`` sends the fallback without the penalty.
      reset_retries: (>= 0) times a task group whose reset faulted (a pool ``Fault``) is
        reset again, all G envs together, on a fresh seed (seed + k * ``RESEED_STRIDE`` on retry k);
        envs still failing after that are dropped (0: drop at once). Either way the game counts in
        ``stats["env_errors"]``.
      action_key: PACE key, an ``ActionKey`` (``"action_tag"`` or ``"first_tokens"``; stored as the enum).
      similarity_thresh: ``obs_hash`` rule: 0.0 exact anchor text, in (0, 1) ``similarity_groups``
        (``EstimatorConfig.similarity_thresh``).
      show_inventory: show the inventory in the prompt (``build_prompt(show_inventory=...)``).
      system_prompt: system message; None leaves the chat template's default (Qwen2.5 inserts its own).
      template: None, or a mapping of ``PromptTemplate`` fields overriding the game's default.
      scheduler: a ``Scheduler`` (``"lockstep"`` or ``"continuous"``; stored as the enum). Another
        scheduler for one call: ``dataclasses.replace(rcfg, scheduler=...)``.
      num_slots: (>= 0) decode slots of the continuous scheduler; 0: one per game, capped
        at the engine's largest batch bucket. More slots than a call's games: ``collect`` warns (each slot holds a
        KV cache row; the extra ones stay empty).
      chunk_steps: (>= 1) most decode steps per on-device chunk of the continuous scheduler.
      branch_turns: branching rollouts (``rollout.branch``): the turns (strictly increasing, in
        [1, max_steps)) at which every game forks into ``branch_children`` games from its state then
        (the game's snapshot, or a checked replay of its actions); () (default): no branching. A task group
        of G games starts G / children ** len(branch_turns) roots (``branch_roots``), so it still ends with G
        games and the sampling budget is unchanged.
      branch_children: (>= 2) games a fork makes, the forked one included; G must be divisible by
        ``branch_children ** len(branch_turns)``.

    Raises:
      ValueError: naming the ``RolloutConfig`` field, on a value outside its range or set, or a game
        that is not registered.
    """

    game: str = "textcraft"
    group_size: int = 8
    max_steps: int = 50
    history_length: int = 2
    max_prompt_length: int = 2048
    invalid_penalty: float = 0.1
    success_reward: float = 10.0
    fallback_action: str | None = None
    require_think: bool = False
    reject_cjk: bool = False
    invalid_action: str = "fallback"
    projection_chars: int = 30
    length_finish: str = "parse"
    reset_retries: int = 1
    action_key: ActionKey = ActionKey.ACTION_TAG
    similarity_thresh: float = 0.0
    show_inventory: bool = False
    system_prompt: str | None = None
    template: Any = None
    scheduler: Scheduler = Scheduler.LOCKSTEP
    num_slots: int = 0
    chunk_steps: int = 8
    branch_turns: tuple[int, ...] = ()
    branch_children: int = 2

    def __post_init__(self):
        ints = (("group_size", 1), ("max_steps", 1), ("history_length", 0), ("max_prompt_length", 16))
        for name, lo in (*ints, ("reset_retries", 0), ("projection_chars", 1), ("num_slots", 0), ("chunk_steps", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"RolloutConfig.{name} must be an int >= {lo}, got {v!r}")
        object.__setattr__(self, "scheduler", _enum_field(Scheduler, self.scheduler, "scheduler"))
        object.__setattr__(self, "action_key", _enum_field(ActionKey, self.action_key, "action_key"))
        if self.invalid_action not in INVALID_ACTIONS:
            raise ValueError(
                f"RolloutConfig.invalid_action must be one of {INVALID_ACTIONS}, got {self.invalid_action!r}"
            )
        if self.length_finish not in LENGTH_FINISH:
            raise ValueError(f"RolloutConfig.length_finish must be one of {LENGTH_FINISH}, got {self.length_finish!r}")
        if self.fallback_action is not None and (
            not isinstance(self.fallback_action, str) or not self.fallback_action.strip()
        ):
            raise ValueError(
                f"RolloutConfig.fallback_action must be None or a non-empty str, got {self.fallback_action!r}"
            )
        try:
            game_spec(self.game)
        except ValueError as e:
            raise ValueError(f"RolloutConfig.game must be a registered game: {e}") from None
        for name, lo, ok in (("invalid_penalty", ">= 0", np.greater_equal), ("success_reward", "> 0", np.greater)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and ok(v, 0)):
                raise ValueError(f"RolloutConfig.{name} must be a finite number {lo}, got {v!r}")
        t = self.similarity_thresh
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < 1.0:
            raise ValueError(f"RolloutConfig.similarity_thresh must be 0 or a float in (0, 1), got {t!r}")
        self._check_branching()

    def _check_branching(self) -> None:
        turns = self.branch_turns
        if not isinstance(turns, (tuple, list)) or any(isinstance(t, bool) or not isinstance(t, int) for t in turns):
            raise ValueError(f"RolloutConfig.branch_turns must be a tuple of ints, got {turns!r}")
        turns = tuple(int(t) for t in turns)
        object.__setattr__(self, "branch_turns", turns)
        if any(b <= a for a, b in zip(turns, turns[1:])) or any(not 1 <= t < self.max_steps for t in turns):
            raise ValueError(
                f"RolloutConfig.branch_turns must be strictly increasing turns in [1, max_steps={self.max_steps}), "
                f"got {turns!r}"
            )
        c = self.branch_children
        if isinstance(c, bool) or not isinstance(c, int) or c < 2:
            raise ValueError(f"RolloutConfig.branch_children must be an int >= 2, got {c!r}")
        leaves = c ** len(turns)
        if self.group_size % leaves:
            raise ValueError(
                f"RolloutConfig.group_size={self.group_size} must be divisible by branch_children ** "
                f"len(branch_turns) = {c} ** {len(turns)} = {leaves} (a task group of G games starts "
                f"G / {leaves} roots)"
            )

    @property
    def branch_roots(self) -> int:
        """Games a task group starts from its reset: ``group_size / branch_children ** len(branch_turns)``
        (``group_size`` without branching); each root forks into ``branch_children`` games at every turn of
        ``branch_turns``, so the task group still ends with ``group_size`` games."""
        return self.group_size // self.branch_children ** len(self.branch_turns)

    @property
    def spec(self) -> GameSpec:
        """The game's registered ``GameSpec``."""
        return game_spec(self.game)

    @property
    def fallback(self) -> str:
        """The command an invalid response is replaced with: ``fallback_action`` or the game's default."""
        return self.fallback_action if self.fallback_action is not None else self.spec.fallback_action
