"""Crafting games with a latent finite-horizon MDP, and their exact values by dynamic programming.

A game has T tasks (recipes). Task `task` is a chain of K stages; in stage k one action crafts the
next part (the recipe's step; it fails with probability `slip` and the stage stays), one action is a
dead end (with probability `trap_prob` the tool breaks: the game moves to the stage's trap twin,
from which nothing succeeds until the horizon), the other valid actions waste the turn, and the last
action id is the unparsable response (the turn is wasted and `invalid_penalty` is charged). Crafting
the K-th part enters the terminal goal state and pays `success_reward`. Latent states (S = 2 T K + 1):

    live(task, k) = task * K + k,   trap(task, k) = T K + task * K + k,   goal = 2 T K.

Conventions are the estimators' (`docs/estimators.md`, "Returns", penalty="in_reward"): the step
return is `R[t] = reward[t] - penalty[t] + gamma * R[t+1]`, so
`Q[t, s, a] = r[s, a] - c[s, a] + gamma * sum_s' P[s, a, s'] V[t + 1, s']`, `V[H] = 0`, `V[t, goal] = 0`.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Game:
    """A tabular finite-horizon MDP (numpy arrays; S states, A actions, T tasks).

    Attributes:
      transition: float64[S, A, S], P(s' | s, a); rows sum to 1 (the goal is absorbing).
      reward: float64[S, A], the game's expected reward of (s, a) (success reward on entering the goal).
      success: float64[S, A], the probability that (s, a) enters the goal (for J, the success rate).
      penalty: float64[S, A] >= 0, the invalid-action charge of (s, a).
      terminal: bool[S], states where an episode ends (the goal).
      start: int[T], the start state of each task.
      correct: int[T, K], the recipe action of each stage; dead_end: int[T, K], its dead-end action.
      live: bool[S], the live stages; trap_of: int[S], each live state's trap twin (-1 elsewhere).
      invalid_action: the unparsable action id (A - 1); its PACE key is -1.
      tasks, stages: T and K.
      success_reward: paid on entering the goal (`reward` holds its expectation).
    """

    transition: np.ndarray
    reward: np.ndarray
    success: np.ndarray
    penalty: np.ndarray
    terminal: np.ndarray
    start: np.ndarray
    correct: np.ndarray
    dead_end: np.ndarray
    live: np.ndarray
    trap_of: np.ndarray
    invalid_action: int
    tasks: int
    stages: int
    success_reward: float

    @property
    def num_states(self) -> int:
        """S."""
        return self.transition.shape[0]

    @property
    def num_actions(self) -> int:
        """A (the last one is the unparsable response)."""
        return self.transition.shape[1]

    def state_name(self, s: int) -> tuple[str, int, int]:
        """("live" | "trap" | "goal", task, stage) of latent state `s`."""
        tk = self.tasks * self.stages
        if s == 2 * tk:
            return ("goal", -1, self.stages)
        kind = "live" if s < tk else "trap"
        task, k = divmod(s % tk, self.stages)
        return (kind, task, k)


def crafting_game(
    *,
    tasks: int = 4,
    stages: int = 3,
    actions: int = 4,
    slip: float = 0.2,
    trap_prob: float = 0.5,
    success_reward: float = 1.0,
    invalid_penalty: float = 0.1,
    seed: int = 0,
) -> Game:
    """The crafting game of the module docstring; recipes drawn with `np.random.default_rng(seed)`.

    Args:
      tasks: T >= 1 recipes (one per task group kind).
      stages: K >= 1 parts to craft.
      actions: A >= 3 (a recipe action and a dead end differ, plus the unparsable id A - 1).
      slip: probability in [0, 1) that the recipe action fails (the stage stays).
      trap_prob: probability in [0, 1] that the dead-end action breaks the tool.
      success_reward: > 0, paid on entering the goal.
      invalid_penalty: >= 0, charged for the unparsable action.
      seed: recipe draw.
    Raises:
      ValueError: naming the argument, when a value is out of range.
    """
    for name, v, ok, want in (
        ("tasks", tasks, tasks >= 1, "an int >= 1"),
        ("stages", stages, stages >= 1, "an int >= 1"),
        ("actions", actions, actions >= 3, "an int >= 3"),
        ("slip", slip, 0.0 <= slip < 1.0, "a float in [0, 1)"),
        ("trap_prob", trap_prob, 0.0 <= trap_prob <= 1.0, "a float in [0, 1]"),
        ("success_reward", success_reward, success_reward > 0, "a float > 0"),
        ("invalid_penalty", invalid_penalty, invalid_penalty >= 0, "a float >= 0"),
        ("seed", seed, seed >= 0, "an int >= 0"),
    ):
        if not ok:
            raise ValueError(f"crafting_game: {name} must be {want}, got {v!r}")
    rng = np.random.default_rng(seed)
    t_, k_, a_ = tasks, stages, actions
    tk = t_ * k_
    s_ = 2 * tk + 1
    goal = 2 * tk
    inv = a_ - 1
    correct = np.zeros((t_, k_), np.int64)
    dead = np.zeros((t_, k_), np.int64)
    for task in range(t_):
        for k in range(k_):
            correct[task, k], dead[task, k] = rng.choice(a_ - 1, 2, replace=False)
    p = np.zeros((s_, a_, s_))
    reward = np.zeros((s_, a_))
    success = np.zeros((s_, a_))
    penalty = np.zeros((s_, a_))
    trap_of = np.full(s_, -1, np.int64)
    for task in range(t_):
        for k in range(k_):
            s, trap = task * k_ + k, tk + task * k_ + k
            trap_of[s] = trap
            nxt = goal if k == k_ - 1 else s + 1
            for a in range(a_):
                p[s, a, s] = 1.0
                p[trap, a, trap] = 1.0
            c, d = correct[task, k], dead[task, k]
            p[s, c, s], p[s, c, nxt] = slip, 1.0 - slip
            p[s, d, s], p[s, d, trap] = 1.0 - trap_prob, trap_prob
            if nxt == goal:
                reward[s, c] = success_reward * (1.0 - slip)
                success[s, c] = 1.0 - slip
    p[goal, :, goal] = 1.0
    penalty[:goal, inv] = invalid_penalty
    terminal = np.zeros(s_, bool)
    terminal[goal] = True
    live = np.zeros(s_, bool)
    live[:tk] = True
    return Game(
        transition=p,
        reward=reward,
        success=success,
        penalty=penalty,
        terminal=terminal,
        start=np.arange(t_) * k_,
        correct=correct,
        dead_end=dead,
        live=live,
        trap_of=trap_of,
        invalid_action=inv,
        tasks=t_,
        stages=k_,
        success_reward=float(success_reward),
    )


def policy_values(game: Game, pi: np.ndarray, horizon: int, gamma: float, *, success_only: bool = False):
    """Exact Q^pi and V^pi of a stationary policy over latent states, by backward induction.

    Args:
      game: the MDP.
      pi: float[..., S, A] action probabilities per latent state (leading axes: e.g. seeds).
      horizon: H >= 1 turns.
      gamma: discount in [0, 1].
      success_only: value the success indicator (gamma = 1 then gives the success probability),
        no reward and no penalty.
    Returns:
      (Q float64[..., H, S, A], V float64[..., H, S]): values of acting at turn t (0-based) in s; both
      are 0 at the terminal goal.
    Raises:
      ValueError: when pi's trailing shape is not (S, A) or horizon < 1.
    """
    pi = np.asarray(pi, np.float64)
    s_, a_ = game.num_states, game.num_actions
    if pi.shape[-2:] != (s_, a_):
        raise ValueError(f"policy_values: pi must end in shape ({s_}, {a_}), got {pi.shape}")
    if horizon < 1:
        raise ValueError(f"policy_values: horizon must be >= 1, got {horizon}")
    lead = pi.shape[:-2]
    r = game.success if success_only else game.reward - game.penalty
    q = np.zeros(lead + (horizon, s_, a_))
    v = np.zeros(lead + (horizon, s_))
    v_next = np.zeros(lead + (s_,))
    for t in range(horizon - 1, -1, -1):
        qt = r + gamma * np.einsum("sax,...x->...sa", game.transition, v_next)
        qt = np.where(game.terminal[:, None], 0.0, qt)
        q[..., t, :, :] = qt
        v[..., t, :] = np.sum(pi * qt, axis=-1)
        v_next = v[..., t, :]
    return q, v


def success_probability(game: Game, pi: np.ndarray, horizon: int) -> np.ndarray:
    """Exact J(pi): the probability of reaching the goal within `horizon` turns, averaged over tasks.

    Args: pi float[..., S, A] (as `policy_values`). Returns float64[...].
    """
    _, v = policy_values(game, pi, horizon, 1.0, success_only=True)
    return v[..., 0, game.start].mean(axis=-1)
