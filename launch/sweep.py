"""Run a grid of config overrides x seeds, one ordinary run folder per cell.

    python -m launch.sweep --config=configs/textcraft_tiny.py --workdir=runs/study \
        --grid='estimator.name=grpo,gigpo,bigpo,bipace_q,bipace_diff' --seeds=0,1,2 \
        --config.num_iterations=8 --parallel=1

Each cell is ``python -m launch.train`` in ``<workdir>/<cell>`` (the cell's name spells its
overrides, e.g. ``estimator.name=grpo,seed=0``) with the grid values, ``--config.seed=<seed>`` and
every ``--config.<field>=<value>`` given here. ``--grid`` may repeat (the cells are the product).
Cells run as separate processes, ``--parallel`` at a time (on a pod, keep 1: each cell takes the
whole slice). The sweep is resumable: a finished cell (``sweep_cell.json`` with exit code 0) is
skipped, a killed one resumes from its latest checkpoint. ``<workdir>/sweep.json`` records the grid
and each cell's status; ``python -m launch.report <workdir>`` aggregates the runs. ``--workdir`` may be
``gs://bucket/study`` (a cell's ``train.log`` is then written locally and copied up when the cell ends).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import app, flags
from etils import epath

from bipace_jax import runfolder
from launch import cli
from launch._common import ROOT

_CONFIG = flags.DEFINE_string("config", os.path.join("configs", "textcraft_tiny.py"), "Run config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Study folder: one run folder per cell.", required=True)
_GRID = flags.DEFINE_multi_string("grid", [], "'field=v1,v2,...' (repeatable; the cells are the product).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds of every grid point (config.seed).")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Cells run at the same time (processes).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the cells' commands and exit.")
cli.help_lists_fields("config", _CONFIG.default)  # the cells' config is parsed per cell (check_cell)


def split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: ``'a,(1, 2),b'`` -> ``['a', '(1, 2)', 'b']``."""
    out, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    return out


def parse_grid(specs: list[str], seeds: list[str]) -> list[list[tuple[str, str]]]:
    """The cells: one list of (field, value) per grid point and seed (seed last), seed by seed.

    Raises:
      ValueError: a spec without ``field=values``, an empty value, a field given twice or the field
        ``seed`` (use ``--seeds``), a seed that is not an int, or a repeated value or seed (two cells
        would share one run folder).
    """
    axes: list[list[tuple[str, str]]] = []
    seen = set()
    for spec in specs:
        field, sep, values = spec.partition("=")
        field = field.strip().removeprefix("config.")
        if not sep or not re.fullmatch(r"[A-Za-z_][\w.]*", field):
            raise ValueError(f"--grid must be 'field=v1,v2,...', got {spec!r}")
        if field == "seed" or field in seen:
            raise ValueError(f"--grid: field {field!r} given twice or is 'seed' (use --seeds), got {spec!r}")
        vals = split_values(values)
        if any(not v for v in vals):
            raise ValueError(f"--grid {field}: empty value in {values!r}")
        if len(set(vals)) != len(vals):
            raise ValueError(f"--grid {field}: a value is repeated in {values!r} (two cells would share a run folder)")
        seen.add(field)
        axes.append([(field, v) for v in vals])
    for s in seeds:
        if not re.fullmatch(r"-?\d+", s.strip()):
            raise ValueError(f"--seeds must be ints, got {s!r}")
    if len({int(s) for s in seeds}) != len(seeds):
        raise ValueError(f"--seeds: a seed is repeated in {','.join(seeds)} (two cells would share a run folder)")
    # seed-major: every grid point of seed 0 runs before any of seed 1, so a partial sweep is balanced
    return [[*point, ("seed", s.strip())] for s in seeds for point in itertools.product(*axes)]


def cell_name(cell: list[tuple[str, str]]) -> str:
    """A folder name spelling the cell's overrides. Characters outside [\\w.,=+-] become '_', and then
    the name ends in ``~`` + 8 hex digits of the raw overrides' SHA-1, so distinct values never share a
    folder (``Be brief!`` and ``Be brief?``; ``a/b`` and ``a_b``); a name with nothing replaced is kept
    as it is (older sweep folders resume)."""
    raw = ",".join(f"{f}={v}" for f, v in cell)
    name = re.sub(r"[^\w.,=+-]", "_", raw)
    return name if name == raw else f"{name}~{hashlib.sha1(raw.encode()).hexdigest()[:8]}"


_OVERRIDES: list[str] = []  # the command line's --config.<field>=<value>, for every cell


def _parse_flags(argv: list[str]) -> list[str]:
    """absl parsing of everything except the ``--config.<field>=<value>`` overrides, kept for the cells."""
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    bad = [a for a in overrides if "=" not in a]
    if bad:
        sys.exit(f"error: config overrides must be written --config.<field>=<value>, got {bad}")
    _OVERRIDES[:] = overrides
    return flags.FLAGS([a for a in argv if not a.startswith("--config.")])


def check_cell(config: str, cell: list[tuple[str, str]], extra: list[str]) -> None:
    """Build and validate one cell's config (``bipace_jax.build.build_spec``) before anything runs.

    Raises:
      ValueError: naming the cell and the bad field.
    """
    from ml_collections import config_flags

    from bipace_jax import build
    from bipace_jax import config as config_lib

    fv = flags.FlagValues()
    argv = ["sweep", f"--config={config}", *extra, *(f"--config.{f}={v}" for f, v in cell)]
    try:
        config_flags.DEFINE_config_file("config", config, flag_values=fv, sys_argv=argv)
        fv(argv)
        build.build_spec(fv.config)
    except (config_lib.ConfigError, flags.Error, ValueError, KeyError, AttributeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() is its repr
        if isinstance(e, (KeyError, AttributeError)):  # a misspelt field: name it and the fields meant
            fields = [a.split("=", 1)[0][len("--config.") :] for a in argv[2:]]
            msg = cli.unknown_field_message(cli.load_config(config), "config", fields) or msg
        raise ValueError(f"cell {cell_name(cell)}: {cli.one_line(msg)}") from None


def cell_command(config: str, run_dir: str, cell: list[tuple[str, str]], extra: list[str]) -> list[str]:
    """The ``launch.train`` argv of one cell: the config, its run folder, the shared overrides, then the cell's."""
    overrides = [f"--config.{f}={v}" for f, v in cell]
    return [sys.executable, "-m", "launch.train", f"--config={config}", f"--workdir={run_dir}", *extra, *overrides]


def _done(run_dir: str) -> bool:
    text = runfolder.read_text(epath.Path(run_dir) / "sweep_cell.json")
    return text is not None and json.loads(text).get("returncode") == 0


def _open_log(run_dir: str, name: str) -> tuple[Any, str]:
    """The cell's log file opened for appending, and where it is: ``<run_dir>/train.log``, or for a
    gs:// study a local temporary file (a child's output needs a local file) copied up by ``_close_log``."""
    if not runfolder.is_remote(run_dir):
        os.makedirs(run_dir, exist_ok=True)
        return open(os.path.join(run_dir, "train.log"), "a"), os.path.join(run_dir, "train.log")
    fd, path = tempfile.mkstemp(prefix=f"sweep_{re.sub(r'[^A-Za-z0-9_.=-]', '_', name)}_", suffix=".log")
    os.close(fd)
    return open(path, "a"), path


def _close_log(log: Any, run_dir: str) -> None:
    log.close()
    if runfolder.is_remote(run_dir):  # GCS has no append: the earlier attempts' log + this one, written whole
        dest = epath.Path(run_dir) / "train.log"
        dest.parent.mkdir(parents=True, exist_ok=True)  # a cell that failed at once made no folder
        with open(log.name) as f:
            runfolder.write_text(dest, (runfolder.read_text(dest) or "") + f.read())
        os.remove(log.name)


def _summary_line(run_dir: str) -> str:
    from bipace_jax import metric_keys as keys
    from bipace_jax.metrics import read_metrics

    rows = read_metrics(run_dir)
    before = keys.before(keys.VAL_SUCCESS)
    first = next((r[before] for r in rows if before in r), None)
    last = next((r[keys.VAL_SUCCESS] for r in reversed(rows) if keys.VAL_SUCCESS in r), None)
    fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    return f"{len(rows)} iterations, validation {fmt(first)} -> {fmt(last)}"


def main(argv):
    del argv
    try:
        cells = parse_grid(_GRID.value, _SEEDS.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if _PARALLEL.value < 1:
        raise app.UsageError(f"--parallel must be an int >= 1, got {_PARALLEL.value}")
    config = os.path.abspath(_CONFIG.value)
    if not os.path.exists(config):
        raise app.UsageError(f"--config {config} does not exist")
    try:
        study = os.fspath(runfolder.path(_WORKDIR.value))
    except runfolder.RunFolderError as e:
        sys.exit(f"error: {e}")
    extra = list(_OVERRIDES)
    jobs = [(cell_name(c), c) for c in cells]
    for _, cell in jobs:  # every cell's config is checked before the first one starts
        try:
            check_cell(config, cell, extra)
        except ValueError as e:
            sys.exit(f"error: {e}")
    if _DRY_RUN.value:
        for name, cell in jobs:
            print(" ".join(cell_command(config, os.fspath(epath.Path(study) / name), cell, extra)))
        return
    try:  # the study folder is checked before the first cell starts
        runfolder.prepare(study)
    except runfolder.RunFolderError as e:
        sys.exit(f"error: {e}")
    record: dict[str, Any] = {
        "config": os.path.relpath(config, ROOT) if config.startswith(ROOT) else config,
        "grid": _GRID.value,
        "seeds": _SEEDS.value,
        "overrides": extra,
        "cells": {},
    }

    def save():
        runfolder.write_text(epath.Path(study) / "sweep.json", json.dumps(record, indent=2))

    todo = []
    for k, (name, cell) in enumerate(jobs):
        run_dir = os.fspath(epath.Path(study) / name)
        if _done(run_dir):
            print(f"[{k + 1}/{len(jobs)}] {name}: finished earlier, skipped ({_summary_line(run_dir)})", flush=True)
            record["cells"][name] = "done"
        else:
            todo.append((k, name, cell, run_dir))
            record["cells"][name] = "pending"
    save()
    running: list[tuple[int, str, str, subprocess.Popen, float, Any]] = []
    failed = 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    while todo or running:
        while todo and len(running) < _PARALLEL.value:
            k, name, cell, run_dir = todo.pop(0)
            log, log_path = _open_log(run_dir, name)
            cmd = cell_command(config, run_dir, cell, extra)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((k, name, run_dir, proc, time.perf_counter(), log))
            record["cells"][name] = "running"
            save()
            where = f"{name}/train.log" if log_path.startswith(study) else f"{log_path}, then {name}/train.log"
            print(f"[{k + 1}/{len(jobs)}] {name}: started (log {where})", flush=True)
        time.sleep(0.5)
        for item in list(running):
            k, name, run_dir, proc, t0, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            _close_log(log, run_dir)
            wall = time.perf_counter() - t0
            cell_record = {"returncode": proc.returncode, "wall_s": wall, "cell": dict(jobs[k][1])}
            runfolder.write_text(epath.Path(run_dir) / "sweep_cell.json", json.dumps(cell_record, indent=2))
            if proc.returncode == 0:
                record["cells"][name] = "done"
                print(f"[{k + 1}/{len(jobs)}] {name}: done in {wall:.0f} s ({_summary_line(run_dir)})", flush=True)
            else:
                failed += 1
                record["cells"][name] = f"failed (exit code {proc.returncode})"
                print(f"[{k + 1}/{len(jobs)}] {name}: FAILED (exit code {proc.returncode}), see its train.log")
            save()
    if failed:
        sys.exit(f"sweep: {failed} of {len(jobs)} cells failed; run the same command again to retry them")
    print(f"sweep: {len(jobs)} cells done in {study}; report: python -m launch.report {study}")


if __name__ == "__main__":
    cli.run(main, flags_parser=_parse_flags)
