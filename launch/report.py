"""Aggregate run folders into the paper's table form: mean +- std over seeds, per arm.

    python -m launch.report runs/study [more run folders or studies] [--threshold=0.9] [--out=DIR]

Run folders are found as given or one level down (a folder with ``metrics.jsonl`` and
``config.json``). Runs whose configs differ only in ``seed`` or in fields a resume may change
(``bipace_jax.resume.NEUTRAL``: worker counts, logging, checkpoint cadence, the iteration budget) form one *arm*; an arm is named by the
fields that tell the arms apart (e.g. ``estimator.name=bipace_q``; plots label it by the values,
e.g. ``bipace_q``). Per arm, over its seeds (std: sample standard deviation, ddof 1; none for one
seed, printed "(n = 1)"):

* final and best validation success (``val/success_rate``, the before-RL validation counts as
  iteration 0 of "best"), the before-RL validation and the gain over it (final - before, per seed,
  in percentage points), per category (``val/success_rate/<key>``), held-out goals, WebShop's task
  score (``val/score``) where present;
* iterations to reach ``--threshold`` validation success (the first validation at or above it; the
  before-RL validation counts as 0 iterations), with how many seeds reached it;
* estimator diagnostics averaged over iterations: singleton step-group rate of exact hashing and of
  the clusters (each run records both, whichever partition it trains with), pairs, PACE and
  leave-one-out row shares, epsilon; BiPACE's share of the iteration time. A diagnostic that does not
  describe the arm's estimator (``estimator_diagnostics``: clusters and epsilon without clusters,
  pairs without step groups, PACE/LOO rows without PACE) prints "-" (report.json keeps the value).

Only complete runs enter the means: a run whose sweep cell failed (``sweep_cell.json``) or that logged
fewer iterations than its ``num_iterations`` is left out and named in the report; a validation whose
value is missing or not finite (NaN, written as null: every game of the panel faulted) is skipped, and
a number that some seeds lack says "(n of m seeds)". The command exits 1 only when no run is complete.

Writes ``report.md``, ``report.json`` and plots (learning curves with a 95% t-interval band over
seeds, singleton rates, PACE mix; x = iterations completed, ``metric_keys.x_of``) to ``--out``
(default: beside the runs, never inside one: ``<study>/report`` for a study folder,
``<run>_report`` next to a run folder given alone). Folders may be local or ``gs://``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from absl import app, flags

from bipace_jax import metric_keys as mk
from bipace_jax import resume, runfolder

_THRESHOLD = flags.DEFINE_float("threshold", 0.9, "Validation success that counts as reached (0..1).")
_OUT = flags.DEFINE_string(
    "out", "", "Output folder (default: <study>/report for a study folder, <run>_report beside a lone run)."
)

SUCCESS_COLUMNS = ("final", "before", "gain", "best")  # per-seed numbers of the success table
DIAGNOSTICS = (  # (metric, label in the table)
    (mk.HASH_SINGLETON_GROUPS, "singleton groups, hashing"),
    (mk.CLUSTER_SINGLETON_GROUPS, "singleton groups, clusters"),
    (mk.PAIRS, "pairs"),
    (mk.PACE_ROWS, "PACE rows"),
    (mk.LOO_ROWS, "LOO rows"),
    (mk.EPSILON, "epsilon"),
    (mk.BIPACE_SHARE, "BiPACE time share"),
)


def estimator_diagnostics(name: str | None) -> tuple[str, ...]:
    """The ``DIAGNOSTICS`` keys that describe estimator ``name``'s own batches: the hash singleton rate
    and the time share always; the cluster singleton rate and epsilon with fingerprint clusters; pairs
    with any step groups; PACE and leave-one-out rows with PACE (``EstimatorSpec.uses_pace_options``).
    Every key for a name the registry does not know (nothing is hidden that might apply)."""
    from bipace_jax.estimators import registry

    if name not in registry.names():
        return tuple(k for k, _ in DIAGNOSTICS)
    spec = registry.get(name)
    shown = {mk.HASH_SINGLETON_GROUPS, mk.BIPACE_SHARE}
    if spec.grouping == registry.CLUSTER:
        shown |= {mk.CLUSTER_SINGLETON_GROUPS, mk.EPSILON}
    if spec.grouping != registry.NO_GROUPS:
        shown.add(mk.PAIRS)
    if spec.uses_pace_options:
        shown |= {mk.PACE_ROWS, mk.LOO_ROWS}
    return tuple(k for k, _ in DIAGNOSTICS if k in shown)


def find_runs(paths: list[str]) -> list[str]:
    """Run folders among ``paths`` and their direct subfolders, sorted.

    Raises:
      ValueError: a path that does not exist, or no run folder at all.
    """
    runs = []
    for p in paths:
        folder = runfolder.path(p, "run folder")
        if not folder.is_dir():
            raise ValueError(f"not a folder: {p}")
        candidates = [p] + [os.path.join(p, d) for d in sorted(x.name for x in folder.iterdir())]
        runs += [c for c in candidates if (runfolder.path(c) / "metrics.jsonl").exists()]
    if not runs:
        raise ValueError(f"no run folder (metrics.jsonl) in {paths}")
    return sorted(set(runs))


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True)
    return out


def arms_of(runs: list[str]) -> dict[str, list[str]]:
    """Runs grouped by their config without ``seed`` and the fields a resume may change
    (``resume.is_neutral``); each arm named by the fields that differ."""
    configs = {}
    for r in runs:
        text = runfolder.read_text(runfolder.path(r) / "config.json")
        configs[r] = _flatten(json.loads(text)) if text is not None else {}
    keys = sorted(k for k in {k for c in configs.values() for k in c} - {"seed"} if not resume.is_neutral(k))
    differing = [k for k in keys if len({c.get(k) for c in configs.values()}) > 1]
    arms: dict[str, list[str]] = {}
    for r, c in configs.items():
        name = ",".join(f"{k}={json.loads(c[k]) if k in c else None}" for k in differing) or "all runs"
        arms.setdefault(name, []).append(r)
    return arms


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof 1; None for one value: no spread is known); NaN for none."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    m = sum(vals) / len(vals)
    if len(vals) == 1:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def arm_label(name: str) -> str:
    """A plot label for an arm: its fields' values (``"estimator.name=bipace_q,sampler.temperature=1.0"``
    -> ``"bipace_q, temperature 1.0"``: the first field's value alone, the others with their last part)."""
    if "=" not in name:
        return name
    parts = [p.split("=", 1) for p in name.split(",")]
    return ", ".join(v if i == 0 else f"{k.rsplit('.', 1)[-1]} {v}" for i, (k, v) in enumerate(parts))


# Two-sided 95% Student t quantiles for 1..10 degrees of freedom; beyond, z + (z^3 + z) / (4 df).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t_quantile(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` >= 1 degrees of freedom (3 digits up to 10, then the
    Cornish-Fisher term: 2.039 at 30 against 2.042).

    Raises:
      ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"t_quantile: expected df >= 1, got {df}")
    z = 1.959964
    return _T975[df - 1] if df <= len(_T975) else z + (z**3 + z) / (4 * df)


def _finite(v: Any) -> float | None:
    """``v`` as a float, or None when it is missing or not finite (``metrics`` writes NaN as null)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def validation_curve(rows: list[dict], key: str = mk.VAL_SUCCESS) -> list[tuple[int, float]]:
    """(iterations trained, value) of every validation: the before-RL one at 0, then after iteration i at
    i + 1; a validation whose value is missing or not finite (every game faulted) is left out."""
    curve = []
    before = mk.before(key)
    for r in rows:
        if before in r and _finite(r[before]) is not None:
            curve.append((0, _finite(r[before])))
        if key in r and _finite(r[key]) is not None:
            curve.append((mk.x_of(key, r[mk.ITERATION]), _finite(r[key])))
    return curve


def _config(run: str) -> dict[str, Any]:
    """The run's ``config.json`` as a dict ({} when absent)."""
    text = runfolder.read_text(runfolder.path(run) / "config.json")
    return json.loads(text) if text is not None else {}


def run_status(run: str, rows: list[dict]) -> str | None:
    """None for a complete run; else why it is left out of the means: its sweep cell failed
    (``sweep_cell.json`` with a non-zero exit code) or it logged fewer iterations than its config's
    ``num_iterations``."""
    folder = runfolder.path(run)
    cell = runfolder.read_text(folder / "sweep_cell.json")
    if cell is not None and json.loads(cell).get("returncode") != 0:
        return f"failed (exit code {json.loads(cell).get('returncode')})"
    text = runfolder.read_text(folder / "config.json")
    want = json.loads(text).get("num_iterations") if text is not None else None
    done = len({int(r[mk.ITERATION]) for r in rows if mk.ITERATION in r})
    if isinstance(want, int) and done < want:
        return f"incomplete ({done} of {want} iterations)"
    return None


def run_summary(run: str, threshold: float) -> dict[str, Any]:
    """One run's final/best validation, categories, iterations to ``threshold`` and mean diagnostics."""
    from bipace_jax.metrics import read_metrics

    rows = read_metrics(run)
    curve = validation_curve(rows)
    out: dict[str, Any] = {"run": os.path.basename(os.path.normpath(run)), "iterations": len(rows), "curve": curve}
    out["status"] = run_status(run, rows)
    out["missing_validations"] = sum(
        1 for r in rows for k in (mk.VAL_SUCCESS, mk.before(mk.VAL_SUCCESS)) if k in r and _finite(r[k]) is None
    )
    out["final"] = curve[-1][1] if curve else None
    out["before"] = curve[0][1] if curve and curve[0][0] == 0 else None
    out["gain"] = out["final"] - out["before"] if out["before"] is not None and len(curve) > 1 else None
    out["estimator"] = _config(run).get("estimator", {}).get("name")
    out["best"] = max(v for _, v in curve) if curve else None
    out["iterations_to_threshold"] = next((i for i, v in curve if v >= threshold), None)
    last_val = next((r for r in reversed(rows) if _finite(r.get(mk.VAL_SUCCESS)) is not None), {})
    out["final_by_key"] = {
        k: _finite(v)
        for k, v in last_val.items()
        if k.startswith(mk.VAL + "/") and k != mk.VAL_SUCCESS and "/tasks" not in k
    }
    out["final_by_key"] = {k: v for k, v in out["final_by_key"].items() if "success_rate" in k or k.endswith("/score")}
    out["diagnostics"] = {}
    for key, _ in DIAGNOSTICS:
        vals = [v for v in (_finite(r.get(key)) for r in rows) if v is not None]
        out["diagnostics"][key] = sum(vals) / len(vals) if vals else None
    out["curves"] = {
        key: [(mk.x_of(key, r[mk.ITERATION]), _finite(r[key])) for r in rows if _finite(r.get(key)) is not None]
        for key in (mk.HASH_SINGLETON_GROUPS, mk.CLUSTER_SINGLETON_GROUPS, mk.PACE_ROWS)
    }
    return out


def aggregate(arms: dict[str, list[str]], threshold: float) -> dict[str, Any]:
    """Per arm: mean/std over its complete seeds of every summary number (see the module docstring);
    failed or incomplete runs (`run_status`) are left out and listed under ``excluded``, and ``counted``
    gives, per number, how many seeds had a finite value of it."""
    report: dict[str, Any] = {"threshold": threshold, "arms": {}}
    for name, runs in arms.items():
        summaries = [run_summary(r, threshold) for r in runs]
        per_run = [s for s in summaries if s["status"] is None]
        arm: dict[str, Any] = {"runs": [s["run"] for s in per_run], "seeds": len(per_run)}
        arm["excluded"] = {s["run"]: s["status"] for s in summaries if s["status"] is not None}
        arm["counted"] = {k: sum(s[k] is not None for s in per_run) for k in SUCCESS_COLUMNS}
        for k in SUCCESS_COLUMNS:
            arm[k] = mean_std([s[k] for s in per_run])
        reached = [s["iterations_to_threshold"] for s in per_run if s["iterations_to_threshold"] is not None]
        arm["iterations_to_threshold"] = mean_std(reached)
        arm["reached_threshold"] = f"{len(reached)}/{len(per_run)}"
        keys = sorted({k for s in per_run for k in s["final_by_key"]})
        arm["final_by_key"] = {k: mean_std([s["final_by_key"].get(k) for s in per_run]) for k in keys}
        arm["diagnostics"] = {k: mean_std([s["diagnostics"][k] for s in per_run]) for k, _ in DIAGNOSTICS}
        names = {s["estimator"] for s in summaries}
        arm["estimator"] = names.pop() if len(names) == 1 else None
        arm["shown_diagnostics"] = list(estimator_diagnostics(arm["estimator"]))
        arm["per_run"] = per_run
        report["arms"][name] = arm
    return report


def _pm(ms: tuple[float, float | None], pct: bool = True, signed: bool = False) -> str:
    m, s = ms
    if math.isnan(m):
        return "-"
    scale = 100 if pct else 1
    mean = f"{scale * m:{'+' if signed else ''}.1f}" if pct else f"{m:.3g}"
    if s is None:  # one seed: no spread to show
        return f"{mean} (n = 1)"
    return f"{mean} +- {scale * s:.1f}" if pct else f"{mean} +- {s:.2g}"


def to_markdown(report: dict[str, Any]) -> str:
    """``report.md``: the arms' success table, the final success per category, the diagnostics table
    (rates and success in percent, mean +- sample std over seeds)."""
    arms = report["arms"]
    lines = [
        "| arm | seeds | final success (%) | before RL (%) | gain (points) | best success (%) | "
        f"iterations to {100 * report['threshold']:.0f}% (reached) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, a in arms.items():
        its = _pm(a["iterations_to_threshold"], pct=False)

        def seeds_of(k, a=a):  # "(n of m seeds)" when some seeds had no finite value of it
            n = a["counted"][k]
            return "" if n == a["seeds"] else f" ({n} of {a['seeds']} seeds)"

        final, best = _pm(a["final"]) + seeds_of("final"), _pm(a["best"]) + seeds_of("best")
        before, gain = _pm(a["before"]) + seeds_of("before"), _pm(a["gain"], signed=True) + seeds_of("gain")
        lines.append(
            f"| {name} | {a['seeds']} | {final} | {before} | {gain} | {best} | {its} ({a['reached_threshold']}) |"
        )
    left_out = [f"{run} ({why})" for a in arms.values() for run, why in a["excluded"].items()]
    if left_out:
        lines += ["", "Left out of the means: " + ", ".join(left_out) + "."]
    keys = sorted({k for a in arms.values() for k in a["final_by_key"]})
    if keys:
        lines += ["", "Final validation by category (%):", "", "| arm | " + " | ".join(keys) + " |"]
        lines.append("|---|" + "---|" * len(keys))
        for name, a in arms.items():
            lines.append(f"| {name} | " + " | ".join(_pm(a["final_by_key"].get(k, (math.nan, 0))) for k in keys) + " |")
    lines += ["", "Estimator diagnostics (mean over iterations, then over seeds):", ""]
    lines.append("| arm | " + " | ".join(label for _, label in DIAGNOSTICS) + " |")
    lines.append("|---|" + "---|" * len(DIAGNOSTICS))
    for name, a in arms.items():
        shown = a.get("shown_diagnostics", [k for k, _ in DIAGNOSTICS])
        cells = [
            _pm(a["diagnostics"][k], pct=k not in (mk.PAIRS, mk.EPSILON)) if k in shown else "-" for k, _ in DIAGNOSTICS
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], out: str) -> list[str]:
    """Learning curves, cluster singleton rates and PACE share per arm: the mean over seeds with a 95%
    t-interval band (mean +- t(n-1) s / sqrt(n); no band for one seed, labelled "n = 1"), x =
    iterations completed (``metric_keys.x_of``); an arm whose estimator has no clusters (no PACE) is
    left out of the singleton (PACE) plot, and a plot no arm draws on is not written. Returns the file
    names written into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    files = []
    panels = (
        ("learning_curves.png", "validation success rate", "Validation success", None, lambda s: s["curve"]),
        (
            "singleton_rates.png",
            "singleton step-group rate (clusters)",
            "Singleton step groups, clusters",
            mk.CLUSTER_SINGLETON_GROUPS,
            lambda s: s["curves"][mk.CLUSTER_SINGLETON_GROUPS],
        ),
        ("pace_rows.png", "share of rows", "PACE row share", mk.PACE_ROWS, lambda s: s["curves"][mk.PACE_ROWS]),
    )
    for fname, ylabel, title, diagnostic, get in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        drew = False
        for name, a in report["arms"].items():
            if diagnostic is not None and diagnostic not in a.get("shown_diagnostics", [diagnostic]):
                continue  # the arm's estimator has no clusters / no PACE: its curve would be a flat 0
            curves = [dict(get(s)) for s in a["per_run"]]
            xs = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not xs:
                continue
            ys = np.array([[c[x] for x in xs] for c in curves])
            n = len(curves)
            (line,) = ax.plot(
                xs, ys.mean(0), marker="o" if len(xs) < 12 else None, label=f"{arm_label(name)} (n = {n})"
            )
            if n > 1:
                half = t_quantile(n - 1) * ys.std(0, ddof=1) / math.sqrt(n)
                ax.fill_between(xs, ys.mean(0) - half, ys.mean(0) + half, alpha=0.2, color=line.get_color())
            drew = True
        if drew:
            ax.set_xlabel("PPO iterations completed")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title} (mean over seeds, band: 95% t-interval)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            with (runfolder.path(out, "--out") / fname).open("wb") as f:  # a file object: --out may be gs://
                fig.savefig(f, format="png", dpi=110)
            files.append(fname)
        plt.close(fig)
    return files


#: What ``launch.report`` writes into ``--out``, as glob patterns (a folder holding only these is an earlier report's).
OUT_FILES = ("report.md", "report.json", "*.png")


def default_out(first: str) -> str:
    """``--out``'s default for the first folder given: ``<first>_report`` beside it when it is a run
    folder itself (holds ``metrics.jsonl``), else ``<first>/report`` (a study: beside its runs)."""
    if (runfolder.path(first) / "metrics.jsonl").exists():
        return os.path.normpath(first) + "_report" if "://" not in first else first.rstrip("/") + "_report"
    return os.path.join(first, "report") if "://" not in first else first.rstrip("/") + "/report"


def main(argv):
    paths = argv[1:]
    if not paths:
        raise app.UsageError("give one or more run folders or study folders")
    if not 0.0 <= _THRESHOLD.value <= 1.0:
        raise app.UsageError(f"--threshold must lie in [0, 1], got {_THRESHOLD.value}")
    try:
        runs = find_runs(paths)
    except ValueError as e:
        sys.exit(f"error: {e}")
    report = aggregate(arms_of(runs), _THRESHOLD.value)
    if not any(a["seeds"] for a in report["arms"].values()):
        excluded = {r: why for a in report["arms"].values() for r, why in a["excluded"].items()}
        sys.exit(f"error: no complete run to report: {excluded}")
    out = _OUT.value or default_out(paths[0])
    try:  # never over another command's files (a run folder, an eval): one report folder per set of inputs
        source = ", ".join(sorted(os.fspath(runfolder.path(p, "run folder")) for p in paths))
        folder = runfolder.claim_output(out, "--out", "launch.report", source, OUT_FILES)
    except runfolder.RunFolderError as e:
        sys.exit(f"error: {e}")
    md = to_markdown(report)
    report["plots"] = plot(report, out)
    runfolder.write_text(folder / "report.md", md)
    runfolder.write_text(folder / "report.json", json.dumps(report, indent=2))
    print(md)
    print(f"wrote {out}/report.md, report.json, " + ", ".join(report["plots"]))


if __name__ == "__main__":
    from launch import cli

    cli.run(main)
