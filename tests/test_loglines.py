"""The plain log lines of an iteration and a validation (bipace_jax/loglines.py), on hand-made records."""

import logging

from bipace_jax import loglines
from bipace_jax import metric_keys as keys


def test_iteration_line_shows_the_record_values_and_phase_seconds():
    rec = {
        keys.TRAIN_SUCCESS: 0.8125,
        "train/return": 7.5,
        "loss/kl": 0.00123,
        "loss/entropy": 1.25,
        "loss/clip_frac": 0.04,
        keys.EPSILON: 0.003,
        keys.HASH_SINGLETON_GROUPS: 0.5,
        keys.CLUSTER_SINGLETON_GROUPS: 0.25,
        keys.stage_seconds("rollout"): 12.04,
        keys.stage_seconds("update"): 3.0,
        keys.ITERATION_SECONDS: 15.5,
    }
    assert loglines.iteration_line(3, 10, rec) == (
        "iteration 3/10: success 0.812 return 7.500 kl 0.00123 entropy 1.25 clip 0.040 eps 0.003 "
        "singletons hash 0.500 clusters 0.250 | 15.5 s (rollout 12.0, update 3.0)"
    )


def test_validation_line_names_both_panels():
    rec = {keys.VAL_SUCCESS: 0.85, keys.VAL_HOLDOUT_SUCCESS: 0.7, keys.VALIDATION_SECONDS: 9.06}
    assert loglines.validation_line(4, rec) == "validation after 4 iterations: seen 0.850 held-out 0.700 | 9.1 s"
    assert loglines.validation_line(0, {keys.VAL_SUCCESS: 0.5}, before=True) == "validation before RL: seen 0.500"


def test_lines_are_logged_at_info_under_a_warning_root():
    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    root, keep = logging.getLogger(), Keep()
    level = root.level
    root.setLevel(logging.WARNING)  # absl's verbosity in launch.train
    root.addHandler(keep)
    try:
        loglines.log_iteration(1, 2, {keys.TRAIN_SUCCESS: 1.0})
        logging.getLogger("bipace_jax.other").info("hidden")  # other INFO lines stay hidden
    finally:
        root.removeHandler(keep)
        root.setLevel(level)
    assert keep.lines == ["iteration 1/2: success 1.000"]
