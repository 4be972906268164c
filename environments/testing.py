"""A tiny deterministic text game whose actions can crash, hang or raise: the pool's test fixture.

Not registered with ``make``: pass the class itself to ``EnvPool`` (a picklable factory). Also
``InstantPool``, in-process fake games behind the pool's interface, for the rollout loop's tests and
benchmarks, and ``DriftEnv``, a game that is not deterministic for its seed (a fork's replay diverges).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import time
from typing import Any

from environments.base import Observation, TextEnv
from environments.pool import ResetResult, StepResult, TaskInfoResult
from environments.registry import make


class FaultyEnv(TextEnv):
    """A counting game with fault injection (for ``EnvPool`` tests and benchmarks).

    ``reset(task_id, seed)`` shows ``"task {task_id} seed {seed} step 0"``. Actions:
    ``"win"`` ends with reward 1.0; ``"crash"`` kills the process (``os._exit``); ``"segv"``
    dereferences a null pointer (a real segfault); ``"hang"`` sleeps for an hour; ``"raise"``
    raises RuntimeError; ``"nan"`` / ``"inf"`` / ``"text"`` score the step NaN / inf / ``"high"``
    (unscorable rewards: ``TextEnv.step`` refuses them); ``"hash"`` shows ``hash("bipace")``
    (to check PYTHONHASHSEED); ``"pid"`` shows the process id; ``"unpicklable"`` returns an
    info dict holding a lambda; ``"nap"`` sleeps 0.8 s, then counts like any other action; any other action advances the
    counter: ``"task T seed S step N: <action>"``. Seeds with special meaning in ``reset``:
    -1 hangs, -2 crashes, -3 crashes once per ``marker_dir`` (the first reset creates the marker,
    then crashes), -4 gives a per-process observation (breaks task-group equality), -5 raises
    ValueError, -6 raises RuntimeError, -7 segfaults. ``task_info`` of task 99 hangs, of task 98
    raises. ``step_cost_ms`` makes every step busy the CPU that long (a synthetic slow game
    for benchmarks, e.g. 36 ms like an ALFWorld step). ``split="valid"`` is a 7-task game whose
    ``task_info`` has ``task_type="valid"`` and ``depth="valid"`` (for validation panels drawn from
    another split).
    """

    def __init__(
        self, max_steps: int = 20, marker_dir: str | None = None, step_cost_ms: float = 0.0, split: str = "train"
    ):
        super().__init__(max_steps)
        if split not in ("train", "valid"):
            raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
        self.split = split
        self.marker_dir = marker_dir
        self.step_cost_ms = float(step_cost_ms)
        self._task = (0, 0)
        self._count = 0

    @property
    def num_tasks(self) -> int:
        return 100 if self.split == "train" else 7

    def task_info(self, task_id: int) -> dict[str, Any]:
        if self.split == "valid":
            # depth too: a run configured as TextCraft splits validation by depth (its GameSpec.categories)
            return {"task": int(task_id), "task_type": "valid", "depth": "valid"}
        if task_id == 99:
            time.sleep(3600)
        if task_id == 98:
            raise RuntimeError("injected task_info error")
        return {"task": int(task_id), "parity": int(task_id) % 2}

    def _obs(self, text: str, won: bool = False) -> Observation:
        return Observation(text=text, anchor=text, task=f"task {self._task[0]}", won=won)

    def _reset(self, task_id: int, seed: int) -> Observation:
        if seed == -1:
            time.sleep(3600)
        if seed == -2:
            os._exit(2)
        if seed == -3 and self.marker_dir is not None:
            marker = os.path.join(self.marker_dir, "crashed_once")
            try:  # atomic: of workers racing here, exactly one crashes
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os._exit(3)
        if seed == -5:
            raise ValueError("injected reset error")
        if seed == -6:
            raise RuntimeError("injected reset error")
        if seed == -7:
            ctypes.string_at(0)
        self._task = (task_id, seed)
        self._count = 0
        if seed == -4:
            return self._obs(f"task {task_id} pid {os.getpid()}")
        return self._obs(f"task {task_id} seed {seed} step 0")

    def _step(self, action: str):
        if self.step_cost_ms > 0:
            end = time.process_time() + self.step_cost_ms / 1000.0
            while time.process_time() < end:
                pass
        if action in ("crash", "segv", "hang", "raise"):
            _fire(action, "injected step error")
        if action == "nap":
            time.sleep(0.8)
        if action in ("nan", "inf", "text"):
            return (
                self._obs(f"scored {action}"),
                {"nan": float("nan"), "inf": float("inf"), "text": "high"}[action],
                False,
                {},
            )
        if action == "unpicklable":
            return self._obs("returns a lambda"), 0.0, False, {"f": lambda: 0}
        if action == "win":
            return self._obs("you win", won=True), 1.0, True, {}
        if action == "hash":
            return self._obs(str(hash("bipace"))), 0.0, False, {}
        if action == "pid":
            return self._obs(str(os.getpid())), 0.0, False, {}
        self._count += 1
        t, s = self._task
        return self._obs(f"task {t} seed {s} step {self._count}: {action}"), 0.0, False, {"count": self._count}

    def oracle_action(self) -> str:
        return "win"


FAULT_KINDS = ("hang", "raise", "crash", "segv", "sigkill")
_CALLS = ("reset", "step")


class _Wrapper(TextEnv):
    """A registered game around another one (``inner``), whose tasks, task infos and oracle it keeps."""

    def __init__(self, game: str, **options):
        self.inner = make(game, **options)
        super().__init__(self.inner.max_steps)

    @property
    def num_tasks(self) -> int:
        return self.inner.num_tasks

    def task_info(self, task_id: int) -> dict[str, Any]:
        return self.inner.task_info(task_id)

    def oracle_action(self):
        return self.inner.oracle_action()


class ChaosEnv(_Wrapper):
    """A registered game with faults injected on a schedule (for rollout tests and ``launch.chaos``).

    ``plan_dir/plan.json`` lists faults ``{"id": str, "call": "reset" | "step", "at": n, "kind": k}``:
    the n-th call (1-based) of that kind, counted over every ChaosEnv of the plan (all workers, and
    across worker replacements and restarts: the counters live in ``plan_dir``), fires fault k
    (``FAULT_KINDS``: sleep an hour, raise RuntimeError, ``os._exit(1)``, a null-pointer read,
    SIGKILL of its own worker). Each fault fires once; firing writes ``plan_dir/fired/<id>.json``
    with the call, the task id, seed and step. Without a ``plan.json`` nothing fires.
    """

    def __init__(self, game: str, plan_dir: str, **options):
        super().__init__(game, **options)
        self.plan_dir = plan_dir
        self._task: tuple[int, int] = (-1, -1)
        self._step_index = 0

    def _tick(self, call: str) -> None:
        plan_path = os.path.join(self.plan_dir, "plan.json")
        if not os.path.exists(plan_path):
            return
        with open(os.path.join(self.plan_dir, "counters.lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # workers count together
            counters_path = os.path.join(self.plan_dir, "counters.json")
            counters = {c: 0 for c in _CALLS}
            if os.path.exists(counters_path):
                with open(counters_path) as f:
                    counters.update(json.load(f))
            counters[call] += 1
            with open(counters_path, "w") as f:
                json.dump(counters, f)
            with open(plan_path) as f:
                plan = json.load(f)
            due = [p for p in plan if p["call"] == call and p["at"] == counters[call]]
            fired_dir = os.path.join(self.plan_dir, "fired")
            os.makedirs(fired_dir, exist_ok=True)
            record = {"call": call, "at": counters[call], "task_id": self._task[0], "seed": self._task[1]}
            record.update(step=self._step_index, pid=os.getpid(), time=time.time())
            for p in due:
                with open(os.path.join(fired_dir, f"{p['id']}.json"), "w") as f:
                    json.dump(dict(record, id=p["id"], kind=p["kind"]), f)
        for p in due:
            _fire(p["kind"])

    def reset(self, task_id: int, seed: int) -> Observation:
        self._task, self._step_index = (int(task_id), int(seed)), 0
        self._tick("reset")
        obs = self.inner.reset(task_id, seed)
        self._done = False
        return obs

    def step(self, action: str):
        self._tick("step")
        self._step_index += 1
        return self.inner.step(action)

    def _reset(self, task_id: int, seed: int) -> Observation:  # reset/step delegate whole
        raise NotImplementedError

    def _step(self, action: str):
        raise NotImplementedError


class UnscorableEnv(_Wrapper):
    """A registered game whose scorer fails on one task (for tests of ``TextEnv.step``'s reward check):
    every step of task ``task_id`` scores ``reward`` (NaN by default; inf, or a non-number such as
    ``"high"``), every other task scores as the game does.
    """

    def __init__(self, game: str, task_id: int, reward: Any = float("nan"), **options):
        super().__init__(game, **options)
        self.task_id, self.reward = int(task_id), reward

    def _reset(self, task_id: int, seed: int) -> Observation:
        return self.inner.reset(task_id, seed)

    def _step(self, action: str):
        obs, reward, done, info = self.inner.step(action)
        return obs, self.reward if self._task_id == self.task_id else reward, done, info


def _fire(kind: str, message: str = "injected fault") -> None:
    """Fires the fault ``kind`` of ``FAULT_KINDS`` in this process (``"raise"``: RuntimeError(message))."""
    if kind == "hang":
        time.sleep(3600)
    elif kind == "raise":
        raise RuntimeError(message)
    elif kind == "crash":
        os._exit(1)
    elif kind == "segv":
        ctypes.string_at(0)
    elif kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")


class DriftEnv(TextEnv):
    """Not deterministic for its seed: a step's text counts this instance's resets, so a replay in another
    env (reset once more) shows another observation."""

    def __init__(self, max_steps=5):
        super().__init__(max_steps)
        self.resets = 0

    @property
    def num_tasks(self):
        return 4

    def _reset(self, task_id, seed):
        self.resets += 1
        return Observation(text="start", anchor="start", task="drift")

    def _step(self, action):
        text = f"moved after {self.resets} resets"
        return Observation(text=text, anchor=text, task="drift"), 0.0, False, {}


class InstantPool:
    """``n`` in-process fake games of ``turns`` steps each behind ``EnvPool``'s interface (``reset``,
    ``task_info``, ``step``, ``submit`` / ``poll``), no worker processes: ``step`` answers at once,
    a ``submit``-ted step at the next ``poll``. A subclass says what game ``i`` shows now (``_obs``,
    an ``Observation``; ``self.t[i]`` is its turn); a step scores 0.0 and ends the game at ``turns``."""

    env = "textcraft"

    def __init__(self, n: int, turns: int):
        self.n, self.turns = n, turns
        self.t = [0] * n
        self.queue: list[tuple[int, int]] = []  # (ticket, env) submitted, not yet polled
        self.ticket = 0

    def __len__(self):
        return self.n

    def _obs(self, i: int) -> Observation:
        raise NotImplementedError

    def _advance(self, i: int):
        self.t[i] += 1
        return StepResult(self._obs(i), 0.0, self.t[i] >= self.turns, {})

    def reset(self, envs, tasks, seeds):
        for i in envs:
            self.t[i] = 0
        return [ResetResult(self._obs(i), {}) for i in envs]

    def task_info(self, envs):
        return [TaskInfoResult({"goal": "item"}) for _ in envs]

    def step(self, envs, actions):
        return [self._advance(i) for i in envs]

    def submit(self, jobs):
        tickets = list(range(self.ticket, self.ticket + len(jobs)))
        self.ticket += len(jobs)
        self.queue += [(t, job.env) for t, job in zip(tickets, jobs)]
        return tickets

    def poll(self, timeout=0.0):
        out, self.queue = [(t, self._advance(i)) for t, i in self.queue], []
        return out

    @property
    def in_flight(self) -> int:
        return len(self.queue)
