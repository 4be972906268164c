"""The metric keys of a run's records (``metrics.jsonl``), defined once for producers and consumers.

Keys are ``<section>/<name>``. The trainer writes them; ``metrics.make_plots``, ``launch.report`` and
``launch.sweep`` read them. Validation panels are named ``VAL`` (goals from the training set) and
``VAL_HOLDOUT`` (held-out goals); the validation before any update is recorded with iteration 0
under ``VAL_BEFORE`` (``before``/``after`` map the two). Imports nothing from the library.
"""

from __future__ import annotations

ITERATION = "iteration"

# Validation panels (prefixes) and the before-training copy of the first validation.
VAL = "val"
VAL_HOLDOUT = "val/holdout"
VAL_BEFORE = "val_before"

TRAIN_SUCCESS = "train/success_rate"
VAL_SUCCESS = "val/success_rate"
VAL_HOLDOUT_SUCCESS = "val/holdout/success_rate"
TASK_CURSOR = "train/task_cursor"
OPTIMIZER_STEPS = "train/optimizer_steps"
LOGPROB_GAP = "rollout/logprob_gap"

EPSILON = "estimator/epsilon"
CALIBRATION_RATE = "estimator/calibration_singleton_rate"  # + "/<epsilon>"
HASH_SINGLETON_GROUPS = "estimator/hash_singleton_group_rate"
CLUSTER_SINGLETON_GROUPS = "estimator/cluster_singleton_group_rate"
PACE_ROWS = "estimator/pace_row_rate"
LOO_ROWS = "estimator/loo_row_rate"
SINGLETON_ROWS = "estimator/singleton_row_rate"
PAIRS = "estimator/pairs"

ITERATION_SECONDS = "time/iteration_s"
VALIDATION_SECONDS = "time/validation_s"
PREVIOUS_CHECKPOINT_SECONDS = "time/previous_checkpoint_s"
BIPACE_SHARE = "time/bipace_share"  # estimator stage seconds / iteration seconds


def stage_seconds(stage: str) -> str:
    """The key of a stage's wall seconds: ``"rollout"`` -> ``"time/rollout_s"``."""
    return f"time/{stage}_s"


def before(key: str) -> str:
    """A validation record's key as recorded before training: its first section becomes
    ``VAL_BEFORE`` (``"val/x"`` -> ``"val_before/x"``, ``"val/holdout/x"`` -> ``"val_before/holdout/x"``,
    ``"time/validation_s"`` -> ``"val_before/validation_s"``).

    Raises:
      ValueError: ``key`` has no section (no "/").
    """
    section, sep, rest = key.partition("/")
    if not sep:
        raise ValueError(f"metric_keys.before: expected a '<section>/<name>' key, got {key!r}")
    return f"{VAL_BEFORE}/{rest}"


def after(key: str) -> str:
    """A ``VAL_BEFORE`` key as the validation key it copies: ``"val_before/x"`` -> ``"val/x"``.

    Raises:
      ValueError: ``key`` is not under ``VAL_BEFORE``.
    """
    if not key.startswith(VAL_BEFORE + "/"):
        raise ValueError(f"metric_keys.after: expected a key under {VAL_BEFORE + '/'!r}, got {key!r}")
    return VAL + key[len(VAL_BEFORE) :]
