"""EnvPool: N text environments in worker processes, stepped in batches, surviving faults.

Workers are fresh Python interpreters (like multiprocessing's ``spawn``; never ``fork``, which
is unsafe in a process running JAX threads), started with ``subprocess`` so that

* each worker gets a fixed ``PYTHONHASHSEED`` (default 0): games whose text depends on set or
  dict-of-str order are deterministic across workers and runs;
* the parent's ``__main__`` (e.g. the trainer, with JAX loaded) is not re-imported in workers,
  as multiprocessing's spawn and forkserver would do;
* each worker leads its own process group (in the parent's session), so a kill also ends
  anything it started.

They talk to the parent over a socket pair with ``multiprocessing.connection.Connection``
(pickled messages). Environment ``i`` lives on worker ``i % num_workers``. One call sends one
message per involved worker; each worker answers env by env, and must answer each within
``timeout_s``.

Faults: a worker that dies (crash, OOM kill) or does not answer within ``timeout_s`` is killed
(its whole process group) and replaced by a fresh one; the env it was serving and those queued
after it in that call end their episodes with ``done=True``, reward 0 and ``info["env_error"]``
set; its other envs (answered before the fault, or not in the call) lost their episodes too and
report the same on their next ``step``. A Python exception inside a game's
``step`` ends that env's episode the same way, without replacing the worker. Nothing is
silently dropped: every requested env gets a result, and ``env_error`` marks every faulted one.

Not thread-safe: use one pool from one thread.
"""

from __future__ import annotations

import dataclasses
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

from environments.base import Observation, TextEnv, make, registered

__all__ = ["EnvPool", "StepResult", "EnvPoolError"]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StepResult(NamedTuple):
    """One env's step: ``(obs, reward, done, info)``; ``info["env_error"]`` (str) on a fault."""

    obs: Observation
    reward: float
    done: bool
    info: dict[str, Any]


class EnvPoolError(RuntimeError):
    """A pool-level failure: a worker cannot start, or a reset fails even on a fresh worker."""


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
        spec_bytes, options, env_ids, parent_path = conn.recv()
        for entry in parent_path:
            if entry not in sys.path:
                sys.path.append(entry)
        spec = pickle.loads(spec_bytes)
        if isinstance(spec, str):
            envs: dict[int, TextEnv] = {i: make(spec, **options) for i in env_ids}
        else:
            envs = {i: spec(**options) for i in env_ids}
    except BaseException as e:  # noqa: BLE001
        conn.send(("init_error", _portable(e), traceback.format_exc()))
        return
    conn.send(("ready", os.getpid(), hash("bipace")))
    while True:
        try:
            cmd, payload = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if cmd == "close":
            return
        for item in payload:
            try:
                if cmd == "step":
                    i, action = item
                    obs, reward, done, info = envs[i].step(action)
                    reply = ("ok", (obs, float(reward), bool(done), dict(info)))
                elif cmd == "reset":
                    i, task_id, seed = item
                    reply = ("ok", envs[i].reset(task_id, seed))
                elif cmd == "oracle":
                    fn = getattr(envs[item], "oracle_action", None)
                    reply = ("ok", fn() if fn is not None else None)
                elif cmd == "task_info":
                    i, task_id = item
                    reply = ("ok", envs[i].task_info(task_id))
                else:
                    raise ValueError(f"unknown command {cmd!r}")
            except Exception as e:  # noqa: BLE001  (reported to the parent, never kills the worker)
                reply = ("error", _portable(e), traceback.format_exc())
            try:
                conn.send(reply)  # pickles fully before writing: a pickling error leaves the stream intact
            except (TypeError, AttributeError, pickle.PicklingError) as e:
                err = RuntimeError(f"{cmd} result could not be sent to the parent: {_describe(e)}")
                conn.send(("error", err, ""))


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
            w.conn.send(("close", None))
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
      env: a registered environment name (``environments.make``) or a picklable factory
        (a module-level callable, e.g. a ``TextEnv`` subclass) called as ``env(**env_options)``.
      num_envs: number of environments (>= 1).
      env_options: keyword options for every environment (e.g. ``{"max_steps": 50}``).
      num_workers: worker processes (1..num_envs); default ``min(num_envs, os.cpu_count())``.
      timeout_s: the longest one environment operation (a reset, a step, an oracle call) may
        take, in seconds: a worker that gives no answer for ``timeout_s`` is declared hung (so a
        call over k envs of one worker may last up to k * timeout_s when each is slow).
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
        if isinstance(env, str):
            if env not in registered():
                raise ValueError(f"env {env!r} is not registered; known: {registered()}")
        try:
            self._spec_bytes = pickle.dumps(env)
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
        conn.send((self._spec_bytes, self.env_options, env_ids, list(sys.path)))
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

    def _replace(self, w: int, reason: str) -> None:
        old = self._workers[w]
        if old is not None:
            _kill(old)
        self.fault_count += 1
        for i in range(w, self.num_envs, self.num_workers):
            if self._running[i]:
                self._lost[i] = reason
            self._running[i] = False
        self._await_ready(w, self._launch(w))

    # -- the call protocol -------------------------------------------------------------------
    def _call(self, cmd: str, items: dict[int, list]) -> tuple[dict[int, list], dict[int, str]]:
        """Send ``items`` (worker -> payload list) and collect one reply per payload entry.

        Workers answer entry by entry; a worker is declared hung when ``timeout_s`` passes
        without its next answer, dead when its connection closes. Returns (replies, faults):
        ``replies[w]`` holds the answers received (all of them unless ``w`` is in ``faults``,
        then the answers before the fault). Faulted workers are NOT replaced here: the caller
        records the answers, then calls ``_replace_faulted``.
        """
        self._check_open()
        replies: dict[int, list] = {w: [] for w in items}
        faults: dict[int, str] = {}
        pending: dict[Connection, int] = {}
        deadline: dict[int, float] = {}
        for w, payload in items.items():
            worker = self._workers[w]
            try:
                worker.conn.send((cmd, payload))
            except (OSError, ValueError) as e:
                faults[w] = f"worker {w} unreachable ({_describe(e)})"
                continue
            if payload:
                pending[worker.conn] = w
                deadline[w] = time.monotonic() + self.timeout_s
        while pending:
            now = time.monotonic()
            for conn, w in list(pending.items()):
                if deadline[w] <= now:
                    del pending[conn]
                    faults[w] = f"worker {w} did not answer {cmd} within timeout_s={self.timeout_s}"
            if not pending:
                break
            wake = min(deadline[w] for w in pending.values()) - now
            for conn in wait(list(pending), timeout=max(wake, 0.0)):
                w = pending[conn]
                try:
                    while True:  # drain what is already there
                        replies[w].append(conn.recv())
                        if len(replies[w]) == len(items[w]) or not conn.poll():
                            break
                except (EOFError, OSError):
                    code = self._workers[w].proc.poll()
                    faults[w] = f"worker {w} died during {cmd} (exit code {code})"
                    del pending[conn]
                    continue
                deadline[w] = time.monotonic() + self.timeout_s
                if len(replies[w]) == len(items[w]):
                    del pending[conn]
        return replies, faults

    def _replace_faulted(self, faults: dict[int, str]) -> None:
        for w, reason in faults.items():
            self._replace(w, reason)

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

    # -- public API --------------------------------------------------------------------------
    def reset(self, env_indices: Sequence[int], task_ids: Sequence[int], seeds: Sequence[int]) -> list[Observation]:
        """Reset env ``env_indices[k]`` to task ``task_ids[k]`` with seed ``seeds[k]``; observations in order.

        A worker fault during reset is retried once on a fresh worker.

        Raises:
          ValueError: on mismatched lengths, bad or repeated indices, or the game's own
            ValueError (e.g. a task id out of range), re-raised with the env index.
          EnvPoolError: when a reset fails again on a fresh worker, or when envs of one task
            group (same task id and seed) show different initial observations.
        """
        idx = self._group(env_indices, "reset")
        if not (len(task_ids) == len(idx) == len(seeds)):
            raise ValueError(
                f"reset: env_indices, task_ids and seeds must have equal lengths, got "
                f"{len(idx)}, {len(task_ids)}, {len(seeds)}"
            )
        jobs = {i: (i, int(t), int(s)) for i, t, s in zip(idx, task_ids, seeds)}
        for i in idx:  # until this reset succeeds, these envs have no episode
            self._running[i] = False
            self._lost.pop(i, None)
        results: dict[int, Observation] = {}
        todo = list(idx)
        for attempt in range(2):
            by_worker: dict[int, list] = {}
            for i in todo:
                by_worker.setdefault(i % self.num_workers, []).append(jobs[i])
            replies, faults = self._call("reset", by_worker)
            self._replace_faulted(faults)  # a reset retries on the fresh worker
            todo = []
            for w, payload in by_worker.items():
                if w in faults:
                    if attempt == 1:
                        raise EnvPoolError(f"reset of envs {[j[0] for j in payload]} failed twice: {faults[w]}")
                    todo.extend(j[0] for j in payload)
                    continue
                for (i, _, _), (status, value, *tb) in zip(payload, replies[w]):
                    if status == "error":
                        self._running[i] = False
                        if isinstance(value, ValueError):
                            raise ValueError(f"reset of env {i}: {value}") from value
                        raise EnvPoolError(f"reset of env {i} raised {_describe(value)}\n{tb[0]}")
                    results[i] = value
            if not todo:
                break
        for i in idx:
            self._task[i] = jobs[i][1:]
            self._last_obs[i] = results[i]
            self._running[i] = True
            self._lost.pop(i, None)
        groups: dict[tuple[int, int], list[int]] = {}
        for i in idx:
            groups.setdefault(self._task[i], []).append(i)
        for (task_id, seed), members in groups.items():
            first = results[members[0]]
            differ = [i for i in members if results[i] != first]
            if differ:
                raise EnvPoolError(
                    f"task group (task_id={task_id}, seed={seed}): initial observations of envs "
                    f"{differ} differ from env {members[0]}'s; the game is not deterministic for a seed"
                )
        return [results[i] for i in idx]

    def step(self, env_indices: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
        """Step env ``env_indices[k]`` with ``actions[k]``; results in the same order.

        A fault ends the episode: ``StepResult(last observation, 0.0, True, {"env_error": why})``.

        Raises:
          ValueError: on mismatched lengths, bad or repeated indices, or a non-str action.
          RuntimeError: when an env has no running episode (never reset, or already done).
        """
        idx = self._group(env_indices, "step")
        if len(actions) != len(idx):
            raise ValueError(f"step: env_indices and actions must have equal lengths, got {len(idx)}, {len(actions)}")
        for i, a in zip(idx, actions):
            if not isinstance(a, str):
                raise ValueError(f"step: action for env {i} must be a str, got {type(a).__name__}")
            if not self._running[i] and i not in self._lost:
                raise RuntimeError(f"step: env {i} has no running episode (reset it first)")
        out: dict[int, StepResult] = {}
        for i in idx:
            if i in self._lost:
                out[i] = self._error_result(i, self._lost.pop(i))
        by_worker: dict[int, list] = {}
        for i, a in zip(idx, actions):
            if i not in out:
                by_worker.setdefault(i % self.num_workers, []).append((i, a))
        replies, faults = self._call("step", by_worker)
        for w, payload in by_worker.items():
            answered = replies[w]
            for (i, _), (status, value, *_tb) in zip(payload, answered):
                if status == "error":
                    out[i] = self._error_result(i, f"env {i} raised {_describe(value)}")
                    continue
                obs, reward, done, info = value
                self._last_obs[i] = obs
                self._running[i] = not done
                out[i] = StepResult(obs, reward, done, info)
            for i, _ in payload[len(answered) :]:  # the env that hung or crashed, and those after it
                out[i] = self._error_result(i, faults[w])
        # envs whose step completed on a faulted worker lost their episode with it: their next
        # step reports env_error (marked by _replace)
        self._replace_faulted(faults)
        return [out[i] for i in idx]

    def _error_result(self, i: int, why: str) -> StepResult:
        self._running[i] = False
        obs = self._last_obs[i]
        if obs is None:
            obs = Observation(text="", anchor="", task="")
        return StepResult(obs, 0.0, True, {"env_error": why})

    def oracle_actions(self, env_indices: Sequence[int]) -> list[str | None]:
        """The expert's next action of each env from its current state (None without one or on a fault)."""
        idx = self._group(env_indices, "oracle_actions")
        by_worker: dict[int, list] = {}
        for i in idx:
            if self._running[i]:
                by_worker.setdefault(i % self.num_workers, []).append(i)
        replies, faults = self._call("oracle", by_worker)
        self._replace_faulted(faults)
        out: dict[int, str | None] = {i: None for i in idx}
        for w, payload in by_worker.items():
            if w in faults:
                continue  # its envs lost their episodes: no expert action
            for i, (status, value, *_) in zip(payload, replies[w]):
                out[i] = value if status == "ok" else None
        return [out[i] for i in idx]

    def task_info(self, env_indices: Sequence[int]) -> list[dict[str, Any]]:
        """``task_info`` of each env's current task (from its last reset).

        Raises RuntimeError when an env was never reset, EnvPoolError when a worker fails.
        """
        idx = self._group(env_indices, "task_info")
        by_worker: dict[int, list] = {}
        for i in idx:
            if self._task[i] is None:
                raise RuntimeError(f"task_info: env {i} was never reset")
            by_worker.setdefault(i % self.num_workers, []).append((i, self._task[i][0]))
        replies, faults = self._call("task_info", by_worker)
        self._replace_faulted(faults)
        if faults:
            raise EnvPoolError(f"task_info failed: {faults}")
        out: dict[int, dict] = {}
        for w, payload in by_worker.items():
            for (i, _), (status, value, *_tb) in zip(payload, replies[w]):
                if status == "error":
                    raise EnvPoolError(f"task_info of env {i} raised {_describe(value)}")
                out[i] = value
        return [out[i] for i in idx]

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
