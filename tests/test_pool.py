"""EnvPool: batched stepping in worker processes, task-group checks, crash/hang recovery, shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import environments
from environments.pool import (
    ENV_ERRORS,
    EnvPool,
    EnvPoolError,
    Fault,
    ResetJob,
    ResetResult,
    StepJob,
    StepResult,
    TaskInfoResult,
)
from environments.testing import FaultyEnv

LADDER, CHEST = 272, 183


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def faulty_pool():
    pool = EnvPool(FaultyEnv, 4, num_workers=2, timeout_s=20.0)
    yield pool
    pool.close()


def test_textcraft_pool_matches_in_process_envs_for_any_subset_and_order():
    local = [environments.make("textcraft", max_steps=30) for _ in range(3)]
    tasks, seeds = [LADDER, LADDER, CHEST], [4, 4, 9]
    with EnvPool("textcraft", 3, env_options={"max_steps": 30}, num_workers=2) as pool:
        started = pool.reset([2, 0, 1], [tasks[2], tasks[0], tasks[1]], [seeds[2], seeds[0], seeds[1]])
        assert all(isinstance(r, ResetResult) and r.ok and r.info == {} for r in started)
        obs = [r.obs for r in started]
        assert obs == [
            local[2].reset(tasks[2], seeds[2]),
            local[0].reset(tasks[0], seeds[0]),
            local[1].reset(tasks[1], seeds[1]),
        ]
        assert obs[1] == obs[2]  # a task group shows one initial observation
        assert [r.info for r in pool.task_info([0, 2])] == [
            {"depth": 2, "goal": "ladder"},
            {"depth": 2, "goal": "chest"},
        ]
        order = [[1, 2], [2, 0], [0, 1, 2], [2], [1, 0]]
        done = [False] * 3
        for subset in order * 4:
            subset = [i for i in subset if not done[i]]
            if not subset:
                continue
            oracle = pool.oracle_actions(subset)
            assert oracle == [local[i].oracle_action() for i in subset]
            actions = [a if k % 2 == 0 else "inventory" for k, a in enumerate(oracle)]
            results = pool.step(subset, actions)
            for i, a, r in zip(subset, actions, results):
                assert isinstance(r, StepResult)
                assert tuple(r[:4]) == local[i].step(a) and r.fault is None
                done[i] = r.done
        assert all(done)
        assert pool.fault_count == 0
        assert pool.oracle_actions([0, 1, 2]) == [None, None, None]  # finished episodes


def test_task_group_with_differing_initial_observations_raises(faulty_pool):
    # seed -4 makes the first observation depend on the process: envs 0 and 1 sit on two workers
    with pytest.raises(EnvPoolError, match=r"task group \(task_id=3, seed=-4\)"):
        faulty_pool.reset([0, 1], [3, 3], [-4, -4])
    # different groups may differ; equal groups agree
    obs = faulty_pool.reset([0, 1, 2, 3], [3, 3, 4, 4], [1, 1, 1, 1])
    assert [r.obs.text for r in obs] == ["task 3 seed 1 step 0"] * 2 + ["task 4 seed 1 step 0"] * 2


def test_crashed_worker_is_replaced_and_its_episodes_end_with_env_error(faulty_pool):
    pool = faulty_pool
    pool.reset([0, 1, 2, 3], [1, 2, 3, 4], [0, 0, 0, 0])
    pool.step([0, 1, 2, 3], ["a", "b", "c", "d"])
    pids, faults = pool.worker_pids(), pool.fault_count
    # env 1 (worker 1) crashes its worker; env 0 (worker 0) is unaffected; env 3 shares worker 1
    r0, r1 = pool.step([0, 1], ["e", "crash"])
    assert r0 == StepResult(r0.obs, 0.0, False, {"count": 2}) and r0.obs.text == "task 1 seed 0 step 2: e"
    assert r1.done and r1.reward == 0.0 and r1.fault is Fault.CRASH and r1.info == {}
    assert "worker 1 died during step" in r1.detail
    assert r1.obs.text == "task 2 seed 0 step 1: b"  # the last observation the env showed
    new_pids = pool.worker_pids()
    assert new_pids[0] == pids[0] and new_pids[1] != pids[1] and not _alive(pids[1])
    assert pool.fault_count == faults + 1
    # env 3 lost its episode with the old worker: its next step reports it, once
    (r3,) = pool.step([3], ["f"])
    assert r3.done and r3.fault == "lost" and "worker 1 died" in r3.detail
    assert r3.obs.text == "task 4 seed 0 step 1: d"
    with pytest.raises(RuntimeError, match="env 3 has no running episode"):
        pool.step([3], ["g"])
    # the fresh worker serves new episodes
    assert [r.obs.text for r in pool.reset([1, 3], [7, 8], [2, 2])] == ["task 7 seed 2 step 0", "task 8 seed 2 step 0"]
    assert pool.step([1], ["h"])[0].obs.text == "task 7 seed 2 step 1: h"


def test_envs_answered_before_a_crash_keep_their_result_then_report_the_lost_episode(faulty_pool):
    pool = faulty_pool
    pool.reset([0, 2], [1, 2], [0, 0])  # both on worker 0
    r0, r2 = pool.step([0, 2], ["x", "crash"])
    assert not r0.done and r0.obs.text == "task 1 seed 0 step 1: x"
    assert r2.done and r2.fault == "crash" and "worker 0 died during step" in r2.detail
    (again,) = pool.step([0], ["y"])
    assert again.done and again.fault == "lost"
    assert "worker 0 died during step" in again.detail
    assert again.obs.text == "task 1 seed 0 step 1: x"


def test_game_exception_ends_only_that_episode_and_keeps_the_worker(faulty_pool):
    pool = faulty_pool
    pool.reset([0, 2], [5, 6], [1, 1])  # both on worker 0
    pids = pool.worker_pids()
    r0, r2 = pool.step([0, 2], ["raise", "x"])
    assert r0.done and r0.info == {} and r0.fault is Fault.EXCEPTION
    assert r0.detail == "env 0 raised RuntimeError: injected step error"
    assert not r2.done and r2.obs.text == "task 6 seed 1 step 1: x"
    assert pool.worker_pids() == pids


def test_unpicklable_step_result_is_an_env_error_not_a_dead_worker(faulty_pool):
    pool = faulty_pool
    pool.reset([1], [2], [3])
    pids = pool.worker_pids()
    (r,) = pool.step([1], ["unpicklable"])
    assert r.done and r.fault == "exception"
    assert "step result could not be sent to the parent" in r.detail
    assert pool.worker_pids() == pids


def test_hung_worker_is_killed_after_the_call_timeout():
    with EnvPool(FaultyEnv, 2, num_workers=2, timeout_s=2.0) as pool:
        pool.reset([0, 1], [1, 1], [0, 0])
        old = pool.worker_pids()
        r0, r1 = pool.step([0, 1], ["hang", "x"])
        assert r0.done and r0.fault == "timeout"
        assert "worker 0 did not answer step within timeout_s=2.0" in r0.detail
        assert not r1.done and r1.obs.text == "task 1 seed 0 step 1: x"
        assert not _alive(old[0]) and pool.worker_pids()[1] == old[1]
        # the replacement works; a hang inside oracle-free calls is recovered the same way
        assert pool.reset([0], [2], [0])[0].obs.text == "task 2 seed 0 step 0"
        assert pool.step([0], ["y"])[0].obs.text == "task 2 seed 0 step 1: y"


def test_timeout_applies_per_env_answer_not_to_the_whole_batch():
    # three 0.8 s steps on one worker take 2.4 s in all, more than timeout_s, but each answer
    # comes within it: no fault
    with EnvPool(FaultyEnv, 3, num_workers=1, timeout_s=2.0) as pool:
        pool.reset([0, 1, 2], [0, 0, 0], [0, 0, 0])
        results = pool.step([0, 1, 2], ["nap", "nap", "nap"])
        assert [r.obs.text for r in results] == ["task 0 seed 0 step 1: nap"] * 3
        assert pool.fault_count == 0


def test_hung_reset_returns_the_good_observations_and_a_timeout_result_quickly():
    # the issue's reproduction: env 1's reset hangs (seed -1); before, reset raised after ~2 x timeout
    # and env 0 lost its episode
    with EnvPool(FaultyEnv, 2, num_workers=2, timeout_s=2.0) as pool:
        old = pool.worker_pids()
        t0 = time.monotonic()
        r0, r1 = pool.reset([0, 1], [0, 3], [0, -1])
        assert time.monotonic() - t0 < 10.0
        assert r0 == ResetResult(r0.obs, {}) and r0.obs.text == "task 0 seed 0 step 0"
        assert not r1.ok and r1.fault == "timeout" and "timeout_s=2.0" in r1.detail
        assert pool.fault_count == 1 and pool.worker_pids()[0] == old[0] and not _alive(old[1])
        assert pool.step([0], ["a"])[0].obs.text == "task 0 seed 0 step 1: a"  # env 0 kept its episode
        with pytest.raises(RuntimeError, match="env 1 has no running episode"):
            pool.step([1], ["a"])
        assert pool.reset([1], [3], [0])[0].obs.text == "task 3 seed 0 step 0"  # the fresh worker serves


@pytest.mark.parametrize(
    "seed,kind,detail",
    [
        (-2, "crash", "worker 0 died during reset (exit code 2)"),
        (-7, "crash", "worker 0 died during reset (exit code -11)"),  # a segfault
        (-6, "exception", "env 2 raised RuntimeError: injected reset error"),
    ],
)
def test_reset_fault_of_one_env_flags_it_and_resets_its_worker_mates_again(seed, kind, detail):
    # envs 0, 2, 4 share worker 0: env 2 faults; env 0 (answered before) and env 4 (queued after)
    # get real observations, from the fresh worker when the old one died
    with EnvPool(FaultyEnv, 6, num_workers=2, timeout_s=20.0) as pool:
        results = pool.reset([0, 2, 4, 1], [10, 12, 14, 11], [0, seed, 0, 0])
        assert [r.obs.text for r in results if r.ok] == [f"task {t} seed 0 step 0" for t in (10, 14, 11)]
        assert results[1] == ResetResult(results[1].obs, {}, Fault(kind), detail) and results[1].obs.text == ""
        assert pool.fault_count == (kind == "crash")
        stepped = pool.step([0, 4, 1], ["x", "x", "x"])
        assert [r.obs.text for r in stepped] == [f"task {t} seed 0 step 1: x" for t in (10, 14, 11)]


def test_a_worker_killed_between_calls_is_replaced_without_blaming_an_env():
    with EnvPool(FaultyEnv, 4, num_workers=2, timeout_s=20.0) as pool:
        pool.reset([0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0])
        victim = pool.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.5)
        r1, r0 = pool.step([1, 0], ["x", "x"])  # env 1's episode died with its worker
        assert r1.done and r1.fault == "lost" and "had exited (exit code -9)" in r1.detail
        assert not r0.done and r0.obs.text == "task 0 seed 0 step 1: x"
        (r3,) = pool.step([3], ["x"])  # reported once, on its next step
        assert r3.fault == "lost"
        results = pool.reset([1, 3], [5, 5], [0, 0])  # resets after a kill need no culprit either
        assert all(r.ok for r in results) and pool.fault_count == 1


def test_task_info_faults_are_results_not_exceptions():
    with EnvPool(FaultyEnv, 4, num_workers=2, timeout_s=2.0) as pool:
        pool.reset([0, 1, 2, 3], [98, 99, 2, 3], [0, 0, 0, 0])
        info = pool.task_info([0, 1, 2, 3])
        assert info[0] == TaskInfoResult({}, Fault.EXCEPTION, "env 0 raised RuntimeError: injected task_info error")
        assert info[1].fault is Fault.TIMEOUT and info[1].info == {}
        assert info[2] == TaskInfoResult({"task": 2, "parity": 0}) and info[2].fault is None
        assert info[3].fault is Fault.LOST  # queued after env 1 on the hung worker
        # env 3's episode ended with worker 1; env 0's game raised but its worker and episode stay
        r0, r3 = pool.step([0, 3], ["x", "x"])
        assert not r0.done and r3.done and r3.fault == "lost"
        assert ENV_ERRORS == tuple(Fault) and [str(k) for k in ENV_ERRORS] == ["timeout", "crash", "exception", "lost"]


def test_oracle_fault_gives_none_and_the_episode_reports_the_loss():
    with EnvPool(FaultyEnv, 2, num_workers=1, timeout_s=20.0) as pool:
        pool.reset([0, 1], [0, 1], [0, 0])
        pool._workers[0].proc.kill()
        time.sleep(0.5)
        assert pool.oracle_actions([0, 1]) == [None, None]
        assert [r.fault for r in pool.step([0, 1], ["x", "x"])] == ["lost", "lost"]


def test_workers_run_with_the_fixed_hash_seed():
    probe = "print(hash('bipace'))"
    expected = {
        hs: int(
            subprocess.run(
                [sys.executable, "-c", probe],
                capture_output=True,
                text=True,
                env=dict(os.environ, PYTHONHASHSEED=str(hs)),
            ).stdout
        )
        for hs in (0, 7)
    }
    with EnvPool(FaultyEnv, 2, num_workers=2) as pool:
        assert pool.worker_hash_probes() == [expected[0]] * 2
        pool.reset([0, 1], [0, 0], [0, 0])
        assert [r.obs.text for r in pool.step([0, 1], ["hash", "hash"])] == [str(expected[0])] * 2
    with EnvPool(FaultyEnv, 1, hash_seed=7) as pool:
        assert pool.worker_hash_probes() == [expected[7]]


def test_close_stops_every_worker_even_a_hung_one():
    pool = EnvPool(FaultyEnv, 2, num_workers=2, timeout_s=60.0)
    pool.reset([0, 1], [0, 0], [0, 0])
    pids = pool.worker_pids()
    # leave worker 1 busy in a hang that no call waits for
    pool.submit([StepJob(1, "hang")])
    pool.close(grace_s=0.5)
    assert not any(_alive(p) for p in pids)
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="EnvPool is closed"):
        pool.step([0], ["x"])


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(env="textcraft", num_envs=0), ValueError, "num_envs must be an int >= 1"),
        (
            dict(env="textcraft", num_envs=2, num_workers=3),
            ValueError,
            r"num_workers must be an int in \[1, num_envs=2\]",
        ),
        (dict(env="textcraft", num_envs=1, timeout_s=0), ValueError, "timeout_s must be a number > 0"),
        (dict(env="chess", num_envs=1), ValueError, "env 'chess' is not registered"),
        (dict(env=lambda: None, num_envs=1), ValueError, "not picklable"),
        (dict(env="textcraft", num_envs=1, hash_seed=-1), ValueError, "hash_seed must be an int"),
        (
            dict(env="textcraft", num_envs=1, env_options={"bogus": 1}),
            EnvPoolError,
            "worker 0 could not build its environments: TypeError: .*bogus",
        ),
    ],
)
def test_bad_pool_arguments_raise_naming_the_field(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        EnvPool(**kwargs)


def test_bad_call_arguments_raise_before_any_work(faulty_pool):
    pool = faulty_pool
    pool.reset([0], [1], [1])
    with pytest.raises(ValueError, match="env_indices must not repeat"):
        pool.step([0, 0], ["a", "b"])
    with pytest.raises(ValueError, match=r"env index 4 out of range \[0, 4\)"):
        pool.step([4], ["a"])
    with pytest.raises(ValueError, match="equal lengths"):
        pool.step([0], ["a", "b"])
    with pytest.raises(ValueError, match="action for env 0 must be a str"):
        pool.step([0], [None])
    with pytest.raises(ValueError, match="equal lengths"):
        pool.reset([0, 1], [1], [1, 1])


def test_an_unscorable_reward_ends_only_that_game_with_an_exception_fault():
    # TextEnv.step refuses NaN, inf and a non-number: the pool reports that env's fault, the others play on
    with EnvPool(FaultyEnv, 4, num_workers=2, timeout_s=20.0) as pool:
        pool.reset([0, 1, 2, 3], [5, 6, 7, 8], [0, 0, 0, 0])
        results = pool.step([0, 1, 2, 3], ["nan", "a", "inf", "text"])
        assert [r.fault for r in results] == [Fault.EXCEPTION, None, Fault.EXCEPTION, Fault.EXCEPTION]
        assert (
            "FaultyEnv task 5: step 1 gave reward nan (float); a reward must be a finite real number"
            in results[0].detail
        )
        assert "FaultyEnv task 7: step 1 gave reward inf" in results[2].detail
        assert "FaultyEnv task 8: step 1 gave reward 'high' (str)" in results[3].detail
        assert results[1].obs.text == "task 6 seed 0 step 1: a" and results[1].reward == 0.0
        assert pool.step([1], ["win"])[0].reward == 1.0 and pool.fault_count == 0  # no worker was replaced
        with pytest.raises(RuntimeError, match="env 0 has no running episode"):
            pool.step([0], ["a"])


def test_text_env_step_accepts_real_numbers_only():
    env = FaultyEnv()
    env.reset(3, 0)
    assert env.step("win")[1] == 1.0
    env.reset(4, 0)
    with pytest.raises(ValueError, match=r"FaultyEnv task 4: step 1 gave reward nan"):
        env.step("nan")
    with pytest.raises(RuntimeError, match="finished episode"):  # the unscorable step ended the episode
        env.step("a")


# -- asynchronous submit / poll ------------------------------------------------------------------
def _poll_all(pool, tickets):
    """Polls until every ticket is back; returns the polls' (ticket, result) lists, in order."""
    batches = []
    while pool.in_flight:
        got = pool.poll(timeout=None)
        assert got, "poll(None) returned nothing while jobs were in flight"
        batches.append(got)
    back = [t for batch in batches for t, _ in batch]
    assert sorted(back) == sorted(tickets) and len(set(back)) == len(back)  # each ticket exactly once
    assert pool.poll() == [] and pool.in_flight == 0
    return batches


def test_submit_returns_tickets_at_once_and_poll_gives_each_result_once():
    with EnvPool(FaultyEnv, 4, num_workers=2, timeout_s=20.0) as pool:
        assert pool.poll() == [] and pool.poll(timeout=None) == []  # nothing in flight: no wait
        first = pool.submit([ResetJob(i, 10 + i, 0) for i in range(4)])
        assert first == [0, 1, 2, 3] and pool.in_flight == 4
        batches = _poll_all(pool, first)
        results = dict(t for batch in batches for t in batch)
        assert [results[t].obs.text for t in first] == [f"task {10 + i} seed 0 step 0" for i in range(4)]
        assert all(isinstance(r, ResetResult) and r.ok for r in results.values())
        # env 1 naps 0.8 s on worker 1 (with env 3 queued behind it); worker 0's envs answer first
        second = pool.submit([StepJob(1, "nap"), StepJob(3, "x"), StepJob(0, "x"), StepJob(2, "y")])
        assert second == [4, 5, 6, 7]
        with pytest.raises(RuntimeError, match=r"env 1 already has a job in flight \(ticket 4\)"):
            pool.submit([StepJob(1, "x")])
        with pytest.raises(RuntimeError, match="env 3 already has a job in flight"):
            pool.step([3], ["x"])
        batches = _poll_all(pool, second)
        order = [t for batch in batches for t, _ in batch]
        assert set(order[:2]) == {6, 7} and order[2:] == [4, 5]  # the slow game did not hold worker 0 up
        results = dict(t for batch in batches for t in batch)
        assert [results[t].obs.text for t in second] == [
            "task 11 seed 0 step 1: nap",
            "task 13 seed 0 step 1: x",
            "task 10 seed 0 step 1: x",
            "task 12 seed 0 step 1: y",
        ]
        assert all(isinstance(r, StepResult) and r.fault is None and not r.done for r in results.values())


def test_a_blocking_call_leaves_the_submitted_jobs_results_for_poll():
    with EnvPool(FaultyEnv, 4, num_workers=2, timeout_s=20.0) as pool:
        pool.reset([0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0])
        (t,) = pool.submit([StepJob(1, "nap")])
        # env 0 (worker 0) and env 3 (queued behind env 1's nap on worker 1) step while env 1 is in flight
        r0, r3 = pool.step([0, 3], ["a", "b"])
        assert (r0.obs.text, r3.obs.text) == ("task 0 seed 0 step 1: a", "task 3 seed 0 step 1: b")
        assert pool.task_info([2])[0] == TaskInfoResult({"task": 2, "parity": 0})
        assert pool.in_flight == 1
        ((back, res),) = pool.poll(timeout=None)
        assert back == t and res.obs.text == "task 1 seed 0 step 1: nap" and pool.in_flight == 0
        (again,) = pool.submit([StepJob(0, "c")])
        assert again > t  # tickets are never reused (the blocking calls took some too)
        assert pool.poll(timeout=None)[0][1].obs.text == "task 0 seed 0 step 2: c"


# Env 1 and env 3 share worker 1 (env 3 queued behind env 1); envs 0 and 2 are worker 0's.
_STEP_FAULTS = {"hang": ("hang", Fault.TIMEOUT), "crash": ("crash", Fault.CRASH), "segfault": ("segv", Fault.CRASH),
                "raise": ("raise", Fault.EXCEPTION)}  # fmt: skip
_RESET_FAULTS = {"hang": (-1, Fault.TIMEOUT), "crash": (-2, Fault.CRASH), "segfault": (-7, Fault.CRASH),
                 "raise": (-6, Fault.EXCEPTION)}  # fmt: skip


@pytest.mark.parametrize("op", ["step", "reset"])
@pytest.mark.parametrize("kind", ["hang", "crash", "segfault", "raise", "lost"])
def test_every_fault_kind_gives_each_submitted_job_exactly_one_outcome(op, kind):
    with EnvPool(FaultyEnv, 4, num_workers=2, timeout_s=2.0) as pool:
        pool.reset([0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0])
        old = pool.worker_pids()
        if kind == "lost":  # worker 1 dies between calls: envs 1 and 3 lost their episodes with it
            os.kill(old[1], signal.SIGKILL)
            time.sleep(0.5)
        if op == "step":
            bad = _STEP_FAULTS[kind][0] if kind != "lost" else "x"
            jobs = [StepJob(1, bad), StepJob(3, "x"), StepJob(0, "x"), StepJob(2, "x")]
        else:
            bad = _RESET_FAULTS[kind][0] if kind != "lost" else 0
            jobs = [ResetJob(1, 21, bad), ResetJob(3, 23, 0), ResetJob(0, 20, 0), ResetJob(2, 22, 0)]
        tickets = pool.submit(jobs)
        assert len(set(tickets)) == 4
        batches = _poll_all(pool, tickets)
        results = dict(t for batch in batches for t in batch)
        r1, r3, r0, r2 = (results[t] for t in tickets)
        good = {"step": ("task 0 seed 0 step 1: x", "task 2 seed 0 step 1: x"), "reset": ("task 20 seed 0 step 0",
                "task 22 seed 0 step 0")}[op]  # fmt: skip
        assert (r0.obs.text, r2.obs.text) == good and r0.fault is None and r2.fault is None
        if kind == "lost":
            if op == "step":  # answered at submit, without blame: the worker died idle
                assert r1.fault is r3.fault is Fault.LOST and "had exited (exit code -9)" in r1.detail
            else:  # a reset starts a new episode on the fresh worker
                assert (r1.obs.text, r3.obs.text) == ("task 21 seed 0 step 0", "task 23 seed 0 step 0")
            assert pool.fault_count == 1
            return
        expected = _STEP_FAULTS[kind][1] if op == "step" else _RESET_FAULTS[kind][1]
        assert r1.fault is expected
        if expected is Fault.EXCEPTION:  # the worker stays and serves env 3
            assert r3.fault is None and pool.worker_pids() == old
        else:  # env 3 was queued behind the culprit on the replaced worker
            assert r3.fault is Fault.LOST and f"lost with worker 1: {r1.detail}" == r3.detail
            assert pool.worker_pids()[0] == old[0] and not _alive(old[1]) and pool.fault_count == 1
        if kind == "hang":  # worker 0's games came back in a poll before the hung one's timeout
            hung_poll = next(k for k, batch in enumerate(batches) if tickets[0] in dict(batch))
            assert hung_poll > 0 and {t for t, _ in batches[hung_poll]} == {tickets[0], tickets[1]}
            assert "did not answer" in r1.detail and "timeout_s=2.0" in r1.detail
        if kind == "segfault":
            assert "exit code -11" in r1.detail
        # the pool plays on: every env can be reset and stepped again
        assert [r.ok for r in pool.reset([0, 1, 2, 3], [5, 5, 6, 6], [1, 1, 1, 1])] == [True] * 4
        assert [r.obs.text for r in pool.step([1, 3], ["z", "z"])] == [
            "task 5 seed 1 step 1: z",
            "task 6 seed 1 step 1: z",
        ]


def test_a_worker_killed_while_serving_submitted_jobs_blames_its_current_job():
    with EnvPool(FaultyEnv, 2, num_workers=1, timeout_s=20.0) as pool:
        pool.reset([0, 1], [0, 1], [0, 0])
        tickets = pool.submit([StepJob(0, "nap"), StepJob(1, "x")])
        time.sleep(0.2)  # worker 0 is inside env 0's nap
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        results = dict(t for batch in _poll_all(pool, tickets) for t in batch)
        assert results[tickets[0]].fault is Fault.CRASH and "exit code -9" in results[tickets[0]].detail
        assert results[tickets[1]].fault is Fault.LOST


def test_bad_submits_raise_before_anything_is_sent(faulty_pool):
    pool = faulty_pool
    pool.reset([0, 1, 3], [1, 1, 1], [1, 1, 1])
    assert pool.step([3], ["win"])[0].done  # env 3's episode is over
    n = pool.in_flight
    with pytest.raises(ValueError, match="a job must be a StepJob or ResetJob"):
        pool.submit([(0, "x")])
    with pytest.raises(ValueError, match="env 0 appears twice"):
        pool.submit([StepJob(0, "a"), ResetJob(0, 1, 1)])
    with pytest.raises(ValueError, match=r"env index 9 out of range \[0, 4\)"):
        pool.submit([StepJob(0, "a"), StepJob(9, "a")])
    with pytest.raises(ValueError, match="action for env 1 must be a str"):
        pool.submit([StepJob(0, "a"), StepJob(1, 3)])
    with pytest.raises(ValueError, match="task_id and seed of env 2 must be ints"):
        pool.submit([ResetJob(2, "1", 0)])
    with pytest.raises(RuntimeError, match="env 3 has no running episode"):
        pool.submit([StepJob(0, "a"), StepJob(3, "a")])
    with pytest.raises(ValueError, match="poll: timeout must be None or a number >= 0"):
        pool.poll(timeout=-1)
    assert pool.in_flight == n == 0 and pool.poll() == []
    assert pool.step([0], ["a"])[0].obs.text == "task 1 seed 1 step 1: a"  # nothing was queued for env 0


def test_a_late_poll_never_turns_answered_jobs_into_faults():
    # the case 2: two steps answer in ~1 ms, but the host is busy 1.8 s (a compile, a long
    # decode chunk) before it polls, with timeout_s=1: both are answers, not hangs, and nothing is replaced
    with EnvPool(FaultyEnv, 2, num_workers=1, timeout_s=1.0) as pool:
        pool.reset([0, 1], [0, 1], [0, 0])
        pid = pool.worker_pids()
        tickets = pool.submit([StepJob(0, "a"), StepJob(1, "b")])
        time.sleep(1.8)
        results = dict(t for batch in _poll_all(pool, tickets) for t in batch)
        assert [results[t].fault for t in tickets] == [None, None]
        assert [results[t].obs.text for t in tickets] == ["task 0 seed 0 step 1: a", "task 1 seed 0 step 1: b"]
        assert pool.fault_count == 0 and pool.worker_pids() == pid


def test_a_late_poll_still_finds_the_job_that_hung_behind_an_answered_one():
    # the answered job is the worker's; the hang queued behind it is timed from that answer, not from the poll
    with EnvPool(FaultyEnv, 2, num_workers=1, timeout_s=1.0) as pool:
        pool.reset([0, 1], [0, 1], [0, 0])
        tickets = pool.submit([StepJob(0, "a"), StepJob(1, "hang")])
        time.sleep(1.8)
        t0 = time.monotonic()
        results = dict(t for batch in _poll_all(pool, tickets) for t in batch)
        assert time.monotonic() - t0 < 0.9  # already past its timeout when the host polled: no second wait
        assert results[tickets[0]].fault is None and results[tickets[0]].obs.text == "task 0 seed 0 step 1: a"
        assert results[tickets[1]].fault == "timeout" and "timeout_s=1.0" in results[tickets[1]].detail
        assert pool.fault_count == 1
