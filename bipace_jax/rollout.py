"""Multi-turn rollout: every live game of every task group advances one turn per sampler call.

``collect`` plays ``len(games) * group_size`` games in lockstep (one task group per ``(task_id, seed)``). Each turn, for every game still
running: the game's prompt (``environments.prompts.build_prompt``, wrapped in the tokenizer's chat
template as the user message) is tokenized; one ``Engine.generate`` call answers all of them; each
response is parsed into a command (``parse_action``); invalid responses are charged
``invalid_penalty`` and the game receives the fallback action instead (``RolloutConfig.fallback_action``,
by default the game's ``GameSpec.fallback_action``); the pool steps every game at once. Games end when the game says so, when they reach ``max_steps``, or on an environment error.

Every (trajectory, step) becomes one row of the output, in the canonical order of the estimator
contract (ascending group, trajectory, step; ``docs/estimators.md``): the token arrays the trainer needs
(prompt, response, masks, sampling log-probs) and a ``StepBatch`` with the same rows:

* ``group_id``: task group index k (the k-th ``(task_id, seed)`` of ``games``).
* ``traj_id``: game index ``k * group_size + g`` (the pool's env index).
* ``step``: turn index inside the trajectory, 0..T-1.
* ``reward``: ``success_reward * env_reward`` (the game's part).
* ``penalty``: ``invalid_penalty * (response invalid)``, kept apart so the estimator can charge it to
  its own row (``EstimatorConfig.penalty="own_row"``); the default ``"in_reward"`` uses
  ``reward - penalty``, the step's net reward.
* ``obs_hash``: ``assign_ids`` of the anchor text of the observation the prompt showed, or with
  ``similarity_thresh > 0`` its ``similarity_groups`` cluster (verl-agent's similarity grouping).
* ``fingerprint``: the sampler's prompt fingerprint (hidden state at the last prompt token).
* ``action_key``: ``assign_ids`` of the PACE key: ``action_tag(response)`` or the first 8 response
  token ids (``first_tokens``); an unparsable response gets -1.

Prompt length: a prompt over ``max_prompt_length`` tokens is rebuilt with fewer history entries,
oldest dropped first, and counted in ``stats["truncations"]``; a prompt that is too long even with
no history raises ``PromptTooLongError`` naming the game, the env, the task and the step.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bipace_jax.batch import TokenBatch  # re-exported: the rollout emits it, the learner consumes it
from bipace_jax.estimators import StepBatch, assign_ids, similarity_groups
from bipace_jax.metrics import HostStats
from bipace_jax.sampling import Engine, SampleOutput, key_data, truncate_at_stop
from environments.pool import ENV_ERRORS, Fault, StepJob
from environments.prompts import action_tag, build_prompt, invalid_command, parse_action
from environments.registry import GameSpec, game_spec

__all__ = [
    "Episode",
    "FIRST_TOKENS",
    "PromptTooLongError",
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

#: Number of response tokens in the ``first_tokens`` PACE key (``docs/estimators.md``, "PACE keys").
FIRST_TOKENS = 8
_ACTION_KEYS = ("action_tag", "first_tokens")
#: How a response is scored when it used the whole token budget (finish reason ``length``).
LENGTH_FINISH = ("parse", "invalid", "unpenalised")
INVALID_ACTIONS = ("fallback", "projected")
RESEED_STRIDE = 1_000_003  # retry k of a task group's reset uses seed + k * RESEED_STRIDE


class Scheduler(enum.StrEnum):
    """How ``collect`` batches the sampler: ``lockstep`` (one ``generate`` per turn over every live game,
    then one pool step) or ``continuous`` (``Engine.slots``: a finished response goes to its game
    while the other slots keep decoding)."""

    LOCKSTEP = "lockstep"
    CONTINUOUS = "continuous"


class PromptTooLongError(ValueError):
    """A prompt does not fit ``max_prompt_length`` tokens even with no history shown."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How games are played and scored.

    Attributes:
      game: a registered game (``environments.registered()``); its ``GameSpec`` gives the prompt
        template and the default fallback action.
      group_size: G, rollouts per task group (all from the same task id and seed).
      max_steps: turns per game at most; a game still running after it ends (``truncated``).
      history_length: earlier (observation, action) pairs shown in the prompt (verl-agent: 2).
      max_prompt_length: most prompt tokens (>= 16; chat template included); must not exceed the sampler's
        largest length bucket.
      invalid_penalty: (>= 0) subtracted from a step's reward when its response has no parsable action.
      success_reward: (> 0) multiplies the game's own reward (1.0 on success) (verl-agent: 10).
      fallback_action: the command sent to the game for an invalid response; None (default): the
        game's ``GameSpec.fallback_action`` (``RolloutConfig.fallback``).
      require_think: a response without ``<think>...</think>`` before the action is invalid.
      reject_cjk: a response holding a CJK ideograph is invalid (verl-agent's rule).
      invalid_action: what the game receives for an invalid response: ``"fallback"`` sends
        ``fallback_action``; ``"projected"`` (verl-agent) the parsed action when the tags were there,
        else the response's last ``projection_chars`` characters, lower-cased (also what the history
        shows).
      projection_chars: (>= 1) the tail kept by ``"projected"`` (verl-agent: ALFWorld 30, WebShop 20).
      length_finish: a response cut by the token budget (finish reason ``length``): ``"parse"`` scores
        it like any other (valid when its action parses), ``"invalid"`` makes it an invalid action
        (fallback sent, penalty charged), ``"unpenalised"`` sends the fallback without the penalty.
      reset_retries: (>= 0) times a task group whose reset faulted (a pool ``Fault``) is
        reset again, all G envs together, on a fresh seed (seed + k * ``RESEED_STRIDE`` on retry k);
        envs still failing after that are dropped (0: drop at once). Either way the game counts in
        ``stats["env_errors"]``.
      action_key: PACE key: ``"action_tag"`` or ``"first_tokens"``.
      similarity_thresh: ``obs_hash`` rule: 0.0 exact anchor text, in (0, 1) ``similarity_groups``
        (``EstimatorConfig.similarity_thresh``).
      show_inventory: show the inventory in the prompt (``build_prompt(show_inventory=...)``).
      system_prompt: system message; None leaves the chat template's default (Qwen2.5 inserts its own).
      template: None, or a mapping of ``PromptTemplate`` fields overriding the game's default.
      scheduler: ``Scheduler`` value, ``"lockstep"`` or ``"continuous"`` (``collect(scheduler=...)``
        overrides it).
      num_slots: (>= 0) decode slots of the continuous scheduler; 0: one per game, capped at the
        sampler's largest batch bucket.
      chunk_steps: (>= 1) most decode steps per on-device chunk of the continuous scheduler.

    Raises:
      ValueError: naming the ``RolloutConfig`` field, on a value outside its range or set, or a game
        that is not registered.
    """

    game: str = "textcraft"
    group_size: int = 8
    max_steps: int = 50
    history_length: int = 2
    max_prompt_length: int = 2048
    invalid_penalty: float = 0.1
    success_reward: float = 10.0
    fallback_action: str | None = None
    require_think: bool = False
    reject_cjk: bool = False
    invalid_action: str = "fallback"
    projection_chars: int = 30
    length_finish: str = "parse"
    reset_retries: int = 1
    action_key: str = "action_tag"
    similarity_thresh: float = 0.0
    show_inventory: bool = False
    system_prompt: str | None = None
    template: Any = None
    scheduler: str = "lockstep"
    num_slots: int = 0
    chunk_steps: int = 8

    def __post_init__(self):
        ints = (("group_size", 1), ("max_steps", 1), ("history_length", 0), ("max_prompt_length", 16))
        for name, lo in (*ints, ("reset_retries", 0), ("projection_chars", 1), ("num_slots", 0), ("chunk_steps", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"RolloutConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.scheduler not in tuple(Scheduler):
            raise ValueError(
                f"RolloutConfig.scheduler must be one of {tuple(map(str, Scheduler))}, got {self.scheduler!r}"
            )
        if self.invalid_action not in INVALID_ACTIONS:
            raise ValueError(
                f"RolloutConfig.invalid_action must be one of {INVALID_ACTIONS}, got {self.invalid_action!r}"
            )
        if self.length_finish not in LENGTH_FINISH:
            raise ValueError(f"RolloutConfig.length_finish must be one of {LENGTH_FINISH}, got {self.length_finish!r}")
        if self.action_key not in _ACTION_KEYS:
            raise ValueError(f"RolloutConfig.action_key must be one of {_ACTION_KEYS}, got {self.action_key!r}")
        if self.fallback_action is not None and (
            not isinstance(self.fallback_action, str) or not self.fallback_action.strip()
        ):
            raise ValueError(
                f"RolloutConfig.fallback_action must be None or a non-empty str, got {self.fallback_action!r}"
            )
        try:
            game_spec(self.game)
        except ValueError as e:
            raise ValueError(f"RolloutConfig.game must be a registered game: {e}") from None
        for name, lo, ok in (("invalid_penalty", ">= 0", np.greater_equal), ("success_reward", "> 0", np.greater)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and ok(v, 0)):
                raise ValueError(f"RolloutConfig.{name} must be a finite number {lo}, got {v!r}")
        t = self.similarity_thresh
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < 1.0:
            raise ValueError(f"RolloutConfig.similarity_thresh must be 0 or a float in (0, 1), got {t!r}")

    @property
    def spec(self) -> GameSpec:
        """The game's registered ``GameSpec``."""
        return game_spec(self.game)

    @property
    def fallback(self) -> str:
        """The command an invalid response is replaced with: ``fallback_action`` or the game's default."""
        return self.fallback_action if self.fallback_action is not None else self.spec.fallback_action


@dataclasses.dataclass
class Episode:
    """One game of a ``collect`` call.

    Attributes:
      task_id, seed: the game played; ``group_id``: its task group; ``traj_id``: its pool env index.
      won: the game reported success. ``length``: steps taken. ``invalid_count``: unparsable responses.
      episode_return: undiscounted sum of the net step rewards (success term minus invalid-action charges).
      env_error: the pool's ``Fault`` (a ``StrEnum``: "timeout", "crash", "exception", "lost") when the
        game failed at reset or mid-game, else None; such a game's rows are left out of the batch (its return is
        not the game's), it is not counted in ``success_rate``. ``env_error_detail``: the pool's
        account of it (e.g. ``"env 3 raised ValueError: TextCraftEnv task 12: step 2 gave reward nan ..."``).
      truncated: ended by ``max_steps`` (or the game's own cap) without success or error.
      score: the game's task score (``info["task_score"]``, WebShop) at the last step, else None.
      task_info: the game's ``task_info`` of the task (e.g. ``goal``, ``depth``).
    """

    task_id: int
    seed: int
    group_id: int
    traj_id: int
    won: bool = False
    length: int = 0
    invalid_count: int = 0
    episode_return: float = 0.0
    env_error: Fault | None = None
    env_error_detail: str = ""
    truncated: bool = False
    task_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    score: float | None = None


@dataclasses.dataclass
class StepRecord:
    """One (trajectory, step) row as played, before the rows are packed into arrays."""

    traj: int
    group: int
    step: int
    reward: float  # the game's part: success_reward * env reward
    penalty: float  # the invalid-action charge, >= 0
    anchor: str
    fingerprint: np.ndarray  # float32[D]
    pace: Any  # the PACE key (action tag text or first token ids)
    prompt: list[int]
    tokens: np.ndarray  # int32[M]
    logprobs: np.ndarray  # float32[M]
    length: int
    text: str
    action: str
    valid: bool
    finish: str  # why the response ended: "eos", "stop" (a stop string) or "length" (the token budget)
    label: str | None = None
    observation: str = ""  # the observation text the prompt ends with (transcripts)
    state: Any = None  # the Observation the prompt showed (DAgger records, sft.dagger_records)


@dataclasses.dataclass
class RolloutResult:
    """One ``collect`` call's output; N rows = all (trajectory, step) pairs in canonical order.

    Attributes:
      prompt_ids: int32[N, P] prompt tokens, left-padded with the pad id (P = the sampler's length
        bucket of the longest prompt).
      prompt_mask: int32[N, P], 1 on real prompt tokens.
      response_ids: int32[N, M] sampled response tokens (M = ``max_new_tokens``), pad past the length.
      response_mask: int32[N, M], 1 on the response's tokens (EOS and stop-text tokens included).
      sample_logprobs: float32[N, M] sampler log-probs (``SampleOutput.logprobs``), 0 past the length.
      steps: ``StepBatch`` whose first N rows are the token rows (row i = token row i), padded with
        masked rows to ``len(games) * group_size * max_steps`` rows and fixed capacities
        (``group_capacity`` = task groups, ``row_capacity`` = G * max_steps rounded up to 16), so
        its shape, and the estimator's compiled program, is the same every call.
      episodes: one ``Episode`` per trajectory, in traj order.
      timing: seconds spent in ``sampling_s`` (sampler calls; of which ``prefill_s`` and ``decode_s`` as the
        sampler reports them; continuous: ``prefill_s`` is the inserts' host time, their device time lands in
        ``decode_s``, the wait for the chunk queued behind them), ``env_s`` (pool reset/step; continuous: the host's time
        in submit/poll, env steps overlapping decode not counted) and ``host_s`` (prompts, tokenization, parsing,
        assembling), and ``total_s``.
      stats: ``truncations`` (prompts whose history was cut), ``history_dropped`` (entries cut),
        ``turns``, ``rows``, ``response_tokens``, ``prompt_tokens_max``, ``finish_eos_rate``, ``finish_stop_rate``, ``finish_length_rate`` (why responses ended), ``budget_hits`` (responses that
        used all M tokens without EOS or stop text), ``invalid_rate``, ``success_rate`` (of the games
        without a fault), ``env_errors`` (games that failed at reset or mid-game: ``Episode.env_error``;
        ``env_errors_<kind>`` per kind of ``ENV_ERRORS``, "lost" being a worker mate's fault)
        ``env_error_rows`` (their rows, left out of the batch) and ``reset_faults`` (env resets that
        faulted, including those a retry repaired): this host's values, ``host_stats.values()``.
      host_stats: the same statistics as ``metrics.HostStats`` (rates as numerator and denominator,
        ``turns`` and ``prompt_tokens_max`` as maxima, the rest counts), for ``distributed.pooled``.
      responses: N decoded response texts (cut after the stop text); ``actions``: N commands sent.
      finish_reasons: N of ``"eos"``, ``"stop"`` or ``"length"``: why each response ended.
      observations: N observation texts, the game's text each prompt ends with (``bipace_jax.transcripts``).
      states: N ``environments.base.Observation``s, the whole game state each prompt showed (its ``text``
        is ``observations[r]``; with the earlier rows' ``observations`` and ``actions`` of the same
        trajectory, the prompt's history, it re-encodes the prompt: ``sft.dagger_records``).
      valid: N bools, whether each response parsed into a valid command (False: the invalid-action path).
      labels: N labels from ``collect``'s ``labeler`` (e.g. the oracle's action from the state the
        prompt showed, for DAgger), or None without a labeler.
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    sample_logprobs: np.ndarray
    steps: StepBatch
    episodes: list[Episode]
    timing: dict[str, float]
    stats: dict[str, float]
    responses: list[str]
    actions: list[str]
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    labels: list[str | None] | None = None
    observations: list[str] = dataclasses.field(default_factory=list)
    states: list[Any] = dataclasses.field(default_factory=list)
    valid: list[bool] = dataclasses.field(default_factory=list)
    host_stats: HostStats = dataclasses.field(default_factory=HostStats)

    @property
    def rows(self) -> int:
        """N, the played (trajectory, step) rows: the token rows and the first N rows of ``steps``."""
        return self.prompt_ids.shape[0]

    def token_batch(self) -> TokenBatch:
        """The rows as one ``TokenBatch`` (response columns stay M = ``max_new_tokens``)."""
        rmask = self.response_mask.astype(bool)
        rid = np.where(rmask, self.response_ids, 0).astype(np.int32)
        return TokenBatch(
            np.concatenate([self.prompt_ids, rid], 1).astype(np.int32),
            np.concatenate([self.prompt_mask, rmask.astype(np.int32)], 1),
            rid,
            rmask,
            self.prompt_ids.shape[1],
        )

    def row_values(self, values) -> np.ndarray:
        """float32[N] of a per-``steps``-row array (e.g. advantages [num_rows]): its real rows, checked
        against ``steps.mask`` so token rows and step rows cannot drift apart.

        Raises:
          ValueError: ``values`` is not one entry per ``steps`` row, or the real rows are not the first N.
        """
        values = np.asarray(values, np.float32)
        mask = np.asarray(self.steps.mask)
        if values.shape != mask.shape or not mask[: self.rows].all() or mask[self.rows :].any():
            raise ValueError(
                f"values must have one entry per StepBatch row ({mask.shape}) whose first "
                f"{self.rows} rows are the real ones, got shape {values.shape}, {int(mask.sum())} real rows"
            )
        return values[: self.rows]


def encode_prompt(
    tokenizer, rcfg: RolloutConfig, obs, history: Sequence[tuple[str, str]], step: int, where: str = ""
) -> tuple[list[int], int]:
    """The chat-formatted prompt token ids of one turn, shortened to ``max_prompt_length``.

    Shows the last ``history_length`` entries of ``history``; while the prompt is longer than
    ``rcfg.max_prompt_length`` tokens, the oldest shown entry is dropped.

    Args:
      tokenizer: a ``transformers`` tokenizer with a chat template.
      rcfg: the rollout config (game, template, history length, system prompt, inventory option).
      obs: the current ``environments.base.Observation``.
      history: earlier (observation text, action sent) pairs, oldest first.
      step: actions taken so far.
      where: text naming the game instance for the error message.

    Returns:
      (token ids, number of history entries dropped to fit).

    Raises:
      PromptTooLongError: even with no history the prompt exceeds ``max_prompt_length``.
    """
    shown = min(rcfg.history_length, len(history))
    dropped = 0
    while True:
        hist = list(history[len(history) - shown :]) if shown else []
        text = build_prompt(
            rcfg.game, obs, hist, step, history_length=shown, template=rcfg.template, show_inventory=rcfg.show_inventory
        )
        ids = chat_prompt_ids(tokenizer, text, rcfg.system_prompt)
        if len(ids) <= rcfg.max_prompt_length:
            return ids, dropped
        if shown == 0:
            raise PromptTooLongError(
                f"{rcfg.game} {where} step {step}: the prompt has {len(ids)} tokens with no history, more than "
                f"RolloutConfig.max_prompt_length={rcfg.max_prompt_length}"
            )
        shown -= 1
        dropped += 1


def chat_prompt_ids(tokenizer, user_text: str, system_prompt: str | None) -> list[int]:
    """Token ids of one chat-formatted turn, ending with the opened assistant turn.

    ``apply_chat_template`` of an optional system message (omitted when ``system_prompt`` is None)
    and the user message, ``add_generation_prompt=True``; exactly what the sampler is fed each turn
    (warm-start data uses it too, so behaviour cloning sees the RL loop's prompts).
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": user_text})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def finish_reason(tokens: np.ndarray, text: str, eos: set[int], stop_strings: Sequence[str]) -> str:
    """Why a response ended: ``"eos"`` (its last token is an EOS id), ``"stop"`` (its text holds a stop
    string) or ``"length"`` (neither: the token budget ran out)."""
    if len(tokens) and int(tokens[-1]) in eos:
        return "eos"
    return "stop" if any(s in text for s in stop_strings) else "length"


def game_keys(key: jax.Array, games: Sequence[tuple[int, int]], group_size: int) -> np.ndarray:
    """uint32[len(games) * group_size, 2]: one key per game, from what the game is, not where it runs.

    Env ``k * G + g`` (rollout g of task group k = ``games[k]``) gets ``key`` folded with the task id, the
    seed (low and high 32 bits), g, and c, the count of earlier task groups with the same
    ``(task_id, seed)``; so adding or removing other games never changes a game's key.
    """
    seen: dict[tuple[int, int], int] = {}
    parts = []
    for task, seed in games:
        copy = seen.get((task, seed), 0)
        seen[(task, seed)] = copy + 1
        parts += [(task, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, g, copy) for g in range(group_size)]
    data = jnp.asarray(np.asarray(parts, np.int64).astype(np.uint32).reshape(-1, 5))

    def one(fields):
        k = key_data(key)
        for j in range(5):
            k = jax.random.fold_in(k, fields[j])
        return k

    return np.asarray(jax.vmap(one)(data), np.uint32)


# jitted: the continuous scheduler calls it per insert, and op-by-op dispatch cost ~10 ms a call on CPU
_fold_rows = jax.jit(jax.vmap(jax.random.fold_in))


def turn_keys(keys: np.ndarray, turns: Sequence[int]) -> np.ndarray:
    """uint32[B, 2]: ``fold_in(keys[b], turns[b])``, the sampler key of each game's turn (``game_keys`` rows)."""
    return np.asarray(_fold_rows(jnp.asarray(keys), jnp.asarray(turns, jnp.uint32)), np.uint32)


def _takes(sampler, name: str) -> bool:
    """Whether ``sampler.generate`` accepts the keyword ``name`` (``row_keys``, ``groups``; test doubles may not)."""
    try:
        return name in inspect.signature(sampler.generate).parameters
    except (TypeError, ValueError):
        return False


def _check_inputs(sampler, pool, games, rcfg) -> list[tuple[int, int]]:
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
    env_name = getattr(pool, "env", None)
    if isinstance(env_name, str) and env_name != rcfg.game:
        raise ValueError(f"RolloutConfig.game is {rcfg.game!r} but the pool runs {env_name!r}")
    buckets = getattr(getattr(sampler, "config", None), "length_buckets", None)
    if buckets and rcfg.max_prompt_length > buckets[-1]:
        raise ValueError(
            f"RolloutConfig.max_prompt_length={rcfg.max_prompt_length} exceeds the sampler's largest "
            f"length bucket {buckets[-1]}"
        )
    return games


def _start_games(pool, rcfg: RolloutConfig, env_task: list[int], env_seed: list[int]):
    """Resets envs ``0 .. len(env_task)-1``; a task group with a faulted env is reset again, all of it,
    on a fresh seed, up to ``rcfg.reset_retries`` times (``env_seed`` is updated in place).

    Returns (observations, task infos, faults, faults seen): one per env, the fault None for a game
    that runs; the count includes faults that a retry repaired.
    """
    n, g_size = len(env_task), rcfg.group_size
    obs: list[Any] = [None] * n
    infos: list[dict] = [{} for _ in range(n)]
    errors: list[Fault | None] = [None] * n
    base_seed = list(env_seed)
    todo, faults = list(range(n)), 0
    for attempt in range(rcfg.reset_retries + 1):
        for i in todo:
            env_seed[i] = base_seed[i] + attempt * RESEED_STRIDE
        results = pool.reset(todo, [env_task[i] for i in todo], [env_seed[i] for i in todo])
        for i, res in zip(todo, results):
            obs[i], errors[i] = res.obs, res.fault
        started = [i for i in todo if errors[i] is None]
        for i, res in zip(started, pool.task_info(started) if started else []):
            errors[i], infos[i] = res.fault, res.info
        faults += sum(errors[i] is not None for i in todo)
        failed_groups = sorted({i // g_size for i in todo if errors[i] is not None})
        todo = [i for g in failed_groups for i in range(g * g_size, (g + 1) * g_size)]
        if not todo:
            break
    return obs, infos, errors, faults


@dataclasses.dataclass
class _Games:
    """The running state of one ``collect`` call's games (env ``i`` plays rollout ``i % G`` of group ``i // G``)."""

    obs: list[Any]  # each env's current Observation
    history: list[list[tuple[str, str]]]  # each env's (observation text, action sent), oldest first
    episodes: list[Episode]
    live: list[int]  # envs still playing, ascending
    keys: np.ndarray  # uint32[n_envs, 2] each game's key (``game_keys``)
    prompts: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # continuous: each slot game's prompt
    labels: dict[int, Any] = dataclasses.field(default_factory=dict)  # continuous: its label
    slot_stats: dict[str, float] = dataclasses.field(default_factory=dict)  # continuous: slots, decode steps, use
    rows: list[StepRecord] = dataclasses.field(default_factory=list)
    stats: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict(truncations=0, history_dropped=0, turns=0, response_tokens=0, budget_hits=0)
    )
    timing: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"sampling_s": 0.0, "env_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0}
    )


def _new_games(pool, rcfg: RolloutConfig, games: list[tuple[int, int]], key) -> tuple[_Games, int]:
    """Resets the ``len(games) * G`` envs; returns their state and the count of reset faults."""
    g_size = rcfg.group_size
    env_task = [games[i // g_size][0] for i in range(len(games) * g_size)]
    env_seed = [games[i // g_size][1] for i in range(len(games) * g_size)]
    t0 = time.perf_counter()
    obs, infos, errors, reset_faults = _start_games(pool, rcfg, env_task, env_seed)
    dt = time.perf_counter() - t0
    episodes = [
        Episode(task_id=t, seed=s, group_id=i // g_size, traj_id=i, task_info=dict(infos[i]), env_error=errors[i])
        for i, (t, s) in enumerate(zip(env_task, env_seed))
    ]
    live = [i for i, ep in enumerate(episodes) if ep.env_error is None and not obs[i].won]
    keys = game_keys(key, games, g_size)
    state = _Games(obs=obs, history=[[] for _ in episodes], episodes=episodes, live=live, keys=keys)
    state.timing["env_s"] += dt
    return state, reset_faults


def _turn_prompts(state: _Games, tokenizer, rcfg: RolloutConfig, envs: Sequence[int] | None = None) -> list[list[int]]:
    """The prompt token ids of every live game (or of ``envs``), history shortened to fit (counted in ``stats``)."""
    prompts = []
    for i in state.live if envs is None else envs:
        ep = state.episodes[i]
        where = f"env {i} (task {ep.task_id}, seed {ep.seed})"
        ids, dropped = encode_prompt(tokenizer, rcfg, state.obs[i], state.history[i], ep.length, where)
        state.stats["truncations"] += dropped > 0
        state.stats["history_dropped"] += dropped
        prompts.append(ids)
    return prompts


def _decode(out: SampleOutput, sampler, tokenizer) -> tuple[list[str], list[str]]:
    """The response texts (cut after the stop text) and finish reasons of one ``generate`` call's rows."""
    stop_strings = tuple(getattr(sampler.config, "stop_strings", ()))
    eos = set(getattr(sampler, "eos_token_ids", ()))
    lengths = np.asarray(out.lengths)
    rows = range(len(lengths))
    texts = tokenizer.batch_decode([out.tokens[r, : lengths[r]].tolist() for r in rows], skip_special_tokens=True)
    texts = [truncate_at_stop(t, stop_strings) for t in texts]
    return texts, [finish_reason(out.tokens[r, : lengths[r]], texts[r], eos, stop_strings) for r in rows]


def _score(texts: list[str], finish: list[str], rcfg: RolloutConfig) -> tuple[list[str], list[bool], list[bool]]:
    """Per response: the command sent, whether it is valid, whether it is charged the invalid penalty."""
    actions, valid, penalised = [], [], []
    for text, why in zip(texts, finish):
        act, ok = parse_action(text, require_think=rcfg.require_think, reject_cjk=rcfg.reject_cjk)
        ok = ok and not (why == "length" and rcfg.length_finish != "parse")
        valid.append(ok)
        penalised.append(not ok and not (why == "length" and rcfg.length_finish == "unpenalised"))
        projected = invalid_command(text, act, rcfg.invalid_action, rcfg.fallback, rcfg.projection_chars)
        actions.append(act if ok else projected)
    return actions, valid, penalised


def _play_turn(state: _Games, actor, sampler, pool, tokenizer, rcfg: RolloutConfig, key, labeler, temperature) -> float:
    """Plays one turn of every live game: prompts, one sampler call, parsing, one pool step, the rows.

    Returns the sampler call's response tokens per second (for the progress bar).
    """
    live = state.live
    prompts = _turn_prompts(state, tokenizer, rcfg)
    labels = list(labeler(list(live))) if labeler is not None else [None] * len(live)
    t0 = time.perf_counter()
    if _takes(sampler, "row_keys"):
        row_keys = turn_keys(state.keys[live], [state.episodes[i].length for i in live])
        # a task group's games share their prompt head (the sampler prefills it once if configured to)
        kw = dict(groups=[state.episodes[i].group_id for i in live]) if _takes(sampler, "groups") else {}
        if temperature is not None:
            kw["temperature"] = temperature
        out = sampler.generate(actor, prompts, key, row_keys=row_keys, **kw)
    else:
        out = sampler.generate(actor, prompts, key)
    dt_sample = time.perf_counter() - t0
    state.timing["sampling_s"] += dt_sample
    if out.timing is not None:
        state.timing["prefill_s"] += out.timing.prefill_s
        state.timing["decode_s"] += out.timing.decode_s
    state.live = _step_and_book(state, live, prompts, out, labels, sampler, pool, tokenizer, rcfg)
    state.stats["turns"] += 1
    return float(np.asarray(out.lengths).sum()) / max(dt_sample, 1e-9)


@dataclasses.dataclass
class _Reply:
    """One game's sampled response, parsed, waiting for its env step."""

    prompt: list[int]
    tokens: np.ndarray  # int32[M]
    logprobs: np.ndarray  # float32[M]
    fingerprint: np.ndarray  # float32[D]
    length: int
    text: str
    finish: str
    action: str
    valid: bool
    penalised: bool
    label: Any


def _replies(out: SampleOutput, prompts, labels, sampler, tokenizer, rcfg: RolloutConfig) -> list[_Reply]:
    """The rows of one sampler output, decoded and scored (``_decode``, ``_score``)."""
    texts, finish = _decode(out, sampler, tokenizer)
    actions, valid, penalised = _score(texts, finish, rcfg)
    lengths = np.asarray(out.lengths)
    return [
        _Reply(
            prompt=prompts[r],
            tokens=np.asarray(out.tokens[r]),
            logprobs=np.asarray(out.logprobs[r]),
            fingerprint=np.asarray(out.fingerprints[r], np.float32),
            length=int(lengths[r]),
            text=texts[r],
            finish=finish[r],
            action=actions[r],
            valid=valid[r],
            penalised=penalised[r],
            label=labels[r],
        )
        for r in range(len(texts))
    ]


def _book(state: _Games, i: int, rep: _Reply, res, rcfg: RolloutConfig, max_new: int) -> bool:
    """Books game ``i``'s step (its reply and the pool's result) as a row; returns whether it plays on."""
    state.stats["response_tokens"] += rep.length
    state.stats["budget_hits"] += rep.finish == "length" and rep.length == max_new
    if rcfg.action_key == "action_tag":
        pace = action_tag(rep.text)
    else:
        pace = tuple(int(t) for t in rep.tokens[: min(rep.length, FIRST_TOKENS)])
    reward = rcfg.success_reward * float(res.reward)
    penalty = rcfg.invalid_penalty * rep.penalised
    ep = state.episodes[i]
    state.rows.append(
        StepRecord(
            traj=i,
            group=ep.group_id,
            step=ep.length,
            reward=reward,
            penalty=penalty,
            anchor=state.obs[i].anchor,
            fingerprint=rep.fingerprint,
            pace=pace,
            prompt=rep.prompt,
            tokens=rep.tokens,
            logprobs=rep.logprobs,
            length=rep.length,
            text=rep.text,
            action=rep.action,
            valid=rep.valid,
            finish=rep.finish,
            label=rep.label,
            observation=state.obs[i].text,
            state=state.obs[i],
        )
    )
    state.history[i].append((state.obs[i].text, rep.action))
    state.obs[i] = res.obs
    return not _advance(ep, res, reward - penalty, rep.valid, rcfg.max_steps)


def _step_and_book(state: _Games, live, prompts, out: SampleOutput, labels, sampler, pool, tokenizer, rcfg):
    """Parses the responses of games ``live``, steps them in the pool, books their rows; returns those still playing."""
    replies = _replies(out, prompts, labels, sampler, tokenizer, rcfg)
    t0 = time.perf_counter()
    results = pool.step(live, [rep.action for rep in replies])
    state.timing["env_s"] += time.perf_counter() - t0
    max_new = int(sampler.config.max_new_tokens)
    return [i for i, rep, res in zip(live, replies, results) if _book(state, i, rep, res, rcfg, max_new)]


def _play_continuous(state: _Games, actor, sampler, pool, tokenizer, rcfg: RolloutConfig, labeler, temperature) -> None:
    """Plays every live game to its end on ``Engine.slots``: a game whose response is done is submitted to
    the pool (``EnvPool.submit``) and its slot freed while the other slots keep decoding; answered games
    (``EnvPool.poll``) wait for a free slot, where their next prompt goes.

    Each round: poll the pool and tokenize the answered games' next prompts while the last dispatched
    decode chunk runs; wait for it; read the finished rows; insert waiting prompts into the free slots;
    dispatch the next chunk; then parse the finished responses and submit their env steps while it runs.
    Inserts are not waited for, so ``timing["prefill_s"]`` is their host time and their device time
    lands in ``decode_s`` (the wait for the chunk queued behind them).
    """
    n_slots = rcfg.num_slots or min(len(state.episodes), sampler.config.batch_buckets[-1])
    slot_sampler = sampler.slots(
        actor, n_slots, max_prompt=rcfg.max_prompt_length, chunk=rcfg.chunk_steps, temperature=temperature
    )
    max_new = int(sampler.config.max_new_tokens)
    t0, env_s0 = time.perf_counter(), state.timing["env_s"]
    slots = slot_sampler.empty()
    pending = collections.deque(state.live)  # games waiting for a slot, in order
    prepared: dict[int, list[int]] = {}  # a waiting game's next prompt, tokenized ahead
    slot_env = [-1] * n_slots
    stepping: dict[int, tuple[int, _Reply]] = {}  # pool ticket -> (env, its reply)
    busy_steps, in_flight = 0, None  # in_flight: (steps device scalar, busy slots) of the dispatched chunk
    while pending or stepping or any(e >= 0 for e in slot_env):
        if stepping:  # take the answered games; wait for one only when no slot has work
            idle = in_flight is None and not pending and all(e < 0 for e in slot_env)
            t1 = time.perf_counter()
            answered = pool.poll(timeout=None if idle else 0.0)
            state.timing["env_s"] += time.perf_counter() - t1
            for ticket, res in answered:
                i, rep = stepping.pop(ticket)
                if _book(state, i, rep, res, rcfg, max_new):
                    pending.append(i)
                    prepared[i] = _turn_prompts(state, tokenizer, rcfg, [i])[0]  # overlaps the running chunk
        if in_flight is not None:
            t1 = time.perf_counter()
            busy_steps += in_flight[1] * slot_sampler.steps_run(in_flight[0])
            state.timing["decode_s"] += time.perf_counter() - t1
            in_flight = None
        done = slot_sampler.done(slots)  # synced: no chunk is in flight here (a writable copy)
        ready = [k for k, e in enumerate(slot_env) if e >= 0 and done[k]]
        finished = None
        if ready:  # read before the next chunk: its call donates ``slots``
            finished = [slot_env[k] for k in ready], slot_sampler.read(slots, ready)
            for k in ready:
                slot_env[k] = -1
        free = [k for k, e in enumerate(slot_env) if e < 0]
        if pending and free:
            envs = [pending.popleft() for _ in range(min(len(pending), len(free)))]
            ids = free[: len(envs)]
            late = [i for i in envs if i not in prepared]
            prepared.update(zip(late, _turn_prompts(state, tokenizer, rcfg, late)))
            prompts = [prepared.pop(i) for i in envs]
            for k, i, p in zip(ids, envs, prompts):
                slot_env[k] = i
                state.prompts[i] = p
                state.labels[i] = None
            if labeler is not None:
                for i, lab in zip(envs, labeler(list(envs))):
                    state.labels[i] = lab
            keys = turn_keys(state.keys[envs], [state.episodes[i].length for i in envs])
            t1 = time.perf_counter()
            # not waited for: the chunk below queues behind it, the host goes on to the replies
            slots = slot_sampler.insert(slots, prompts, ids, keys)
            state.timing["prefill_s"] += time.perf_counter() - t1
            done[ids] = False  # unknown until the chunk: one ending at its first token makes it run 0 steps
        busy = sum(e >= 0 for e in slot_env)
        if any(e >= 0 and not done[k] for k, e in enumerate(slot_env)):
            slots, steps = slot_sampler.decode(slots, False)
            in_flight = (steps, busy)
        if finished is None:
            continue
        envs, out = finished
        prompts, labels = [state.prompts[i] for i in envs], [state.labels[i] for i in envs]
        replies = _replies(out, prompts, labels, sampler, tokenizer, rcfg)
        t1 = time.perf_counter()
        tickets = pool.submit([StepJob(i, rep.action) for i, rep in zip(envs, replies)])
        state.timing["env_s"] += time.perf_counter() - t1
        stepping.update(zip(tickets, zip(envs, replies)))
    # env time (submit, poll, waits with no slot busy) is not sampling time
    state.timing["sampling_s"] += time.perf_counter() - t0 - (state.timing["env_s"] - env_s0)
    state.live = []
    state.stats["turns"] = max((ep.length for ep in state.episodes), default=0)
    c = slot_sampler.counters
    state.slot_stats = dict(
        slots=n_slots,
        decode_steps=c["decode_steps"],
        busy_steps=busy_steps,
        slot_steps=c["decode_steps"] * n_slots,
        chunks=c["chunk_calls"],
        inserts=c["insert_calls"],
    )


def _advance(ep: Episode, res, net_reward: float, valid: bool, max_steps: int) -> bool:
    """Books one step's pool result into the episode; returns whether the game is over."""
    ep.episode_return += net_reward
    ep.length += 1
    ep.invalid_count += not valid
    if "task_score" in res.info:
        ep.score = float(res.info["task_score"])
    if res.fault is not None:
        ep.env_error, ep.env_error_detail = res.fault, res.detail
    ep.won = bool(res.obs.won)
    done = bool(res.done) or ep.env_error is not None or ep.length >= max_steps
    if done:
        ep.truncated = bool(res.info.get("truncated", False)) or (
            not ep.won and ep.env_error is None and ep.length >= max_steps
        )
    return done


def _pack(rows: list[StepRecord], sampler, tokenizer, num_groups: int, rcfg: RolloutConfig):
    """The rows (canonical order) as token arrays and a fixed-shape ``StepBatch``.

    Returns (prompt_ids int32[N, P], prompt_mask int32[N, P], response_ids int32[N, M],
    response_mask int32[N, M], sample_logprobs float32[N, M], steps), P the sampler's length bucket
    of the longest prompt.
    """
    n_rows = len(rows)
    p_max = max(len(r.prompt) for r in rows)
    length_bucket = getattr(sampler, "length_bucket", None)
    width = length_bucket(p_max) if callable(length_bucket) else p_max
    pad_id = getattr(sampler, "pad_id", None)
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids = np.full((n_rows, width), pad_id, np.int32)
    prompt_mask = np.zeros((n_rows, width), np.int32)
    for k, r in enumerate(rows):
        prompt_ids[k, width - len(r.prompt) :] = r.prompt
        prompt_mask[k, width - len(r.prompt) :] = 1
    response_ids = np.stack([r.tokens for r in rows]).astype(np.int32)
    sample_logprobs = np.stack([r.logprobs for r in rows]).astype(np.float32)
    resp_len = np.array([r.length for r in rows], np.int32)
    response_mask = (np.arange(response_ids.shape[1])[None, :] < resp_len[:, None]).astype(np.int32)
    # The StepBatch has a fixed shape per (groups, G, max_steps): rows padded to the most a collect
    # can produce (mask False), static capacities set, so the jitted estimator compiles once a run.
    row_cap = num_groups * rcfg.group_size * rcfg.max_steps

    def padded(values, dtype, fill=0):
        out = np.full((row_cap,) + np.shape(values)[1:], fill, dtype)
        out[:n_rows] = values
        return out

    steps = StepBatch.from_numpy(
        group_id=padded([r.group for r in rows], np.int32),
        traj_id=padded([r.traj for r in rows], np.int32),
        step=padded([r.step for r in rows], np.int32),
        reward=padded([r.reward for r in rows], np.float32),
        penalty=padded([r.penalty for r in rows], np.float32),
        obs_hash=padded(
            similarity_groups([r.anchor for r in rows], [r.group for r in rows], rcfg.similarity_thresh), np.int32
        ),
        fingerprint=padded(np.stack([r.fingerprint for r in rows]), np.float32),
        action_key=padded(assign_ids([r.pace for r in rows]), np.int32, fill=-1),
        mask=padded(np.ones(n_rows, bool), bool, fill=False),
        group_capacity=num_groups,
        row_capacity=-(-rcfg.group_size * rcfg.max_steps // 16) * 16,
    )
    return prompt_ids, prompt_mask, response_ids, response_mask, sample_logprobs, steps


def _episode_stats(
    counters: dict[str, int], rows: list[StepRecord], episodes: list[Episode], played: int, reset_faults: int
) -> HostStats:
    """``RolloutResult.host_stats``: the turn counters, rates as (numerator, denominator) and fault
    counts of one call (rows: the kept rows; played: every row, the faulted games' included)."""
    errors = [ep.env_error for ep in episodes if ep.env_error is not None]
    n = len(rows)
    finished = [ep.won for ep in episodes if ep.env_error is None]
    counts = {k: v for k, v in counters.items() if k != "turns"}
    counts.update(
        rows=n,
        env_errors=len(errors),
        **{f"env_errors_{kind}": sum(e == kind for e in errors) for kind in ENV_ERRORS},
        env_error_rows=played - n,
        reset_faults=reset_faults,
    )
    rates = {
        "invalid_rate": (sum(not r.valid for r in rows), n),
        **{f"finish_{why}_rate": (sum(r.finish == why for r in rows), n) for why in ("eos", "stop", "length")},
        "success_rate": (sum(finished), len(finished)),
    }
    maxima = {"turns": counters["turns"], "prompt_tokens_max": max(len(r.prompt) for r in rows)}
    return HostStats(
        {k: int(v) for k, v in counts.items()},
        {k: (float(a), float(b)) for k, (a, b) in rates.items()},
        {k: float(v) for k, v in maxima.items()},
    )


def _kept_rows(state: _Games, game: str) -> list[StepRecord]:
    """The rows of the games without a fault, in canonical order (group, traj, step).

    Raises:
      RuntimeError: no row is left (every game faulted or was over at reset).
    """
    faulted = {ep.traj_id for ep in state.episodes if ep.env_error is not None}
    rows = [r for r in state.rows if r.traj not in faulted]
    if not rows:
        kinds = sorted({str(ep.env_error) for ep in state.episodes if ep.env_error is not None})
        raise RuntimeError(
            f"collect: no {game} step to train on: {len(state.rows)} rows played, {len(faulted)} of "
            f"{len(state.episodes)} games failed (env errors: {kinds or 'none'}), the rest were over at reset"
        )
    # rows of one traj were appended in step order: a stable sort keeps it
    return sorted(rows, key=lambda r: (r.group, r.traj, r.step))


def collect(
    actor,
    sampler: Engine,
    pool,
    tokenizer,
    games: Sequence[tuple[int, int]],
    rcfg: RolloutConfig,
    key: jax.Array,
    progress: bool | str = True,
    labeler: Callable[[list[int]], Sequence[str | None]] | None = None,
    scheduler: str | None = None,
    temperature: float | None = None,
) -> RolloutResult:
    """Plays G rollouts of every task in lockstep and returns the step rows.

    Args:
      actor: the current policy, passed to ``sampler.generate`` every turn.
      sampler: an ``Engine`` (or any object with ``generate(actor, prompts, key) -> SampleOutput`` and
        ``config``).
      pool: an ``environments.pool.EnvPool`` with at least ``len(games) * group_size`` envs; envs
        ``0 .. n-1`` are used, env ``k * G + g`` plays rollout g of task group k. Lockstep calls its
        ``reset`` / ``step``; continuous also its ``submit`` / ``poll`` (a game steps while others decode).
      tokenizer: the actor's tokenizer (chat template, encode, decode).
      games: one ``(task_id, seed)`` pair per task group.
      rcfg: ``RolloutConfig``.
      key: ``jax.random`` key; turn t of a game samples with ``turn_keys(game_keys(key, games, G), t)``,
        its own (game, turn) key, so its tokens do not depend on the other games (a sampler whose
        ``generate`` takes no ``row_keys`` gets ``fold_in(key, t)`` for the whole turn).
      progress: show a tqdm bar over turns (live games, tokens/s); a string is the bar's label
        (default ``"rollout <game>"``).
      labeler: called each turn with the live env indices before they step; returns one label per env
        for the state its prompt shows (DAgger: ``pool.oracle_actions``). Kept in ``RolloutResult.labels``.
      scheduler: ``"lockstep"`` or ``"continuous"`` (``Scheduler``); None takes ``rcfg.scheduler``. Both
        give the same ``RolloutResult`` (timing aside) for the same keys; continuous needs a real
        ``Engine`` and adds ``timing["decode_steps"]`` and ``stats["slot_use"]``.
      temperature: the sampling temperature of this collect (``Engine.generate``'s per-call argument);
        None takes the engine's ``config.temperature``.

    Returns:
      ``RolloutResult`` (see its docstring).

    Raises:
      ValueError: no or malformed ``games``, a pool too small or of another game (or without
        ``submit`` / ``poll`` for continuous), ``max_prompt_length`` above the sampler's largest bucket.
      PromptTooLongError: a prompt does not fit even with no history (names game, env, task, step).
      RuntimeError: every game faulted or was over at reset (no row to train on).
    """
    t_start = time.perf_counter()
    games = _check_inputs(sampler, pool, games, rcfg)
    scheduler = rcfg.scheduler if scheduler is None else scheduler
    if scheduler not in tuple(Scheduler):
        raise ValueError(f"collect: scheduler must be one of {tuple(map(str, Scheduler))}, got {scheduler!r}")
    if scheduler == Scheduler.CONTINUOUS and not (hasattr(pool, "submit") and hasattr(pool, "poll")):
        raise ValueError("collect: scheduler='continuous' needs a pool with submit/poll (environments.pool.EnvPool)")
    state, reset_faults = _new_games(pool, rcfg, games, key)
    if scheduler == Scheduler.CONTINUOUS and state.live:
        _play_continuous(state, actor, sampler, pool, tokenizer, rcfg, labeler, temperature)
    _play_lockstep(state, actor, sampler, pool, tokenizer, rcfg, key, labeler, progress, temperature)
    return _result(state, sampler, tokenizer, len(games), rcfg, reset_faults, t_start, labeled=labeler is not None)


def _play_lockstep(
    state: _Games, actor, sampler, pool, tokenizer, rcfg, key, labeler, progress: bool | str, temperature=None
) -> None:
    """Every live game one turn per sampler call until none is left or ``rcfg.max_steps`` turns."""
    bar = None
    if progress and state.live:
        from tqdm.auto import tqdm

        desc = progress if isinstance(progress, str) else f"rollout {rcfg.game}"
        bar = tqdm(total=rcfg.max_steps, desc=desc, unit="turn", leave=False)
    try:
        for turn in range(rcfg.max_steps):
            if not state.live:
                break
            tok_s = _play_turn(
                state, actor, sampler, pool, tokenizer, rcfg, jax.random.fold_in(key, turn), labeler, temperature
            )
            if bar is not None:
                bar.update(1)
                bar.set_postfix(live=len(state.live), tok_s=f"{tok_s:.0f}")
    finally:
        if bar is not None:
            bar.close()


def _result(
    state: _Games, sampler, tokenizer, n_groups: int, rcfg, reset_faults: int, t_start: float, labeled: bool
) -> RolloutResult:
    """The played games' ``RolloutResult``: kept rows packed, timing closed, statistics counted."""
    rows = _kept_rows(state, rcfg.game)
    prompt_ids, prompt_mask, response_ids, response_mask, sample_logprobs, steps = _pack(
        rows, sampler, tokenizer, n_groups, rcfg
    )
    timing = state.timing
    timing["total_s"] = time.perf_counter() - t_start
    timing["host_s"] = timing["total_s"] - timing["sampling_s"] - timing["env_s"]
    host_stats = _episode_stats(state.stats, rows, state.episodes, len(state.rows), reset_faults)
    if state.slot_stats:
        for k in ("decode_steps", "chunks", "inserts"):
            timing[k] = float(state.slot_stats[k])
        # busy slot-steps over slot-steps offered: pools over hosts as a rate
        use = (float(state.slot_stats["busy_steps"]), float(state.slot_stats["slot_steps"]))
        host_stats = dataclasses.replace(host_stats, rates={**host_stats.rates, "slot_use": use})
    return RolloutResult(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        sample_logprobs=sample_logprobs,
        steps=steps,
        episodes=state.episodes,
        timing=timing,
        stats=host_stats.values(),
        responses=[r.text for r in rows],
        actions=[r.action for r in rows],
        finish_reasons=[r.finish for r in rows],
        labels=[r.label for r in rows] if labeled else None,
        observations=[r.observation for r in rows],
        states=[r.state for r in rows],
        valid=[r.valid for r in rows],
        host_stats=host_stats,
    )
