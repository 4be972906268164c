"""The lab's branching and staleness arms (`docs/lab.md`, "Branching" and "Staleness"): tree-shaped games
at the same budget, version lags with fingerprint drift, and stale policies in learning."""

import hashlib

import numpy as np
import pytest

from bipace_jax.config import ConfigError
from bipace_jax.estimators import EstimatorConfig
from bipace_jax.lab import (
    LabView,
    bonus_policy,
    build_batch,
    crafting_game,
    estimate,
    learn,
    sample_rollouts,
    score_estimators,
)
from bipace_jax.lab import config as lab_config
from bipace_jax.lab.observe import branch_leaders, fingerprints

SHAPE = dict(groups=2, group_size=8, horizon=6)
SEEDS = 4


def _game():
    return crafting_game(tasks=2, stages=2, actions=4, slip=0.2, trap_prob=0.5, invalid_penalty=0.1, seed=1)


def test_branch_leaders_hand_computed():
    # G = 8 games as 2 trees forked at turns 1 and 3 into 2: before turn 1 a tree repeats one game,
    # from turn 1 its two halves, from turn 3 every game acts alone. Observations lag one turn
    # behind the actions: the fork turn's observation is the parent's.
    obs, act = branch_leaders(8, 5, (1, 3), 2)
    tree, half, alone = [0, 0, 0, 0, 4, 4, 4, 4], [0, 0, 2, 2, 4, 4, 6, 6], list(range(8))
    np.testing.assert_array_equal(obs, [tree, tree, half, half, alone])
    np.testing.assert_array_equal(act, [tree, half, half, alone, alone])
    obs, act = branch_leaders(8, 3)
    np.testing.assert_array_equal(obs, np.tile(np.arange(8), (3, 1)))
    np.testing.assert_array_equal(act, obs)
    for args, needle in (
        ((8, 5, (2,), 3), "group_size: expected a multiple of branch_children \\*\\* len\\(branch_turns\\) = 3"),
        ((8, 5, (5,), 2), "branch_turns: expected distinct turns in \\[0, 5\\)"),
        ((8, 5, (1, 1), 2), "branch_turns"),
        ((8, 5, (1,), 1), "branch_children: expected an int >= 2 when branch_turns is set"),
        ((8, 5, (), 2), "branch_children: expected 1 when branch_turns is empty"),
    ):
        with pytest.raises(ValueError, match=needle):
            branch_leaders(*args)


def _stay_policy(game, seeds):
    """Half the waste action, half the unparsable one: the game never leaves its start state."""
    pi = np.zeros((seeds, game.num_states, game.num_actions))
    for s in range(game.num_states):
        task, k = divmod(s % (game.tasks * game.stages), game.stages)
        waste = ({0, 1, 2} - {game.correct[task, k], game.dead_end[task, k]}).pop()
        pi[:, s, waste] = pi[:, s, game.invalid_action] = 0.5
    return pi


@pytest.mark.parametrize(
    "turns, children, sizes",
    [
        # No fork: 8 games x 5 turns, every observation its own form (m = 2^30): 40 singletons.
        ((), 1, [1] * 40),
        # Fork at turn 2 into 4 (2 trees): turns 0 and 1 repeat the tree's game (2 trees x 2 turns, groups
        # of 4), turn 2's observation is the parent's (2 groups of 4), turns 3-4 act alone (16 singletons).
        ((2,), 4, [1] * 16 + [4] * 6),
        # Fork at turn 0 into 8: only turn 0's observation is shared (one group of 8).
        ((0,), 8, [1] * 32 + [8]),
        # Forks at 1 and 3 into 2: turn 0 (2 groups of 4), turn 1 (2 of 4), turn 2 (4 of 2), turn 3 (4 of 2),
        # turn 4 alone (8).
        ((1, 3), 2, [1] * 8 + [2] * 8 + [4] * 4),
    ],
)
def test_a_fork_gives_the_expected_step_group_sizes(turns, children, sizes):
    game = crafting_game(tasks=1, stages=1, actions=4, seed=0)
    pi = _stay_policy(game, 2)
    rng = np.random.default_rng(0)
    ro = sample_rollouts(
        game,
        pi,
        rng,
        groups=1,
        group_size=8,
        horizon=5,
        paraphrases=2**30,
        branch_turns=turns,
        branch_children=children,
    )
    assert ro.num_rows == 2 * 8 * 5 and len(np.unique(ro.traj)) == 2 * 8  # the same games per task group
    b = build_batch(game, ro, pi, LabView(paraphrases=2**30), rng, gamma=0.9, render_text=False)
    _, _, labels = estimate(b, EstimatorConfig(name="gigpo", norm="mean", gamma=0.9))
    for g in range(2):
        _, size = np.unique(labels[ro.group == g], return_counts=True)
        assert sorted(size.tolist()) == sorted(sizes)


def test_branched_siblings_repeat_the_prefix_and_share_the_fork_observation():
    game = _game()
    pi = bonus_policy(game, 1.0, SEEDS)
    rng = np.random.default_rng(3)
    view = LabView(paraphrases=3, history=1, noise_tokens=2, noise_vocab=50, sigma=0.1, dim=8, false_split=0.5)
    ro = sample_rollouts(game, pi, rng, paraphrases=3, history=1, branch_turns=(2,), branch_children=4, **SHAPE)
    b = build_batch(game, ro, pi, view, rng, gamma=0.9, render_text=True)
    fp, obs = np.asarray(b.steps.fingerprint)[: ro.num_rows], np.asarray(b.steps.obs_hash)[: ro.num_rows]
    assert len(np.unique(ro.traj)) == SEEDS * 2 * 8
    g = ro.traj % 8
    fork = checked = 0
    for i in range(ro.num_rows):
        leader = ro.traj[i] - g[i] % 4  # the first game of its tree (2 trees of 4 per task group)
        j = np.flatnonzero((ro.traj == leader) & (ro.step == ro.step[i]))
        assert j.size == 1 or ro.step[i] > 2
        if ro.step[i] <= 2:
            j = j[0]
            # The parent's observation: same text (hash), same fingerprint, history and latent state.
            assert obs[i] == obs[j] and ro.state[i] == ro.state[j] and ro.form[i] == ro.form[j]
            np.testing.assert_array_equal(fp[i], fp[j])
            assert ro.obs_source[i] == j
            if ro.step[i] < 2:  # the prefix repeats the leader's step: action and reward too
                assert ro.action[i] == ro.action[j] and ro.reward[i] == ro.reward[j] and ro.act_source[i] == j
            else:  # the fork turn: every sibling draws its own action
                fork += ro.act_source[i] == i
            checked += 1
    assert checked >= 150 and fork == np.sum(ro.step == 2) > 40
    # After the fork the siblings act apart: some differ in action at turn 2.
    t2 = ro.step == 2
    assert len(set(zip(ro.traj[t2] // 4, ro.action[t2]))) > len(set(ro.traj[t2] // 4))


def test_no_branch_and_no_lag_reproduce_the_recorded_arm_bit_for_bit():
    # Recorded with the lab before the branching and staleness arms (commit cdb8fbe): the same draws,
    # texts, fingerprints and learning, so lag 0 / no branch is exactly today's arm (the learning to
    # float32 rounding of the jitted estimator, whose reductions XLA may order differently per run).
    game = _game()
    rng = np.random.default_rng(11)
    pi = bonus_policy(game, 1.0, SEEDS)
    view = LabView(paraphrases=3, history=1, noise_tokens=1, noise_vocab=4, sigma=0.1, dim=8, false_merge=0.5)
    view = LabView(**dict(view.__dict__, false_split=0.3, drift=0.7))  # drift moves no row without a lag
    ro = sample_rollouts(game, pi[None], rng, paraphrases=3, history=1, lag=np.zeros((SEEDS, 2, 8), int), **SHAPE)
    b = build_batch(game, ro, pi, view, rng, gamma=0.9, render_text=True)
    h = hashlib.sha256()
    n = ro.num_rows
    for x in (ro.state, ro.form, ro.action, ro.traj, ro.step, b.steps.obs_hash, b.steps.action_key):
        h.update(np.ascontiguousarray(np.asarray(x)[:n], np.int64).tobytes())
    assert n == 300 and h.hexdigest()[:16] == "1c2d1bc0a943d62d"
    assert float(np.asarray(b.steps.fingerprint, np.float64).sum()) == pytest.approx(70.98894016472332, abs=1e-9)
    assert float(b.a_star.sum()) == pytest.approx(-0.8459672780895435, abs=1e-12)
    out = learn(
        game,
        LabView(paraphrases=4, sigma=0.1, dim=16, drift=0.5),
        EstimatorConfig(name="bipace_q", norm="mean", gamma=0.9),
        seeds=SEEDS,
        iterations=2,
        lr=2.0,
        max_staleness=0,
        **SHAPE,
    )
    np.testing.assert_allclose(
        out["success"][-1],
        [0.4583719385981948, 0.5770262516385773, 0.38518720177866966, 0.5378916404745241],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        out["corr"][-1], [0.5216535741166909, 0.7148868945309051, 0.42563565694403216, 0.5264495338003987], rtol=1e-5
    )


def test_a_lagged_game_plays_its_version_s_policy():
    game = crafting_game(tasks=1, stages=1, actions=4, seed=0)
    recipe = game.correct[0, 0]
    versions = np.zeros((2, 1, game.num_states, game.num_actions))
    versions[0, :, :, game.invalid_action] = 1.0  # the current policy: always unparsable
    versions[1, :, :, recipe] = 1.0  # one version old: always the recipe
    lag = np.array([[[0, 1, 0, 1, 1, 0, 0, 1]]])
    ro = sample_rollouts(game, versions, np.random.default_rng(0), groups=1, group_size=8, horizon=3, lag=lag)
    g = ro.traj % 8
    np.testing.assert_array_equal(ro.lag, lag[0, 0, g])
    np.testing.assert_array_equal(ro.action, np.where(ro.lag == 1, recipe, game.invalid_action))
    with pytest.raises(ValueError, match="lag must be int\\[1, 1, 8\\] in \\[0, 2\\)"):
        sample_rollouts(game, versions, np.random.default_rng(0), groups=1, group_size=8, horizon=3, lag=lag + 1)
    with pytest.raises(ValueError, match="lag and branch_turns together are not modelled"):
        sample_rollouts(
            game,
            versions,
            np.random.default_rng(0),
            groups=1,
            group_size=8,
            horizon=3,
            lag=lag,
            branch_turns=(1,),
            branch_children=2,
        )


def test_drift_model_statistics():
    # cos(e_0, e_l) = 1 / sqrt(1 + l drift^2) for wide fingerprints (|W_l|^2 / D -> l); one walk per
    # (seed, state): rows of one state and lag share a fingerprint (sigma 0), later versions go further.
    game = _game()
    seeds, drift, d = 60, 0.5, 1024
    pi = np.broadcast_to(bonus_policy(game, 1.0, seeds), (5, seeds, game.num_states, game.num_actions))
    rng = np.random.default_rng(2)
    lag = rng.integers(0, 5, (seeds, 2, 8))
    ro = sample_rollouts(game, pi, rng, lag=lag, **SHAPE)
    fp = fingerprints(game, ro, LabView(dim=d, drift=drift), rng).astype(np.float64)
    key = (ro.seed * game.num_states + ro.state) * 5 + ro.lag
    first = {}
    for i, k in enumerate(key):
        if k in first:
            np.testing.assert_allclose(fp[i], fp[first[k]], atol=1e-6)
        first.setdefault(k, i)
    for lag_l in range(1, 5):
        cos = [fp[first[k0]] @ fp[first[k0 + lag_l]] for k0 in first if k0 % 5 == 0 and k0 + lag_l in first]
        assert len(cos) > 30
        assert np.mean(cos) == pytest.approx(1 / np.sqrt(1 + lag_l * drift**2), abs=0.01), lag_l


def test_branching_scores_each_distinct_step_once_in_node_corr():
    game = _game()
    pi = bonus_policy(game, 1.0, SEEDS)
    cfgs = {n: EstimatorConfig(name=n, norm="mean", gamma=0.9) for n in ("gigpo", "bipace_q")}
    rng = np.random.default_rng(4)
    ro = sample_rollouts(game, pi, rng, **SHAPE)
    flat, _ = score_estimators(build_batch(game, ro, pi, LabView(), rng, gamma=0.9, render_text=False), cfgs)
    np.testing.assert_array_equal(flat["gigpo"]["node_corr"], flat["gigpo"]["corr"])  # no copies: the same
    assert ((flat["bipace_q"]["loo_row_rate"] >= 0) & (flat["bipace_q"]["loo_row_rate"] < 0.2)).all()
    np.testing.assert_array_equal(flat["gigpo"]["loo_row_rate"], 0.0)
    ro = sample_rollouts(game, pi, rng, branch_turns=(2,), branch_children=8, **SHAPE)
    b = build_batch(game, ro, pi, LabView(), rng, gamma=0.9, render_text=False)
    tree, _ = score_estimators(b, cfgs)
    adv = estimate(b, cfgs["gigpo"])[0]
    # seed 0 by hand: the copies' mean advantage per distinct step, against that step's A*.
    keep = ro.seed == 0
    src = ro.act_source[keep]
    uniq = np.unique(src)
    mean = np.array([adv[ro.act_source == u].mean() for u in uniq])
    a = b.a_star[uniq]
    sel = np.abs(a) > 1e-3
    assert tree["gigpo"]["node_corr"][0] == pytest.approx(np.corrcoef(mean[sel], a[sel])[0, 1], abs=1e-9)
    assert uniq.size < keep.sum()


def test_stale_learning_improves_and_sync_is_k0():
    kw = dict(seeds=SEEDS, iterations=3, lr=2.0, **SHAPE)
    view = LabView(paraphrases=2, sigma=0.1, dim=16, drift=0.3)
    cfg = EstimatorConfig(name="gigpo", norm="mean", gamma=0.9)
    sync = learn(_game(), view, cfg, **kw)
    stale = learn(_game(), view, cfg, max_staleness=2, **kw)
    assert (stale["success"][-1] > stale["success"][0]).all()
    np.testing.assert_array_equal(stale["success"][0], sync["success"][0])
    assert not np.array_equal(stale["success"][-1], sync["success"][-1])
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        learn(_game(), view, cfg, max_staleness=-1, **kw)


def test_branch_and_staleness_config_errors_name_the_field():
    lab_config.validate(lab_config.default_config())
    for changes, needle in (
        (dict(branch_turns="3"), "config.batch.branch_children must be an int >= 2 when branch turns are set"),
        (dict(branch_turns="3", branch_children=3), "config.batch.branch_children must make children"),
        (dict(branch_turns="10", branch_children=2), "config.batch.branch_turns must be '' or distinct"),
        (dict(branch_turns="1,1", branch_children=2), "config.batch.branch_turns"),
        (dict(branch_children=2), "config.batch.branch_children must be 1 when no branch turn is set"),
        (dict(max_staleness=-1), "config.batch.max_staleness must be an int >= 0"),
        (dict(max_staleness=1, branch_turns="2", branch_children=2), "config.batch.max_staleness must be 0 when"),
    ):
        c = lab_config.default_config()
        c.batch.update(changes)
        with pytest.raises(ConfigError, match=needle):
            lab_config.validate(c)
    for field, value, needle in (
        ("view.drift", -0.1, "config.view.drift"),
        ("grid.branch", "2:3", "config.grid.branch must make children"),
        ("grid.branch", "none;x", "config.grid.branch must be 'none' or 'turns:children'"),
        ("grid.branch_learning", ":2", "config.grid.branch_learning must be 'none' or"),
        ("grid.staleness", "0,-1", "config.grid.staleness must hold values >= 0"),
        ("grid.drifts", "a", "config.grid.drifts must be a comma-separated list"),
        ("grid.stale_paraphrases", 0, "config.grid.stale_paraphrases"),
    ):
        c = lab_config.default_config()
        section, _, name = field.rpartition(".")
        c[section][name] = value
        with pytest.raises(ConfigError, match=needle):
            lab_config.validate(c)
