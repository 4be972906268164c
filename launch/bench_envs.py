"""Benchmark: environment steps/s in a plain in-process loop vs EnvPool with 1 and 2 workers.

    python -m launch.bench_envs [--num_envs=8] [--turns=300] [--out=benchmarks/envs.json]

Games: TextCraft (actions: the oracle's plan of each episode, computed before timing), ALFWorld
when ``environments.make("alfworld")`` works (random admissible actions; skipped with the reason
otherwise), WebShop (our engine on ``--webshop_options``' data, default the shipped
10-product sample; the oracle's episodes, computed before timing: searches, item pages, option
clicks and purchases), and a synthetic game that burns 36 ms of CPU a step (``FaultyEnv(step_cost_ms=36)``,
about an ALFWorld step's cost on a generated game, see ``environments/alfworld.py``) to show the pool on a slow game. Every mode
plays the same episodes: ``num_envs`` games stepped together for ``turns`` turns, finished games
reset (in one batched call) to the next task. Steps/s counts env steps over the whole loop,
resets included, best of ``--repeats`` runs; pool start-up is reported apart. Prints a table, writes JSON whose headline
ratios sit under keys containing ``speedup`` (pool steps/s over in-process steps/s).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import random
import time
from collections.abc import Callable
from typing import Any

from absl import app, flags

import environments
from environments.alfworld import FIXTURES_DIR
from environments.pool import EnvPool, ResetResult
from environments.testing import FaultyEnv
from launch._common import ROOT, write_json

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_envs", 8, "games stepped together")
flags.DEFINE_integer("turns", 300, "turns per mode for TextCraft (each steps every game once)")
flags.DEFINE_integer("slow_turns", 8, "turns per mode for the 36 ms synthetic game and ALFWorld")
flags.DEFINE_integer("repeats", 3, "runs per mode; the best (highest steps/s) is reported, all are kept")
flags.DEFINE_string(
    "alfworld_options",
    '{"expert_type": null}',
    "JSON options for make('alfworld'); without data_path and $ALFWORLD_DATA the committed "
    "fixture games (environments/data/alfworld_fixtures) are used",
)
flags.DEFINE_string(
    "webshop_options",
    '{"data_dir": "sample", "split": "test"}',
    "JSON options for make('webshop'); set data_dir (or $WEBSHOP_DATA) to WebShop's data folder for the real catalogue",
)
flags.DEFINE_integer("webshop_turns", 100, "turns per mode for WebShop")
flags.DEFINE_string("out", "benchmarks/envs.json", "where to write the JSON")


class _InProcess:
    """The pool's reset/step interface over a plain list of environments in this process."""

    def __init__(self, factory: Callable[[], Any], num_envs: int):
        self.envs = [factory() for _ in range(num_envs)]

    def reset(self, idx, tasks, seeds):
        return [ResetResult(self.envs[i].reset(t, s), {}) for i, t, s in zip(idx, tasks, seeds)]

    def step(self, idx, actions):
        return [self.envs[i].step(a) for i, a in zip(idx, actions)]


def _drive(runner, num_envs: int, num_tasks: int, turns: int, policy) -> dict[str, float]:
    """Step every game ``turns`` times; returns steps, resets, seconds."""
    episode = [0] * num_envs
    rng = random.Random(0)

    def schedule(i):
        k = (i + episode[i] * num_envs) % num_tasks
        return k, 1000 + i + episode[i] * num_envs

    t0 = time.perf_counter()
    idx = list(range(num_envs))
    first = [schedule(i) for i in idx]
    obs = [r.obs for r in runner.reset(idx, [f[0] for f in first], [f[1] for f in first])]
    state = {i: (first[i], obs[i], 0) for i in idx}
    steps = resets = 0
    for _ in range(turns):
        actions = [policy(state[i][0], state[i][1], state[i][2], rng) for i in idx]
        results = runner.step(idx, actions)
        steps += len(idx)
        finished = []
        for i, (o, _, done, _) in zip(idx, results):
            task, _, n = state[i]
            state[i] = (task, o, n + 1)
            if done:
                episode[i] += 1
                finished.append(i)
        if finished:
            nxt = [schedule(i) for i in finished]
            new = runner.reset(finished, [x[0] for x in nxt], [x[1] for x in nxt])
            resets += len(finished)
            for i, x, r in zip(finished, nxt, new):
                state[i] = (x, r.obs, 0)
    return {"steps": steps, "resets": resets, "seconds": time.perf_counter() - t0}


def _bench_game(env, options, num_tasks, turns, policy) -> dict[str, Any]:
    """``env`` (a registered game name or an env class) in-process and in EnvPools of 1 and 2 workers."""
    num_envs = FLAGS.num_envs
    factory = env if callable(env) else functools.partial(environments.make, env)
    out: dict[str, Any] = {"num_envs": num_envs, "turns": turns}

    def best(runner) -> dict[str, Any]:
        runs = [_drive(runner, num_envs, num_tasks, turns, policy) for _ in range(FLAGS.repeats)]
        top = min(runs, key=lambda r: r["seconds"])
        return {
            **top,
            "steps_per_s": top["steps"] / top["seconds"],
            "all_steps_per_s": [r["steps"] / r["seconds"] for r in runs],
        }

    out["inprocess"] = best(_InProcess(lambda: factory(**options), num_envs))
    for workers in (1, 2):
        t0 = time.perf_counter()
        pool = EnvPool(env, num_envs, env_options=options, num_workers=workers, timeout_s=120.0)
        start = time.perf_counter() - t0
        try:
            r = best(pool)
            faults = pool.fault_count
        finally:
            pool.close()
        key = f"pool_{workers}_worker{'s' if workers > 1 else ''}"
        out[key] = {**r, "start_s": start, "faults": faults}
        out[f"speedup_{key}_vs_inprocess"] = out[key]["steps_per_s"] / out["inprocess"]["steps_per_s"]
    return out


GAMES = ("textcraft", "synthetic_36ms", "alfworld", "webshop")


def _oracle_policy(env, count: int, fallback: str):
    """A policy replaying the oracle's whole episode of each of ``_drive``'s first ``count`` (task, seed)
    keys, played before timing (the games are deterministic); ``fallback`` once it is used up."""
    plans = {}
    for i in range(count):
        task, seed = i % env.num_tasks, 1000 + i
        env.reset(task, seed)
        plan, done = [], False
        while not done and (action := env.oracle_action()) is not None:
            plan.append(action)
            done = env.step(action)[2]
        plans[(task, seed)] = plan

    def policy(key, obs, n, rng):
        plan = plans.get(key)
        return plan[n] if plan and n < len(plan) else fallback

    return policy


def main(argv):
    del argv
    num_envs = FLAGS.num_envs
    results: dict[str, Any] = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_avg_at_start": os.getloadavg(),
            "python": platform.python_version(),
        },
    }

    tc = environments.make("textcraft")
    policy = _oracle_policy(tc, num_envs * 64, "inventory")
    results["textcraft"] = _bench_game("textcraft", {"max_steps": 50}, tc.num_tasks, FLAGS.turns, policy)
    results["synthetic_36ms"] = _bench_game(
        FaultyEnv, {"max_steps": 20, "step_cost_ms": 36.0}, 100, FLAGS.slow_turns, lambda key, obs, n, rng: "x"
    )

    alf_options = json.loads(FLAGS.alfworld_options)
    if "data_path" not in alf_options and not os.environ.get("ALFWORLD_DATA") and os.path.isdir(FIXTURES_DIR):
        alf_options["data_path"] = FIXTURES_DIR
    try:
        probe = environments.make("alfworld", **alf_options)
        num_tasks = probe.num_tasks
        del probe
    except Exception as e:  # noqa: BLE001  (any failure to build ALFWorld skips it, with the reason)
        results["alfworld"] = {"skipped": f"make('alfworld') failed: {type(e).__name__}: {e}"}
    else:

        def alfworld_policy(key, obs, n, rng):
            acts = [a for a in (obs.admissible_actions or []) if a != "help"]
            return rng.choice(acts) if acts else "look"

        results["alfworld"] = _bench_game("alfworld", alf_options, num_tasks, FLAGS.slow_turns, alfworld_policy)
        # A path inside the project is recorded relative to its root: the JSON names no machine's folders.
        results["alfworld"]["options"] = {
            k: os.path.relpath(v, ROOT) if k == "data_path" and os.path.abspath(v).startswith(ROOT + os.sep) else v
            for k, v in alf_options.items()
        }
        results["alfworld"]["policy"] = "uniform over admissible actions except help, seeded"

    ws_options = json.loads(FLAGS.webshop_options)
    try:
        ws_tasks = environments.make("webshop", **ws_options).num_tasks
    except Exception as e:  # noqa: BLE001  (any failure to build WebShop skips it, with the reason)
        results["webshop"] = {"skipped": f"make('webshop') failed: {type(e).__name__}: {e}"}
    else:
        policy = _oracle_policy(environments.make("webshop", **ws_options), num_envs * 64, "click[back to search]")
        results["webshop"] = _bench_game("webshop", ws_options, ws_tasks, FLAGS.webshop_turns, policy)
        results["webshop"]["options"] = ws_options
        results["webshop"]["policy"] = "the oracle's episode of each (task, seed), computed before timing"

    results["machine"]["load_avg_at_end"] = os.getloadavg()
    load = max(results["machine"]["load_avg_at_start"][0], results["machine"]["load_avg_at_end"][0])
    if load >= (os.cpu_count() or 1):
        results["note"] = (
            f"measured on a contended machine (1-min load average up to {load:.1f} on "
            f"{os.cpu_count()} cores): no core was idle, so worker processes could not run in "
            "parallel with the rest of the load; pool speedups here are lower bounds"
        )
    results["speedup"] = {
        f"{game}_{k.split('speedup_')[1]}": v
        for game in GAMES
        for k, v in results[game].items()
        if k.startswith("speedup_")
    }

    print(f"{'game':<16}{'mode':<16}{'steps':>8}{'resets':>8}{'steps/s':>12}{'speedup':>10}")
    for game in GAMES:
        r = results[game]
        if "skipped" in r:
            print(f"{game:<16}skipped: {r['skipped']}")
            continue
        for mode in ("inprocess", "pool_1_worker", "pool_2_workers"):
            m = r[mode]
            sp = r.get(f"speedup_{mode}_vs_inprocess", 1.0)
            print(f"{game:<16}{mode:<16}{m['steps']:>8}{m['resets']:>8}{m['steps_per_s']:>12.1f}{sp:>10.2f}")
    if "note" in results:
        print("note:", results["note"])
    print(
        f"load average (1, 5, 15 min): start {results['machine']['load_avg_at_start']}, end {results['machine']['load_avg_at_end']}"
    )
    write_json(FLAGS.out, results, indent=2)


if __name__ == "__main__":
    app.run(main)
