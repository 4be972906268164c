"""launch.sweep (grid parsing, config checks, a 2-cell run that resumes after a kill) and launch.report
(hand-written run folders with hand-computed means, stds and iterations to a threshold)."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from launch import report, sweep
from tests.tiny_runs import TINY_RUN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_grid_values_split_outside_brackets_and_cells_are_the_product_with_seeds_last():
    assert sweep.split_values("a,(1, 2),'x,y',b") == ["a", "(1, 2)", "'x,y'", "b"]
    cells = sweep.parse_grid(["estimator.name=grpo,bipace_q", "config.ppo.epochs=1,2"], ["0", "1"])
    assert len(cells) == 8
    assert cells[0] == [("estimator.name", "grpo"), ("ppo.epochs", "1"), ("seed", "0")]
    assert cells[3] == [("estimator.name", "bipace_q"), ("ppo.epochs", "2"), ("seed", "0")]  # seed-major
    assert cells[-1] == [("estimator.name", "bipace_q"), ("ppo.epochs", "2"), ("seed", "1")]
    assert sweep.cell_name(cells[4]) == "estimator.name=grpo,ppo.epochs=1,seed=1"
    assert sweep.cell_name([("sampler.batch_buckets", "(4, 8)")]).startswith("sampler.batch_buckets=_4,_8_~")


@pytest.mark.parametrize(
    "specs,seeds,match",
    [
        (["estimator.name"], ["0"], "--grid must be 'field=v1,v2,...'"),
        (["seed=1,2"], ["0"], "use --seeds"),
        (["a.b=1", "a.b=2"], ["0"], "given twice"),
        (["a.b=1,,2"], ["0"], "empty value"),
        ([], ["x"], "--seeds must be ints"),
    ],
)
def test_bad_grid_is_refused_naming_the_problem(specs, seeds, match):
    with pytest.raises(ValueError, match=match):
        sweep.parse_grid(specs, seeds)


def test_every_cell_config_is_checked_before_anything_runs():
    config = os.path.join(ROOT, "configs", "textcraft_tiny.py")
    sweep.check_cell(config, [("estimator.name", "gigpo"), ("seed", "3")], ["--config.num_iterations=2"])
    with pytest.raises(ValueError, match=r"cell estimator.name=bogus,seed=0: config.estimator.name: expected one of"):
        sweep.check_cell(config, [("estimator.name", "bogus"), ("seed", "0")], [])
    with pytest.raises(
        ValueError,
        match=r"cell estimator.nme=grpo,seed=0: --config.estimator.nme: .*did you mean --config.estimator.name",
    ):
        sweep.check_cell(config, [("estimator.nme", "grpo"), ("seed", "0")], [])


def _fake_run(path, name, seed, val_before, vals, diag):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"seed": seed, "estimator": {"name": name, "gamma": 0.95}, "env": {"name": "textcraft"}}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for i, v in enumerate(vals):
            rec = {"iteration": i, "estimator/cluster_singleton_group_rate": diag[i], "estimator/pace_row_rate": 0.5}
            if i == 0:
                rec["val_before/success_rate"] = val_before
            if v is not None:
                rec.update({"val/success_rate": v, "val/success_rate/depth_2": v / 2, "val/tasks": 9})
            f.write(json.dumps(rec) + "\n")


def test_report_of_hand_written_runs_gives_hand_computed_numbers(tmp_path):
    study = tmp_path / "study"
    _fake_run(study / "a0", "grpo", 0, 0.5, [0.6, None, 0.8], [0.4, 0.2, 0.3])
    _fake_run(study / "a1", "grpo", 1, 0.5, [0.9, None, 0.7], [0.1, 0.1, 0.1])
    _fake_run(study / "b0", "bipace_q", 0, 0.5, [0.5, 0.6, 0.95], [0.0, 0.0, 0.0])
    (study / "notes").mkdir()  # not a run folder: ignored
    arms = report.arms_of(report.find_runs([str(study)]))
    assert sorted(arms) == ["estimator.name=bipace_q", "estimator.name=grpo"]
    r = report.aggregate(arms, threshold=0.85)
    grpo, bq = r["arms"]["estimator.name=grpo"], r["arms"]["estimator.name=bipace_q"]
    # final: 0.8 and 0.7 -> mean 0.75, sample std sqrt(((0.05)^2 * 2) / 1) = 0.0707
    assert grpo["final"][0] == pytest.approx(0.75) and grpo["final"][1] == pytest.approx(math.sqrt(0.005))
    # best: 0.8 and 0.9; iterations to 0.85: seed 1 reaches 0.9 after iteration 0 (1 iteration), seed 0 never
    assert grpo["best"][0] == pytest.approx(0.85)
    assert grpo["iterations_to_threshold"] == (1.0, None) and grpo["reached_threshold"] == "1/2"
    assert bq["iterations_to_threshold"] == (3.0, None) and bq["reached_threshold"] == "1/1"
    assert bq["final"] == (pytest.approx(0.95), None)  # one seed: no spread
    assert grpo["final_by_key"]["val/success_rate/depth_2"][0] == pytest.approx(0.375)
    # diagnostics: the mean over iterations, then over seeds: (0.3 + 0.1) / 2
    assert grpo["diagnostics"]["estimator/cluster_singleton_group_rate"][0] == pytest.approx(0.2)
    md = report.to_markdown(r)
    # before RL 0.5 for every seed; gains 0.3 and 0.2 (grpo), 0.45 (bipace_q), in points
    assert (
        "| estimator.name=grpo | 2 | 75.0 +- 7.1 | 50.0 +- 0.0 | +25.0 +- 7.1 | 85.0 +- 7.1 | 1 (n = 1) (1/2) |" in md
    )
    assert "| estimator.name=bipace_q | 1 | 95.0 (n = 1) | 50.0 (n = 1) | +45.0 (n = 1) | 95.0 (n = 1) |" in md
    assert report.plot(r, str(tmp_path)) == ["learning_curves.png", "singleton_rates.png", "pace_rows.png"]


TINY = [
    *TINY_RUN_FLAGS,
    "--config.log.plots=False",
    "--config.checkpoint.export_hf=False",
    "--config.num_iterations=1",
]


@pytest.mark.slow
def test_two_cell_sweep_runs_and_resumes_after_a_kill(tmp_path):
    from bipace_jax.tiny import build_game_tokenizer
    from configs import textcraft_tiny

    cfg = textcraft_tiny.get_config()
    cfg.model.checkpoint = ""
    build_game_tokenizer(cfg, str(tmp_path / "tok"), num_tasks=16)
    study = tmp_path / "study"
    cmd = [
        sys.executable,
        "-m",
        "launch.sweep",
        f"--workdir={study}",
        "--grid=estimator.name=grpo,bipace_q",
        "--seeds=0",
        f"--config.model.tokenizer={tmp_path / 'tok'}",
        *TINY,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    first, second = study / "estimator.name=grpo,seed=0", study / "estimator.name=bipace_q,seed=0"
    try:  # kill the whole sweep (it and its cell) once the second cell has started
        deadline = time.time() + 600
        while not (second / "train.log").exists():
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert json.loads((first / "sweep_cell.json").read_text())["returncode"] == 0
    assert not (second / "sweep_cell.json").exists()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "[1/2] estimator.name=grpo,seed=0: finished earlier, skipped (1 iterations" in out.stdout
    assert "[2/2] estimator.name=bipace_q,seed=0: done in" in out.stdout
    status = json.loads((study / "sweep.json").read_text())
    assert status["cells"] == {"estimator.name=grpo,seed=0": "done", "estimator.name=bipace_q,seed=0": "done"}
    r = report.aggregate(report.arms_of(report.find_runs([str(study)])), threshold=0.5)
    assert sorted(r["arms"]) == ["estimator.name=bipace_q", "estimator.name=grpo"]
