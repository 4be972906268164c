"""A discrete-event simulation of one host's rollout under both schedulers (lockstep, continuous).

Deterministic: the response lengths come from a seeded NumPy generator (or are given), and time
advances only by the unit costs of `SimConfig`. The event order is not copied: ``simulate`` runs the
rollout's own loop, ``rollout.schedule.run`` with its ``Lockstep`` and ``Continuous`` schedulers, on
a simulated engine (``SimEngine``, ``SimSlots``: a row's key names its game and turn, whose response
length the table gives), pool (``SimPool``), host work (``SimTurns``) and clock (``VirtualClock``).
What that loop does, priced:

* **lockstep**, per turn: one prefill over the live games (``prefill_s(rows, prompt_tokens)``), then
  ``max(L) - 1`` decode steps (the first token comes from the prefill, and the loop runs until the
  longest response of the call ends) at ``decode_step_s(rows, prompt_tokens + max_new_tokens)`` each
  (the call's dense cache), the host work (``host_turn_s``), then every env step of the turn (all envs
  in parallel: ``env_step_s``). Games past their last turn leave the next call.
* **continuous**, per loop pass: if env jobs are in flight, poll them (all answers settled by now;
  when no slot has work and no game waits, block until the first one settles: that wait is
  ``env_s``); answered games that play on queue FIFO; if games wait and slots are free, one
  ``insert`` of ``n = min(waiting, free)`` prompts into the lowest free slots
  (``insert_s(n, prompt_tokens)``, which must charge any row padding of the insert program); if no
  busy slot has finished, one decode chunk of ``min(chunk_steps, fewest tokens left of a busy slot)``
  (0 when every busy slot ended at its first token: the host cannot know before the chunk)
  steps at the fixed-shape ``slot_step_s`` (every slot, busy or not, over the dense
  ``max_prompt_tokens + max_new_tokens`` columns) plus ``host_chunk_s``; the finished slots are
  read, freed and their games submitted to the pool, each answered ``env_step_s`` later.

A response of L tokens (1 <= L <= ``max_new_tokens``) takes its first token from the prefill /
insert and L - 1 decode steps, in both schedulers, as the device programs do. Fed the response lengths
of a real continuous ``collect`` (zero env latency, so both event orders are deterministic), the
simulation gives its decode steps, insert calls and slot use exactly (``tests/test_schedule_sim.py``).

Against the design note's simulation (one v5e host, 7B roofline constants, 1024-token prompts, mean
of 5 draws) this one gives decode-step ratios 2.02 / 2.37 / 2.68 (note: 2.00 / 2.30 / 2.61) and wall
ratios 1.58 / 1.72 / 1.52 (note: 1.66 / 1.75 / 1.51) at 8 / 16 / 64 slots, lockstep 143 / 193 / 371 s
(note: 145 / 197 / 374): within 5%, the wall ratios lower by the loop's one-chunk lag (a finished
game's env step is submitted after the next chunk is dispatched, and the chunk is waited for before
its answers can be inserted). The draws differ (another generator and seeds), and the note
inserts in row buckets of at most 8 where the rollout loop inserts every ready game at once (the
note pays its 2 ms call constant more often).

Not modelled (as in the design note's simulation): host work besides the per-turn and per-chunk
constants (tokenising, parsing, the pool's IPC), fewer env workers than games, prompts of varying
length (every prompt costs ``prompt_tokens``), and variance across hosts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from bipace_jax.rollout import RolloutConfig, Scheduler, schedule
from bipace_jax.sampling import SampleOutput
from environments.base import Observation
from environments.pool import ResetResult, StepResult, TaskInfoResult

__all__ = [
    "SimConfig",
    "SimEngine",
    "SimPool",
    "SimSlots",
    "SimTurns",
    "VirtualClock",
    "lengths",
    "lognormal_mu",
    "simulate",
]

_GAME = "textcraft"  # any registered game (the loop's config names one; nothing of it runs)
_PROMPT_COLUMNS = 16  # the simulated prompts' length bucket (RolloutConfig's smallest max_prompt_length)
_OBS = Observation(text="", anchor="", task="")  # what every simulated game shows

Cost = float | Callable[[int, int], float]


def lognormal_mu(mean: float, sigma: float) -> float:
    """The log-space location of a lognormal with arithmetic ``mean`` and log-space ``sigma``."""
    return math.log(mean) - sigma**2 / 2


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """One host's rollout: its games, slots, response lengths and unit costs (seconds).

    Attributes:
      games: (>= 1) games the host plays.
      slots: (>= 1) decode slots of the continuous scheduler (lockstep serves every live game per call).
      turns: (>= 1) most turns a game plays (``env.max_steps``).
      end_prob: [0, 1) probability a game ends after each turn before ``turns`` (0: every game plays
        all ``turns``).
      mean_tokens, sigma: the response-length lognormal: arithmetic mean (> 0) and log-space sigma (>= 0).
      max_new_tokens: (>= 1) the response cap M; lengths are rounded and clipped to [min_tokens, M].
      min_tokens: (1 <= min_tokens <= M) the smallest response.
      response_lengths: None (draw them), or explicit lengths per game: one sequence of ints in
        [1, M] per game, one per turn it plays (its length is the game's turn count, at most
        ``turns``); ``end_prob``, ``mean_tokens``, ``sigma`` are then unused.
      prompt_tokens: (>= 1) prompt tokens of every prefill row (the lockstep call's length bucket).
      max_prompt_tokens: (None or >= prompt_tokens) the slot cache's prompt columns P_max (None:
        ``prompt_tokens``); the continuous decode step reads P_max + M columns per slot.
      env_step_s: (>= 0) seconds of one env step (every env steps in parallel).
      decode_step_s: (>= 0) lockstep decode step, a float or ``f(rows, context) -> s`` over the call's
        live rows and its cache width ``prompt_tokens + max_new_tokens``.
      slot_step_s: None or (>= 0) the continuous decode step over all ``slots`` (fixed shape); None:
        ``decode_step_s(slots, max_prompt_tokens + max_new_tokens)``.
      prefill_s: (>= 0) a float or ``f(rows, prompt_tokens) -> s``: one lockstep prefill over its live
        rows (and one continuous insert of ``rows`` prompts unless ``insert_s`` is given).
      insert_s: None (``prefill_s``) or (>= 0) a float or ``f(rows, prompt_tokens) -> s``: one
        continuous insert of ``rows`` prompts (any row padding of the insert program charged in it).
      chunk_steps: (>= 1) most decode steps of one continuous chunk (``rollout.chunk_steps``).
      host_turn_s, host_chunk_s: (>= 0) host seconds per lockstep turn and per continuous chunk.
      seed: the generator's seed (response lengths and early ends).

    Raises:
      ValueError: naming the field, on a value outside its range or of the wrong type.
    """

    games: int
    slots: int
    turns: int = 50
    end_prob: float = 0.0
    mean_tokens: float = 150.0
    sigma: float = 0.8
    max_new_tokens: int = 512
    min_tokens: int = 1
    response_lengths: Sequence[Sequence[int]] | None = None
    prompt_tokens: int = 1024
    max_prompt_tokens: int | None = None
    env_step_s: float = 0.03
    decode_step_s: Cost = 0.0
    slot_step_s: float | None = None
    prefill_s: Cost = 0.0
    insert_s: Cost | None = None
    chunk_steps: int = 8
    host_turn_s: float = 0.0
    host_chunk_s: float = 0.0
    seed: int = 0

    def __post_init__(self):
        def bad(name, want):
            return ValueError(f"SimConfig.{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)

        for name, lo in (("games", 1), ("slots", 1), ("turns", 1), ("max_new_tokens", 1), ("prompt_tokens", 1)):
            if not is_int(getattr(self, name)) or getattr(self, name) < lo:
                raise bad(name, f"an int >= {lo}")
        if not is_int(self.chunk_steps) or self.chunk_steps < 1:
            raise bad("chunk_steps", "an int >= 1")
        if not is_int(self.seed):
            raise bad("seed", "an int")
        if not is_int(self.min_tokens) or not 1 <= self.min_tokens <= self.max_new_tokens:
            raise bad("min_tokens", f"an int in [1, max_new_tokens={self.max_new_tokens}]")
        if not is_num(self.end_prob) or not 0 <= self.end_prob < 1:
            raise bad("end_prob", "a number in [0, 1)")
        if not is_num(self.mean_tokens) or self.mean_tokens <= 0:
            raise bad("mean_tokens", "a number > 0")
        if not is_num(self.sigma) or self.sigma < 0:
            raise bad("sigma", "a number >= 0")
        if self.max_prompt_tokens is not None and (
            not is_int(self.max_prompt_tokens) or self.max_prompt_tokens < self.prompt_tokens
        ):
            raise bad("max_prompt_tokens", f"None or an int >= prompt_tokens={self.prompt_tokens}")
        for name in ("env_step_s", "host_turn_s", "host_chunk_s"):
            if not is_num(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "a finite number >= 0 (seconds)")
        if self.slot_step_s is not None and (not is_num(self.slot_step_s) or self.slot_step_s < 0):
            raise bad("slot_step_s", "None or a finite number >= 0 (seconds)")
        for name in ("decode_step_s", "prefill_s", "insert_s"):
            v = getattr(self, name)
            if name == "insert_s" and v is None:
                continue
            if not callable(v) and (not is_num(v) or v < 0):
                raise bad(name, "a finite number >= 0 (seconds) or a callable (rows, tokens) -> seconds")
        if self.response_lengths is not None:
            rl = self.response_lengths
            if isinstance(rl, (str, bytes)) or not isinstance(rl, Sequence) or len(rl) != self.games:
                raise bad("response_lengths", f"None or a sequence of games={self.games} per-game sequences")
            for g, seq in enumerate(rl):
                if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or not 1 <= len(seq) <= self.turns:
                    raise ValueError(
                        f"SimConfig.response_lengths[{g}] must be a sequence of 1 to turns={self.turns} lengths, got {seq!r}"
                    )
                if not all(is_int(x) and 1 <= x <= self.max_new_tokens for x in seq):
                    raise ValueError(
                        f"SimConfig.response_lengths[{g}] must hold ints in [1, max_new_tokens={self.max_new_tokens}], got {seq!r}"
                    )

    @property
    def cache_prompt(self) -> int:
        return self.prompt_tokens if self.max_prompt_tokens is None else self.max_prompt_tokens


def _cost(c: Cost, rows: int, tokens: int) -> float:
    v = float(c(rows, tokens)) if callable(c) else float(c)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"a cost function returned {v!r} s for rows={rows}, tokens={tokens}; expected >= 0")
    return v


def lengths(cfg: SimConfig) -> list[list[int]]:
    """Every game's response lengths, one per turn it plays (``cfg.response_lengths`` or drawn)."""
    if cfg.response_lengths is not None:
        return [[int(x) for x in seq] for seq in cfg.response_lengths]
    rng = np.random.default_rng(cfg.seed)
    mu = lognormal_mu(cfg.mean_tokens, cfg.sigma)
    draws = rng.lognormal(mu, cfg.sigma, size=(cfg.games, cfg.turns))
    table = np.clip(np.rint(draws), cfg.min_tokens, cfg.max_new_tokens).astype(int)
    if cfg.end_prob > 0:  # the turn count: geometric, capped at `turns`
        n = np.minimum(rng.geometric(cfg.end_prob, size=cfg.games), cfg.turns)
    else:
        n = np.full(cfg.games, cfg.turns)
    return [table[g, : n[g]].tolist() for g in range(cfg.games)]


class VirtualClock:
    """The simulation's ``rollout.protocols.Clock``: seconds that pass only when a simulated cost is paid."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t


@dataclasses.dataclass(frozen=True)
class _EngineConfig:
    """What the loop reads of a ``SamplerConfig``."""

    max_new_tokens: int
    batch_buckets: tuple[int, ...]
    length_buckets: tuple[int, ...] = (_PROMPT_COLUMNS,)
    stop_strings: tuple[str, ...] = ()
    temperature: float = 1.0
    shared_head_tokens: int = 0


class _Reply(NamedTuple):
    action: str


class SimTurns:
    """The ``TurnPort`` of the simulated games: one-token prompts, a game's row key is (game, turn), and
    booking a step advances the game's turn (the host work itself costs ``host_turn_s`` / ``host_chunk_s``)."""

    def __init__(self, games: int):
        self.live = list(range(games))
        self.turn = [0] * games

    def prompt(self, env: int) -> list[int]:
        return [1]

    def row_keys(self, envs: Sequence[int]) -> np.ndarray:
        return np.array([[g, self.turn[g]] for g in envs], np.uint32).reshape(-1, 2)

    def groups(self, envs: Sequence[int]) -> list[int]:
        return list(envs)

    def labels(self, envs: Sequence[int]) -> list[None]:
        return [None] * len(envs)

    def replies(self, out: SampleOutput, prompts, labels) -> list[_Reply]:
        return [_Reply("")] * len(prompts)

    def book(self, env: int, reply: _Reply, result: StepResult) -> bool:
        self.turn[env] += 1
        return not result.done

    def spawned(self, env: int) -> list[int]:
        return []  # the simulated games do not branch


class SimEngine:
    """An ``EngineLike`` whose response lengths come from the table by each row's key (game, turn), and
    whose calls advance the clock by ``cfg``'s costs.

    ``stages`` sums the seconds paid per stage; ``lockstep`` counts its ``generate`` calls' decode steps,
    busy row-steps (rows still generating) and row-steps (live rows)."""

    def __init__(self, cfg: SimConfig, table: list[list[int]], clock: VirtualClock):
        self.cfg, self.table, self.clock = cfg, table, clock
        self.config = _EngineConfig(max_new_tokens=cfg.max_new_tokens, batch_buckets=(cfg.games,))
        self.tokenizer, self.pad_id, self.eos_token_ids = None, 0, (0,)
        self.stages = dict(prefill=0.0, decode=0.0, env=0.0, host=0.0)
        self.lockstep = dict(steps=0, busy=0, row_steps=0, calls=0)

    def lengths(self, row_keys: np.ndarray) -> list[int]:
        return [self.table[g][t] for g, t in np.asarray(row_keys).tolist()]

    def pay(self, stage: str, seconds: float) -> None:
        self.clock.t += seconds
        self.stages[stage] += seconds

    def generate(self, actor, prompts, key, *, temperature=None, row_keys=None, groups=None) -> SampleOutput:
        cfg, ls = self.cfg, self.lengths(row_keys)
        rows, n = len(ls), max(ls) - 1
        self.pay("prefill", _cost(cfg.prefill_s, rows, cfg.prompt_tokens))
        self.pay("decode", n * _cost(cfg.decode_step_s, rows, cfg.prompt_tokens + cfg.max_new_tokens))
        self.pay("host", cfg.host_turn_s)
        c = self.lockstep
        c["steps"], c["busy"], c["row_steps"], c["calls"] = (
            c["steps"] + n,
            c["busy"] + sum(x - 1 for x in ls),
            c["row_steps"] + n * rows,
            c["calls"] + 1,
        )
        return SampleOutput(None, np.asarray(ls), None, None)

    def slots(self, actor, num_slots: int, *, max_prompt: int, chunk: int, temperature=None) -> SimSlots:
        return SimSlots(self, num_slots, chunk)


class SimSlots:
    """A ``SlotHandle``: NS slots with a position and a target length each; an insert gives a slot its
    first token, a chunk runs ``min(chunk, fewest tokens left of a live slot)`` steps of every slot at the
    fixed-shape ``slot_step_s`` and ends ``host_chunk_s`` after them (the host waits for it in ``steps_run``)."""

    def __init__(self, engine: SimEngine, num_slots: int, chunk: int):
        cfg = engine.cfg
        self.engine, self.num_slots, self.chunk = engine, num_slots, chunk
        self.counters = dict(decode_steps=0, chunk_calls=0, insert_calls=0)
        self.step_s = (
            cfg.slot_step_s
            if cfg.slot_step_s is not None
            else _cost(cfg.decode_step_s, num_slots, cfg.cache_prompt + cfg.max_new_tokens)
        )
        self.pos, self.target = [0] * num_slots, [0] * num_slots
        self._chunk_end = 0.0

    def empty(self) -> None:
        return None  # the state lives on this handle

    def insert(self, state, prompts, slot_ids, row_keys) -> None:
        cfg = self.engine.cfg
        cost = cfg.prefill_s if cfg.insert_s is None else cfg.insert_s
        self.engine.pay("prefill", _cost(cost, len(prompts), cfg.prompt_tokens))
        self.counters["insert_calls"] += 1
        for k, n in zip(slot_ids, self.engine.lengths(row_keys)):
            self.pos[k], self.target[k] = 1, n

    def decode(self, state, wait: bool = True) -> tuple[None, int]:
        live = [k for k in range(self.num_slots) if self.pos[k] < self.target[k]]
        n = min(self.chunk, min(self.target[k] - self.pos[k] for k in live)) if live else 0
        d, host = n * self.step_s, self.engine.cfg.host_chunk_s
        self.engine.stages["decode"] += d
        self.engine.stages["host"] += host
        self._chunk_end = self.engine.clock.t + d + host
        for k in live:
            self.pos[k] += n
        self.counters["chunk_calls"] += 1
        return None, (self.steps_run(n) if wait else n)

    def steps_run(self, steps: int) -> int:
        self.engine.clock.t = max(self.engine.clock.t, self._chunk_end)
        self.counters["decode_steps"] += steps
        return steps

    def done(self, state) -> np.ndarray:
        return np.array([p >= t for p, t in zip(self.pos, self.target)])

    def read(self, state, slot_ids) -> SampleOutput:
        return SampleOutput(None, np.array([self.target[k] for k in slot_ids]), None, None)


class SimPool:
    """A ``GamePort``: game g plays ``len(table[g])`` turns; a submitted step is answered ``env_step_s``
    later (every env in parallel); a blocking ``poll`` advances the clock to the first answer (env stage)."""

    env = _GAME

    def __init__(self, table: list[list[int]], engine: SimEngine):
        self.table, self.engine, self.clock = table, engine, engine.clock
        self.turn = [0] * len(table)
        self.due: dict[int, tuple[float, int]] = {}  # ticket -> (answer time, game)
        self.ticket = 0

    def __len__(self) -> int:
        return len(self.table)

    def reset(self, env_indices, task_ids, seeds) -> list[ResetResult]:
        return [ResetResult(_OBS, {}) for _ in env_indices]

    def task_info(self, env_indices) -> list[TaskInfoResult]:
        return [TaskInfoResult({}) for _ in env_indices]

    def submit(self, jobs) -> list[int]:
        tickets = list(range(self.ticket, self.ticket + len(jobs)))
        self.ticket += len(jobs)
        for t, job in zip(tickets, jobs):
            self.due[t] = (self.clock.t + self.engine.cfg.env_step_s, job.env)
        return tickets

    def poll(self, timeout: float | None = 0.0) -> list[tuple[int, StepResult]]:
        first = min((at for at, _ in self.due.values()), default=None)
        if timeout is None and first is not None and first > self.clock.t:
            self.engine.pay("env", first - self.clock.t)
        out = []
        for ticket in sorted(t for t, (at, _) in self.due.items() if at <= self.clock.t):
            g = self.due.pop(ticket)[1]
            self.turn[g] += 1
            out.append((ticket, StepResult(_OBS, 0.0, self.turn[g] >= len(self.table[g]), {})))
        return out


def _run(cfg: SimConfig, table: list[list[int]], scheduler: Scheduler) -> tuple[SimEngine, dict]:
    """``rollout.schedule.run`` of ``cfg``'s games under ``scheduler`` on the simulated engine, pool, host
    and clock; returns the engine (its stages and lockstep counts) and the loop's scheduler statistics."""
    clock = VirtualClock()
    engine = SimEngine(cfg, table, clock)
    rcfg = RolloutConfig(
        game=_GAME,
        group_size=1,
        max_steps=cfg.turns,
        max_prompt_length=_PROMPT_COLUMNS,
        scheduler=scheduler,
        num_slots=cfg.slots,
        chunk_steps=cfg.chunk_steps,
    )
    sched = schedule.policy(rcfg, engine, None, cfg.games, None, clock)
    _, stats = schedule.run(sched, SimPool(table, engine), SimTurns(cfg.games), clock)
    return engine, stats


def _summary(engine: SimEngine, decode_steps: int, busy: int, slot_steps: int, prefill_calls: int, **counts) -> dict:
    """One scheduler's result: wall seconds, decode steps, slot use (``busy`` of ``slot_steps`` row-steps
    decoded a live row; 1.0 when nothing was decoded), seconds per stage, prefill calls, then ``counts``."""
    return dict(
        wall_s=engine.clock.t,
        decode_steps=decode_steps,
        slot_use=busy / slot_steps if slot_steps else 1.0,
        stages_s=dict(engine.stages),
        prefill_calls=prefill_calls,
        **counts,
    )


def _lockstep(cfg: SimConfig, table: list[list[int]]) -> dict[str, Any]:
    engine, _ = _run(cfg, table, Scheduler.LOCKSTEP)
    c = engine.lockstep
    return _summary(engine, c["steps"], c["busy"], c["row_steps"], c["calls"], turns=c["calls"])


def _continuous(cfg: SimConfig, table: list[list[int]]) -> dict[str, Any]:
    engine, s = _run(cfg, table, Scheduler.CONTINUOUS)
    # slot_steps = decode_steps x slots: zero exactly when no chunk decoded
    return _summary(engine, s["decode_steps"], s["busy_steps"], s["slot_steps"], s["inserts"], chunks=s["chunks"])


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Simulates ``cfg`` under both schedulers (see the module doc for the event order).

    Returns a JSON-ready dict: ``lockstep`` and ``continuous``, each with ``wall_s`` (s),
    ``decode_steps`` (device decode steps), ``slot_use`` (busy row-steps over row-steps of the decode
    steps: lockstep rows still generating over live rows, continuous busy slots over all slots),
    ``stages_s`` (``prefill``, ``decode``, ``env`` (time the host only waits for envs), ``host``;
    they sum to ``wall_s``) and ``prefill_calls``; ``ideal_steps`` (the design note's step counts:
    lockstep sum over turns of the longest response, continuous the largest per-game token total, so
    k = 1, no prefill, env or host cost, as many slots as games), ``response_tokens`` (all responses'
    tokens), and the ratios lockstep / continuous ``speedup_wall``, ``speedup_decode_steps``.
    """
    table = lengths(cfg)
    lock, cont = _lockstep(cfg, table), _continuous(cfg, table)
    longest = max(len(x) for x in table)
    ideal_lock = sum(max(x[i] for x in table if len(x) > i) for i in range(longest))
    ideal_cont = max(sum(x) for x in table)
    return dict(
        lockstep=lock,
        continuous=cont,
        ideal_steps=dict(lockstep=ideal_lock, continuous=ideal_cont, ratio=ideal_lock / ideal_cont),
        response_tokens=sum(sum(x) for x in table),
        speedup_wall=lock["wall_s"] / cont["wall_s"] if cont["wall_s"] > 0 else math.nan,
        speedup_decode_steps=lock["decode_steps"] / cont["decode_steps"] if cont["decode_steps"] else math.nan,
    )
