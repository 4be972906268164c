"""A tiny deterministic text game whose actions can crash, hang or raise: the pool's test fixture.

Not registered with ``make``: pass the class itself to ``EnvPool`` (a picklable factory).
"""

from __future__ import annotations

import os
import time
from typing import Any

from environments.base import Observation, TextEnv


class FaultyEnv(TextEnv):
    """A counting game with fault injection (for ``EnvPool`` tests and benchmarks).

    ``reset(task_id, seed)`` shows ``"task {task_id} seed {seed} step 0"``. Actions:
    ``"win"`` ends with reward 1.0; ``"crash"`` kills the process (``os._exit``); ``"hang"``
    sleeps for an hour; ``"raise"`` raises RuntimeError; ``"hash"`` shows ``hash("bipace")``
    (to check PYTHONHASHSEED); ``"pid"`` shows the process id; ``"unpicklable"`` returns an
    info dict holding a lambda; ``"nap"`` sleeps 0.8 s, then counts like any other action; any other action advances the
    counter: ``"task T seed S step N: <action>"``. Seeds with special meaning in ``reset``:
    -1 hangs, -2 crashes, -3 crashes once per ``marker_dir`` (the first reset creates the marker,
    then crashes), -4 gives a per-process observation (breaks task-group equality), -5 raises
    ValueError. ``step_cost_ms`` makes every step busy the CPU that long (a synthetic slow game
    for benchmarks, e.g. 36 ms like an ALFWorld step).
    """

    def __init__(self, max_steps: int = 20, marker_dir: str | None = None, step_cost_ms: float = 0.0):
        super().__init__(max_steps)
        self.marker_dir = marker_dir
        self.step_cost_ms = float(step_cost_ms)
        self._task = (0, 0)
        self._count = 0

    @property
    def num_tasks(self) -> int:
        return 100

    def task_info(self, task_id: int) -> dict[str, Any]:
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
        if action == "crash":
            os._exit(1)
        if action == "hang":
            time.sleep(3600)
        if action == "raise":
            raise RuntimeError("injected step error")
        if action == "nap":
            time.sleep(0.8)
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
