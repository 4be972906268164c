"""Run metrics: ``metrics.jsonl`` (one JSON line per iteration), TensorBoard events, PNG plots.

Keys are ``<section>/<name>`` (``train/success_rate``, ``val/success_rate``, ``time/rollout_s``,
``estimator/singleton_group_rate``, ...) plus ``iteration``. Only the primary process writes.
On resume, lines for iterations that are re-run are dropped first, so the file holds exactly one
line per completed iteration, in order. Every file goes through ``bipace_jax.runfolder`` (local or gs://).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterable, Sequence
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


@dataclasses.dataclass(frozen=True)
class HostStats:
    """One host's statistics in the form that pools over hosts (``distributed.pooled``).

    A rate is kept as its (numerator, denominator) sums, so the run's rate is the summed numerator
    over the summed denominator (a mean of per-host rates would weight a host with 2 rows like one
    with 200). All values are float (float64 once pooled); keys are full metric keys or bare names
    (``prefixed`` adds a section).

    Attributes:
      counts: name -> this host's count (an int stays an int in ``values()``); pooled: the float sum over hosts.
      rates: name -> (numerator, denominator) of this host; pooled: sum(num) / sum(den), 0.0 when the
        summed denominator is 0 (no row, no game: the project's convention for an empty rate).
      maxima: name -> this host's value; pooled: the max over hosts.

    Raises:
      ValueError: a name in two of the three maps, or a negative denominator.
    """

    counts: dict[str, float | int] = dataclasses.field(default_factory=dict)
    rates: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    maxima: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        shared = (self.counts.keys() & self.rates.keys()) | (
            self.maxima.keys() & (self.counts.keys() | self.rates.keys())
        )
        if shared:
            raise ValueError(f"HostStats: names in more than one of counts/rates/maxima: {sorted(shared)}")
        bad = sorted(k for k, (_, den) in self.rates.items() if not den >= 0)
        if bad:
            raise ValueError(f"HostStats: rates {bad} need a denominator >= 0, got {[self.rates[k][1] for k in bad]}")

    def keys(self) -> list[str]:
        """Every name, sorted (the order ``distributed.pooled`` gathers them in)."""
        return sorted([*self.counts, *self.rates, *self.maxima])

    def values(self) -> dict[str, float]:
        """The statistics as metric values (this host's alone: the run's with one process)."""
        out = {k: v if isinstance(v, int) else float(v) for k, v in self.counts.items()}  # an int count stays one
        out.update({k: float(num) / float(den) if den > 0 else 0.0 for k, (num, den) in self.rates.items()})
        out.update({k: float(v) for k, v in self.maxima.items()})
        return out

    def prefixed(self, prefix: str) -> HostStats:
        """The same statistics with ``prefix`` before every name (``"rollout/"``)."""
        return HostStats(
            {prefix + k: v for k, v in self.counts.items()},
            {prefix + k: v for k, v in self.rates.items()},
            {prefix + k: v for k, v in self.maxima.items()},
        )

    def vector(self) -> np.ndarray:
        """float64 ``[1 + len(counts) + 2 * len(rates) + len(maxima)]``: a checksum of the names (equal
        records hold equal names), then the counts, each rate's (numerator, denominator) and the maxima,
        each in sorted name order; ``like`` reads it back."""
        c, r, m = sorted(self.counts), sorted(self.rates), sorted(self.maxima)
        crc = zlib.crc32("\0".join(["c", *c, "r", *r, "m", *m]).encode())
        values = [*(self.counts[k] for k in c), *(x for k in r for x in self.rates[k]), *(self.maxima[k] for k in m)]
        return np.array([crc, *values], np.float64)

    def like(self, vector: np.ndarray) -> HostStats:
        """The record of another host from its ``vector()``, with this record's names.

        Raises:
          ValueError: the vector's checksum or length is not this record's (the hosts hold other names).
        """
        mine = self.vector()
        vector = np.asarray(vector, np.float64)
        if vector.shape != mine.shape or vector[0] != mine[0]:
            raise ValueError(
                f"HostStats: another host holds other names than {self.keys()} (every host must report the same "
                "statistics)"
            )
        c, r, m = sorted(self.counts), sorted(self.rates), sorted(self.maxima)
        v = vector[1:].tolist()
        nums = v[len(c) : len(c) + 2 * len(r)]
        return HostStats(
            dict(zip(c, v[: len(c)])),
            {k: (nums[2 * i], nums[2 * i + 1]) for i, k in enumerate(r)},
            dict(zip(m, v[len(c) + 2 * len(r) :])),
        )

    @staticmethod
    def pool(records: Sequence[HostStats]) -> HostStats:
        """Every host's record as the run's: counts summed, each rate's numerator and denominator
        summed, maxima the max.

        Raises:
          ValueError: no record, or records with other names.
        """
        if not records:
            raise ValueError("HostStats.pool: expected at least one record, got none")
        first = records[0]
        if any(r.keys() != first.keys() or set(r.rates) != set(first.rates) for r in records):
            raise ValueError(f"HostStats.pool: the records hold other names than {first.keys()}")
        return HostStats(
            {k: sum(float(r.counts[k]) for r in records) for k in first.counts},
            {
                k: (sum(float(r.rates[k][0]) for r in records), sum(float(r.rates[k][1]) for r in records))
                for k in first.rates
            },
            {k: max(float(r.maxima[k]) for r in records) for k in first.maxima},
        )

    def __or__(self, other: HostStats) -> HostStats:
        """Both records in one (names must not repeat: ValueError)."""
        repeated = set(self.keys()) & set(other.keys())
        if repeated:
            raise ValueError(f"HostStats: both records hold {sorted(repeated)}")
        return HostStats(
            {**self.counts, **other.counts}, {**self.rates, **other.rates}, {**self.maxima, **other.maxima}
        )


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
