"""Multi-turn rollout: every live game of every task group advances one turn per sampler call.

``collect`` plays ``len(task_ids) * group_size`` games in lockstep. Each turn, for every game still
running: the game's prompt (``environments.prompts.build_prompt``, wrapped in the tokenizer's chat
template as the user message) is tokenized; one ``Sampler.generate`` call answers all of them; each
response is parsed into a command (``parse_action``); invalid responses are charged
``invalid_penalty`` and the game receives ``fallback_action`` instead; the pool steps every game at
once. Games end when the game says so, when they reach ``max_steps``, or on an environment error.

Every (trajectory, step) becomes one row of the output, in the canonical order of the estimator
contract (ascending group, trajectory, step; ``docs/estimators.md``): the token arrays the trainer needs
(prompt, response, masks, sampling log-probs) and a ``StepBatch`` with the same rows:

* ``group_id``: task group index k (the k-th entry of ``task_ids``).
* ``traj_id``: game index ``k * group_size + g`` (the pool's env index).
* ``step``: turn index inside the trajectory, 0..T-1.
* ``reward``: ``success_reward * env_reward`` (the game's part).
* ``penalty``: ``invalid_penalty * (response invalid)``, kept apart so the estimator can charge it to
  its own row (``EstimatorConfig.penalty="own_row"``); the default ``"in_reward"`` uses
  ``reward - penalty``, the step's net reward.
* ``obs_hash``: ``assign_ids`` of the anchor text of the observation the prompt showed.
* ``fingerprint``: the sampler's prompt fingerprint (hidden state at the last prompt token).
* ``action_key``: ``assign_ids`` of the PACE key: ``action_tag(response)`` or the first 8 response
  token ids (``first_tokens``); an unparsable response gets -1.

Prompt length: a prompt over ``max_prompt_length`` tokens is rebuilt with fewer history entries,
oldest dropped first, and counted in ``stats["truncations"]``; a prompt that is too long even with
no history raises ``PromptTooLongError`` naming the game, the env, the task and the step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from bipace_jax.batch import TokenBatch  # re-exported: the rollout emits it, the learner consumes it
from bipace_jax.estimators import StepBatch, assign_ids
from bipace_jax.sampling import Sampler, SamplerConfig, truncate_at_stop
from environments.pool import ENV_ERRORS
from environments.prompts import action_tag, build_prompt, invalid_command, parse_action

__all__ = [
    "Episode",
    "FIRST_TOKENS",
    "PromptTooLongError",
    "RolloutConfig",
    "RolloutResult",
    "StepRecord",
    "TokenBatch",
    "chat_prompt_ids",
    "collect",
    "encode_prompt",
    "finish_reason",
]

#: Number of response tokens in the ``first_tokens`` PACE key (``docs/estimators.md``, "PACE keys").
FIRST_TOKENS = 8
_ACTION_KEYS = ("action_tag", "first_tokens")
#: How a response is scored when it used the whole token budget (finish reason ``length``).
LENGTH_FINISH = ("parse", "invalid", "unpenalised")
INVALID_ACTIONS = ("fallback", "projected")
RESEED_STRIDE = 1_000_003  # retry k of a task group's reset uses seed + k * RESEED_STRIDE


class PromptTooLongError(ValueError):
    """A prompt does not fit ``max_prompt_length`` tokens even with no history shown."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How games are played and scored.

    Attributes:
      game: environment name (``environments.make``); selects the prompt template.
      group_size: G, rollouts per task group (all from the same task id and seed).
      max_steps: turns per game at most; a game still running after it ends (``truncated``).
      history_length: earlier (observation, action) pairs shown in the prompt (verl-agent: 2).
      max_prompt_length: most prompt tokens (>= 16; chat template included); must not exceed the sampler's
        largest length bucket.
      invalid_penalty: (>= 0) subtracted from a step's reward when its response has no parsable action.
      success_reward: (> 0) multiplies the game's own reward (1.0 on success) (verl-agent: 10).
      fallback_action: the command sent to the game for an invalid response.
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
      reset_retries: (>= 0) times a task group whose reset faulted (``env_error`` from the pool) is
        reset again, all G envs together, on a fresh seed (seed + k * ``RESEED_STRIDE`` on retry k);
        envs still failing after that are dropped (0: drop at once). Either way the game counts in
        ``stats["env_errors"]``.
      action_key: PACE key: ``"action_tag"`` or ``"first_tokens"``.
      show_inventory: show the inventory in the prompt (``build_prompt(show_inventory=...)``).
      system_prompt: system message; None leaves the chat template's default (Qwen2.5 inserts its own).
      template: None, or a mapping of ``PromptTemplate`` fields overriding the game's default.
      sampler: the ``SamplerConfig`` the caller builds its ``Sampler`` from (``collect`` uses the
        ``Sampler`` it is given).
    """

    game: str = "textcraft"
    group_size: int = 8
    max_steps: int = 50
    history_length: int = 2
    max_prompt_length: int = 2048
    invalid_penalty: float = 0.1
    success_reward: float = 10.0
    fallback_action: str = "inventory"
    require_think: bool = False
    reject_cjk: bool = False
    invalid_action: str = "fallback"
    projection_chars: int = 30
    length_finish: str = "parse"
    reset_retries: int = 1
    action_key: str = "action_tag"
    show_inventory: bool = False
    system_prompt: str | None = None
    template: Any = None
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)

    def __post_init__(self):
        ints = (("group_size", 1), ("max_steps", 1), ("history_length", 0), ("max_prompt_length", 16))
        for name, lo in (*ints, ("reset_retries", 0), ("projection_chars", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"RolloutConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.invalid_action not in INVALID_ACTIONS:
            raise ValueError(
                f"RolloutConfig.invalid_action must be one of {INVALID_ACTIONS}, got {self.invalid_action!r}"
            )
        if self.length_finish not in LENGTH_FINISH:
            raise ValueError(f"RolloutConfig.length_finish must be one of {LENGTH_FINISH}, got {self.length_finish!r}")
        if self.action_key not in _ACTION_KEYS:
            raise ValueError(f"RolloutConfig.action_key must be one of {_ACTION_KEYS}, got {self.action_key!r}")
        if not isinstance(self.fallback_action, str) or not self.fallback_action.strip():
            raise ValueError(f"RolloutConfig.fallback_action must be a non-empty str, got {self.fallback_action!r}")
        for name, lo, ok in (("invalid_penalty", ">= 0", np.greater_equal), ("success_reward", "> 0", np.greater)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and ok(v, 0)):
                raise ValueError(f"RolloutConfig.{name} must be a finite number {lo}, got {v!r}")
        if not isinstance(self.sampler, SamplerConfig):
            raise ValueError(f"RolloutConfig.sampler must be a SamplerConfig, got {type(self.sampler).__name__}")


@dataclasses.dataclass
class Episode:
    """One game of a ``collect`` call.

    Attributes:
      task_id, seed: the game played; ``group_id``: its task group; ``traj_id``: its pool env index.
      won: the game reported success. ``length``: steps taken. ``invalid_count``: unparsable responses.
      episode_return: undiscounted sum of the net step rewards (success term minus invalid-action charges).
      env_error: the pool's fault kind (``environments.pool.ENV_ERRORS``) when the game failed at
        reset or mid-game, else None; such a game's rows are left out of the batch (its return is
        not the game's), it is not counted in ``success_rate``.
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
    env_error: str | None = None
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
        masked rows to ``len(task_ids) * group_size * max_steps`` rows and fixed capacities
        (``group_capacity`` = task groups, ``row_capacity`` = G * max_steps rounded up to 16), so
        its shape, and the estimator's compiled program, is the same every call.
      episodes: one ``Episode`` per trajectory, in traj order.
      timing: seconds spent in ``sampling_s`` (sampler calls; of which ``prefill_s`` and ``decode_s`` as the
        sampler reports them), ``env_s`` (pool reset/step) and ``host_s`` (prompts, tokenization, parsing,
        assembling), and ``total_s``.
      stats: ``truncations`` (prompts whose history was cut), ``history_dropped`` (entries cut),
        ``turns``, ``rows``, ``response_tokens``, ``prompt_tokens_max``, ``finish_eos_rate``, ``finish_stop_rate``, ``finish_length_rate`` (why responses ended), ``budget_hits`` (responses that
        used all M tokens without EOS or stop text), ``invalid_rate``, ``success_rate`` (of the games
        without a fault), ``env_errors`` (games that failed at reset or mid-game: ``Episode.env_error``;
        ``env_errors_<kind>`` per kind of ``ENV_ERRORS``, "lost" being a worker mate's fault)
        ``env_error_rows`` (their rows, left out of the batch) and ``reset_faults`` (env resets that
        faulted, including those a retry repaired).
      responses: N decoded response texts (cut after the stop text); ``actions``: N commands sent.
      finish_reasons: N of ``"eos"``, ``"stop"`` or ``"length"``: why each response ended.
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


def _check_inputs(sampler, pool, task_ids, seeds, rcfg):
    if not isinstance(rcfg, RolloutConfig):
        raise TypeError(f"rcfg must be a RolloutConfig, got {type(rcfg).__name__}")
    task_ids, seeds = list(task_ids), list(seeds)
    if not task_ids:
        raise ValueError("task_ids must hold at least one task id, got none")
    if len(seeds) != len(task_ids):
        raise ValueError(f"seeds must have one entry per task group: {len(task_ids)} task_ids, {len(seeds)} seeds")
    n = len(task_ids) * rcfg.group_size
    if len(pool) < n:
        raise ValueError(
            f"pool has {len(pool)} envs, fewer than len(task_ids) * group_size = "
            f"{len(task_ids)} * {rcfg.group_size} = {n}"
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
    return task_ids, seeds, n


def _start_games(pool, rcfg: RolloutConfig, env_task: list[int], env_seed: list[int]):
    """Resets envs ``0 .. len(env_task)-1``; a task group with a faulted env is reset again, all of it,
    on a fresh seed, up to ``rcfg.reset_retries`` times (``env_seed`` is updated in place).

    Returns (observations, task infos, fault kinds, faults seen): one per env, the kind None for a
    game that runs; the count includes faults that a retry repaired.
    """
    n, g_size = len(env_task), rcfg.group_size
    obs: list[Any] = [None] * n
    infos: list[dict] = [{} for _ in range(n)]
    errors: list[str | None] = [None] * n
    base_seed = list(env_seed)
    todo, faults = list(range(n)), 0
    for attempt in range(rcfg.reset_retries + 1):
        for i in todo:
            env_seed[i] = base_seed[i] + attempt * RESEED_STRIDE
        results = pool.reset(todo, [env_task[i] for i in todo], [env_seed[i] for i in todo])
        for i, res in zip(todo, results):
            obs[i], errors[i] = res.obs, res.info.get("env_error")
        started = [i for i in todo if errors[i] is None]
        for i, info in zip(started, pool.task_info(started) if started else []):
            errors[i] = info.get("env_error")
            infos[i] = {} if errors[i] else info
        faults += sum(errors[i] is not None for i in todo)
        failed_groups = sorted({i // g_size for i in todo if errors[i] is not None})
        todo = [i for g in failed_groups for i in range(g * g_size, (g + 1) * g_size)]
        if not todo:
            break
    return obs, infos, errors, faults


def collect(
    actor,
    sampler: Sampler,
    pool,
    tokenizer,
    task_ids: Sequence[int],
    seeds: Sequence[int],
    rcfg: RolloutConfig,
    key: jax.Array,
    progress: bool = True,
    labeler: Callable[[list[int]], Sequence[str | None]] | None = None,
) -> RolloutResult:
    """Plays G rollouts of every task in lockstep and returns the step rows.

    Args:
      actor: the current policy, passed to ``sampler.generate`` every turn.
      sampler: a ``Sampler`` (or any object with ``generate(actor, prompts, key) -> SampleOutput`` and
        ``config``).
      pool: an ``environments.pool.EnvPool`` with at least ``len(task_ids) * group_size`` envs; envs
        ``0 .. n-1`` are used, env ``k * G + g`` plays rollout g of task group k.
      tokenizer: the actor's tokenizer (chat template, encode, decode).
      task_ids, seeds: one task id and seed per task group.
      rcfg: ``RolloutConfig``.
      key: ``jax.random`` key; turn t samples with ``fold_in(key, t)``.
      progress: show a tqdm bar over turns (live games, tokens/s).
      labeler: called each turn with the live env indices before they step; returns one label per env
        for the state its prompt shows (DAgger: ``pool.oracle_actions``). Kept in ``RolloutResult.labels``.

    Returns:
      ``RolloutResult`` (see its docstring).

    Raises:
      ValueError: mismatched ``task_ids``/``seeds``, a pool too small or of another game,
        ``max_prompt_length`` above the sampler's largest bucket.
      PromptTooLongError: a prompt does not fit even with no history (names game, env, task, step).
    """
    t_start = time.perf_counter()
    task_ids, seeds, n = _check_inputs(sampler, pool, task_ids, seeds, rcfg)
    g_size = rcfg.group_size
    env_idx = list(range(n))
    env_task = [int(task_ids[i // g_size]) for i in env_idx]
    env_seed = [int(seeds[i // g_size]) for i in env_idx]
    timing = {"sampling_s": 0.0, "env_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0}
    stop_strings = tuple(getattr(sampler.config, "stop_strings", ()))
    max_new = int(sampler.config.max_new_tokens)
    eos = set(getattr(sampler, "eos_token_ids", ()))

    t0 = time.perf_counter()
    obs, infos, errors, reset_faults = _start_games(pool, rcfg, env_task, env_seed)
    timing["env_s"] += time.perf_counter() - t0

    history: list[list[tuple[str, str]]] = [[] for _ in env_idx]
    episodes = [
        Episode(
            task_id=env_task[i],
            seed=env_seed[i],
            group_id=i // g_size,
            traj_id=i,
            task_info=dict(infos[i] or {}),
            env_error=errors[i],
        )
        for i in env_idx
    ]
    live = [i for i in env_idx if errors[i] is None and not obs[i].won]
    rows: list[StepRecord] = []
    stats = dict(truncations=0, history_dropped=0, turns=0, response_tokens=0, budget_hits=0)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=rcfg.max_steps, desc=f"rollout {rcfg.game}", unit="turn", leave=False)
    try:
        for turn in range(rcfg.max_steps):
            if not live:
                break
            prompts = []
            for i in live:
                where = f"env {i} (task {env_task[i]}, seed {env_seed[i]})"
                ids, dropped = encode_prompt(tokenizer, rcfg, obs[i], history[i], episodes[i].length, where)
                stats["truncations"] += dropped > 0
                stats["history_dropped"] += dropped
                prompts.append(ids)
            labels = list(labeler(list(live))) if labeler is not None else [None] * len(live)
            t0 = time.perf_counter()
            out = sampler.generate(actor, prompts, jax.random.fold_in(key, turn))
            dt_sample = time.perf_counter() - t0
            timing["sampling_s"] += dt_sample
            for k in ("prefill_s", "decode_s"):
                timing[k] += float(getattr(sampler, "last_timing", {}).get(k, 0.0))
            lengths = np.asarray(out.lengths)
            texts = tokenizer.batch_decode(
                [out.tokens[r, : lengths[r]].tolist() for r in range(len(live))], skip_special_tokens=True
            )
            texts = [truncate_at_stop(t, stop_strings) for t in texts]
            finish = [finish_reason(out.tokens[r, : lengths[r]], texts[r], eos, stop_strings) for r in range(len(live))]
            actions, valid, penalised = [], [], []
            for text, why in zip(texts, finish):
                act, ok = parse_action(text, require_think=rcfg.require_think, reject_cjk=rcfg.reject_cjk)
                ok = ok and not (why == "length" and rcfg.length_finish != "parse")
                valid.append(ok)
                penalised.append(not ok and not (why == "length" and rcfg.length_finish == "unpenalised"))
                projected = invalid_command(text, act, rcfg.invalid_action, rcfg.fallback_action, rcfg.projection_chars)
                actions.append(act if ok else projected)
            t0 = time.perf_counter()
            results = pool.step(live, actions)
            timing["env_s"] += time.perf_counter() - t0
            still = []
            for r, i in enumerate(live):
                res = results[r]
                n_tok = int(lengths[r])
                toks = out.tokens[r, :n_tok]
                stats["response_tokens"] += n_tok
                stats["budget_hits"] += finish[r] == "length" and n_tok == max_new
                if rcfg.action_key == "action_tag":
                    pace = action_tag(texts[r])
                else:
                    pace = tuple(int(t) for t in toks[:FIRST_TOKENS])
                reward = rcfg.success_reward * float(res.reward)
                penalty = rcfg.invalid_penalty * penalised[r]
                ep = episodes[i]
                rows.append(
                    StepRecord(
                        traj=i,
                        group=i // g_size,
                        step=ep.length,
                        reward=reward,
                        penalty=penalty,
                        anchor=obs[i].anchor,
                        fingerprint=np.asarray(out.fingerprints[r], np.float32),
                        pace=pace,
                        prompt=prompts[r],
                        tokens=np.asarray(out.tokens[r]),
                        logprobs=np.asarray(out.logprobs[r]),
                        length=n_tok,
                        text=texts[r],
                        action=actions[r],
                        valid=valid[r],
                        finish=finish[r],
                        label=labels[r],
                    )
                )
                ep.episode_return += reward - penalty
                ep.length += 1
                ep.invalid_count += not valid[r]
                history[i].append((obs[i].text, actions[r]))
                obs[i] = res.obs
                if "task_score" in res.info:
                    ep.score = float(res.info["task_score"])
                if res.info.get("env_error"):
                    ep.env_error = str(res.info["env_error"])
                ep.won = bool(res.obs.won)
                done = bool(res.done) or ep.env_error is not None or ep.length >= rcfg.max_steps
                if done:
                    ep.truncated = bool(res.info.get("truncated", False)) or (
                        not ep.won and ep.env_error is None and ep.length >= rcfg.max_steps
                    )
                else:
                    still.append(i)
            live = still
            stats["turns"] += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(live=len(live), tok_s=f"{lengths.sum() / max(dt_sample, 1e-9):.0f}")
    finally:
        if bar is not None:
            bar.close()

    # Assemble in canonical order (group, traj, step): rows of one traj were appended in step order.
    faulted = {ep.traj_id for ep in episodes if ep.env_error is not None}
    played = len(rows)
    rows = [r for r in rows if r.traj not in faulted]
    if not rows:
        kinds = sorted({ep.env_error for ep in episodes if ep.env_error is not None})
        raise RuntimeError(
            f"collect: no {rcfg.game} step to train on: {played} rows played, {len(faulted)} of {len(episodes)} "
            f"games failed (env errors: {kinds or 'none'}), the rest were over at reset"
        )
    rows.sort(key=lambda r: (r.group, r.traj, r.step))
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
    row_cap = len(task_ids) * g_size * rcfg.max_steps

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
        obs_hash=padded(assign_ids([r.anchor for r in rows]), np.int32),
        fingerprint=padded(np.stack([r.fingerprint for r in rows]), np.float32),
        action_key=padded(assign_ids([r.pace for r in rows]), np.int32, fill=-1),
        mask=padded(np.ones(n_rows, bool), bool, fill=False),
        group_capacity=len(task_ids),
        row_capacity=-(-g_size * rcfg.max_steps // 16) * 16,
    )
    timing["total_s"] = time.perf_counter() - t_start
    timing["host_s"] = timing["total_s"] - timing["sampling_s"] - timing["env_s"]
    stats.update(
        rows=n_rows,
        prompt_tokens_max=p_max,
        invalid_rate=float(np.mean([not r.valid for r in rows])),
        **{f"finish_{why}_rate": float(np.mean([r.finish == why for r in rows])) for why in ("eos", "stop", "length")},
        success_rate=float(np.mean([ep.won for ep in episodes if ep.env_error is None] or [0.0])),
        env_errors=len(faulted),
        **{f"env_errors_{kind}": sum(ep.env_error == kind for ep in episodes) for kind in ENV_ERRORS},
        env_error_rows=played - n_rows,
        reset_faults=reset_faults,
    )
    return RolloutResult(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        sample_logprobs=sample_logprobs,
        steps=steps,
        episodes=episodes,
        timing=timing,
        stats=stats,
        responses=[r.text for r in rows],
        actions=[r.action for r in rows],
        finish_reasons=[r.finish for r in rows],
        labels=[r.label for r in rows] if labeler else None,
    )
