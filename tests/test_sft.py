"""Warm start (launch/sft.py): data format, loss, DAgger labelling, and the command end to end."""

import json
import os

import numpy as np
import pytest

import environments
from bipace_jax.tiny import train_tokenizer
from launch.build_tokenizer import textcraft_corpus, item_names
from launch.sft import (Example, PromptBuilder, encode_prompt, encode_response, make_batch,
                        oracle_episodes, play_policy, summarize, token_nll, validate_config)

TASKS = [300, 301, 150]  # three depth-2 goals


@pytest.fixture(scope="module")
def tok():
    texts, lines = textcraft_corpus(seeds=1, task_ids=TASKS)
    return train_tokenizer(texts, vocab_size=400, phrase_tokens=item_names(lines))


def make_env():
    return environments.make("textcraft", max_steps=15)


def test_examples_are_the_rl_prompt_and_the_oracle_action_in_tags(tok):
    from environments.prompts import build_prompt

    prompt = PromptBuilder("textcraft", history_length=0, show_inventory=True)
    examples, stats = oracle_episodes(make_env, [(300, 0)], prompt, tok)
    assert stats["oracle_win_rate"] == 1.0
    env = make_env()
    obs = env.reset(300, 0)
    history, step = [], 0
    for ex in examples:  # replay: each example is (chat(build_prompt(state)), oracle action)
        action = env.oracle_action()
        user = build_prompt("textcraft", obs, history, step, history_length=0, show_inventory=True)
        chat = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                       add_generation_prompt=True)
        assert tok.decode(ex.prompt_ids) == chat
        assert tok.decode(ex.response_ids) == f"<action>{action}</action><|im_end|>"
        history.append((obs.text, action))
        obs, _, done, _ = env.step(action)
        step += 1
    assert done and obs.won and len(examples) == step


def test_make_batch_places_targets_after_the_prompt():
    ex = [Example([5, 6, 7], [8, 9]), Example([5], [8, 9, 10])]
    ids, mask, pos, tgt, tmask = make_batch(ex, length=6, pad_id=0, response_length=4)
    np.testing.assert_array_equal(ids, [[5, 6, 7, 8, 9, 0], [5, 8, 9, 10, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    # column t predicts token t+1: the last prompt column predicts the first response token
    np.testing.assert_array_equal(pos, [[2, 3, 0, 0], [0, 1, 2, 0]])
    np.testing.assert_array_equal(tgt, [[8, 9, 0, 0], [8, 9, 10, 0]])
    np.testing.assert_array_equal(tmask, [[1, 1, 0, 0], [1, 1, 1, 0]])
    with pytest.raises(ValueError, match="response_length"):
        make_batch(ex, length=6, pad_id=0, response_length=2)
    with pytest.raises(ValueError, match="length bucket"):
        make_batch(ex, length=4, pad_id=0, response_length=4)


def test_token_nll_matches_numpy_on_masked_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    targets = np.array([[1, 4, 0], [2, 2, 3]], np.int32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    want = -(picked * mask).sum() / mask.sum()
    acc = ((logits.argmax(-1) == targets) * mask).sum() / mask.sum()
    loss, got_acc = token_nll(logits, targets, mask)
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    np.testing.assert_allclose(float(got_acc), acc, rtol=1e-6)


def test_dagger_labels_every_visited_state_with_the_oracle_action_from_that_state(tok):
    """A policy that first wastes a step on a wrong `get` then follows the oracle: the oracle
    labels re-plan from the state the policy actually reached (the recovery data DAgger adds)."""
    prompt = PromptBuilder("textcraft", history_length=0, show_inventory=True)
    made = []

    def make_tracked_env():
        made.append(make_env())
        return made[-1]

    def generate(prompts):  # one game: look at its env to act
        env = made[0]
        return ["<action>get 1 dirt</action>" if env._steps == 0 else
                f"<action>{env.oracle_action()}</action>"]

    episodes, examples = play_policy(generate, make_tracked_env, [(300, 7)], prompt, tok,
                                     max_steps=15, label=True)
    assert episodes[0]["won"] and episodes[0]["invalid"] == 0
    assert len(examples) == episodes[0]["length"]
    # replay the same actions and check every label is the oracle's action from that state
    env = make_env()
    env.reset(300, 7)
    actions = ["get 1 dirt"]
    assert tok.decode(examples[0].response_ids) == f"<action>{env.oracle_action()}</action><|im_end|>"
    env.step(actions[0])
    for ex in examples[1:]:
        a = env.oracle_action()
        assert tok.decode(ex.response_ids) == f"<action>{a}</action><|im_end|>"
        env.step(a)
    assert all(e.source == "dagger" for e in examples)


def test_unparsable_responses_count_as_invalid_and_send_the_fallback(tok):
    prompt = PromptBuilder("textcraft", history_length=0, show_inventory=True)
    episodes, examples = play_policy(lambda ps: ["no tags"] * len(ps), make_env, [(300, 1), (301, 2)],
                                     prompt, tok, max_steps=3, label=False)
    assert [e["won"] for e in episodes] == [False, False]
    assert [e["invalid"] for e in episodes] == [3, 3] and examples == []
    s = summarize(episodes)
    assert s["success"] == 0.0 and s["invalid_rate"] == 1.0 and s["mean_length"] == 3.0


def test_summarize_splits_depths_and_heldout_goals():
    eps = [dict(task_id=1, depth=2, won=True, length=4, invalid=0),
           dict(task_id=2, depth=2, won=False, length=15, invalid=3),
           dict(task_id=3, depth=3, won=True, length=6, invalid=1),
           dict(task_id=4, depth=2, won=True, length=5, invalid=0)]
    s = summarize(eps, heldout={4})
    assert s["success"] == 0.75 and s["success_depth2"] == pytest.approx(2 / 3)
    assert s["success_depth3"] == 1.0 and s["success_seen"] == pytest.approx(2 / 3)
    assert s["success_heldout"] == 1.0 and s["invalid_rate"] == pytest.approx(4 / 30)


def test_bad_config_fails_with_one_line_naming_the_field():
    from configs.sft_textcraft_tiny import get_config

    c = get_config()
    c.train.batch_size = 0
    with pytest.raises(ValueError, match=r"config\.train\.batch_size must be >= 1"):
        validate_config(c)
