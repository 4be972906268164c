"""What ``collect`` and ``schedule.run`` need from the engine, the game pool and the clock, written down.

Structural types (``typing.Protocol``): the sampling engine, ``environments.pool.EnvPool``, the wall
clock, and the schedule simulation's ``SimEngine`` / ``SimPool`` / ``VirtualClock`` satisfy them
without inheriting from them. Nothing here is probed at run time (no ``getattr`` / ``hasattr`` /
``inspect.signature``): an object that lacks a member fails where the member is used.

Shape letters: B prompts of one call, M new tokens, D fingerprint width, NS decode slots.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["Clock", "EngineLike", "GamePort", "SampleLike", "SlotHandle", "TurnPort", "WallClock"]


class SampleLike(Protocol):
    """One engine call's rows (``sampling.SampleOutput``): tokens int32[B, M] (pad past the length),
    lengths int32[B], logprobs float32[B, M], fingerprints float32[B, D], and timing (``prefill_s``,
    ``decode_s`` seconds of host wall time) or None."""

    tokens: Any
    lengths: Any
    logprobs: Any
    fingerprints: Any
    timing: Any


class SlotHandle(Protocol):
    """Continuous batching over the engine's programs (``Engine.slots``): NS decode slots in one state."""

    num_slots: int  # NS, rows of the decode state (>= requested)
    counters: dict[str, int]  # decode_steps, chunk_calls, insert_calls, summed over calls

    def empty(self) -> Any:
        """A decode state of NS empty (done) slots."""

    def insert(
        self, state: Any, prompts: Sequence[Sequence[int]], slot_ids: Sequence[int], row_keys: np.ndarray
    ) -> Any:
        """Prefills ``prompts`` into the free slots ``slot_ids`` with keys uint32[B, 2]; not waited for;
        ``state`` is donated (use the returned one)."""

    def decode(self, state: Any, wait: bool = True) -> tuple[Any, Any]:
        """One chunk of decode steps of every busy slot, leaving when one finishes: (state, steps), steps
        an int with ``wait``, else a handle for ``steps_run``."""

    def steps_run(self, steps: Any) -> int:
        """Waits for a dispatched chunk; counts and returns its steps."""

    def done(self, state: Any) -> np.ndarray:
        """bool[NS], a host copy: the slot's response ended (or the slot is empty)."""

    def read(self, state: Any, slot_ids: Sequence[int]) -> SampleLike:
        """The rows of the finished slots ``slot_ids`` (timing None)."""


class EngineLike(Protocol):
    """The sampling engine (``sampling.Engine``): one per run; the tokenizer and sampler settings travel on it.

    ``config`` has ``max_new_tokens``, ``stop_strings``, ``batch_buckets``, ``length_buckets``,
    ``temperature`` and ``shared_head_tokens`` (a ``sampling.SamplerConfig``).
    """

    config: Any
    tokenizer: Any
    pad_id: int
    eos_token_ids: tuple[int, ...]

    def generate(
        self,
        actor: Any,
        prompts: Sequence[Sequence[int]],
        key: Any,
        *,
        temperature: float | None = None,
        row_keys: np.ndarray | None = None,
        groups: Sequence[int] | None = None,
    ) -> SampleLike:
        """Lockstep: one response per prompt, row b drawn from its own ``row_keys[b]``; rows of one of
        ``groups`` may share their prompt head's prefill."""

    def slots(
        self, actor: Any, num_slots: int, *, max_prompt: int, chunk: int, temperature: float | None = None
    ) -> SlotHandle:
        """Continuous batching: ``num_slots`` decode slots for prompts of at most ``max_prompt`` tokens."""


class GamePort(Protocol):
    """The game pool (``environments.pool.EnvPool``): env ``i`` of ``len(pool)`` plays one game at a time.

    ``reset`` / ``task_info`` start the games (synchronously); every step goes through ``submit`` (one
    ticket per ``StepJob``, not waited for) and ``poll`` (the settled ``(ticket, StepResult)`` pairs; with
    ``timeout=None`` it waits until at least one is settled, with ``0.0`` it does not wait).
    """

    env: Any  # the registered game's name, or the factory of an unregistered (test) game

    def __len__(self) -> int: ...

    def reset(self, env_indices: Sequence[int], task_ids: Sequence[int], seeds: Sequence[int]) -> list[Any]: ...

    def task_info(self, env_indices: Sequence[int]) -> list[Any]: ...

    def submit(self, jobs: Sequence[Any]) -> list[int]: ...

    def poll(self, timeout: float | None = 0.0) -> list[tuple[int, Any]]: ...


class TurnPort(Protocol):
    """The host work of the games' turns that ``schedule.run`` calls (``turns.HostTurns`` in ``collect``).

    ``live``: the envs that play, ascending. A reply has ``action``, the command the pool's ``StepJob``
    sends.
    """

    live: list[int]

    def prompt(self, env: int) -> list[int] | None:
        """The env's next prompt token ids; None: the game ended instead (its fault booked)."""

    def row_keys(self, envs: Sequence[int]) -> np.ndarray:
        """uint32[B, 2] the engine key of each env's turn."""

    def groups(self, envs: Sequence[int]) -> list[int]:
        """Each env's task group (rows of a group may share their prompt head)."""

    def labels(self, envs: Sequence[int]) -> list[Any]:
        """Each env's label of the state its prompt shows, or None each."""

    def replies(self, out: SampleLike, prompts: Sequence[list[int]], labels: Sequence[Any]) -> list[Any]:
        """The finished rows decoded and scored: one reply per row."""

    def book(self, env: int, reply: Any, result: Any) -> bool:
        """Books the env's step (its reply and the pool's ``StepResult``); returns whether it plays on."""

    def spawned(self, env: int) -> list[int]:
        """The envs that start playing because of the env's step just booked (branching rollouts: its
        forked siblings, or the subtree it released), ascending; [] without branching."""


class Clock(Protocol):
    """Seconds on the loop's clock: the host's wall clock, or the simulation's virtual one."""

    def now(self) -> float: ...


class WallClock:
    """``time.perf_counter``, the clock of a real ``collect``."""

    def now(self) -> float:
        return time.perf_counter()
