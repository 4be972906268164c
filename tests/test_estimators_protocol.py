"""The protocol options (`docs/estimators.md`, "Protocol options"): hand-computed cases, the equivalences
that keep the defaults unchanged, and bad input. The jitted path and the NumPy oracle are both held to
the hand-computed numbers; the random-batch parity is in test_estimators_parity.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from bipace_jax.estimators import EstimatorConfig, StepBatch, compute_advantages, reference
from bipace_jax.estimators.synthetic import random_step_arrays

D = 8


def _batch(trajs, total=16, penalties=True):
    """trajs: list of (group, traj, rewards, penalties or None, keys, fingerprint index per step).

    One row per step; every row of a trajectory with a fingerprint index f gets the one-hot e_f, so
    rows with equal f share a cluster (epsilon < 1) and an `obs_hash`. Padding rows (up to `total`
    rows, 2 task-group slots of 16 rows: the small cases share compiled functions) hold garbage.
    """
    rows = []
    for g, t, rewards, pens, keys, fps in trajs:
        for s, r in enumerate(rewards):
            rows.append((g, t, s, r, 0.0 if pens is None else pens[s], keys[s], fps[s]))
    n = max(total, len(rows) + 1)
    a = {k: np.full(n, -7, np.int32) for k in ("group_id", "traj_id", "step", "obs_hash", "action_key")}
    a["reward"] = np.full(n, np.nan, np.float32)
    a["fingerprint"] = np.full((n, D), np.nan, np.float32)
    a["mask"] = np.zeros(n, bool)
    pen = np.full(n, np.nan, np.float32)
    for i, (g, t, s, r, p, k, f) in enumerate(rows):
        a["group_id"][i], a["traj_id"][i], a["step"][i], a["reward"][i] = g, t, s, r
        a["obs_hash"][i], a["action_key"][i], a["fingerprint"][i], a["mask"][i] = f, k, np.eye(D)[f], True
        pen[i] = p
    caps = dict(group_capacity=2, row_capacity=16) if len(rows) <= 16 else {}
    return StepBatch.from_numpy(**a, penalty=pen if penalties else None, **caps)


def _both(batch, **cfg):
    """(jitted advantages, oracle advantages, jitted diagnostics) of the real rows."""
    cfg = EstimatorConfig(**cfg)
    adv, diag = compute_advantages(batch, cfg)
    ref, ref_diag = reference.compute_advantages_reference(batch, cfg, dtype=np.float64)
    n = int(np.asarray(batch.mask).sum())
    for k, v in ref_diag.items():
        assert float(diag[k]) == pytest.approx(float(v), abs=1e-6), k
    np.testing.assert_array_equal(np.asarray(adv)[n:], 0.0)
    return np.asarray(adv)[:n], ref[:n], {k: float(v) for k, v in diag.items()}


# --- episode_stats: the scenario --------------------------------------------------------
# One task group: 4 wins of 12 steps (reward 10 at the last step, 0 before) and 4 losses of 50 steps
# (reward 0 everywhere). GRPO, norm="mean_std".
#   episode_stats="rows" (verl-agent): 4 * 12 = 48 rows score 10, 4 * 50 = 200 rows score 0, N = 248.
#     mean = 480 / 248 = 60/31 = 1.935484
#     sum of squared deviations = 48 * 200 / 248 * 10^2 = 120000/31 = 3870.968
#     unbiased var = 3870.968 / 247 = 15.671935, std = 3.958779
#     win  row: (10 - 1.935484) / (3.958779 + 1e-6) = 8.064516 / 3.958780 = +2.037122
#     loss row: (0 - 1.935484) / 3.958780 = -0.488910
#   episode_stats="trajectory" (ours): scores 10, 10, 10, 10, 0, 0, 0, 0: mean 5,
#     unbiased var = 8 * 25 / 7 = 28.571429, std = 5.345225, A = +-5 / 5.345226 = +-0.935414
ROWS_WIN, ROWS_LOSS = 2.0371219, -0.4889093
TRAJ_PM = 0.9354142


def _wins_and_losses():
    wins = [(0, t, [0.0] * 11 + [10.0], None, [0] * 12, [0] * 12) for t in range(4)]
    losses = [(0, 4 + t, [0.0] * 50, None, [0] * 50, [0] * 50) for t in range(4)]
    return _batch(wins + losses, penalties=False)


def test_hand_arithmetic_of_the_wins_and_losses_scenario():
    scores = np.array([10.0] * 48 + [0.0] * 200)
    std = scores.std(ddof=1)
    assert scores.mean() == pytest.approx(60 / 31) and std == pytest.approx(3.958779, abs=1e-6)
    assert (10 - scores.mean()) / (std + 1e-6) == pytest.approx(ROWS_WIN, abs=1e-6)
    assert -scores.mean() / (std + 1e-6) == pytest.approx(ROWS_LOSS, abs=1e-6)
    assert 5 / (np.std([10.0] * 4 + [0.0] * 4, ddof=1) + 1e-6) == pytest.approx(TRAJ_PM, abs=1e-6)


@pytest.mark.parametrize("stats,win,loss", [("rows", ROWS_WIN, ROWS_LOSS), ("trajectory", TRAJ_PM, -TRAJ_PM)])
def test_rows_statistics_weigh_long_losing_trajectories_more(stats, win, loss):
    batch = _wins_and_losses()
    adv, ref, _ = _both(batch, name="grpo", norm="mean_std", episode_stats=stats)
    expected = np.array([win] * 48 + [loss] * 200)
    np.testing.assert_allclose(adv, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ref, expected, rtol=0, atol=1e-6)


# --- penalty ------------------------------------------------------------------------------------
# One task group, gamma 0.5, gigpo with norm="mean" (A_step = R - mean over the obs group), omega 1.
#   traj A: reward [0, 0, 10], penalty [0, 0.5, 0], obs [0, 1, 2]
#   traj B: reward [0, 0],     penalty [0.5, 0],    obs [0, 1]
# own_row: R = discounted reward minus the row's own penalty:
#   A: [2.5, 5 - 0.5, 10] = [2.5, 4.5, 10];  B: [0 - 0.5, 0] = [-0.5, 0]
#   obs 0: {2.5, -0.5} mean 1 -> +1.5, -1.5; obs 1: {4.5, 0} mean 2.25 -> +2.25, -2.25; obs 2: alone -> 0
#   scores (rows): A [10, 10 - 0.5, 10], B [-0.5, 0]; mean 29/5 = 5.8 -> [4.2, 3.7, 4.2], [-6.3, -5.8]
#   A = [5.7, 5.95, 4.2], [-7.8, -8.05]
# in_reward: the reward is reward - penalty: A [0, -0.5, 10] -> R [2.25, 4.5, 10]; B [-0.5, 0] -> R [-0.5, 0]
#   (A's first row loses 0.5 * 0.5 = 0.25 of the penalty discounted back)
#   obs 0: {2.25, -0.5} mean 0.875 -> +-1.375; obs 1: +-2.25 as above
#   rows: scores A 9.5 (x3), B -0.5 (x2), mean 5.5 -> +4, -6:  A = [5.375, 6.25, 4], [-7.375, -8.25]
#   trajectory: G = 9.5, -0.5, mean 4.5 -> +-5:               A = [6.375, 7.25, 5], [-6.375, -7.25]
PEN_TRAJS = [
    (0, 1, [0.0, 0.0, 10.0], [0.0, 0.5, 0.0], [0, 0, 0], [0, 1, 2]),
    (0, 2, [0.0, 0.0], [0.5, 0.0], [0, 0], [0, 1]),
]
PEN_CASES = [
    ("own_row", "rows", [5.7, 5.95, 4.2, -7.8, -8.05]),
    ("in_reward", "rows", [5.375, 6.25, 4.0, -7.375, -8.25]),
    ("in_reward", "trajectory", [6.375, 7.25, 5.0, -6.375, -7.25]),
]


@pytest.mark.parametrize("penalty,stats,expected", PEN_CASES)
def test_own_row_penalty_charges_only_its_own_row(penalty, stats, expected):
    batch = _batch(PEN_TRAJS)
    adv, ref, _ = _both(batch, name="gigpo", gamma=0.5, norm="mean", penalty=penalty, episode_stats=stats)
    np.testing.assert_allclose(adv, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ref, expected, rtol=0, atol=1e-9)


@pytest.mark.slow
def test_in_reward_equals_a_batch_with_the_penalty_already_in_the_reward():
    """The old contract: with penalty="in_reward" a penalty field changes nothing but `reward - penalty`."""
    caps = dict(group_capacity=4, row_capacity=32)  # one compiled function per estimator and batch structure
    for seed in range(2):
        a = random_step_arrays(np.random.default_rng(seed), num_rows=64, dim=8, penalty=True)
        with_field = StepBatch.from_numpy(**a, **caps)
        folded = dict(a, reward=(a["reward"] - np.where(a["mask"], a["penalty"], 0)).astype(np.float32))
        del folded["penalty"]
        folded = StepBatch.from_numpy(**folded, **caps)
        for name in ("gigpo", "bipace_q"):
            cfg = EstimatorConfig(name=name, gamma=0.9)
            adv1, diag1 = compute_advantages(with_field, cfg)
            adv2, diag2 = compute_advantages(folded, cfg)
            np.testing.assert_array_equal(np.asarray(adv1), np.asarray(adv2))
            assert {k: float(v) for k, v in diag1.items()} == {k: float(v) for k, v in diag2.items()}


def test_no_penalty_field_reads_as_zero_penalties():
    without = _batch(PEN_TRAJS, penalties=False)
    zeros = StepBatch.from_numpy(
        **{k: getattr(without, k) for k in ("group_id", "traj_id", "step", "reward", "obs_hash", "fingerprint")},
        action_key=without.action_key,
        mask=without.mask,
        penalty=np.zeros(without.num_rows, np.float32),
        group_capacity=2,
        row_capacity=16,
    )
    cfg = EstimatorConfig(name="gigpo", gamma=0.5, norm="mean", penalty="own_row", episode_stats="rows")
    np.testing.assert_array_equal(np.asarray(compute_advantages(without, cfg)[0]), compute_advantages(zeros, cfg)[0])
    ref, _ = reference.compute_advantages_reference(without, cfg)
    np.testing.assert_allclose(np.asarray(compute_advantages(without, cfg)[0]), ref, atol=1e-5)


# --- step_norm ----------------------------------------------------------------------------------
# One task group, four one-step trajectories in one cluster (same fingerprint), R = reward (gamma
# irrelevant): R = [4, 2, 0, 2], keys [a, a, b, b]; mean 2, unbiased std = sqrt(8 / 3) = 1.632993.
#   bipace_q: V = 2, Q_a = 3, Q_b = 1 -> Q - V = [+1, +1, -1, -1]
#   bipace_diff: R - mean(other key) = [4 - 1, 2 - 1, 0 - 3, 2 - 3] = [3, 1, -3, -1]
#   step_norm="std": divided by 1.632993 + 1e-6: bipace_q [+-0.612372], bipace_diff [1.837117, 0.612372, ...]
#   (gigpo on the same rows: (R - 2) / 1.632994 = [1.224745, 0, -1.224745, 0]).
# The step term is isolated as advantage(estimator) - advantage(grpo) (omega 1).
STD = np.sqrt(8 / 3) + 1e-6
STEP_TRAJS = [(0, t, [r], None, [k], [0]) for t, (r, k) in enumerate(zip([4.0, 2.0, 0.0, 2.0], [0, 0, 1, 1]))]
STEP_CASES = [
    ("bipace_q", "none", [1.0, 1.0, -1.0, -1.0]),
    ("bipace_q", "std", [1 / STD, 1 / STD, -1 / STD, -1 / STD]),
    ("bipace_diff", "none", [3.0, 1.0, -3.0, -1.0]),
    ("bipace_diff", "std", [3 / STD, 1 / STD, -3 / STD, -1 / STD]),
    ("gigpo", "std", [2 / STD, 0.0, -2 / STD, 0.0]),  # gigpo already divides; step_norm changes nothing
]


@pytest.mark.slow
@pytest.mark.parametrize("name,step_norm,step", STEP_CASES)
def test_step_norm_std_divides_the_pace_term_by_the_cluster_std(name, step_norm, step):
    batch = _batch(STEP_TRAJS, penalties=False)
    adv, ref, diag = _both(batch, name=name, norm="mean_std", step_norm=step_norm)
    grpo, _, _ = _both(batch, name="grpo", norm="mean_std")
    np.testing.assert_allclose(adv - grpo, step, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ref - grpo, step, rtol=0, atol=1e-5)
    assert np.abs(np.asarray(step)).max() > 0.5 and diag["max_group_size"] == 4


@pytest.mark.slow
def test_step_norm_is_ignored_under_norm_mean_and_zeroes_an_all_equal_cluster():
    batch = _batch(STEP_TRAJS, penalties=False)
    plain, _, _ = _both(batch, name="bipace_q", norm="mean")
    std, _, _ = _both(batch, name="bipace_q", norm="mean", step_norm="std")
    np.testing.assert_array_equal(plain, std)
    # Returns equal in exact arithmetic but one float32 rounding apart (10 + (-0.1 + -0.1) = 9.8 vs
    # -0.1 + (-0.1 + 10) = 9.799999): without the span rule this 2-row cluster gives about +-0.41.
    flat = _batch(
        [
            (0, 0, [10.0, -0.1, -0.1], None, [0, 0, 0], [0, 1, 2]),
            (0, 1, [-0.1, -0.1, 10.0], None, [1, 1, 1], [0, 3, 4]),
        ],
        penalties=False,
    )
    for name in ("bipace_q", "bipace_diff"):
        cfg = EstimatorConfig(name=name, gamma=1.0, norm="mean_std", step_norm="std")
        adv = np.asarray(compute_advantages(flat, cfg)[0])
        ref, _ = reference.compute_advantages_reference(flat, cfg, dtype=np.float32)
        grpo = np.asarray(compute_advantages(flat, EstimatorConfig(name="grpo", gamma=1.0))[0])
        np.testing.assert_array_equal(adv, grpo)
        np.testing.assert_array_equal(ref, grpo)


# --- pace_fallback ------------------------------------------------------------------------------
# Task group 0: one cluster of five one-step trajectories, R = [4, 2, 0, 2, 7], keys [a, a, b, b, c].
#   V = 15/5 = 3; Q_a = 3, Q_b = 1, Q_c = 7.
#   same_key_cluster (keys differ -> every row is a PACE row): Q - V = [0, 0, -2, -2, +4]
#   singleton_pool: row c's pool {c} is a singleton -> leave-one-out 7 - mean(4, 2, 0, 2) = 7 - 2 = +5
# Task group 1: one cluster of two one-step trajectories with the same key a, R = [4, 2].
#   same_key_cluster: leave-one-out [4 - 2, 2 - 4] = [+2, -2] (LOO rows)
#   singleton_pool: the pool is the whole cluster: Q - V = 0 (PACE rows)
# Rows: 7. LOO rows: same_key_cluster 2 (group 1) -> 2/7; singleton_pool 1 (row c) -> 1/7.
# bipace_diff: every row of group 0 has a different-key peer (diff-peer either way), group 1's rows
# have none (leave-one-out either way): the two fallbacks coincide.
#   diff-peer in group 0: a rows vs mean(0, 2, 7) = 3, b rows vs mean(4, 2, 7) = 13/3, c vs mean(4, 2, 0, 2) = 2:
#   [4 - 3, 2 - 3, 0 - 13/3, 2 - 13/3, 7 - 2] = [1, -1, -13/3, -7/3, 5]
FALLBACK_TRAJS = [
    (0, t, [r], None, [k], [0]) for t, (r, k) in enumerate(zip([4.0, 2.0, 0.0, 2.0, 7.0], [0, 0, 1, 1, 2]))
] + [(1, 10, [4.0], None, [0], [0]), (1, 11, [2.0], None, [0], [0])]
FALLBACK_CASES = [
    ("bipace_q", "same_key_cluster", [0, 0, -2, -2, 4, 2, -2], 2 / 7, 5 / 7),
    ("bipace_q", "singleton_pool", [0, 0, -2, -2, 5, 0, 0], 1 / 7, 6 / 7),
    ("bipace_diff", "same_key_cluster", [1, -1, -13 / 3, -7 / 3, 5, 2, -2], 2 / 7, 5 / 7),
    ("bipace_diff", "singleton_pool", [1, -1, -13 / 3, -7 / 3, 5, 2, -2], 2 / 7, 5 / 7),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,fallback,step,loo,pace", FALLBACK_CASES)
def test_singleton_pool_falls_back_per_row(name, fallback, step, loo, pace):
    batch = _batch(FALLBACK_TRAJS, penalties=False)
    adv, ref, diag = _both(batch, name=name, norm="mean", pace_fallback=fallback)
    grpo, _, _ = _both(batch, name="grpo", norm="mean")
    np.testing.assert_allclose(adv - grpo, step, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ref - grpo, step, rtol=0, atol=1e-9)
    assert diag["loo_row_rate"] == pytest.approx(loo) and diag["pace_row_rate"] == pytest.approx(pace)
    assert diag["loo_row_rate"] + diag["pace_row_rate"] + diag["singleton_row_rate"] == pytest.approx(1.0)


# --- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(penalty="per_row"), r"EstimatorConfig.penalty: expected one of \('in_reward', 'own_row'\)"),
        (dict(episode_stats="steps"), r"EstimatorConfig.episode_stats: expected one of"),
        (dict(step_norm="mad"), r"EstimatorConfig.step_norm: expected one of \('none', 'std'\)"),
        (dict(pace_fallback="loo"), r"EstimatorConfig.pace_fallback: expected one of"),
        (dict(penalty="own_row"), r"EstimatorConfig.penalty: 'own_row' requires EstimatorConfig.episode_stats='rows'"),
    ],
)
def test_protocol_options_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EstimatorConfig(**kwargs)
    EstimatorConfig(penalty="own_row", episode_stats="rows")  # the valid pairing


def test_from_numpy_validates_the_penalty_field():
    a = random_step_arrays(np.random.default_rng(0), num_rows=64, dim=8, penalty=True)
    StepBatch.from_numpy(**a)  # NaN and negative garbage on padding is fine
    real = int(np.flatnonzero(a["mask"])[0])
    for bad, message in ((-0.1, "expected finite values >= 0"), (np.inf, "expected finite values >= 0")):
        b = dict(a, penalty=a["penalty"].copy())
        b["penalty"][real] = bad
        with pytest.raises(ValueError, match=f"StepBatch.penalty: {message}.*row {real}"):
            StepBatch.from_numpy(**b)
    with pytest.raises(ValueError, match=r"StepBatch.penalty: expected shape \(64,\)"):
        StepBatch.from_numpy(**dict(a, penalty=a["penalty"][:10]))
    with pytest.raises(ValueError, match="StepBatch.penalty: expected a floating dtype"):
        StepBatch.from_numpy(**dict(a, penalty=np.zeros(64, np.int32)))


def test_jitted_path_treats_a_bad_penalty_like_a_bad_reward():
    batch = _batch(PEN_TRAJS)
    pen = np.asarray(batch.penalty).copy()
    pen[3] = -1.0  # traj B's first row: both of B's rows become invalid
    bad = batch.replace(penalty=jnp.asarray(pen))
    cfg = EstimatorConfig(name="gigpo", gamma=0.5, norm="mean", penalty="own_row", episode_stats="rows")
    adv, diag = compute_advantages(bad, cfg)
    ref, ref_diag = reference.compute_advantages_reference(bad, cfg)
    assert int(diag["invalid_rows"]) == ref_diag["invalid_rows"] == 2
    np.testing.assert_allclose(np.asarray(adv), ref, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv)[3:], 0.0)
