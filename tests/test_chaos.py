"""The chaos run (`python -m launch.chaos`): every injected fault is survived and nothing is lost."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_chaos_run_survives_every_fault_with_no_iteration_lost_and_the_reference_parameters(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "launch.chaos", f"--workdir={tmp_path / 'runs'}", "--iterations=3", f"--out={out}"]
    # no warm-up run (its wall times are not checked here) and one prompt length: each program compiles once
    cmd += ["--nowarmup", "--config.sampler.length_buckets=(448,)"]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["faults_injected"] == s["faults_survived"] == 9
    assert s["iterations_lost"] == 0 and s["iterations_recorded_twice"] == 0
    process, games = s["runs"]["process"], s["runs"]["games"]
    for run in (process, games):
        assert run["iterations_recorded"] == [0, 1, 2]
    # a SIGKILL during a save and a torn newest checkpoint change nothing: the reference's exact weights
    assert process["final_params_equal_reference"] and process["final_params_max_abs_diff_vs_reference"] == 0.0
    assert process["torn_steps_set_aside"] and process["iterations_recomputed"] >= 1
    # a second run in the same folder refused at start-up; late polls dropped no answered game
    second = next(f for f in process["faults"] if f["fault"].startswith("a second run"))
    assert second["refused"] and "is in use by launch.train" in second["said"]
    assert process["late_polls"] and process["episodes_dropped"] == 0
    # every game fault fired once, inside the run; each mid-episode fault dropped at least its own game
    assert games["faults_fired"] == 5 and sorted(f["id"] for f in games["fired"]) == sorted(
        f["id"] for f in games["faults"]
    )
    by_kind = games["episodes_with_env_error_train_by_kind"]
    assert sum(by_kind.values()) == games["episodes_with_env_error_train"]
    assert games["episodes_with_env_error_train"] + games["episodes_with_env_error_val"] >= 4
