"""What a resumed run may change: the config fields whose change alters the run, and the run's state on disk.

A run folder keeps the config it started with (``config.json``). Starting again in the same folder
resumes; a config that differs in a field that changes what is trained or measured (the estimator,
the learning rate, the games, the seed...) would silently mix two runs in one curve, so
``changed_fields`` names those fields and the command refuses unless told otherwise. Fields that only
change how the run is carried out (logging, checkpoint cadence, worker counts, the iteration budget)
may change freely. ``check_resume`` applies the rule for ``launch.train`` (and says when a run is
finished; ``report_from_disk`` rebuilds its report), ``check_config_change`` for any command
(``bipace_jax.sft.run`` with the warm start's ``SFT_NEUTRAL``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from bipace_jax import metric_keys, runfolder
from bipace_jax.metrics import read_metrics

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
#: The file orbax writes into a checkpoint's step folder once the step is complete.
COMMIT_MARKER = "commit_success.txt"
ALLOW_FLAG = "--allow_config_change"

#: Field prefixes (dotted, ``config.`` left off) a resume may change without changing the run.
NEUTRAL = (
    "num_iterations",  # extending (or shortening) a run continues the same run
    "log.",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.async_save",
    "checkpoint.export_hf",
    "checkpoint.shared_workdir",
    "env.num_workers",
    "env.timeout_s",
    "compile_cache_dir",
)

#: Fields added to the config after run folders were written, with the value that reproduces a run
#: whose stored config lacks them: resuming such a run with that value is no change (another value is).
ADDED = {
    "optim.schedule": "constant",  # the warm start's warmup_cosine joined the RL config's optimizer
    "estimator.hgpo_history": 2,  # HGPO's options: read only by the hgpo estimator
    "estimator.hgpo_alpha": 1.0,
    "estimator.hgpo_base_group": False,
    "ppo.pack": False,  # packed micro-batches: off reproduces the unpacked update
    "ppo.pack_width": 0,
    "ppo.pack_response_width": 0,
    "ppo.tis_cap": 0.0,  # truncated importance weights: off is the unweighted loss
    "async_rl.max_staleness": 0,  # asynchronous RL: off (colocated, on-policy) is the synchronous loop
    "async_rl.switch": "turn",
    "async_rl.sampler_devices": 0,
    "async_rl.sampler_processes": 0,
    "rollout.branch_turns": [],  # branching rollouts: off plays every game from the reset, as before
    "rollout.branch_children": 2,
}

#: The warm start's (``bipace_jax.sft``) fields a resume may change: how often it logs and saves, its
#: worker count, its example log. Any other change (a round count, a learning rate, the data) alters
#: the updates a resumed run makes (the LR schedule spans all rounds).
SFT_NEUTRAL = ("env.num_workers", "train.log_every", "train.checkpoint_every", "train.log_examples")


class ConfigChangeError(ValueError):
    """A resume whose config differs from the run folder's ``config.json`` in a field that changes the run."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of a nested dict (a config's ``to_dict()`` or its JSON)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def is_neutral(field: str, neutral: Sequence[str] = NEUTRAL) -> bool:
    """Whether the dotted ``field`` (``config.`` left off) falls under ``neutral``: a field a resume may
    change without changing the run (so it never tells two runs apart, e.g. in ``launch.report``'s arms)."""
    return any(field == p.rstrip(".") or field.startswith(p if p.endswith(".") else p + ".") for p in neutral)


def _canonical(v: Any) -> Any:
    return json.loads(json.dumps(v, default=str))  # tuples -> lists, enums/paths -> str, as config.json holds them


def changed_fields(
    old: dict[str, Any], new: dict[str, Any], neutral: Sequence[str] = NEUTRAL
) -> list[tuple[str, Any, Any]]:
    """``(field, old value, new value)`` for every field outside ``neutral`` (dotted prefixes; a trailing
    "." covers a section) that differs between two configs (nested dicts); a field present in one only
    counts as changed (its other value None), unless it is one of ``ADDED`` at its added value (a run
    stored before that field existed)."""
    a, b = flatten(_canonical(old)), flatten(_canonical(new))
    for side, other in ((a, b), (b, a)):
        for f, v in ADDED.items():
            if f not in side and other.get(f) == v:
                side[f] = v
    return [
        (f, a.get(f), b.get(f)) for f in sorted(set(a) | set(b)) if not is_neutral(f, neutral) and a.get(f) != b.get(f)
    ]


def stored_config(workdir: str) -> dict[str, Any] | None:
    """The config a run folder started with (its ``config.json``), or None when it has none or it does not parse."""
    text = runfolder.read_text(runfolder.path(workdir) / CONFIG_FILE)
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def describe(changes: list[tuple[str, Any, Any]], limit: int = 6) -> str:
    """One line: ``"config.a: 1 -> 2, config.b: x -> y"`` (the first ``limit``, then a count)."""
    shown = [f"config.{f}: {o!r} -> {n!r}" for f, o, n in changes[:limit]]
    more = f" and {len(changes) - limit} more" if len(changes) > limit else ""
    return ", ".join(shown) + more


def logged(workdir: str) -> int:
    """1 + the highest ``iteration`` in the run folder's ``metrics.jsonl`` (0 when it has none): the
    iterations a training run completed, the updates a warm start logged."""
    return 1 + max((r.get(metric_keys.ITERATION, -1) for r in read_metrics(workdir)), default=-1)


def check_config_change(
    workdir: str,
    old: dict[str, Any] | None,
    new: dict[str, Any],
    done: int,
    allow: bool,
    *,
    neutral: Sequence[str] = NEUTRAL,
    unit: str = "iterations",
) -> list[tuple[str, Any, Any]]:
    """Refuse to resume the run in ``workdir`` (config ``old``, its ``config.json``; ``done`` ``unit``
    logged) with config ``new`` when they differ outside ``neutral``; with ``allow`` keep ``old`` as
    ``config.before_<done>.json`` and go on. A folder with no stored config or nothing done holds no
    run to mix with. Returns the changes (``changed_fields``; empty when there is nothing to check).

    Raises:
      ConfigChangeError: one line naming ``workdir``, ``done``, the changed fields (old -> new) and
        ``ALLOW_FLAG``.
    """
    if old is None or done <= 0:
        return []
    changes = changed_fields(old, new, neutral)
    if changes and not allow:
        raise ConfigChangeError(
            f"--workdir={workdir} holds a run ({done} {unit}) with another config: "
            f"{describe(changes)}; use a new --workdir, or {ALLOW_FLAG} to continue it"
        )
    if changes:
        kept = runfolder.path(workdir) / f"config.before_{done}.json"
        runfolder.write_text(kept, json.dumps(old, indent=2))
        log.warning("resuming with a changed config (%s); the old one is %s", describe(changes), kept)
    return changes


#: Where a checkpoint step keeps its ``meta`` item (orbax's ``JsonSave``; read here without orbax).
META_FILE = ("meta", "metadata")


def latest_record(workdir: str) -> tuple[int, dict[str, Any]] | None:
    """``(step, meta)`` of the newest committed checkpoint in ``workdir`` whose ``meta`` reads (the
    dict ``Checkpointer.save`` wrote: ``CheckpointMeta`` fields, ``step``, ``rng``), or None when there
    is none. Reads one small JSON file per step tried, without orbax; local or ``gs://``."""
    root = runfolder.path(workdir) / "checkpoints"
    if not root.exists():
        return None
    for step in sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True):
        folder = root / str(step)
        if not (folder / COMMIT_MARKER).exists():
            continue
        try:
            return step, json.loads(runfolder.read_text(folder.joinpath(*META_FILE)) or "")
        except json.JSONDecodeError:
            continue
    return None


def checkpoint_changes(workdir: str, config: dict[str, Any]) -> tuple[int, list[tuple[str, Any, Any]]] | None:
    """The newest checkpoint in ``workdir`` against ``config`` (a ``to_dict()``): ``(its iteration, the
    changed fields)`` by the config it recorded (``changed_fields``), or, for a checkpoint that recorded
    none, by its seed and estimator name; None when the folder has no readable checkpoint."""
    record = latest_record(workdir)
    if record is None:
        return None
    step, meta = record
    if isinstance(meta.get("config"), dict):
        return int(meta.get("iteration", step)), changed_fields(meta["config"], config)
    recorded = {"seed": meta.get("seed"), "estimator.name": meta.get("estimator") or None}
    current = flatten(_canonical(config))
    changes = [(f, v, current.get(f)) for f, v in recorded.items() if v is not None and v != current.get(f)]
    return int(meta.get("iteration", step)), sorted(changes)


def check_resume(workdir: str, config: dict[str, Any], num_iterations: int, allow_change: bool) -> str | None:
    """``launch.train``'s resume rule for a run of ``config`` (a ``to_dict()``) and ``num_iterations``
    in ``workdir``: ``check_config_change`` against its ``config.json``, then the same rule against the
    newest checkpoint's own record (its config, or its seed and estimator), which holds when
    ``config.json`` or ``metrics.jsonl`` is damaged or gone. Returns the finished-run line when the
    folder's metrics already reach ``num_iterations``, else None.

    Raises:
      ConfigChangeError: the folder holds a run or a checkpoint of another config and not ``allow_change``.
    """
    old = stored_config(workdir)
    done = logged(workdir) if old is not None else 0
    check_config_change(workdir, old, config, done, allow_change)
    found = checkpoint_changes(workdir, config)
    if found is not None and found[1]:
        iteration, changes = found
        if not allow_change:
            raise ConfigChangeError(
                f"--workdir={workdir} holds a checkpoint (iteration {iteration}) of another config: "
                f"{describe(changes)}; use a new --workdir, or {ALLOW_FLAG} to continue it"
            )
        log.warning("resuming a checkpoint of another config (%s)", describe(changes))
    if done >= num_iterations and done > 0:
        return f"the run in {workdir} is finished ({done} of {num_iterations} iterations); its report, from disk:"
    return None


def fields_behind(workdir: str, config: dict[str, Any]) -> str:
    """For an error about state on disk that another config wrote (a checkpoint of other shapes): the
    config fields that differ from the folder's ``config.json`` (``"config.model.hidden_size: 4 -> 8"``),
    or the newest checkpoint's recorded config when ``config.json`` is gone; a sentence saying they are
    unknown when neither names one."""
    old = stored_config(workdir)
    changes = changed_fields(old, config) if old is not None else []
    if not changes and (found := checkpoint_changes(workdir, config)) is not None:
        changes = found[1]
    if not changes:
        return f"which config field changed is unknown ({CONFIG_FILE} and the checkpoint's record name none)"
    return f"config fields changed since: {describe(changes)}"


def report_from_disk(workdir: str) -> dict[str, Any]:
    """``launch.train.format_report``'s summary rebuilt from a run folder's ``metrics.jsonl``:
    ``first_val`` (the validation before RL, ``val/...`` keys), ``last_val`` (the last validation
    record), ``last_train`` (the last row), ``iterations_run``, ``start_iteration`` 0, ``workdir``."""
    rows = read_metrics(workdir)
    first = next((r for r in rows if r.get(metric_keys.ITERATION) == 0), {})
    first_val = {metric_keys.after(k): v for k, v in first.items() if k.startswith(metric_keys.VAL_BEFORE + "/")}
    last_val = next(
        ({k: v for k, v in r.items() if k.startswith("val/")} for r in reversed(rows) if metric_keys.VAL_SUCCESS in r),
        None,
    )
    return {
        "workdir": workdir,
        "start_iteration": 0,
        "iterations_run": len(rows),
        "first_val": first_val or None,
        "last_val": last_val,
        "last_train": rows[-1] if rows else None,
    }
