"""Benchmark: jitted estimators vs the NumPy oracle vs a PyTorch-reference-style GiGPO grouping.

    python -m launch.bench_estimators [--quick]

Prints a table and writes benchmarks/estimators.json. Batches: `synthetic.rollout_like_arrays`, task
groups of 8 trajectories x 50 steps (N = 1,600 / 6,400 / 25,600 rows for 4 / 16 / 64 groups), D = 896 /
1,536 / 3,584 (Qwen2.5 0.5B / 1.5B / 7B hidden sizes). Jitted times: median of warm calls on device
inputs (`block_until_ready`; device times on a GPU/TPU), compile time apart. The NumPy oracle
(`reference.py`) is timed once per cell, and at N = 25,600 extrapolated linearly in N from N = 6,400
(`oracle_extrapolated`, see `oracle_extrapolation` in the JSON). The PyTorch-reference GiGPO grouping
is verl-agent's way: a Python dict per task group keyed by the observation string, returns by a
Python loop per trajectory, torch mean/std per step group. The similarity arm times
`similarity_groups` (verl-agent's `similarity_thresh` grouping, host side, at its default 0.95) on
ALFWorld-like anchor texts of the same batches (`observation_texts`), next to the jitted BiGPO
clustering: rows/s and the step groups and singleton rows each partition gives.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from bipace_jax.estimators import EstimatorConfig, StepBatch, core, reference, registry, similarity_groups
from bipace_jax.estimators.synthetic import rollout_like_arrays
from launch._common import seconds

GROUPS = (4, 16, 64)  # x 8 trajectories x 50 steps = 1,600 / 6,400 / 25,600 rows
DIMS = (896, 1536, 3584)
TARGET = 100.0
SIMILARITY_THRESH = 0.95  # verl-agent's default similarity_thresh
_LOCATIONS = ("countertop", "cabinet", "drawer", "fridge", "shelf", "sinkbasin", "stoveburner", "garbagecan")
_OBJECTS = ("apple", "bread", "knife", "mug", "egg", "lettuce", "tomato", "spoon", "fork", "plate", "cup", "pan")


def _median_ms(fn, repeats):
    fn()
    return 1e3 * float(np.median([seconds(fn) for _ in range(repeats)]))


def _jit_cell(batch, cfg, repeats):
    """(median warm milliseconds, compile seconds) of the jitted estimator on `batch`."""
    jitted, scalars = core.jitted_advantages(cfg)
    args = (batch, *scalars)
    t = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - t
    ms = _median_ms(lambda: jax.block_until_ready(compiled(*args)), repeats)
    return ms, compile_s


def copy_bandwidth_gb_s() -> float:
    """Host memory bandwidth seen by numpy: bytes read + written per second by a 256 MB copy."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    best = min(seconds(lambda: np.copyto(dst, src)) for _ in range(3))
    return 2 * src.nbytes / best / 1e9


def torch_dict_gigpo(arrays, gamma=0.95):
    """GiGPO step advantages the PyTorch-reference way (Python dict over observation strings)."""
    import torch

    obs_text = [
        f"You are in room {h}. Inventory: [{h % 7} items]. What do you do next?" for h in arrays["obs_hash"].tolist()
    ]
    t0 = time.perf_counter()
    n = len(obs_text)
    reward = torch.as_tensor(arrays["reward"])
    returns = torch.zeros(n)
    by_traj = defaultdict(list)
    for i, (t, s) in enumerate(zip(arrays["traj_id"].tolist(), arrays["step"].tolist())):
        by_traj[t].append((s, i))
    for rows in by_traj.values():
        running = 0.0
        for _, i in sorted(rows, reverse=True):
            running = reward[i] + gamma * running
            returns[i] = running
    groups = defaultdict(lambda: defaultdict(list))
    for i, (g, text) in enumerate(zip(arrays["group_id"].tolist(), obs_text)):
        groups[g][text].append(i)
    adv = torch.zeros(n)
    for by_obs in groups.values():
        for idx in by_obs.values():
            if len(idx) < 2:
                continue
            r = returns[idx]
            adv[idx] = (r - r.mean()) / (r.std() + 1e-6)
    return 1e3 * (time.perf_counter() - t0), adv


def observation_texts(arrays) -> list[str]:
    """ALFWorld-like anchor texts (~120 chars) for `rollout_like_arrays` rows: one location and object
    list per (task group, latent state), the 3 text variants of a state differ only in the inventory
    (near-duplicates), and a novel row (obs_hash >= 1,000,000) gets its own random text."""
    out = []
    for g, h in zip(arrays["group_id"].tolist(), arrays["obs_hash"].tolist()):
        r = np.random.default_rng(h if h >= 1_000_000 else (g, h // 3))
        loc = f"{_LOCATIONS[r.integers(len(_LOCATIONS))]} {r.integers(1, 5)}"
        picks = r.choice(len(_OBJECTS), int(r.integers(2, 6)), replace=False)
        objects = ", ".join(f"a {_OBJECTS[k]} {r.integers(1, 4)}" for k in picks)
        inventory = ("nothing", "a soapbar 1", "a key 2")[h % 3]
        out.append(f"You arrive at {loc}. On the {loc}, you see {objects}. You are carrying: {inventory}.")
    return out


def _partition_stats(group_id, ids):
    """(step groups, singleton row rate) of the partition by (group_id, ids)."""
    _, counts = np.unique(np.stack([group_id, ids]), axis=1, return_counts=True)
    return int(counts.size), float(np.sum(counts == 1) / len(ids)) if len(ids) else 0.0


def similarity_arm(groups, cells, dims):
    """Rows/s of `similarity_groups` vs exact hashing vs the jitted BiGPO clustering, per N."""
    rows = []
    for g in groups:
        arrays = rollout_like_arrays(g, dim=8, seed=g)
        texts = observation_texts(arrays)
        n = len(texts)
        t0 = time.perf_counter()
        sim = similarity_groups(texts, arrays["group_id"], SIMILARITY_THRESH)
        sim_ms = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        exact = similarity_groups(texts, arrays["group_id"], 0.0)
        exact_ms = 1e3 * (time.perf_counter() - t0)
        bigpo = {c["D"]: c for c in cells if c["estimator"] == "bigpo" and c["N"] == n}
        exact_groups, exact_singletons = _partition_stats(arrays["group_id"], exact)
        sim_groups, sim_singletons = _partition_stats(arrays["group_id"], sim)
        rows.append(
            dict(
                N=n,
                similarity_thresh=SIMILARITY_THRESH,
                similarity_ms=sim_ms,
                similarity_rows_per_s=n / sim_ms * 1e3,
                exact_hash_ms=exact_ms,
                exact_hash_rows_per_s=n / exact_ms * 1e3,
                bigpo_jit_rows_per_s={str(d): bigpo[d]["jit_rows_per_s"] for d in dims if d in bigpo},
                exact_step_groups=exact_groups,
                exact_singleton_row_rate=exact_singletons,
                similarity_step_groups=sim_groups,
                similarity_singleton_row_rate=sim_singletons,
            )
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (smoke run)")
    parser.add_argument("--out", default="benchmarks/estimators.json")
    args = parser.parse_args()
    groups, dims = ((1, 4), (64, 128)) if args.quick else (GROUPS, DIMS)
    headline = ("bipace_q", 8 * 50 * groups[1], dims[min(1, len(dims) - 1)])
    start = time.perf_counter()
    cells, oracle_measured = [], {}
    for d in dims:
        for g in groups:
            n = g * 8 * 50
            arrays = rollout_like_arrays(g, dim=d, seed=g * 7 + d)
            batch = StepBatch.from_numpy(**arrays)
            repeats = 3 if n * d > 30_000_000 else 5
            for name in registry.names():
                cfg = EstimatorConfig(name=name)
                ms, compile_s = _jit_cell(batch, cfg, repeats)
                oracle_ms = None
                if n <= groups[1] * 400:
                    oracle_ms = 1e3 * seconds(functools.partial(reference.compute_advantages_reference, batch, cfg))
                    oracle_measured[(name, n, d)] = oracle_ms
                cells.append(
                    dict(
                        estimator=name,
                        N=n,
                        D=d,
                        jit_ms=ms,
                        jit_rows_per_s=n / ms * 1e3,
                        compile_s=compile_s,
                        oracle_ms=oracle_ms,
                    )
                )
                print(
                    f"{name:12s} N={n:6d} D={d:5d} jit {ms:9.2f} ms  compile {compile_s:6.2f} s  "
                    f"oracle {'-' if oracle_ms is None else f'{oracle_ms:9.1f} ms'}",
                    flush=True,
                )
    n_mid = groups[1] * 400
    for c in cells:
        c["oracle_extrapolated"] = c["oracle_ms"] is None
        if c["oracle_ms"] is None:
            c["oracle_ms"] = oracle_measured[(c["estimator"], n_mid, c["D"])] * c["N"] / n_mid
        c["oracle_rows_per_s"] = c["N"] / c["oracle_ms"] * 1e3
        c["speedup_vs_oracle"] = c["oracle_ms"] / c["jit_ms"]

    torch_rows = []
    for g in groups:
        arrays = rollout_like_arrays(g, dim=8, seed=g)
        ms, _ = torch_dict_gigpo(arrays)
        jit = next(c for c in cells if c["estimator"] == "gigpo" and c["N"] == g * 400 and c["D"] == dims[0])
        torch_rows.append(
            dict(
                N=g * 400,
                torch_dict_ms=ms,
                torch_dict_rows_per_s=g * 400 / ms * 1e3,
                jit_gigpo_ms=jit["jit_ms"],
                speedup_jit_gigpo_vs_torch_dict=ms / jit["jit_ms"],
            )
        )

    sim_rows = similarity_arm(groups, cells, dims)

    print("\n| estimator | N | D | jit ms | jit rows/s | compile s | oracle ms | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        mark = "*" if c["oracle_extrapolated"] else ""
        print(
            f"| {c['estimator']} | {c['N']} | {c['D']} | {c['jit_ms']:.2f} | {c['jit_rows_per_s']:.3g} | "
            f"{c['compile_s']:.2f} | {c['oracle_ms']:.1f}{mark} | {c['speedup_vs_oracle']:.1f} |"
        )
    print("(* oracle extrapolated)\n\n| N | torch dict GiGPO ms | jit gigpo ms | speedup |\n|---|---|---|---|")
    for r in torch_rows:
        print(
            f"| {r['N']} | {r['torch_dict_ms']:.1f} | {r['jit_gigpo_ms']:.2f} | {r['speedup_jit_gigpo_vs_torch_dict']:.1f} |"
        )
    print(
        f"\n| N | similarity_groups({SIMILARITY_THRESH}) rows/s | exact hash rows/s | jit bigpo rows/s (D) | "
        "step groups exact / similarity | singleton rows exact / similarity |\n|---|---|---|---|---|---|"
    )
    for r in sim_rows:
        bigpo = ", ".join(f"{v:.3g} ({d})" for d, v in r["bigpo_jit_rows_per_s"].items())
        print(
            f"| {r['N']} | {r['similarity_rows_per_s']:.3g} | {r['exact_hash_rows_per_s']:.3g} | {bigpo} | "
            f"{r['exact_step_groups']} / {r['similarity_step_groups']} | "
            f"{r['exact_singleton_row_rate']:.3f} / {r['similarity_singleton_row_rate']:.3f} |"
        )
    head = next(c for c in cells if (c["estimator"], c["N"], c["D"]) == headline)
    print(
        f"\nheadline: jitted bipace_q at N={headline[1]}, D={headline[2]} is "
        f"{head['speedup_vs_oracle']:.1f}x the NumPy oracle (target {TARGET:.0f}x)"
    )
    result = dict(
        speedup_vs_oracle=head["speedup_vs_oracle"],
        headline=dict(
            estimator=headline[0],
            N=headline[1],
            D=headline[2],
            jit_ms=head["jit_ms"],
            oracle_ms=head["oracle_ms"],
            target_speedup=TARGET,
            target_met=head["speedup_vs_oracle"] >= TARGET,
        ),
        cells=cells,
        torch_dict_gigpo=torch_rows,
        similarity_grouping=sim_rows,
        oracle_extrapolation=(
            "cells with oracle_extrapolated=true (the oracle was not run there, it "
            f"would take minutes): oracle_ms(N, D) = measured(N={n_mid}, same D) * N / {n_mid} "
            "(linear in N: the oracle loops over rows, each compared with the "
            "clusters of its own task group, whose number does not grow with N)"
        ),
        environment=dict(
            backend=jax.default_backend(),
            devices=str(jax.devices()),
            cpu_count=os.cpu_count(),
            machine=platform.processor() or platform.machine(),
            jax=jax.__version__,
            numpy=np.__version__,
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            load_average_at_end=os.getloadavg(),
            copy_bandwidth_gb_s=copy_bandwidth_gb_s(),
        ),
        notes=(
            f"Target ({TARGET:.0f}x for {headline[0]} at N={headline[1]}, D={headline[2]}) "
            f"{'met' if head['speedup_vs_oracle'] >= TARGET else 'NOT met'} in this run. The exact "
            "greedy clustering needs every row's dot products with the running sums of the clusters "
            "of its task group (about N x K x D multiply-adds); the jitted kernel does them as "
            "batched matmuls over blocks of 16 rows and 16-slot cluster chunks (N x (16 + K rounded "
            "up to 16) x D), so it does about 2x the oracle's arithmetic, without its Python overhead. "
            "On a CPU both are bound by arithmetic and memory traffic (see copy_bandwidth_gb_s, and "
            "load_average_at_end for other jobs sharing the machine); grpo/gigpo read no fingerprints "
            "(see their cells and torch_dict_gigpo)."
        ),
        data="synthetic.rollout_like_arrays: 8 trajectories x 50 steps per task group, 30 latent "
        "states, fingerprint noise 0.15, 4% novel rows, 3 observation texts per latent state",
        total_runtime_s=time.perf_counter() - start,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['total_runtime_s']:.0f} s)")


if __name__ == "__main__":
    main()
