"""Shared prompt heads: the host plan (hand-computed cases) and the sampler's shared-head prefill on the
tiny Qwen2 (the plain prefill is the oracle: same tokens, log-probs and fingerprints)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from bipace_jax.models import Qwen2Actor, Qwen2Config
from bipace_jax.sampling import Engine, SamplerConfig
from bipace_jax.sampling.heads import common_prefix_length, plan_heads, suffix_ladder
from tests.test_sampling import small_tokenizer


def _arr(*xs):
    return np.asarray(xs, np.int32)


def test_common_prefix_length_and_the_suffix_ladder():
    assert common_prefix_length([_arr(1, 2, 3, 4), _arr(1, 2, 5), _arr(1, 2, 3)]) == 2
    assert common_prefix_length([_arr(7, 8), _arr(7, 8, 9)]) == 2  # the shorter one whole
    assert common_prefix_length([_arr(1, 2)]) == 2 and common_prefix_length([_arr(1), _arr(2)]) == 0
    assert suffix_ladder(64) == suffix_ladder(224) == (32,) and suffix_ladder(288) == (32, 128)
    assert suffix_ladder(63) == () and suffix_ladder(1024) == (32, 128, 512)


def test_two_groups_of_identical_prompts_share_all_but_their_last_token():
    a, b = np.arange(10, 50, dtype=np.int32), np.arange(100, 140, dtype=np.int32)  # 40 tokens each
    plan = plan_heads([a, a, b, b], [0, 0, 1, 1], 128, 4, min_tokens=8)
    # Ts 32: heads of 39 tokens in Th 96, suffixes of 1; cost 2 heads * 96 + 4 rows * 32 = 320 of 4 * 128.
    assert (plan.head_width, plan.suffix_width, plan.tokens, plan.plain_tokens) == (96, 32, 320, 512)
    assert len(plan.heads) == 2 and plan.shared_rows == 4
    np.testing.assert_array_equal(plan.heads[0], a[:39])
    np.testing.assert_array_equal(plan.heads[1], b[:39])
    np.testing.assert_array_equal(plan.row_head, [0, 0, 1, 1])
    np.testing.assert_array_equal(plan.split, [39, 39, 39, 39])


def test_a_group_too_long_for_the_head_width_shares_a_shorter_head_and_a_lone_row_is_its_own_head():
    head = np.arange(10, 110, dtype=np.int32)  # 100 shared tokens
    rows = [np.concatenate([head, _arr(1, 2)]), np.concatenate([head, _arr(3)]), np.arange(200, 320, dtype=np.int32)]
    plan = plan_heads(rows, [5, 5, 6], 128, 4, min_tokens=8)
    # Ts 32: Th 96 takes 96 of the 100 shared tokens (suffixes 6 and 5); the lone 120-token row splits
    # at 120 - 32 = 88. Heads: 2 -> bucket 2; cost 2 * 96 + 4 * 32 = 320.
    assert (plan.suffix_width, plan.tokens, plan.shared_rows) == (32, 320, 2)
    np.testing.assert_array_equal(plan.split, [96, 96, 88])
    np.testing.assert_array_equal(plan.row_head, [0, 0, 1])
    np.testing.assert_array_equal(plan.heads[0], head[:96])
    np.testing.assert_array_equal(plan.heads[1], rows[2][:88])


def test_no_plan_without_a_shared_head_worth_it():
    x, y = np.arange(1, 41, dtype=np.int32), np.arange(101, 141, dtype=np.int32)
    assert plan_heads([x, y], [0, 1], 64, 2, min_tokens=4) is None  # no group has two rows
    assert plan_heads([x, y], [0, 0], 64, 2, min_tokens=4) is None  # the group shares nothing
    assert plan_heads([x, x], [0, 0], 64, 2, min_tokens=40) is None  # 39 shared tokens < min_tokens
    # One shared pair and 8 lone rows: 9 heads (bucket 16) cost 16 * 32 + 16 * 32, the plain 16 * 64.
    lone = [np.arange(i * 50, i * 50 + 40, dtype=np.int32) for i in range(8)]
    assert plan_heads([x, x, *lone], [0, 0, *range(1, 9)], 64, 16, min_tokens=4) is None


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(groups=[0]), "one id per prompt"),
        (dict(min_tokens=0), "min_tokens must be an int >= 1"),
        (dict(prompt_bucket=8), r"prompts must hold 1\.\.8 tokens"),
    ],
)
def test_plan_heads_rejects_bad_input(kw, match):
    args = dict(arrays=[np.arange(1, 11, dtype=np.int32)] * 2, groups=[0, 0], prompt_bucket=64, batch_bucket=2)
    args.update(kw)
    min_tokens = args.pop("min_tokens", 4)
    with pytest.raises(ValueError, match=match):
        plan_heads(**args, min_tokens=min_tokens)


def _prompts(vocab):
    """Three groups of four prompts on a 70-token head (one prompt the head alone, three with suffixes of
    1-19 tokens) and a lone 50-token prompt."""
    rng = np.random.default_rng(0)
    prompts, groups = [], []
    for g in range(3):
        head = rng.integers(3, vocab, 70).tolist()
        for j in range(4):
            prompts.append(head + (rng.integers(3, vocab, int(rng.integers(1, 20))).tolist() if j else []))
            groups.append(g)
    prompts.append(rng.integers(3, vocab, 50).tolist())
    groups.append(9)
    return prompts, groups


@pytest.mark.slow
@pytest.mark.parametrize("fingerprint_layer", [-1, 1])
def test_shared_head_prefill_equals_the_plain_prefill(fingerprint_layer):
    tok = small_tokenizer()
    actor = Qwen2Actor(Qwen2Config.tiny(vocab_size=len(tok)), fingerprint_layer=fingerprint_layer, rngs=nnx.Rngs(0))
    prompts, groups = _prompts(len(tok))
    base = dict(max_new_tokens=12, batch_buckets=(4, 16), length_buckets=(128,))
    for greedy in (True, False):
        plain = Engine(tok, SamplerConfig(**base, greedy=greedy))
        shared = Engine(tok, SamplerConfig(**base, greedy=greedy, shared_head_tokens=32))
        plan = shared.head_plan([np.asarray(p, np.int32) for p in prompts], groups, 128)
        assert plan is not None and len(plan.heads) == 4 and plan.shared_rows == 12
        keys = jax.random.split(jax.random.key(3), len(prompts))
        a = plain.generate(actor, prompts, jax.random.key(0), row_keys=keys, groups=groups)
        b = shared.generate(actor, prompts, jax.random.key(0), row_keys=keys, groups=groups)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_allclose(a.fingerprints, b.fingerprints, atol=1e-5)
        assert b.timing.prefill_tokens < 0.5 * a.timing.prefill_tokens
        assert a.timing.prefill_tokens == a.timing.prompt_tokens == sum(map(len, prompts))
    assert len(set(a.lengths.tolist())) > 1  # rows of several lengths were decoded after the shared prefill


def test_generate_rejects_groups_of_the_wrong_length():
    tok = small_tokenizer()
    actor = Qwen2Actor(Qwen2Config.tiny(vocab_size=len(tok)), rngs=nnx.Rngs(0))
    sampler = Engine(tok, SamplerConfig(max_new_tokens=2, shared_head_tokens=8))
    with pytest.raises(ValueError, match=r"groups must hold one int per prompt \(2\), got 1"):
        sampler.generate(actor, [[5, 6], [5, 7]], jax.random.key(0), groups=[0])


def test_sampler_config_rejects_a_negative_head_length():
    with pytest.raises(ValueError, match="shared_head_tokens must be an int >= 0"):
        SamplerConfig(shared_head_tokens=-1)


def test_qwen_pretokens_split_digits_words_and_spaces_like_qwen2():
    from launch.head_lengths import qwen_pretokens

    # "Hello", " world", " ", "1", "2", ".\n", " go": every digit alone, a word keeps its leading space,
    # punctuation takes the new lines after it
    assert qwen_pretokens("Hello world 12.\n go") == 7
    assert qwen_pretokens("cabinet 10, cabinet 2") == 8  # "cabinet", " ", "1", "0", ",", " cabinet", " ", "2"


def test_the_committed_head_lengths_put_the_shared_head_first():
    # benchmarks/shared_heads.json (launch.head_lengths): turn 1's two prompts are one prompt (the head is
    # all of it); later the head ends where the two games' history first differs, never before the task
    import json
    import os

    from launch._common import ROOT

    games = json.load(open(os.path.join(ROOT, "benchmarks", "shared_heads.json")))["games"]
    assert sorted(games) == ["alfworld", "textcraft", "webshop"]
    for g in games.values():
        for r in g["rows"]:
            assert r["head_qwen"] <= min(r["prompt_qwen"], r["prompt_qwen_other"])
            if r["turn"] == 1:
                assert r["head_chars"] == r["prompt_chars"]
            else:
                assert "Observation" in r["head_ends_with"] or "Action" in r["head_ends_with"]
        assert 3.0 < g["chars_per_qwen_token"] < 4.5
