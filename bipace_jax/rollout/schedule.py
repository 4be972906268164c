"""The one event loop of a rollout (``run``) and its two schedulers (``Lockstep``, ``Continuous``).

Each pass of ``run``: take the answered env steps (``GamePort.poll``; waiting for one only when
nothing else can run) and book them, tokenizing the next prompt of each game that plays on while the
engine works; wait for the dispatched decode work; read the finished rows; insert waiting prompts into
the free rows; dispatch the next decode work; then parse the finished responses and submit their env
steps while it runs.

* ``Lockstep`` is the barrier case: it waits until every env step of the turn is answered, inserts every
  live game at once and decodes them until all are done (one ``Engine.generate``), so every live game
  advances one turn per engine call.
* ``Continuous`` runs the same passes on ``Engine.slots``: a finished response goes to its game while
  the other slots keep decoding, and an answered game takes the lowest free slot (FIFO).

The host work of a turn (prompt, keys, parsing, booking: ``turns.HostTurns``) comes through a
``TurnPort``, and every wait is timed on a ``Clock``; the schedule simulation (``bipace_jax.schedule_sim``)
runs this loop on a simulated engine, pool, host and clock.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from bipace_jax.rollout.config import RolloutConfig, Scheduler
from bipace_jax.rollout.protocols import Clock, EngineLike, GamePort, SlotHandle, TurnPort
from environments.pool import StepJob

__all__ = ["Continuous", "Lockstep", "policy", "run"]

# (envs, prompts, labels, output) of rows that finished decoding
Finished = tuple[list[int], list[list[int]], list[Any], Any]


def _timing() -> dict[str, float]:
    return {"sampling_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "env_s": 0.0}


class Lockstep:
    """Insert every waiting game, decode until all are done (one ``Engine.generate``), step them all.

    ``progress``: a tqdm bar over turns (live games, tokens/s) or None. ``policy``: None (``actor``
    plays every turn, version 0) or a callable returning ``(actor, policy version)``, asked at every
    turn boundary (asynchronous RL's switch point); ``versions[env]`` lists the version of each of the
    env's turns.
    """

    barrier = True  # the next insert waits for every env step of the turn

    def __init__(
        self, engine: EngineLike, actor, key, temperature: float | None, clock: Clock, progress=None, policy=None
    ):
        self.engine, self.actor, self.key, self.temperature, self.bar = engine, actor, key, temperature, progress
        self.clock, self.timing = clock, _timing()
        self.policy = policy
        self.versions: dict[int, list[int]] = collections.defaultdict(list)
        self._waiting: tuple | None = None
        self._finished: Finished | None = None

    def busy(self) -> bool:
        return self._waiting is not None or self._finished is not None

    def wait(self) -> None:
        """Nothing runs in the background: ``dispatch`` decoded until done."""

    def take_finished(self) -> Finished | None:
        out, self._finished = self._finished, None
        return out

    def free(self) -> int:
        return 0 if self.busy() else 1 << 30  # every live game fits one call

    def insert(self, envs, prompts, labels, keys: np.ndarray, groups) -> None:
        self._waiting = (envs, prompts, labels, keys, groups)

    def dispatch(self) -> None:
        if self._waiting is None:
            return
        envs, prompts, labels, keys, groups = self._waiting
        self._waiting = None
        actor, version = self.policy() if self.policy is not None else (self.actor, 0)
        for i in envs:
            self.versions[i].append(version)
        t0 = self.clock.now()
        # a task group's games share their prompt head (the engine prefills it once if configured to)
        out = self.engine.generate(actor, prompts, self.key, temperature=self.temperature, row_keys=keys, groups=groups)
        dt = self.clock.now() - t0
        self.timing["sampling_s"] += dt
        if out.timing is not None:
            self.timing["prefill_s"] += out.timing.prefill_s
            self.timing["decode_s"] += out.timing.decode_s
        self._finished = (envs, prompts, labels, out)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(live=len(envs), tok_s=f"{float(np.asarray(out.lengths).sum()) / max(dt, 1e-9):.0f}")

    def close(self) -> dict[str, float]:
        if self.bar is not None:
            self.bar.close()
        return {}


class Continuous:
    """The engine's decode slots: insert into the free ones, decode one chunk at a time (not waited for
    while the host books the answered games), read the finished ones.

    Inserts are not waited for, so ``timing["prefill_s"]`` is their host time and their device time lands
    in ``decode_s`` (the wait for the chunk queued behind them).
    """

    barrier = False

    def __init__(self, handle: SlotHandle, clock: Clock):
        self.handle, self.clock, self.timing = handle, clock, _timing()
        self.state = handle.empty()
        self.slot_env = [-1] * handle.num_slots  # the env each slot serves, -1: free
        self.prompts: dict[int, list[int]] = {}  # a slot game's prompt
        self.labels: dict[int, Any] = {}  # and its label
        self.in_flight: tuple[Any, int] | None = None  # (steps handle, busy slots) of the dispatched chunk
        self.busy_steps = 0
        self._done = np.ones(handle.num_slots, bool)

    def busy(self) -> bool:
        return self.in_flight is not None or any(e >= 0 for e in self.slot_env)

    def wait(self) -> None:
        if self.in_flight is not None:
            t0 = self.clock.now()
            self.busy_steps += self.in_flight[1] * self.handle.steps_run(self.in_flight[0])
            dt = self.clock.now() - t0
            self.timing["decode_s"] += dt
            self.timing["sampling_s"] += dt
            self.in_flight = None
        self._done = self.handle.done(self.state)  # synced: no chunk is in flight here

    def take_finished(self) -> Finished | None:
        ready = [k for k, e in enumerate(self.slot_env) if e >= 0 and self._done[k]]
        if not ready:  # read before the next chunk: its call donates the state
            return None
        envs = [self.slot_env[k] for k in ready]
        t0 = self.clock.now()
        out = self.handle.read(self.state, ready)
        self.timing["sampling_s"] += self.clock.now() - t0
        for k in ready:
            self.slot_env[k] = -1
        return envs, [self.prompts.pop(i) for i in envs], [self.labels.pop(i) for i in envs], out

    def free(self) -> int:
        return sum(e < 0 for e in self.slot_env)

    def insert(self, envs, prompts, labels, keys: np.ndarray, groups) -> None:
        ids = [k for k, e in enumerate(self.slot_env) if e < 0][: len(envs)]
        for k, i, p, lab in zip(ids, envs, prompts, labels):
            self.slot_env[k], self.prompts[i], self.labels[i] = i, p, lab
        t0 = self.clock.now()
        # not waited for: the chunk below queues behind it, the host goes on to the replies
        self.state = self.handle.insert(self.state, prompts, ids, keys)
        dt = self.clock.now() - t0
        self.timing["prefill_s"] += dt
        self.timing["sampling_s"] += dt
        self._done[ids] = False  # unknown until the chunk: one ending at its first token makes it run 0 steps

    def dispatch(self) -> None:
        busy = sum(e >= 0 for e in self.slot_env)
        if any(e >= 0 and not self._done[k] for k, e in enumerate(self.slot_env)):
            t0 = self.clock.now()
            self.state, steps = self.handle.decode(self.state, wait=False)
            self.timing["sampling_s"] += self.clock.now() - t0
            self.in_flight = (steps, busy)

    def close(self) -> dict[str, float]:
        """The slot statistics: slots, decode steps, busy slot-steps, slot-steps offered, chunks, inserts."""
        c, n = self.handle.counters, self.handle.num_slots
        return dict(
            slots=n,
            decode_steps=c["decode_steps"],
            busy_steps=self.busy_steps,
            slot_steps=c["decode_steps"] * n,
            chunks=c["chunk_calls"],
            inserts=c["insert_calls"],
        )


def policy(
    rcfg: RolloutConfig,
    engine: EngineLike,
    actor,
    n_games: int,
    key,
    clock: Clock,
    *,
    temperature: float | None = None,
    progress=None,
    policy=None,
) -> Lockstep | Continuous:
    """The scheduler ``rcfg.scheduler`` for ``n_games`` games: ``Lockstep``, or ``Continuous`` on
    ``rcfg.num_slots`` slots (0: one per game, capped at the engine's largest batch bucket).
    ``policy``: see ``Lockstep``; ``Continuous`` asks it once (its slots bind one set of weights)."""
    if rcfg.scheduler == Scheduler.LOCKSTEP:
        return Lockstep(engine, actor, key, temperature, clock, progress, policy)
    if policy is not None:
        actor, _ = policy()
    n_slots = rcfg.num_slots or min(n_games, engine.config.batch_buckets[-1])
    handle = engine.slots(
        actor, n_slots, max_prompt=rcfg.max_prompt_length, chunk=rcfg.chunk_steps, temperature=temperature
    )
    return Continuous(handle, clock)


def _admit(sched: Lockstep | Continuous, host: TurnPort, pending: collections.deque, prepared: dict):
    """Inserts waiting games into the free rows, FIFO (lockstep: all, in env order); a game without a
    prompt (``TurnPort.prompt`` None: it ended) is skipped and the next waiting game takes its place.
    Returns the games still waiting."""
    if sched.barrier:
        pending = collections.deque(sorted(pending))
    n_free = sched.free()
    envs, prompts = [], []
    while pending and len(envs) < n_free:
        i = pending.popleft()
        p = prepared.pop(i) if i in prepared else host.prompt(i)
        if p is not None:
            envs.append(i)
            prompts.append(p)
    if envs:
        sched.insert(envs, prompts, host.labels(envs), host.row_keys(envs), host.groups(envs))
    return pending


def run(sched: Lockstep | Continuous, pool: GamePort, host: TurnPort, clock: Clock) -> tuple[dict, dict]:
    """Plays every game of ``host.live`` to its end under ``sched`` (the module doc gives the event order).

    ``host`` does the host work of the turns (``turns.HostTurns`` in ``collect``; the schedule simulation's
    own); no env step is left in flight on return.

    Returns:
      (timing: seconds on ``clock`` of ``sampling_s``, ``prefill_s``, ``decode_s`` (as the scheduler
      counts them) and ``env_s`` (the host's time in submit / poll); the scheduler's statistics:
      ``Continuous`` its slots, ``decode_steps``, ``busy_steps``, ``slot_steps``, ``chunks``, ``inserts``,
      ``Lockstep`` none).
    """
    pending = collections.deque(host.live)  # games waiting for a row, in order
    prepared: dict[int, list[int]] = {}  # a waiting game's next prompt, tokenized ahead
    stepping: dict[int, tuple[int, Any]] = {}  # pool ticket -> (env, its reply)
    timing = sched.timing
    try:
        while pending or stepping or sched.busy():
            if stepping:  # take the answered games; wait for one only when nothing else can run
                block = sched.barrier or (not sched.busy() and not pending)
                t0 = clock.now()
                answered = pool.poll(timeout=None if block else 0.0)
                timing["env_s"] += clock.now() - t0
                for ticket, res in answered:
                    i, rep = stepping.pop(ticket)
                    plays_on = host.book(i, rep, res)
                    for j in ([i] if plays_on else []) + host.spawned(i):  # spawned: a fork's siblings
                        p = host.prompt(j)  # overlaps the running chunk
                        if p is not None:
                            pending.append(j)
                            prepared[j] = p
                if sched.barrier and stepping:
                    continue
            sched.wait()
            finished = sched.take_finished()
            if pending:
                pending = _admit(sched, host, pending, prepared)
            sched.dispatch()
            if finished is None:
                continue
            envs, prompts, labels, out = finished
            replies = host.replies(out, prompts, labels)
            t0 = clock.now()
            tickets = pool.submit([StepJob(i, rep.action) for i, rep in zip(envs, replies)])
            timing["env_s"] += clock.now() - t0
            stepping.update(zip(tickets, zip(envs, replies)))
    finally:
        stats = sched.close()
    return timing, stats
