"""Episode transcripts: the lines of a real collect (TextCraft games, a scripted oracle sampler, the
shipped tokenizer, the real estimator) round-trip through episodes/<i>.jsonl; the game bound, the
phase replacement and the renderer (and launch.transcripts) give the expected text."""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np
import pytest

from bipace_jax import transcripts
from bipace_jax.estimators import EstimatorConfig, compute_advantages, step_details
from bipace_jax.models import load_tokenizer
from bipace_jax.rollout import RolloutConfig, collect
from bipace_jax.sampling import SampleOutput, SamplerConfig
from environments.pool import EnvPool
from launch.transcripts import show

GAMES = [(16, 3), (12, 4)]  # depth-3 goals the oracle solves in 5-6 steps
GAMMA = 0.9


class OracleSampler:
    """Answers each live game with its oracle action; env ``bad`` answers gibberish (invalid)."""

    def __init__(self, tokenizer, pool, n_envs, bad=()):
        self.config = SamplerConfig(max_new_tokens=48, length_buckets=(512, 1024))
        self.tokenizer, self.pool, self.n_envs, self.bad = tokenizer, pool, n_envs, set(bad)
        self.eos_token_ids = (tokenizer.eos_token_id,)
        self.pad_id = tokenizer.pad_token_id

    def length_bucket(self, t):
        return next(b for b in self.config.length_buckets if b >= t)

    def generate(self, actor, prompts, key, *, temperature=None, row_keys=None, groups=None):
        oracle = self.pool.oracle_actions(list(range(self.n_envs)))
        live = [i for i, a in enumerate(oracle) if a is not None]
        m, b = self.config.max_new_tokens, len(prompts)
        tokens, lengths = np.full((b, m), self.pad_id, np.int32), np.zeros(b, np.int32)
        for r, i in enumerate(live):
            text = "I do not know." if i in self.bad else f"<action>{oracle[i]}</action>"
            ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
            tokens[r, : len(ids)], lengths[r] = ids, len(ids)
        fps = np.tile(np.eye(1, 8, dtype=np.float32), (b, 1))  # one cluster per task group's step
        logps = np.where(np.arange(m)[None] < lengths[:, None], -0.5, 0.0).astype(np.float32)
        return SampleOutput(tokens, lengths, logps, fps)


@pytest.fixture(scope="module")
def played():
    """(RolloutResult, tokenizer, advantages [N], labels [N], kinds [N]) of 2 groups x 2 games, env 1 invalid."""
    tok = load_tokenizer("bipace_jax/data/textcraft_tiny")
    with EnvPool("textcraft", 4, env_options={"max_steps": 6}, num_workers=1) as pool:
        rcfg = RolloutConfig(game="textcraft", group_size=2, max_steps=6, max_prompt_length=1024)
        res = collect(None, OracleSampler(tok, pool, 4, bad={1}), pool, GAMES, rcfg, jax.random.key(0))
    cfg = EstimatorConfig(name="bipace_q", gamma=GAMMA, epsilon=0.05)
    adv = res.row_values(compute_advantages(res.steps, cfg)[0])
    labels, kinds = (res.row_values(x).astype(np.int32) for x in step_details(res.steps, cfg))
    return res, tok, adv, labels, kinds


@pytest.mark.slow  # the played fixture: an env pool and two TextCraft task groups, 15-20 s
def test_written_lines_equal_the_rollout_result(played, tmp_path):
    res, tok, adv, labels, kinds = played
    rows = transcripts.step_rows(
        res, tok, iteration=3, phase="rollout", gamma=GAMMA, max_games=8, advantages=adv, labels=labels, kinds=kinds
    )
    transcripts.write(str(tmp_path), 3, "rollout", rows)
    back = transcripts.read(str(tmp_path), 3)
    assert back == json.loads(json.dumps(rows)) and len(back) == res.num_rows
    assert transcripts.iterations(str(tmp_path)) == [3]
    steps = res.steps
    traj, step = np.asarray(steps.traj_id)[: res.num_rows], np.asarray(steps.step)[: res.num_rows]
    net = (np.asarray(steps.reward) - np.asarray(steps.penalty))[: res.num_rows]
    for r, line in enumerate(back):
        ep = res.episodes[line["game"]]
        assert (line["game"], line["turn"]) == (traj[r], step[r])
        assert (line["task_id"], line["seed"], line["won"]) == (ep.task_id, ep.seed, ep.won)
        assert line["episode_return"] == pytest.approx(ep.episode_return) and line["episode_length"] == ep.length
        assert line["advantage"] == pytest.approx(float(adv[r]), abs=1e-6)
        assert line["step_group"] == labels[r] and line["reward"] == pytest.approx(float(net[r]), abs=1e-6)
        assert (line["response"], line["action"], line["valid"]) == (
            res.rows[r].text,
            res.rows[r].action,
            res.rows[r].valid,
        )
        ids = res.prompt_ids[r][res.prompt_mask[r] == 1].astype(np.int32)
        assert line["prompt_hash"] == hashlib.sha256(ids.tobytes()).hexdigest()[:16]
        assert line["prompt_tokens"] == ids.size and res.rows[r].observation == line["observation"]
        assert (line["prompt"] is not None) == (line["turn"] == 0)
        assert line["policy_version"] == res.rows[r].policy_version == 0  # played without a policy source
        assert line["pace_kind"] == {-1: "excluded", 1: "loo", 2: "pace"}.get(int(kinds[r]), line["pace_kind"])
    # the oracle games win on their last step (+10) and the return is 10 * gamma^(steps left)
    won = [ln for ln in back if ln["won"]]
    for ln in won:
        assert ln["return"] == pytest.approx(10.0 * GAMMA ** (ln["episode_length"] - 1 - ln["turn"]), rel=1e-6)
    assert won and all(ln["action"] == "inventory" and ln["valid"] is False for ln in back if ln["game"] == 1)
    bad = [ln for ln in back if ln["game"] == 1]  # six invalid turns charged 0.1 each
    assert [ln["reward"] for ln in bad] == pytest.approx([-0.1] * 6)
    assert bad[0]["return"] == pytest.approx(-0.1 * sum(GAMMA**k for k in range(6)))
    assert bad[0]["prompt"].startswith("<|im_start|>") and "Goal: craft" in bad[0]["prompt"]
    # equal fingerprints: one cluster per task group, holding several distinct action keys (the steps'
    # commands; an unparsable response is a key of its own), so every row takes the PACE branch
    assert {ln["pace_kind"] for ln in back} == {"pace"}
    assert len({ln["step_group"] for ln in back if ln["group"] == 0}) == 1
    assert len({ln["step_group"] for ln in back}) == 2


@pytest.mark.slow
def test_max_games_bounds_the_file_and_a_phase_written_again_replaces_its_lines(played, tmp_path):
    res, tok, *_ = played
    rows = transcripts.step_rows(res, tok, iteration=0, phase="val", gamma=GAMMA, max_games=1)
    assert {r["game"] for r in rows} == {0} and len(rows) == res.episodes[0].length
    assert all(r["advantage"] is None and r["step_group"] is None for r in rows)
    assert transcripts.gather(rows, 1) == [dict(r, host=0) for r in rows]  # one process: unchanged
    w = str(tmp_path)
    transcripts.write(w, 0, "val", rows)
    two = transcripts.step_rows(res, tok, iteration=0, phase="rollout", gamma=GAMMA, max_games=2)
    transcripts.write(w, 0, "rollout", two)
    transcripts.write(w, 0, "rollout", two[:1])  # a re-run iteration: the old rollout lines go
    back = transcripts.read(w, 0)
    assert [r["phase"] for r in back] == ["val"] * len(rows) + ["rollout"]
    assert len(open(tmp_path / "episodes" / "0.jsonl").read().splitlines()) == len(rows) + 1
    with pytest.raises(ValueError, match="max_games must be >= 1"):
        transcripts.step_rows(res, tok, iteration=0, phase="val", gamma=GAMMA, max_games=0)
    with pytest.raises(ValueError, match=r"advantages must be one value per token row"):
        transcripts.step_rows(res, tok, iteration=0, phase="val", gamma=GAMMA, max_games=1, advantages=np.zeros(3))


def _line(turn, **kw):
    base = dict(iteration=2, phase="rollout", game=0, host=0, task_id=7, seed=11, group=0, turn=turn, won=True)
    base.update(episode_return=10.0, episode_length=2, prompt=None, observation=f"obs {turn}", valid=True)
    base.update(response=f"<action>a{turn}</action>", action=f"a{turn}", reward=0.0, advantage=None)
    base.update(step_group=None, pace_kind=None, finish="stop", policy_version=2)
    return {**base, **kw}


def test_render_prints_header_prompt_and_turns(tmp_path):
    rows = [
        _line(
            0, prompt="PROMPT\n", observation="obs 0", **{"return": 9.0}, advantage=0.5, step_group=3, pace_kind="pace"
        ),
        _line(
            1, reward=10.0, **{"return": 10.0}, advantage=-0.25, step_group=4, pace_kind="singleton", policy_version=1
        ),
        _line(0, game=1, won=False, valid=False, action="inventory", **{"return": -0.1}, reward=-0.1),
    ]
    text = transcripts.render(rows, game=0)
    assert text.splitlines() == [
        "=== iteration 2 rollout game 0: task 7 seed 11 (group 0, host 0) won in 2 steps, return +10.000",
        "--- prompt (turn 0)",
        "PROMPT",
        "--- turn 0",
        "response: <action>a0</action>",
        "action: a0",
        "reward +0.000  return +9.000  advantage +0.500  step group 3 (pace)",
        "--- turn 1",
        "observation: obs 1",
        "response: <action>a1</action>",
        "action: a1",
        "reward +10.000  return +10.000  advantage -0.250  step group 4 (singleton)  sampled by version 1 (lag 1)",
    ]
    other = transcripts.render(rows, game=1).splitlines()
    assert other[0].endswith("lost in 2 steps, return +10.000") and "action: inventory (invalid)" in other
    assert "observation: obs 0" in other and "reward -0.100  return -0.100  advantage -" in other
    assert transcripts.render(rows, phase="val") == ""
    transcripts.write(str(tmp_path), 2, "rollout", rows)
    assert show(str(tmp_path), game=0) == text  # launch.transcripts: the last iteration by default
    with pytest.raises(ValueError, match=r"iteration 2 has \(phase, game\) \[\('rollout', 0\), \('rollout', 1\)\]"):
        show(str(tmp_path), game=5)
    with pytest.raises(ValueError, match=r"--iteration=4: .* has transcripts of iterations \[2\]"):
        show(str(tmp_path), iteration=4)
    with pytest.raises(ValueError, match="no episodes/<iteration>.jsonl"):
        show(str(tmp_path / "none"))
