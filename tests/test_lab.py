"""The credit-assignment lab (`bipace_jax/lab`, `docs/lab.md`): ground truth, batches, scores, learning."""

import os

import numpy as np
import pytest

from bipace_jax.config import ConfigError
from bipace_jax.estimators import EstimatorConfig, assign_ids
from bipace_jax.lab import (
    LabView,
    anchor,
    bonus_policy,
    build_batch,
    crafting_game,
    estimate,
    learn,
    policy_values,
    sample_rollouts,
    score_estimators,
    score_rows,
    singleton_rates,
    success_probability,
)
from bipace_jax.lab import config as lab_config
from bipace_jax.lab.observe import anchor_texts, observation_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One batch shape for every estimator call here, so each estimator compiles once per test session.
SHAPE = dict(groups=2, group_size=8, horizon=6)
SEEDS = 4


def _game():
    return crafting_game(tasks=2, stages=2, actions=4, slip=0.2, trap_prob=0.5, invalid_penalty=0.1, seed=1)


def _batch(view, *, rng_seed=0, bonus=1.0, render_text=True):
    game = _game()
    rng = np.random.default_rng(rng_seed)
    pi = bonus_policy(game, bonus, SEEDS)
    ro = sample_rollouts(game, pi, rng, paraphrases=view.paraphrases, history=view.history, **SHAPE)
    return game, pi, build_batch(game, ro, pi, view, rng, gamma=0.9, render_text=render_text)


def _same_partition(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return len(set(zip(a.tolist(), b.tolist()))) == len(set(a.tolist())) == len(set(b.tolist()))


def test_success_probability_hand_computed():
    # One stage, actions {recipe, dead end, invalid}; uniform policy, 2 turns, trap 1/2, no slip:
    # turn 1 wins 1/3, stays live 1/3 (invalid) + 1/3 * 1/2 (dead end spared) = 1/2, then wins 1/3.
    game = crafting_game(tasks=1, stages=1, actions=3, slip=0.0, trap_prob=0.5, seed=0)
    uniform = np.full((game.num_states, 3), 1 / 3)
    assert success_probability(game, uniform, 2) == pytest.approx(1 / 3 + 1 / 2 * 1 / 3, abs=1e-12)
    expert = np.zeros((game.num_states, 3))
    expert[:, game.correct[0, 0]] = 1.0
    assert success_probability(game, expert, 1) == pytest.approx(1.0, abs=1e-12)
    # Q of the invalid action at the last turn: its penalty, nothing else.
    q, v = policy_values(game, uniform, 2, 0.9)
    assert q[1, 0, game.invalid_action] == pytest.approx(-0.1)
    assert q[1, 0, game.correct[0, 0]] == pytest.approx(1.0)
    assert v[1, 0] == pytest.approx((1.0 - 0.1 + 0.0) / 3)


def test_dp_values_match_monte_carlo_within_the_interval():
    game = _game()
    rng = np.random.default_rng(7)
    pi = np.random.default_rng(3).dirichlet(np.ones(game.num_actions), game.num_states)[None]
    gamma, horizon = 0.9, 6
    ro = sample_rollouts(game, pi, rng, groups=1, group_size=40000, horizon=horizon)
    net = ro.reward - ro.penalty
    ret = np.zeros_like(net)
    for i in range(ro.num_rows - 1, -1, -1):  # rows are canonical: a trajectory's later step is the next row
        later = i + 1 < ro.num_rows and ro.traj[i + 1] == ro.traj[i]
        ret[i] = net[i] + (gamma * ret[i + 1] if later else 0.0)
    q, v = policy_values(game, pi, horizon, gamma)
    checked = 0
    for t in range(3):
        for s in np.unique(ro.state[ro.step == t]):
            at = (ro.step == t) & (ro.state == s)
            if at.sum() < 500:
                continue
            se = ret[at].std(ddof=1) / np.sqrt(at.sum())
            assert abs(ret[at].mean() - v[0, t, s]) <= 4 * se + 1e-12, (t, s)
            for a in range(game.num_actions):
                sa = at & (ro.action == a)
                if sa.sum() >= 200:
                    se = ret[sa].std(ddof=1) / np.sqrt(sa.sum())
                    assert abs(ret[sa].mean() - q[0, t, s, a]) <= 4 * se + 1e-12, (t, s, a)
                    checked += 1
    assert checked >= 12
    won = np.zeros(ro.seeds * ro.groups * ro.group_size, bool)
    won[ro.traj[ro.reward > 0]] = True
    _, p_win = policy_values(game, pi, horizon, 1.0, success_only=True)
    j = p_win[0, 0, game.start[ro.task[0]]]  # one task group: every game plays its task
    assert abs(won.mean() - j) <= 4 * np.sqrt(j * (1 - j) / won.size)


def test_step_batch_is_built_as_the_rollout_builds_it():
    view = LabView(paraphrases=3, history=1, noise_tokens=1, noise_vocab=4, sigma=0.1, dim=8)
    game, pi, b = _batch(view)
    ro, st = b.rollouts, b.steps
    n = ro.num_rows
    assert st.num_rows == SEEDS * 2 * 8 * 6 and st.group_capacity == SEEDS * 2 and st.row_capacity == 48
    mask = np.asarray(st.mask)
    assert mask[:n].all() and not mask[n:].any()
    order = np.lexsort((ro.step, ro.traj, ro.group))
    np.testing.assert_array_equal(order, np.arange(n))  # canonical order
    key = np.asarray(st.action_key)[:n]
    inv = ro.action == game.invalid_action
    assert inv.any() and (key[inv] == -1).all() and (key[~inv] >= 0).all()
    np.testing.assert_allclose(np.asarray(st.penalty)[:n], np.where(inv, 0.1, 0.0), atol=1e-7)
    fp = np.asarray(st.fingerprint)[:n]
    np.testing.assert_allclose(np.linalg.norm(fp, axis=1), 1.0, atol=1e-6)
    # The anchor text is an injective function of (state, form, history, noise): same partition.
    rng = np.random.default_rng(5)
    noise = rng.integers(0, 4, (n, 1))
    texts = anchor_texts(game, ro, noise)
    assert _same_partition(assign_ids(texts), observation_keys(ro, noise))
    assert "~w" in texts[0] and ("earlier" in texts[1] or ro.step[1] == 0)
    np.testing.assert_allclose(b.a_star, b.q - b.v)


def test_false_merge_and_false_split_move_the_fingerprints():
    game, _, b = _batch(LabView(paraphrases=2, sigma=0.0, dim=8, false_merge=1.0))
    ro, fp = b.rollouts, np.asarray(b.steps.fingerprint)[: b.rollouts.num_rows]
    trap = ~game.live[ro.state] & ~game.terminal[ro.state]
    assert trap.any()
    for i in np.flatnonzero(trap)[:5]:
        twin = np.flatnonzero(game.trap_of == ro.state[i])[0]
        same = (ro.seed == ro.seed[i]) & (ro.state == twin)
        if same.any():
            np.testing.assert_allclose(fp[np.flatnonzero(same)[0]], fp[i], atol=1e-6)
    _, _, b2 = _batch(LabView(paraphrases=2, sigma=0.0, dim=8, false_split=1.0))
    ro2, fp2 = b2.rollouts, np.asarray(b2.steps.fingerprint)[: b2.rollouts.num_rows]
    s0 = ro2.state[0]  # seed 0's first start state
    a = np.flatnonzero((ro2.seed == 0) & (ro2.state == s0) & (ro2.form == 0))[0]
    c = np.flatnonzero((ro2.seed == 0) & (ro2.state == s0) & (ro2.form == 1))[0]
    assert float(fp2[a] @ fp2[c]) < 0.95


def test_scores_move_as_their_definitions_imply():
    a_star = np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    cell = np.array([0, 0, 1, 1, 2, 2])
    seed = np.zeros(6, int)

    def s(adv, **kw):
        return {k: float(v[0]) for k, v in score_rows(adv, a_star, cell, seed, 1, **kw).items()}

    perfect = s(a_star, episode_adv=np.zeros(6))
    assert perfect["corr"] == pytest.approx(1) and perfect["sign"] == 1 and perfect["nmse"] == 0
    assert perfect["no_signal"] == 0
    doubled = s(2 * a_star)
    assert doubled["corr"] == pytest.approx(1) and doubled["nmse"] == pytest.approx(1)
    assert doubled["state_err"] == pytest.approx(0) and doubled["action_err"] == pytest.approx(1)
    # A per-state shift is a baseline error: all state-side; sum A*^2 = 10.5.
    shifted = s(a_star + np.repeat([0.3, -0.3, 1.0], 2))
    assert shifted["state_err"] == pytest.approx(2 * (0.09 + 0.09 + 1.0) / 10.5)
    assert shifted["action_err"] == pytest.approx(0, abs=1e-12)
    flipped = s(-a_star)
    assert flipped["corr"] == pytest.approx(-1) and flipped["sign"] == 0 and flipped["nmse"] == pytest.approx(4)
    zero = s(np.zeros(6), episode_adv=np.zeros(6))
    assert zero["corr"] == 0 and zero["sign"] == 0 and zero["nmse"] == 1 and zero["no_signal"] == 1
    # Rows with |A*| <= delta leave corr and sign, not nmse.
    few = s(np.array([1.0, -1.0, -0.5, 0.5, 2.0, -2.0]), delta=0.6)
    assert few["corr"] == pytest.approx(1) and few["sign"] == 1 and few["nmse"] == pytest.approx(2 / 10.5)


@pytest.mark.slow
def test_gigpo_equals_bigpo_exactly_with_one_form_and_noiseless_fingerprints_at_epsilon_0():
    view = LabView(paraphrases=1, sigma=0.0, dim=16)
    _, _, b = _batch(view)
    gig, _, lab_g = estimate(b, EstimatorConfig(name="gigpo", norm="mean", gamma=0.9))
    big, _, lab_b = estimate(b, EstimatorConfig(name="bigpo", norm="mean", gamma=0.9, epsilon=0.0))
    assert _same_partition(lab_g, lab_b)
    np.testing.assert_array_equal(gig, big)
    assert np.abs(gig).max() > 0


def test_many_forms_make_gigpo_singletons_with_no_step_signal_while_clusters_keep_it():
    grpo_cfg = EstimatorConfig(name="grpo", norm="mean", gamma=0.9)
    rates = []
    for m in (1, 4, 100_000):
        _, _, b = _batch(LabView(paraphrases=m, sigma=0.0, dim=16), rng_seed=m)
        ro = b.rollouts
        ep = estimate(b, grpo_cfg)[0]
        gig, _, lab_g = estimate(b, grpo_cfg.replace(name="gigpo"))
        big, _, lab_b = estimate(b, grpo_cfg.replace(name="bigpo", epsilon=0.05))
        rates.append(singleton_rates(lab_g, ro.seed, SEEDS)[0].mean())
        if m == 100_000:
            no_sig = score_rows(gig, b.a_star, b.cell, ro.seed, SEEDS, episode_adv=ep)["no_signal"]
            assert (no_sig > 0.97).all()
            big_no_sig = score_rows(big, b.a_star, b.cell, ro.seed, SEEDS, episode_adv=ep)["no_signal"]
            assert (big_no_sig < 0.2).all()
            assert singleton_rates(lab_b, ro.seed, SEEDS)[0].mean() < 0.05
    assert rates[0] < rates[1] < rates[2] and rates[2] > 0.97


def test_singleton_rates_hand_computed():
    labels = np.array([5, 5, 7, -1, 9, 9, 9, 2])
    seed = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    rows, groups = singleton_rates(labels, seed, 2)
    np.testing.assert_allclose(rows, [2 / 4, 1 / 4])
    np.testing.assert_allclose(groups, [2 / 3, 1 / 2])


def test_learning_improves_exact_success_from_the_same_start():
    game = _game()
    out = learn(
        game,
        LabView(paraphrases=1),
        EstimatorConfig(name="gigpo", norm="mean", gamma=0.9),
        seeds=SEEDS,
        iterations=3,
        lr=2.0,
        **SHAPE,
    )
    j = out["success"]
    uniform = np.full((game.num_states, game.num_actions), 1 / game.num_actions)
    np.testing.assert_allclose(j[0], success_probability(game, uniform, SHAPE["horizon"]))
    assert (j[-1] > j[0]).all() and j.shape == (4, SEEDS)


@pytest.mark.slow
def test_bipace_q_gives_bigpo_s_tabular_gradient_when_clusters_are_policy_states():
    # Per (cluster, action) the rows' sum of Q-hat - V-hat equals their sum of R - V-hat, and a tabular
    # policy gradient only sees those sums: identical learning, different per-row advantages.
    kw = dict(seeds=SEEDS, iterations=2, lr=2.0, **SHAPE)
    view = LabView(paraphrases=4, sigma=0.0, dim=16)
    base = EstimatorConfig(name="bigpo", norm="mean", gamma=0.9)
    big = learn(_game(), view, base, **kw)
    q = learn(_game(), view, base.replace(name="bipace_q"), **kw)
    np.testing.assert_allclose(q["success"], big["success"], rtol=1e-6)
    assert not np.allclose(q["corr"], big["corr"])


def test_config_defaults_validate_and_bad_fields_are_named():
    c = lab_config.default_config()
    lab_config.validate(c)
    for field, value, needle in (
        ("view.paraphrases", 0, "config.view.paraphrases"),
        ("view.false_merge", 1.5, "config.view.false_merge"),
        ("batch.seeds", 1, "config.batch.seeds"),
        ("game.slip", 1.0, "config.game.slip"),
        ("game.actions", 2, "config.game.actions: actions must be an int >= 3"),
        ("game.recipe_seed", -1, "config.game.recipe_seed"),
        ("estimator.names", "gigpo,nope", "config.estimator.names"),
        ("estimator.epsilon", 1.0, "config.estimator.epsilon"),
        ("grid.learning", "1:0:0", "config.grid.learning"),
        ("grid.sigmas", "0,-1", "config.grid.sigmas"),
        ("mode", "all", "config.mode"),
    ):
        bad = lab_config.default_config()
        section, _, name = field.rpartition(".")
        (bad[section] if section else bad)[name] = value
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            lab_config.validate(bad)


def test_anchor_reads_the_committed_textcraft_report_and_interpolates_m_and_sigma():
    def rows(key, xs, rates, name):
        return [{key: x, "summary": {name: {"singleton_group_rate": [r, 0.0, 200]}}} for x, r in zip(xs, rates)]

    m_rows = rows("m", [1, 8, 64], [0.1, 0.5, 0.9], "gigpo")
    s_rows = rows("sigma", [0.0, 0.2, 0.4], [0.0, 0.1, 0.5], "bigpo")
    a = anchor("docs/results/estimators_textcraft_tiny/report.json", m_rows, s_rows, root=ROOT)
    h, c = a["textcraft_hash_singleton_group_rate"], a["textcraft_cluster_singleton_group_rate"]
    assert 0.5 < h < 0.6 and 0.15 < c < 0.25  # the study's 55-56% and 19-20% (README)
    assert a["m_matching_hash_rate"] == pytest.approx(8 + (h - 0.5) / 0.4 * 56)
    assert a["sigma_matching_cluster_rate"] == pytest.approx(0.2 + (c - 0.1) / 0.4 * 0.2)
    assert anchor("no/such/report.json", m_rows, s_rows, root=ROOT)["error"] == "not found"


def test_hgpo_arm_is_scored_on_its_whole_advantage():
    """HGPO mixes A_ep into its own terms, so its step_ scores are those of its whole advantage and its
    no-signal rows are those with A = 0 (`docs/lab.md`, "Scores")."""
    _, _, b = _batch(LabView(paraphrases=2, sigma=0.0, dim=16))
    cfgs = {n: EstimatorConfig(name=n, norm="mean", gamma=0.9) for n in ("gigpo", "hgpo")}
    scores, _ = score_estimators(b, cfgs)
    h = scores["hgpo"]
    np.testing.assert_array_equal(h["step_corr"], h["corr"])
    np.testing.assert_array_equal(h["step_nmse"], h["nmse"])
    adv = estimate(b, cfgs["hgpo"])[0]
    zero = np.bincount(b.rollouts.seed, weights=adv == 0, minlength=SEEDS) / np.bincount(b.rollouts.seed)
    np.testing.assert_allclose(h["no_signal"], zero)
    assert (h["corr"] > 0).all() and not np.array_equal(h["corr"], scores["gigpo"]["corr"])
