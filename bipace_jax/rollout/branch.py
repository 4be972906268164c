"""Branching rollouts (``RolloutConfig.branch_turns``): a task group's G games grown as trees forked at
chosen turns, so siblings share a state exactly (and the prompt head of it) at the same number of games.

Layout: with c = ``branch_children`` and f = ``len(branch_turns)`` forks, a task group starts R = G / c^f
roots (``RolloutConfig.branch_roots``). Game g of task group k (env ``k * G + g``) is leaf g of the group's
forest: root ``g // c^f``, and at fork j (1..f) sibling d_j, the j-th base-c digit of ``g % c^f`` (most
significant first; ``leaf_path``). Before fork j a game lives on the env whose digits from j on are 0;
when it has played ``branch_turns[j-1]`` turns and plays on, it forks: envs ``e + d * c^(f-j)``, d = 1..c-1,
take its state (``EnvPool.fork``: the game's snapshot, or a replay of its actions from the same reset seed
checked observation by observation) and its history, and the game itself plays on as sibling 0. The task
group ends with exactly G games, as without branching.

Keys: root r of task group k has ``turns.game_keys(key, games, R)[k * R + r]``; a fork gives sibling d
(0 included) the key ``fold_in(key, BRANCH_SALT + d)`` of the forking game's key, and turn t samples from
``turn_keys(that key, t)``: a game's tokens are a function of (game, branch path, turn), unchanged when
siblings are added or removed. ``BRANCH_SALT`` keeps a sibling's key apart from every turn key.

Rows: a child's trajectory repeats its parent's rows before the fork (the same tokens; ``StepRecord.source``
names the row that sampled each), so every game is a whole trajectory with steps 0..T-1 and the
estimators run unchanged; ``StepBatch.source_row`` and ``StepBatch.branch`` carry the tree. A repeated
prefix row is trained once per game that passes through it (per-leaf trajectories).

A game that ends before its next fork (won, failed, capped, faulted, or at reset) cannot fork: the envs
of its subtree then play lone games from the task group's reset instead (``stats["branch_released"]``),
each with its leaf's key (its root's key folded with its whole path), so the group still plays G games.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from bipace_jax.rollout.config import RolloutConfig
from bipace_jax.rollout.protocols import EngineLike
from bipace_jax.rollout.records import StepRecord
from bipace_jax.rollout.turns import HostTurns, Play, Reply, book, clean_observation, game_keys, turn_keys
from environments.base import ReplayDivergedError

__all__ = ["BRANCH_COUNTERS", "BRANCH_SALT", "BranchTurns", "Forest", "leaf_path", "plant", "sampled_singletons"]

#: Added to a sibling index before it is folded into the forking game's key: far above any turn index.
BRANCH_SALT = 0x5EED0000
#: ``RolloutResult.stats`` counters of a branching collect: forks made, prefix rows repeated in children,
#: envs that played a lone game from the reset because their subtree's game ended before its fork.
BRANCH_COUNTERS = ("branch_forks", "branch_copied_rows", "branch_released")


def leaf_path(g: int, children: int, forks: int) -> tuple[int, ...]:
    """Game g's sibling index at each fork (base-``children`` digits of ``g % children**forks``, most
    significant first); ``forks`` entries."""
    rest = g % children**forks
    return tuple((rest // children ** (forks - 1 - j)) % children for j in range(forks))


def _fold(keys: np.ndarray, data: Sequence[int]) -> np.ndarray:
    # turn_keys is fold_in row by row: here it folds sibling indices (offset by BRANCH_SALT)
    return turn_keys(np.asarray(keys, np.uint32).reshape(-1, 2), [BRANCH_SALT + int(d) for d in data])


@dataclasses.dataclass
class Forest:
    """Where each env's game stands in its task group's tree: forks done (``level``) and its sibling
    index at each (``path``)."""

    rcfg: RolloutConfig
    level: list[int]
    path: list[tuple[int, ...]]

    @property
    def forks(self) -> int:
        return len(self.rcfg.branch_turns)

    def span(self, level: int) -> int:
        """Envs in the subtree of a game that has made ``level`` forks."""
        return self.rcfg.branch_children ** (self.forks - level)


def plant(play: Play, games: Sequence[tuple[int, int]], key) -> Forest:
    """Makes ``play`` (``turns.start`` of a branching ``collect``) start its roots only: sets the roots'
    keys, releases the subtrees of roots that faulted or ended at reset, and adds the branch counters."""
    rcfg = play.rcfg
    g_size, roots = rcfg.group_size, rcfg.branch_roots
    n = len(play.episodes)
    forest = Forest(rcfg, [0] * n, [()] * n)
    span = forest.span(0)
    root_keys = game_keys(key, games, roots)
    play.keys = np.zeros((n, 2), np.uint32)
    root_envs = [k * g_size + r * span for k in range(len(games)) for r in range(roots)]
    play.keys[root_envs] = root_keys
    play.stats.update(dict.fromkeys(BRANCH_COUNTERS, 0))
    live = set(play.live)
    started = [e for e in root_envs if e in live]
    for e in root_envs:
        if e not in live:
            started += release(play, forest, e)
    play.live[:] = sorted(started)
    return forest


def _playable(play: Play, e: int) -> bool:
    return play.episodes[e].env_error is None and not play.obs[e].won


def release(play: Play, forest: Forest, e: int) -> list[int]:
    """Env ``e``'s game ended before its next fork: the other envs of its subtree play lone games from the
    reset, each with its leaf's key. Returns those that can play (their reset ran and is not over)."""
    level = forest.level[e]
    if level >= forest.forks:
        return []
    c, f = play.rcfg.branch_children, forest.forks
    out = []
    for x in range(e + 1, e + forest.span(level)):
        path = leaf_path(x % play.rcfg.group_size, c, f)
        k = play.keys[e]
        for d in path[level:]:
            k = _fold(k, [d])[0]
        play.keys[x], forest.level[x], forest.path[x] = k, f, path
        play.stats["branch_released"] += 1
        if _playable(play, x):
            out.append(x)
    return out


def fork(play: Play, forest: Forest, pool, e: int) -> list[int]:
    """Forks env ``e``'s game (it has just played ``branch_turns[level]`` turns and plays on) into its
    siblings' envs; returns the siblings that play on from its state.

    Raises:
      ReplayDivergedError: a sibling's game did not reach the state (a replay gave another observation,
        or the restored game shows another observation than the forked one).
    """
    level, c = forest.level[e], play.rcfg.branch_children
    step = forest.span(level + 1)
    kids = [e + d * step for d in range(1, c)]
    results = pool.fork(e, kids)
    keys = _fold(np.repeat(play.keys[e][None], c, 0), range(c))
    parent_rows = [r for r in play.rows if r.traj == e]
    path = forest.path[e]
    play.keys[e], forest.level[e], forest.path[e] = keys[0], level + 1, (*path, 0)
    play.stats["branch_forks"] += 1
    out = []
    for d, (x, res) in enumerate(zip(kids, results), start=1):
        parent = play.episodes[e]
        play.episodes[x] = dataclasses.replace(parent, traj_id=x, task_info=dict(parent.task_info))
        play.keys[x], forest.level[x], forest.path[x] = keys[d], level + 1, (*path, d)
        play.history[x] = list(play.history[e])
        play.rows += [dataclasses.replace(r, traj=x, source=r.source or (r.traj, r.step)) for r in parent_rows]
        play.stats["branch_copied_rows"] += len(parent_rows)
        if res.fault is not None:
            play.episodes[x].env_error, play.episodes[x].env_error_detail = res.fault, res.detail
            out += release(play, forest, x)
            continue
        obs = clean_observation(res.obs)
        if obs != play.obs[e]:
            raise ReplayDivergedError(
                f"fork of env {e} into env {x} at turn {parent.length}: the restored game shows {obs.text[:80]!r}, "
                f"the forked one {play.obs[e].text[:80]!r}"
            )
        play.obs[x] = obs
        out.append(x)
    return out


class BranchTurns(HostTurns):
    """``protocols.TurnPort`` of a branching ``collect``: ``HostTurns`` whose ``book`` forks a game at its
    branch turns (or releases its subtree when it ends before one); ``spawned`` hands the loop the envs
    that start playing after a step."""

    def __init__(self, play: Play, engine: EngineLike, pool, forest: Forest):
        super().__init__(play, engine)
        self.pool, self.forest = pool, forest
        self._spawned: dict[int, list[int]] = {}

    def book(self, env: int, reply: Reply, result: Any) -> bool:
        plays_on = book(self.play, env, reply, result, self.max_new)
        self.play.rows[-1].branch = self.forest.path[env]
        level = self.forest.level[env]
        if level < self.forest.forks:
            if not plays_on:
                self._spawned[env] = release(self.play, self.forest, env)
            elif self.play.episodes[env].length == self.play.rcfg.branch_turns[level]:
                self._spawned[env] = fork(self.play, self.forest, self.pool, env)
        return plays_on

    def spawned(self, env: int) -> list[int]:
        return self._spawned.pop(env, [])


def sampled_singletons(rows: Sequence[StepRecord]) -> tuple[float, float]:
    """(rows, sampled steps) counted over sampled steps only (a repeated prefix row counts once): the
    sampled steps whose exact-anchor step group (task group, anchor text) holds no other sampled step, and
    all sampled steps; the singleton share that branching changes without counting its copies."""
    seen: set[tuple[int, int]] = set()
    groups: dict[tuple[int, str], int] = {}
    for r in rows:
        src = r.source or (r.traj, r.step)
        if src in seen:
            continue
        seen.add(src)
        groups[(r.group, r.anchor)] = groups.get((r.group, r.anchor), 0) + 1
    return float(sum(v == 1 for v in groups.values())), float(len(seen))
