"""Run metrics: ``metrics.jsonl`` (one JSON line per iteration), TensorBoard events, PNG plots.

Keys are ``<section>/<name>`` (``train/success_rate``, ``val/success_rate``, ``time/rollout_s``,
``estimator/singleton_group_rate``, ...) plus ``iteration``. Only the primary process writes.
On resume, lines for iterations that are re-run are dropped first, so the file holds exactly one
line per completed iteration, in order. Every file goes through ``bipace_jax.runfolder`` (local or gs://).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from etils import epath

from bipace_jax import metric_keys as keys
from bipace_jax import runfolder

METRICS_FILE = "metrics.jsonl"


def _clean(v: Any):
    if isinstance(v, np.generic):
        v = v.item()
    if getattr(v, "shape", None) == ():
        v = float(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def read_metrics(workdir: str) -> list[dict]:
    """All lines of ``<workdir>/metrics.jsonl`` as dicts (empty list when absent).

    Raises:
      RunFolderError: ``workdir`` is a URL of a scheme other than ``gs://``.
    """
    text = runfolder.read_text(runfolder.path(workdir) / METRICS_FILE)
    rows = []
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill mid-write (older runs appended): it is re-run
                break
    return rows


class MetricsLogger:
    """Writes one record per iteration to JSON lines and TensorBoard.

    GCS has no append: the logger keeps the run's lines and rewrites ``metrics.jsonl`` whole after
    each record (a few MB at most), so the file always holds complete lines only.

    Args:
      workdir: run folder (local or ``gs://``, see ``bipace_jax.runfolder``).
      start_iteration: first iteration this process will log; earlier lines are kept, later
        (and any partial) lines are removed.
      enabled: False on non-primary processes (everything becomes a no-op).

    Raises:
      RunFolderError: ``workdir`` is a URL of a scheme other than ``gs://``.
    """

    def __init__(self, workdir: str, start_iteration: int = 0, enabled: bool = True):
        self.workdir = workdir
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        self._dir = runfolder.path(workdir)
        self._dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(workdir) if int(r.get("iteration", -1)) < start_iteration]
        self._lines = [json.dumps(r) for r in kept]
        self._save()
        self._tb = _Events(self._dir / "tb", start_iteration)

    def _save(self) -> None:
        runfolder.write_text(self._dir / METRICS_FILE, "".join(line + "\n" for line in self._lines))

    def write(self, iteration: int, record: dict[str, Any]) -> None:
        """Add ``record`` (scalars, or small dicts/strings kept in JSON only) for ``iteration``."""
        if not self.enabled:
            return
        rec = {"iteration": int(iteration)}
        rec.update({k: _clean(v) for k, v in record.items()})
        self._lines.append(json.dumps(rec))
        self._save()
        for k, v in rec.items():
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.writer.add_scalar(k, v, global_step=iteration)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class _Events:
    """TensorBoard event files in ``tb_dir``, written by tensorboardX."""

    def __init__(self, tb_dir: epath.Path, start_iteration: int):
        from tensorboardX import SummaryWriter

        # Live curves in the bucket via epath (not tensorboardX's own GCS client): local events, copied at each flush.
        self._dest = tb_dir if runfolder.is_remote(tb_dir) else None
        self._local = tempfile.mkdtemp(prefix="bipace_tb_") if self._dest is not None else os.fspath(tb_dir)
        # Event files are named by the second they start in: a suffix unique to this start keeps a
        # restart within the same second from replacing the previous file.
        suffix = f".{os.getpid()}.{time.time_ns()}"
        self.writer = SummaryWriter(logdir=self._local, purge_step=start_iteration, filename_suffix=suffix)

    def flush(self) -> None:
        self.writer.flush()
        if self._dest is not None:
            runfolder.upload(self._local, self._dest)

    def close(self) -> None:
        self.writer.close()
        if self._dest is not None:
            runfolder.upload(self._local, self._dest)
            shutil.rmtree(self._local, ignore_errors=True)


class StageTimer:
    """Wall seconds of named stages: ``with timer.stage("rollout"): ...``; a stage entered again adds up.

    ``seconds``: stage name -> seconds, in first-entered order; ``total()``: their sum.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def total(self) -> float:
        return sum(self.seconds.values())


def panel_metrics(
    name: str, won: np.ndarray, length: np.ndarray, errors: np.ndarray, score: np.ndarray
) -> dict[str, float]:
    """A validation panel's record from its per-task float arrays ``[num_tasks]`` (NaN: every game of
    the task faulted, left out of the means): ``<name>/success_rate``, ``/episode_length`` (means over
    tasks, NaN when all are NaN), ``/tasks``, ``/env_errors`` (faulted games, summed) and ``/score``
    (only when some task has one, e.g. WebShop's)."""

    def mean(a):
        return float(np.nanmean(a)) if not np.isnan(a).all() else float("nan")

    out = {f"{name}/score": mean(score)} if not np.isnan(score).all() else {}
    out[f"{name}/success_rate"] = mean(won)
    out[f"{name}/episode_length"] = mean(length)
    out[f"{name}/tasks"] = len(won)
    out[f"{name}/env_errors"] = int(errors.sum())
    return out


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(updates completed, value): the record of iteration i is measured after i + 1 updates;
    ``val_before/*`` (the validation before any update) sits at 0."""
    xs, ys = [], []
    before = keys.before(key) if key.startswith(keys.VAL + "/") else None
    for r in rows:
        if before and r.get(before) is not None:
            xs.append(0)
            ys.append(r[before])
        if r.get(key) is not None:
            xs.append(r[keys.ITERATION] + 1)
            ys.append(r[key])
    return xs, ys


def make_plots(
    workdir: str,
    rows: Iterable[dict] | None = None,
    *,
    train_temperature: float | None = None,
    val_temperature: float | None = None,
    grouping: str | None = None,
) -> list[str]:
    """PNG plots from the metrics: success curve, singleton rate hash vs clusters, PACE row mix.

    ``train_temperature`` / ``val_temperature``: the rollout and validation sampling temperatures,
    named in the success plot's legend when given. ``grouping``: the estimator's step groups
    (``EstimatorSpec.grouping``: ``"obs_hash"``, ``"cluster"``, ``"none"``), marked in the singleton
    plot; both partitions are drawn from what every run records (``estimator/hash_*``, ``cluster_*``).

    Returns the paths written (under ``<workdir>/plots``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows) if rows is not None else read_metrics(workdir)
    out_dir = runfolder.path(workdir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        paths.append(os.fspath(out_dir / name))
        with (out_dir / name).open("wb") as f:  # a file object: the folder may be gs://
            fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)

    def line_plot(name, series, xlabel, ylabel, title, ylim=None):
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in series:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o" if key.startswith("val") else None, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.grid(alpha=0.3)
        save(fig, name)

    def mark(kind):
        return ": trained on" if kind == grouping else ""

    def named(label, t):
        return label if t is None else f"{label} (T={t:g})"

    line_plot(
        "success.png",
        (
            (keys.TRAIN_SUCCESS, named("train", train_temperature)),
            (keys.VAL_SUCCESS, named("validation", val_temperature)),
            (keys.VAL_HOLDOUT_SUCCESS, "validation, held-out goals"),
        ),
        "PPO iterations completed",
        "success rate",
        "Success",
        ylim=(-0.02, 1.02),
    )
    line_plot(
        "singleton_rate.png",
        (
            (keys.HASH_SINGLETON_GROUPS, "exact hashing (GiGPO's)" + mark("obs_hash")),
            (keys.CLUSTER_SINGLETON_GROUPS, "fingerprint clusters (BiGPO's, BiPACE's)" + mark("cluster")),
        ),
        "iteration",
        "singleton step-group rate",
        "Singleton rate of each partition on this run's batches",
    )

    fig, ax = plt.subplots(figsize=(6, 4))
    xs, pace = _series(rows, keys.PACE_ROWS)
    _, loo = _series(rows, keys.LOO_ROWS)
    _, single = _series(rows, keys.SINGLETON_ROWS)
    if xs and len(pace) == len(loo) == len(single):
        ax.stackplot(xs, pace, loo, single, labels=["PACE (Q - V)", "leave-one-out", "singleton"])
        ax.legend(loc="lower right")
    ax.set_xlabel("iteration")
    ax.set_ylabel("share of rows")
    ax.set_ylim(0, 1)
    ax.set_title("PACE row mix")
    save(fig, "pace_row_mix.png")
    return paths
