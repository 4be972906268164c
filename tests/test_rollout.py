"""Rollout tests on real TextCraft games (EnvPool workers), with a tiny random Qwen2 actor and the real
sampler, and with a scripted sampler that plays the games' oracle (so wins and rewards are known)."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import pytest
from flax import nnx

import environments
from bipace_jax.models import Qwen2Actor, Qwen2Config, load_tokenizer
from bipace_jax.rollout import (
    FIRST_TOKENS,
    ActionKey,
    PromptTooLongError,
    RolloutConfig,
    Scheduler,
    collect,
    encode_prompt,
    game_keys,
    turn_keys,
)
from bipace_jax.sampling import Engine, SampleOutput, SamplerConfig
from environments.base import Observation
from environments.pool import EnvPool, Fault
from environments.prompts import action_tag, build_prompt

GAMES = [(16, 3), (12, 4)]  # (task_id, seed) of depth-3 goals the oracle solves in 5-6 steps
SEEDS = [s for _, s in GAMES]


def _rollout(max_steps: int, game: str = "textcraft", **options) -> RolloutConfig:
    """The rollout of these tests: task groups of 2 games of up to ``max_steps`` turns, prompts up to
    1024 tokens, ``options`` on top."""
    return RolloutConfig(game=game, group_size=2, max_steps=max_steps, max_prompt_length=1024, **options)


# 3 slots for 4 games: a game waits for a free slot; chunks of 3 steps leave early on a finished row.
SLOTS_ROLLOUT = _rollout(3, num_slots=3, chunk_steps=3)


def _random_actor(tokenizer):
    """The tiny random-init Qwen2 actor (``Qwen2Config.tiny``, seed 0) over ``tokenizer``'s vocabulary."""
    return Qwen2Actor(Qwen2Config.tiny(vocab_size=len(tokenizer)), rngs=nnx.Rngs(0))


def _ragged_sampler(tokenizer, **options) -> SamplerConfig:
    """Up to 8 new tokens in batches of 2 or 4, prompts up to 1024 tokens, ``options`` on top; every 5th id
    ends a response, so the random actor's responses have several lengths."""
    eos = tuple(range(3, len(tokenizer), 5))
    base = dict(max_new_tokens=8, batch_buckets=(2, 4), length_buckets=(512, 1024), eos_token_ids=eos)
    return SamplerConfig(**{**base, **options})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE trained on TextCraft prompts (so prompts are a few hundred tokens), Qwen specials,
    saved and reloaded with the bundled Qwen2.5 chat template."""
    from tests.qwen_fixtures import write_tiny_tokenizer

    env = environments.make("textcraft", max_steps=5)
    corpus = []
    for task in range(0, 400, 10):
        obs = env.reset(task, 0)
        corpus.append(build_prompt("textcraft", obs, [], 0))
        corpus.append(f"<think>I need it</think><action>{env.oracle_action()}</action>")
    return load_tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=1200, corpus=corpus))


@pytest.fixture(scope="module")
def pool():
    with EnvPool("textcraft", 4, env_options={"max_steps": 50}, num_workers=1) as p:
        yield p


class OracleSampler:
    """Answers each live game with its oracle action (env ``bad`` answers gibberish), like a Sampler."""

    def __init__(self, tokenizer, pool, n_envs, bad=(), max_new_tokens=48):
        self.config = SamplerConfig(max_new_tokens=max_new_tokens, length_buckets=(512, 1024))
        self.tokenizer, self.pool, self.n_envs, self.bad = tokenizer, pool, n_envs, set(bad)
        self.eos_token_ids = (tokenizer.eos_token_id,)
        self.pad_id = tokenizer.pad_token_id
        self.calls = []

    def length_bucket(self, t):
        return next(b for b in self.config.length_buckets if b >= t)

    def generate(self, actor, prompts, key, *, temperature=None, row_keys=None, groups=None):
        oracle = self.pool.oracle_actions(list(range(self.n_envs)))
        live = [i for i, a in enumerate(oracle) if a is not None]
        assert len(live) == len(prompts)
        self.calls.append((live, [len(p) for p in prompts]))
        m = self.config.max_new_tokens
        b = len(prompts)
        tokens = np.full((b, m), self.pad_id, np.int32)
        lengths = np.zeros(b, np.int32)
        for r, i in enumerate(live):
            text = "I do not know." if i in self.bad else f"<think>plan</think><action>{oracle[i]}</action>"
            ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
            assert len(ids) <= m
            tokens[r, : len(ids)] = ids
            lengths[r] = len(ids)
        fps = np.eye(b, 8, dtype=np.float32)
        logps = np.where(np.arange(m)[None] < lengths[:, None], -0.5, 0.0).astype(np.float32)
        return SampleOutput(tokens, lengths, logps, fps)


def test_collect_with_the_oracle_wins_scores_and_orders_rows(tokenizer, pool):
    rcfg = _rollout(8)
    sampler = OracleSampler(tokenizer, pool, 4, bad={1})
    res = collect(None, sampler, pool, GAMES, rcfg, jax.random.key(0))
    eps = res.episodes
    assert [e.traj_id for e in eps] == [0, 1, 2, 3] and [e.group_id for e in eps] == [0, 0, 1, 1]
    assert [e.task_id for e in eps] == [16, 16, 12, 12] and eps[0].task_info["goal"] == "beetroot soup"
    # Envs 0, 2, 3 follow the oracle and win; env 1 answers gibberish: fallback "inventory", capped.
    assert [e.won for e in eps] == [True, False, True, True]
    assert eps[1].length == 8 and eps[1].truncated and eps[1].invalid_count == 8
    assert 2 <= eps[0].length < 8 and eps[2].length == eps[3].length < 8
    assert not any(e.truncated for k, e in enumerate(eps) if k != 1)
    s = res.steps
    n = sum(e.length for e in eps)
    # Fixed shape: padded to groups * G * max_steps rows (= 4 * 8), real rows first, padding masked.
    assert s.num_rows == 4 * 8 and s.group_capacity == 2 and s.row_capacity == 16
    np.testing.assert_array_equal(np.asarray(s.mask), np.arange(s.num_rows) < n)
    gid, tid, step = (np.asarray(x)[:n] for x in (s.group_id, s.traj_id, s.step))
    reward, penalty, obs_hash, akey = (np.asarray(x)[:n] for x in (s.reward, s.penalty, s.obs_hash, s.action_key))
    assert res.stats.values()["rows"] == n == res.response_ids.shape[0] == res.prompt_ids.shape[0]
    order = np.lexsort((step, tid, gid))
    np.testing.assert_array_equal(order, np.arange(n))  # canonical order
    for e in eps:
        rows = tid == e.traj_id
        np.testing.assert_array_equal(step[rows], np.arange(e.length))
        expected = np.zeros(e.length)
        if e.won:
            expected[-1] = 10.0
        np.testing.assert_allclose(reward[rows], expected, atol=1e-6)  # the game's part only
        np.testing.assert_allclose(penalty[rows], 0.1 if e.traj_id == 1 else 0.0, atol=1e-7)  # charged apart
        assert e.episode_return == pytest.approx(expected.sum() - penalty[rows].sum(), abs=1e-6)
    # Fallback action sent for the gibberish env; action keys: unparsable -> -1, equal tags -> equal ids.
    assert all(a == "inventory" for a, t in zip([r.action for r in res.rows], tid) if t == 1)
    assert (akey[tid == 1] == -1).all() and (akey[tid != 1] >= 0).all()
    tags = [action_tag(t) for t in [r.text for r in res.rows]]
    for a in range(n):
        for b in range(n):
            if tags[a] is not None and tags[b] is not None:
                assert (akey[a] == akey[b]) == (tags[a] == tags[b])
    # Step 0 of a task group sees the same anchor; rollouts 0/1 (same task) share it, group 1 differs.
    s0 = step == 0
    assert len(set(obs_hash[s0 & (gid == 0)])) == 1 and len(set(obs_hash[s0 & (gid == 1)])) == 1
    assert obs_hash[s0 & (gid == 0)][0] != obs_hash[s0 & (gid == 1)][0]
    # Token arrays: masks match lengths, prompts are the chat-formatted game prompts, left-padded.
    assert (
        res.response_mask.sum(1) == np.array([len(tokenizer.encode(t)) + 1 for t in [r.text for r in res.rows]])
    ).all()
    assert (res.sample_logprobs[res.response_mask == 0] == 0).all()
    assert (res.prompt_mask[:, -1] == 1).all() and res.prompt_ids.shape[1] in (512, 1024)
    text0 = tokenizer.decode(res.prompt_ids[0][res.prompt_mask[0] == 1])
    assert text0.startswith("<|im_start|>system") and text0.endswith("<|im_start|>assistant\n")
    assert f"Goal: craft {eps[0].task_info['goal']}" in text0
    assert res.stats.values()["invalid_rate"] == pytest.approx(8 / n)
    assert res.stats.values()["success_rate"] == 0.75 and res.stats.values()["env_errors"] == 0
    assert set(res.timing) == {"sampling_s", "prefill_s", "decode_s", "env_s", "host_s", "total_s"}
    assert min(res.timing.values()) >= 0
    assert res.timing["total_s"] == pytest.approx(res.timing["sampling_s"] + res.timing["env_s"] + res.timing["host_s"])
    # Lockstep: one sampler call per turn with every live game.
    assert sampler.calls[0][0] == [0, 1, 2, 3] and len(sampler.calls) == 8
    assert [len(c[0]) for c in sampler.calls] == sorted((len(c[0]) for c in sampler.calls), reverse=True)


def test_first_tokens_key_groups_responses_by_their_first_token_ids(tokenizer, pool):
    rcfg = _rollout(3, action_key="first_tokens")
    sampler = OracleSampler(tokenizer, pool, 4, bad={2})
    res = collect(None, sampler, pool, GAMES, rcfg, jax.random.key(0))
    akey = np.asarray(res.steps.action_key)[: res.stats.values()["rows"]]
    firsts = [tuple(r[: min(FIRST_TOKENS, int(m.sum()))]) for r, m in zip(res.response_ids, res.response_mask)]
    assert (akey >= 0).all()
    for a in range(len(firsts)):
        for b in range(len(firsts)):
            assert (akey[a] == akey[b]) == (firsts[a] == firsts[b])


def test_encode_prompt_drops_oldest_history_first(tokenizer):
    obs = Observation(text="Got 1 oak logs", anchor="Got 1 oak logs", task="Goal: craft stick.")
    history = [(f"observation number {k} " + "word " * 30, f"get {k} oak logs") for k in range(4)]
    base = RolloutConfig(game="textcraft", history_length=3, max_prompt_length=4096)
    full, dropped = encode_prompt(tokenizer, base, obs, history, step=4)
    assert dropped == 0
    none, _ = encode_prompt(tokenizer, RolloutConfig(game="textcraft", history_length=0), obs, history, step=4)
    limit = (len(full) + len(none)) // 2
    ids, dropped = encode_prompt(
        tokenizer, RolloutConfig(game="textcraft", history_length=3, max_prompt_length=limit), obs, history, step=4
    )
    text = tokenizer.decode(ids)
    assert len(ids) <= limit and 1 <= dropped <= 2
    assert "observation number 3" in text  # newest kept
    assert "observation number 1" not in text  # oldest shown entry dropped first
    with pytest.raises(PromptTooLongError, match=r"textcraft env 5 step 4: the prompt has \d+ tokens with no history"):
        encode_prompt(
            tokenizer,
            RolloutConfig(game="textcraft", max_prompt_length=len(none) - 1),
            obs,
            history,
            step=4,
            where="env 5",
        )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(games=[]), "at least one"),
        (dict(games=[(0, 1, 2)]), r"\(task_id, seed\) pairs, got \(0, 1, 2\)"),
        (dict(games=[(0, 1), (1, 2), (2, 3)]), "pool has 4 envs, fewer than"),
        (dict(game="alfworld"), "RolloutConfig.game is 'alfworld' but the pool runs 'textcraft'"),
    ],
)
def test_collect_rejects_inconsistent_arguments(tokenizer, pool, kw, match):
    rcfg = _rollout(2, game=kw.pop("game", "textcraft"))
    args = {"games": GAMES, **kw}
    with pytest.raises(ValueError, match=match):
        collect(None, OracleSampler(tokenizer, pool, 4), pool, args["games"], rcfg, jax.random.key(0))


@pytest.mark.slow
def test_collect_with_the_tiny_actor_and_real_sampler(tokenizer, pool):
    actor = _random_actor(tokenizer)
    scfg = SamplerConfig(max_new_tokens=8, batch_buckets=(4,), length_buckets=(1024,))
    sampler = Engine(tokenizer, scfg)
    rcfg = _rollout(2)
    res = collect(actor, sampler, pool, GAMES, rcfg, jax.random.key(1), progress=True)
    n = res.stats.values()["rows"]
    assert n == 8 and res.response_ids.shape == (8, 8) and res.prompt_ids.shape == (8, 1024)
    fp = np.asarray(res.steps.fingerprint)[:n]
    assert res.steps.num_rows == 8 and fp.shape == (8, 64)
    np.testing.assert_allclose(np.linalg.norm(fp, axis=1), 1.0, atol=1e-5)
    # Each row's sample matches what the sampler gives for that prompt (same key fold and row index).
    lengths = res.response_mask.sum(1)
    assert ((lengths >= 1) & (lengths <= 8)).all()
    assert (res.sample_logprobs[res.response_mask == 1] < 0).all()
    # Random weights never produce "<action>...</action>": every step is invalid, reward 0 and penalty 0.1.
    np.testing.assert_allclose(np.asarray(res.steps.reward)[:n], 0.0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(res.steps.penalty)[:n], 0.1, atol=1e-6)
    assert [r.action for r in res.rows] == ["inventory"] * 8 and res.stats.values()["invalid_rate"] == 1.0
    assert res.timing["sampling_s"] > 0 and res.stats.values()["response_tokens"] == lengths.sum()
    assert 0 < res.timing["prefill_s"] + res.timing["decode_s"] <= res.timing["sampling_s"]
    # Turn 0 sampled all four games in one call: its rows equal a direct sampler call with each game's
    # own (game, turn) key.
    rows0 = np.asarray(res.steps.step)[:n] == 0
    prompts = [list(p[m == 1]) for p, m in zip(res.prompt_ids[rows0], res.prompt_mask[rows0])]
    keys0 = turn_keys(game_keys(jax.random.key(1), GAMES, 2), [0] * 4)
    direct = sampler.generate(actor, prompts, jax.random.key(99), row_keys=keys0)
    np.testing.assert_array_equal(direct.tokens, res.response_ids[rows0])
    np.testing.assert_allclose(direct.fingerprints, fp[rows0], atol=1e-6)


def test_game_keys_depend_on_the_game_only():
    both = game_keys(jax.random.key(3), [(16, 3), (12, 4)], 2)
    alone = game_keys(jax.random.key(3), [(12, 4)], 2)
    twice = game_keys(jax.random.key(3), [(12, 4), (12, 4)], 2)
    assert both.shape == (4, 2) and both.dtype == np.uint32
    np.testing.assert_array_equal(both[2:], alone)
    np.testing.assert_array_equal(twice[:2], alone)
    assert len({tuple(k) for k in np.concatenate([both, twice[2:]])}) == 6  # rollouts and copies differ
    k = turn_keys(both, [0, 1, 0, 1])
    assert len({tuple(x) for x in k}) == 4 and not (k == both).all(axis=1).any()
    big = game_keys(jax.random.key(3), [(12, 4 + (1 << 32))], 2)  # the seed's high bits count
    assert not (big == alone).all()


@pytest.mark.slow
def test_sampled_tokens_of_a_game_do_not_depend_on_the_other_games(tokenizer, pool):
    actor = _random_actor(tokenizer)
    sampler = Engine(tokenizer, SamplerConfig(max_new_tokens=8, batch_buckets=(4,), length_buckets=(1024,)))
    rcfg = _rollout(2)
    key = jax.random.key(5)
    both = collect(actor, sampler, pool, GAMES, rcfg, key)
    alone = collect(actor, sampler, pool, GAMES[1:], rcfg, key)
    rows = np.asarray(both.steps.group_id)[: both.num_rows] == 1  # group (12, 4): envs 2, 3 here, 0, 1 alone
    assert rows.sum() == alone.num_rows == 4
    np.testing.assert_array_equal(both.response_ids[rows], alone.response_ids)
    np.testing.assert_allclose(both.sample_logprobs[rows], alone.sample_logprobs, atol=1e-5)
    # Another game's tokens differ (the keys are its own): the check above can fail.
    assert not np.array_equal(both.response_ids[~rows], alone.response_ids)


def _assert_same_result(a, b):
    """Two RolloutResults equal, timing and the continuous scheduler's own counters aside."""
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.sample_logprobs, b.sample_logprobs, atol=1e-5)
    for f in ("group_id", "traj_id", "step", "reward", "penalty", "obs_hash", "action_key", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(a.steps, f)), np.asarray(getattr(b.steps, f)), err_msg=f)
    np.testing.assert_allclose(np.asarray(a.steps.fingerprint), np.asarray(b.steps.fingerprint), atol=1e-5)
    assert a.episodes == b.episodes
    fields = ("text", "action", "finish", "label", "observation", "state", "valid", "prompt", "length", "pace")
    for f in fields:
        assert [getattr(r, f) for r in a.rows] == [getattr(r, f) for r in b.rows], f
    assert len(a.rows) == a.num_rows and a.labeled == b.labeled
    assert {k: v for k, v in b.stats.values().items() if k != "slot_use"} == a.stats.values()


@pytest.mark.slow
@pytest.mark.parametrize("greedy", [True, False])
def test_continuous_scheduler_equals_lockstep(tokenizer, pool, greedy):
    actor = _random_actor(tokenizer)
    sampler = Engine(tokenizer, _ragged_sampler(tokenizer, greedy=greedy))
    rcfg = SLOTS_ROLLOUT
    key = jax.random.key(2)
    lock = collect(actor, sampler, pool, GAMES, rcfg, key)
    cont = collect(actor, sampler, pool, GAMES, dataclasses.replace(rcfg, scheduler="continuous"), key)
    assert lock.num_rows == cont.num_rows == 12
    _assert_same_result(lock, cont)
    assert cont.timing["decode_steps"] > 0 and 0 < cont.stats.values()["slot_use"] <= 1
    if not greedy:  # responses of several lengths: the slots really ran out of step
        assert len(set(lock.response_mask.sum(1).tolist())) > 1


@pytest.mark.slow
def test_shared_prompt_heads_leave_the_rollout_unchanged(tokenizer, pool):
    actor = _random_actor(tokenizer)
    plain = Engine(tokenizer, _ragged_sampler(tokenizer))
    shared = Engine(tokenizer, _ragged_sampler(tokenizer, shared_head_tokens=32))
    calls = []
    generate = shared.generate

    def spy(actor, prompts, key, **kw):  # the groups it is given, what it prefilled
        out = generate(actor, prompts, key, **kw)
        calls.append((list(kw["groups"]), out.timing.prefill_tokens, out.timing.prompt_tokens))
        return out

    shared.generate = spy
    rcfg = _rollout(3)
    key = jax.random.key(4)
    a = collect(actor, plain, pool, GAMES, rcfg, key)
    b = collect(actor, shared, pool, GAMES, rcfg, key)
    _assert_same_result(a, b)
    assert calls[0][0] == [0, 0, 1, 1]  # env i plays in task group i // G
    assert all(run < prompt for _, run, prompt in calls)  # every turn prefilled the groups' heads once


class _SlowRecordingPool:
    """An EnvPool whose games answer no sooner than ``hold_s`` after their submit (a slow game on top of the
    real pool and its faults); submits, answers and the slot sampler's decode chunks are logged in order."""

    def __init__(self, pool, events, hold_s=0.05):
        self.pool, self.events, self.hold_s = pool, events, hold_s
        self.sent, self.held = {}, {}

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def __len__(self):
        return len(self.pool)

    def submit(self, jobs):
        tickets = self.pool.submit(jobs)
        self.sent.update(dict.fromkeys(tickets, time.monotonic()))
        self.events.append(("submit", tickets))
        return tickets

    def poll(self, timeout=0.0):
        while True:
            self.held.update(self.pool.poll(0.0))
            now = time.monotonic()
            due = sorted(t for t in self.held if self.sent[t] + self.hold_s <= now)
            if due or timeout == 0.0 or not (self.held or self.pool.in_flight):
                break
            time.sleep(0.005)
        if due:
            self.events.append(("poll", due))
        return [(t, self.held.pop(t)) for t in due]


@pytest.mark.slow
def test_continuous_steps_games_while_decoding_and_equals_lockstep_with_a_faulting_game(tokenizer, monkeypatch):
    import functools

    from bipace_jax.sampling import SlotHandle
    from environments.testing import UnscorableEnv

    actor = _random_actor(tokenizer)
    sampler = Engine(tokenizer, _ragged_sampler(tokenizer, greedy=False))
    rcfg = SLOTS_ROLLOUT
    events = []
    chunk = SlotHandle.decode

    def logged_chunk(self, *a, **k):
        events.append(("chunk", None))
        return chunk(self, *a, **k)

    monkeypatch.setattr(SlotHandle, "decode", logged_chunk)
    factory = functools.partial(UnscorableEnv, "textcraft", task_id=12)  # task group 1's steps score NaN
    key = jax.random.key(2)
    with EnvPool(factory, 4, env_options={"max_steps": 50}, num_workers=2, timeout_s=20.0) as pool:
        lock = collect(actor, sampler, pool, GAMES, rcfg, key)
        cont = collect(actor, sampler, _SlowRecordingPool(pool, events), GAMES, dataclasses.replace(rcfg, scheduler="continuous"), key)  # fmt: skip
        assert pool.in_flight == 0
    assert [e.env_error for e in cont.episodes] == [None, None, Fault.EXCEPTION, Fault.EXCEPTION]
    assert [e.length for e in cont.episodes] == [3, 3, 1, 1] and cont.num_rows == 6
    _assert_same_result(lock, cont)
    # every submitted step came back exactly once, and some decode chunk ran while a step was in flight
    submitted = [t for kind, ts in events if kind == "submit" for t in ts]
    polled = [t for kind, ts in events if kind == "poll" for t in ts]
    assert len(submitted) == 8 and sorted(polled) == sorted(submitted) and len(set(polled)) == 8
    back_at = {t: k for k, (kind, ts) in enumerate(events) if kind == "poll" for t in ts}
    sent_at = {t: k for k, (kind, ts) in enumerate(events) if kind == "submit" for t in ts}
    assert any(any(kind == "chunk" for kind, _ in events[sent_at[t] : back_at[t]]) for t in submitted), (
        "no decode chunk overlapped an env step"
    )


def test_the_scheduler_is_stored_as_its_enum_and_an_unknown_one_is_refused():
    with pytest.raises(ValueError, match=r"RolloutConfig.scheduler must be one of \('lockstep', 'continuous'\)"):
        RolloutConfig(scheduler="eager")
    rcfg = RolloutConfig(scheduler="continuous", action_key="first_tokens")
    assert rcfg.scheduler is Scheduler.CONTINUOUS and rcfg.action_key is ActionKey.FIRST_TOKENS
    with pytest.raises(ValueError, match="RolloutConfig.scheduler must be one of"):
        dataclasses.replace(rcfg, scheduler="x")
    with pytest.raises(ValueError, match="RolloutConfig.action_key must be one of"):
        RolloutConfig(action_key="tags")


class FinishSampler(OracleSampler):
    """Env 0 answers its oracle action and EOS; env 1 its action, then filler up to the token budget (no
    EOS); env 2 filler only, cut by the budget. No stop strings, so a cut response can still parse."""

    def __init__(self, tokenizer, pool, m=40):
        super().__init__(tokenizer, pool, 3, max_new_tokens=m)
        self.config = SamplerConfig(max_new_tokens=m, length_buckets=(512, 1024), stop_strings=())

    def generate(self, actor, prompts, key, *, temperature=None, row_keys=None, groups=None):
        oracle = self.pool.oracle_actions(list(range(self.n_envs)))
        live = [i for i, a in enumerate(oracle) if a is not None]
        m, b = self.config.max_new_tokens, len(prompts)
        tokens = np.full((b, m), self.pad_id, np.int32)
        lengths = np.zeros(b, np.int32)
        filler = self.tokenizer.encode(" and then")
        for r, i in enumerate(live):
            if i == 0:
                ids = self.tokenizer.encode(f"<action>{oracle[i]}</action>") + [self.tokenizer.eos_token_id]
            else:
                ids = self.tokenizer.encode(f"<action>{oracle[i]}</action>" if i == 1 else "I think")
                ids = (ids + filler * m)[:m]
            tokens[r, : len(ids)], lengths[r] = ids, len(ids)
        fps = np.eye(b, 8, dtype=np.float32)
        return SampleOutput(tokens, lengths, np.where(tokens != self.pad_id, -0.5, 0.0).astype(np.float32), fps)


@pytest.mark.parametrize("mode", ["parse", "invalid", "unpenalised"])
def test_finish_reasons_are_recorded_and_length_rows_are_scored_by_the_config(tokenizer, pool, mode):
    rcfg = RolloutConfig(
        game="textcraft",
        group_size=3,
        max_steps=2,
        max_prompt_length=1024,
        length_finish=mode,
        invalid_penalty=0.1,
    )
    res = collect(None, FinishSampler(tokenizer, pool), pool, [(16, 3)], rcfg, jax.random.key(0))
    traj = np.asarray(res.steps.traj_id)[: res.num_rows]
    reward = np.asarray(res.steps.reward)[: res.num_rows]
    charged = np.asarray(res.steps.penalty)[: res.num_rows]
    assert res.num_rows == 6 and list(traj) == [0, 0, 1, 1, 2, 2]
    assert [r.finish for r in res.rows] == ["eos", "eos", "length", "length", "length", "length"]
    assert (
        res.stats.values()["finish_eos_rate"] == pytest.approx(1 / 3) and res.stats.values()["finish_stop_rate"] == 0.0
    )
    assert res.stats.values()["finish_length_rate"] == pytest.approx(2 / 3)
    cut_ok = mode == "parse"  # env 1's cut response holds a whole action
    assert [res.rows[k].action == "inventory" for k in range(6)] == [False, False, not cut_ok, not cut_ok, True, True]
    # Oracle steps of a 5-6 step goal pay no game reward yet: a row's net reward is minus its penalty.
    penalty = {"parse": [0, 0, 0, 0, 0.1, 0.1], "invalid": [0, 0, 0.1, 0.1, 0.1, 0.1], "unpenalised": [0] * 6}[mode]
    np.testing.assert_allclose(reward, 0.0, atol=1e-7)
    np.testing.assert_allclose(charged, penalty, atol=1e-7)


def test_finish_reason_prefers_eos_then_stop_text():
    from bipace_jax.rollout import finish_reason

    assert finish_reason(np.array([5, 2]), "<action>x</action>", {2}, ("</action>",)) == "eos"
    assert finish_reason(np.array([5, 6]), "<action>x</action>", {2}, ("</action>",)) == "stop"
    assert finish_reason(np.array([5, 6]), "<action>x", {2}, ("</action>",)) == "length"
    with pytest.raises(ValueError, match="length_finish must be one of"):
        RolloutConfig(length_finish="drop")


def _chaos_pool(tmp_path, plan):
    import functools
    import json

    from environments.testing import ChaosEnv

    (tmp_path / "plan.json").write_text(json.dumps(plan))
    factory = functools.partial(ChaosEnv, "textcraft", str(tmp_path))
    return EnvPool(factory, 4, env_options={"max_steps": 50}, num_workers=1, timeout_s=3.0)


def test_a_hung_reset_is_retried_on_a_fresh_seed_for_the_whole_task_group(tokenizer, tmp_path):
    from bipace_jax.rollout import RESEED_STRIDE

    # reset call 2 is env 1's (task group 0): it hangs; the pool flags it, the rollout resets group 0 again
    with _chaos_pool(tmp_path, [{"id": "h", "call": "reset", "at": 2, "kind": "hang"}]) as pool:
        res = collect(None, OracleSampler(tokenizer, pool, 4), pool, GAMES, _rollout(8), jax.random.key(0))
    eps = res.episodes
    assert [e.seed for e in eps] == [SEEDS[0] + RESEED_STRIDE] * 2 + [SEEDS[1]] * 2
    assert all(e.won and e.env_error is None for e in eps)
    assert (
        res.stats.values()["reset_faults"] == 1
        and res.stats.values()["env_errors"] == 0
        and res.stats.values()["success_rate"] == 1.0
    )
    assert (tmp_path / "fired" / "h.json").exists()


@pytest.mark.slow
def test_continuous_equals_lockstep_after_a_hung_reset_is_retried(tokenizer, tmp_path):
    from bipace_jax.rollout import RESEED_STRIDE

    actor = _random_actor(tokenizer)
    sampler = Engine(tokenizer, _ragged_sampler(tokenizer, length_buckets=(1024,), greedy=True))
    rcfg = SLOTS_ROLLOUT
    plan = [{"id": "h", "call": "reset", "at": 2, "kind": "hang"}]  # env 1's reset: group 0 is reset again
    out = {}
    for scheduler in ("lockstep", "continuous"):  # a pool (and chaos plan) each: a fault fires once
        (tmp_path / scheduler).mkdir()
        with _chaos_pool(tmp_path / scheduler, plan) as pool:
            out[scheduler] = collect(
                actor, sampler, pool, GAMES, dataclasses.replace(rcfg, scheduler=scheduler), jax.random.key(6)
            )
    lock, cont = out["lockstep"], out["continuous"]
    assert [e.seed for e in cont.episodes] == [SEEDS[0] + RESEED_STRIDE] * 2 + [SEEDS[1]] * 2
    assert lock.stats.values()["reset_faults"] == cont.stats.values()["reset_faults"] == 1
    _assert_same_result(lock, cont)


def test_without_retries_a_crashed_reset_drops_only_that_game(tokenizer, tmp_path):
    with _chaos_pool(tmp_path, [{"id": "c", "call": "reset", "at": 2, "kind": "crash"}]) as pool:
        res = collect(
            None, OracleSampler(tokenizer, pool, 4), pool, GAMES, _rollout(8, reset_retries=0), jax.random.key(0)
        )
    eps = res.episodes
    assert [e.env_error for e in eps] == [None, Fault.CRASH, None, None] and eps[1].length == 0
    assert [e.won for e in eps] == [True, False, True, True] and [e.seed for e in eps] == [3, 3, 4, 4]
    n = res.stats.values()["rows"]
    assert sorted(set(np.asarray(res.steps.traj_id)[:n].tolist())) == [0, 2, 3]
    assert (
        res.stats.values()["env_errors"] == 1
        and res.stats.values()["reset_faults"] == 1
        and res.stats.values()["env_error_rows"] == 0
    )
    assert res.stats.values()["success_rate"] == 1.0  # of the 3 games played


def test_a_game_that_raises_mid_episode_is_left_out_of_the_batch(tokenizer, tmp_path):
    # step calls 1-4 are turn 0 (envs 0-3); call 6 is env 1's second step
    with _chaos_pool(tmp_path, [{"id": "r", "call": "step", "at": 6, "kind": "raise"}]) as pool:
        res = collect(None, OracleSampler(tokenizer, pool, 4), pool, GAMES, _rollout(8), jax.random.key(0))
    eps = res.episodes
    assert [e.env_error for e in eps] == [None, "exception", None, None] and eps[1].length == 2
    n = res.stats.values()["rows"]
    tid = np.asarray(res.steps.traj_id)[:n]
    assert 1 not in tid.tolist() and n == sum(e.length for e in eps) - 2
    assert np.asarray(res.steps.mask).sum() == n == res.response_ids.shape[0] == len([r.action for r in res.rows])
    assert (
        res.stats.values()["env_errors"] == 1
        and res.stats.values()["env_error_rows"] == 2
        and res.stats.values()["reset_faults"] == 0
    )
    assert res.stats.values()["env_errors_exception"] == 1 and res.stats.values()["env_errors_lost"] == 0


def test_a_game_whose_scorer_returns_nan_is_an_env_error_and_the_others_are_unchanged(tokenizer, tmp_path):
    import functools

    from environments.testing import UnscorableEnv

    def play(factory):
        with EnvPool(factory, 4, env_options={"max_steps": 50}, num_workers=1, timeout_s=20.0) as pool:
            sampler = OracleSampler(tokenizer, pool, 4)
            return collect(None, sampler, pool, GAMES, _rollout(8), jax.random.key(0))

    good = play(functools.partial(UnscorableEnv, "textcraft", task_id=-1))  # no task unscorable
    res = play(functools.partial(UnscorableEnv, "textcraft", task_id=12))  # task group 1 (envs 2, 3)
    eps = res.episodes
    assert [e.env_error for e in eps] == [None, None, Fault.EXCEPTION, Fault.EXCEPTION]
    assert [e.length for e in eps[2:]] == [1, 1]  # its first step was unscorable
    assert "UnscorableEnv task 12: step 1 gave reward nan" in eps[2].env_error_detail
    assert (
        res.stats.values()["env_errors"] == 2
        and res.stats.values()["env_errors_exception"] == 2
        and res.stats.values()["env_error_rows"] == 2
    )
    assert good.stats.values()["env_errors"] == 0 and all(e.won for e in good.episodes)
    # task group 0 played as without the fault: the same episodes, rows and rewards
    assert [(e.won, e.length, e.episode_return) for e in eps[:2]] == [
        (e.won, e.length, e.episode_return) for e in good.episodes[:2]
    ]
    n = res.stats.values()["rows"]
    assert n == sum(e.length for e in eps[:2]) and set(np.asarray(res.steps.traj_id)[:n].tolist()) == {0, 1}
    np.testing.assert_array_equal(np.asarray(res.steps.reward)[:n], np.asarray(good.steps.reward)[:n])
    assert np.isfinite(np.asarray(res.steps.reward)).all() and res.stats.values()["success_rate"] == 1.0


def test_projected_invalid_action_sends_the_response_tail_and_charges_the_penalty(tokenizer, pool):
    rcfg = _rollout(3, invalid_action="projected", projection_chars=8)
    sampler = OracleSampler(tokenizer, pool, 4, bad={1})
    res = collect(None, sampler, pool, GAMES, rcfg, jax.random.key(0))
    n = res.stats.values()["rows"]
    tid = np.asarray(res.steps.traj_id)[:n]
    # env 1 answers "I do not know.": the game gets its last 8 characters, lower-cased
    assert [a for a, t in zip([r.action for r in res.rows], tid) if t == 1] == ["ot know."] * 3
    assert all(a != "ot know." for a, t in zip([r.action for r in res.rows], tid) if t != 1)
    np.testing.assert_allclose(np.asarray(res.steps.reward)[:n][tid == 1], 0.0, atol=1e-6)  # the game's part
    np.testing.assert_allclose(np.asarray(res.steps.penalty)[:n][tid == 1], 0.1, atol=1e-6)  # the charge
    # the history shows the projected command, as verl-agent's memory does
    text = tokenizer.decode(res.prompt_ids[int(np.flatnonzero(tid == 1)[1])])
    assert "ot know." in text


def test_the_fallback_action_is_the_games_unless_the_config_sets_one():
    spec = environments.game_spec("textcraft")
    assert RolloutConfig(game="textcraft").fallback == spec.fallback_action == "inventory"
    assert RolloutConfig(game="textcraft", fallback_action="look").fallback == "look"
    assert RolloutConfig(game="textcraft").spec is spec
    with pytest.raises(ValueError, match="RolloutConfig.game must be a registered game: unknown environment 'chess'"):
        RolloutConfig(game="chess")
    with pytest.raises(ValueError, match="RolloutConfig.fallback_action must be None or a non-empty str, got ' '"):
        RolloutConfig(fallback_action=" ")
