"""Train an LLM agent with PPO and BiPACE advantages.

    python -m launch.train --workdir=runs/textcraft_tiny                       # CPU default config
    python -m launch.train --config=configs/alfworld_qwen2_5_7b.py --workdir=runs/x \
        --config.model.checkpoint=/ckpt/Qwen2.5-7B-Instruct --config.estimator.epsilon=0.1 --config.seed=2

Every config field can be overridden with ``--config.<field>=<value>``. The run folder receives
``metrics.jsonl``, TensorBoard events (``tb/``), plots (``plots/``), orbax checkpoints
(``checkpoints/``) and, at the end, the policy as a Hugging Face folder (``hf_final/``). Starting again
with the same ``--workdir`` resumes from the latest checkpoint (``--noresume`` refuses instead); while a
run is on, a second one in its folder refuses (its lock, ``.lock.process_<i>``, is taken over by the
resume of a crashed run).
``--workdir=gs://bucket/run`` writes all of it to GCS (needs ``pip install -e '.[gcp]'``).

Multi-host (one process per host): ``--coordinator_address=host0:1234 --num_processes=N
--process_id=i``, or the ``BIPACE_COORDINATOR`` / ``BIPACE_NUM_PROCESSES`` / ``BIPACE_PROCESS_ID``
environment variables, or ``BIPACE_DISTRIBUTED=auto`` on Cloud TPU (see ``launch/README.md``).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags, logging

from launch import cli
from launch._common import ROOT

_DEFAULT_CONFIG = os.path.join(ROOT, "configs", "textcraft_tiny.py")

_CONFIG = cli.define_config_file("config", _DEFAULT_CONFIG, "Run config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run folder, local or gs://bucket/path (metrics, events, plots, checkpoints).", required=True
)
_RESUME = flags.DEFINE_bool(
    "resume", True, "Resume from the latest checkpoint in --workdir (--noresume: fail if one exists)."
)
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config",
    False,
    "Print the resolved config and the run plan (bipace_jax.plan: mesh, batches, rows, validation games), then exit.",
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Check the config, devices, run folder, resume and games; compile nothing, then exit."
)
_ALLOW_CHANGE = flags.DEFINE_bool(
    "allow_config_change",
    False,
    "Resume although the config differs from the run folder's config.json in fields that change the run "
    "(the old config is kept as config.before_<iteration>.json).",
)
_COORD = flags.DEFINE_string("coordinator_address", "", "jax.distributed coordinator host:port (multi-host).")
_NPROC = flags.DEFINE_integer("num_processes", 0, "Number of processes (multi-host).")
_PID = flags.DEFINE_integer("process_id", -1, "This process's index (multi-host).")


def _fmt(x, pct=True):
    if x is None:
        return "-"
    return f"{100 * x:5.1f}%" if pct else f"{x:.3g}"


def format_report(summary: dict) -> str:
    """A short text report: validation before/after RL (overall, by category) at ``summary["val_temperature"]``
    (the header leaves the temperature out when the summary lacks it), time split, BiPACE diagnostics."""
    lines = [
        f"Run folder: {summary['workdir']}  (iterations {summary['start_iteration']} -> "
        f"{summary['start_iteration'] + summary['iterations_run']})"
    ]
    first, last = summary.get("first_val") or {}, summary.get("last_val") or {}
    keys = sorted({k for k in list(first) + list(last) if "success_rate" in k}, key=lambda k: (k.count("/"), k))
    if keys:
        t = summary.get("val_temperature")
        lines.append(f"{'Validation success' + ('' if t is None else f' (T={t:g})'):42s}  before RL   after RL")
        for k in keys:
            lines.append(f"  {k:42s} {_fmt(first.get(k)):>9s}  {_fmt(last.get(k)):>9s}")
    tr = summary.get("last_train") or {}
    if tr:
        total = tr.get("time/iteration_s", 0.0) or 1e-9
        lines.append(f"Last iteration: {total:.1f} s")
        for k in ("rollout_s", "old_logprobs_s", "ref_logprobs_s", "estimator_s", "update_s"):
            v = tr.get(f"time/{k}")
            if v is not None:
                lines.append(f"  {k[:-2]:14s} {v:8.2f} s  {100 * v / total:5.1f}%")
        lines.append(f"  BiPACE-specific share (grouping + advantages): {100 * tr.get('time/bipace_share', 0):.2f}%")
        diag = [
            ("singleton step groups, hash", "estimator/hash_singleton_group_rate"),
            ("singleton step groups, clusters", "estimator/singleton_group_rate"),
            ("PACE rows", "estimator/pace_row_rate"),
            ("leave-one-out rows", "estimator/loo_row_rate"),
            ("singleton rows", "estimator/singleton_row_rate"),
        ]
        lines.append(
            "BiPACE diagnostics (last iteration): "
            + ", ".join(f"{name} {_fmt(tr.get(k))}" for name, k in diag if k in tr)
            + f", epsilon {tr.get('estimator/epsilon')}"
        )
        lines.append(
            f"Train success {_fmt(tr.get('train/success_rate'))}, KL {_fmt(tr.get('loss/kl'), False)}, "
            f"entropy {_fmt(tr.get('loss/entropy'), False)}, clip frac {_fmt(tr.get('loss/clip_frac'))}"
        )
    if summary.get("plots"):
        lines.append("Plots: " + ", ".join(summary["plots"]))
    if summary.get("hf_export"):
        lines.append(f"Policy (HF folder, load_hf_checkpoint): {summary['hf_export']}")
    if summary.get("wall_s") is not None:
        lines.append(f"Wall time: {summary['wall_s'] / 60:.1f} min (start-up, compiles, validation and iterations)")
    return "\n".join(lines)


def run_plan(spec):
    """The run's ``plan.RunPlan`` on this process's devices, with the validation panels the run will
    play (``validation.select``: the game is built once here, in this process).

    Raises:
      ConfigError: the mesh or a row count does not split over the devices, or the game refuses its
        options (the same checks the trainer makes before the model loads).
    """
    from bipace_jax import plan, validation

    layout = plan.HostLayout.current(spec)
    return plan.plan(spec, layout, validation.select(spec, spec.env.name).games)


def devices_line() -> str:
    """``"devices: 8 x TPU v5 lite (tpu), 1 process"``: the devices JAX sees, their kind and backend."""
    import jax

    kinds = sorted({d.device_kind for d in jax.devices()})
    procs = jax.process_count()
    return (
        f"devices: {jax.device_count()} x {', '.join(kinds)} ({jax.default_backend()}), "
        f"{procs} process{'es' if procs > 1 else ''}"
    )


def role_line(spec, role: str, first: int | None = None) -> str:
    """What this process does in a run with ``async_rl.sampler_processes`` (``async_processes.LEARNER``
    or ``SAMPLER``): one line, so the sampler's terminal is not silent while the learner logs.
    ``first``: the iteration the learner starts at (0, or its checkpoint's), known to the sampler."""
    import jax

    a, me, n = spec.async_rl, jax.process_index(), jax.process_count()
    head = f"{role}: process {me} of {n} (config.async_rl.sampler_processes={a.sampler_processes})"
    if role == "learner":
        return (
            f"{head}: trains and writes the log lines, metrics and checkpoints; process {n - 1} plays the "
            f"iterations, at most async_rl.max_staleness={a.max_staleness} ahead (0: on-policy)"
        )
    rest = f"iterations {first + 1}-{spec.num_iterations}" if first < spec.num_iterations else "nothing (done)"
    return f"{head}: plays {rest} of {spec.num_iterations} for the learner (process 0), which logs them"


def check_resume(spec, workdir: str, allow_change: bool) -> str | None:
    """``resume.check_resume`` for ``spec`` (a ``RunSpec``): refuse (one line, ``SystemExit``) a resume
    whose config differs in a field that changes the run; with ``allow_change`` keep the old config
    beside the new one. Returns the finished-run line when the folder's metrics already reach
    ``num_iterations``, else None."""
    from bipace_jax import resume

    try:
        return resume.check_resume(workdir, spec.config.to_dict(), spec.num_iterations, allow_change)
    except resume.ConfigChangeError as e:
        cli.fail(str(e))


def report_from_disk(workdir: str) -> dict:
    """``format_report``'s summary rebuilt from a run folder's ``metrics.jsonl`` (``resume.report_from_disk``)."""
    from bipace_jax import resume

    return resume.report_from_disk(workdir)


def train(config, workdir: str, resume: bool = True, env_factory=None) -> None:
    """The job behind ``main``: check the config, start JAX (multi-host from the flags), train, report.

    ``env_factory``: passed to ``Trainer`` (a wrapped game, e.g. ``launch.chaos``'s fault injector).
    Exits with a one-line error on a bad config, a run folder that cannot be written (checked before
    the model loads), an existing run with ``resume=False`` or a non-finite update. A Ctrl-C during
    training closes the trainer (pending checkpoint writes finish) and raises ``KeyboardInterrupt``
    with ``cli.interrupted_line``'s message (``cli.run`` prints it and exits with 130).
    """
    t_start = time.perf_counter()
    from bipace_jax import build
    from bipace_jax import config as config_lib

    if not flags.FLAGS["verbosity"].present:  # orbax/absl INFO lines drown the progress bars
        logging.set_verbosity(logging.WARNING)
    try:  # every field is checked before JAX starts or anything compiles
        spec = build.build_spec(config)
    except config_lib.ConfigError as e:
        sys.exit(f"error: {e}")
    from bipace_jax import distributed

    distributed.initialize(_COORD.value, _NPROC.value, _PID.value)
    with distributed.failures_shared():  # one host's error ends every host, naming it (host 0's log too)
        _train_started(spec, workdir, resume, env_factory, t_start)


def _train_started(spec, workdir: str, resume: bool, env_factory, t_start: float) -> None:
    """``train`` once JAX has started: check the devices and the run folder, take its lock, train."""
    import jax

    from bipace_jax import async_processes, distributed, runfolder
    from bipace_jax import config as config_lib
    from bipace_jax import plan as plan_lib

    try:  # asynchronous RL by process: each role's collectives, plan and mesh span its own processes
        distributed.check_same_config(spec.config.to_json_best_effort())
        async_processes.enter_role(spec)
    except config_lib.ConfigError as e:
        sys.exit(f"error: {e}")
    if _PRINT_CONFIG.value:
        print(spec.config.to_json_best_effort(indent=2), flush=True)
        try:
            print(json.dumps(run_plan(spec).summary(), indent=2), flush=True)
        except config_lib.ConfigError as e:
            sys.exit(f"error: {e} (the run plan on {jax.device_count()} devices)")
        return
    try:
        sizes = run_plan(spec)
        plan_lib.check_workdir(spec, workdir, jax.process_count())
        runfolder.path(workdir)
        if message := runfolder.missing_extra(workdir, "--workdir"):  # before anything reads the folder
            raise runfolder.RunFolderError(message)
        lock = runfolder.RunLock(workdir, f"process_{jax.process_index()}", "launch.train")
        if _DRY_RUN.value:  # checked, not taken; nothing is created
            runfolder.check_writable(workdir)
            if (who := lock.holder()) is not None:
                raise runfolder.RunFolderBusy(lock.busy_message(who))
        else:
            runfolder.prepare(workdir)
            lock.acquire()  # one run per folder: a second one refuses here, before it writes anything
    except (config_lib.ConfigError, runfolder.RunFolderError) as e:
        sys.exit(f"error: {e}")
    try:
        _train_locked(spec, sizes, workdir, resume, env_factory, t_start)
    finally:
        lock.release()


def _train_locked(spec, sizes, workdir: str, resume: bool, env_factory, t_start: float) -> None:
    """``train`` once the run folder is checked and its lock held (or checked, for ``--dry_run``);
    ``sizes``: the run's ``plan.RunPlan``."""
    import jax

    from bipace_jax import async_processes, checkpointing, runfolder
    from bipace_jax import config as config_lib
    from bipace_jax import trainer as trainer_lib

    finished = check_resume(spec, workdir, _ALLOW_CHANGE.value) if resume else None
    if finished is not None:
        if jax.process_index() == 0:
            report = dict(report_from_disk(workdir), val_temperature=spec.val.temperature)
            print(finished + "\n" + format_report(report), flush=True)
        return
    if jax.process_index() == 0:  # which chips the run uses, before anything long starts
        print(devices_line(), flush=True)
    if _DRY_RUN.value:
        print(
            "dry run: config, devices, games, run folder and resume checked, nothing compiled; "
            f"{json.dumps(sizes.summary())}"
        )
        return
    config_lib.enable_compile_cache(spec)  # before the first compile
    logging.info("devices: %s (process %d of %d)", jax.devices(), jax.process_index(), jax.process_count())
    role = async_processes.enter_role(spec)
    if role == async_processes.SAMPLER:  # plays; the learner reports
        try:
            sampler = async_processes.SamplerProcess(spec, workdir, env_factory=env_factory)
            print(role_line(spec, role, sampler.start["iteration"]), flush=True)
            played = sampler.run()["iterations"]
        except (config_lib.ConfigError, runfolder.RunFolderError) as e:
            sys.exit(f"error: {e}")
        print(f"sampler: {played} iterations played and sent; the learner finished", flush=True)
        return
    if role == async_processes.LEARNER:
        print(role_line(spec, role), flush=True)
    try:
        tr = trainer_lib.Trainer(spec, workdir, resume=resume, env_factory=env_factory)
    except (config_lib.ConfigError, runfolder.RunFolderError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    except checkpointing.CheckpointMismatchError as e:  # steps stay in place; name the fields if config.json can
        from bipace_jax import resume as resume_lib

        cli.fail(f"{e} ({resume_lib.fields_behind(workdir, spec.config.to_dict())})")
    stopped = None
    try:
        summary = tr.run()
    except trainer_lib.NonFiniteError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        stopped = cli.interrupted_line(tr.iteration, spec.num_iterations, tr.checkpointer.latest_step())
    finally:
        tr.close()
    if stopped is not None:  # raised after close (checkpoint writes finished), caught by cli.run: one line, exit 130
        raise KeyboardInterrupt(stopped)
    if jax.process_index() == 0:
        report = dict(summary, wall_s=time.perf_counter() - t_start, val_temperature=spec.val.temperature)
        print(format_report(report), flush=True)


def main(argv):
    del argv
    train(_CONFIG.value, _WORKDIR.value, _RESUME.value)


if __name__ == "__main__":
    cli.run(main, hard_exit=True)
