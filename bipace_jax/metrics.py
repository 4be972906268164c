"""Run metrics: ``metrics.jsonl`` (one JSON line per iteration), TensorBoard events, PNG plots.

Keys are ``<section>/<name>`` (``train/success_rate``, ``val/success_rate``, ``time/rollout_s``,
``estimator/singleton_group_rate``, ...) plus ``iteration``. Only the primary process writes.
On resume, lines for iterations that are re-run are dropped first, so the file holds exactly one
line per completed iteration, in order. Every file goes through ``bipace_jax.runfolder`` (local or gs://).
Keys are documented in ``bipace_jax.metric_keys.TABLE`` (docs/metrics.md); TensorBoard, wandb and the
plots put each key at ``metric_keys.x_of`` (iterations completed), the before-RL validation in the
``val/*`` series at 0.
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
import uuid
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
    """Writes one record per iteration to JSON lines, TensorBoard and (optionally) wandb.

    GCS has no append: the logger keeps the run's lines and rewrites ``metrics.jsonl`` whole after
    each record (a few MB at most), so the file always holds complete lines only. Each scalar goes to
    TensorBoard (and wandb) as series ``metric_keys.series_of(key)`` at step ``metric_keys.x_of(key,
    iteration)``: ``val_before/x`` is step 0 of ``val/x``, a validation after iteration i is step i + 1.

    Args:
      workdir: run folder (local or ``gs://``, see ``bipace_jax.runfolder``).
      start_iteration: first iteration this process will log; earlier lines are kept, later
        (and any partial) lines are removed.
      enabled: False on non-primary processes (everything becomes a no-op).
      config: the run's config as a JSON-able dict; written to TensorBoard as text ("config") and
        hparams (flattened scalars and strings), and to wandb's run config.
      derived: sizes derived from the config (rows per iteration, hosts, mesh, ...), written beside it.
      wandb_project: a wandb project name to also log there (``config.log.wandb``); None: no wandb.
        The run id is kept in ``<workdir>/wandb_id`` so a resume continues the same wandb run;
        ``WANDB_MODE=offline`` writes the run under ``<workdir>/wandb`` with no network.

    Raises:
      RunFolderError: ``workdir`` is a URL of a scheme other than ``gs://``.
      ImportError: ``wandb_project`` is given and wandb is not installed (the ``wandb`` extra).
    """

    def __init__(
        self,
        workdir: str,
        start_iteration: int = 0,
        enabled: bool = True,
        *,
        config: dict[str, Any] | None = None,
        derived: dict[str, Any] | None = None,
        wandb_project: str | None = None,
    ):
        self.workdir = workdir
        self.enabled = enabled
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self._dir = runfolder.path(workdir)
        self._dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(workdir) if int(r.get("iteration", -1)) < start_iteration]
        self._lines = [json.dumps(r) for r in kept]
        self._save()
        self._tb = _Events(self._dir / "tb", start_iteration)
        if config is not None or derived:
            self._tb.config(config or {}, derived or {})
        # The purge at start_iteration also drops the kept validation drawn at step start_iteration: re-add it.
        for r in kept:
            self._tb.scalars(
                {k: v for k, v in r.items() if keys.x_of(k, r["iteration"]) >= start_iteration}, r["iteration"]
            )
        self._tb.flush()
        if wandb_project is not None:
            self._wandb = _Wandb(wandb_project, self._dir, dict(config or {}, derived=derived or {}))

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
        self._tb.scalars(rec, iteration)
        self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(rec, iteration)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def _scalars(rec: dict[str, Any], iteration: int) -> dict[int, dict[str, float]]:
    """x (iterations completed) -> {series: value} of a record's numeric entries."""
    out: dict[int, dict[str, float]] = {}
    for k, v in rec.items():
        if k != keys.ITERATION and isinstance(v, (int, float)) and not isinstance(v, bool):
            out.setdefault(keys.x_of(k, iteration), {})[keys.series_of(k)] = v
    return dict(sorted(out.items()))


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as ``{"section.field": value}``; values other than bool/int/float/str as JSON text."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
    return out


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

    def scalars(self, rec: dict[str, Any], iteration: int) -> None:
        for x, values in _scalars(rec, iteration).items():
            for k, v in values.items():
                self.writer.add_scalar(k, v, global_step=x)

    def config(self, config: dict[str, Any], derived: dict[str, Any]) -> None:
        """The config and derived sizes as a text summary and as hparams (one session, step 0)."""
        from tensorboardX.summary import hparams

        text = json.dumps({"config": config, "derived": derived}, indent=2, sort_keys=True, default=str)
        self.writer.add_text("config", "```\n" + text + "\n```", global_step=0)
        flat = flat_config(config)
        flat.update(flat_config(derived, "derived."))
        metrics = {keys.VAL_SUCCESS: 0.0, keys.TRAIN_SUCCESS: 0.0}  # names of scalar tags in this run
        for summary in hparams(flat, metrics):
            self.writer.file_writer.add_summary(summary)

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


class _Wandb:
    """One wandb run for the run folder: every key against the custom x ``iterations_completed``."""

    STEP = "iterations_completed"

    def __init__(self, project: str, folder: epath.Path, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "config.log.wandb=True needs wandb: pip install -e '.[wandb]' (or set config.log.wandb=False)"
            ) from None
        id_file = folder / "wandb_id"
        run_id = (runfolder.read_text(id_file) or "").strip() or uuid.uuid4().hex[:12]
        runfolder.write_text(id_file, run_id)
        # wandb writes its files locally: in the run folder, or a temporary folder for a gs:// run
        local = tempfile.mkdtemp(prefix="bipace_wandb_") if runfolder.is_remote(folder) else os.fspath(folder)
        self._wandb = wandb
        self.run = wandb.init(project=project, id=run_id, resume="allow", dir=local, config=config, name=folder.name)
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP)

    def log(self, rec: dict[str, Any], iteration: int) -> None:
        for x, values in _scalars(rec, iteration).items():
            self.run.log({**values, self.STEP: x})

    def close(self) -> None:
        self.run.finish()


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
    """(iterations completed, value) of ``key`` over the records (``metric_keys.x_of``): a ``val/*``
    key's series starts with its ``val_before/*`` copy at 0; missing and null values are left out."""
    xs, ys = [], []
    before = keys.before(key) if key.startswith(keys.VAL + "/") else None
    for r in rows:
        for k in (before, key) if before else (key,):
            if r.get(k) is not None:
                xs.append(keys.x_of(k, r[keys.ITERATION]))
                ys.append(r[k])
    return xs, ys


def wilson(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (default 95%) of a binomial proportion ``successes / n``.

    ``successes`` may be fractional (a panel's rate x games). Returns ``(low, high)`` in [0, 1].

    Raises:
      ValueError: ``n <= 0`` or ``successes`` outside ``[0, n]``.
    """
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson: expected 0 <= successes <= n and n > 0, got {successes} of {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def panel_games(record: dict[str, Any], prefix: str, group_size: int, category: str | None = None) -> int:
    """Games behind a validation rate: ``tasks x group_size`` minus faulted games (``env_errors``,
    panel-wide only). ``prefix``: ``"val"``, ``"val/holdout"`` or a ``val_before`` copy; ``category``:
    ``"<key>_<value>"`` for a per-category rate (its ``tasks/<category>``). 0 when the record lacks it."""
    tasks = record.get(f"{prefix}/tasks" + (f"/{category}" if category else ""))
    if tasks is None:
        return 0
    errors = 0 if category else int(record.get(f"{prefix}/env_errors") or 0)
    return max(int(tasks) * int(group_size) - errors, 0)


def validation_points(rows: list[dict], prefix: str, group_size: int) -> list[tuple[int, float, float, float, int]]:
    """``(x, rate, low, high, games)`` of every validation of panel ``prefix`` (``"val"`` or
    ``"val/holdout"``), the before-RL one at x = 0; ``low``/``high``: 95% Wilson interval over its games."""
    out = []
    for r in rows:
        for p in (keys.before(prefix + "/success_rate").rsplit("/", 1)[0], prefix):
            v, n = r.get(f"{p}/success_rate"), panel_games(r, p, group_size)
            if v is not None and n > 0:
                out.append((keys.x_of(f"{p}/success_rate", r[keys.ITERATION]), v, *wilson(v * n, n), n))
    return out


def _run_config(workdir: str) -> dict[str, Any]:
    text = runfolder.read_text(runfolder.path(workdir) / "config.json")
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}


STAGES = ("rollout", "old_logprobs", "ref_logprobs", "estimator", "update")  # the trainer's StageTimer names
LOSS_PANELS = (  # (key, y label)
    ("loss/pg_loss", "policy-gradient loss"),
    ("loss/kl", "KL to reference (nats/token)"),
    ("loss/entropy", "entropy (nats/token)"),
    ("loss/clip_frac", "clipped token fraction"),
)


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
    """PNG plots of a run, every x = iterations completed (``metric_keys.x_of``):

    ``success.png`` (train curve; validation points with 95% Wilson intervals over their games),
    ``singleton_rate.png`` (hash vs clusters), ``pace_row_mix.png``, ``training.png`` (loss, KL,
    entropy, clip fraction), ``time.png`` (seconds per phase per iteration), ``categories.png`` (success
    per category before RL and at the last validation, with Wilson intervals), ``calibration.png``
    (singleton rate vs epsilon: the calibration sweep, the target and every iteration's point).

    ``train_temperature`` / ``val_temperature``: sampling temperatures, named in the success legend.
    ``grouping``: the estimator's step groups (``EstimatorSpec.grouping``), marked in the singleton
    plot. ``group_size`` (games per validation task, ``val.group_size``) and ``target_singleton_rate``
    (``estimator.calibration.target_singleton_rate``): read from ``<workdir>/config.json`` when None;
    without a group size the intervals are left out.

    Returns the paths written (under ``<workdir>/plots``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = list(rows) if rows is not None else read_metrics(workdir)
    cfg = _run_config(workdir)
    if group_size is None:
        group_size = cfg.get("val", {}).get("group_size")
    if target_singleton_rate is None:
        target_singleton_rate = cfg.get("estimator", {}).get("calibration", {}).get("target_singleton_rate")
    out_dir = runfolder.path(workdir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    x_label = "PPO iterations completed"

    def save(fig, name):
        paths.append(os.fspath(out_dir / name))
        with (out_dir / name).open("wb") as f:  # a file object: the folder may be gs://
            fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)

    def finish(ax, ylabel, title, ylim=None, xlabel=x_label):
        if xlabel != "category":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    def named(label, t):
        return label if t is None else f"{label} (T={t:g})"

    # Success: the training games, and each validation with its interval.
    fig, ax = plt.subplots(figsize=(6, 4))
    xs, ys = _series(rows, keys.TRAIN_SUCCESS)
    if xs:
        ax.plot(xs, ys, label=named("train batch", train_temperature))
    for prefix, label in (
        (keys.VAL, named("validation", val_temperature)),
        (keys.VAL_HOLDOUT, "validation, held-out goals"),
    ):
        pts = validation_points(rows, prefix, group_size) if group_size else []
        if pts:
            x, v, lo, hi, n = (np.array(c, float) for c in zip(*pts))
            ax.errorbar(
                x,
                v,
                yerr=[v - lo, hi - v],
                marker="o",
                capsize=3,
                label=f"{label}, {int(n[-1])} game{'' if n[-1] == 1 else 's'}",
            )
        elif not group_size and (xy := _series(rows, prefix + "/success_rate"))[0]:
            ax.plot(*xy, marker="o", label=label)
    finish(ax, "success rate", "Success (bars: 95% Wilson interval)" if group_size else "Success", (-0.02, 1.02))
    save(fig, "success.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label, kind in (
        (keys.HASH_SINGLETON_GROUPS, "exact hashing (GiGPO's)", "obs_hash"),
        (keys.CLUSTER_SINGLETON_GROUPS, "fingerprint clusters (BiGPO's, BiPACE's)", "cluster"),
    ):
        if (xy := _series(rows, key))[0]:
            ax.plot(*xy, label=label + (": trained on" if kind == grouping else ""))
    finish(ax, "singleton step-group rate", "Singleton rate of each partition on this run's batches")
    save(fig, "singleton_rate.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    xs, pace = _series(rows, keys.PACE_ROWS)
    _, loo = _series(rows, keys.LOO_ROWS)
    _, single = _series(rows, keys.SINGLETON_ROWS)
    if xs and len(pace) == len(loo) == len(single):
        ax.stackplot(xs, pace, loo, single, labels=["PACE (Q - V)", "leave-one-out", "singleton"])
    finish(ax, "share of rows", "PACE row mix", (0, 1))
    save(fig, "pace_row_mix.png")

    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, (key, label) in zip(axes.flat, LOSS_PANELS):
        if (xy := _series(rows, key))[0]:
            ax.plot(*xy, marker=".")
        finish(ax, label, key)
    fig.suptitle("PPO update (x: iterations completed before the batch's update)")
    fig.tight_layout()
    save(fig, "training.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    its = [r[keys.ITERATION] for r in rows]
    bottom = np.zeros(len(rows))
    phases = [(keys.stage_seconds(st), st) for st in STAGES]
    phases += [(keys.VALIDATION_SECONDS, "validation"), (keys.PREVIOUS_CHECKPOINT_SECONDS, "checkpoint (previous)")]
    for key, label in phases:
        h = np.array([float(r.get(key) or 0.0) for r in rows])
        if h.any():
            ax.bar(its, h, bottom=bottom, label=label)
            bottom += h
    finish(ax, "wall seconds", "Time per phase", xlabel="iteration")
    save(fig, "time.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    last = next((r for r in reversed(rows) if r.get(keys.VAL_SUCCESS) is not None), None)
    first = next((r for r in rows if r.get(keys.before(keys.VAL_SUCCESS)) is not None), None)
    cats = sorted(k[len(keys.VAL_SUCCESS) + 1 :] for k in (last or {}) if k.startswith(keys.VAL_SUCCESS + "/"))
    for j, (rec, prefix, label) in enumerate(
        ((first, keys.before(keys.VAL_SUCCESS).rsplit("/", 1)[0], "before RL"), (last, keys.VAL, "last validation"))
    ):
        if rec is None or not cats:
            continue
        v = np.array([float(rec.get(f"{prefix}/success_rate/{c}") or 0.0) for c in cats])
        n = [panel_games(rec, prefix, group_size or 0, c) for c in cats]
        lo_hi = [wilson(vi * ni, ni) if ni else (vi, vi) for vi, ni in zip(v, n)]
        err = [v - np.array([a for a, _ in lo_hi]), np.array([b for _, b in lo_hi]) - v]
        x = np.arange(len(cats)) + (j - 0.5) * 0.4
        suffix = f" (iteration {rec[keys.ITERATION] + 1})" if prefix == keys.VAL else ""
        ax.bar(x, v, 0.4, yerr=err if group_size else None, capsize=3, label=label + suffix)
    ax.set_xticks(
        np.arange(len(cats)), [f"{c}\n({last.get(f'{keys.VAL}/tasks/{c}', '?')} tasks)" for c in cats] if cats else []
    )
    finish(
        ax, "validation success rate", "Success per category (bars: 95% Wilson interval)", (0, 1.05), xlabel="category"
    )
    save(fig, "categories.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    prefix = keys.CALIBRATION_RATE + "/"
    sweep = sorted((float(k[len(prefix) :]), v) for r in rows for k, v in r.items() if k.startswith(prefix))
    if sweep:
        ax.plot(*zip(*sweep), marker="o", label="calibration sweep (iteration 0)")
    ep = [(r.get(keys.EPSILON), r.get(keys.CLUSTER_SINGLETON_GROUPS), r[keys.ITERATION]) for r in rows]
    ep = [e for e in ep if e[0] is not None and e[1] is not None]
    if ep:
        sc = ax.scatter(
            [e[0] for e in ep], [e[1] for e in ep], c=[e[2] for e in ep], cmap="viridis", zorder=3, label="iterations"
        )
        fig.colorbar(sc, ax=ax, label="iteration")
    if target_singleton_rate is not None and sweep:
        ax.axhline(target_singleton_rate, color="grey", linestyle="--", label=f"target {target_singleton_rate:g}")
    finish(
        ax,
        "singleton step-group rate (clusters)",
        "Calibration: singleton rate vs epsilon",
        xlabel="epsilon (cosine distance)",
    )
    save(fig, "calibration.png")
    return paths
