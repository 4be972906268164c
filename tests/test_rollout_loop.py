"""The rollout's event loop (``rollout.schedule.run``) on host-only doubles of the engine and the pool:
both schedulers, a game whose prompt cannot fit, text no tokenizer encodes, and the config checks."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest

from bipace_jax.models import load_tokenizer
from bipace_jax.rollout import PROMPT_TOO_LONG, RolloutConfig, Scheduler, collect
from bipace_jax.rollout.turns import clean_observation, clean_text
from bipace_jax.sampling import SampleOutput, SamplerConfig
from environments.base import Observation
from environments.testing import InstantPool

GAMES = [(3, 1), (5, 2)]  # two task groups of G = 2: envs 0, 1 and 2, 3
ANSWER = "<think>ok</think><action>inventory</action>"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bipace_jax/data/textcraft_tiny")


class ScriptedEngine:
    """Answers every prompt with ``ANSWER`` and EOS, by ``generate`` (lockstep) or by slots (continuous):
    an inserted row has its first token, then one token per decode step until its length."""

    def __init__(self, tok, **config):
        self.config = SamplerConfig(max_new_tokens=24, batch_buckets=(4,), length_buckets=(1024,), **config)
        self.tokenizer, self.pad_id, self.eos_token_ids = tok, tok.pad_token_id, (tok.eos_token_id,)
        self.answer = tok.encode(ANSWER) + [tok.eos_token_id]
        self.prompts: list[list[int]] = []  # every prompt the engine was given, in order

    def rows(self, prompts) -> SampleOutput:
        self.prompts += [list(p) for p in prompts]
        b, m = len(prompts), self.config.max_new_tokens
        tokens = np.full((b, m), self.pad_id, np.int32)
        tokens[:, : len(self.answer)] = self.answer
        lengths = np.full(b, len(self.answer), np.int32)
        logps = np.where(tokens != self.pad_id, -0.5, 0.0).astype(np.float32)
        return SampleOutput(tokens, lengths, logps, np.tile(np.eye(1, 4, dtype=np.float32), (b, 1)))

    def generate(self, actor, prompts, key, *, temperature=None, row_keys=None, groups=None):
        assert row_keys is not None and len(row_keys) == len(groups) == len(prompts)
        return self.rows(prompts)

    def slots(self, actor, num_slots, *, max_prompt, chunk, temperature=None):
        return ScriptedSlots(self, num_slots, chunk)


class ScriptedSlots:
    def __init__(self, engine, num_slots, chunk):
        self.engine, self.num_slots, self.chunk = engine, num_slots, chunk
        self.counters = dict(decode_steps=0, chunk_calls=0, insert_calls=0)
        self.length = len(engine.answer)

    def empty(self):
        return dict(pos=np.full(self.num_slots, self.length), rows={})

    def insert(self, state, prompts, slot_ids, row_keys):
        self.counters["insert_calls"] += 1
        out = self.engine.rows(prompts)
        for k, r in zip(slot_ids, range(len(prompts))):
            state["pos"][k] = 1
            state["rows"][k] = tuple(x[r] for x in out[:4])
        return state

    def decode(self, state, wait=True):
        live = state["pos"] < self.length
        steps = min(self.chunk, int((self.length - state["pos"][live]).min())) if live.any() else 0
        state["pos"][live] += steps
        self.counters["chunk_calls"] += 1
        return state, (self.steps_run(steps) if wait else steps)

    def steps_run(self, steps):
        self.counters["decode_steps"] += steps
        return steps

    def done(self, state):
        return state["pos"] >= self.length

    def read(self, state, slot_ids):
        return SampleOutput(*(np.stack(x) for x in zip(*(state["rows"][k] for k in slot_ids))))


class TextPool(InstantPool):
    """In-process games: env i shows ``text(i, turn)`` and ends after ``turns`` steps; a submitted step is
    answered at the next poll; ``stepped`` lists the (env, turn) of every step taken."""

    def __init__(self, n, turns, text):
        super().__init__(n, turns)
        self.text, self.stepped = text, []

    def _obs(self, i):
        words = self.text(i, self.t[i])
        return Observation(text=words, anchor=words, task=f"craft item {i // 2}")

    def _advance(self, i):
        out = super()._advance(i)
        self.stepped.append((i, self.t[i]))
        return out


def _play(tok, text, scheduler, turns=3, **rcfg):
    engine = ScriptedEngine(tok)
    pool = TextPool(4, turns, text)
    cfg = RolloutConfig(game="textcraft", group_size=2, max_steps=turns, max_prompt_length=1024, **rcfg)
    cfg = dataclasses.replace(cfg, scheduler=scheduler)
    res = collect(None, engine, pool, GAMES, cfg, jax.random.key(0))
    return res, engine, pool


@pytest.mark.parametrize("scheduler", list(Scheduler))
def test_a_game_whose_prompt_cannot_fit_ends_with_a_named_fault_and_the_others_play_on(tok, scheduler):
    # env 1's observation after its first step and env 2's first one do not fit 1024 tokens with no history
    def text(i, t):
        long = (i == 1 and t == 1) or (i == 2 and t == 0)
        return " ".join(["oak planks"] * 800) if long else f"turn {t} of env {i}"

    res, engine, pool = _play(tok, text, scheduler, num_slots=3 if scheduler == Scheduler.CONTINUOUS else 0)
    eps = res.episodes
    assert [e.env_error for e in eps] == [None, PROMPT_TOO_LONG, PROMPT_TOO_LONG, None]
    assert [e.length for e in eps] == [3, 1, 0, 3] and not eps[1].truncated
    assert "env 1 (task 3, seed 1) step 1: the prompt has" in eps[1].env_error_detail
    assert "max_prompt_length=1024" in eps[2].env_error_detail
    s = res.stats.values()
    assert s["env_errors"] == 2 and s["env_errors_prompt_too_long"] == 2 and s["env_errors_exception"] == 0
    assert s["rows"] == 6 and s["env_error_rows"] == 1  # env 1's one played row, left out
    assert [r.traj for r in res.rows] == [0, 0, 0, 3, 3, 3]
    assert pool.in_flight == 0 and sorted(pool.stepped) == [(0, 1), (0, 2), (0, 3), (1, 1), (3, 1), (3, 2), (3, 3)]
    assert len(engine.prompts) == 7  # the two long prompts never reached the engine


def test_both_schedulers_give_the_same_rows_around_a_prompt_that_cannot_fit(tok):
    def text(i, t):
        return " ".join(["oak planks"] * 800) if (i, t) == (3, 2) else f"turn {t} of env {i}"

    lock, _, _ = _play(tok, text, Scheduler.LOCKSTEP)
    cont, _, _ = _play(tok, text, Scheduler.CONTINUOUS, num_slots=2, chunk_steps=2)
    assert [e.env_error for e in lock.episodes] == [None, None, None, PROMPT_TOO_LONG]
    assert lock.episodes == cont.episodes
    np.testing.assert_array_equal(lock.tokens.input_ids, cont.tokens.input_ids)
    assert [(r.traj, r.step, r.observation) for r in lock.rows] == [(r.traj, r.step, r.observation) for r in cont.rows]
    assert cont.timing["inserts"] > 0 and lock.stats.values()["env_error_rows"] == 2


ODD = "emoji \U0001f642, CJK \u6f22\u5b57, RTL \u05e9\u05dc\u05d5\u05dd, NUL \x00 end"


@pytest.mark.parametrize("scheduler", list(Scheduler))
def test_a_lone_surrogate_in_a_games_text_becomes_a_replacement_character(tok, scheduler):
    def text(i, t):
        return f"bad\ud800text {ODD}" if i == 2 else f"turn {t} {ODD}"

    with pytest.raises(TypeError):  # what the tokenizer does with the raw text: the reason for the rule
        tok("bad\ud800text")
    res, engine, _ = _play(tok, text, scheduler)
    assert all(e.env_error is None for e in res.episodes) and res.num_rows == 12
    rows2 = [r for r in res.rows if r.traj == 2]
    assert {r.observation for r in rows2} == {f"bad\ufffdtext {ODD}"}
    assert all(r.state.anchor == r.observation for r in rows2)
    # the prompt the engine saw holds the replacement character and the other scripts unchanged
    seen = [tok.decode(p) for p in engine.prompts]
    assert sum("bad\ufffdtext" in s for s in seen) == 3 and all(ODD in s for s in seen)


def test_clean_observation_replaces_only_lone_surrogates():
    obs = Observation(text="a\udc80b", anchor=ODD, task="t\ud83d", admissible_actions=["go\ud800", "look"])
    out = clean_observation(obs)
    assert (out.text, out.anchor, out.task) == ("a\ufffdb", ODD, "t\ufffd")
    assert out.admissible_actions == ["go\ufffd", "look"]
    same = Observation(text=ODD, anchor=ODD, task="t")
    assert clean_observation(same) is same and clean_text(ODD) is ODD
    assert clean_text("\U0001f642") == "\U0001f642"  # a surrogate pair's character is no lone surrogate


def test_continuous_warns_of_slots_past_the_games_and_of_unused_shared_heads(tok):
    pool = TextPool(4, 1, lambda i, t: "x")
    cfg = RolloutConfig(game="textcraft", group_size=2, max_steps=1, max_prompt_length=1024, scheduler="continuous")
    with pytest.warns(UserWarning, match=r"RolloutConfig.num_slots=1000 is more than the 4 games of this collect"):
        collect(None, ScriptedEngine(tok), pool, GAMES, dataclasses.replace(cfg, num_slots=1000), jax.random.key(0))
    with pytest.warns(UserWarning, match=r"SamplerConfig.shared_head_tokens=32 has no effect with RolloutConfig.sch"):
        collect(None, ScriptedEngine(tok, shared_head_tokens=32), pool, GAMES, cfg, jax.random.key(0))
    with warnings.catch_warnings():  # lockstep uses the heads; 4 slots for 4 games: no warning
        warnings.simplefilter("error")
        collect(None, ScriptedEngine(tok, shared_head_tokens=32), pool, GAMES, dataclasses.replace(cfg, scheduler="lockstep"), jax.random.key(0))  # fmt: skip
        collect(None, ScriptedEngine(tok), pool, GAMES, dataclasses.replace(cfg, num_slots=4), jax.random.key(0))
