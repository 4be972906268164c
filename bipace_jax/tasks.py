"""Which games a run plays: task selectors, the hold-out split, the training schedule, validation panels.

Pure host-side bookkeeping over task ids and game seeds (no JAX, no games): every function here is
deterministic in its arguments, so a resumed or multi-host run recomputes the same schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bipace_jax.config import parse_selector

TRAIN_SEED_RANGE = 1_000_000  # training game seeds lie in [0, 10^6); validation seeds at or above it


def select_tasks(selector: str, num_tasks: int, task_info: Callable[[int], dict]) -> list[int]:
    """Task ids matched by a selector string, ascending.

    ``"all"``; ``"a:b"`` (range); ``"i,j,k"``; ``"key=v1,v2"`` (``task_info(id)[key]`` printed equals
    one of the values); parts joined with ``"&"`` intersect. ``""`` selects nothing.

    Raises:
      ValueError: a selector outside the grammar (``config.parse_selector``), an id outside
        ``[0, num_tasks)``, or a selector that matches no task.
    """
    parts = parse_selector(selector)
    if not parts:
        return []
    ids = set(range(num_tasks))
    for part in parts:
        if part[0] == "key":
            _, key, wanted = part
            ids &= {i for i in range(num_tasks) if str(task_info(i).get(key)) in wanted}
        elif part[0] == "range":
            _, a, b = part
            if not 0 <= a < b <= num_tasks:
                raise ValueError(f"task selector {selector!r}: range {a}:{b} must lie in [0, {num_tasks}]")
            ids &= set(range(a, b))
        elif part[0] == "ids":
            bad = sorted(i for i in part[1] if not 0 <= i < num_tasks)
            if bad:
                raise ValueError(f"task selector {selector!r}: ids {bad} outside [0, {num_tasks})")
            ids &= part[1]
    if not ids:
        raise ValueError(f"task selector {selector!r} matches no task")
    return sorted(ids)


def split_holdout(ids: list[int], holdout: list[int], every: int) -> tuple[list[int], list[int]]:
    """(training ids, held-out ids): ``holdout`` plus every ``every``-th id of ``ids`` (ascending;
    positions every-1, 2*every-1, ...; 0 = none) are held out and removed from training."""
    ids = sorted(ids)
    held = set(holdout) | (set(ids[every - 1 :: every]) if every else set())
    return [t for t in ids if t not in held], sorted(held)


def train_task(train_ids: list[int], seed: int, index: int) -> tuple[int, int]:
    """(task_id, game_seed) of global task group number ``index`` of a run.

    The train ids are visited in epochs, each a fresh permutation seeded by ``(seed, epoch)``; the game
    seed of every group is drawn from ``(seed, index)`` in ``[0, TRAIN_SEED_RANGE)`` (validation seeds
    are ``>= TRAIN_SEED_RANGE``: never a training game).
    """
    epoch, k = divmod(index, len(train_ids))
    perm = np.random.default_rng([seed, epoch, 7]).permutation(len(train_ids))
    game_seed = int(np.random.default_rng([seed, index, 11]).integers(0, TRAIN_SEED_RANGE))
    return train_ids[int(perm[k])], game_seed


def validation_panel(
    seen: list[int],
    heldout: list[int],
    num_seen: int,
    num_heldout: int,
    seed_base: int,
    mode: str = "spread",
    seeds_per_goal: int = 1,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The fixed validation panels ``(seen goals, held-out goals)`` of ``(task_id, game_seed)`` pairs.

    ``mode="spread"``: ``num_seen`` goals evenly spaced over ``seen`` (``linspace`` indices, rounded)
    and ``num_heldout`` over ``heldout`` (all when fewer), each played with ``seeds_per_goal`` game
    seeds (goal by goal); the seeds are ``seed_base + k`` with k running over both panels in that
    order. ``mode="random"``: distinct goals drawn with ``seed_base``, each with ``seeds_per_goal``
    seeds drawn in ``[seed_base, 2^31)``. ``seed_base >= TRAIN_SEED_RANGE`` keeps every panel game
    unseen in training (new distractors).

    Raises:
      ValueError: ``mode`` is neither ``"spread"`` nor ``"random"``.
    """
    if mode == "spread":

        def pick(ids, n):
            if n >= len(ids):
                return list(ids)
            return [ids[int(i)] for i in np.linspace(0, len(ids) - 1, n).round()] if n else []

        goals = pick(list(seen), num_seen), pick(list(heldout), num_heldout)
        seeds = iter(range(seed_base, seed_base + seeds_per_goal * (len(goals[0]) + len(goals[1]))))
        return tuple([(t, next(seeds)) for t in g for _ in range(seeds_per_goal)] for g in goals)
    if mode != "random":
        raise ValueError(f"validation panel mode must be 'spread' or 'random', got {mode!r}")
    rng = np.random.default_rng(seed_base)
    out = []
    for ids, n in ((seen, num_seen), (heldout, num_heldout)):
        chosen = rng.permutation(len(ids))[: min(n, len(ids))]
        seeds = rng.integers(seed_base, 2**31 - 1, size=(len(chosen), seeds_per_goal))
        out.append([(ids[int(i)], int(s)) for i, row in zip(chosen, seeds) for s in row])
    return out[0], out[1]
