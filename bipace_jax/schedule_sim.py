"""A discrete-event simulation of one host's rollout under both schedulers (lockstep, continuous).

Deterministic: the response lengths come from a seeded NumPy generator (or are given), and time
advances only by the unit costs of `SimConfig`. The event order copies the host loops of
``rollout._play_lockstep`` and ``rollout._play_continuous`` (with ``sampling.Engine.slots``):

* **lockstep**, per turn: one prefill over the live games (``prefill_s(rows, prompt_tokens)``), then
  ``max(L) - 1`` decode steps (the first token comes from the prefill, and the loop runs until the
  longest response of the call ends) at ``decode_step_s(rows, prompt_tokens + max_new_tokens)`` each
  (the call's dense cache), the host work, then one synchronous pool step (all envs in parallel:
  ``env_step_s``). Games past their last turn leave the next call.
* **continuous**, per loop pass: if env jobs are in flight, poll them (all answers settled by now;
  when no slot has work and no game waits, block until the first one settles: that wait is
  ``env_s``); answered games that play on queue FIFO; if games wait and slots are free, one
  ``insert`` of ``n = min(waiting, free)`` prompts into the lowest free slots
  (``insert_s(n, prompt_tokens)``, which must charge any row padding of the insert program); if no
  busy slot has finished, one decode chunk of ``min(chunk_steps, fewest tokens left of a busy slot)``
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
inserts in row buckets of at most 8 where this loop, like ``_play_continuous``, inserts every ready
game at once (the note pays its 2 ms call constant more often).

Not modelled (as in the design note's simulation): host work besides the per-turn and per-chunk
constants (tokenising, parsing, the pool's IPC), fewer env workers than games, prompts of varying
length (every prompt costs ``prompt_tokens``), and variance across hosts.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["SimConfig", "simulate", "lengths", "lognormal_mu"]

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


def _lockstep(cfg: SimConfig, table: list[list[int]]) -> dict[str, Any]:
    t = prefill = decode = env = host = 0.0
    steps = busy = row_steps = calls = 0
    live = list(range(cfg.games))
    context = cfg.prompt_tokens + cfg.max_new_tokens
    for turn in range(cfg.turns):
        if not live:
            break
        rows = len(live)
        ls = [table[g][turn] for g in live]
        p = _cost(cfg.prefill_s, rows, cfg.prompt_tokens)
        n = max(ls) - 1
        d = n * _cost(cfg.decode_step_s, rows, context)
        prefill, decode, host, env = prefill + p, decode + d, host + cfg.host_turn_s, env + cfg.env_step_s
        t += p + d + cfg.host_turn_s + cfg.env_step_s
        steps, busy, row_steps, calls = steps + n, busy + sum(x - 1 for x in ls), row_steps + n * rows, calls + 1
        live = [g for g in live if turn + 1 < len(table[g])]
    return dict(
        wall_s=t,
        decode_steps=steps,
        slot_use=busy / row_steps if row_steps else 1.0,
        stages_s=dict(prefill=prefill, decode=decode, env=env, host=host),
        prefill_calls=calls,
        turns=calls,
    )


def _continuous(cfg: SimConfig, table: list[list[int]]) -> dict[str, Any]:
    b, k = cfg.slots, cfg.chunk_steps
    slot_step = (
        cfg.slot_step_s
        if cfg.slot_step_s is not None
        else _cost(cfg.decode_step_s, b, cfg.cache_prompt + cfg.max_new_tokens)
    )
    t = prefill = decode = env = host = 0.0
    steps = busy_steps = inserts = chunks = 0
    turn = [0] * cfg.games  # the turn each game plays next
    pending = collections.deque(range(cfg.games))  # games waiting for a slot, FIFO
    slot_game, pos, target = [-1] * b, [0] * b, [0] * b
    stepping: collections.deque[tuple[float, int]] = collections.deque()  # (answer time, game), by ticket
    chunk_end = None  # when the dispatched decode chunk ends (the host polls while it runs)
    while pending or stepping or chunk_end is not None or any(g >= 0 for g in slot_game):
        if stepping:  # poll: the answers settled by now; block for the first when nothing else can run
            idle = chunk_end is None and not pending and all(g < 0 for g in slot_game)
            if idle and stepping[0][0] > t:
                env += stepping[0][0] - t
                t = stepping[0][0]
            while stepping and stepping[0][0] <= t:
                _, g = stepping.popleft()
                turn[g] += 1
                if turn[g] < len(table[g]):
                    pending.append(g)
        if chunk_end is not None:  # wait for the chunk
            t, chunk_end = max(t, chunk_end), None
        finished = [s for s in range(b) if slot_game[s] >= 0 and pos[s] >= target[s]]
        games = [slot_game[s] for s in finished]
        for s in finished:  # read and freed before the insert reuses the slot
            slot_game[s] = -1
        free = [s for s in range(b) if slot_game[s] < 0]
        if pending and free:
            n = min(len(pending), len(free))
            p = _cost(cfg.prefill_s if cfg.insert_s is None else cfg.insert_s, n, cfg.prompt_tokens)
            t, prefill, inserts = t + p, prefill + p, inserts + 1
            for s in free[:n]:
                g = pending.popleft()
                slot_game[s], pos[s], target[s] = g, 1, table[g][turn[g]]
        busy = [s for s in range(b) if slot_game[s] >= 0]
        live = [s for s in busy if pos[s] < target[s]]
        if live:  # dispatch one chunk: it stops at the first live slot's end
            n = min(k, min(target[s] - pos[s] for s in live))
            d = n * slot_step
            chunk_end = t + d + cfg.host_chunk_s
            decode, host = decode + d, host + cfg.host_chunk_s
            steps, busy_steps, chunks = steps + n, busy_steps + n * len(busy), chunks + 1
            for s in live:
                pos[s] += n
        for g in games:  # the finished responses' env steps, submitted while the chunk runs
            stepping.append((t + cfg.env_step_s, g))
    return dict(
        wall_s=t,
        decode_steps=steps,
        slot_use=busy_steps / (steps * b) if steps else 1.0,
        stages_s=dict(prefill=prefill, decode=decode, env=env, host=host),
        prefill_calls=inserts,
        chunks=chunks,
    )


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
