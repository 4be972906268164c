"""Asynchronous RL (``bipace_jax.async_rl``, ``config.async_rl``): the config's errors, the sampler
thread's staleness bound on a hand-driven learner, the resume rule of the new fields, and (in a
subprocess on 8 CPU devices) whole runs: 4 sampler + 4 learner devices at k = 0 against the colocated
run, k = 1's row versions, and a SIGKILL during a weight push resumed with no iteration lost or repeated."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
import time

import jax
import numpy as np
import pytest

import configs.textcraft_tiny
from bipace_jax import async_rl, build, resume
from bipace_jax.config import AsyncConfig, ConfigError, MeshConfig, Switch
from bipace_jax.models import load_tokenizer
from bipace_jax.rollout import RolloutConfig, collect
from tests.devices import run_on_cpu_devices
from tests.test_rollout_loop import GAMES, ScriptedEngine, TextPool

# ------------------------------------------------------------------------------------------------
# Config.


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_staleness", -1, "config.async_rl.max_staleness must be"),
        ("switch", "token", "config.async_rl.switch must be"),
        ("sampler_devices", -2, "config.async_rl.sampler_devices must be"),
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
