"""PNG plots of one run folder, one function per figure; x = iterations completed (``metric_keys.x_of``).

Each figure function takes the run's records (``Run``) and returns a matplotlib ``Figure``, or None
when the run has nothing for it to show (a GRPO run has no PACE rows; a run with one epsilon and no
calibration sweep has no singleton-rate-vs-epsilon relation). ``make_plots`` writes the figures that
exist under ``<workdir>/plots``. A series with few points is drawn with markers, so a one-iteration
run's single point is visible.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from bipace_jax import metric_keys as keys
from bipace_jax import runfolder
from bipace_jax.metrics import read_metrics, series, validation_points
from bipace_jax.stats import panel_games, wilson

STAGES = ("rollout", "old_logprobs", "ref_logprobs", "estimator", "update")  # the trainer's StageTimer names
LOSS_PANELS = (  # (key, y label)
    ("loss/pg_loss", "policy-gradient loss"),
    ("loss/kl", "KL to reference (nats/token)"),
    ("loss/entropy", "entropy (nats/token)"),
    ("loss/clip_frac", "clipped token fraction"),
)
X_LABEL = "PPO iterations completed"
MARKED_BELOW = 12  # a series of fewer points gets markers (a line through one point draws nothing)


@dataclasses.dataclass(frozen=True)
class Run:
    """What every figure reads: the run's records and the settings that label them.

    Attributes:
      rows: one record per iteration (``metrics.read_metrics``).
      group_size: games per validation task (``val.group_size``); None: no intervals.
      train_temperature, val_temperature: sampling temperatures, named in the success legend.
      grouping: the estimator's step groups (``EstimatorSpec.grouping``), marked in the singleton plot.
      target_singleton_rate: ``estimator.calibration.target_singleton_rate``, drawn with a sweep.
    """

    rows: list[dict]
    group_size: int | None = None
    train_temperature: float | None = None
    val_temperature: float | None = None
    grouping: str | None = None
    target_singleton_rate: float | None = None


def _marker(n: int, marker: str = "o") -> str | None:
    return marker if n < MARKED_BELOW else None


def _figure(figsize=(6, 4), nrows: int = 1, ncols: int = 1):
    """``(figure, axes)`` on the file-only Agg backend (no display on a training host)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=figsize)


def _finish(ax, ylabel: str, title: str, ylim=None, xlabel: str = X_LABEL) -> None:
    from matplotlib.ticker import MaxNLocator

    if xlabel != "category":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole iterations, even for one
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _named(label: str, t: float | None) -> str:
    return label if t is None else f"{label} (T={t:g})"


def success(run: Run):
    """``success.png``: the training games' success, and each validation with its 95% Wilson interval."""
    fig, ax = _figure()
    xs, ys = series(run.rows, keys.TRAIN_SUCCESS)
    if xs:
        ax.plot(xs, ys, marker=_marker(len(xs)), label=_named("train batch", run.train_temperature))
    for prefix, label in (
        (keys.VAL, _named("validation", run.val_temperature)),
        (keys.VAL_HOLDOUT, "validation, held-out goals"),
    ):
        pts = validation_points(run.rows, prefix, run.group_size) if run.group_size else []
        if pts:
            x, v, lo, hi, n = (np.array(c, float) for c in zip(*pts))
            games = f"{int(n[-1])} game{'' if n[-1] == 1 else 's'}"
            ax.errorbar(x, v, yerr=[v - lo, hi - v], marker="o", capsize=3, label=f"{label}, {games}")
        elif not run.group_size and (xy := series(run.rows, prefix + "/success_rate"))[0]:
            ax.plot(*xy, marker="o", label=label)
    title = "Success (bars: 95% Wilson interval)" if run.group_size else "Success"
    _finish(ax, "success rate", title, (-0.02, 1.02))
    return fig


def singleton_rate(run: Run):
    """``singleton_rate.png``: the singleton step-group rate of exact hashing and of the clusters."""
    fig, ax = _figure()
    for key, label, kind in (
        (keys.HASH_SINGLETON_GROUPS, "exact hashing (GiGPO's)", "obs_hash"),
        (keys.CLUSTER_SINGLETON_GROUPS, "fingerprint clusters (BiGPO's, BiPACE's)", "cluster"),
    ):
        if (xy := series(run.rows, key))[0]:
            ax.plot(*xy, marker=_marker(len(xy[0])), label=label + (": trained on" if kind == run.grouping else ""))
    _finish(ax, "singleton step-group rate", "Singleton rate of each partition on this run's batches")
    return fig


def pace_row_mix(run: Run):
    """``pace_row_mix.png``: each iteration's rows by advantage kind (PACE, leave-one-out, singleton),
    stacked bars; None when no row of the run had a PACE or leave-one-out advantage (an estimator
    without PACE records both rates as 0)."""
    xs, pace = series(run.rows, keys.PACE_ROWS)
    _, loo = series(run.rows, keys.LOO_ROWS)
    _, single = series(run.rows, keys.SINGLETON_ROWS)
    if not xs or not len(pace) == len(loo) == len(single) or not any(pace) and not any(loo):
        return None
    fig, ax = _figure()
    bottom = np.zeros(len(xs))
    for label, share in (("PACE (Q - V)", pace), ("leave-one-out", loo), ("singleton", single)):
        ax.bar(xs, share, 0.8, bottom=bottom, label=label)
        bottom += np.asarray(share, float)
    _finish(ax, "share of rows", "PACE row mix", (0, 1))
    return fig


def training(run: Run):
    """``training.png``: policy-gradient loss, KL, entropy and clip fraction, one panel each."""
    fig, axes = _figure((9, 6), 2, 2)
    for ax, (key, label) in zip(axes.flat, LOSS_PANELS):
        if (xy := series(run.rows, key))[0]:
            ax.plot(*xy, marker="o" if len(xy[0]) < MARKED_BELOW else ".")
        _finish(ax, label, key)
    fig.suptitle("PPO update (x: iterations completed before the batch's update)")
    fig.tight_layout()
    return fig


def time_phases(run: Run):
    """``time.png``: wall seconds per phase of each iteration, stacked; the before-RL validation is
    stacked on iteration 0 (it runs before that iteration's rollout)."""
    fig, ax = _figure((7, 4))
    its = [r[keys.ITERATION] for r in run.rows]
    bottom = np.zeros(len(run.rows))
    phases = [(keys.before(keys.VALIDATION_SECONDS), "validation before RL")]
    phases += [(keys.stage_seconds(st), st) for st in STAGES]
    phases += [(keys.VALIDATION_SECONDS, "validation"), (keys.PREVIOUS_CHECKPOINT_SECONDS, "checkpoint (previous)")]
    for key, label in phases:
        h = np.array([float(r.get(key) or 0.0) for r in run.rows])
        if h.any():
            ax.bar(its, h, bottom=bottom, label=label)
            bottom += h
    _finish(ax, "wall seconds", "Time per phase", xlabel="iteration")
    return fig


def categories(run: Run):
    """``categories.png``: success per category before RL and at the last validation (Wilson intervals)."""
    fig, ax = _figure((7, 4))
    rows = run.rows
    last = next((r for r in reversed(rows) if r.get(keys.VAL_SUCCESS) is not None), None)
    first = next((r for r in rows if r.get(keys.before(keys.VAL_SUCCESS)) is not None), None)
    cats = sorted(k[len(keys.VAL_SUCCESS) + 1 :] for k in (last or {}) if k.startswith(keys.VAL_SUCCESS + "/"))
    before = keys.before(keys.VAL_SUCCESS).rsplit("/", 1)[0]
    for j, (rec, prefix, label) in enumerate(((first, before, "before RL"), (last, keys.VAL, "last validation"))):
        if rec is None or not cats:
            continue
        v = np.array([float(rec.get(f"{prefix}/success_rate/{c}") or 0.0) for c in cats])
        n = [panel_games(rec, prefix, run.group_size or 0, c) for c in cats]
        lo_hi = [wilson(vi * ni, ni) if ni else (vi, vi) for vi, ni in zip(v, n)]
        err = [v - np.array([a for a, _ in lo_hi]), np.array([b for _, b in lo_hi]) - v]
        x = np.arange(len(cats)) + (j - 0.5) * 0.4
        suffix = f" (iteration {rec[keys.ITERATION] + 1})" if prefix == keys.VAL else ""
        ax.bar(x, v, 0.4, yerr=err if run.group_size else None, capsize=3, label=label + suffix)
    labels = [f"{c}\n({last.get(f'{keys.VAL}/tasks/{c}', '?')} tasks)" for c in cats] if cats else []
    ax.set_xticks(np.arange(len(cats)), labels)
    title = "Success per category (bars: 95% Wilson interval)"
    _finish(ax, "validation success rate", title, (0, 1.05), xlabel="category")
    return fig


def calibration(run: Run):
    """``calibration.png``: the clusters' singleton rate against epsilon: the calibration sweep (with the
    target) and every iteration's point, coloured by iteration. None without a sweep and with one
    epsilon over the whole run (nothing relates the rate to epsilon)."""
    from matplotlib.ticker import MaxNLocator

    prefix = keys.CALIBRATION_RATE + "/"
    sweep = sorted((float(k[len(prefix) :]), v) for r in run.rows for k, v in r.items() if k.startswith(prefix))
    ep = [(r.get(keys.EPSILON), r.get(keys.CLUSTER_SINGLETON_GROUPS), r[keys.ITERATION]) for r in run.rows]
    ep = [e for e in ep if e[0] is not None and e[1] is not None]
    if not sweep and len({e[0] for e in ep}) < 2:
        return None
    fig, ax = _figure()
    if sweep:
        ax.plot(*zip(*sweep), marker="o", label="calibration sweep (iteration 0)")
    if ep:
        its = [e[2] for e in ep]
        sc = ax.scatter([e[0] for e in ep], [e[1] for e in ep], c=its, cmap="viridis", zorder=3, label="iterations")
        sc.set_clim(min(its) - 0.5, max(its) + 0.5)  # one colour band per iteration, one iteration included
        bar = fig.colorbar(sc, ax=ax, label="iteration")
        bar.set_ticks(
            sorted(set(its)) if len(set(its)) < MARKED_BELOW else MaxNLocator(integer=True).tick_values(*sc.get_clim())
        )
    if run.target_singleton_rate is not None and sweep:
        ax.axhline(
            run.target_singleton_rate, color="grey", linestyle="--", label=f"target {run.target_singleton_rate:g}"
        )
    _finish(ax, "singleton step-group rate (clusters)", "Calibration: singleton rate vs epsilon", xlabel="epsilon")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))  # epsilon is not an iteration count
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)  # the epsilon itself, never an offset from it
    ax.set_xlabel("epsilon (cosine distance)")
    return fig


FIGURES: tuple[tuple[str, Callable[[Run], Any]], ...] = (
    ("success.png", success),
    ("singleton_rate.png", singleton_rate),
    ("pace_row_mix.png", pace_row_mix),
    ("training.png", training),
    ("time.png", time_phases),
    ("categories.png", categories),
    ("calibration.png", calibration),
)


def _run_config(workdir: str) -> dict[str, Any]:
    text = runfolder.read_text(runfolder.path(workdir) / "config.json")
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}


def make_plots(
    workdir: str,
    rows: Iterable[dict] | None = None,
    *,
    train_temperature: float | None = None,
    val_temperature: float | None = None,
    grouping: str | None = None,
    group_size: int | None = None,
    target_singleton_rate: float | None = None,
) -> list[str]:
    """Writes every figure of ``FIGURES`` that the run has data for as ``<workdir>/plots/<name>``.

    ``rows``: the records (default: ``<workdir>/metrics.jsonl``). ``group_size`` (``val.group_size``)
    and ``target_singleton_rate`` (``estimator.calibration.target_singleton_rate``) are read from
    ``<workdir>/config.json`` when None; without a group size the intervals are left out. The other
    arguments are ``Run``'s. Returns the paths written, in ``FIGURES`` order.
    """
    import matplotlib.pyplot as plt

    cfg = _run_config(workdir)
    if group_size is None:
        group_size = cfg.get("val", {}).get("group_size")
    if target_singleton_rate is None:
        target_singleton_rate = cfg.get("estimator", {}).get("calibration", {}).get("target_singleton_rate")
    run = Run(
        list(rows) if rows is not None else read_metrics(workdir),
        group_size,
        train_temperature,
        val_temperature,
        grouping,
        target_singleton_rate,
    )
    out_dir = runfolder.path(workdir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in FIGURES:
        fig = draw(run)
        if fig is None:
            continue
        with (out_dir / name).open("wb") as f:  # a file object: the folder may be gs://
            fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(os.fspath(out_dir / name))
    return paths
