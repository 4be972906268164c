"""Multi-turn rollout: the task groups' games played on the sampling engine and the game pool.

``collect`` plays ``len(games) * group_size`` games (one task group per ``(task_id, seed)``). Each turn of
a game: its prompt (``environments.prompts.build_prompt``, wrapped in the tokenizer's chat template as
the user message) is tokenized; the engine answers it; the response is parsed into a command
(``parse_action``); invalid responses are charged ``invalid_penalty`` and the game receives the fallback
action instead (``RolloutConfig.fallback_action``, by default the game's ``GameSpec.fallback_action``);
the pool steps the game. Games end when the game says so, when they reach ``max_steps``, or on an
environment error (a pool ``Fault``, or a prompt too long even with no history). ``RolloutConfig.scheduler``
batches the engine: ``lockstep`` (every live game one turn per engine call) or ``continuous`` (decode
slots: a game steps while the others decode); both run ``schedule.run`` and give the same rows.

Every (trajectory, step) of a game without a fault becomes one row of the output, in the canonical
order of the estimator contract (ascending group, trajectory, step; ``docs/estimators.md``): the token
rows the trainer needs and a ``StepBatch`` with the same rows:

* ``group_id``: task group index k (the k-th ``(task_id, seed)`` of ``games``).
* ``traj_id``: game index ``k * group_size + g`` (the pool's env index).
* ``step``: turn index inside the trajectory, 0..T-1.
* ``reward``: ``success_reward * env_reward`` (the game's part).
* ``penalty``: ``invalid_penalty * (response invalid)``, kept apart so the estimator can charge it to
  its own row (``EstimatorConfig.penalty="own_row"``); the default ``"in_reward"`` uses
  ``reward - penalty``, the step's net reward.
* ``obs_hash``: ``assign_ids`` of the anchor text of the observation the prompt showed, or with
  ``similarity_thresh > 0`` its ``similarity_groups`` cluster (verl-agent's similarity grouping).
* ``fingerprint``: the engine's prompt fingerprint (hidden state at the last prompt token).
* ``action_key``: ``assign_ids`` of the PACE key (``ActionKey``): ``action_tag(response)`` or the first 8
  response token ids (``first_tokens``); an unparsable response gets -1.

Prompt length: a prompt over ``max_prompt_length`` tokens is rebuilt with fewer history entries,
oldest dropped first, and counted in ``stats["truncations"]``.

Modules: ``config`` (``RolloutConfig``), ``records`` (what a call returns), ``turns`` (one turn's host
work), ``schedule`` (the event loop), ``pack`` (rows to arrays and statistics), ``protocols`` (what the
engine, pool and clock must offer).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable, Sequence

import jax

from bipace_jax.batch import TokenBatch  # re-exported: the rollout emits it, the learner consumes it
from bipace_jax.rollout import branch, pack, schedule, turns
from bipace_jax.rollout.config import FIRST_TOKENS, RESEED_STRIDE, ActionKey, RolloutConfig, Scheduler
from bipace_jax.rollout.protocols import Clock, EngineLike, GamePort, WallClock
from bipace_jax.rollout.records import Episode, RolloutResult, StepRecord
from bipace_jax.rollout.turns import (
    PROMPT_TOO_LONG,
    PromptTooLongError,
    chat_prompt_ids,
    encode_prompt,
    finish_reason,
    game_keys,
    turn_keys,
)

__all__ = [
    "ActionKey",
    "Episode",
    "FIRST_TOKENS",
    "PROMPT_TOO_LONG",
    "PromptTooLongError",
    "RESEED_STRIDE",
    "RolloutConfig",
    "RolloutResult",
    "Scheduler",
    "StepRecord",
    "TokenBatch",
    "chat_prompt_ids",
    "collect",
    "encode_prompt",
    "finish_reason",
    "game_keys",
    "turn_keys",
]


def _check_inputs(engine: EngineLike, pool: GamePort, games, rcfg: RolloutConfig) -> list[tuple[int, int]]:
    if not isinstance(rcfg, RolloutConfig):
        raise TypeError(f"rcfg must be a RolloutConfig, got {type(rcfg).__name__}")
    games = list(games)
    if not games:
        raise ValueError("games must hold at least one (task_id, seed) pair, got none")
    bad = [g for g in games if not (isinstance(g, (tuple, list)) and len(g) == 2)]
    if bad:
        raise ValueError(f"games must be (task_id, seed) pairs, got {bad[0]!r}")
    games = [(int(t), int(s)) for t, s in games]
    n = len(games) * rcfg.group_size
    if len(pool) < n:
        raise ValueError(
            f"pool has {len(pool)} envs, fewer than len(games) * group_size = {len(games)} * {rcfg.group_size} = {n}"
        )
    if isinstance(pool.env, str) and pool.env != rcfg.game:  # a test game's factory has no name to check
        raise ValueError(f"RolloutConfig.game is {rcfg.game!r} but the pool runs {pool.env!r}")
    buckets = engine.config.length_buckets
    if rcfg.max_prompt_length > buckets[-1]:
        raise ValueError(
            f"RolloutConfig.max_prompt_length={rcfg.max_prompt_length} exceeds the engine's largest "
            f"length bucket {buckets[-1]}"
        )
    if rcfg.scheduler == Scheduler.CONTINUOUS:
        if rcfg.num_slots > n:
            warnings.warn(
                f"RolloutConfig.num_slots={rcfg.num_slots} is more than the {n} games of this collect: "
                f"{rcfg.num_slots - n} slots hold KV cache rows and stay empty",
                stacklevel=3,
            )
        if engine.config.shared_head_tokens > 0:
            warnings.warn(
                f"SamplerConfig.shared_head_tokens={engine.config.shared_head_tokens} has no effect with "
                "RolloutConfig.scheduler='continuous' (slot inserts prefill whole prompts)",
                stacklevel=3,
            )
    return games


def _progress_bar(progress: bool | str, rcfg: RolloutConfig):
    if not progress or rcfg.scheduler != Scheduler.LOCKSTEP:
        return None
    from tqdm.auto import tqdm

    desc = progress if isinstance(progress, str) else f"rollout {rcfg.game}"
    return tqdm(total=rcfg.max_steps, desc=desc, unit="turn", leave=False)


def _book_versions(rows: list[StepRecord], versions: dict[int, list[int]] | None, version: int) -> None:
    """Set each row's ``policy_version``: ``version`` for every row when ``versions`` is None, otherwise
    the version of the engine call that sampled it (``versions[env]``, one per call of that env, in
    order). A branching child's own rows start at its fork turn, so a row's call is its rank among its
    env's sampled rows; a repeated prefix row takes the version of the row it repeats (``source``)."""
    if versions is None:
        for r in rows:
            r.policy_version = version
        return
    sampled: dict[int, list[StepRecord]] = collections.defaultdict(list)
    for r in rows:
        if r.source is None:
            sampled[r.traj].append(r)
    for env, own in sampled.items():
        for call, r in enumerate(sorted(own, key=lambda r: r.step)):
            r.policy_version = versions[env][call]
    by_step = {(r.traj, r.step): r.policy_version for r in rows if r.source is None}
    for r in rows:
        if r.source is not None:
            r.policy_version = by_step[r.source]


def collect(
    actor,
    engine: EngineLike,
    pool: GamePort,
    games: Sequence[tuple[int, int]],
    rcfg: RolloutConfig,
    key: jax.Array,
    *,
    temperature: float | None = None,
    labeler: Callable[[list[int]], Sequence[str | None]] | None = None,
    progress: bool | str = False,
    clock: Clock | None = None,
    policy: Callable[[], tuple[object, int]] | None = None,
) -> RolloutResult:
    """Plays G rollouts of every task group under ``rcfg.scheduler`` and returns the step rows.

    Args:
      actor: the current policy, passed to the engine's calls.
      engine: the sampling engine (``rollout.protocols.EngineLike``); its ``tokenizer`` gives the chat
        template, encoding and decoding.
      pool: the game pool (``rollout.protocols.GamePort``, e.g. ``environments.pool.EnvPool``) with at
        least ``len(games) * group_size`` envs of ``rcfg.game``; envs ``0 .. n-1`` are used, env ``k * G + g``
        plays rollout g of task group k.
      games: one ``(task_id, seed)`` pair per task group.
      rcfg: ``RolloutConfig`` (another scheduler for one call: ``dataclasses.replace(rcfg, scheduler=...)``).
      key: ``jax.random`` key; turn t of a game samples with ``turn_keys(game_keys(key, games, G), t)``,
        its own (game, turn) key, so its tokens depend neither on the other games nor on the scheduler.
      temperature: the sampling temperature of this call; None: the engine's ``config.temperature``.
      labeler: called with the env indices whose prompts go to the engine; returns one label per env
        for the state its prompt shows (DAgger: ``pool.oracle_actions``); kept in ``StepRecord.label``.
      progress: lockstep: show a tqdm bar over turns (live games, tokens/s); a string is the bar's label
        (default ``"rollout <game>"``).
      clock: the loop's clock (default the wall clock, ``protocols.WallClock``).
      policy: asynchronous RL (``bipace_jax.async_rl``): a callable returning ``(actor, policy
        version)`` in place of ``actor``, asked at every turn boundary by ``lockstep`` (once by
        ``continuous``); each row's ``StepRecord.policy_version`` is the version that sampled it
        (None: ``actor`` plays, every version 0).

    Returns:
      ``RolloutResult`` (see its docstring); both schedulers give the same one (timing aside; continuous
      adds ``timing["decode_steps" / "chunks" / "inserts"]`` and ``stats`` rate ``slot_use``).

    Raises:
      ValueError: no or malformed ``games``, a pool too small or of another game, ``max_prompt_length``
        above the engine's largest length bucket.
      RuntimeError: every game faulted or was over at reset (no row to train on).
    """
    clock = clock or WallClock()
    t_start = clock.now()
    games = _check_inputs(engine, pool, games, rcfg)
    play, reset_faults = turns.start(pool, rcfg, games, key, clock, labeler)
    host = turns.HostTurns(play, engine)
    if rcfg.branch_turns:  # a task group's games grow as trees (rollout.branch)
        host = branch.BranchTurns(play, engine, pool, branch.plant(play, games, key))
    timing, slot_stats = dict.fromkeys(("sampling_s", "prefill_s", "decode_s", "env_s"), 0.0), {}
    version = 0
    if policy is not None and rcfg.scheduler != Scheduler.LOCKSTEP:
        (actor, version), policy = policy(), None  # the slots bind one set of weights
    if play.live:
        bar = _progress_bar(progress, rcfg)
        sched = schedule.policy(
            rcfg, engine, actor, len(play.episodes), key, clock, temperature=temperature, progress=bar, policy=policy
        )
        timing, slot_stats = schedule.run(sched, pool, host, clock)
        _book_versions(play.rows, sched.versions if policy is not None else None, version)
    timing = dict(timing, env_s=timing["env_s"] + play.reset_s, total_s=clock.now() - t_start)
    timing["host_s"] = timing["total_s"] - timing["sampling_s"] - timing["env_s"]
    return _result(play, engine, len(games), reset_faults, timing, slot_stats, labeled=labeler is not None)


def _result(play: turns.Play, engine: EngineLike, n_groups, reset_faults, timing, slot_stats, labeled: bool):
    """The played games' ``RolloutResult``: kept rows packed, statistics counted."""
    rcfg = play.rcfg
    rows = pack.kept_rows(play.rows, play.episodes, rcfg.game)
    tokens, logprobs = pack.token_batch(rows, engine.config.length_buckets, engine.pad_id)
    play.stats["turns"] = max((ep.length for ep in play.episodes), default=0)
    stats = pack.episode_stats(play.stats, rows, play.episodes, len(play.rows), reset_faults)
    if rcfg.branch_turns:
        rates = {**stats.rates, "sampled_singleton_row_rate": branch.sampled_singletons(rows)}
        stats = dataclasses.replace(stats, rates=rates)
    if slot_stats:
        for k in ("decode_steps", "chunks", "inserts"):
            timing[k] = float(slot_stats[k])
        # busy slot-steps over slot-steps offered: pools over hosts as a rate
        use = (float(slot_stats["busy_steps"]), float(slot_stats["slot_steps"]))
        stats = dataclasses.replace(stats, rates={**stats.rates, "slot_use": use})
    return RolloutResult(
        tokens=tokens,
        sample_logprobs=logprobs,
        steps=pack.step_batch(rows, n_groups, rcfg),
        rows=rows,
        episodes=play.episodes,
        stats=stats,
        timing=timing,
        labeled=labeled,
    )
