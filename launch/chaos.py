"""Chaos test: train a tiny TextCraft agent while faults are injected, and show that nothing is lost.

    python -m launch.chaos --workdir=runs/chaos        # ~3.5 min on 2 cores; writes benchmarks/chaos.json
    python -m launch.chaos --workdir=runs/chaos --nowarmup --config.sampler.length_buckets='(448,)'

``--config.<field>=<value>`` flags are given to every run after the tiny settings (``TINY``);
``--nowarmup`` skips the warm-up run (the reference run fills the compilation cache then, so no
wall time lost is reported).

After a warm-up run (it fills the compilation cache, so wall times compare like with like), three
runs of one config and seed, each ``launch.train``'s job with the game wrapped in
``environments.testing.ChaosEnv`` (faults on a call-count schedule, each fired once):

1. ``reference``: undisturbed; it also counts the game calls, so the faults below land inside the run.
2. ``process``: a second run started in its folder while it trains must refuse; its host reads the
   env pools' answers late (twice per process, 6 s, past ``env.timeout_s``), which must drop no
   answered game; the trainer is SIGKILLed while it saves a checkpoint (its folder lock is left
   behind), then the newest committed checkpoint is torn (a data file truncated) before the restart.
   The restarted run must take the lock over, resume from the newest complete checkpoint, record
   every iteration once and end with the reference's final parameters (no game dropped, so no
   episode differs).
3. ``games``: a hung reset, a hung step, an exception and a segfault inside a game, and SIGKILL of a
   pool worker. The run must finish with every iteration recorded once; the episodes dropped are
   listed (fault, task, seed, step; a crashed or hung worker also ends its other games, "lost"),
   and the final parameters differ from the reference's only through them.

Prints a table and writes ``--out`` (JSON): faults injected and survived, iterations lost or
recorded twice (0), iterations recomputed after the restart, episodes dropped and why, wall time lost.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from absl import app, flags

from launch import train as train_launch
from launch._common import ROOT, write_json

_ITERATIONS = flags.DEFINE_integer("iterations", 4, "RL iterations of each run (>= 3; 4 resumes mid-run).")
_OUT = flags.DEFINE_string("out", "benchmarks/chaos.json", "Where to write the JSON summary.")
_WARMUP = flags.DEFINE_bool(
    "warmup", True, "Fill the compilation cache with a run of its own first, so the runs' wall times compare."
)
_CHILD_PLAN = flags.DEFINE_string("chaos_plan_dir", "", "Internal: run as the trainer child with this fault plan.")

# A run small enough for CI (a few seconds an iteration) that still trains, validates and checkpoints.
TINY = (
    "--config.model.hidden_size=32",
    "--config.model.num_layers=1",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=1",
    "--config.model.intermediate_size=64",
    "--config.model.checkpoint=",
    "--config.rollout.num_groups=2",
    "--config.rollout.group_size=2",
    "--config.env.max_steps=3",
    "--config.env.num_workers=2",
    "--config.env.timeout_s=4",
    "--config.sampler.max_new_tokens=16",
    "--config.sampler.batch_buckets=(4, 8)",
    "--config.val.num_tasks=2",
    "--config.val.num_holdout_tasks=1",
    "--config.val.every=2",
    "--config.val.seeds_per_goal=1",
    "--config.ppo.micro_batch_rows=8",
    "--config.log.progress=False",
    "--config.log.plots=False",
)
LATE_POLL_EVERY, LATE_POLL_S = 25, 6.0  # the process run's host reads its pools' answers late (> env.timeout_s=4)
GAME_FAULTS = (  # (call, kind, where in the reference run's calls: a fraction of its count)
    ("reset", "hang", 0.35),
    ("step", "hang", 0.3),
    ("step", "raise", 0.45),
    ("step", "segv", 0.6),
    ("step", "sigkill", 0.75),
)


def _late_polls(plan_dir: str) -> None:
    """Make the host read its env pools' answers late when ``<plan_dir>/late_poll.json`` asks
    (``{"every": k, "sleep_s": t, "times": n}``): every k-th time the pool takes in answers while jobs
    are in flight, n times per process, it first sleeps ``t`` seconds, past ``env.timeout_s`` (a
    compile or a long decode chunk in between). Each is noted in ``late_polls.jsonl``; answered jobs
    must stay answers (no fault, no game dropped)."""
    spec = os.path.join(plan_dir, "late_poll.json")
    if not os.path.exists(spec):
        return
    from environments import pool as pool_lib

    with open(spec) as f:
        plan = json.load(f)
    pump, count, fired = pool_lib.EnvPool._pump, [0], [0]

    def late(self, wait_s, enough):
        count[0] += 1
        if count[0] % plan["every"] == 0 and self.in_flight and fired[0] < plan["times"]:
            fired[0] += 1
            time.sleep(plan["sleep_s"])
            with open(os.path.join(plan_dir, "late_polls.jsonl"), "a") as f:
                f.write(json.dumps({"pump": count[0], "in_flight": self.in_flight, "sleep_s": plan["sleep_s"]}) + "\n")
        return pump(self, wait_s, enough)

    pool_lib.EnvPool._pump = late


def _child() -> None:
    """The trainer child: ``launch.train``'s job with the game wrapped in the fault injector."""
    from environments.testing import ChaosEnv

    _late_polls(_CHILD_PLAN.value)
    config = train_launch._CONFIG.value
    factory = functools.partial(ChaosEnv, config.env.name, os.path.abspath(_CHILD_PLAN.value))
    train_launch.train(config, train_launch._WORKDIR.value, resume=True, env_factory=factory)


def _command(run_dir: str, plan_dir: str, tokenizer: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launch.chaos",
        f"--chaos_plan_dir={plan_dir}",
        f"--workdir={run_dir}",
        f"--config={ROOT}/configs/textcraft_tiny.py",
        f"--config.model.tokenizer={tokenizer}",
        f"--config.num_iterations={_ITERATIONS.value}",
        *TINY,
        *_overrides(),
    ]


def _overrides() -> list[str]:
    """This command's own ``--config.<field>=<value>`` flags, for every run (after ``TINY``)."""
    return [a for a in sys.argv[1:] if a.startswith("--config.")]


def _environ(cache: str) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )


def _run(cmd: list[str], env: dict[str, str], log: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1800).returncode
    return rc, time.perf_counter() - t0


def _iterations(run_dir: str) -> list[int]:
    from bipace_jax.metrics import read_metrics

    return [int(r["iteration"]) for r in read_metrics(run_dir)]


def _metrics_sum(run_dir: str, prefix: str, suffix: str) -> float:
    """Sum over iterations and keys ``prefix*suffix`` of metrics.jsonl."""
    from bipace_jax.metrics import read_metrics

    rows = read_metrics(run_dir)
    return float(sum(v for r in rows for k, v in r.items() if k.startswith(prefix) and k.endswith(suffix)))


def _final_params(run_dir: str) -> dict[str, Any]:
    from safetensors.numpy import load_file

    out: dict[str, Any] = {}
    for name in sorted(os.listdir(os.path.join(run_dir, "hf_final"))):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(run_dir, "hf_final", name)))
    return out


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    import numpy as np

    if set(a) != set(b):
        return float("inf")
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a)


def _check_run(name: str, run_dir: str, rc: int, iterations: int) -> dict[str, Any]:
    seen = _iterations(run_dir)
    if rc != 0:
        raise RuntimeError(f"{name} run failed (exit code {rc}); see {run_dir}/chaos.log")
    return {
        "iterations_recorded": seen,
        "iterations_lost": len(set(range(iterations)) - set(seen)),
        "iterations_recorded_twice": len(seen) - len(set(seen)),
    }


def _kill_during_save(proc: subprocess.Popen, ckpt_dir: str, step: int, deadline_s: float) -> bool:
    """SIGKILL ``proc`` while checkpoint ``step`` is being written (its orbax temporary folder
    exists); True when the kill hit the save, False when the save committed first (killed then)."""
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end and proc.poll() is None:
        names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
        if any(n.startswith(f"{step}.") and "tmp" in n for n in names):
            proc.send_signal(signal.SIGKILL)
            return True
        if str(step) in names:
            proc.send_signal(signal.SIGKILL)
            return False
        time.sleep(0.0005)
    raise RuntimeError(f"checkpoint {step} never started within {deadline_s} s (exit code {proc.poll()})")


def _second_run(first: subprocess.Popen, run_dir: str, cmd: list[str], env: dict[str, str], log: str) -> dict:
    """Once ``first`` holds ``run_dir``'s lock, the same command again: it must refuse at start-up,
    naming the run that holds the folder, and write nothing there."""
    lock = os.path.join(run_dir, ".lock.process_0")
    t_end = time.monotonic() + 600
    while not os.path.exists(lock):
        if first.poll() is not None or time.monotonic() > t_end:
            raise RuntimeError(f"the first run never took {lock} (exit code {first.poll()})")
        time.sleep(0.05)
    rc, wall = _run(cmd, env, log)
    said = open(log).read()
    refused = rc != 0 and "is in use by launch.train" in said and first.poll() is None
    line = said.strip().splitlines()[-1].replace(run_dir, "<process run>")  # no machine path in the JSON
    return {"exit_code": rc, "refused": refused, "wall_s": wall, "said": line[:200]}


def _tear_newest(ckpt_dir: str) -> dict[str, Any]:
    """Truncate the largest data file of the newest committed checkpoint to half its size."""
    steps = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())
    newest = os.path.join(ckpt_dir, str(steps[-1]))
    files = [os.path.join(d, f) for d, _, fs in os.walk(newest) for f in fs]
    victim = max(files, key=os.path.getsize)
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    return {"step": steps[-1], "file": os.path.relpath(victim, ckpt_dir), "bytes": [size, size // 2]}


def main(argv):
    del argv
    if _CHILD_PLAN.value:
        return _child()
    n_iter = _ITERATIONS.value
    if n_iter < 3:
        raise app.UsageError(f"--iterations must be >= 3 (a restart needs two checkpoints), got {n_iter}")
    from bipace_jax.tiny import build_game_tokenizer
    from configs import textcraft_tiny

    base = os.path.abspath(train_launch._WORKDIR.value)
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    tokenizer, cache = os.path.join(base, "tokenizer"), os.path.join(base, "jax_cache")
    cfg = textcraft_tiny.get_config()
    cfg.model.checkpoint = ""
    build_game_tokenizer(cfg, tokenizer, num_tasks=16)
    env = _environ(cache)
    runs: dict[str, dict[str, Any]] = {}

    def prepare(name: str, plan: list[dict] | None) -> tuple[str, str, list[str]]:
        run_dir, plan_dir = os.path.join(base, name), os.path.join(base, name + "_plan")
        os.makedirs(plan_dir)
        if plan is not None:
            with open(os.path.join(plan_dir, "plan.json"), "w") as f:
                json.dump(plan, f)
        return run_dir, plan_dir, _command(run_dir, plan_dir, tokenizer)

    # 0. warm-up: the same run fills the compilation cache, so the timed runs below compare like with like
    if _WARMUP.value:
        run_dir, _, cmd = prepare("warmup", [])
        rc, _ = _run(cmd, env, os.path.join(base, "warmup.log"))
        if rc != 0:
            raise RuntimeError(f"warm-up run failed (exit code {rc}); see {base}/warmup.log")
    # without the warm-up the reference's wall time includes compiling: a difference would mean nothing
    lost = (lambda wall: wall - runs["reference"]["wall_s"]) if _WARMUP.value else (lambda wall: None)

    # 1. reference (an empty plan still counts the game calls)
    run_dir, plan_dir, cmd = prepare("reference", [])
    rc, wall = _run(cmd, env, os.path.join(base, "reference.log"))
    runs["reference"] = dict(_check_run("reference", run_dir, rc, n_iter), wall_s=wall)
    with open(os.path.join(plan_dir, "counters.json")) as f:
        calls = json.load(f)
    runs["reference"]["game_calls"] = calls
    reference = _final_params(run_dir)

    # 2. process faults: late polls of the env pool, a second run started in the same folder, SIGKILL
    # during a save (its lock is left behind), then a torn newest checkpoint
    run_dir, plan_dir, cmd = prepare("process", None)
    with open(os.path.join(plan_dir, "late_poll.json"), "w") as f:
        json.dump({"every": LATE_POLL_EVERY, "sleep_s": LATE_POLL_S, "times": 2}, f)
    log = os.path.join(base, "process.log")
    t0 = time.perf_counter()
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        kill_step = n_iter - 1
        try:
            second = _second_run(proc, run_dir, cmd, env, os.path.join(base, "second.log"))
            hit = _kill_during_save(proc, os.path.join(run_dir, "checkpoints"), kill_step, 1200)
        finally:
            proc.wait(timeout=60)
    killed_after = _iterations(run_dir)
    torn = _tear_newest(os.path.join(run_dir, "checkpoints"))
    rc, wall2 = _run(cmd, env, log)
    wall = time.perf_counter() - t0
    out = _check_run("process", run_dir, rc, n_iter)
    aside = os.path.join(run_dir, "checkpoints", "torn")
    diff = _max_diff(_final_params(run_dir), reference)
    restart_line = next((ln for ln in open(log) if ln.startswith("Run folder:")), "")
    late = (
        [json.loads(ln) for ln in open(os.path.join(plan_dir, "late_polls.jsonl"))]
        if os.path.exists(os.path.join(plan_dir, "late_polls.jsonl"))
        else []
    )
    dropped = _metrics_sum(run_dir, "rollout/", "/env_errors") + _metrics_sum(run_dir, "val", "/env_errors")
    ok = rc == 0 and out["iterations_lost"] == 0
    runs["process"] = dict(
        out,
        faults=[
            {"fault": "SIGKILL of the trainer during a checkpoint save", "step": kill_step, "hit_the_save": hit},
            {"fault": "torn newest checkpoint before the restart", **torn},
            {"fault": "a second run started in the same folder", **second},
            {"fault": f"late polls: the host reads answers {LATE_POLL_S} s late", "fired": len(late)},
        ],
        # late polls survive when no answered game was dropped for them; the second run when it refused
        faults_survived=(2 if ok else 0) + int(ok and second["refused"]) + int(ok and bool(late) and dropped == 0),
        late_polls=late,
        episodes_dropped=dropped,
        iterations_in_metrics_when_killed=killed_after,
        torn_steps_set_aside=sorted(os.listdir(aside)) if os.path.isdir(aside) else [],
        restart=restart_line[restart_line.find("(iterations") :].strip(),  # no machine path in the JSON
        iterations_recomputed=n_iter - int(restart_line.split("iterations ")[1].split(" ")[0])
        if restart_line
        else None,
        final_params_max_abs_diff_vs_reference=diff,
        final_params_equal_reference=diff == 0.0,
        wall_s=wall,
        wall_time_lost_s=lost(wall),
    )

    # 3. game faults on a call-count schedule inside the run
    plan = [
        {"id": f"{call}_{kind}", "call": call, "kind": kind, "at": max(1, int(frac * calls[call]))}
        for call, kind, frac in GAME_FAULTS
    ]
    run_dir, plan_dir, cmd = prepare("games", plan)
    rc, wall = _run(cmd, env, os.path.join(base, "games.log"))
    out = _check_run("games", run_dir, rc, n_iter)
    fired_dir = os.path.join(plan_dir, "fired")
    fired = [json.load(open(os.path.join(fired_dir, n))) for n in sorted(os.listdir(fired_dir))]
    dropped = [{k: r[k] for k in ("id", "kind", "call", "task_id", "seed", "step")} for r in fired]
    diff = _max_diff(_final_params(run_dir), reference)
    runs["games"] = dict(
        out,
        faults=plan,
        faults_fired=len(fired),
        faults_survived=len(fired) if rc == 0 and out["iterations_lost"] == 0 else 0,
        episodes_with_env_error_train=_metrics_sum(run_dir, "rollout/", "/env_errors"),
        reset_faults_train=_metrics_sum(run_dir, "rollout/", "/reset_faults"),
        episodes_with_env_error_val=_metrics_sum(run_dir, "val", "/env_errors"),
        episodes_with_env_error_train_by_kind={
            kind: _metrics_sum(run_dir, f"rollout/env_errors_{kind}", f"_{kind}")
            for kind in ("timeout", "crash", "exception", "lost")
        },
        fired=dropped,
        final_params_max_abs_diff_vs_reference=diff,
        final_params_differ_because="the fired faults' games were dropped or re-seeded (listed in fired)",
        wall_s=wall,
        wall_time_lost_s=lost(wall),
    )

    injected = len(runs["process"]["faults"]) + runs["games"]["faults_fired"]
    survived = runs["process"]["faults_survived"] + runs["games"]["faults_survived"]
    summary = {
        "iterations": n_iter,
        "config": ["configs/textcraft_tiny.py", *TINY, *_overrides()],
        "warmup": _WARMUP.value,
        "faults_injected": injected,
        "faults_survived": survived,
        "iterations_lost": runs["process"]["iterations_lost"] + runs["games"]["iterations_lost"],
        "iterations_recorded_twice": runs["process"]["iterations_recorded_twice"]
        + runs["games"]["iterations_recorded_twice"],
        "runs": runs,
    }
    rows = [
        ("faults injected / survived", f"{injected} / {survived}"),
        ("iterations lost / recorded twice", f"{summary['iterations_lost']} / {summary['iterations_recorded_twice']}"),
        ("kill hit a checkpoint save", str(runs["process"]["faults"][0]["hit_the_save"])),
        ("torn checkpoint set aside", ", ".join(runs["process"]["torn_steps_set_aside"]) or "-"),
        ("iterations recomputed after restart", str(runs["process"]["iterations_recomputed"])),
        ("process run: final params == reference", str(runs["process"]["final_params_equal_reference"])),
        ("games run: faults fired", f"{runs['games']['faults_fired']} of {len(plan)}"),
        (
            "games run: episodes dropped (train/val)",
            f"{runs['games']['episodes_with_env_error_train']:.0f} / "
            f"{runs['games']['episodes_with_env_error_val']:.0f}",
        ),
        (
            "wall s: reference / process / games",
            f"{runs['reference']['wall_s']:.0f} / {runs['process']['wall_s']:.0f} / {runs['games']['wall_s']:.0f}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for r in dropped:
        print(f"  fired {r['id']:<14s} task {r['task_id']} seed {r['seed']} step {r['step']}")
    write_json(_OUT.value, summary, indent=2)
    if survived != injected or summary["iterations_lost"] or summary["iterations_recorded_twice"]:
        sys.exit("chaos: a fault was not survived or an iteration was lost; see the JSON")
    if not runs["process"]["final_params_equal_reference"]:
        sys.exit("chaos: the restarted run's final parameters differ from the reference's")


if __name__ == "__main__":
    app.run(main)
