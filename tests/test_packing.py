"""Packed, token-budget micro-batches: the layout (hand-computed) and packed == unpacked (log-probs,
the update's gradients and statistics) for rows of very different lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bipace_jax import losses, sharding
from bipace_jax.batch import TokenBatch, pack_lines
from bipace_jax.models import Qwen2Actor
from bipace_jax.models.attention import REFERENCE, attention, segments_of_mask, splash_attention
from bipace_jax.models.layers import positions_in_segments
from bipace_jax.ppo import PPOLearner, mini_batches
from tests.qwen_fixtures import one_layer_config

V = 48


def _actor(seed=0):
    return Qwen2Actor(one_layer_config(V, layers=2), rngs=nnx.Rngs(seed))


def _batch(prompts, responses, p, m, seed=0):
    """Rows with the given real prompt / response lengths (left-padded prompts, right-padded responses)."""
    rng = np.random.default_rng(seed)
    n = len(prompts)
    ids = np.zeros((n, p + m), np.int32)
    mask = np.zeros((n, p + m), np.int32)
    rid = np.zeros((n, m), np.int32)
    rm = np.zeros((n, m), bool)
    for i, (lp, lr) in enumerate(zip(prompts, responses)):
        ids[i, p - lp : p] = rng.integers(3, V, lp)
        mask[i, p - lp : p] = 1
        rid[i, :lr] = rng.integers(3, V, lr)
        rm[i, :lr] = True
    ids[:, p:] = rid
    mask[:, p:] = rm
    return TokenBatch(ids, mask, rid, rm, p)


def test_pack_lines_first_fit_longest_first_within_both_capacities():
    tokens = np.array([7, 3, 5, 2, 4])
    responses = np.array([2, 1, 3, 1, 2])
    # longest first: 0 (7), 2 (5), 4 (4), 1 (3), 3 (2); width 10, 4 response tokens a line
    lines = pack_lines(np.arange(5), tokens, responses, width=10, response_width=4)
    # (tokens, response tokens) left per line: 0 opens A (3, 2); 2 does not fit A: B (5, 1); 4: A has 3 < 4
    # tokens, B 1 < 2 response tokens: C (6, 2); 1 fits A -> (0, 1); 3: not A (0 tokens), B -> (3, 0)
    assert lines == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="ppo.pack_width=6"):
        pack_lines(np.arange(5), tokens, responses, width=6, response_width=4)
    with pytest.raises(ValueError, match="ppo.pack_response_width=2"):
        pack_lines(np.arange(5), tokens, responses, width=10, response_width=2)


def test_take_packed_lays_rows_out_as_segments_with_the_predicting_columns():
    b = _batch([2, 3], [2, 1], p=4, m=3)
    mb, rows, cols = b.take_packed([[1, 0]], width=10, response_width=4, num_lines=2)
    real1 = b.input_ids[1][b.attention_mask[1] > 0]  # 3 prompt + 1 response
    real0 = b.input_ids[0][b.attention_mask[0] > 0]  # 2 prompt + 2 response
    np.testing.assert_array_equal(mb.input_ids[0], np.concatenate([real1, real0, [0, 0]]))
    assert mb.segment_ids.tolist() == [[1, 1, 1, 1, 2, 2, 2, 2, 0, 0], [0] * 10]
    # row 1's response token sits at line column 3, predicted by column 2; row 0's at 6 and 7 (by 5, 6)
    assert mb.head_index[0].tolist() == [2, 5, 6, 0]
    assert mb.response_mask.tolist() == [[True, True, True, False], [False] * 4]
    assert rows.tolist() == [[1, 0, 0, -1], [-1] * 4] and cols.tolist() == [[0, 0, 1, -1], [-1] * 4]
    assert mb.response_ids[0, :3].tolist() == [b.response_ids[1, 0], b.response_ids[0, 0], b.response_ids[0, 1]]
    assert positions_in_segments(jnp.asarray(mb.segment_ids)).tolist()[0] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_segments_of_a_causal_mask_are_the_runs_it_attends():
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    causal = jnp.tril(jnp.ones((6, 6), bool))
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :])
    assert segments_of_mask(mask).tolist() == [[0, 0, 2, 2, 2, 5]]
    left_padded = causal[None] & jnp.array([[0, 0, 1, 1, 1, 1]], bool)[:, None, :]
    ids = segments_of_mask(left_padded).tolist()[0]
    assert ids[2:] == [2, 2, 2, 2] and 2 not in ids[:2]  # padding columns are not in the real run


@pytest.mark.slow
def test_splash_attention_with_packed_segments_matches_the_reference():
    b, t, n, k, hd = 1, 256, 4, 2, 32
    rng = np.random.default_rng(0)
    q, kk, vv = (jnp.asarray(rng.normal(size=(b, t, h, hd)), jnp.float32) for h in (n, k, k))
    seg = np.zeros((b, t), np.int32)
    seg[0, :100], seg[0, 100:230] = 1, 2  # two sequences and padding
    causal = np.tril(np.ones((t, t), bool))
    mask = jnp.asarray(causal[None] & (seg[:, :, None] == seg[:, None, :]))
    want = attention(q, kk, vv, mask, causal=True, schedule=REFERENCE)
    got = splash_attention(q, kk, vv, mask[:, -1, :], segment_ids=segments_of_mask(mask), interpret=True)
    np.testing.assert_allclose(np.asarray(got)[0, :230], np.asarray(want)[0, :230], atol=2e-5)


# prompts of 2..40 tokens, responses of 1..12: rows of very different lengths
PROMPTS = [40, 2, 17, 33, 5, 9, 28, 3, 12, 21, 38, 6]
RESPONSES = [12, 1, 7, 3, 11, 2, 9, 12, 4, 1, 6, 10]


def _learners(kl, mini, micro=3, tis_cap=0.0):
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    cfg = losses.PPOLossConfig(kl_coef=kl, entropy_coef=0.001, tis_cap=tis_cap)
    kw = dict(micro_batch_rows=micro, mini_batch_rows=mini)
    plain = PPOLearner(_actor(), mesh, cfg, optax.sgd(1.0), **kw)
    packed = PPOLearner(_actor(), mesh, cfg, optax.sgd(1.0), pack=True, pack_width=64, pack_response_width=16, **kw)
    return plain, packed


@pytest.mark.slow
def test_packed_logprobs_equal_unpacked():
    b = _batch(PROMPTS, RESPONSES, p=40, m=12)
    plain, packed = _learners(kl=0.0, mini=0)
    want = plain.logprobs(plain.params_local, b)
    got = packed.logprobs(packed.params_local, b)
    np.testing.assert_allclose(got[b.response_mask], want[b.response_mask], atol=1e-5)
    assert (got[~b.response_mask] == 0).all()
    # 12 rows, 265 real tokens: unpacked 4 micro-batches x 3 rows x 52 columns, packed lines of 64
    t = packed.last_tokens["logprobs"]
    assert t["real"] == plain.last_tokens["logprobs"]["real"] == sum(PROMPTS) + sum(RESPONSES)
    assert t["processed"] < plain.last_tokens["logprobs"]["processed"]


@pytest.mark.slow
def test_packed_update_equals_unpacked_across_micro_and_mini_batches():
    # 12 rows in 2 mini-batches of 6 (two SGD steps), micro-batches of 3 rows / 3 packed lines; KL on;
    # old log-probs off the current ones, so the ratio clips on some tokens
    b = _batch(PROMPTS, RESPONSES, p=40, m=12)
    rng = np.random.default_rng(1)
    plain, packed = _learners(kl=0.05, mini=6)
    lp = plain.logprobs(plain.params_local, b)
    old = lp + rng.normal(0, 0.3, lp.shape).astype(np.float32)
    ref = lp - 0.1
    adv = rng.normal(size=b.rows).astype(np.float32)
    full = b.with_(old_logprobs=old, ref_logprobs=ref, advantages=adv)
    before = jax.tree.map(np.asarray, plain.params)
    stats = {}
    for name, L in (("plain", plain), ("packed", packed)):
        stats[name] = L.update(full, jax.random.key(3))
    assert stats["plain"]["loss/updates"] == stats["packed"]["loss/updates"] == 2
    assert stats["plain"]["loss/clip_frac"] > 0 and stats["plain"]["loss/kl"] > 0
    for k, v in stats["plain"].items():
        np.testing.assert_allclose(stats["packed"][k], v, rtol=1e-4, atol=1e-7, err_msg=k)
    # SGD at lr 1: the parameter change is the summed gradient of the two steps
    d_plain = jax.tree.map(lambda a, c: np.asarray(a) - c, plain.params, before)
    d_packed = jax.tree.map(lambda a, c: np.asarray(a) - c, packed.params, before)
    for a, c in zip(jax.tree.leaves(d_plain), jax.tree.leaves(d_packed)):
        assert np.linalg.norm(c - a) <= 1e-4 * np.linalg.norm(a) + 1e-9
    assert packed.last_tokens["update"]["real"] == plain.last_tokens["update"]["real"]


@pytest.mark.slow
def test_packed_update_equals_unpacked_with_truncated_importance_weights():
    # as above, plus sampler log-probs off the old ones by N(0, 0.5): about a fifth of the weights pass
    # the cap 1.5; both layouts weight the same tokens alike (stats and the parameters after 2 steps)
    b = _batch(PROMPTS, RESPONSES, p=40, m=12)
    rng = np.random.default_rng(2)
    plain, packed = _learners(kl=0.05, mini=6, tis_cap=1.5)
    lp = plain.logprobs(plain.params_local, b)
    old = lp + rng.normal(0, 0.3, lp.shape).astype(np.float32)
    sampler = old + rng.normal(0, 0.5, lp.shape).astype(np.float32)
    adv = rng.normal(size=b.rows).astype(np.float32)
    full = b.with_(old_logprobs=old, ref_logprobs=lp - 0.1, advantages=adv, sampler_logprobs=sampler)
    before = jax.tree.map(np.asarray, plain.params)
    key = jax.random.key(3)
    stats = {name: L.update(full, key) for name, L in (("plain", plain), ("packed", packed))}
    for k, v in stats["plain"].items():
        np.testing.assert_allclose(stats["packed"][k], v, rtol=1e-4, atol=1e-7, err_msg=k)
    # the weights' stats against NumPy: token means per mini-batch (the update's split), averaged over the 2
    w = np.exp(old - sampler)
    minis = mini_batches(np.array([b.rows]), 0, 6, jax.random.fold_in(key, 0))
    rm = b.response_mask
    want_w = np.mean([np.minimum(w[r], 1.5)[rm[r]].mean() for r in minis])
    want_t = np.mean([(w[r] > 1.5)[rm[r]].mean() for r in minis])
    assert stats["plain"]["loss/is_weight"] == pytest.approx(want_w, rel=1e-5)
    assert stats["plain"]["loss/is_truncated_frac"] == pytest.approx(want_t, rel=1e-5)
    assert 0.05 < want_t < 0.5
    d_plain = jax.tree.map(lambda a, c: np.asarray(a) - c, plain.params, before)
    d_packed = jax.tree.map(lambda a, c: np.asarray(a) - c, packed.params, before)
    for a, c in zip(jax.tree.leaves(d_plain), jax.tree.leaves(d_packed)):
        assert np.linalg.norm(c - a) <= 1e-4 * np.linalg.norm(a) + 1e-9
