"""Run metrics: ``metrics.jsonl`` (one JSON line per iteration), TensorBoard events, wandb; reading them back.

Keys are ``<section>/<name>`` (``train/success_rate``, ``val/success_rate``, ``time/rollout_s``,
``estimator/singleton_group_rate``, ...) plus ``iteration``. Only the primary process writes.
On resume, lines for iterations that are re-run are dropped first, so the file holds exactly one
line per completed iteration, in order. Every file goes through ``bipace_jax.runfolder`` (local or gs://).
Keys are documented in ``bipace_jax.metric_keys.TABLE`` (docs/metrics.md); TensorBoard, wandb and the
plots (``bipace_jax.plots``) put each key at ``metric_keys.x_of`` (iterations completed), the before-RL
validation in the ``val/*`` series at 0. Host statistics and intervals live in ``bipace_jax.stats``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

import numpy as np
from etils import epath

from bipace_jax import metric_keys as keys
from bipace_jax import runfolder
from bipace_jax.stats import panel_games, wilson

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


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
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
