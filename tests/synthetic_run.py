"""A synthetic run folder (config.json, metrics.jsonl) with every key family the plots and reports read."""

from __future__ import annotations

import json
import os

import numpy as np

GROUP_SIZE = 4  # val.group_size: games per validation task
TASKS = 10  # tasks per validation panel (5 of depth 1, 5 of depth 2)


def records(num_iterations: int = 6, seed: int = 0, val_every: int = 2) -> list[dict]:
    """One record per iteration, as the trainer writes them (validation every ``val_every`` and at the end)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num_iterations):
        r = {
            "iteration": i,
            "train/success_rate": 0.3 + 0.1 * i,
            "loss/pg_loss": -0.01 * i,
            "loss/kl": 0.001 * i,
            "loss/entropy": 1.0 - 0.05 * i,
            "loss/clip_frac": 0.02,
            "estimator/epsilon": 0.05,
            "estimator/hash_singleton_group_rate": 0.6,
            "estimator/cluster_singleton_group_rate": 0.2 + 0.01 * i,
            "estimator/singleton_row_rate": 0.1,
            "estimator/pace_row_rate": 0.6,
            "estimator/loo_row_rate": 0.3,
            "time/rollout_s": 10.0,
            "time/old_logprobs_s": 2.0,
            "time/ref_logprobs_s": 0.0,
            "time/estimator_s": 0.5,
            "time/update_s": 15.0 + float(rng.uniform(0, 1)),
        }
        if i == 0:
            r.update(
                {f"estimator/calibration_singleton_rate/{e:g}": v for e, v in ((0.01, 0.5), (0.02, 0.3), (0.05, 0.2))}
            )
            r.update(_panel("val_before", 0.5, 0.2))
        if (i + 1) % val_every == 0 or i == num_iterations - 1:
            r.update(_panel("val", 0.5 + 0.08 * (i + 1) + 0.02 * seed, 0.3 + 0.05 * (i + 1) + 0.02 * seed))
            r["time/validation_s"] = 8.0
        rows.append(r)
    return rows


def _panel(prefix: str, depth1: float, depth2: float) -> dict:
    return {
        f"{prefix}/success_rate": (depth1 + depth2) / 2,
        f"{prefix}/tasks": TASKS,
        f"{prefix}/env_errors": 0,
        f"{prefix}/success_rate/depth_1": depth1,
        f"{prefix}/success_rate/depth_2": depth2,
        f"{prefix}/tasks/depth_1": TASKS // 2,
        f"{prefix}/tasks/depth_2": TASKS // 2,
    }


def write_run(path, *, seed: int = 0, estimator: str = "grpo", num_iterations: int = 6) -> list[dict]:
    """Writes the run folder at ``path``; returns its records."""
    os.makedirs(path, exist_ok=True)
    config = {
        "seed": seed,
        "num_iterations": num_iterations,
        "estimator": {"name": estimator, "calibration": {"target_singleton_rate": 0.25}},
        "val": {"group_size": GROUP_SIZE},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    rows = records(num_iterations, seed)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows
