"""metric_keys: the documented table (docs/metrics.md is generated from it), the x rule, producer coverage."""

import os
import types

from bipace_jax import metric_keys as mk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_metrics_table_is_the_generated_one():
    text = open(os.path.join(ROOT, "docs", "metrics.md")).read()
    body = text.split("<!-- metric-keys:begin -->\n", 1)[1].split("<!-- metric-keys:end -->", 1)[0]
    assert body == mk.markdown_table(), "docs/metrics.md is stale: regenerate it (see the page's header)"


def test_x_is_iterations_completed():
    assert mk.x_of("train/success_rate", 4) == 4  # played by the policy after 4 updates
    assert mk.x_of("val/success_rate", 4) == 5  # validated after the 5th
    assert mk.x_of("val/holdout/success_rate/depth_2", 0) == 1
    assert mk.x_of("val_before/success_rate", 0) == 0 and mk.x_of("time/validation_s", 2) == 3
    assert mk.series_of("val_before/holdout/tasks") == "val/holdout/tasks"
    assert mk.series_of("val_before/validation_s") == "time/validation_s"


def test_patterns_match_name_parts_only():
    assert mk.describe("val/success_rate/depth_2").pattern == "val/success_rate/<category>_<value>"
    assert mk.describe("val/holdout/success_rate").pattern == "val/holdout/success_rate"
    assert mk.describe("estimator/calibration_singleton_rate/0.05").unit == "fraction"
    assert mk.undocumented(["val/x/success_rate", "loss/nope", "train/success_rate"]) == [
        "loss/nope",
        "val/x/success_rate",
    ]


def test_every_key_the_producers_name_is_documented():
    import numpy as np

    from bipace_jax import ppo
    from bipace_jax.estimators import diagnostics
    from bipace_jax.rollout import pack, records, turns
    from bipace_jax.stats import panel_metrics

    produced = [f"loss/{k}" for k in ppo.STAT_KEYS] + [
        "loss/loss",
        "loss/grad_norm",
        "loss/grad_norm_max",
        "loss/updates",
    ]
    produced += [f"estimator/{k}" for k in diagnostics.DIAGNOSTIC_KEYS]
    produced += [f"estimator/cluster_{k}" for k in diagnostics.SIZE_STATS]
    row = types.SimpleNamespace(prompt=[1, 2], valid=True, finish="eos")
    ep = types.SimpleNamespace(env_error=None, won=True)
    counters = dict.fromkeys(turns.COUNTERS, 0)
    stats = pack.episode_stats(counters, [row], [ep], 1, 0)
    produced += [f"rollout/{k}" for k in (*stats.keys(), *turns.COUNTERS, "slot_use")]
    produced += [f"time/rollout_{k}" for k in (*records.TIMING_KEYS, *records.SLOT_TIMING_KEYS)]
    a = np.array([1.0, 0.0])
    for panel in ("val", "val/holdout", "val_before", "val_before/holdout"):
        produced += list(panel_metrics(panel, a, a, a, a))
    assert len(produced) > 60
    assert mk.undocumented(produced) == []
