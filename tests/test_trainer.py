"""End to end: `python -m launch.train` on real TextCraft games with a tiny actor.

Pins: the two-iteration command leaves metrics, events, plots, a checkpoint and an HF export; a run
killed with SIGKILL mid-iteration resumes with no lost or repeated iteration; two local processes
(jax.distributed over CPU, gloo) run one iteration together. Processes share a persistent
compilation cache so later runs skip most compiles.
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.devices import wait_all
from tests.tiny_runs import TINY_RUN_FLAGS

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    *TINY_RUN_FLAGS,
    "--config.val.every=1",
    "--config.ppo.old_logprobs=recompute",  # so rollout/logprob_gap compares the sampler with the trainer
]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A tokenizer folder built once (the project's game BPE) and a compilation cache folder."""
    import configs.textcraft_tiny
    from bipace_jax.tiny import build_game_tokenizer

    base = tmp_path_factory.mktemp("e2e_shared")
    cfg = configs.textcraft_tiny.get_config()
    cfg.model.checkpoint = ""
    build_game_tokenizer(cfg, str(base / "tokenizer"), num_tasks=16)
    return {"tokenizer": str(base / "tokenizer"), "cache": str(base / "jax_cache")}


def _env(shared, **extra):
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        JAX_COMPILATION_CACHE_DIR=shared["cache"],
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PLATFORMS="cpu",
    )
    env.update(extra)
    return env


def _cmd(workdir, shared, *extra):
    return [
        sys.executable,
        "-m",
        "launch.train",
        f"--config={ROOT}/configs/textcraft_tiny.py",
        f"--workdir={workdir}",
        f"--config.model.tokenizer={shared['tokenizer']}",
        *TINY,
        *extra,
    ]


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


REQUIRED = [
    "train/success_rate",
    "train/episode_length",
    "train/invalid_rate",
    "train/env_errors",
    "train/optimizer_steps",
    "train/return",
    "loss/kl",
    "loss/entropy",
    "loss/clip_frac",
    "loss/grad_norm",
    "estimator/epsilon",
    "estimator/singleton_group_rate",
    "estimator/hash_singleton_group_rate",
    "estimator/cluster_singleton_group_rate",
    "estimator/pace_row_rate",
    "time/rollout_s",
    "time/old_logprobs_s",
    "time/ref_logprobs_s",
    "time/estimator_s",
    "time/update_s",
    "time/bipace_share",
    "val/success_rate",
    "val/success_rate/depth_2",
    "val/holdout/success_rate",
]


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory, shared):
    """The documented command, two iterations, run once: (workdir, completed process)."""
    w = tmp_path_factory.mktemp("two_iterations") / "run"
    out = subprocess.run(
        _cmd(w, shared, "--config.num_iterations=2"),
        cwd=ROOT,
        env=_env(shared),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return w, out


def _learning_record(row):
    """What an iteration computed (not how long it took)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "val_before/validation_s"))}


def test_two_iterations_on_textcraft_leave_metrics_events_checkpoint_plots_and_hf_export(two_iterations, shared):
    w, out = two_iterations
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Validation success" in out.stdout and "BiPACE-specific share" in out.stdout
    assert "Validation success (T=0.4) " in out.stdout  # configs/textcraft_tiny.py's val.temperature, not its name

    rows = _metrics(w)
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        for k in REQUIRED:
            assert k in r and r[k] is not None and math.isfinite(r[k]), k
        assert r["train/episodes"] == 4 and r["train/rows"] >= 4  # 2 groups x 2 rollouts, >= 1 step each
        assert 0 <= r["train/success_rate"] <= 1
        # the trainer's recomputed old log-probs equal the sampler's at the rollout temperature (0.6
        # in textcraft_tiny): same tokens, same tempered policy
        assert r["rollout/logprob_gap"] < 1e-3
    assert rows[0]["train/task_cursor"] == 0 and rows[1]["train/task_cursor"] == 2
    from bipace_jax import metric_keys

    assert metric_keys.undocumented({k for r in rows for k in r}) == []  # docs/metrics.md names every key
    # epsilon: the one-shot calibration of the first iteration (configs/textcraft_tiny.py enables it)
    # is the first grid value whose singleton rate meets the target, and it stays for the run.
    import configs.textcraft_tiny

    cal = configs.textcraft_tiny.get_config().estimator.calibration
    assert cal.enabled
    rates = {
        float(k.rsplit("/", 1)[1]): v
        for k, v in rows[0].items()
        if k.startswith("estimator/calibration_singleton_rate/")
    }
    tried = [e for e in cal.grid if e in rates]
    assert tried == list(cal.grid[: len(tried)]) and tried[-1] == rows[0]["estimator/epsilon"]
    assert rates[tried[-1]] <= cal.target_singleton_rate < min([rates[e] for e in tried[:-1]], default=2.0)
    assert rows[1]["estimator/epsilon"] == rows[0]["estimator/epsilon"]
    assert not any(k.startswith("estimator/calibration_") for k in rows[1])
    assert "val_before/success_rate" in rows[0]

    events = os.listdir(w / "tb")
    assert events and all(os.path.getsize(w / "tb" / e) > 0 for e in events)
    for name in ("success.png", "singleton_rate.png", "pace_row_mix.png", "training.png", "time.png", "categories.png"):
        with open(w / "plots" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    from bipace_jax.checkpointing import Checkpointer

    ck = Checkpointer(str(w))
    assert ck.latest_step() == 2

    # The exported policy is the trained one: it differs from the seed-0 initialisation.
    import jax
    from flax import nnx

    from bipace_jax.models import load_hf_checkpoint

    trained = nnx.state(load_hf_checkpoint(str(w / "hf_final")), nnx.Param)
    import configs.textcraft_tiny
    from bipace_jax.build import build_actor
    from bipace_jax.models import load_tokenizer

    cfg = configs.textcraft_tiny.get_config()
    cfg.model.checkpoint = ""
    for flag in TINY[:5]:
        k, v = flag[len("--config.model.") :].split("=")
        cfg.model[k] = int(v)
    init = nnx.state(build_actor(cfg.model, load_tokenizer(shared["tokenizer"]), seed=cfg.seed), nnx.Param)
    diffs = jax.tree.leaves(
        jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), trained, init)
    )
    assert max(diffs) > 0


def test_a_finished_run_says_so_and_reprints_its_report_from_disk(two_iterations, shared):
    from bipace_jax import resume

    w, first = two_iterations
    assert first.returncode == 0, first.stderr[-3000:]
    rows = _metrics(w)
    stored = json.loads((w / "config.json").read_text())
    line = resume.check_resume(str(w), stored, 2, allow_change=False)
    assert line == f"the run in {w} is finished (2 of 2 iterations); its report, from disk:"
    assert resume.check_resume(str(w), stored, 3, allow_change=False) is None  # a longer budget resumes it
    summary = resume.report_from_disk(str(w))
    assert summary["iterations_run"] == 2 and summary["last_train"] == rows[1]
    assert summary["first_val"]["val/success_rate"] == rows[0]["val_before/success_rate"]
    assert summary["last_val"]["val/holdout/success_rate"] == rows[1]["val/holdout/success_rate"]

    # The same command again: that line, then the run's own report (less the plots, HF folder and wall
    # time only the live run printed), and nothing trained or written.
    before = [(w / "metrics.jsonl").read_bytes(), os.listdir(w / "checkpoints"), os.listdir(w / "tb")]
    again = subprocess.run(
        _cmd(w, shared, "--config.num_iterations=2"), cwd=ROOT, env=_env(shared), capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-3000:]
    live = first.stdout.splitlines()
    live = live[next(i for i, ln in enumerate(live) if ln.startswith("Run folder: ")) :]
    live = [ln for ln in live if not ln.startswith(("Plots: ", "Policy (HF folder", "Wall time: "))]
    assert again.stdout.splitlines() == [line, *live]
    assert "Validation success" in live[1] and len(live) > 5
    assert [(w / "metrics.jsonl").read_bytes(), os.listdir(w / "checkpoints"), os.listdir(w / "tb")] == before


def test_sigkill_mid_iteration_resumes_with_no_lost_or_repeated_iteration(tmp_path, shared, two_iterations):
    w = tmp_path / "run"
    cmd = _cmd(
        w, shared, "--config.num_iterations=3", "--config.checkpoint.export_hf=False", "--config.log.plots=False"
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(shared), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 400
        while not os.path.isdir(w / "checkpoints" / "1"):  # iteration 0 committed
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "no checkpoint 1 in time"
            time.sleep(0.05)
        time.sleep(0.5)  # now inside iteration 1 (rollout or update)
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    killed_rows = _metrics(w)
    assert [r["iteration"] for r in killed_rows] in ([0], [0, 1])

    out = subprocess.run(cmd, cwd=ROOT, env=_env(shared), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(iterations 1 -> 3)" in out.stdout or "(iterations 2 -> 3)" in out.stdout
    rows = _metrics(w)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert [r["train/task_cursor"] for r in rows] == [0, 2, 4]
    assert rows[0] == killed_rows[0]  # the completed iteration is kept, not re-run
    # ...and the resumed run computes exactly what the uninterrupted run computed (same tasks, seeds,
    # RNG, parameters and optimizer state): iteration 1 was re-run from checkpoint 1, not skipped.
    uninterrupted = _metrics(two_iterations[0])
    assert two_iterations[1].returncode == 0
    for a, b in zip(rows[:2], uninterrupted):
        assert _learning_record(a) == _learning_record(b)
    from bipace_jax.checkpointing import Checkpointer

    assert Checkpointer(str(w)).latest_step() == 3


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_local_processes_run_one_iteration_together(tmp_path, shared):
    w = tmp_path / "run"
    port = _free_port()
    procs = []
    for pid in (0, 1):
        cmd = _cmd(
            w,
            shared,
            "--config.num_iterations=1",
            "--config.checkpoint.export_hf=False",
            "--config.log.plots=False",
            "--config.checkpoint.shared_workdir=True",  # both processes on this machine see tmp_path
            "--config.log.transcripts_every=1",
            f"--coordinator_address=localhost:{port}",
            "--num_processes=2",
            f"--process_id={pid}",
        )
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=_env(shared, JAX_NUM_CPU_DEVICES="1"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = wait_all(procs, timeout=600)
    rows = _metrics(w)
    assert [r["iteration"] for r in rows] == [0]
    r = rows[0]
    assert r["train/episodes"] == 4  # each process played its 1 task group x 2 rollouts; counts are summed
    assert r["train/hosts"] == 2
    assert math.isfinite(r["loss/grad_norm"]) and r["val/tasks"] == 2
    assert "Validation success" in outs[0][0] and "Validation success" not in outs[1][0]
    from bipace_jax.checkpointing import Checkpointer

    assert Checkpointer(str(w)).latest_step() == 1
    # transcripts: process 0 wrote every process's games, numbered over both (host 0's first)
    lines = [json.loads(ln) for ln in open(w / "episodes" / "0.jsonl")]
    roll = [ln for ln in lines if ln["phase"] == "rollout"]
    assert {(ln["host"], ln["game"]) for ln in roll} == {(0, 0), (0, 1), (1, 2), (1, 3)}
    assert len(roll) == r["train/rows"] and all(isinstance(ln["advantage"], float) for ln in roll)
    seen = {(ln["host"], ln["task_id"]) for ln in lines if ln["phase"] == "val"}  # one panel task per host
    assert len(seen) == 2 and {h for h, _ in seen} == {0, 1}
