"""What a resumed run may change: the config fields whose change alters the run, and the run's state on disk.

A run folder keeps the config it started with (``config.json``). Starting again in the same folder
resumes; a config that differs in a field that changes what is trained or measured (the estimator,
the learning rate, the games, the seed...) would silently mix two runs in one curve, so
``changed_fields`` names those fields and the command refuses unless told otherwise. Fields that only
change how the run is carried out (logging, checkpoint cadence, worker counts, the iteration budget)
may change freely.
"""

from __future__ import annotations

import json
from typing import Any

from bipace_jax import runfolder

CONFIG_FILE = "config.json"

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


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of a nested dict (a config's ``to_dict()`` or its JSON)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _neutral(field: str) -> bool:
    return any(field == p.rstrip(".") or field.startswith(p if p.endswith(".") else p + ".") for p in NEUTRAL)


def _canonical(v: Any) -> Any:
    return json.loads(json.dumps(v, default=str))  # tuples -> lists, enums/paths -> str, as config.json holds them


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, old value, new value)`` for every field outside ``NEUTRAL`` that differs between two
    configs (nested dicts); a field present in one only counts as changed (its other value None)."""
    a, b = flatten(_canonical(old)), flatten(_canonical(new))
    return [(f, a.get(f), b.get(f)) for f in sorted(set(a) | set(b)) if not _neutral(f) and a.get(f) != b.get(f)]


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
