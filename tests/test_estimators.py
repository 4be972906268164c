"""Estimators: hand-computed cases for every estimator, equivalences, invariances, bad input.

Expected numbers are written from the formulas of `docs/estimators.md` ("Step level", "Clustering", "Diagnostics"),
not from the oracle.
"""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from bipace_jax.estimators import (
    DIAGNOSTIC_KEYS,
    EpsilonController,
    EstimatorConfig,
    StepBatch,
    assign_ids,
    calibrate_epsilon,
    compute_advantages,
    reference,
    step_details,
    step_group_labels,
)
from bipace_jax.estimators.synthetic import random_step_arrays

E = np.eye(8, dtype=np.float32)


ROWS_TOTAL = 16  # hand-computed batches are padded to 16 rows x D=8, 2 task groups x 16 rows,
# so they share compiled functions


def _rows(spec, fingerprints=None, pad=None, dim=8):
    """spec: list of (group, traj, step, reward, obs, key). Padding rows hold garbage."""
    n = len(spec) + (max(0, ROWS_TOTAL - len(spec)) if pad is None else pad)
    a = {k: np.zeros(n, np.int32) for k in ("group_id", "traj_id", "step", "obs_hash", "action_key")}
    a["reward"] = np.full(n, np.nan, np.float32)
    a["fingerprint"] = np.full((n, dim), np.nan, np.float32)
    a["mask"] = np.zeros(n, bool)
    for i, (g, t, s, r, o, k) in enumerate(spec):
        a["group_id"][i], a["traj_id"][i], a["step"][i] = g, t, s
        a["reward"][i], a["obs_hash"][i], a["action_key"][i] = r, o, k
        a["fingerprint"][i] = E[o % dim] if fingerprints is None else fingerprints[i]
        a["mask"][i] = True
    return a


# One task group, three trajectories (episode returns 1, 2, 3), observations A=0, B=1, C=2:
#   traj 0: rewards [0, 1]     obs [A, B]     keys [0, 2]
#   traj 1: rewards [2]        obs [A]        keys [0]
#   traj 2: rewards [0, 0, 3]  obs [A, B, C]  keys [1, 2, 5]
# plus a task group with a single trajectory (A_ep = 0, its step groups separate).
SPEC = [
    (7, 10, 0, 0.0, 0, 0),
    (7, 10, 1, 1.0, 1, 2),
    (7, 11, 0, 2.0, 0, 0),
    (7, 12, 0, 0.0, 0, 1),
    (7, 12, 1, 0.0, 1, 2),
    (7, 12, 2, 3.0, 2, 5),
    (3, 20, 0, 4.0, 0, 0),
]
GAMMA = 0.5
# Step returns with gamma = 0.5: traj 0 [0.5, 1], traj 1 [2], traj 2 [0.75, 1.5, 3], traj 20 [4].
R = np.array([0.5, 1.0, 2.0, 0.75, 1.5, 3.0, 4.0])
A_EP_STD = np.array([-1, -1, 0, 1, 1, 1, 0]) / (1.0 + 1e-6)  # (G - 2) / (std=1 + 1e-6)
A_EP_MEAN = np.array([-1, -1, 0, 1, 1, 1, 0], float)


def _batch(spec=SPEC, **kw):
    return StepBatch.from_numpy(**_rows(spec, **kw), group_capacity=2, row_capacity=16)


def _run(name, batch=None, **cfg):
    cfg.setdefault("gamma", GAMMA)
    adv, diag = compute_advantages(batch if batch is not None else _batch(), EstimatorConfig(name=name, **cfg))
    return np.asarray(adv), {k: float(v) for k, v in diag.items()}


@pytest.mark.parametrize("norm,expected", [("mean_std", A_EP_STD), ("mean", A_EP_MEAN)])
def test_grpo_hand_computed_episode_advantages(norm, expected):
    adv, diag = _run("grpo", norm=norm)
    np.testing.assert_allclose(adv[:7], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(adv[7:], 0.0)  # padding
    assert diag["num_step_groups"] == 0 and diag["pace_row_rate"] == 0.0
    assert diag["hash_num_step_groups"] == 4  # (7,A) (7,B) (7,C) (3,A)


def _gigpo_step(norm):
    a_mean = (0.5 + 2.0 + 0.75) / 3
    a_std = math.sqrt(((0.5 - a_mean) ** 2 + (2.0 - a_mean) ** 2 + (0.75 - a_mean) ** 2) / 2)
    b_mean, b_std = 1.25, math.sqrt(2 * 0.25**2)
    div_a, div_b = (a_std + 1e-6, b_std + 1e-6) if norm == "mean_std" else (1.0, 1.0)
    return np.array(
        [
            (0.5 - a_mean) / div_a,
            (1.0 - b_mean) / div_b,
            (2.0 - a_mean) / div_a,
            (0.75 - a_mean) / div_a,
            (1.5 - b_mean) / div_b,
            0.0,
            0.0,
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gigpo", "bigpo"])
@pytest.mark.parametrize("norm", ["mean_std", "mean"])
def test_gigpo_and_bigpo_hand_computed_step_advantages(name, norm):
    adv, diag = _run(name, norm=norm, omega=0.5)
    a_ep = A_EP_STD if norm == "mean_std" else A_EP_MEAN
    np.testing.assert_allclose(adv[:7], a_ep + 0.5 * _gigpo_step(norm), rtol=1e-5, atol=1e-5)
    # Step groups sizes [3, 2, 1, 1]: p90 of [1, 1, 2, 3] at 0.9 * 3 = 2.7 -> 2 + 0.7 * (3 - 2).
    expected = dict(
        num_step_groups=4,
        singleton_group_rate=0.5,
        singleton_row_rate=2 / 7,
        mean_group_size=7 / 4,
        p90_group_size=2.7,
        max_group_size=3,
        pairs=4,
    )
    for k, v in expected.items():
        assert diag[k] == pytest.approx(v, rel=1e-6), k
        assert diag["hash_" + k] == pytest.approx(v, rel=1e-6), k


def test_bipace_q_hand_computed_pace_loo_and_singleton_rows():
    adv, diag = _run("bipace_q", norm="mean")
    v_a = (0.5 + 2.0 + 0.75) / 3
    step = np.array(
        [
            (0.5 + 2.0) / 2 - v_a,  # cluster A has keys {0, 0, 1}: Q(key 0) - V
            1.0 - 1.5,  # cluster B keys {2, 2}: leave-one-out R - mean(others)
            (0.5 + 2.0) / 2 - v_a,
            0.75 - v_a,  # Q(key 1) = 0.75
            1.5 - 1.0,
            0.0,
            0.0,
        ]
    )  # singletons
    np.testing.assert_allclose(adv[:7], A_EP_MEAN + step, rtol=1e-5, atol=1e-5)
    assert diag["pace_row_rate"] == pytest.approx(3 / 7)
    assert diag["loo_row_rate"] == pytest.approx(2 / 7)
    assert diag["singleton_row_rate"] == pytest.approx(2 / 7)
    assert diag["pace_row_rate"] + diag["loo_row_rate"] + diag["singleton_row_rate"] == pytest.approx(1.0)


def test_step_details_names_the_branch_of_every_row():
    # the hand case above: cluster A (rows 0, 2, 3) PACE, cluster B (rows 1, 4) leave-one-out, the rest singletons
    labels, kinds = (np.asarray(x) for x in step_details(_batch(), EstimatorConfig(name="bipace_q", gamma=GAMMA)))
    np.testing.assert_array_equal(kinds[:7], [2, 1, 2, 2, 1, 0, 0])
    assert (kinds[7:] == -1).all() and (labels[7:] == -1).all()  # padding
    assert labels[0] == labels[2] == labels[3] and labels[1] == labels[4] and len(set(labels[[0, 1, 5, 6]])) == 4
    _, grpo_kinds = step_details(_batch(), EstimatorConfig(name="grpo", gamma=GAMMA))
    np.testing.assert_array_equal(np.asarray(grpo_kinds)[:7], 0)  # no step level: no branch


def test_bipace_diff_hand_computed_diff_peer_baselines():
    adv, _ = _run("bipace_diff", norm="mean_std", omega=2.0)
    step = np.array(
        [
            0.5 - 0.75,  # peers with a different key: {0.75}
            1.0 - 1.5,
            2.0 - 0.75,
            0.75 - (0.5 + 2.0) / 2,
            1.5 - 1.0,
            0.0,
            0.0,
        ]
    )
    np.testing.assert_allclose(adv[:7], A_EP_STD + 2.0 * step, rtol=1e-5, atol=1e-5)


def test_unparsable_keys_match_no_row_so_the_cluster_takes_the_pace_branch():
    spec = [s[:5] + ((-1,) if s[4] == 1 else (s[5],)) for s in SPEC]  # cluster B: keys -1, -1
    q, dq = _run("bipace_q", batch=_batch(spec), norm="mean")
    d, _ = _run("bipace_diff", batch=_batch(spec), norm="mean")
    # Q - V with each row its own key: R_i - V, V = 1.25; diff-peer: R_i - the other row.
    np.testing.assert_allclose(q[[1, 4]], A_EP_MEAN[[1, 4]] + np.array([1.0 - 1.25, 1.5 - 1.25]), atol=1e-6)
    np.testing.assert_allclose(d[[1, 4]], A_EP_MEAN[[1, 4]] + np.array([1.0 - 1.5, 1.5 - 1.0]), atol=1e-6)
    assert dq["pace_row_rate"] == pytest.approx(5 / 7) and dq["loo_row_rate"] == 0.0


def test_discounted_return_is_the_backward_recursion_and_gamma_zero_is_exact():
    spec = [(0, 1, t, r, t, 0) for t, r in enumerate([0.3, -0.1, 2.0])] + [(0, 2, 0, 1.0, 9, 0)]
    for gamma, r0 in ((0.9, 0.3 + 0.9 * (-0.1 + 0.9 * 2.0)), (0.0, 0.3)):
        # gigpo, norm="mean": row (traj 1, step 0) shares no observation -> singleton; compare through
        # a two-row step group with the constant-return traj 2 (obs 9 -> obs 0 for both).
        s = [list(x) for x in spec]
        s[3][4] = 0
        adv, _ = _run("gigpo", batch=_batch([tuple(x) for x in s]), norm="mean", gamma=gamma, omega=1.0)
        g1, g2 = 0.3 - 0.1 + 2.0, 1.0
        a_ep = np.array([g1 - (g1 + g2) / 2, g2 - (g1 + g2) / 2])
        np.testing.assert_allclose(
            adv[[0, 3]], a_ep + np.array([r0 - (r0 + 1.0) / 2, 1.0 - (r0 + 1.0) / 2]), rtol=0, atol=1e-6
        )
    adv0, _ = _run("gigpo", batch=_batch(spec), norm="mean", gamma=0.0)
    assert adv0.dtype == np.float32


def test_equal_episode_returns_stay_equal_despite_float32_rounding():
    # -0.1 + -0.1 + 10 and 10 + -0.1 + -0.1 differ by one float32 rounding step.
    s1 = (np.float32(-0.1) + np.float32(-0.1)) + np.float32(10)
    s2 = (np.float32(10) + np.float32(-0.1)) + np.float32(-0.1)
    assert s1 != s2
    spec = [
        (0, 1, 0, -0.1, 0, 0),
        (0, 1, 1, -0.1, 1, 0),
        (0, 1, 2, 10.0, 2, 0),
        (0, 2, 0, 10.0, 3, 0),
        (0, 2, 1, -0.1, 4, 0),
        (0, 2, 2, -0.1, 5, 0),
    ]
    adv, _ = _run("grpo", batch=_batch(spec), norm="mean_std")
    np.testing.assert_array_equal(adv[:6], 0.0)


@pytest.mark.slow
def test_clustering_nearest_cluster_ties_leader_vs_mean_overflow_and_degenerate_rows():
    deg = lambda a: np.radians(a)
    unit = lambda a: np.array([np.cos(deg(a)), np.sin(deg(a))] + [0] * 6, np.float32)
    # a at 0 deg, b at 16 deg (cos 0.961 >= 0.95 joins a), c at 19 deg: cos to a 0.946 (< 0.95) but
    # cos to the running mean direction (8 deg) 0.982: mean joins, leader opens a second cluster.
    fps = [unit(0), unit(16), unit(19)]
    spec = [(0, 1, t, 0.0, t, 0) for t in range(3)]
    b = _batch(spec, fingerprints=fps)
    mean = np.asarray(step_group_labels(b, EstimatorConfig(name="bigpo", epsilon=0.05)))
    leader = np.asarray(step_group_labels(b, EstimatorConfig(name="bigpo", epsilon=0.05, centroid="leader")))
    assert mean[0] == mean[1] == mean[2]
    assert leader[0] == leader[1] != leader[2]
    # Exact tie: e0 and e1 open two clusters, (e0 + e1)/sqrt(2) has cos 0.7071 to both and joins at
    # epsilon 0.3 the one created first (e0's), whatever the row order in the batch.
    fps = [E[0], E[1], (E[0] + E[1])]
    spec = [(0, 1, 0, 0.0, 0, 0), (0, 2, 0, 0.0, 1, 0), (0, 3, 0, 0.0, 2, 0)]
    for order in ([0, 1, 2], [2, 1, 0]):
        arrays = {k: v[order] for k, v in _rows(spec, fingerprints=fps).items()}
        lab = np.asarray(
            step_group_labels(
                StepBatch.from_numpy(**arrays, group_capacity=2, row_capacity=16),
                EstimatorConfig(name="bigpo", epsilon=0.3),
            )
        )
        inv = {o: i for i, o in enumerate(order)}
        assert lab[inv[2]] == lab[inv[0]] != lab[inv[1]]
    # Capacity 1: e0 opens, e1 overflows (singleton), e0 joins; zero and NaN rows are degenerate.
    fps = [E[0], E[1], E[0], np.zeros(8, np.float32), np.full(8, np.nan, np.float32)]
    spec = [(0, 1, t, float(t), t, 0) for t in range(5)]
    b = _batch(spec, fingerprints=fps)
    cfg = EstimatorConfig(name="bipace_q", epsilon=0.05, capacity=1)
    lab = np.asarray(step_group_labels(b, cfg))
    _, diag = compute_advantages(b, cfg)
    assert lab[0] == lab[2] and len(set(lab[:5].tolist())) == 4 and (lab[5:] == -1).all()
    assert int(diag["overflow_rows"]) == 1 and int(diag["degenerate_rows"]) == 2
    assert float(diag["loo_row_rate"]) == pytest.approx(2 / 5)


@pytest.mark.slow
def test_epsilon_zero_with_one_hot_obs_fingerprints_equals_gigpo_exactly():
    for seed in range(6):
        a = random_step_arrays(np.random.default_rng(seed), num_rows=64, dim=8)
        a["fingerprint"] = np.eye(8, dtype=np.float32)[a["obs_hash"] % 8]
        assert a["obs_hash"].max() < 8
        b = StepBatch.from_numpy(**a, group_capacity=4, row_capacity=24)
        for norm in ("mean_std", "mean"):
            g_adv, g_diag = compute_advantages(b, EstimatorConfig(name="gigpo", norm=norm))
            c_adv, c_diag = compute_advantages(b, EstimatorConfig(name="bigpo", norm=norm, epsilon=0.0))
            np.testing.assert_array_equal(np.asarray(g_adv), np.asarray(c_adv))
            for k in DIAGNOSTIC_KEYS:
                assert float(g_diag[k]) == float(c_diag[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("name,norm", [("gigpo", "mean_std"), ("bipace_q", "mean")])
def test_row_permutation_and_extra_padding_change_nothing(name, norm):
    cfg = EstimatorConfig(name=name, epsilon=0.1, norm=norm)
    for seed in range(4):
        rng = np.random.default_rng(100 + seed)
        a = random_step_arrays(rng, num_rows=64, dim=8)
        adv, diag = compute_advantages(StepBatch.from_numpy(**a, group_capacity=4, row_capacity=24), cfg)
        perm = rng.permutation(64)
        p_adv, p_diag = compute_advantages(
            StepBatch.from_numpy(**{k: v[perm] for k, v in a.items()}, group_capacity=4, row_capacity=24), cfg
        )
        np.testing.assert_array_equal(np.asarray(p_adv), np.asarray(adv)[perm])
        extra = random_step_arrays(rng, num_rows=64, dim=8)
        padded = {k: np.concatenate([v, extra[k][:16]]) for k, v in a.items()}
        padded["mask"][64:] = False
        padded["reward"][64:] = np.nan
        x_adv, x_diag = compute_advantages(StepBatch.from_numpy(**padded, group_capacity=4, row_capacity=24), cfg)
        np.testing.assert_allclose(np.asarray(x_adv)[:64], np.asarray(adv), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(x_adv)[64:], 0.0)
        for k in DIAGNOSTIC_KEYS:
            assert float(p_diag[k]) == float(diag[k]) == pytest.approx(float(x_diag[k])), k


@pytest.mark.slow
def test_bipace_q_recovers_q_minus_v_on_a_bisimulation_mdp():
    """Two observation texts per latent state (bisimilar: same dynamics, same fingerprint up to
    noise). s0 -> action a in {0, 1, 2} -> s1 (obs text x or y at random) -> action b -> terminal
    with reward r(b) = [1, 0, 3][b]. Clusters must be the latent states, so the step advantage is the
    empirical Q(s, a) - V(s) of the sampled returns, while gigpo splits s1 by observation text."""
    rng = np.random.default_rng(0)
    dirs = rng.standard_normal((2, 16)).astype(np.float32)
    spec, fps, latent, ret = [], [], [], []
    gamma, r_final = 0.9, np.array([1.0, 0.0, 3.0])
    for traj in range(24):
        a, b = rng.integers(0, 3), rng.integers(0, 3)
        obs1 = 1 + rng.integers(0, 2)
        spec += [(0, traj, 0, 0.2 * a, 0, int(a)), (0, traj, 1, r_final[b], int(obs1), int(b))]
        for s in (0, 1):
            fps.append(dirs[s] + 0.01 * rng.standard_normal(16).astype(np.float32))
        latent += [0, 1]
        ret += [0.2 * a + gamma * r_final[b], r_final[b]]
    batch = StepBatch.from_numpy(**_rows(spec, fingerprints=fps, dim=16))
    cfg = EstimatorConfig(name="bipace_q", gamma=gamma, norm="mean", epsilon=0.05)
    adv, diag = compute_advantages(batch, cfg)
    grpo, _ = compute_advantages(batch, cfg.replace(name="grpo"))
    step = np.asarray(adv) - np.asarray(grpo)
    latent, ret, keys = np.array(latent), np.array(ret), np.array([s[5] for s in spec])
    for i in range(len(spec)):
        in_s = latent == latent[i]
        q = ret[in_s & (keys == keys[i])].mean()
        assert step[i] == pytest.approx(q - ret[in_s].mean(), abs=1e-5)
    # At s1 the return is deterministic given the action: Q(s1, b) = r(b) exactly.
    s1 = latent == 1
    for i in np.flatnonzero(s1):
        assert step[i] == pytest.approx(r_final[keys[i]] - ret[s1].mean(), abs=1e-5)
    assert int(diag["num_step_groups"]) == 2 and int(diag["hash_num_step_groups"]) == 3


@pytest.mark.slow
def test_bfloat16_fingerprints_cluster_like_their_float32_values():
    a = random_step_arrays(np.random.default_rng(5), num_rows=64, dim=8, fingerprints="gaussian")
    a16 = dict(a, fingerprint=a["fingerprint"].astype(ml_dtypes.bfloat16))
    a32 = dict(a, fingerprint=a16["fingerprint"].astype(np.float32))
    cfg = EstimatorConfig(name="bipace_q", epsilon=0.3)
    b16 = StepBatch.from_numpy(**a16, group_capacity=4, row_capacity=24)
    assert b16.fingerprint.dtype == jnp.bfloat16
    adv16, _ = compute_advantages(b16, cfg)
    adv32, _ = compute_advantages(StepBatch.from_numpy(**a32, group_capacity=4, row_capacity=24), cfg)
    np.testing.assert_array_equal(np.asarray(adv16), np.asarray(adv32))


# ---------------------------------------------------------------------------- bad input


def _good():
    return _rows(SPEC)  # 16 rows


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("reward", lambda a: a["reward"].__setitem__(1, np.nan), "StepBatch.reward"),
        ("step", lambda a: a["step"].__setitem__(1, -1), "StepBatch.step"),
        ("traj_id", lambda a: a["group_id"].__setitem__(1, 99), "StepBatch.traj_id"),
        ("dup", lambda a: a["step"].__setitem__(1, 0), "duplicate"),
        ("gap", lambda a: a["step"].__setitem__(1, 2), "not exactly 0..T-1"),
        ("dtype", lambda a: a.__setitem__("group_id", a["group_id"].astype(np.float32)), "StepBatch.group_id"),
        ("shape", lambda a: a.__setitem__("obs_hash", a["obs_hash"][:-1]), "StepBatch.obs_hash"),
        ("fp", lambda a: a.__setitem__("fingerprint", a["fingerprint"][:, 0]), "StepBatch.fingerprint"),
        ("mask", lambda a: a.__setitem__("mask", a["mask"].astype(np.int32)), "StepBatch.mask"),
        ("range", lambda a: a.__setitem__("traj_id", a["traj_id"].astype(np.int64) + 2**40), "fit int32"),
        ("missing", lambda a: a.__setitem__("reward", None), "StepBatch.reward: missing"),
    ],
)
def test_from_numpy_rejects_bad_real_rows_naming_the_field(field, value, message):
    a = _good()
    value(a)
    with pytest.raises(ValueError, match=message):
        StepBatch.from_numpy(**a)


def test_from_numpy_accepts_garbage_in_padding_and_rejects_too_small_capacities():
    a = _good()
    a["step"][-1], a["traj_id"][-1] = -5, 10  # padding colliding with a real trajectory
    StepBatch.from_numpy(**a)
    with pytest.raises(ValueError, match="StepBatch.row_capacity"):
        StepBatch.from_numpy(**a, row_capacity=4)
    with pytest.raises(ValueError, match="StepBatch.group_capacity"):
        StepBatch.from_numpy(**a, group_capacity=1)


@pytest.mark.parametrize("name", ["gigpo", "bipace_q"])
def test_jitted_path_counts_invalid_trajectories_and_never_returns_nan(name):
    a = _good()
    a["reward"][4] = np.nan  # traj 12 (3 rows): non-finite reward
    a["group_id"][0] = 3  # traj 10 (2 rows) in two task groups
    batch = StepBatch(**{k: jnp.asarray(v) for k, v in a.items()}, group_capacity=2, row_capacity=16)
    cfg = EstimatorConfig(name=name, gamma=GAMMA, norm="mean")
    adv, diag = compute_advantages(batch, cfg)
    adv = np.asarray(adv)
    assert not np.isnan(adv).any()
    assert int(diag["invalid_rows"]) == 5
    np.testing.assert_array_equal(adv[[0, 1, 3, 4, 5]], 0.0)
    ref_adv, ref_diag = reference.compute_advantages_reference(batch, cfg)
    np.testing.assert_allclose(adv, ref_adv, atol=1e-5)
    assert ref_diag["invalid_rows"] == 5
    # Only traj 11 remains in group 7: a single trajectory -> A_ep = 0.
    assert adv[2] == 0.0


def test_jitted_path_marks_rows_beyond_the_capacities_invalid():
    a = _good()
    batch = StepBatch(**{k: jnp.asarray(v) for k, v in a.items()}, group_capacity=1, row_capacity=3)
    cfg = EstimatorConfig(name="bigpo")
    _, diag = compute_advantages(batch, cfg)
    _, ref_diag = reference.compute_advantages_reference(batch, cfg)
    # Group 3 (rank 0) fits; group 7 ranks beyond the single slot: all 6 of its rows are invalid.
    assert int(diag["invalid_rows"]) == ref_diag["invalid_rows"] == 6


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(name="ppo"), "EstimatorConfig.name"),
        (dict(epsilon=1.0), "EstimatorConfig.epsilon"),
        (dict(epsilon=-0.1), "EstimatorConfig.epsilon"),
        (dict(gamma=1.5), "EstimatorConfig.gamma"),
        (dict(norm="std"), "EstimatorConfig.norm"),
        (dict(centroid="median"), "EstimatorConfig.centroid"),
        (dict(capacity=0), "EstimatorConfig.capacity"),
        (dict(key="hash"), "EstimatorConfig.key"),
        (dict(omega=float("nan")), "EstimatorConfig.omega"),
    ],
)
def test_estimator_config_rejects_bad_values_on_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EstimatorConfig(**kwargs)


def test_clustering_estimator_without_capacities_raises_before_compiling():
    a = _good()
    batch = StepBatch(**{k: jnp.asarray(v) for k, v in a.items()})
    with pytest.raises(ValueError, match="row_capacity"):
        compute_advantages(batch, EstimatorConfig(name="bipace_q"))
    adv, _ = compute_advantages(batch, EstimatorConfig(name="gigpo"))  # no layout needed
    assert adv.shape == (16,)


def test_assign_ids_equal_values_equal_ids_and_none_is_minus_one():
    ids = assign_ids(["go north", "take key", None, "go north", ("t", 3), ("t", 3)])
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [0, 1, -1, 0, 2, 2])
    with pytest.raises(ValueError, match=r"values\[0\]"):
        assign_ids([["unhashable"]])


def test_calibrate_epsilon_returns_the_smallest_grid_value_under_the_target():
    # Per group: e0, then rows at angles 10 and 25 degrees from e0: singleton rate falls with epsilon.
    unit = lambda a: np.array([np.cos(np.radians(a)), np.sin(np.radians(a))] + [0] * 6, np.float32)
    spec, fps = [], []
    for g in range(2):
        for t, ang in enumerate((0, 10, 25)):
            spec.append((g, 10 * g + t, 0, 0.0, t, 0))
            fps.append(unit(ang))
    b = _batch(spec, fingerprints=fps)
    grid = (0.0, 0.01, 0.02, 0.05, 0.1)
    eps, rates = calibrate_epsilon(b, target_singleton_rate=0.5, grid=grid, return_rates=True)
    # cos 10 deg = 0.985 joins from epsilon 0.02; cos 25 deg = 0.906 (to e0), 0.96 to the mean.
    assert eps == 0.02 and rates[0.0] == 1.0 and rates[0.01] == 1.0 and rates[0.02] == 0.5
    with pytest.raises(ValueError, match="no epsilon"):
        calibrate_epsilon(b, target_singleton_rate=0.0, grid=(0.0, 0.01))


def test_epsilon_controller_moves_toward_the_target_within_bounds():
    on = EpsilonController(epsilon=0.05, target_singleton_rate=0.2, gain=0.1, max_step=0.01, max_epsilon=0.07)
    assert on.update(0.5) == pytest.approx(0.06)  # 0.1 * 0.3 clipped to 0.01
    assert on.update(0.5) == pytest.approx(0.07)
    assert on.update(0.5) == pytest.approx(0.07)  # upper bound
    assert on.update(0.15) == pytest.approx(0.065)  # 0.1 * -0.05
    with pytest.raises(ValueError, match="singleton_rate"):
        on.update(float("nan"))
    with pytest.raises(ValueError, match="EpsilonController.epsilon"):
        EpsilonController(epsilon=0.5, max_epsilon=0.3)
