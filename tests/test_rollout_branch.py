"""Branching rollouts (``RolloutConfig.branch_turns``, ``rollout/branch.py``): forks on real TextCraft games
in ``EnvPool`` workers with an engine whose responses are a function of each row's key, the tree the rows
carry, both schedulers, released subtrees, the replay check, and the config errors."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from bipace_jax.config import ConfigError
from bipace_jax.estimators import EstimatorConfig, compute_advantages
from bipace_jax.models import load_tokenizer
from bipace_jax.rollout import RolloutConfig, collect
from bipace_jax.rollout.branch import BRANCH_SALT, leaf_path
from bipace_jax.rollout.turns import game_keys, turn_keys
from bipace_jax.sampling import SampleOutput, SamplerConfig
from bipace_jax.transcripts import step_rows
from environments.base import Observation, ReplayDivergedError
from environments.pool import EnvPool, ForkResult
from environments.testing import DriftEnv, InstantPool

GAMES = [(16, 3), (12, 4)]  # two task groups
# commands whose TextCraft observations differ, so forked games part ways after the fork
ACTIONS = ("get 1 oak log", "inventory", "get 2 stick", "craft 4 oak planks using 1 oak log", "get 1 iron ingot")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bipace_jax/data/textcraft_tiny")


@pytest.fixture(scope="module")
def pool():
    with EnvPool("textcraft", 16, env_options={"max_steps": 50}, num_workers=2) as p:
        yield p


def _keyed_text(key) -> str:
    a, b = (int(x) for x in np.asarray(key, np.uint32))
    return f"<think>{a % 997} {b % 991}</think><action>{ACTIONS[(a ^ b) % len(ACTIONS)]}</action>"


class KeyedEngine:
    """Answers each row with a text that is a function of its row key only (its action too), by
    ``generate`` (lockstep) or by slots (continuous); records every (row key, prompt)."""

    def __init__(self, tok):
        self.config = SamplerConfig(max_new_tokens=40, batch_buckets=(4, 16), length_buckets=(1024,))
        self.tokenizer, self.pad_id, self.eos_token_ids = tok, tok.pad_token_id, (tok.eos_token_id,)
        self.calls: list[tuple[tuple[int, int], list[int]]] = []

    def rows(self, prompts, row_keys) -> SampleOutput:
        b, m = len(prompts), self.config.max_new_tokens
        tokens = np.full((b, m), self.pad_id, np.int32)
        lengths = np.zeros(b, np.int32)
        for r, (p, k) in enumerate(zip(prompts, np.asarray(row_keys, np.uint32))):
            self.calls.append((tuple(int(x) for x in k), list(p)))
            ids = self.tokenizer.encode(_keyed_text(k)) + [self.tokenizer.eos_token_id]
            tokens[r, : len(ids)], lengths[r] = ids, len(ids)
        logps = np.where(np.arange(m)[None] < lengths[:, None], -0.5, 0.0).astype(np.float32)
        fps = (np.asarray(row_keys, np.uint32)[:, :1] % 97 + 1).astype(np.float32) * np.ones((1, 4), np.float32)
        return SampleOutput(tokens, lengths, logps, fps)

    def generate(self, actor, prompts, key, *, temperature=None, row_keys=None, groups=None):
        return self.rows(prompts, row_keys)

    def slots(self, actor, num_slots, *, max_prompt, chunk, temperature=None):
        return KeyedSlots(self, num_slots)


class KeyedSlots:
    """Slots over ``KeyedEngine``: a row's response is done after ``1 + (key % 3)`` decode chunks, so the
    slots run out of step."""

    def __init__(self, engine, num_slots):
        self.engine, self.num_slots = engine, num_slots
        self.counters = dict(decode_steps=0, chunk_calls=0, insert_calls=0)

    def empty(self):
        return dict(left=np.zeros(self.num_slots, int), rows={})

    def insert(self, state, prompts, slot_ids, row_keys):
        self.counters["insert_calls"] += 1
        out = self.engine.rows(prompts, row_keys)
        for r, k in enumerate(slot_ids):
            state["left"][k] = 1 + int(np.asarray(row_keys)[r, 0]) % 3
            state["rows"][k] = tuple(np.asarray(x)[r] for x in out[:4])
        return state

    def decode(self, state, wait=True):
        state["left"] = np.maximum(state["left"] - 1, 0)
        self.counters["chunk_calls"] += 1
        return state, (self.steps_run(1) if wait else 1)

    def steps_run(self, steps):
        self.counters["decode_steps"] += steps
        return steps

    def done(self, state):
        return state["left"] <= 0

    def read(self, state, slot_ids):
        return SampleOutput(*(np.stack(x) for x in zip(*(state["rows"][k] for k in slot_ids))))


def _rcfg(**kw) -> RolloutConfig:
    base = dict(game="textcraft", group_size=4, max_steps=4, max_prompt_length=1024, branch_turns=(1,))
    return RolloutConfig(**{**base, **kw})


def _play(tok, pool, rcfg, games=GAMES, key=7):
    return collect(None, KeyedEngine(tok), pool, games, rcfg, jax.random.key(key))


def _by_traj(res):
    out: dict[int, dict[int, object]] = {}
    for r in res.rows:
        out.setdefault(r.traj, {})[r.step] = r
    return out


def test_siblings_start_from_the_parents_state_and_rows_carry_the_tree(tok, pool):
    rcfg = _rcfg(branch_turns=(1, 2), branch_children=2)  # G = 4: one root per group, forks at turns 1 and 2
    res = _play(tok, pool, rcfg)
    assert rcfg.branch_roots == 1
    # every task group still ends with G = 4 games, each a whole trajectory of max_steps rows
    assert [ep.traj_id for ep in res.episodes] == list(range(8))
    assert all(ep.length == 4 and ep.env_error is None for ep in res.episodes)
    assert res.num_rows == 8 * 4
    st = res.stats.values()
    # per group: the root forks at turn 1 (1 fork), both games at turn 2 (2 forks); copies: 1 + 2 * 2
    assert st["branch_forks"] == 2 * 3 and st["branch_copied_rows"] == 2 * (1 + 2 * 2) and st["branch_released"] == 0
    rows = _by_traj(res)
    steps = res.steps
    n = res.num_rows
    obs_hash, source, branch = (np.asarray(x)[:n] for x in (steps.obs_hash, steps.source_row, steps.branch))
    index = {(r.traj, r.step): k for k, r in enumerate(res.rows)}
    for k in range(2):
        e = 4 * k  # the root's env: leaf 0; leaves 1 (fork 2), 2 (fork 1), 3 (forks 1 and 2)
        for leaf, fork_step, parent_leaf in ((2, 1, 0), (1, 2, 0), (3, 2, 2)):
            child, parent = rows[e + leaf], rows[e + parent_leaf]
            # the child's rows before its fork repeat the parent's (same tokens, source named)
            for s in range(fork_step):
                assert child[s].source is not None and np.array_equal(child[s].tokens, parent[s].tokens)
                assert source[index[(e + leaf, s)]] == source[index[(parent[s].traj, s)]]
            # its first own row shows the parent's observation at the branch point: hash-equal
            mine, theirs = index[(e + leaf, fork_step)], index[(parent[fork_step].traj, fork_step)]
            assert child[fork_step].source is None and source[mine] == mine
            assert child[fork_step].anchor == parent[fork_step].anchor and obs_hash[mine] == obs_hash[theirs]
            assert child[fork_step].prompt == parent[fork_step].prompt  # same state, same history: same prompt
            assert child[fork_step].branch == leaf_path(leaf, 2, 2)[:fork_step]  # forks done by then: fork_step
            assert branch[mine] == child[fork_step].branch[-1]
            # ... and samples from its own key: another response than its sibling's
            assert not np.array_equal(child[fork_step].tokens, parent[fork_step].tokens)
    # forked games part ways after the fork (the check above can fail)
    assert len({r.anchor for r in res.rows if r.step == 3}) > 2
    rate = res.stats.rates["sampled_singleton_row_rate"]
    assert rate[1] == n - st["branch_copied_rows"]  # sampled steps: copies counted once
    # the transcripts carry the tree: leaf 3 of group 0 repeats turns 0-1, samples turns 2-3 on path (1, 1)
    lines = [x for x in step_rows(res, tok, iteration=0, phase="rollout", gamma=1.0, max_games=8) if x["game"] == 3]
    assert [(x["turn"], x["branch"], x["repeated"]) for x in lines] == [
        (0, [], True),
        (1, [1], True),
        (2, [1, 1], False),
        (3, [1, 1], False),
    ]
    # an estimator runs on the branched batch as on any other (whole trajectories, steps 0..T-1)
    for name in ("gigpo", "bipace_q"):
        adv, diag = compute_advantages(res.steps, EstimatorConfig(name=name, epsilon=0.01))
        assert np.isfinite(res.row_values(adv)).all() and 0 <= float(diag["singleton_row_rate"]) <= 1


def test_a_childs_tokens_are_its_keys_and_unchanged_when_siblings_are_added_or_removed(tok, pool):
    two = _play(tok, pool, _rcfg(group_size=4, branch_children=2))  # 2 roots x 2 children
    three = _play(tok, pool, _rcfg(group_size=6, branch_children=3))  # 2 roots x 3 children
    for k in range(2):
        for root in range(2):
            for d in range(2):
                a = _by_traj(two)[4 * k + 2 * root + d]
                b = _by_traj(three)[6 * k + 3 * root + d]
                assert sorted(a) == sorted(b) == [0, 1, 2, 3]
                for s in a:
                    assert np.array_equal(a[s].tokens, b[s].tokens) and a[s].text == b[s].text, (k, root, d, s)
    # the keys are the documented ones: root r of group k has game_keys(key, games, R)[k * R + r], sibling d
    # folds BRANCH_SALT + d into it, turn t folds t
    roots = game_keys(jax.random.key(7), GAMES, 2)
    child = turn_keys(roots[[1]], [BRANCH_SALT + 1])  # group 0, root 1, sibling 1
    want = _keyed_text(turn_keys(child, [2])[0])
    assert _by_traj(two)[3][2].text == want


def test_continuous_equals_lockstep_with_branching(tok, pool):
    rcfg = _rcfg(group_size=8, branch_turns=(1, 2), branch_children=2, max_steps=4, num_slots=5)
    lock = _play(tok, pool, rcfg)
    cont = _play(tok, pool, dataclasses.replace(rcfg, scheduler="continuous"))
    assert lock.num_rows == cont.num_rows == 2 * 8 * 4 and lock.stats.values()["branch_forks"] == 2 * 2 * 3
    for f in ("prompt_ids", "response_ids", "response_mask"):
        np.testing.assert_array_equal(getattr(lock, f), getattr(cont, f))
    for f in ("group_id", "traj_id", "step", "reward", "obs_hash", "action_key", "source_row", "branch", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(lock.steps, f)), np.asarray(getattr(cont.steps, f)), f)
    assert lock.episodes == cont.episodes
    for f in ("text", "action", "anchor", "source", "branch", "prompt"):
        assert [getattr(r, f) for r in lock.rows] == [getattr(r, f) for r in cont.rows], f
    assert {k: v for k, v in cont.stats.values().items() if k != "slot_use"} == lock.stats.values()


def test_without_branching_the_rows_carry_no_tree_and_keys_are_unchanged(tok, pool):
    plain = _play(tok, pool, _rcfg(branch_turns=()))
    assert plain.steps.source_row is None and plain.steps.branch is None
    assert all(r.source is None and r.branch == () for r in plain.rows)
    assert "branch_forks" not in plain.stats.values()
    keys = game_keys(jax.random.key(7), GAMES, 4)
    assert _by_traj(plain)[5][1].text == _keyed_text(turn_keys(keys[[5]], [1])[0])


class ForkPool(InstantPool):
    """Fake games that end after ``turns`` steps and fork by copying the turn; ``wrong`` forks show
    another observation than the parent's (an injected divergence)."""

    def __init__(self, n, turns, wrong=False):
        super().__init__(n, turns)
        self.wrong, self.forks = wrong, []

    def _obs(self, i):
        text = f"turn {self.t[i]}"
        return Observation(text=text, anchor=text, task="craft item")

    def fork(self, parent, children):
        self.forks.append((parent, list(children)))
        for i in children:
            self.t[i] = self.t[parent] + (1 if self.wrong else 0)
        return [ForkResult(self._obs(i)) for i in children]


def test_a_game_that_ends_before_its_fork_releases_its_subtree_as_lone_games(tok):
    pool = ForkPool(8, turns=2)  # every game ends after 2 steps, before its fork at turn 2
    res = _play(tok, pool, _rcfg(branch_turns=(2,), max_steps=3))
    assert pool.forks == []
    st = res.stats.values()
    assert st["branch_released"] == 4 and st["branch_forks"] == 0  # 2 roots per group, 1 sibling each
    assert [ep.length for ep in res.episodes] == [2] * 8  # still G = 4 games per group, all from the reset
    roots = game_keys(jax.random.key(7), GAMES, 2)
    lone = turn_keys(roots[[3]], [BRANCH_SALT + 1])  # group 1, root 1: env 7 plays leaf (1, 1)'s key
    assert _by_traj(res)[7][0].text == _keyed_text(turn_keys(lone, [0])[0])


def test_a_fork_whose_restored_game_shows_another_observation_is_refused(tok):
    with pytest.raises(ReplayDivergedError, match="fork of env 0 into env 1 at turn 1"):
        _play(tok, ForkPool(8, turns=3, wrong=True), _rcfg(branch_turns=(1,), max_steps=3))


def test_a_diverging_replay_through_the_pool_raises_the_named_error():
    with EnvPool(DriftEnv, 2, num_workers=1) as p:
        p.reset([0, 1], [0, 0], [1, 1])
        p.step([0], ["go"])
        with pytest.raises(ReplayDivergedError, match=r"fork of env 0 into env 1: DriftEnv task 0 seed 1: the replay"):
            p.fork(0, [1])


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(group_size=6, branch_turns=(1, 2)),
            r"group_size=6 must be divisible by branch_children \*\* len\(branch_turns\) = 2 \*\* 2 = 4 \(a task",
        ),
        (dict(branch_children=1), "branch_children must be an int >= 2, got 1"),
        (
            dict(branch_turns=(2, 1)),
            r"branch_turns must be strictly increasing turns in \[1, max_steps=4\), got \(2, 1\)",
        ),
        (dict(branch_turns=(0,)), r"branch_turns must be strictly increasing turns in \[1, max_steps=4\), got \(0,\)"),
        (dict(branch_turns=(4,)), r"branch_turns must be strictly increasing turns in \[1, max_steps=4\), got \(4,\)"),
        (dict(branch_turns=(1.5,)), r"branch_turns must be a tuple of ints, got \(1\.5,\)"),
    ],
)
def test_branching_config_errors_name_the_fields(kw, match):
    with pytest.raises(ValueError, match=r"^RolloutConfig\." + match):
        _rcfg(**kw)


def test_the_training_config_checks_branching_and_validation_plays_lone_games():
    from bipace_jax import build
    from configs.textcraft_tiny import get_config

    c = get_config()
    assert tuple(c.rollout.branch_turns) == () and build.rollout_config(c, group_size=8).branch_turns == ()
    c.rollout.branch_turns = (2,)
    c.rollout.branch_children = 3
    with pytest.raises(ConfigError, match=r"config\.rollout\.group_size=8 must be divisible by branch_children"):
        build.rollout_config(c, group_size=8)
    c.rollout.branch_children = 2
    assert build.rollout_config(c, group_size=8).branch_roots == 4
    spec = build.build_spec(c)  # the run's: training branches, the validation panels play lone games
    assert spec.rollout.branch_turns == (2,) and spec.val_rollout.branch_turns == ()


@pytest.mark.slow
def test_the_warm_start_actor_branching_equals_across_schedulers_and_shared_heads(tok, pool):
    # the real engine and the shipped warm-start actor (its actions parse, so forked games part ways): a
    # branching rollout is the same under lockstep, lockstep with shared prompt heads, and continuous
    from bipace_jax.models import load_hf_checkpoint
    from bipace_jax.sampling import Engine

    actor = load_hf_checkpoint("bipace_jax/data/textcraft_tiny")
    scfg = dict(max_new_tokens=32, batch_buckets=(16,), length_buckets=(448,), temperature=1.0)
    rcfg = _rcfg(group_size=8, branch_turns=(1, 3), branch_children=2, max_steps=5, max_prompt_length=448)
    key = jax.random.key(3)
    lock = collect(actor, Engine(tok, SamplerConfig(**scfg)), pool, GAMES, rcfg, key)
    heads = collect(actor, Engine(tok, SamplerConfig(**scfg, shared_head_tokens=32)), pool, GAMES, rcfg, key)
    cont = collect(
        actor, Engine(tok, SamplerConfig(**scfg)), pool, GAMES, dataclasses.replace(rcfg, scheduler="continuous"), key
    )
    for other in (heads, cont):
        np.testing.assert_array_equal(lock.response_ids, other.response_ids)
        assert [(r.traj, r.step, r.action, r.anchor, r.source) for r in lock.rows] == [
            (r.traj, r.step, r.action, r.anchor, r.source) for r in other.rows
        ]
        np.testing.assert_array_equal(np.asarray(lock.steps.source_row), np.asarray(other.steps.source_row))
    assert lock.stats.values()["branch_forks"] > 0 and lock.stats.values()["invalid_rate"] < 0.5
    assert len({r.action for r in lock.rows}) > 2  # the actor's own commands, not one fallback


@pytest.mark.parametrize("released", [False, True])
def test_asynchronous_versions_follow_the_sampled_row_through_forks_and_released_games(tok, pool, released):
    # lockstep asks the policy once per turn (async_rl.switch = turn): a row sampled at turn t has version
    # 10 + t; a child's repeated prefix row carries its source's version, a child's own first row the fork
    # turn's, and a released lone game's rows the turns it really played
    asked = []

    def policy():
        asked.append(len(asked))
        return None, 10 + asked[-1]

    rcfg = dataclasses.replace(_rcfg(branch_turns=(1, 2), branch_children=2), scheduler="lockstep")
    play_pool = ForkPool(8, turns=2) if released else pool
    if released:
        rcfg = _rcfg(branch_turns=(2,), max_steps=3, scheduler="lockstep")
    res = collect(None, KeyedEngine(tok), play_pool, GAMES, rcfg, jax.random.key(7), policy=policy)
    first = {}  # env -> the version of its step 0
    for r in res.rows:
        first.setdefault(r.traj, r.policy_version - r.step)
        assert r.policy_version == first[r.traj] + r.step  # one version per turn, in order
    # without release every game's step 0 is turn 0's; released lone games start at turn 2, after the roots end
    assert sorted(first.values()) == ([10] * 4 + [12] * 4 if released else [10] * 8)
    assert any(r.source is not None for r in res.rows) != released
    assert res.tokens.policy_version.tolist() == [r.policy_version for r in res.rows]
