"""The validation panels of a run: which games they hold, their env pools, and playing them.

Shared by the trainer (``Trainer.validate``, before and after RL) and by ``launch.eval`` (the panels
of a config on any checkpoint, no training state), so both score a policy the same way: the same
panel games, the same sampler keys (``panel_key``), the same per-task means (``panel_record``).

Multi-host: each process plays the panel tasks ``i`` with ``i % num_hosts == process_index`` and the
per-task results are summed over processes (each task has one owner).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import environments
from bipace_jax import config as config_lib
from bipace_jax import distributed, tasks
from bipace_jax import metric_keys as keys
from bipace_jax.rollout import Episode, RolloutResult, collect
from bipace_jax.stats import panel_metrics
from environments.pool import EnvPool

__all__ = [
    "PANELS",
    "Panels",
    "make_pool",
    "panel_key",
    "panel_record",
    "per_task",
    "probe",
    "select",
    "start_pools",
    "validate",
]

#: The panels, in the order they are played: seen goals (unseen game seeds), then held-out goals.
PANELS = (keys.VAL, keys.VAL_HOLDOUT)
_FIELDS = {keys.VAL: "val.options", keys.VAL_HOLDOUT: "val.holdout_options"}
_LABELS = {keys.VAL: "validation seen", keys.VAL_HOLDOUT: "validation held-out"}


@dataclasses.dataclass(frozen=True)
class Panels:
    """A run's task sets.

    Attributes:
      train_ids, holdout_ids: training and held-out goal ids of the training game (ascending).
      games: panel name (``PANELS``) -> its ``(task_id, game_seed)`` pairs.
      options: panel name -> its own game options (on top of ``env.options``; {} = the training game).
      task_infos: panel name -> the ``task_info(task_id) -> dict`` of the game it plays.
    """

    train_ids: list[int]
    holdout_ids: list[int]
    games: dict[str, list[tuple[int, int]]]
    options: dict[str, dict[str, Any]]
    task_infos: dict[str, Callable[[int], dict]]


def probe(spec, game, options: dict[str, Any], field: str):
    """One game built in this process with ``options`` (task count, task infos).

    ``game``: a registered name or a callable ``game(**options)``.

    Raises:
      ConfigError: the game refused ``options`` (names ``config.<field>``).
    """
    try:
        return game(**options) if callable(game) else environments.make(game, **options)
    except (TypeError, ValueError, FileNotFoundError, ImportError) as e:
        raise config_lib.ConfigError(f"config.{field}: the game {spec.env.name!r} refused {options}: {e}") from None


def select(spec, game) -> Panels:
    """Training and held-out goals, and the validation panels (from the training goals, or from the
    games of ``val.options`` / ``val.holdout_options``, e.g. ALFWorld's valid splits).

    Raises:
      ConfigError: a game refused its options, or ``tasks.train`` selects nothing outside the held-out goals.
    """
    s = spec
    opts = {"max_steps": s.env.max_steps, **s.env.options}
    own = {keys.VAL: s.val.options, keys.VAL_HOLDOUT: s.val.holdout_options}
    base = probe(s, game, opts, "env.options")
    probes = {k: probe(s, game, {**opts, **o}, _FIELDS[k]) if o else base for k, o in own.items()}
    train_ids, holdout_ids = tasks.split_holdout(
        tasks.select_tasks(s.tasks.train, base.num_tasks, base.task_info),
        tasks.select_tasks(s.tasks.holdout, base.num_tasks, base.task_info),
        s.tasks.holdout_every,
    )
    if not train_ids:
        raise config_lib.ConfigError(
            f"config.tasks.train selects no task outside the held-out goals, got {s.tasks.train!r}"
        )
    v = s.val
    seen = list(range(probes[keys.VAL].num_tasks)) if own[keys.VAL] else train_ids
    held = list(range(probes[keys.VAL_HOLDOUT].num_tasks)) if own[keys.VAL_HOLDOUT] else holdout_ids
    panel_options = (v.num_tasks, v.num_holdout_tasks, v.seed, v.panel, v.seeds_per_goal)
    val_panel, holdout_panel = tasks.validation_panel(seen, held, *panel_options)
    return Panels(
        train_ids=train_ids,
        holdout_ids=holdout_ids,
        games={keys.VAL: val_panel, keys.VAL_HOLDOUT: holdout_panel},
        options=own,
        task_infos={name: p.task_info for name, p in probes.items()},
    )


def make_pool(spec, game, options: dict[str, Any], n: int) -> EnvPool:
    """An ``EnvPool`` of ``n`` games of ``game`` with ``options``, the run's timeout and worker count
    (``env.num_workers``, at most one per game: a by-process learner's pool may hold a single game)."""
    pool_kw = {"num_workers": min(spec.env.num_workers, n)} if spec.env.num_workers else {}
    return EnvPool(game, n, env_options=options, timeout_s=spec.env.timeout_s, **pool_kw)


def start_pools(
    spec, game, panels: Panels, num_hosts: int, train_games: int = 0, *, validating: bool | None = None
) -> tuple[EnvPool, dict]:
    """(the training game's pool, panel name -> the pool it plays on).

    The training game's pool holds ``train_games`` and the games of every panel without options of its
    own; a panel with options gets its own pool. Unless ``validating`` (None: ``val.validating``, the
    run validates at all), no panel is sized.
    """
    s = spec
    validating = s.val.validating if validating is None else validating
    rows = {k: math.ceil(len(g) * s.val.group_size / num_hosts) if validating else 0 for k, g in panels.games.items()}
    opts = {"max_steps": s.env.max_steps, **s.env.options}
    shared = [n for k, n in rows.items() if not panels.options[k]]
    pool = make_pool(s, game, opts, max([train_games, *shared, 1]))
    own = panels.options
    return pool, {k: make_pool(s, game, {**opts, **own[k]}, n) if own[k] and n else pool for k, n in rows.items()}


def panel_key(spec, name: str) -> jax.Array:
    """The sampler key of panel ``name``: a function of ``val.seed`` and the panel only, so every
    validation of a run (and ``launch.eval`` of the same config) plays the same draws."""
    return jax.random.fold_in(jax.random.PRNGKey(spec.val.seed), 1 + len(name))  # 4 "val", 12 "val/holdout"


def panel_record(
    name: str,
    games: list[tuple[int, int]],
    task_info: Callable[[int], dict],
    categories: Sequence[str],
    per_task: dict[str, np.ndarray],
) -> dict[str, Any]:
    """One panel's record from its summed per-task arrays (``won``, ``length``, ``errors``, ``score``,
    float [num_tasks], ``per_task``): ``stats.panel_metrics``, WebShop's unwinnable goals, success per
    category. ``games``: the panel's ``(task_id, seed)`` pairs; ``task_info``: its game's;
    ``categories``: the game's ``GameSpec.categories``. Shared by the trainer's validation, ``launch.eval``
    and the warm start."""
    out = panel_metrics(name, per_task["won"], per_task["length"], per_task["errors"], per_task["score"])
    best = [task_info(tid).get("best_score") for tid, _ in games]  # WebShop: goals no purchase can win
    if any(b is not None for b in best):
        out[f"{name}/unwinnable_goals"] = sum(b is not None and b < 1.0 for b in best)
    for key_name in categories:
        cats: dict[str, list] = {}
        for (tid, _), w in zip(games, per_task["won"]):
            v = task_info(tid).get(key_name)
            if v is not None and not np.isnan(w):
                cats.setdefault(str(v), []).append(w)
        for v, ws in sorted(cats.items()):
            out[f"{name}/success_rate/{key_name}_{v}"] = float(np.mean(ws))
            out[f"{name}/tasks/{key_name}_{v}"] = len(ws)
    return out


def per_task(
    episodes: Sequence[Episode], mine: Sequence[int], num_tasks: int, group_size: int
) -> dict[str, np.ndarray]:
    """This host's per-task arrays (float64 [num_tasks]: ``won``, ``length``, ``errors``, ``score``) of
    the ``episodes`` it played (``group_size`` consecutive ones per task ``mine[j]``, in order): zeros on
    other hosts' tasks (the gather sums), NaN on a task whose games all faulted (left out of the means,
    counted in ``errors``)."""
    out = {k: np.zeros((num_tasks,)) for k in ("won", "length", "errors", "score")}
    for j, i in enumerate(mine):  # G consecutive episodes per task group, groups in order
        played = [e for e in episodes[j * group_size : (j + 1) * group_size] if e.env_error is None]
        out["won"][i] = np.mean([e.won for e in played]) if played else np.nan
        out["length"][i] = np.mean([e.length for e in played]) if played else np.nan
        out["errors"][i] = group_size - len(played)
        scores = [e.score for e in played if e.score is not None]
        out["score"][i] = np.mean(scores) if scores else np.nan
    return out


def validate(
    actor, engine, pools: dict, spec, panels: Panels, *, progress: bool = False, on_panel=None
) -> tuple[dict[str, Any], dict[str, RolloutResult | None]]:
    """Play every non-empty panel at ``val.temperature`` (``RunSpec.val_sampler.temperature``) on its pool.

    Args:
      actor, engine: the policy and the sampling engine (``rollout.protocols.EngineLike``).
      pools: panel name -> ``EnvPool`` (``start_pools``).
      progress: tqdm bars over turns (labelled "validation seen" / "validation held-out").
      on_panel: optional ``on_panel(label)`` called before each panel plays (the trainer's phase display).

    Returns:
      (record: ``val/...`` and ``val/holdout/...`` metrics (``panel_record``) and
      ``metric_keys.VALIDATION_SECONDS``; panel name -> this host's ``RolloutResult``, None when this
      host played none of its tasks).
    """
    out: dict[str, Any] = {}
    results: dict[str, RolloutResult | None] = {}
    t0, G = time.perf_counter(), spec.val.group_size
    for name in PANELS:
        panel = panels.games[name]
        if not panel:
            continue
        mine = list(range(distributed.process_index(), len(panel), distributed.process_count()))
        res = None
        if mine:
            if on_panel is not None:
                on_panel(_LABELS[name])
            label = progress and f"{_LABELS[name]} {spec.env.name}"
            games = [panel[i] for i in mine]
            res = collect(
                actor,
                engine,
                pools[name],
                games,
                spec.val_rollout,
                panel_key(spec, name),
                temperature=spec.val_sampler.temperature,
                progress=label,
            )
        results[name] = res
        mine_arrays = per_task(res.episodes if res is not None else [], mine, len(panel), G)
        summed = {k: distributed.allgather(a).sum(0) for k, a in mine_arrays.items()}
        categories = spec.val_rollout.spec.categories
        out.update(panel_record(name, panel, panels.task_infos[name], categories, summed))
    out[keys.VALIDATION_SECONDS] = time.perf_counter() - t0
    return out, results
