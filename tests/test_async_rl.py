"""Asynchronous RL (``bipace_jax.async_rl``, ``config.async_rl``): the config's errors, the sampler
thread's staleness bound on a hand-driven learner, the resume rule of the new fields, and (in a
subprocess on 8 CPU devices) whole runs: 4 sampler + 4 learner devices at k = 0 against the colocated
run, k = 1's row versions, and a SIGKILL during a weight push resumed with no iteration lost or repeated.
By process (``bipace_jax.async_processes``, ``async_rl.sampler_processes``): the roles' config errors,
the learner group's collectives, the rows' bytes, and ``launch.train`` runs of 2 ``jax.distributed``
processes of 1 CPU device each (one samples, one learns): k = 0 against the same colocated run, and a
k = 1 run whose learner is SIGKILLed during a weight push, resumed."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np
import pytest

import configs.textcraft_tiny
from bipace_jax import async_processes, async_rl, build, distributed, loglines, resume
from bipace_jax.checkpointing import Checkpointer
from bipace_jax.config import AsyncConfig, ConfigError, MeshConfig, Switch
from bipace_jax.models import load_tokenizer
from bipace_jax.rollout import RolloutConfig, collect
from tests.devices import REPO, communicate_all, run_on_cpu_devices
from tests.test_rollout_loop import GAMES, ScriptedEngine, TextPool
from tests.tiny_runs import TINY_ACTOR_FLAGS

# ------------------------------------------------------------------------------------------------
# Config.


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_staleness", -1, "config.async_rl.max_staleness must be"),
        ("switch", "token", "config.async_rl.switch must be"),
        ("sampler_devices", -2, "config.async_rl.sampler_devices must be"),
        ("sampler_processes", -1, "config.async_rl.sampler_processes must be"),
    ],
)
def test_bad_async_fields_fail_naming_the_field(field, value, message):
    c = configs.textcraft_tiny.get_config()
    setattr(c.async_rl, field, value)
    with pytest.raises(ConfigError, match=message):
        build.build_spec(c)


def test_staleness_needs_a_sampler_group_and_turn_switch_needs_lockstep():
    c = configs.textcraft_tiny.get_config()
    c.async_rl.max_staleness = 1
    with pytest.raises(ConfigError, match=r"config.async_rl.sampler_devices must be > 0 with async_rl.max_staleness=1"):
        build.build_spec(c)
    c.async_rl.sampler_devices, c.rollout.scheduler = 2, "continuous"
    with pytest.raises(ConfigError, match=r"config.async_rl.switch must be 'game' with rollout.scheduler='continuous'"):
        build.build_spec(c)
    c.async_rl.switch = "game"
    assert build.build_spec(c).async_rl == AsyncConfig(1, Switch.GAME, 2)


def test_shipped_default_is_colocated_on_policy_and_a_config_without_the_section_reads_as_it():
    c = configs.textcraft_tiny.get_config()
    spec = build.build_spec(c)
    assert spec.async_rl == AsyncConfig(0, Switch.TURN, 0) and not spec.async_rl.disaggregated
    del c["async_rl"]
    assert AsyncConfig.of(c) == AsyncConfig()


def test_roles_must_leave_the_learner_a_device():
    devices = jax.devices()  # one CPU device in the test process
    with pytest.raises(ConfigError, match=r"config.async_rl.sampler_devices must leave the learner at least one"):
        async_rl.role_meshes(MeshConfig(), AsyncConfig(sampler_devices=len(devices)), devices)


def test_resume_accepts_a_run_stored_before_async_rl_at_its_no_change_values():
    new = configs.textcraft_tiny.get_config().to_dict()
    old = {k: v for k, v in new.items() if k != "async_rl"}
    assert resume.changed_fields(old, new) == []
    changed = dict(new, async_rl=dict(new["async_rl"], max_staleness=1, sampler_devices=4))
    fields = [f for f, _, _ in resume.changed_fields(old, changed)]
    assert fields == ["async_rl.max_staleness", "async_rl.sampler_devices"]
    by_process = dict(new, async_rl=dict(new["async_rl"], sampler_processes=1))
    assert [f for f, _, _ in resume.changed_fields(old, by_process)] == ["async_rl.sampler_processes"]


# ------------------------------------------------------------------------------------------------
# Roles by process: config and the learner group (one process here; whole runs at the end).


def test_process_roles_refuse_device_roles_and_a_run_without_two_processes():
    c = configs.textcraft_tiny.get_config()
    c.async_rl.sampler_processes, c.async_rl.sampler_devices = 1, 2
    with pytest.raises(
        ConfigError, match=r"config.async_rl.sampler_processes must be 0 with async_rl.sampler_devices=2"
    ):
        build.build_spec(c)
    c.async_rl.sampler_devices, c.async_rl.max_staleness = 0, 1  # k > 0 may run on a sampler process
    roles = build.build_spec(c).async_rl
    assert roles.disaggregated and roles.by_process
    roles.check_processes(2)
    with pytest.raises(ConfigError, match=r"sampler_processes must be 0 in a run of 1 process .*--num_processes=2"):
        roles.check_processes(1)
    with pytest.raises(
        ConfigError, match=r"sampler_processes must be 1 in a run of 2 processes \(.* 1 sampler processes in a run of 3"
    ):
        roles.check_processes(3)
    with pytest.raises(ConfigError, match=r"sampler_processes must be 1 in a run of 2 processes .*, got 2"):
        AsyncConfig(sampler_processes=2).check_processes(3)
    # 2 sampler processes of 2: not "must be < 2 processes, start the run with --num_processes" (3 is refused too)
    with pytest.raises(
        ConfigError, match=r"must be 1 in a run of 2 processes .*2 sampler processes in a run of 2 .*got 2"
    ):
        AsyncConfig(sampler_processes=2).check_processes(2)
    from bipace_jax.trainer import Trainer

    with pytest.raises(ConfigError, match=r"sampler_processes must be 0 in a run of 1 process"):
        Trainer(c, tempfile.mkdtemp())  # before the run folder, the model or a compile
    assert async_processes.enter_role(build.build_spec(configs.textcraft_tiny.get_config())) is None


def test_a_learner_group_of_one_process_gathers_nothing_and_others_are_refused():
    try:
        distributed.set_group([0])
        assert distributed.group() == (0,) and distributed.process_count() == 1 and distributed.process_index() == 0
        assert distributed.group_devices() == jax.devices()
        np.testing.assert_array_equal(distributed.allgather(np.arange(3, dtype=np.int64)), [[0, 1, 2]])
        with pytest.raises(ValueError, match=r"set_group: process 0 is not in \(1,\)"):
            distributed.set_group([1])
    finally:
        distributed.set_group(None)
    assert distributed.group() == tuple(range(jax.process_count()))


def test_rows_travel_as_bytes_with_every_field_and_device_arrays_back_on_device():
    tok = load_tokenizer("bipace_jax/data/textcraft_tiny")
    cfg = dataclasses.replace(
        RolloutConfig(game="textcraft", group_size=2, max_steps=2, max_prompt_length=1024), scheduler="lockstep"
    )
    res = collect(None, ScriptedEngine(tok), TextPool(4, 2, lambda i, t: f"room {i}"), GAMES, cfg, jax.random.key(0))
    res = dataclasses.replace(res, steps=jax.tree.map(jax.numpy.asarray, res.steps))  # as the engine gives them
    back = async_processes.unpack_rows(async_processes.pack_rows(res))
    assert type(back) is type(res) and len(back.rows) == len(res.rows) == 8
    for a, b in zip(res.rows + res.episodes, back.rows + back.episodes):  # host fields (fingerprints NumPy)
        assert pickle.dumps(a) == pickle.dumps(b)
    assert back.stats.values() == res.stats.values() and back.timing == res.timing
    arrays = [(k, v, getattr(back.tokens, k)) for k, v in vars(res.tokens).items() if isinstance(v, np.ndarray)]
    arrays += [(k, v, getattr(back.steps, k)) for k, v in vars(res.steps).items() if isinstance(v, jax.Array)]
    assert sum(isinstance(a, jax.Array) for _, a, _ in arrays) >= 5
    for name, a, b in arrays + [("sample_logprobs", res.sample_logprobs, back.sample_logprobs)]:
        assert type(b) is type(a) and b.dtype == a.dtype, name  # NumPy stays NumPy, device arrays come back
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


# ------------------------------------------------------------------------------------------------
# The sampler thread's bound, driven by a hand-made learner.


def _drive(k: int, iterations: int, sample_s: float, learn_s: float):
    """A learner taking iterations in order (sleeping ``learn_s`` per update, then publishing the next
    version) against a SamplerThread whose play sleeps ``sample_s``; returns (thread, the version the
    learner held when it took each iteration, the most iterations ever queued)."""
    source = async_rl.PolicySource(graphdef=None, rest=None)
    source.publish = lambda params, version: _publish(source, version)  # no model: versions only
    _publish(source, 0)
    most = [0]

    def play(j, key):
        time.sleep(sample_s)
        return (j, source.version, key)

    th = async_rl.SamplerThread(play, source, 0, iterations, jax.random.PRNGKey(0), k)
    taken = []
    for i in range(iterations):
        res = th.take(i)
        most[0] = max(most[0], len(th.queued()) + 1)
        taken.append((res[0], res[1], i))
        time.sleep(learn_s)
        source.publish(None, i + 1)
    th.close()
    return th, taken, most[0]


def _publish(source, version):
    with source._cond:
        source._actor, source._version = None, version
        source._cond.notify_all()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_sampler_is_never_more_than_k_iterations_ahead(k):
    # a fast sampler against a slow learner: the bound is what holds it back
    th, taken, most = _drive(k, iterations=6, sample_s=0.001, learn_s=0.03)
    assert [j for j, _ in th.started] == list(range(6))
    for j, version in th.started:
        assert j - k <= version <= j, (j, version)  # started with a policy at most k updates old
    lags = [i - v for _, v, i in taken]
    assert all(0 <= lag <= k for lag in lags)
    assert max(lags) == k  # the fast sampler uses all the staleness it is allowed
    assert most <= k + 1  # the iteration being learned and at most k played ahead
    if k == 0:
        assert all(v == i for _, v, i in taken)  # on-policy: the version of every earlier update


def test_sampler_keys_follow_the_trainer_rng_chain():
    # the thread's iteration j key is the trainer's: rng split j + 1 times, then iteration_keys
    th, _, _ = _drive(1, iterations=3, sample_s=0.0, learn_s=0.0)
    rng = jax.random.PRNGKey(0)
    want = []
    for _ in range(3):
        rng, key = jax.random.split(rng)
        want.append(async_rl.iteration_keys(key)[0])
    source = async_rl.PolicySource(None, None)
    _publish(source, 10)
    got = {}
    th = async_rl.SamplerThread(lambda j, key: got.setdefault(j, key), source, 0, 3, jax.random.PRNGKey(0), 0)
    for j in range(3):
        th.take(j)
    th.close()
    assert all(bool((got[j] == want[j]).all()) for j in range(3))


def test_a_sampler_failure_reaches_the_learner():
    source = async_rl.PolicySource(None, None)
    _publish(source, 0)

    def play(j, key):
        raise ValueError(f"env crashed in iteration {j}")

    th = async_rl.SamplerThread(play, source, 0, 2, jax.random.PRNGKey(0), 0)
    with pytest.raises(ValueError, match="env crashed in iteration 0"):
        th.take(0)
    th.close()
    assert not any(t.name == "bipace-sampler" and t.is_alive() for t in threading.enumerate())


def test_a_closed_policy_source_ends_take_instead_of_hanging():
    # by process the weight receiver closes the source when a pull fails; the sampler process's main
    # thread waits in take(j) and must wake to raise the pull's error (async_processes.SamplerProcess.run)
    source = async_rl.PolicySource(None, None)
    th = async_rl.SamplerThread(lambda j, key: j, source, 0, 3, jax.random.PRNGKey(0), 0)
    got = {}

    def take():
        try:
            got["result"] = th.take(0)
        except RuntimeError as e:
            got["error"] = str(e)

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    time.sleep(0.2)  # the sampler thread waits for version 0, the main thread in take(0)
    source.close()
    waiter.join(10.0)
    assert not waiter.is_alive(), "take(0) still waiting after the policy source closed"
    assert got == {"error": "async_rl: the sampler stopped before iteration 0"}
    th.close()


def test_a_failed_weight_pull_ends_the_sampler_process_with_its_error(monkeypatch):
    # SamplerProcess.run with its weight receiver failing before version 0 arrives (no model, no store)
    class FailingReceiver:
        def __init__(self, address, like, source, first, last):
            self.pull_s, self.error = {}, ConnectionError("pull of version 0 failed")
            source.close()  # as _WeightReceiver does on a failed pull

        def close(self):
            pass

    monkeypatch.setattr(async_processes, "_WeightReceiver", FailingReceiver)
    monkeypatch.setattr(async_processes, "_client", lambda: None)
    c = configs.textcraft_tiny.get_config()
    c.num_iterations = 2
    sp = object.__new__(async_processes.SamplerProcess)
    sp.spec, sp.like, sp.source = build.build_spec(c), None, async_rl.PolicySource(None, None)
    sp.start = dict(iteration=0, task_cursor=0, rng=[0, 0], address="")
    sp.pool = type("Pool", (), {"close": lambda self: None})()
    got = {}

    def run():
        try:
            sp.run()
        except ConnectionError as e:
            got["error"] = str(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(10.0)
    assert not runner.is_alive(), "the sampler process still waits after its weight pull failed"
    assert got == {"error": "pull of version 0 failed"}


# ------------------------------------------------------------------------------------------------
# Whole runs on 8 CPU devices (subprocesses: JAX reads the device count once).

_RUNS = r"""
import json, sys, tempfile
import numpy as np
from tests.tiny_runs import one_iteration_config
from bipace_jax.trainer import Trainer
from bipace_jax import loglines

def cfg(sampler_devices, k):
    c = one_iteration_config(group_size=2, max_steps=3, batch_buckets=(4, 8))
    c.num_iterations, c.checkpoint.export_hf = 3, False
    c.optim.learning_rate = 1e-3  # the policy moves: versions differ in what they sample
    c.async_rl.sampler_devices, c.async_rl.max_staleness = sampler_devices, k
    return c

out = {}
for name, sd, k in (("colocated", 0, 0), ("roles_k0", 4, 0), ("roles_k1", 4, 1)):
    tr = Trainer(cfg(sd, k), tempfile.mkdtemp(), resume=False)
    seen = []
    update = tr.learner.update
    tr.learner.update = lambda batch, *a, **kw: update(seen.append(batch.policy_version.tolist()) or batch, *a, **kw)
    recs = [tr.train_iteration() for _ in range(3)]
    tr.close()
    out[name] = dict(
        lines=[loglines.iteration_line(i + 1, 3, r).split(" | ")[0] for i, r in enumerate(recs)],
        records=[{k: v for k, v in r.items() if not k.startswith("time/") and not k.startswith("async/")} for r in recs],
        lag=[(r.get("async/version_lag_mean"), r.get("async/version_lag_max")) for r in recs],
        versions=seen,
        started=tr.sampler.started if tr.sampler else None,
        devices=[tr.mesh.devices.size, tr.sampler_mesh.devices.size if tr.sampler_mesh is not None else 0],
    )
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs():
    proc = run_on_cpu_devices(_RUNS, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT ") :])


def _same_line(a: str, b: str) -> bool:
    """Equal words, numbers within the records' tolerance: a KL of ~1e-15 (the tiny run's first steps)
    prints float32 summation noise that the mesh size (8 vs 4 devices) and packing's line order change."""

    def num(w):
        try:
            return float(w)
        except ValueError:
            return None

    wa, wb = a.split(), b.split()
    return len(wa) == len(wb) and all(
        x == y or (num(x) is not None and num(y) is not None and num(y) == pytest.approx(num(x), rel=1e-4, abs=1e-6))
        for x, y in zip(wa, wb)
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_k0_on_4_sampler_and_4_learner_devices_gives_the_colocated_iteration_lines(runs):
    a, b = runs["colocated"], runs["roles_k0"]
    assert a["devices"] == [8, 0] and b["devices"] == [4, 4]
    for la, lb in zip(a["lines"], b["lines"], strict=True):  # the printed lines, timing aside
        assert _same_line(la, lb), (la, lb)
    for ra, rb in zip(a["records"], b["records"]):  # every other metric within float32 noise of the mesh size
        assert ra.keys() == rb.keys()
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), key
    assert b["lag"] == [[0.0, 0.0]] * 3
    assert [v for _, v in b["started"]] == [0, 1, 2]  # on-policy: iteration j sampled by version j
    assert all(set(v) == {i} for i, v in enumerate(b["versions"]))


@pytest.mark.e2e
@pytest.mark.slow
def test_k1_rows_carry_their_version_and_lag_0_or_1(runs):
    r = runs["roles_k1"]
    assert r["started"][0] == [0, 0]
    for i, versions in enumerate(r["versions"]):
        lags = {i - v for v in versions}
        assert lags <= {0, 1}, (i, versions)
    for (mean, most), versions, i in zip(r["lag"], r["versions"], range(3)):
        lags = [i - v for v in versions]
        assert most == max(lags) and mean == pytest.approx(sum(lags) / len(lags))
    assert runs["roles_k1"]["lag"][0] == [0.0, 0.0]  # nothing to be stale against before the first update


_KILLED = r"""
import os, signal, sys
from tests.tiny_runs import one_iteration_config
from bipace_jax import async_rl
from bipace_jax.trainer import Trainer

workdir, kill_at = sys.argv[1], int(sys.argv[2])
c = one_iteration_config(group_size=2, max_steps=3, batch_buckets=(4, 8))
c.num_iterations, c.checkpoint.export_hf = 3, False
c.async_rl.sampler_devices, c.async_rl.max_staleness = 4, 1
push, pushes = async_rl.push, []

def killing_push(*a, **kw):
    pushes.append(1)
    if len(pushes) == kill_at:  # mid-push: the sampler thread holds the next iteration by now
        os.kill(os.getpid(), signal.SIGKILL)
    return push(*a, **kw)

async_rl.push = killing_push
tr = Trainer(c, workdir)
summary = tr.run()
tr.close()
print("RESUMED_FROM", summary["start_iteration"], "RAN", summary["iterations_run"])
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkill_during_a_weight_push_resumes_with_no_iteration_lost_or_repeated():
    import subprocess
    import sys

    from tests.devices import REPO

    workdir = tempfile.mkdtemp()
    env = dict(
        os.environ,
        JAX_NUM_CPU_DEVICES="8",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO,
    )

    def run(kill_at):
        return subprocess.run(
            [sys.executable, "-c", _KILLED, workdir, str(kill_at)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )

    # pushes: 1 = the initial version 0, 2 = version 1 after iteration 0, 3 = version 2 after iteration 1
    first = run(kill_at=3)
    assert first.returncode == -9, first.stderr[-3000:]
    lines = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [r["iteration"] for r in lines if "train/task_cursor" in r] == [0]  # iteration 1 died in its push
    second = run(kill_at=0)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "RESUMED_FROM 1 RAN 2" in second.stdout
    recs = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
    train = [r for r in recs if "train/task_cursor" in r]
    assert [r["iteration"] for r in train] == [0, 1, 2]  # each once: none lost, none repeated
    assert [r["train/task_cursor"] for r in train] == [0, 2, 4]  # the task groups follow on
    assert all(r["async/version_lag_max"] <= 1 for r in train)


# ------------------------------------------------------------------------------------------------
# The rollout's switch point (rollout.collect's policy hook) on the host-only engine and pool doubles.


@pytest.mark.parametrize("scheduler", ["lockstep", "continuous"])
def test_each_row_records_the_version_that_sampled_it(scheduler):
    tok = load_tokenizer("bipace_jax/data/textcraft_tiny")
    asked = []

    def policy():  # a learner that publishes a new version before every turn boundary
        asked.append(len(asked))
        return object(), 10 + asked[-1]

    cfg = RolloutConfig(game="textcraft", group_size=2, max_steps=3, max_prompt_length=1024)
    cfg = dataclasses.replace(cfg, scheduler=scheduler)
    res = collect(None, ScriptedEngine(tok), TextPool(4, 3, lambda i, t: f"room {i} turn {t}"), GAMES, cfg,
                  jax.random.key(0), policy=policy)  # fmt: skip
    got = [(r.traj, r.step, r.policy_version) for r in res.rows]
    if scheduler == "lockstep":  # turn t of every game is the t-th engine call: version 10 + t (switch = turn)
        assert got == [(i, t, 10 + t) for i in range(4) for t in range(3)] and len(asked) == 3
    else:  # the slots bind one set of weights: asked once, every row that version
        assert got == [(i, t, 10) for i in range(4) for t in range(3)] and len(asked) == 1
    assert res.tokens.policy_version.tolist() == [v for _, _, v in got]
    assert res.tokens.policy_version.dtype == np.int32


def test_without_a_policy_every_row_is_version_0():
    tok = load_tokenizer("bipace_jax/data/textcraft_tiny")
    cfg = dataclasses.replace(
        RolloutConfig(game="textcraft", group_size=2, max_steps=2, max_prompt_length=1024), scheduler="lockstep"
    )
    res = collect(None, ScriptedEngine(tok), TextPool(4, 2, lambda i, t: f"room {i}"), GAMES, cfg, jax.random.key(0))
    assert res.tokens.policy_version.tolist() == [0] * 8


# ------------------------------------------------------------------------------------------------
# Roles by process: `launch.train` on 2 jax.distributed processes of 1 CPU device, 0 learns, 1 samples.

# launch.train, with the learner SIGKILLed when it offers version KILL_AT (-1: never), the sampler's
# rollouts raising when FAIL_PLAY is set, and the learner's last checkpoint raising when FAIL_END is set.
_LAUNCH = r"""
import os, signal, sys
from bipace_jax import async_processes
from launch import cli, train

kill_at, publish = int(os.environ["KILL_AT"]), async_processes.WeightSender.publish

def killing_publish(self, params, version):
    if version == kill_at:  # iteration version - 1 is trained, not yet recorded or checkpointed
        os.kill(os.getpid(), signal.SIGKILL)
    return publish(self, params, version)

def failing_play(self, j, key):
    raise RuntimeError(f"injected: the game crashed in iteration {j}")

async_processes.WeightSender.publish = killing_publish
if os.environ.get("FAIL_PLAY"):
    async_processes.SamplerProcess._play = failing_play
if os.environ.get("FAIL_END"):  # the learner fails in its last checkpoint (the sampler has sent every row)
    from bipace_jax import trainer

    save = trainer.Trainer.save_checkpoint

    def failing_save(self):
        if self.iteration == self.spec.num_iterations:
            raise RuntimeError("injected: the learner failed after its last iteration")
        return save(self)

    trainer.Trainer.save_checkpoint = failing_save
sys.argv = ["launch.train", *sys.argv[1:]]
cli.run(train.main, hard_exit=True)
"""

# The colocated fixture's config (`_RUNS`'s cfg) as flags.
_FLAGS = (
    f"--config={REPO}/configs/textcraft_tiny.py",
    *TINY_ACTOR_FLAGS,
    "--config.model.checkpoint=",
    "--config.rollout.num_groups=2",
    "--config.rollout.group_size=2",
    "--config.env.max_steps=3",
    "--config.env.num_workers=1",
    "--config.sampler.max_new_tokens=16",
    "--config.sampler.batch_buckets=(4, 8)",
    "--config.ppo.micro_batch_rows=8",
    "--config.ppo.mini_batch_rows=0",
    "--config.ppo.old_logprobs=recompute",
    "--config.val.every=0",
    "--config.val.at_start=False",
    "--config.log.progress=False",
    "--config.log.plots=False",
    "--config.num_iterations=3",
    "--config.checkpoint.export_hf=False",
    "--config.optim.learning_rate=1e-3",
    "--config.checkpoint.shared_workdir=True",  # both processes on this machine see the folder
    "--config.async_rl.sampler_processes=1",
)


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """One compilation cache for the module's 2-process runs (they compile the same programs)."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _two_processes(
    workdir: str, cache: str, k: int, kill_at: int = -1, sampler_flags: tuple[str, ...] = (), **env_vars
) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of the learner (process 0) and the sampler (process 1);
    ``sampler_flags`` are added to process 1's command line only."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", PYTHONPATH=REPO, JAX_PLATFORMS="cpu", KILL_AT=str(kill_at))
    env.update(JAX_COMPILATION_CACHE_DIR=cache)
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update(env_vars)
    env.pop("XLA_FLAGS", None)
    flags = [*_FLAGS, f"--workdir={workdir}", f"--config.async_rl.max_staleness={k}"]
    flags += [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, *flags, f"--process_id={pid}", *(sampler_flags if pid else ())],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = communicate_all(procs, timeout=600)
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def _train_rows(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.mark.e2e
@pytest.mark.slow
def test_k0_on_a_sampler_and_a_learner_process_gives_the_colocated_iteration_lines(runs, jax_cache, tmp_path):
    w = str(tmp_path / "run")
    (rc0, out0, err0), (rc1, out1, err1) = _two_processes(w, jax_cache, k=0)
    assert rc0 == 0 and rc1 == 0, (err0[-3000:], err1[-3000:])
    rows = _train_rows(w)  # written by process 0 alone
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    lines = [loglines.iteration_line(i + 1, 3, r).split(" | ")[0] for i, r in enumerate(rows)]
    for la, lb in zip(runs["colocated"]["lines"], lines, strict=True):  # the 8-device colocated run's
        assert _same_line(la, lb), (la, lb)
    for ra, rb in zip(runs["colocated"]["records"], rows):  # every other metric within the same tolerance
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), key
    assert all(r["train/hosts"] == 1 and r["train/episodes"] == 4 for r in rows)  # the learner group: 1 process
    assert all(r["async/version_lag_max"] == 0 for r in rows)  # on-policy
    for key in ("async/weight_push_s", "async/weight_pull_s", "async/rows_send_s", "async/rows_receive_s"):
        assert all(0 < r[key] < 60 for r in rows), key
    assert all(r["async/rows_bytes"] > 10_000 for r in rows)
    assert Checkpointer(w).latest_step() == 3
    assert "Train success" in out0 and "learner: process 0 of 2" in out0  # the learner reports, the sampler plays
    assert out1.splitlines() == [
        "sampler: process 1 of 2 (config.async_rl.sampler_processes=1): plays iterations 1-3 of 3 for the learner "
        "(process 0), which logs them",
        "sampler: 3 iterations played and sent; the learner finished",
    ]


@pytest.mark.e2e
@pytest.mark.slow
def test_k1_learner_process_killed_during_a_weight_push_resumes_with_no_iteration_lost_or_repeated(jax_cache, tmp_path):
    w = str(tmp_path / "run")
    # offers: version 0 at the start, 1 after iteration 0 (checkpoint 1), 2 after iteration 1: killed there
    (rc0, _, err0), (rc1, _, err1) = _two_processes(w, jax_cache, k=1, kill_at=2)
    assert rc0 == -signal.SIGKILL and rc1 != 0, (err0[-3000:], err1[-3000:])  # the sampler ends with it
    assert [r["iteration"] for r in _train_rows(w)] == [0]
    (rc0, out0, err0), (rc1, out1, err1) = _two_processes(w, jax_cache, k=1)
    assert rc0 == 0 and rc1 == 0, (err0[-3000:], err1[-3000:])
    assert "(iterations 1 -> 3)" in out0  # restarted from checkpoint 1; the sampler from the learner's start
    assert "plays iterations 2-3 of 3" in out1 and "2 iterations played" in out1
    rows = _train_rows(w)
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # each once: none lost, none repeated
    assert [r["train/task_cursor"] for r in rows] == [0, 2, 4]
    assert rows[0]["async/version_lag_max"] == 0 and all(r["async/version_lag_max"] <= 1 for r in rows)
    assert rows[1]["async/version_lag_max"] == 0  # the restarted sampler begins at the checkpoint's version
    assert Checkpointer(w).latest_step() == 3


@pytest.mark.e2e
@pytest.mark.slow
def test_a_failing_sampler_process_stops_the_learner_naming_it(jax_cache, tmp_path):
    w = str(tmp_path / "run")
    (rc0, _, err0), (rc1, _, err1) = _two_processes(w, jax_cache, k=0, FAIL_PLAY="1")
    assert rc1 == 1 and "error: RuntimeError: injected: the game crashed in iteration 0" in err1, err1[-3000:]
    line = "error: process 1 of 2 failed: RuntimeError: injected: the game crashed in iteration 0; process 0 stops too"
    assert rc0 == 1 and line in err0, err0[-3000:]  # the learner waited for iteration 0's rows
    assert not os.path.exists(os.path.join(w, "metrics.jsonl")) or _train_rows(w) == []


@pytest.mark.e2e
@pytest.mark.slow
def test_a_learner_failing_after_the_last_rows_stops_the_sampler_naming_it(jax_cache, tmp_path):
    # the sampler has sent every row and waits for the learner to close: a failure, not a close
    w = str(tmp_path / "run")
    (rc0, _, err0), (rc1, _, err1) = _two_processes(w, jax_cache, k=0, FAIL_END="1")
    assert rc0 == 1 and "error: RuntimeError: injected: the learner failed after its last iteration" in err0, err0
    line = "error: process 0 of 2 failed: RuntimeError: injected: the learner failed after its last iteration"
    assert rc1 == 1 and line + "; process 1 stops too" in err1, err1[-3000:]
    assert [r["iteration"] for r in _train_rows(w)] == [0, 1, 2]


@pytest.mark.e2e
@pytest.mark.slow
def test_processes_started_with_different_configs_stop_in_one_line_naming_it(jax_cache, tmp_path):
    w = str(tmp_path / "run")
    (rc0, _, err0), (rc1, _, err1) = _two_processes(w, jax_cache, k=0, sampler_flags=("--config.seed=1",))
    assert rc1 == 1 and rc0 != 0, (err0[-3000:], err1[-3000:])
    assert re.search(r"error: process 1's config \(sha256 \w+\) differs from process 0's \(\w+\)", err1), err1[-3000:]
    assert "process 1 of 2 failed" in err0, err0[-3000:]  # the learner stops too, naming the sampler
    assert not os.path.exists(os.path.join(w, "metrics.jsonl"))  # before anything trains
