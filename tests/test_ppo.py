"""PPOLearner: log-prob alignment, exact gradient accumulation, NaN guard, and the update's direction."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bipace_jax import losses, sharding
from bipace_jax.config import ConfigError
from bipace_jax.models import Qwen2Actor
from bipace_jax.ppo import STAT_KEYS, NonFiniteError, PPOLearner
from tests.qwen_fixtures import one_layer_config, random_token_batch

V = 48
SGD = optax.sgd(0.5)  # shared transformations: learners of one model + loss + optimizer share compiled programs
ADAMW = optax.adamw(3e-3)


def _actor(seed=0, **kw):
    return Qwen2Actor(one_layer_config(V), rngs=nnx.Rngs(seed), **kw)


def _batch(n=6, p=7, m=5, seed=0):
    """Left-padded prompts of random length, right-padded responses of random length (>= 1)."""
    return random_token_batch(np.random.default_rng(seed), n, p, m, V)


def _update(L, b, old, ref, adv, key):
    return L.update(b.with_(old_logprobs=old, ref_logprobs=ref, advantages=adv), key)


@nnx.jit
def _row_logits(actor, seq):
    """Logits float32[T, V] of one unpadded row int32[1, T] (jitted: one compile per length, not per op)."""
    return actor(seq, jnp.ones_like(seq)).logits[0]


def _learner(tx, micro, kl=0.0, mini=0, actor=None):
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    cfg = losses.PPOLossConfig(kl_coef=kl, entropy_coef=0.001)
    return PPOLearner(actor or _actor(), mesh, cfg, tx, micro_batch_rows=micro, mini_batch_rows=mini)


@pytest.mark.slow
def test_logprobs_match_a_per_row_forward_over_the_real_tokens():
    L = _learner(SGD, micro=4)
    b = _batch(n=4)
    lp = L.logprobs(L.params_local, b)
    actor = _actor()
    for i in range(b.rows):
        prompt = b.input_ids[i, : b.prompt_len][b.attention_mask[i, : b.prompt_len] > 0]
        resp = b.response_ids[i][b.response_mask[i]]
        seq = np.concatenate([prompt, resp])[None]
        logits = _row_logits(actor, jnp.asarray(seq))
        want = jax.nn.log_softmax(logits[len(prompt) - 1 : -1], -1)[np.arange(len(resp)), resp]
        np.testing.assert_allclose(lp[i, : len(resp)], want, atol=2e-5)


@pytest.mark.slow
def test_gradient_accumulation_over_micro_batches_equals_one_big_batch():
    b = _batch(n=6)
    adv = np.array([1.0, -0.5, 2.0, 0.0, -1.5, 0.7], np.float32)
    results = []
    for micro in (6, 4):  # 4: a full and a padded micro-batch
        L = _learner(SGD, micro=micro)
        old = L.logprobs(L.params_local, b) - 0.05  # ratios away from 1
        _update(L, b, old, None, adv, jax.random.PRNGKey(0))
        results.append(jax.tree.map(np.asarray, L.params))
    for other in results[1:]:
        jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-6, rtol=1e-5), results[0], other)


@pytest.mark.slow
def test_first_update_sees_unit_ratio_and_zero_kl_to_the_initial_policy():
    L = _learner(ADAMW, micro=3, kl=0.01)
    b = _batch()
    old = L.logprobs(L.params_local, b)
    ref = L.logprobs(L.ref_params_local, b)
    np.testing.assert_allclose(old, ref, atol=1e-6)
    out = _update(L, b, old, ref, np.ones(b.rows, np.float32), jax.random.PRNGKey(0))
    assert out["loss/clip_frac"] == 0.0
    assert abs(out["loss/kl"]) < 1e-7
    assert out["loss/updates"] == 1 and out["loss/grad_norm"] > 0
    # the reference stays frozen while the policy moves
    np.testing.assert_allclose(L.logprobs(L.ref_params_local, b), ref, atol=1e-6)
    assert np.abs(L.logprobs(L.params_local, b) - old)[b.response_mask].max() > 1e-4


@pytest.mark.slow
def test_updates_raise_logprob_of_positive_advantage_rows_and_lower_negative_ones():
    L = _learner(ADAMW, micro=3, mini=0)
    b = _batch(n=6, seed=3)
    adv = np.array([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], np.float32)
    before = (L.logprobs(L.params_local, b) * b.response_mask).sum(1)
    for it in range(3):
        old = L.logprobs(L.params_local, b)
        _update(L, b, old, None, adv, jax.random.PRNGKey(it))
    after = (L.logprobs(L.params_local, b) * b.response_mask).sum(1)
    assert np.all(after[:3] > before[:3]) and np.all(after[3:] < before[3:])


@pytest.mark.slow
def test_mini_batches_give_one_optimizer_step_each():
    L = _learner(ADAMW, micro=3, mini=4)
    b = _batch(n=10)  # 3 mini-batches of <= 4 rows, each 2 micro-batches of 3
    out = _update(L, b, L.logprobs(L.params_local, b), None, np.ones(10, np.float32), jax.random.PRNGKey(0))
    assert out["loss/updates"] == 3  # ceil(10 / 4)


@pytest.mark.slow
def test_nan_advantage_stops_the_update_and_leaves_params_untouched():
    L = _learner(ADAMW, micro=3)
    b = _batch()
    before = jax.tree.map(np.asarray, L.params)
    adv = np.ones(b.rows, np.float32)
    adv[2] = np.nan
    with pytest.raises(NonFiniteError, match="non-finite PPO update .*the update was not applied"):
        _update(L, b, L.logprobs(L.params_local, b), None, adv, jax.random.PRNGKey(0))
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, L.params))


@pytest.mark.slow
def test_fused_old_logprobs_give_the_same_update_as_a_recomputed_pass():
    b = _batch(n=6, seed=5)
    adv = np.array([1.0, -0.5, 2.0, 0.0, -1.5, 0.7], np.float32)
    plain = _learner(ADAMW, micro=3, kl=0.01)
    _update(
        plain,
        b,
        plain.logprobs(plain.params_local, b),
        plain.logprobs(plain.ref_params_local, b),
        adv,
        jax.random.PRNGKey(0),
    )
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fused = PPOLearner(
        _actor(),
        mesh,
        losses.PPOLossConfig(kl_coef=0.01, entropy_coef=0.001),
        ADAMW,
        micro_batch_rows=3,
        fused_old_logprobs=True,
    )
    sampler_lp = fused.logprobs(fused.params_local, b) + 0.25  # what a sampler reported, off by 0.25
    out = _update(fused, b, sampler_lp, fused.logprobs(fused.ref_params_local, b), adv, jax.random.PRNGKey(0))
    assert out["loss/sampler_gap"] == pytest.approx(0.25, abs=1e-4)
    jax.tree.map(
        lambda a, c: np.testing.assert_allclose(a, c, atol=1e-6),
        jax.tree.map(np.asarray, plain.params),
        jax.tree.map(np.asarray, fused.params),
    )
    with pytest.raises(ConfigError, match=r"ppo\.old_logprobs.*ppo\.epochs == 1 and ppo\.mini_batch_rows == 0"):
        PPOLearner(
            _actor(),
            mesh,
            losses.PPOLossConfig(),
            ADAMW,
            micro_batch_rows=3,
            mini_batch_rows=3,
            fused_old_logprobs=True,
        )


@pytest.mark.slow
def test_prompt_buckets_cut_micro_batch_padding_without_changing_logprobs_or_the_update():
    # Prompts of 2..12 tokens in a batch padded to 12: micro-batches of similar lengths keep 4, 8 or 12
    # prompt columns; log-probs and the parameters after two updates equal the uncut learner's.
    b = _batch(n=10, p=12, seed=7)
    adv = np.linspace(-1.0, 1.5, 10).astype(np.float32)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    cfg = losses.PPOLossConfig(kl_coef=0.0, entropy_coef=0.001)
    plain = PPOLearner(_actor(), mesh, cfg, ADAMW, micro_batch_rows=3, mini_batch_rows=6)
    cut = PPOLearner(_actor(), mesh, cfg, ADAMW, micro_batch_rows=3, mini_batch_rows=6, prompt_buckets=(8, 4))
    assert cut.prompt_buckets == (4, 8)
    lens = b.attention_mask[:, : b.prompt_len].sum(1)
    assert lens.min() <= 4 and lens.max() > 8  # every bucket is used
    np.testing.assert_allclose(cut.logprobs(cut.params_local, b), plain.logprobs(plain.params_local, b), atol=1e-6)
    for it in range(2):
        for L in (plain, cut):
            _update(L, b, L.logprobs(L.params_local, b) - 0.05, None, adv, jax.random.PRNGKey(it))
    # 4 AdamW steps of 3e-3 move a weight up to 1.2e-2; m / sqrt(v) magnifies float-order gradient noise
    jax.tree.map(
        lambda a, c: np.testing.assert_allclose(a, c, atol=1e-5),
        jax.tree.map(np.asarray, plain.params),
        jax.tree.map(np.asarray, cut.params),
    )
    # a micro-batch's width: the smallest bucket holding its longest prompt, else the widest prompt
    # (another process's batch may be wider: its rows are left-padded with masked columns)
    assert cut._prompt_width(int(lens.min()), b.prompt_len) == 4
    assert cut._prompt_width(int(lens.max()), b.prompt_len) == b.prompt_len == 12
    assert cut._prompt_width(9, 16) == 16 and cut._prompt_width(3, 2) == 2
    wide = b.take(np.arange(3), 16, 4).attention_mask
    assert wide.shape == (4, 16 + 5) and not wide[:3, :4].any()
    np.testing.assert_array_equal(wide[:3, 4:], b.attention_mask[:3])
    assert wide[3].tolist() == [0] * 20 + [1]  # a padding row: one real token, no empty softmax


@pytest.mark.slow
def test_logprobs_and_the_ppo_objective_use_only_the_tokenizers_ids():
    # support 40 of the actor's 48 logit columns: log_softmax over the first 40, as the sampler draws.
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    cfg = losses.PPOLossConfig(kl_coef=0.0, entropy_coef=0.001)
    b = _batch(n=4)
    b.response_ids[:] = np.minimum(b.response_ids, 39)
    b.input_ids[:, b.prompt_len :] = b.response_ids
    L = PPOLearner(_actor(), mesh, cfg, SGD, micro_batch_rows=4, support=40)
    lp = L.logprobs(L.params_local, b)
    full = PPOLearner(_actor(), mesh, cfg, SGD, micro_batch_rows=4).logprobs(L.params_local, b)
    actor = _actor()
    for i in range(b.rows):
        prompt = b.input_ids[i, : b.prompt_len][b.attention_mask[i, : b.prompt_len] > 0]
        resp = b.response_ids[i][b.response_mask[i]]
        seq = np.concatenate([prompt, resp])[None]
        logits = _row_logits(actor, jnp.asarray(seq))[len(prompt) - 1 : -1]
        want = jax.nn.log_softmax(logits[:, :40], -1)[np.arange(len(resp)), resp]
        np.testing.assert_allclose(lp[i, : len(resp)], want, atol=2e-5)
    assert (lp[b.response_mask] > full[b.response_mask]).all()  # less mass to share: every log-prob rises
    # The PPO objective's entropy is over the same 40 ids.
    from bipace_jax.ppo import MicroBatch

    z = np.zeros(b.response_ids.shape, np.float32)
    mb = MicroBatch(b.input_ids, b.attention_mask, b.response_ids, b.response_mask, lp, z, np.zeros(b.rows, np.float32))
    mb = jax.tree.map(jnp.asarray, mb)
    _, stats = L.objective(actor, mb, jnp.float32(b.response_mask.sum()))
    ents = []
    for i in range(b.rows):
        prompt = b.input_ids[i, : b.prompt_len][b.attention_mask[i, : b.prompt_len] > 0]
        resp = b.response_ids[i][b.response_mask[i]]
        seq = np.concatenate([prompt, resp])[None]
        logits = _row_logits(actor, jnp.asarray(seq))[len(prompt) - 1 : -1, :40]
        p = jax.nn.softmax(logits, -1)
        ents += list(np.asarray(-(p * jnp.log(p)).sum(-1)))
    np.testing.assert_allclose(float(stats["entropy"]), np.mean(ents), rtol=1e-4)


@pytest.mark.slow
def test_chunked_lm_head_gives_the_same_logprobs_and_update(chunk=3):  # 3 does not divide M = 5: a padded chunk
    b = _batch(n=6, seed=5)
    adv = np.array([1.0, -0.5, 2.0, 0.0, -1.5, 0.7], np.float32)
    results = []
    for c in (0, chunk):
        mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        cfg = losses.PPOLossConfig(kl_coef=0.0, entropy_coef=0.01, temperature=0.7)
        L = PPOLearner(_actor(), mesh, cfg, SGD, micro_batch_rows=3, logprob_chunk=c)
        old = L.logprobs(L.params_local, b)
        out = _update(L, b, old - 0.05, None, adv, jax.random.PRNGKey(0))
        results.append((old, out, jax.tree.map(np.asarray, L.params)))
    (old0, out0, p0), (old1, out1, p1) = results
    np.testing.assert_allclose(old1, old0, atol=1e-6)
    for k in ("loss/pg_loss", "loss/entropy", "loss/grad_norm"):
        np.testing.assert_allclose(out1[k], out0[k], rtol=1e-5, err_msg=k)
    jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, atol=1e-6, rtol=1e-5), p0, p1)


@pytest.mark.slow
def test_fp32_master_weights_with_bf16_compute_change_every_weight_under_small_adamw_steps():
    # bf16 parameters would round most of these 1e-6 updates away (issue: "updates vanish").
    actor = _actor(1, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    L = PPOLearner(actor, mesh, losses.PPOLossConfig(kl_coef=0.0), optax.adamw(1e-6), micro_batch_rows=6)
    before = jax.tree.map(np.asarray, L.params)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(before))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(L.opt_state) if hasattr(x, "dtype") and x.ndim)
    b = _batch(n=6, seed=2)
    adv = np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], np.float32)
    for it in range(10):
        _update(L, b, L.logprobs(L.params_local, b), None, adv, jax.random.PRNGKey(it))
    after = jax.tree.map(np.asarray, L.params)
    changed = jax.tree.leaves(jax.tree.map(lambda a, c: float(np.mean(a != c)), before, after))
    assert min(changed) == 1.0, changed


@pytest.mark.slow
def test_program_specs_are_what_the_learner_runs():
    from bipace_jax.batch import abstract_micro_batch
    from bipace_jax.ppo import STAT_KEYS, logprobs_spec

    L = _learner(SGD, micro=3)
    b = _batch(n=3)
    mb = abstract_micro_batch(L.mesh, 3, b.prompt_len, 5, reference=False)  # kl_coef 0: no reference
    step = L.step_specs(L.objective, mb, STAT_KEYS)
    acc = step["accumulate"]
    assert acc.donate_argnums == (2,) and step["apply"].donate_argnums == (0, 1)  # the accumulator, params + moments
    placed = zip(jax.tree.leaves(acc.args[0]), jax.tree.leaves(acc.in_shardings[0]), jax.tree.leaves(L.param_shardings))
    assert all(got.is_equivalent_to(want, x.ndim) for x, got, want in placed)
    assert acc.args[4].input_ids.shape == (3, b.prompt_len + 5) and acc.args[4].ref_logprobs is None
    assert acc.lower().compile() is not None
    with pytest.raises(TypeError, match="'accumulate' takes 6 positional arguments, got 1"):
        acc(L.params)
    # the log-prob spec's program is the one PPOLearner.logprobs calls: same values through either
    lmb = abstract_micro_batch(L.mesh, 3, b.prompt_len, 5, logprobs=False)
    spec = logprobs_spec(L.graphdef, L.objective, L.params_local, L.rest, lmb)
    got = spec(L.params_local, L.rest, jax.tree.map(jnp.asarray, b.take(np.arange(3), b.prompt_len, 3)))
    np.testing.assert_allclose(np.asarray(got), L.logprobs(L.params_local, b), atol=1e-6)


def _tis_learner(tis_cap, **kw):
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    cfg = losses.PPOLossConfig(kl_coef=0.0, entropy_coef=0.0, tis_cap=tis_cap)
    return PPOLearner(_actor(), mesh, cfg, SGD, micro_batch_rows=3, **kw)


@pytest.mark.slow
def test_truncated_importance_weights_scale_the_policy_gradient_step():
    # SGD, no KL or entropy: the step is linear in the per-token weights. A sampler whose log-probs sit
    # log 2 below the old ones gives weight 2 (kept at cap 3, truncated to 1.5 at cap 1.5), so the step is
    # 2x / 1.5x the unweighted one; a sampler equal to the old policy (weight 1) changes nothing.
    b = _batch(n=6, seed=5)
    adv = np.array([1.0, -0.5, 2.0, 0.0, -1.5, 0.7], np.float32)
    steps, outs = {}, {}
    for name, cap, shift in (
        ("off", 0.0, 0.0),
        ("same", 3.0, 0.0),
        ("x2", 3.0, np.log(2.0)),
        ("cut", 1.5, np.log(2.0)),
    ):
        L = _tis_learner(cap)
        before = jax.tree.map(np.asarray, L.params)
        old = L.logprobs(L.params_local, b) - 0.05
        full = b.with_(old_logprobs=old, advantages=adv, sampler_logprobs=old - np.float32(shift))
        outs[name] = L.update(full, jax.random.PRNGKey(0))
        steps[name] = jax.tree.map(lambda a, c: np.asarray(a) - c, L.params, before)
    assert set(outs["off"]) == {f"loss/{k}" for k in (*STAT_KEYS, "loss", "grad_norm", "grad_norm_max", "updates")}
    assert set(outs["x2"]) == set(outs["off"]) | {"loss/is_weight", "loss/is_truncated_frac"}
    assert outs["same"]["loss/is_weight"] == 1.0 and outs["same"]["loss/is_truncated_frac"] == 0.0
    assert outs["x2"]["loss/is_weight"] == pytest.approx(2.0) and outs["x2"]["loss/is_truncated_frac"] == 0.0
    assert outs["cut"]["loss/is_weight"] == pytest.approx(1.5) and outs["cut"]["loss/is_truncated_frac"] == 1.0
    for name, scale in (("same", 1.0), ("x2", 2.0), ("cut", 1.5)):
        assert outs[name]["loss/pg_loss"] == pytest.approx(scale * outs["off"]["loss/pg_loss"], rel=1e-5)
        jax.tree.map(
            # the step is read as new - old float32 weights: a rounding of up to a few 1e-7
            lambda a, c, s=scale: np.testing.assert_allclose(a, s * c, rtol=1e-4, atol=1e-6),
            steps[name],
            steps["off"],
        )


@pytest.mark.slow
def test_tis_cap_zero_ignores_sampler_logprobs_and_keeps_todays_update_exactly():
    b = _batch(n=6, seed=5)
    adv = np.array([1.0, -0.5, 2.0, 0.0, -1.5, 0.7], np.float32)
    params, outs = [], []
    for sampler in (None, "far"):
        L = _tis_learner(0.0)
        old = L.logprobs(L.params_local, b) - 0.05
        full = b.with_(old_logprobs=old, advantages=adv, sampler_logprobs=None if sampler is None else old - 5.0)
        outs.append(L.update(full, jax.random.PRNGKey(0)))
        params.append(jax.tree.map(np.asarray, L.params))
    assert outs[0] == outs[1]
    jax.tree.map(np.testing.assert_array_equal, params[0], params[1])


def _tiny_config():
    from configs import textcraft_tiny

    c = textcraft_tiny.get_config()
    c.model.checkpoint = ""  # the shipped warm start may be absent in a checkout: random init
    return c


def test_tis_needs_recomputed_old_logprobs_and_the_batchs_sampler_logprobs():
    import configs

    with pytest.raises(ConfigError, match=r"^config\.ppo\.tis_cap must be 0 unless ppo\.old_logprobs == 'recompute'"):
        _tis_learner(2.0, fused_old_logprobs=True)
    b = _batch(n=3)
    L = _tis_learner(2.0)
    lp = np.zeros(b.response_ids.shape, np.float32)
    with pytest.raises(ValueError, match=r"no sampler_logprobs .*tis_cap=2\.0 > 0 needs the sampler's log-probs"):
        L.update(b.with_(old_logprobs=lp, advantages=np.zeros(3, np.float32)), jax.random.PRNGKey(0))
    for fields, message in (
        ({"tis_cap": -1.0}, "config.ppo.tis_cap must be a finite number >= 0 (0 = off), got -1.0"),
        (
            {"tis_cap": 2.0, "old_logprobs": "fused", "mini_batch_rows": 0},
            "config.ppo.tis_cap must be 0 unless ppo.old_logprobs == 'recompute' (with 'fused' the old log-probs "
            "are the sampler's), got 2.0",
        ),
        ({"tis_cap": 2.0, "old_logprobs": "sampler"}, "unless ppo.old_logprobs == 'recompute' (with 'sampler'"),
    ):
        c = _tiny_config()
        for k, v in fields.items():
            c.ppo[k] = v
        with pytest.raises(ConfigError) as e:
            configs.validate(c)
        assert message in str(e.value) and "\n" not in str(e.value)
    c = _tiny_config()
    c.ppo.tis_cap, c.ppo.old_logprobs = 2.0, "recompute"  # the tiny run's own is 'sampler'
    assert configs.build_spec(c).loss.tis_cap == 2.0


@pytest.mark.e2e
def test_a_tis_run_gives_the_learner_the_samplers_logprobs_and_logs_the_weights(tmp_path):
    """One RL iteration of the tiny actor with ``ppo.tis_cap`` 2: the update's batch carries the rollout's
    own log-probs; the logged weight statistics are the NumPy token means of min(exp(old - sampler), 2)."""
    from bipace_jax import metric_keys
    from bipace_jax.tiny import build_game_tokenizer
    from bipace_jax.trainer import Trainer
    from tests.tiny_runs import one_iteration_config, recorded_iteration

    c = one_iteration_config(group_size=2, max_steps=3, batch_buckets=(4, 8))
    c.ppo.tis_cap = 2.0
    tokenizer = build_game_tokenizer(c, str(tmp_path / "tok"), num_tasks=8)
    rec, res, batch, updated = recorded_iteration(Trainer(c, str(tmp_path / "run"), tokenizer=tokenizer))
    np.testing.assert_array_equal(batch.sampler_logprobs, np.asarray(res.sample_logprobs, np.float32))
    m = batch.response_mask
    w = np.exp(batch.old_logprobs.astype(np.float64) - batch.sampler_logprobs)[m]
    assert rec["loss/updates"] == 1 and updated
    assert rec["loss/is_weight"] == pytest.approx(np.minimum(w, 2.0).mean(), rel=1e-5)
    assert rec["loss/is_truncated_frac"] == pytest.approx((w > 2.0).mean(), abs=1e-7)
    # on-policy, the same tempered policy on both sides: weights ~1 (the forwards agree to < 1e-3 nats)
    assert rec["rollout/logprob_gap"] < 1e-3 and abs(rec["loss/is_weight"] - 1) < 1e-3
    assert metric_keys.undocumented(rec) == []
