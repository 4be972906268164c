"""Branching on vs off at the same budget: a sweep's arms (``rollout.branch_turns``) side by side.

    python -m launch.branch_results runs/branch_sweep [more studies or runs] --out=docs/results/branching_textcraft_tiny

Reads every run folder of the studies (``launch.report.find_runs``; arms: ``launch.report.arms_of``) and,
per arm over its seeds (mean and 95% Student t-interval, ``launch.report.t_quantile``), at iteration 0
(the same warm-start policy in every arm: the rollout's own effect) and over the iterations each run
logged (partial runs included, named with their iteration count):

* training success (``train/success_rate``: the games the rollout played, all G of every task group);
* ``estimator/hash_singleton_row_rate`` (rows alone in their exact-anchor step group, as the estimator
  sees the batch: a child's repeated prefix rows count) and ``rollout/sampled_singleton_row_rate``
  (sampled steps only, each repeated prefix once; without branching every row is sampled, so the arm's
  value is its hash singleton row rate);
* ``estimator/loo_row_rate`` and ``estimator/pace_row_rate`` (rows on PACE's leave-one-out fallback and
  on its Q - V); ``train/rows``, ``rollout/response_tokens`` (the sampling budget), ``rollout/branch_*``.

Writes ``branching.json``, ``branching.md`` and ``branching.png`` (the per-iteration means with their
bands) to ``--out``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from launch.report import arm_label, arms_of, find_runs, t_quantile

KEYS = (
    "train/success_rate",
    "estimator/hash_singleton_row_rate",
    "rollout/sampled_singleton_row_rate",
    "estimator/loo_row_rate",
    "estimator/pace_row_rate",
    "train/rows",
    "rollout/response_tokens",
    "rollout/branch_forks",
    "rollout/branch_copied_rows",
    "rollout/branch_released",
)


def _branch_turns(run: str) -> list[int]:
    with open(os.path.join(run, "config.json")) as f:
        return list(json.load(f).get("rollout", {}).get("branch_turns") or [])


def _rows(run: str) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def _value(row: dict, key: str, branching: bool) -> float | None:
    if key == "rollout/sampled_singleton_row_rate" and not branching:
        key = "estimator/hash_singleton_row_rate"  # no copies: every row is sampled
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def interval(values: list[float]) -> dict:
    """Mean, sample std and the 95% t-interval half width over ``values`` (none for one value)."""
    n = len(values)
    mean = float(np.mean(values)) if n else float("nan")
    sd = float(np.std(values, ddof=1)) if n > 1 else None
    half = t_quantile(n - 1) * sd / math.sqrt(n) if sd is not None else None
    return {"n": n, "mean": mean, "std": sd, "ci95": half}


def summarize(studies: list[str]) -> dict:
    runs = find_runs(studies)
    out = {"studies": studies, "arms": {}}
    for arm, members in sorted(arms_of(runs).items()):
        branching = bool(_branch_turns(members[0]))
        per_seed = {k: [] for k in KEYS}
        curves = {k: {} for k in KEYS}
        iterations = {}
        for run in members:
            rows = _rows(run)
            iterations[os.path.basename(run.rstrip("/"))] = len(rows)
            for k in KEYS:
                vals = [v for v in (_value(r, k, branching) for r in rows) if v is not None]
                if vals:
                    per_seed[k].append(float(np.mean(vals)))  # the run's mean over its iterations
                for i, r in enumerate(rows):
                    v = _value(r, k, branching)
                    if v is not None:
                        curves[k].setdefault(i, []).append(v)
        out["arms"][arm] = {
            "label": arm_label(arm),
            "branching": branching,
            "iterations_logged": iterations,
            "over_seeds": {k: interval(v) for k, v in per_seed.items() if v},
            "iteration_0": {k: interval(c[0]) for k, c in curves.items() if 0 in c},
            "curves": {k: {i: interval(v) for i, v in sorted(c.items())} for k, c in curves.items() if c},
        }
    return out


def to_markdown(s: dict, which: str = "over_seeds") -> str:
    lines = [
        "| arm | runs (iterations logged) | " + " | ".join(k for k in KEYS[:5]) + " |",
        "|---|---|" + "---|" * 5,
    ]
    for a in s["arms"].values():
        cells = []
        for k in KEYS[:5]:
            st = a[which].get(k)
            if st is None:
                cells.append("-")
            elif st["ci95"] is None:
                cells.append(f"{100 * st['mean']:.1f}% (n = 1)")
            else:
                cells.append(f"{100 * st['mean']:.1f}% ± {100 * st['ci95']:.1f} (n = {st['n']})")
        runs = ", ".join(str(v) for v in a["iterations_logged"].values())
        lines.append(f"| {a['label']} | {runs} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = KEYS[:4]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4))
    for ax, k in zip(axes, keys):
        for a in s["arms"].values():
            c = a["curves"].get(k, {})
            if not c:
                continue
            x = np.array(sorted(int(i) for i in c))
            m = np.array([c[i]["mean"] for i in sorted(c, key=int)])
            h = np.array([c[i]["ci95"] or 0.0 for i in sorted(c, key=int)])
            ax.plot(x, m, marker="o", label=f"branch_turns={a['label']}")
            ax.fill_between(x, m - h, m + h, alpha=0.2)
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("iteration (policy after i updates)")
        ax.set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.suptitle("branching on vs off, same games per task group (mean over seeds, band: 95% t-interval)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if not a.startswith("--out=")]
    outs = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--out=")]
    if not args:
        print(__doc__)
        return 2
    out = outs[0] if outs else os.path.join(args[0], "branching")
    os.makedirs(out, exist_ok=True)
    s = summarize(args)
    with open(os.path.join(out, "branching.json"), "w") as f:
        json.dump(s, f, indent=1, sort_keys=True)
    md = "At iteration 0 (the warm-start policy in every arm):\n\n" + to_markdown(s, "iteration_0")
    md += "\nMean over each run's logged iterations:\n\n" + to_markdown(s)
    with open(os.path.join(out, "branching.md"), "w") as f:
        f.write(md)
    plot(s, os.path.join(out, "branching.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
