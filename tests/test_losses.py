"""Loss terms against hand-computed values (formulas in bipace_jax/losses.py docstrings)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from bipace_jax import losses


def _lp(r):
    """log-ratio giving ratio r when old_logprobs = 0."""
    return jnp.asarray(np.log(np.asarray(r, np.float64)), jnp.float32)


def test_ppo_clip_loss_matches_hand_computed_cases():
    # (A, ratio) -> expected per-token loss, clipped flag; clip 0.2, dual clip 3.0
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0, -2.0, 0.0, 1.0]])
    ratio = np.array([[1.5, 0.5, 1.5, 5.0, 0.5, 2.0, 1.1]])
    loss, clipped = losses.ppo_clip_loss(_lp(ratio), jnp.zeros_like(adv), adv, 0.2, 3.0)
    # A=1,r=1.5: max(-1.5,-1.2)=-1.2 clipped; A=1,r=.5: max(-.5,-.8)=-.5;
    # A=-1,r=1.5: max(1.5,1.2)=1.5; A=-1,r=5: max(5,1.2)=5 -> dual min(5,3)=3 (clipped);
    # A=-2,r=.5: max(1.0,1.6)=1.6 clipped; A=0: 0; A=1,r=1.1: -1.1 inside the range.
    np.testing.assert_allclose(loss, [[-1.2, -0.5, 1.5, 3.0, 1.6, 0.0, -1.1]], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(clipped, [[1, 0, 0, 1, 1, 0, 0]])


def test_ppo_clip_loss_without_dual_clip_is_unbounded_for_negative_advantage():
    loss, _ = losses.ppo_clip_loss(_lp([[5.0]]), jnp.zeros((1, 1)), jnp.array([[-1.0]]), 0.2, None)
    np.testing.assert_allclose(loss, [[5.0]], rtol=1e-6)


def test_low_var_kl_matches_k3_formula_and_bound():
    logp = jnp.log(jnp.array([[0.5, 0.5, 1e-12]]))
    ref = jnp.log(jnp.array([[0.25, 0.5, 0.9]]))
    kl = losses.low_var_kl(logp, ref, bound=10.0)
    d = math.log(0.5)  # log(0.25 / 0.5)
    np.testing.assert_allclose(kl[0, :2], [math.exp(d) - d - 1.0, 0.0], rtol=1e-5, atol=1e-7)
    assert float(kl[0, 2]) == 10.0  # exp(27.5) clamped to the bound


def test_entropy_from_logits_matches_closed_form():
    logits = jnp.array([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    h = losses.entropy_from_logits(logits)
    expected_2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    np.testing.assert_allclose(h, [[math.log(2.0), expected_2]], rtol=1e-6)


def test_token_logprobs_gathers_log_softmax():
    logits = jnp.array([[[0.0, math.log(3.0)], [2.0, 2.0]]])
    lp = losses.token_logprobs(logits, jnp.array([[1, 0]]))
    np.testing.assert_allclose(lp, [[math.log(0.75), math.log(0.5)]], rtol=1e-6)


def test_token_mean_ignores_masked_tokens_even_if_nonfinite():
    values = jnp.array([[1.0, 3.0, jnp.nan], [5.0, jnp.inf, 7.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
    assert float(losses.token_mean(values, mask)) == pytest.approx((1 + 3 + 5) / 3)
    assert float(losses.token_mean(values, mask, denom=9.0)) == pytest.approx(1.0)
    assert float(losses.token_mean(values, jnp.zeros_like(mask))) == 0.0


def _ppo_loss(logits, targets, mask, old, ref, adv, cfg, denom=None):
    """The PPO objective from logits [B, M, V] at ``cfg.temperature``, as ``ppo.response_logprobs`` feeds it."""
    logits = jnp.asarray(logits, jnp.float32) / cfg.temperature
    logp, ent = losses.token_logprobs(logits, targets), losses.entropy_from_logits(logits)
    return losses.ppo_loss_from_logprobs(logp, ent, mask, old, ref, adv, cfg, denom)


def test_ppo_loss_total_matches_hand_computed_value():
    # One row, two tokens (second masked). V=2, logits [0, log 3] -> p = [.25, .75]; target 1.
    logits = jnp.array([[[0.0, math.log(3.0)], [9.0, -9.0]]])
    targets = jnp.array([[1, 0]])
    mask = jnp.array([[True, False]])
    logp = math.log(0.75)
    old = jnp.array([[logp - math.log(1.5), 0.0]])  # ratio 1.5
    ref = jnp.array([[math.log(0.5), 0.0]])
    adv = jnp.array([2.0])
    cfg = losses.PPOLossConfig(clip_eps=0.2, dual_clip=3.0, kl_coef=0.01, entropy_coef=0.001)
    loss, m = _ppo_loss(logits, targets, mask, old, ref, adv, cfg)
    pg = max(-2.0 * 1.5, -2.0 * 1.2)  # = -2.4
    d = math.log(0.5) - logp
    kl = math.exp(d) - d - 1.0
    ent = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert float(m["pg_loss"]) == pytest.approx(pg, rel=1e-5)
    assert float(m["kl"]) == pytest.approx(kl, rel=1e-5)
    assert float(m["entropy"]) == pytest.approx(ent, rel=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(1.0)
    assert float(loss) == pytest.approx(pg + 0.01 * kl - 0.001 * ent, rel=1e-5)


def test_ppo_loss_is_taken_at_the_policy_temperature():
    # logits [0, log 9] at temperature 2 are [0, log 3] at 1: the hand-computed case above.
    logits = jnp.array([[[0.0, math.log(9.0)], [9.0, -9.0]]])
    targets, mask = jnp.array([[1, 0]]), jnp.array([[True, False]])
    logp = math.log(0.75)
    old = jnp.array([[logp - math.log(1.5), 0.0]])
    ref = jnp.array([[math.log(0.5), 0.0]])
    cfg = losses.PPOLossConfig(clip_eps=0.2, dual_clip=3.0, kl_coef=0.01, entropy_coef=0.001, temperature=2.0)
    loss, m = _ppo_loss(logits, targets, mask, old, ref, jnp.array([2.0]), cfg)
    d = math.log(0.5) - logp
    ent = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert float(m["entropy"]) == pytest.approx(ent, rel=1e-5)
    assert float(loss) == pytest.approx(-2.4 + 0.01 * (math.exp(d) - d - 1.0) - 0.001 * ent, rel=1e-5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        losses.PPOLossConfig(temperature=0.0)


@pytest.mark.slow
def test_micro_batch_losses_with_global_denominator_sum_to_full_batch_token_mean():
    rng = np.random.default_rng(0)
    B, M, V = 6, 5, 7
    logits = jnp.asarray(rng.normal(size=(B, M, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, size=(B, M)), jnp.int32)
    mask = jnp.asarray(rng.random((B, M)) < 0.7)
    old = jnp.asarray(rng.normal(size=(B, M)) * 0.1 - 2.0, jnp.float32)
    ref = jnp.asarray(rng.normal(size=(B, M)) * 0.1 - 2.0, jnp.float32)
    adv = jnp.asarray(rng.normal(size=(B,)), jnp.float32)
    cfg = losses.PPOLossConfig()
    full, _ = _ppo_loss(logits, targets, mask, old, ref, adv, cfg)
    denom = jnp.sum(mask)
    parts = [
        _ppo_loss(logits[s], targets[s], mask[s], old[s], ref[s], adv[s], cfg, denom)[0]
        for s in (slice(0, 2), slice(2, 4), slice(4, 6))
    ]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-5)


def test_ppo_loss_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="clip_eps"):
        losses.PPOLossConfig(clip_eps=0.0)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.PPOLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_coef"):
        losses.PPOLossConfig(kl_coef=-1.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _ppo_loss(
            jnp.zeros((1, 1, 2)),
            jnp.zeros((1, 1), jnp.int32),
            jnp.ones((1, 1), bool),
            jnp.zeros((1, 1)),
            None,
            jnp.zeros((1,)),
            losses.PPOLossConfig(),
        )


def test_low_var_kl_is_never_negative_near_zero():
    # exp(d) - d - 1 cancels to -5.96e-8 at d = -3e-8 in float32; expm1(d) - d does not.
    assert float(losses.low_var_kl(jnp.asarray([3e-8]), jnp.asarray([0.0]))[0]) == 0.0
    d = np.concatenate([np.linspace(-1e-3, 1e-3, 20001), -np.logspace(-12, -1, 500), np.logspace(-12, -1, 500)])
    d = d.astype(np.float32)
    kl = np.asarray(losses.low_var_kl(jnp.zeros_like(d), jnp.asarray(d), bound=np.inf))
    assert kl.min() >= 0.0
    np.testing.assert_allclose(kl, np.expm1(d.astype(np.float64)) - d, rtol=1e-3, atol=2e-9)  # float32 ulps of d


@pytest.mark.parametrize("gap", [80.0, 100.0, 1e4])
def test_a_masked_token_with_a_huge_ratio_gives_the_gradient_of_the_real_tokens_alone(gap):
    # the issue: a masked (padding) token whose ratio is e^100 gave a NaN gradient (e^80 was fine):
    # exp(100) overflows float32 and the mask's zero times inf is NaN in the backward pass
    import jax

    cfg = losses.PPOLossConfig(kl_coef=0.01, entropy_coef=0.0)
    logprobs = jnp.array([[-1.0, -0.5, 0.0]])
    old = jnp.array([[-1.2, -0.5, -gap]])  # the third token is padding: its ratio is e^gap
    ref = jnp.array([[-1.0, -0.7, -gap]])
    mask = jnp.array([[True, True, False]])
    adv = jnp.array([-1.5])

    def loss(lp, m):
        return losses.ppo_loss_from_logprobs(lp, jnp.zeros_like(lp), m, old, ref, adv, cfg)[0]

    grad = jax.grad(loss)(logprobs, mask)
    assert np.isfinite(np.asarray(grad)).all(), grad
    assert float(grad[0, 2]) == 0.0  # a masked token moves nothing
    # the real tokens' gradient equals the gradient of the same loss with the padding cut off
    short = jax.grad(
        lambda lp: losses.ppo_loss_from_logprobs(lp, jnp.zeros_like(lp), mask[:, :2], old[:, :2], ref[:, :2], adv, cfg)[
            0
        ]
    )(logprobs[:, :2])
    np.testing.assert_allclose(np.asarray(grad[:, :2]), np.asarray(short), rtol=1e-6)
    assert np.isfinite(float(loss(logprobs, mask)))


# --- truncated importance sampling (ppo.tis_cap) ------------------------------------------------


def test_truncated_is_weights_below_at_and_above_the_cap_without_overflow():
    # log(old / sampler): e^-100, 0.5, 1, the cap 2 exactly, 3, e^100, e^1e4 (float32 exp overflows past ~88.7)
    old = jnp.asarray([[-100.0, math.log(0.5), 0.0, math.log(2.0), math.log(3.0), 100.0, 1e4]], jnp.float32)
    w, truncated = losses.truncated_is_weights(old, jnp.zeros_like(old), 2.0)
    np.testing.assert_allclose(w, [[math.exp(-100.0), 0.5, 1.0, 2.0, 2.0, 2.0, 2.0]], rtol=1e-6, atol=1e-38)
    np.testing.assert_array_equal(truncated, [[0, 0, 0, 0, 1, 1, 1]])  # a weight equal to the cap is kept


def _tis_oracle(logp, old, sampler, ref, ent, adv, mask, clip, dual, kl_coef, ent_coef, cap, bound=10.0):
    """NumPy float64 oracle of the TIS-weighted token-mean objective and its gradient in ``logp``."""
    logp, old, sampler, ref, ent = (np.asarray(x, np.float64) for x in (logp, old, sampler, ref, ent))
    a = np.broadcast_to(np.asarray(adv, np.float64)[:, None], logp.shape)
    m = np.asarray(mask, bool)
    r = np.exp(np.where(m, logp - old, 0.0))
    unclipped, clipped = -a * r, -a * np.clip(r, 1 - clip, 1 + clip)
    pg = np.maximum(unclipped, clipped)
    d_pg = np.where(unclipped >= clipped, -a * r, 0.0)  # d/dlogp of the active branch (clip(r) is flat)
    dual_on = (a < 0) & (-a * dual < pg)
    pg, d_pg = np.where(dual_on, -a * dual, pg), np.where(dual_on, 0.0, d_pg)
    with np.errstate(over="ignore"):
        w = np.minimum(np.exp(np.where(m, old - sampler, 0.0)), cap)
    dk = np.where(m, ref - logp, 0.0)
    k3 = np.exp(dk) - dk - 1
    d_k3 = np.where(np.abs(k3) < bound, 1.0 - np.exp(dk), 0.0)
    n = m.sum()
    loss = ((w * pg)[m].sum() + kl_coef * k3[m].sum() - ent_coef * ent[m].sum()) / n
    grad = np.where(m, w * d_pg + kl_coef * d_k3, 0.0) / n
    return loss, grad, (w * pg)[m].sum() / n, w[m].mean(), (np.exp(np.where(m, old - sampler, 0.0)) > cap)[m].mean()


def test_tis_weighted_loss_and_gradient_match_a_numpy_oracle():
    import jax

    # two rows x 5 tokens: importance weights below (0.5, 1.9), above (3, e^100) the cap 2, and e^-100 (a
    # weight exactly at the cap: the test above; here float32 rounding of old - sampler decides it);
    # masked tokens whose sampler ratio is e^100 or e^-100 and whose old ratio is e^100
    logp = np.array([[-1.0, -0.5, -2.0, -0.3, -1.1], [-0.7, -1.5, -0.2, -0.9, -3.0]], np.float32)
    old = logp - np.log(np.array([[1.5, 0.5, 1.1, 0.9, 1.0], [1.3, 0.7, 5.0, 1.0, 1.0]], np.float32))
    log_w = np.array([[math.log(0.5), math.log(1.9), math.log(3.0), 100.0, 100.0], [0.1, -100.0, 0.0, 0.0, -100.0]])
    sampler = (old - log_w).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], bool)
    old[0, 4] = logp[0, 4] - 100.0  # a masked token with an old ratio of e^100 as well
    ref = logp + np.array([[0.2, -0.1, 0.3, 0.0, 50.0], [-0.4, 0.1, 0.2, 0.0, 0.0]], np.float32)
    ent = np.array([[0.5, 1.0, 1.5, 2.0, 9.0], [0.7, 0.9, 1.1, 1.3, 9.0]], np.float32)
    adv = np.array([1.5, -2.0], np.float32)
    cfg = losses.PPOLossConfig(clip_eps=0.2, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01, tis_cap=2.0)

    def f(lp):
        args = (jnp.asarray(ent), jnp.asarray(mask), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv), cfg)
        return losses.ppo_loss_from_logprobs(lp, *args, sampler_logprobs=jnp.asarray(sampler))

    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    want, want_grad, want_pg, want_w, want_trunc = _tis_oracle(
        logp, old, sampler, ref, ent, adv, mask, 0.2, 3.0, 0.05, 0.01, 2.0
    )
    assert np.isfinite(np.asarray(grad)).all() and np.isfinite(float(loss))
    assert float(loss) == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)
    assert float(m["pg_loss"]) == pytest.approx(want_pg, rel=1e-5)
    # 7 real tokens: weights 0.5, 1.9, 2 (3 truncated), 2 (e^100 truncated), e^0.1, e^-100, 1
    assert float(m["is_weight"]) == pytest.approx(want_w, rel=1e-6)
    assert want_w == pytest.approx((0.5 + 1.9 + 2 + 2 + math.exp(0.1) + math.exp(-100) + 1) / 7)
    assert float(m["is_truncated_frac"]) == pytest.approx(want_trunc) == pytest.approx(2 / 7)
    # the weights carry no gradient: the loss does not move with the sampler's log-probs
    g_sampler = jax.grad(
        lambda s: losses.ppo_loss_from_logprobs(
            jnp.asarray(logp),
            jnp.asarray(ent),
            jnp.asarray(mask),
            jnp.asarray(old),
            jnp.asarray(ref),
            jnp.asarray(adv),
            cfg,
            sampler_logprobs=s,
        )[0]
    )(jnp.asarray(sampler))
    assert (np.asarray(g_sampler) == 0).all()


def test_tis_off_is_the_unweighted_loss_exactly_and_unit_weights_change_nothing():
    rng = np.random.default_rng(0)
    B, M = 4, 6
    logp = jnp.asarray(rng.normal(size=(B, M)) * 0.3 - 1.0, jnp.float32)
    old = logp + jnp.asarray(rng.normal(size=(B, M)) * 0.3, jnp.float32)
    ref = logp + jnp.asarray(rng.normal(size=(B, M)) * 0.1, jnp.float32)
    ent = jnp.asarray(rng.random((B, M)), jnp.float32)
    mask = jnp.asarray(rng.random((B, M)) < 0.7)
    adv = jnp.asarray(rng.normal(size=(B,)), jnp.float32)
    off = losses.PPOLossConfig()
    base = losses.ppo_loss_from_logprobs(logp, ent, mask, old, ref, adv, off)
    # tis_cap 0: sampler log-probs, however far off, are ignored; loss and stats bit-identical
    ignored = losses.ppo_loss_from_logprobs(logp, ent, mask, old, ref, adv, off, sampler_logprobs=old - 5.0)
    assert float(ignored[0]) == float(base[0]) and set(ignored[1]) == set(base[1])
    assert all(float(ignored[1][k]) == float(v) for k, v in base[1].items())
    # a sampler that agrees with the learner: every weight exp(0) = 1, the same loss bit for bit
    on = losses.PPOLossConfig(tis_cap=2.0)
    same = losses.ppo_loss_from_logprobs(logp, ent, mask, old, ref, adv, on, sampler_logprobs=old)
    assert float(same[0]) == float(base[0])
    assert all(float(same[1][k]) == float(v) for k, v in base[1].items())
    assert float(same[1]["is_weight"]) == 1.0 and float(same[1]["is_truncated_frac"]) == 0.0


def test_tis_needs_the_sampler_logprobs_and_a_finite_non_negative_cap():
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"PPOLossConfig\.tis_cap must be a finite number >= 0 \(0 = off\)"):
            losses.PPOLossConfig(tis_cap=bad)
    one = jnp.zeros((1, 1))
    with pytest.raises(ValueError, match=r"sampler_logprobs is None but tis_cap=2\.0 > 0"):
        losses.ppo_loss_from_logprobs(
            one, one, jnp.ones((1, 1), bool), one, None, jnp.zeros((1,)), losses.PPOLossConfig(kl_coef=0.0, tis_cap=2.0)
        )
