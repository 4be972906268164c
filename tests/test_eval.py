"""launch.eval: the shipped tiny checkpoint scored on small panels of configs/textcraft_tiny.py gives
exactly the trainer's own before-RL validation (record and transcripts) for the same seed and panels,
writes no training state, and reports in markdown; the trainer's rollout transcripts carry the
iteration's advantages; a bad checkpoint is one error line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bipace_jax import metric_keys as keys
from bipace_jax import transcripts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# small panels (3 seen goals, 1 held-out, one seed each), a 6-step cap: the same for eval and trainer
OVERRIDES = {
    "val.num_tasks": 3,
    "val.num_holdout_tasks": 1,
    "val.seeds_per_goal": 1,
    "env.max_steps": 6,
    "env.num_workers": 1,
    "log.progress": False,
    "log.transcripts_every": 1,
    "log.transcripts_max_games": 4,
}


def _run(*args, timeout=600):
    import jax

    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    # this pytest process's compilation cache (tests/conftest.py): the trainer's validation here then
    # loads the eval's programs instead of compiling them again
    if jax.config.jax_compilation_cache_dir:
        env.update(
            JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        )
    cmd = [sys.executable, "-m", "launch.eval", "--config=configs/textcraft_tiny.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _trainer_config():
    import configs.textcraft_tiny

    c = configs.textcraft_tiny.get_config()
    for dotted, v in OVERRIDES.items():
        section, field = dotted.split(".")
        c[section][field] = v
    # a cheap training iteration (2 task groups x 2 games, fixed epsilon): only its transcript is checked
    c.rollout.num_groups, c.rollout.group_size = 2, 2
    c.estimator.calibration.enabled = False
    return c


@pytest.mark.e2e
@pytest.mark.slow
def test_eval_equals_the_trainers_before_rl_validation_and_writes_no_training_state(tmp_path):
    out = tmp_path / "eval"
    proc = _run(f"--out={out}", *(f"--config.{k}={v}" for k, v in OVERRIDES.items()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "eval.json").read_text())
    assert sorted(os.listdir(out)) == [
        ".written_by.json",
        "config.json",
        "episodes",
        "eval.json",
        "report.md",
    ]  # no checkpoints/
    assert result["checkpoint"].endswith("bipace_jax/data/textcraft_tiny") and result["seed"] == 0

    from bipace_jax.trainer import Trainer

    tr = Trainer(_trainer_config(), str(tmp_path / "run"))
    try:
        before = tr.validate()  # what run() logs as val_before/* (iteration 0)
        rec = tr.train_iteration()
    finally:
        tr.close()
    ours = {k: v for k, v in result["record"].items() if k != keys.VALIDATION_SECONDS}
    assert ours == {k: v for k, v in before.items() if k != keys.VALIDATION_SECONDS}
    assert ours["val/tasks"] == 3 and ours["val/holdout/tasks"] == 1
    assert result["panels"] == {
        "val": [list(g) for g in tr.val_panel],
        "val/holdout": [list(g) for g in tr.holdout_panel],
    }

    # the same games, token for token: the eval's transcripts are the trainer's validation lines
    mine, theirs = transcripts.read(str(out), 0), transcripts.read(str(tmp_path / "run"), 0)
    val = [r for r in theirs if r["phase"] != "rollout"]
    assert mine == val and {r["phase"] for r in mine} == {"val", "val/holdout"}
    assert {r["game"] for r in mine if r["phase"] == "val"} == {0, 1, 2}

    # the training rollout's lines: every row of the 2 x 2 games, with the advantages the update used
    roll = [r for r in theirs if r["phase"] == "rollout"]
    assert {r["game"] for r in roll} == {0, 1, 2, 3} and all(r["step_group"] is not None for r in roll)
    assert all(r["iteration"] == 0 for r in roll) and len(roll) == rec["train/rows"]
    assert np.mean([r["advantage"] for r in roll]) == pytest.approx(rec["advantage/mean"], abs=1e-9)
    assert np.abs([r["advantage"] for r in roll]).max() == pytest.approx(rec["advantage/abs_max"], abs=1e-9)

    # the markdown report: one row per success rate, the seen panel's with its Wilson interval
    report = (out / "report.md").read_text()
    seen = ours["val/success_rate"]
    from bipace_jax.stats import wilson

    low, high = wilson(seen * 3, 3)
    assert f"| val/success_rate | {100 * seen:.1f}% | 3 | {100 * low:.1f}-{100 * high:.1f}% |" in report
    assert "| val/holdout/success_rate |" in report and report in proc.stdout


@pytest.mark.slow
def test_a_checkpoint_that_is_not_a_folder_is_one_error_line(tmp_path):
    proc = _run(f"--checkpoint={tmp_path / 'missing'}", f"--out={tmp_path / 'o'}", timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "TPU" not in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: config.model.checkpoint") and "config.json" in lines[0]
    assert not (tmp_path / "o").exists()  # nothing written before the checks pass
