"""One plain log line per iteration and per validation, from a run's metric record.

The lines go through Python logging (absl's handler in the launch commands) at INFO on this module's
own logger, whose level is INFO whatever absl's verbosity: a sweep cell's ``train.log`` and a run with
``log.progress=False`` show them as well as a terminal. Metric names come from ``metric_keys``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tqdm import tqdm

from bipace_jax import metric_keys as keys

log = logging.getLogger(__name__)
log.setLevel(logging.INFO)  # the lines show under absl's default WARNING verbosity too


def progress_bar(progress: bool, **kwargs) -> tqdm:
    """A tqdm bar (``kwargs`` as tqdm's) when ``progress``, else a disabled one.

    A shown bar passes no ``disable``, so the ``TQDM_DISABLE`` environment variable decides as for any
    tqdm: the launch commands set it when stderr is not a terminal, and an explicit ``disable=False``
    would override that and write hundreds of ``\r`` frames into a log file.
    """
    return tqdm(**kwargs) if progress else tqdm(disable=True, **kwargs)


#: (label, key, format) of the iteration line, in order; a key missing from the record is left out.
ITERATION_FIELDS = (
    ("success", keys.TRAIN_SUCCESS, "{:.3f}"),
    ("return", "train/return", "{:.3f}"),
    ("kl", "loss/kl", "{:.4g}"),
    ("entropy", "loss/entropy", "{:.4g}"),
    ("clip", "loss/clip_frac", "{:.3f}"),
    ("eps", keys.EPSILON, "{:.4g}"),
    ("singletons hash", keys.HASH_SINGLETON_GROUPS, "{:.3f}"),
    ("clusters", keys.CLUSTER_SINGLETON_GROUPS, "{:.3f}"),
)
#: Stages whose seconds the iteration line shows (``metric_keys.stage_seconds``).
STAGES = ("rollout", "old_logprobs", "ref_logprobs", "estimator", "update")


def _fmt(fmt: str, v) -> str:
    try:
        return fmt.format(float(v))
    except (TypeError, ValueError):
        return str(v)


def iteration_line(iteration: int, total: int, rec: Mapping[str, object]) -> str:
    """``"iteration 3/10: success 0.812 return 7.9 kl 0.0012 ... | 21.4 s (rollout 12.1 ...)"``;
    ``iteration`` counts the iterations completed (1-based)."""
    parts = [f"{label} {_fmt(fmt, rec[k])}" for label, k, fmt in ITERATION_FIELDS if k in rec]
    stages = [f"{s} {rec[keys.stage_seconds(s)]:.1f}" for s in STAGES if keys.stage_seconds(s) in rec]
    secs = rec.get(keys.ITERATION_SECONDS)
    timing = f" | {secs:.1f} s ({', '.join(stages)})" if secs is not None else ""
    return f"iteration {iteration}/{total}: " + " ".join(parts) + timing


def validation_line(iteration: int, rec: Mapping[str, object], *, before: bool = False) -> str:
    """``"validation after 3 iterations: seen 0.850 (40 games) held-out 0.700 | 9.1 s"`` of a
    ``Trainer.validate`` record (``val/...`` keys)."""
    parts = []
    for label, prefix in (("seen", keys.VAL), ("held-out", keys.VAL_HOLDOUT)):
        k = f"{prefix}/success_rate"
        if k in rec:
            parts.append(f"{label} {_fmt('{:.3f}', rec[k])}")
    secs = rec.get(keys.VALIDATION_SECONDS)
    when = "before RL" if before else f"after {iteration} iterations"
    return f"validation {when}: " + " ".join(parts) + (f" | {secs:.1f} s" if secs is not None else "")


def log_iteration(iteration: int, total: int, rec: Mapping[str, object]) -> None:
    """Log ``iteration_line`` at INFO."""
    log.info("%s", iteration_line(iteration, total, rec))


def log_validation(iteration: int, rec: Mapping[str, object], *, before: bool = False) -> None:
    """Log ``validation_line`` at INFO."""
    log.info("%s", validation_line(iteration, rec, before=before))
