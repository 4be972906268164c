"""EnvPool: N text environments in worker processes, stepped asynchronously, surviving faults.

Workers are fresh Python interpreters (like multiprocessing's ``spawn``; never ``fork``, which
is unsafe in a process running JAX threads), started with ``subprocess`` so that

* each worker gets a fixed ``PYTHONHASHSEED`` (default 0): games whose text depends on set or
  dict-of-str order are deterministic across workers and runs;
* the parent's ``__main__`` (e.g. the trainer, with JAX loaded) is not re-imported in workers,
  as multiprocessing's spawn and forkserver would do;
* each worker leads its own process group (in the parent's session), so a kill also ends
  anything it started.

They talk to the parent over a socket pair with ``multiprocessing.connection.Connection``
(pickled messages). Environment ``i`` lives on worker ``i % num_workers``. ``submit`` sends one
message per involved worker and returns a ticket per job at once; each worker answers its jobs one
by one, in the order submitted; ``poll`` hands back whatever has been answered (or has faulted).
``step`` / ``reset`` are ``submit`` followed by waiting for their own tickets. A job must be answered
within ``timeout_s`` of the moment its worker could start it: its submit, or the answer to the job
queued ahead of it on the same worker (by the worker's clock), whichever is later. A job the worker
answered is never a fault, however late the host polls (a compile or a long decode chunk in between).

Faults never raise: every submitted job gets exactly one result, and the result's typed ``fault``
field (a ``Fault``, None when the env answered) names the kind of each faulted one, ``detail`` says
what happened; the game's own ``info`` never carries pool keys:

* ``Fault.TIMEOUT``: the env gave no answer within ``timeout_s`` (a hang);
* ``Fault.CRASH``: its worker died while serving it (exception outside Python, segfault, OOM or
  SIGKILL);
* ``Fault.EXCEPTION``: the game raised (the worker stays);
* ``Fault.LOST``: the env's episode lived in a worker that was replaced because of another env.

A hung or dead worker is killed (its whole process group) and replaced by a fresh one, so the
episodes of all its envs end: its jobs queued behind the culprit get a ``"lost"`` result at once
(the blocking ``reset`` simply redoes those resets on the fresh worker), the other envs report the
loss on their next ``step``. Jobs on other workers are unaffected and are not held up.

Not thread-safe: use one pool from one thread.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from environments.base import EnvSnapshot, Observation, ReplayDivergedError, TextEnv
from environments.registry import game_spec, registered

__all__ = [
    "ENV_ERRORS",
    "EnvPool",
    "EnvPoolError",
    "Fault",
    "ForkResult",
    "ResetJob",
    "ResetResult",
    "StepJob",
    "StepResult",
    "TaskInfoResult",
]


class Fault(enum.StrEnum):
    """Why the pool could not give an env's own answer (the values are the metric names' kinds)."""

    TIMEOUT = "timeout"  # no answer within timeout_s: the worker was declared hung
    CRASH = "crash"  # the worker died while serving this env
    EXCEPTION = "exception"  # the game raised; the worker stays
    LOST = "lost"  # the episode died with a worker replaced because of another env


#: Every fault kind, in declaration order (``rollout/env_errors_<kind>`` metrics).
ENV_ERRORS = tuple(Fault)

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StepResult(NamedTuple):
    """One env's step: the game's ``(obs, reward, done, info)``, or on a fault ``fault`` set (``detail``
    says what happened), the last observation, reward 0.0, ``done`` True and an empty ``info``."""

    obs: Observation
    reward: float
    done: bool
    info: dict[str, Any]
    fault: Fault | None = None
    detail: str = ""


class ResetResult(NamedTuple):
    """One env's reset: the initial ``obs`` and ``info`` (empty); on a fault ``fault`` is set (``detail``
    says what happened), ``obs`` is empty and the env has no running episode."""

    obs: Observation
    info: dict[str, Any]
    fault: Fault | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.fault is None


class TaskInfoResult(NamedTuple):
    """One env's ``task_info`` of its current task: the game's dict, or ``{}`` with ``fault`` set on a fault."""

    info: dict[str, Any]
    fault: Fault | None = None
    detail: str = ""


class StepJob(NamedTuple):
    """``submit`` job: step env ``env`` with ``action`` (its result is a ``StepResult``)."""

    env: int
    action: str


class ResetJob(NamedTuple):
    """``submit`` job: reset env ``env`` to task ``task_id`` with ``seed`` (its result is a ``ResetResult``)."""

    env: int
    task_id: int
    seed: int


class ForkResult(NamedTuple):
    """One child env of ``EnvPool.fork``: the observation its restored game shows, or on a fault ``fault``
    set (``detail`` says what happened), an empty ``obs`` and no running episode."""

    obs: Observation
    fault: Fault | None = None
    detail: str = ""


class _OracleJob(NamedTuple):
    env: int


class _SnapshotJob(NamedTuple):
    env: int


class _RestoreJob(NamedTuple):
    env: int
    snapshot: EnvSnapshot


class _TaskInfoJob(NamedTuple):
    env: int
    task_id: int


_COMMANDS = {
    StepJob: "step",
    ResetJob: "reset",
    _OracleJob: "oracle",
    _TaskInfoJob: "task_info",
    _SnapshotJob: "snapshot",
    _RestoreJob: "restore",
}


@dataclasses.dataclass
class _Ticket:
    """A submitted job waiting for its worker's answer."""

    ticket: int
    job: tuple
    cmd: str


class EnvPoolError(RuntimeError):
    """A pool-level failure: a worker cannot start (or restart), or a task group's envs disagree."""


@dataclasses.dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    env_ids: list[int]
    hash_probe: int | None = None


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _worker_main() -> None:
    """Worker process entry point: ``python -c ... <fd>``; serves commands until "close" or EOF."""
    conn = Connection(int(sys.argv[1]))
    try:
        factory_bytes, options, env_ids, parent_path = conn.recv()
        for entry in parent_path:
            if entry not in sys.path:
                sys.path.append(entry)
        factory = pickle.loads(factory_bytes)
        envs: dict[int, TextEnv] = {i: factory(**options) for i in env_ids}
    except BaseException as e:  # noqa: BLE001
        conn.send(("init_error", _portable(e), traceback.format_exc()))
        return
    conn.send(("ready", os.getpid(), hash("bipace")))
    while True:
        try:
            msg = conn.recv()  # "close" or a list of (command, job fields), answered one by one
        except (EOFError, OSError):
            return  # the parent is gone
        if msg == "close":
            return
        for cmd, item in msg:
            try:
                if cmd == "step":
                    i, action = item
                    obs, reward, done, info = envs[i].step(action)
                    reply = ("ok", (obs, float(reward), bool(done), dict(info)), "")
                elif cmd == "reset":
                    i, task_id, seed = item
                    reply = ("ok", envs[i].reset(task_id, seed), "")
                elif cmd == "oracle":
                    (i,) = item
                    reply = ("ok", envs[i].oracle_action(), "")
                elif cmd == "task_info":
                    i, task_id = item
                    reply = ("ok", envs[i].task_info(task_id), "")
                elif cmd == "snapshot":
                    (i,) = item
                    reply = ("ok", envs[i].snapshot(), "")
                elif cmd == "restore":
                    i, snap = item
                    reply = ("ok", envs[i].restore(snap), "")
                else:
                    raise ValueError(f"unknown command {cmd!r}")
            except Exception as e:  # noqa: BLE001  (reported to the parent, never kills the worker)
                reply = ("error", _portable(e), traceback.format_exc())
            # when it answered (CLOCK_MONOTONIC is one clock for every process of a host): the next job's
            # time starts here, however late the parent reads it
            answered_at = time.monotonic()
            try:
                conn.send((*reply, answered_at))  # pickles fully before writing: an error leaves the stream intact
            except (TypeError, AttributeError, pickle.PicklingError) as e:
                err = RuntimeError(f"{cmd} result could not be sent to the parent: {_describe(e)}")
                conn.send(("error", err, "", answered_at))


def _kill(worker: _Worker) -> None:
    try:
        os.killpg(worker.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        worker.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    worker.conn.close()


def _shutdown(workers: list[_Worker | None], grace_s: float) -> None:
    live = [w for w in workers if w is not None and w.proc.poll() is None]
    for w in live:
        try:
            w.conn.send("close")
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for w in live:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        if w is not None:
            _kill(w)  # also ends anything a worker started in its process group
    workers[:] = [None] * len(workers)


class EnvPool:
    """``num_envs`` environments in worker processes (see the module docstring for faults).

    Args:
      env: a registered game name (its ``GameSpec.factory`` is sent to the workers, which import the
        game's module) or a picklable factory (a module-level callable, e.g. a ``TextEnv`` subclass)
        called as ``env(**env_options)``.
      num_envs: number of environments (>= 1).
      env_options: keyword options for every environment (e.g. ``{"max_steps": 50}``).
      num_workers: worker processes (1..num_envs); default ``min(num_envs, os.cpu_count())``.
      timeout_s: the longest one environment operation (a reset, a step, an oracle call) may
        take, in seconds, counted from when its worker could start it (its submit, or the answer to
        the job ahead of it on that worker): a worker that gives no answer for ``timeout_s`` is
        declared hung (so a call over k envs of one worker may last up to k * timeout_s when each
        is slow).
      start_timeout_s: deadline for a worker to build its environments, in seconds.
      hash_seed: ``PYTHONHASHSEED`` of every worker (an int in [0, 4294967295]).

    Raises:
      ValueError: on a bad argument, naming it.
      EnvPoolError: when a worker fails to start (with the worker's error).
    """

    def __init__(
        self,
        env: str | Callable[..., TextEnv],
        num_envs: int,
        env_options: dict[str, Any] | None = None,
        num_workers: int | None = None,
        timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
        hash_seed: int = 0,
    ):
        if not (isinstance(env, str) or callable(env)):
            raise ValueError(f"env must be a registered name or a factory, got {env!r}")
        if not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}")
        if num_workers is None:
            num_workers = min(num_envs, os.cpu_count() or 1)
        if not isinstance(num_workers, int) or not 1 <= num_workers <= num_envs:
            raise ValueError(f"num_workers must be an int in [1, num_envs={num_envs}], got {num_workers!r}")
        for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0 (seconds), got {value!r}")
        if not isinstance(hash_seed, int) or not 0 <= hash_seed <= 4294967295:
            raise ValueError(f"hash_seed must be an int in [0, 4294967295], got {hash_seed!r}")
        if isinstance(env, str) and env not in registered():
            raise ValueError(f"env {env!r} is not registered; known: {registered()}")
        # a name travels as its GameSpec's factory (pickled by reference): workers import the game's module
        factory = game_spec(env).factory if isinstance(env, str) else env
        try:
            self._factory_bytes = pickle.dumps(factory)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"env factory {env!r} is not picklable (use a module-level callable): {e}") from None
        self.env = env
        self.num_envs = num_envs
        self.num_workers = num_workers
        self.env_options = dict(env_options or {})
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.hash_seed = hash_seed
        self.fault_count = 0  # worker replacements so far
        self._workers: list[_Worker | None] = [None] * num_workers
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, 5.0)
        self._task: list[tuple[int, int] | None] = [None] * num_envs
        self._last_obs: list[Observation | None] = [None] * num_envs
        self._running = [False] * num_envs
        self._lost: dict[int, str] = {}  # env -> why its episode was lost
        self._queue: list[collections.deque[_Ticket]] = [collections.deque() for _ in range(num_workers)]
        self._head_since = [0.0] * num_workers  # when each worker could start its first queued job
        self._busy: dict[int, int] = {}  # env -> the ticket of its job in flight
        self._done: dict[int, tuple[Any, BaseException | None]] = {}  # ticket -> (result, the game's exception)
        self._next_ticket = 0
        try:
            pending = [self._launch(w) for w in range(num_workers)]
            for w, worker in enumerate(pending):
                self._await_ready(w, worker)
        except BaseException:
            self.close()
            raise

    # -- worker lifecycle --------------------------------------------------------------------
    def _launch(self, w: int) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, PYTHONHASHSEED=str(self.hash_seed))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from environments.pool import _worker_main; _worker_main()",
                    str(child_sock.fileno()),
                ],
                pass_fds=(child_sock.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                process_group=0,  # own process group (killpg), same session (fair CPU share)
            )
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
        env_ids = list(range(w, self.num_envs, self.num_workers))
        worker = _Worker(proc=proc, conn=conn, env_ids=env_ids)
        self._workers[w] = worker
        conn.send((self._factory_bytes, self.env_options, env_ids, list(sys.path)))
        return worker

    def _await_ready(self, w: int, worker: _Worker) -> None:
        if not worker.conn.poll(self.start_timeout_s):
            _kill(worker)
            raise EnvPoolError(f"worker {w} did not start within start_timeout_s={self.start_timeout_s}")
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.proc.wait(timeout=10)
            raise EnvPoolError(f"worker {w} exited during start (exit code {code})") from None
        if msg[0] == "init_error":
            _kill(worker)
            raise EnvPoolError(f"worker {w} could not build its environments: {_describe(msg[1])}\n{msg[2]}")
        worker.hash_probe = msg[2]

    def _replace(self, w: int, detail: str) -> None:
        old = self._workers[w]
        if old is not None:
            _kill(old)
        self.fault_count += 1
        for i in range(w, self.num_envs, self.num_workers):
            if self._running[i]:
                self._lost[i] = f"lost with worker {w}: {detail}"
            self._running[i] = False
        self._await_ready(w, self._launch(w))

    # -- the job protocol --------------------------------------------------------------------
    def _submit(self, jobs: Sequence[tuple]) -> list[int]:
        """Checks ``jobs`` (step/reset/oracle/task_info), queues them on their workers, returns their tickets."""
        self._check_open()
        self._replace_exited()
        seen: set[int] = set()
        for job in jobs:
            if type(job) not in _COMMANDS:
                raise ValueError(f"submit: a job must be a StepJob or ResetJob, got {job!r}")
            i = job.env
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_envs:
                raise ValueError(f"submit: env index {i!r} out of range [0, {self.num_envs})")
            if i in seen:
                raise ValueError(f"submit: env {i} appears twice in one submit")
            seen.add(i)
            if i in self._busy:
                raise RuntimeError(f"submit: env {i} already has a job in flight (ticket {self._busy[i]})")
            if isinstance(job, StepJob):
                if not isinstance(job.action, str):
                    raise ValueError(f"step: action for env {i} must be a str, got {type(job.action).__name__}")
                if not self._running[i] and i not in self._lost:
                    raise RuntimeError(f"step: env {i} has no running episode (reset it first)")
            elif isinstance(job, ResetJob):
                if any(isinstance(v, bool) or not isinstance(v, int) for v in (job.task_id, job.seed)):
                    raise ValueError(
                        f"reset: task_id and seed of env {i} must be ints, got {job.task_id!r}, {job.seed!r}"
                    )
        tickets, by_worker = [], {}
        for job in jobs:
            t = _Ticket(self._next_ticket, job, _COMMANDS[type(job)])
            self._next_ticket += 1
            tickets.append(t.ticket)
            self._busy[job.env] = t.ticket
            if isinstance(job, ResetJob):  # until this reset succeeds, the env has no episode
                self._running[job.env] = False
                self._lost.pop(job.env, None)
            elif isinstance(job, StepJob) and job.env in self._lost:  # its episode is already over
                self._finish(t, Fault.LOST, self._lost.pop(job.env))
                continue
            by_worker.setdefault(job.env % self.num_workers, []).append(t)
        now = time.monotonic()
        for w, queued in by_worker.items():
            if not self._queue[w]:
                self._head_since[w] = now
            self._queue[w].extend(queued)
            try:
                self._workers[w].conn.send([(t.cmd, tuple(t.job)) for t in queued])
            except (OSError, ValueError) as e:
                self._fault(w, Fault.CRASH, f"worker {w} unreachable ({_describe(e)})")
        return tickets

    def _pump(self, wait_s: float | None, enough: Callable[[], bool]) -> None:
        """Takes in the workers' answers and declares hung or dead workers, until ``enough()``, no job
        is in flight, or ``wait_s`` seconds pass (None: no limit; 0: only what is already there)."""
        end = None if wait_s is None else time.monotonic() + wait_s
        while True:
            # answers first: a job answered while the host was busy elsewhere is an answer, never a hang
            conns = {self._workers[w].conn: w for w, queue in enumerate(self._queue) if queue}
            for conn in wait(list(conns), timeout=0) if conns else ():
                self._drain(conns[conn], conn)
            now = time.monotonic()
            for w, queue in enumerate(self._queue):
                if queue and self._head_since[w] + self.timeout_s <= now:
                    if self._workers[w].conn.poll():  # answered since the drain above
                        self._drain(w, self._workers[w].conn)
                        continue
                    cmd = queue[0].cmd
                    self._fault(w, Fault.TIMEOUT, f"worker {w} did not answer {cmd} within timeout_s={self.timeout_s}")
            if enough() or not any(self._queue):
                return
            now = time.monotonic()
            if end is not None and now >= end:
                return
            wake = min(self._head_since[w] + self.timeout_s for w, queue in enumerate(self._queue) if queue) - now
            if end is not None:
                wake = min(wake, end - now)
            wait([self._workers[w].conn for w, queue in enumerate(self._queue) if queue], timeout=max(wake, 0.0))

    def _drain(self, w: int, conn: Connection) -> None:
        """Reads the answers already sent by worker ``w`` (each settles its oldest queued job)."""
        queue = self._queue[w]
        try:
            while queue:
                status, value, _tb, answered_at = conn.recv()
                t = queue.popleft()
                self._head_since[w] = answered_at  # the next job's time started with this answer
                if status == "ok":
                    self._finish(t, "ok", value)
                else:
                    self._finish(t, Fault.EXCEPTION, f"env {t.job.env} raised {_describe(value)}", value)
                if not conn.poll():
                    break
        except (EOFError, OSError):
            cmd = queue[0].cmd
            self._fault(w, Fault.CRASH, f"worker {w} died during {cmd} (exit code {self._exit_code(w)})")

    def _fault(self, w: int, kind: Fault, detail: str) -> None:
        """Worker ``w`` hung or died serving its oldest queued job: that job gets ``kind``, the jobs
        queued behind it are lost, and the worker is replaced (its other episodes end)."""
        queued = list(self._queue[w])
        self._queue[w].clear()
        for k, t in enumerate(queued):
            self._finish(t, kind, detail) if k == 0 else self._finish(t, Fault.LOST, f"lost with worker {w}: {detail}")
        self._replace(w, detail)

    def _finish(self, t: _Ticket, status, value, exc: BaseException | None = None) -> None:
        """Books job ``t``'s outcome (("ok", answer) or (fault, detail)) as its typed result."""
        i = t.job.env
        del self._busy[i]
        ok = status == "ok"
        if t.cmd == "step":
            if ok:
                obs, reward, done, info = value
                self._last_obs[i] = obs
                self._running[i] = not done
                result = StepResult(obs, reward, done, info)
            else:
                self._lost.pop(i, None)  # reported now, not again
                result = self._error_result(i, status, value)
        elif t.cmd == "reset":
            if ok:
                self._task[i], self._last_obs[i], self._running[i] = (t.job.task_id, t.job.seed), value, True
                result = ResetResult(value, {})
            else:
                result = self._error_result(i, status, value, reset=True)
        elif t.cmd == "task_info":
            result = TaskInfoResult(value) if ok else TaskInfoResult({}, Fault(status), value)
        elif t.cmd == "restore":
            if ok:
                snap = t.job.snapshot
                self._task[i], self._last_obs[i], self._running[i] = (snap.task_id, snap.seed), value, True
                result = ForkResult(value)
            else:
                self._running[i] = False
                result = ForkResult(Observation(text="", anchor="", task=""), Fault(status), value)
        else:
            result = value if ok else None
        self._done[t.ticket] = (result, exc)

    def _run(self, jobs: Sequence[tuple]) -> list[tuple[Any, BaseException | None]]:
        """Submits ``jobs`` and waits for their own results, in order (other tickets stay for ``poll``)."""
        tickets = self._submit(jobs)
        self._pump(None, lambda: all(t in self._done for t in tickets))
        return [self._done.pop(t) for t in tickets]

    def _group(self, env_indices: Sequence[int], what: str) -> list[int]:
        idx = [int(i) for i in env_indices]
        for i in idx:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"{what}: env index {i} out of range [0, {self.num_envs})")
        if len(set(idx)) != len(idx):
            raise ValueError(f"{what}: env_indices must not repeat, got {list(env_indices)}")
        return idx

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("EnvPool is closed")

    def _exit_code(self, w: int) -> int | None:
        try:  # a closed socket can come before the exit status (e.g. while a core is written)
            return self._workers[w].proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None

    def _replace_exited(self) -> None:
        """Replace idle workers that died between jobs (killed, OOM): no env's job is to blame."""
        self._check_open()
        for w, worker in enumerate(self._workers):
            code = worker.proc.poll()
            if code is not None and not self._queue[w]:
                self._replace(w, f"worker {w} had exited (exit code {code})")

    # -- public API --------------------------------------------------------------------------
    def submit(self, jobs: Sequence[StepJob | ResetJob]) -> list[int]:
        """Starts ``jobs`` and returns one ticket (an int, never reused) per job, without waiting.

        Each job's result comes back once, from ``poll`` (a ``StepResult`` for a ``StepJob``, a
        ``ResetResult`` for a ``ResetJob``, with the same fault fields as ``step`` / ``reset``; a
        reset's task-group check and its retry of lost resets are ``reset``'s, not ``submit``'s). A step
        of an env whose episode was lost with a replaced worker is answered at once (``Fault.LOST``).

        Raises (before anything is sent):
          ValueError: a job of another type, an env index out of range or repeated, a non-str action,
            a non-int task id or seed.
          RuntimeError: an env already has a job in flight, a ``StepJob``'s env has no running
            episode, or the pool is closed.
        """
        for job in jobs:
            if not isinstance(job, (StepJob, ResetJob)):
                raise ValueError(f"submit: a job must be a StepJob or ResetJob, got {job!r}")
        return self._submit(list(jobs))

    def poll(self, timeout: float | None = 0.0) -> list[tuple[int, StepResult | ResetResult]]:
        """The ``(ticket, result)`` of every submitted job settled since the last ``poll``, by ticket.

        ``timeout``: seconds to wait for at least one result when none is ready (0: do not wait;
        None: until one is, unless nothing is in flight). A worker past its job's ``timeout_s`` is
        declared hung here (its jobs settle as faults), so call ``poll`` while jobs are in flight.

        Raises:
          ValueError: a negative ``timeout``.
          EnvPoolError: a faulted worker cannot be restarted.
        """
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"poll: timeout must be None or a number >= 0 (seconds), got {timeout!r}")
        self._check_open()
        self._pump(timeout, lambda: bool(self._done))
        out = [(t, self._done[t][0]) for t in sorted(self._done)]
        self._done.clear()
        return out

    @property
    def in_flight(self) -> int:
        """Jobs submitted whose results ``poll`` has not returned yet."""
        return len(self._busy) + len(self._done)

    def reset(self, env_indices: Sequence[int], task_ids: Sequence[int], seeds: Sequence[int]) -> list[ResetResult]:
        """Reset env ``env_indices[k]`` to task ``task_ids[k]`` with seed ``seeds[k]``; results in order.

        A fault never raises: the env whose reset hung, crashed its worker or raised gets
        ``ResetResult(empty obs, {}, fault, detail)`` and no episode;
        the other envs of a replaced worker are reset again on the fresh one, so their results
        are real. Retrying a faulted game (e.g. on another seed) is the caller's choice.

        Raises:
          ValueError: on mismatched lengths, bad or repeated indices, or the game's own
            ValueError (e.g. a task id out of range), re-raised with the env index.
          RuntimeError: an env has a job in flight (from ``submit``).
          EnvPoolError: when envs of one task group (same task id and seed) show different
            initial observations (the game is not deterministic), or a worker cannot restart.
        """
        idx = self._group(env_indices, "reset")
        if not (len(task_ids) == len(idx) == len(seeds)):
            raise ValueError(
                f"reset: env_indices, task_ids and seeds must have equal lengths, got "
                f"{len(idx)}, {len(task_ids)}, {len(seeds)}"
            )
        jobs = {i: ResetJob(i, int(t), int(s)) for i, t, s in zip(idx, task_ids, seeds)}
        results: dict[int, ResetResult] = {}
        todo = list(idx)
        while todo:  # each round settles at least one env per faulted worker (its culprit)
            for i, (res, exc) in zip(todo, self._run([jobs[i] for i in todo])):
                if res.fault is Fault.EXCEPTION and isinstance(exc, ValueError):
                    raise ValueError(f"reset of env {i}: {exc}") from exc
                results[i] = res
            # an innocent bystander (lost, or reset before its worker was replaced): reset again
            todo = [i for i in idx if results[i].fault is Fault.LOST or (results[i].ok and not self._running[i])]
        groups: dict[tuple[int, int], list[int]] = {}
        for i in idx:
            if results[i].ok:
                groups.setdefault(jobs[i][1:], []).append(i)
        for (task_id, seed), members in groups.items():
            first = results[members[0]].obs
            differ = [i for i in members if results[i].obs != first]
            if differ:
                raise EnvPoolError(
                    f"task group (task_id={task_id}, seed={seed}): initial observations of envs "
                    f"{differ} differ from env {members[0]}'s; the game is not deterministic for a seed"
                )
        return [results[i] for i in idx]

    def step(self, env_indices: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        """Step env ``env_indices[k]`` with ``actions[k]``; results in the same order.

        A fault ends the episode and never raises: ``StepResult(last observation, 0.0, True, {}, fault,
        detail)``.

        Raises:
          ValueError: on mismatched lengths, bad or repeated indices, or a non-str action.
          RuntimeError: when an env has no running episode (never reset, or already done), or has a
            job in flight (from ``submit``).
        """
        idx = self._group(env_indices, "step")
        if len(actions) != len(idx):
            raise ValueError(f"step: env_indices and actions must have equal lengths, got {len(idx)}, {len(actions)}")
        return [res for res, _ in self._run([StepJob(i, a) for i, a in zip(idx, actions)])]

    def _error_result(self, i: int, kind: Fault, detail: str, reset: bool = False):
        self._running[i] = False
        if reset:
            return ResetResult(Observation(text="", anchor="", task=""), {}, Fault(kind), detail)
        obs = self._last_obs[i]
        if obs is None:
            obs = Observation(text="", anchor="", task="")
        return StepResult(obs, 0.0, True, {}, Fault(kind), detail)

    def oracle_actions(self, env_indices: Sequence[int]) -> list[str | None]:
        """The expert's next action of each env from its current state (None without one or on a fault)."""
        idx = self._group(env_indices, "oracle_actions")
        self._replace_exited()
        asked = [i for i in idx if self._running[i]]
        answers = dict(zip(asked, (res for res, _ in self._run([_OracleJob(i) for i in asked]))))
        return [answers.get(i) for i in idx]

    def task_info(self, env_indices: Sequence[int]) -> list[TaskInfoResult]:
        """``task_info`` of each env's current task (from its last reset), as ``TaskInfoResult``s.

        A fault never raises: the env's entry is ``TaskInfoResult({}, fault, detail)`` (for a
        timeout, crash or loss its running episode ended with the worker).

        Raises RuntimeError when an env was never reset.
        """
        idx = self._group(env_indices, "task_info")
        for i in idx:
            if self._task[i] is None:
                raise RuntimeError(f"task_info: env {i} was never reset")
        return [res for res, _ in self._run([_TaskInfoJob(i, self._task[i][0]) for i in idx])]

    def fork(self, parent: int, children: Sequence[int]) -> list[ForkResult]:
        """Puts each of ``children`` in ``parent``'s running episode; results in order.

        The parent's game gives an ``EnvSnapshot`` (``TextEnv.snapshot``: its deep-copied state, or its
        action prefix for a replay from the same reset seed), each child's game restores it
        (``TextEnv.restore``, which checks a replay observation by observation) and runs on from there
        on its own. The parent plays on unchanged. A fault never raises: a faulted snapshot faults every
        child, a faulted restore that child (``ForkResult`` with ``fault`` set, no running episode).

        Raises:
          ValueError: a bad or repeated index, or ``parent`` among ``children``.
          RuntimeError: ``parent`` has no running episode, or an env has a job in flight.
          ReplayDivergedError: a child's game did not reach the parent's state (named, with both envs).
        """
        kids = self._group([parent, *children], "fork")[1:]
        self._replace_exited()
        if not self._running[parent]:
            raise RuntimeError(f"fork: env {parent} has no running episode")
        [(snap, exc)] = self._run([_SnapshotJob(parent)])
        if snap is None:  # the parent's worker raised, hung or died: no state to give
            why = f"fork: snapshot of env {parent} failed" + (f": {_describe(exc)}" if exc is not None else "")
            return [ForkResult(Observation(text="", anchor="", task=""), Fault.EXCEPTION, why) for _ in kids]
        out = []
        for i, (res, exc) in zip(kids, self._run([_RestoreJob(i, snap) for i in kids])):
            if isinstance(exc, ReplayDivergedError):
                raise ReplayDivergedError(f"fork of env {parent} into env {i}: {exc}") from exc
            out.append(res)
        return out

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a worker is replaced)."""
        self._check_open()
        return [w.proc.pid for w in self._workers]

    def worker_hash_probes(self) -> list[int]:
        """``hash("bipace")`` as computed in each worker: equal for equal ``hash_seed``."""
        self._check_open()
        return [w.hash_probe for w in self._workers]

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker: a polite "close", then SIGKILL to each process group after ``grace_s`` seconds.

        Idempotent; also runs when the pool is garbage-collected or the interpreter exits.
        """
        if self._finalizer.detach() is not None:
            _shutdown(self._workers, grace_s)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.num_envs
