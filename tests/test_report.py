"""launch.report over runs that a study really produces: NaN validations, failed and unfinished seeds."""

import json
import os
import subprocess
import sys

import pytest

from launch import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(path, seed, vals, *, returncode=None, num_iterations=None):
    os.makedirs(path)
    config = {"seed": seed, "estimator": {"name": "grpo"}}
    if num_iterations is not None:
        config["num_iterations"] = num_iterations
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for i, v in enumerate(vals):
            rec = {"iteration": i, "estimator/pace_row_rate": 0.5, "val/success_rate": v}
            if i == 0:
                rec["val_before/success_rate"] = 0.5
            f.write(json.dumps(rec) + "\n")  # None is written as null, as metrics writes NaN
    if returncode is not None:
        with open(os.path.join(path, "sweep_cell.json"), "w") as f:
            json.dump({"returncode": returncode}, f)


def test_a_nan_validation_is_left_out_and_counted_not_a_crash(tmp_path):
    # seed 1's last panel faulted in every game: metrics wrote null; its final is its last finite one
    _run(tmp_path / "s0", 0, [0.6, 0.8])
    _run(tmp_path / "s1", 1, [0.9, None])
    r = report.aggregate(report.arms_of(report.find_runs([str(tmp_path)])), threshold=0.95)
    arm = r["arms"]["all runs"]
    by_run = {s["run"]: s for s in arm["per_run"]}
    assert by_run["s1"]["final"] == pytest.approx(0.9) and by_run["s1"]["missing_validations"] == 1
    assert arm["final"][0] == pytest.approx(0.85) and arm["counted"]["final"] == 2


def test_failed_and_unfinished_seeds_are_left_out_of_the_means_and_named(tmp_path):
    # the case: 3 seeds, one cell failed after 2 of 6 iterations: 90.0 +- 0.0 over the 2 complete
    _run(tmp_path / "s0", 0, [0.9] * 6, returncode=0, num_iterations=6)
    _run(tmp_path / "s1", 1, [0.9] * 6, returncode=0, num_iterations=6)
    _run(tmp_path / "s2", 2, [0.3, 0.3], returncode=1, num_iterations=6)
    _run(tmp_path / "s3", 3, [0.1, 0.1, 0.1], num_iterations=6)  # killed outside a sweep: no sweep_cell.json
    r = report.aggregate(report.arms_of(report.find_runs([str(tmp_path)])), threshold=0.95)
    arm = r["arms"]["all runs"]
    assert arm["seeds"] == 2 and arm["final"] == (pytest.approx(0.9), 0.0)
    assert arm["excluded"] == {"s2": "failed (exit code 1)", "s3": "incomplete (3 of 6 iterations)"}
    md = report.to_markdown(r)
    assert "| all runs | 2 | 90.0 +- 0.0 |" in md
    assert "Left out of the means: s2 (failed (exit code 1)), s3 (incomplete (3 of 6 iterations))." in md


def test_the_command_reports_with_one_complete_run_and_refuses_with_none(tmp_path):
    _run(tmp_path / "ok" / "s0", 0, [0.7, None], returncode=0, num_iterations=2)
    _run(tmp_path / "ok" / "s1", 1, [0.2], returncode=1, num_iterations=2)
    cmd = [sys.executable, "-m", "launch.report", str(tmp_path / "ok"), f"--out={tmp_path / 'out'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Left out of the means: s1 (failed (exit code 1))" in proc.stdout
    assert json.load(open(tmp_path / "out" / "report.json"))["arms"]["all runs"]["seeds"] == 1
    _run(tmp_path / "bad" / "s0", 0, [0.2], returncode=1, num_iterations=2)
    cmd = [sys.executable, "-m", "launch.report", str(tmp_path / "bad"), f"--out={tmp_path / 'out2'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "no complete run" in proc.stderr


def test_one_seed_says_n_1_and_the_band_is_a_t_interval(tmp_path):
    from tests.synthetic_run import write_run

    for seed in (0, 1, 2):
        write_run(tmp_path / "study" / f"grpo_s{seed}", seed=seed, estimator="grpo")
    write_run(tmp_path / "study" / "bq_s0", seed=0, estimator="bipace_q")
    r = report.aggregate(report.arms_of(report.find_runs([str(tmp_path / "study")])), threshold=0.7)
    assert sorted(r["arms"]) == ["estimator.name=bipace_q", "estimator.name=grpo"]
    assert report.arm_label("estimator.name=bipace_q") == "bipace_q"
    assert report.arm_label("estimator.name=grpo,sampler.temperature=1.0") == "grpo, temperature 1.0"
    md = report.to_markdown(r)
    assert "| estimator.name=bipace_q | 1 | 79.0 (n = 1) |" in md
    assert "| estimator.name=grpo | 3 | 81.0 +- 2.0 |" in md  # finals 0.79, 0.81, 0.83
    # the synthetic runs validate at x = 0 (before RL), 2, 4, 6: iterations completed
    assert [x for x, _ in r["arms"]["estimator.name=grpo"]["per_run"][0]["curve"]] == [0, 2, 4, 6]
    assert report.t_quantile(2) == 4.303 and report.t_quantile(30) == pytest.approx(2.042, abs=0.005)
    files = report.plot(r, str(tmp_path))
    assert files == ["learning_curves.png", "singleton_rates.png", "pace_rows.png"]
    assert open(tmp_path / "learning_curves.png", "rb").read(4) == b"\x89PNG"


def test_default_out_is_beside_the_runs_never_inside_one(tmp_path):
    _run(tmp_path / "study" / "s0", 0, [0.7])
    assert report.default_out(str(tmp_path / "study")) == str(tmp_path / "study" / "report")
    assert report.default_out(str(tmp_path / "study" / "s0") + "/") == str(tmp_path / "study" / "s0_report")
    cmd = [sys.executable, "-m", "launch.report", str(tmp_path / "study" / "s0")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "70.0 (n = 1)" in proc.stdout and "+- 0.0" not in proc.stdout.split("diagnostics")[0]
    assert sorted(os.listdir(tmp_path / "study" / "s0")) == ["config.json", "metrics.jsonl"]  # nothing written inside
    assert os.path.exists(tmp_path / "study" / "s0_report" / "report.md")


def test_before_rl_and_gain_columns_and_no_cluster_numbers_for_grpo(tmp_path):
    from tests.synthetic_run import write_run

    for seed in (0, 1, 2):
        write_run(tmp_path / "study" / f"grpo_s{seed}", seed=seed, estimator="grpo")
    write_run(tmp_path / "study" / "bq_s0", seed=0, estimator="bipace_q")
    r = report.aggregate(report.arms_of(report.find_runs([str(tmp_path / "study")])), threshold=0.7)
    grpo = r["arms"]["estimator.name=grpo"]
    # before RL: (0.5 + 0.2) / 2 = 0.35 for every seed; finals 0.79, 0.81, 0.83: gains 0.44, 0.46, 0.48
    assert grpo["before"] == (pytest.approx(0.35), pytest.approx(0.0))
    assert grpo["gain"] == (pytest.approx(0.46), pytest.approx(0.02))
    md = report.to_markdown(r)
    assert "| estimator.name=grpo | 3 | 81.0 +- 2.0 | 35.0 +- 0.0 | +46.0 +- 2.0 | 81.0 +- 2.0 |" in md
    assert "| estimator.name=bipace_q | 1 | 79.0 (n = 1) | 35.0 (n = 1) | +44.0 (n = 1) |" in md
    # diagnostics: hashing, clusters, pairs, PACE, LOO, epsilon, time share. GRPO has no clusters, step
    # groups or PACE: "-", not the 22.5 / 0.05 / 60.0 its records hold; bipace_q shows them all.
    assert "| estimator.name=grpo | 60.0 +- 0.0 | - | - | - | - | - | - |" in md
    assert (
        "| estimator.name=bipace_q | 60.0 (n = 1) | 22.5 (n = 1) | - | 60.0 (n = 1) | 30.0 (n = 1) | 0.05 (n = 1) | - |"
        in md
    )
    assert grpo["diagnostics"]["estimator/epsilon"][0] == pytest.approx(0.05)  # report.json keeps the value
    assert report.estimator_diagnostics("gigpo") == (
        "estimator/hash_singleton_group_rate",
        "estimator/pairs",
        "time/bipace_share",
    )
    assert len(report.estimator_diagnostics("not_registered")) == len(report.DIAGNOSTICS)
    # a study of GRPO arms alone draws no singleton-rate or PACE plot
    only = {k: v for k, v in r["arms"].items() if k == "estimator.name=grpo"}
    assert report.plot(dict(r, arms=only), str(tmp_path)) == ["learning_curves.png"]


def test_fields_a_resume_may_change_do_not_split_an_arm(tmp_path):
    # the case 6: three seeds of one config, seed 2 resumed with env.num_workers=4 (a field
    # resume treats as neutral) showed as two arms, n = 2 and n = 1
    import json

    from tests.synthetic_run import write_run

    for seed in range(3):
        write_run(tmp_path / "study" / f"grpo_s{seed}", seed=seed, estimator="grpo")
    resumed = tmp_path / "study" / "grpo_s2" / "config.json"
    config = json.loads(resumed.read_text())
    config["env"], config["log"] = {"num_workers": 4}, {"progress": False}
    resumed.write_text(json.dumps(config))
    write_run(tmp_path / "study" / "bq_s0", seed=0, estimator="bipace_q")
    arms = report.arms_of(report.find_runs([str(tmp_path / "study")]))
    study = str(tmp_path / "study")
    assert arms == {
        "estimator.name=bipace_q": [f"{study}/bq_s0"],
        "estimator.name=grpo": [f"{study}/grpo_s{s}" for s in range(3)],
    }


def test_the_report_refuses_an_out_folder_of_another_run_or_command(tmp_path):
    # the case 9: --out=<a run folder> mixed the report's files into the run's
    _run(tmp_path / "study" / "s0", 0, [0.7])
    _run(tmp_path / "other", 1, [0.5])
    cmd = [sys.executable, "-m", "launch.report", str(tmp_path / "study"), f"--out={tmp_path / 'other'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --out={tmp_path / 'other'} holds files launch.report did not write (config.json, metrics.jsonl)"
    )
    assert sorted(os.listdir(tmp_path / "other")) == ["config.json", "metrics.jsonl"]
