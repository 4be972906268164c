"""The host work of one turn, for both schedulers: the game state of a ``collect`` call (``Play``), its
start, keys, prompt encoding, and decode / score / book / advance of a response.

Keys: env ``k * G + g`` (rollout g of task group k) gets ``game_keys``, a function of what the game is,
and its turn t samples from ``turn_keys(game_key, t)``, so its tokens depend neither on the other games
nor on the scheduler.

Game boundary: every observation the pool returns passes ``clean_observation`` (a lone UTF-16
surrogate, which no tokenizer encodes, becomes U+FFFD); a game whose prompt does not fit
``max_prompt_length`` even with no history ends with ``Episode.env_error = PROMPT_TOO_LONG`` (its rows
dropped like a faulted game's) while the others play on.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bipace_jax.rollout.config import FIRST_TOKENS, RESEED_STRIDE, ActionKey, RolloutConfig
from bipace_jax.rollout.protocols import Clock, EngineLike, GamePort, SampleLike
from bipace_jax.rollout.records import Episode, StepRecord
from bipace_jax.sampling import key_data, truncate_at_stop
from environments.base import Observation
from environments.pool import Fault
from environments.prompts import action_tag, build_prompt, invalid_command, parse_action

__all__ = [
    "COUNTERS",
    "HostTurns",
    "PROMPT_TOO_LONG",
    "Play",
    "PromptTooLongError",
    "Reply",
    "book",
    "chat_prompt_ids",
    "clean_observation",
    "clean_text",
    "encode_prompt",
    "finish_reason",
    "game_keys",
    "prompt_of",
    "replies",
    "start",
    "turn_keys",
]

#: ``Episode.env_error`` of a game whose prompt does not fit ``max_prompt_length`` even with no history.
PROMPT_TOO_LONG = "prompt_too_long"
#: The turn counters of ``RolloutResult.stats`` kept while the games play.
COUNTERS = ("truncations", "history_dropped", "turns", "response_tokens", "budget_hits")
_SURROGATE = re.compile("[\ud800-\udfff]")


class PromptTooLongError(ValueError):
    """A prompt does not fit ``max_prompt_length`` tokens even with no history shown."""


def clean_text(text: str) -> str:
    """``text`` with every lone UTF-16 surrogate (U+D800..U+DFFF, not encodable as UTF-8) replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def clean_observation(obs: Observation) -> Observation:
    """``obs`` with its texts (``text``, ``anchor``, ``task``, ``inventory``, ``admissible_actions``)
    passed through ``clean_text``; the same object when none holds a surrogate."""
    fields = {}
    for name in ("text", "anchor", "task", "inventory"):
        v = getattr(obs, name)
        if isinstance(v, str) and clean_text(v) is not v:
            fields[name] = clean_text(v)
    if obs.admissible_actions is not None and any(clean_text(a) is not a for a in obs.admissible_actions):
        fields["admissible_actions"] = [clean_text(a) for a in obs.admissible_actions]
    return dataclasses.replace(obs, **fields) if fields else obs


def chat_prompt_ids(tokenizer, user_text: str, system_prompt: str | None) -> list[int]:
    """Token ids of one chat-formatted turn, ending with the opened assistant turn.

    ``apply_chat_template`` of an optional system message (omitted when ``system_prompt`` is None)
    and the user message, ``add_generation_prompt=True``; exactly what the engine is fed each turn
    (warm-start data uses it too, so behaviour cloning sees the RL loop's prompts).
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": user_text})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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
    """uint32[B, 2]: ``fold_in(keys[b], turns[b])``, the engine key of each game's turn (``game_keys`` rows)."""
    # NumPy arguments straight into the jitted program: a ``jnp.asarray`` each would dispatch on its own
    return np.asarray(_fold_rows(np.asarray(keys, np.uint32), np.asarray(turns, np.uint32)), np.uint32)


@dataclasses.dataclass
class Play:
    """The running state of one ``collect`` call's games (env ``i`` plays rollout ``i % G`` of group ``i // G``);
    ``rows`` are appended as the steps are booked, ``reset_s`` is the pool's reset time."""

    rcfg: RolloutConfig
    obs: list[Any]  # each env's current Observation
    history: list[list[tuple[str, str]]]  # each env's (observation text, action sent), oldest first
    episodes: list[Episode]
    live: list[int]  # envs playing at the start, ascending
    keys: np.ndarray  # uint32[n_envs, 2] each game's key (``game_keys``)
    labeler: Callable[[list[int]], Sequence[Any]] | None = None
    rows: list[StepRecord] = dataclasses.field(default_factory=list)
    stats: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    reset_s: float = 0.0


def _reset(pool: GamePort, rcfg: RolloutConfig, env_task: list[int], env_seed: list[int]):
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
            obs[i], errors[i] = clean_observation(res.obs), res.fault
        started = [i for i in todo if errors[i] is None]
        for i, res in zip(started, pool.task_info(started) if started else []):
            errors[i], infos[i] = res.fault, res.info
        faults += sum(errors[i] is not None for i in todo)
        failed_groups = sorted({i // g_size for i in todo if errors[i] is not None})
        todo = [i for g in failed_groups for i in range(g * g_size, (g + 1) * g_size)]
        if not todo:
            break
    return obs, infos, errors, faults


def start(pool: GamePort, rcfg: RolloutConfig, games: list[tuple[int, int]], key, clock: Clock, labeler=None):
    """Resets the ``len(games) * G`` envs; returns their ``Play`` and the count of reset faults."""
    g_size = rcfg.group_size
    env_task = [games[i // g_size][0] for i in range(len(games) * g_size)]
    env_seed = [games[i // g_size][1] for i in range(len(games) * g_size)]
    t0 = clock.now()
    obs, infos, errors, reset_faults = _reset(pool, rcfg, env_task, env_seed)
    dt = clock.now() - t0
    episodes = [
        Episode(task_id=t, seed=s, group_id=i // g_size, traj_id=i, task_info=dict(infos[i]), env_error=errors[i])
        for i, (t, s) in enumerate(zip(env_task, env_seed))
    ]
    live = [i for i, ep in enumerate(episodes) if ep.env_error is None and not obs[i].won]
    keys = game_keys(key, games, g_size)
    history = [[] for _ in episodes]
    play = Play(rcfg=rcfg, obs=obs, history=history, episodes=episodes, live=live, keys=keys, labeler=labeler)
    play.reset_s = dt
    return play, reset_faults


def prompt_of(play: Play, tokenizer, i: int) -> list[int] | None:
    """Env ``i``'s next prompt, history shortened to fit (counted in ``stats``); None when it does not fit
    even with no history: the game then ends with ``env_error = PROMPT_TOO_LONG``."""
    ep = play.episodes[i]
    where = f"env {i} (task {ep.task_id}, seed {ep.seed})"
    try:
        ids, dropped = encode_prompt(tokenizer, play.rcfg, play.obs[i], play.history[i], ep.length, where)
    except PromptTooLongError as e:
        ep.env_error, ep.env_error_detail = PROMPT_TOO_LONG, str(e)
        return None
    play.stats["truncations"] += dropped > 0
    play.stats["history_dropped"] += dropped
    return ids


@dataclasses.dataclass
class Reply:
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


def _decode(out: SampleLike, engine: EngineLike) -> tuple[list[str], list[str]]:
    """The response texts (cut after the stop text) and finish reasons of one engine output's rows."""
    stop_strings = tuple(engine.config.stop_strings)
    eos = set(engine.eos_token_ids)
    lengths = np.asarray(out.lengths)
    rows = range(len(lengths))
    texts = engine.tokenizer.batch_decode(
        [np.asarray(out.tokens[r, : lengths[r]]).tolist() for r in rows], skip_special_tokens=True
    )
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


def replies(out: SampleLike, prompts, labels, engine: EngineLike, rcfg: RolloutConfig) -> list[Reply]:
    """The rows of one engine output, decoded and scored, each with its prompt and label."""
    texts, finish = _decode(out, engine)
    actions, valid, penalised = _score(texts, finish, rcfg)
    lengths = np.asarray(out.lengths)
    return [
        Reply(
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


def book(play: Play, i: int, rep: Reply, res, max_new: int) -> bool:
    """Books game ``i``'s step (its reply and the pool's result) as a row; returns whether it plays on."""
    rcfg = play.rcfg
    play.stats["response_tokens"] += rep.length
    play.stats["budget_hits"] += rep.finish == "length" and rep.length == max_new
    if rcfg.action_key == ActionKey.ACTION_TAG:
        pace = action_tag(rep.text)
    else:
        pace = tuple(int(t) for t in rep.tokens[: min(rep.length, FIRST_TOKENS)])
    reward = rcfg.success_reward * float(res.reward)
    penalty = rcfg.invalid_penalty * rep.penalised
    ep, obs = play.episodes[i], play.obs[i]
    play.rows.append(
        StepRecord(
            traj=i,
            group=ep.group_id,
            step=ep.length,
            reward=reward,
            penalty=penalty,
            anchor=obs.anchor,
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
            observation=obs.text,
            state=obs,
        )
    )
    play.history[i].append((obs.text, rep.action))
    play.obs[i] = clean_observation(res.obs)
    return not _advance(ep, res, reward - penalty, rep.valid, rcfg.max_steps)


class HostTurns:
    """``protocols.TurnPort`` of a ``collect`` call: its ``Play`` and the engine's tokenizer and settings."""

    def __init__(self, play: Play, engine: EngineLike):
        self.play, self.engine = play, engine
        self.live = play.live
        self.max_new = int(engine.config.max_new_tokens)

    def prompt(self, env: int) -> list[int] | None:
        return prompt_of(self.play, self.engine.tokenizer, env)

    def row_keys(self, envs: Sequence[int]) -> np.ndarray:
        return turn_keys(self.play.keys[list(envs)], [self.play.episodes[i].length for i in envs])

    def groups(self, envs: Sequence[int]) -> list[int]:
        return [self.play.episodes[i].group_id for i in envs]

    def labels(self, envs: Sequence[int]) -> list[Any]:
        labeler = self.play.labeler
        return list(labeler(list(envs))) if labeler is not None else [None] * len(envs)

    def replies(self, out: SampleLike, prompts, labels) -> list[Reply]:
        return replies(out, prompts, labels, self.engine, self.play.rcfg)

    def book(self, env: int, reply: Reply, result) -> bool:
        return book(self.play, env, reply, result, self.max_new)

    def spawned(self, env: int) -> list[int]:
        return []  # no branching: a step never starts another game (``branch.BranchTurns``)
