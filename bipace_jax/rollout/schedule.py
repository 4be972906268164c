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

Both call ``turns`` for the host work of a turn, and time everything on the ``Play``'s ``Clock``; the
schedule simulation (``bipace_jax.schedule_sim``) runs this loop on a simulated engine, pool and clock.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from bipace_jax.rollout import turns
from bipace_jax.rollout.config import RolloutConfig, Scheduler
from bipace_jax.rollout.protocols import EngineLike, GamePort, SlotHandle
from bipace_jax.rollout.turns import Play
from environments.pool import StepJob

__all__ = ["Continuous", "Lockstep", "policy", "run"]

# (envs, prompts, labels, output) of rows that finished decoding
Finished = tuple[list[int], list[list[int]], list[Any], Any]


class Lockstep:
    """Insert every waiting game, decode until all are done (one ``Engine.generate``), step them all.

    ``progress``: a tqdm bar over turns (live games, tokens/s) or None.
    """

    barrier = True  # the next insert waits for every env step of the turn

    def __init__(self, engine: EngineLike, actor, key, temperature: float | None, progress=None):
        self.engine, self.actor, self.key, self.temperature, self.bar = engine, actor, key, temperature, progress
        self._waiting: tuple | None = None
        self._finished: Finished | None = None

    def busy(self) -> bool:
        return self._waiting is not None or self._finished is not None

    def wait(self, play: Play) -> None:
        """Nothing runs in the background: ``dispatch`` decoded until done."""

    def take_finished(self, play: Play) -> Finished | None:
        out, self._finished = self._finished, None
        return out

    def free(self) -> int:
        return 0 if self.busy() else 1 << 30  # every live game fits one call

    def insert(self, play: Play, envs, prompts, labels, keys: np.ndarray) -> None:
        self._waiting = (envs, prompts, labels, keys)

    def dispatch(self, play: Play) -> None:
        if self._waiting is None:
            return
        envs, prompts, labels, keys = self._waiting
        self._waiting = None
        # a task group's games share their prompt head (the engine prefills it once if configured to)
        groups = [play.episodes[i].group_id for i in envs]
        t0 = play.clock.now()
        out = self.engine.generate(
            self.actor, prompts, self.key, temperature=self.temperature, row_keys=keys, groups=groups
        )
        dt = play.clock.now() - t0
        play.timing["sampling_s"] += dt
        if out.timing is not None:
            play.timing["prefill_s"] += out.timing.prefill_s
            play.timing["decode_s"] += out.timing.decode_s
        self._finished = (envs, prompts, labels, out)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(live=len(envs), tok_s=f"{float(np.asarray(out.lengths).sum()) / max(dt, 1e-9):.0f}")

    def close(self, play: Play) -> None:
        if self.bar is not None:
            self.bar.close()


class Continuous:
    """The engine's decode slots: insert into the free ones, decode one chunk at a time (not waited for
    while the host books the answered games), read the finished ones.

    Inserts are not waited for, so ``timing["prefill_s"]`` is their host time and their device time lands
    in ``decode_s`` (the wait for the chunk queued behind them).
    """

    barrier = False

    def __init__(self, handle: SlotHandle):
        self.handle = handle
        self.state = handle.empty()
        self.slot_env = [-1] * handle.num_slots  # the env each slot serves, -1: free
        self.prompts: dict[int, list[int]] = {}  # a slot game's prompt
        self.labels: dict[int, Any] = {}  # and its label
        self.in_flight: tuple[Any, int] | None = None  # (steps handle, busy slots) of the dispatched chunk
        self.busy_steps = 0
        self._done = np.ones(handle.num_slots, bool)

    def busy(self) -> bool:
        return self.in_flight is not None or any(e >= 0 for e in self.slot_env)

    def wait(self, play: Play) -> None:
        if self.in_flight is not None:
            t0 = play.clock.now()
            self.busy_steps += self.in_flight[1] * self.handle.steps_run(self.in_flight[0])
            dt = play.clock.now() - t0
            play.timing["decode_s"] += dt
            play.timing["sampling_s"] += dt
            self.in_flight = None
        self._done = self.handle.done(self.state)  # synced: no chunk is in flight here

    def take_finished(self, play: Play) -> Finished | None:
        ready = [k for k, e in enumerate(self.slot_env) if e >= 0 and self._done[k]]
        if not ready:  # read before the next chunk: its call donates the state
            return None
        envs = [self.slot_env[k] for k in ready]
        t0 = play.clock.now()
        out = self.handle.read(self.state, ready)
        play.timing["sampling_s"] += play.clock.now() - t0
        for k in ready:
            self.slot_env[k] = -1
        return envs, [self.prompts.pop(i) for i in envs], [self.labels.pop(i) for i in envs], out

    def free(self) -> int:
        return sum(e < 0 for e in self.slot_env)

    def insert(self, play: Play, envs, prompts, labels, keys: np.ndarray) -> None:
        ids = [k for k, e in enumerate(self.slot_env) if e < 0][: len(envs)]
        for k, i, p, lab in zip(ids, envs, prompts, labels):
            self.slot_env[k], self.prompts[i], self.labels[i] = i, p, lab
        t0 = play.clock.now()
        # not waited for: the chunk below queues behind it, the host goes on to the replies
        self.state = self.handle.insert(self.state, prompts, ids, keys)
        dt = play.clock.now() - t0
        play.timing["prefill_s"] += dt
        play.timing["sampling_s"] += dt
        self._done[ids] = False  # unknown until the chunk: one ending at its first token makes it run 0 steps

    def dispatch(self, play: Play) -> None:
        busy = sum(e >= 0 for e in self.slot_env)
        if any(e >= 0 and not self._done[k] for k, e in enumerate(self.slot_env)):
            t0 = play.clock.now()
            self.state, steps = self.handle.decode(self.state, wait=False)
            play.timing["sampling_s"] += play.clock.now() - t0
            self.in_flight = (steps, busy)

    def close(self, play: Play) -> None:
        c, n = self.handle.counters, self.handle.num_slots
        play.slot_stats = dict(
            slots=n,
            decode_steps=c["decode_steps"],
            busy_steps=self.busy_steps,
            slot_steps=c["decode_steps"] * n,
            chunks=c["chunk_calls"],
            inserts=c["insert_calls"],
        )


def policy(
    rcfg: RolloutConfig, engine: EngineLike, actor, n_games: int, key, temperature=None, progress=None
) -> Lockstep | Continuous:
    """The scheduler ``rcfg.scheduler`` for ``n_games`` games: ``Lockstep``, or ``Continuous`` on
    ``rcfg.num_slots`` slots (0: one per game, capped at the engine's largest batch bucket)."""
    if rcfg.scheduler == Scheduler.LOCKSTEP:
        return Lockstep(engine, actor, key, temperature, progress)
    n_slots = rcfg.num_slots or min(n_games, engine.config.batch_buckets[-1])
    handle = engine.slots(
        actor, n_slots, max_prompt=rcfg.max_prompt_length, chunk=rcfg.chunk_steps, temperature=temperature
    )
    return Continuous(handle)


def _admit(sched, play: Play, tokenizer, pending: collections.deque, prepared: dict) -> None:
    """Inserts waiting games into the free rows, FIFO (lockstep: all, in env order); a game whose prompt
    does not fit ends (``turns.PROMPT_TOO_LONG``) and the next waiting game takes its place."""
    if sched.barrier:
        pending = collections.deque(sorted(pending)) if pending else pending
    n_free = sched.free()
    envs, prompts = [], []
    while pending and len(envs) < n_free:
        i = pending.popleft()
        p = prepared.pop(i) if i in prepared else turns.prompt_of(play, tokenizer, i)
        if p is not None:
            envs.append(i)
            prompts.append(p)
    if envs:
        labels = list(play.labeler(list(envs))) if play.labeler is not None else [None] * len(envs)
        keys = turns.turn_keys(play.keys[envs], [play.episodes[i].length for i in envs])
        sched.insert(play, envs, prompts, labels, keys)
    return pending


def run(sched: Lockstep | Continuous, engine: EngineLike, pool: GamePort, play: Play) -> None:
    """Plays every live game of ``play`` to its end under ``sched`` (the module doc gives the event order).

    Books every step into ``play`` (rows, episodes, counters, timing on ``play.clock``); a game whose
    prompt does not fit ends with ``turns.PROMPT_TOO_LONG``; no env step is left in flight on return.
    """
    tokenizer, rcfg = engine.tokenizer, play.rcfg
    max_new = int(engine.config.max_new_tokens)
    pending = collections.deque(play.live)  # games waiting for a row, in order
    prepared: dict[int, list[int]] = {}  # a waiting game's next prompt, tokenized ahead
    stepping: dict[int, tuple[int, turns.Reply]] = {}  # pool ticket -> (env, its reply)
    try:
        while pending or stepping or sched.busy():
            if stepping:  # take the answered games; wait for one only when nothing else can run
                block = sched.barrier or (not sched.busy() and not pending)
                t0 = play.clock.now()
                answered = pool.poll(timeout=None if block else 0.0)
                play.timing["env_s"] += play.clock.now() - t0
                for ticket, res in answered:
                    i, rep = stepping.pop(ticket)
                    if turns.book(play, i, rep, res, max_new):
                        p = turns.prompt_of(play, tokenizer, i)  # overlaps the running chunk
                        if p is not None:
                            pending.append(i)
                            prepared[i] = p
                if sched.barrier and stepping:
                    continue
            sched.wait(play)
            finished = sched.take_finished(play)
            if pending:
                pending = _admit(sched, play, tokenizer, pending, prepared)
            sched.dispatch(play)
            if finished is None:
                continue
            envs, prompts, labels, out = finished
            replies = turns.replies(out, prompts, labels, engine, rcfg)
            t0 = play.clock.now()
            tickets = pool.submit([StepJob(i, rep.action) for i, rep in zip(envs, replies)])
            play.timing["env_s"] += play.clock.now() - t0
            stepping.update(zip(tickets, zip(envs, replies)))
    finally:
        sched.close(play)
    play.stats["turns"] = max((ep.length for ep in play.episodes), default=0)
