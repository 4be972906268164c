"""verl-agent's similarity grouping: `similarity_groups` and GiGPO on it vs a plain re-statement.

The oracle below restates, as plain Python in float64, verl-agent's `build_step_group` (its
`enable_similarity` branch), `episode_norm_reward` (`compute_mean_std_cross_steps=True`),
`step_norm_reward` and `compute_gigpo_outcome_advantage` (gigpo/core_gigpo.py at 796ed31): rows
of each task group in batch order, a row joins the first cluster whose first observation has
`SequenceMatcher(None, obs, rep).ratio() >= thresh`. Batches are verl-agent-shaped: task groups
of 8 trajectories, rows in its gathered order (env index, then step), ALFWorld-like observations
with exact repeats and, in the near-duplicate cases, texts that differ in one object number or a
trailing sentence.
"""

import difflib

import numpy as np
import pytest

from bipace_jax.build import estimator_config, rollout_config, validate
from bipace_jax.config import ConfigError
from bipace_jax.estimators import EstimatorConfig, StepBatch, compute_advantages, similarity_groups, step_group_labels
from bipace_jax.rollout import RolloutConfig
from configs import base

GROUP_SIZE = 8
# Pairwise SequenceMatcher ratios of these texts are <= 0.54: without variants, no two merge at 0.9.
OBS = (
    "You arrive at countertop 1. On the countertop 1, you see a apple 1, a bread 1, and a knife 2.",
    "You open the fridge 1. The fridge 1 is open. In it, you see a egg 2, a lettuce 1, and a tomato 3.",
    "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing.",
    "Nothing happens.",
    "You pick up the mug 2 from the cabinet 3.",
    "The drawer 2 is closed. You are carrying: a soapbar 1.",
)


# ---- the plain re-statement of verl-agent's code (float64) ----
def verl_build_step_group(anchor_obs, index, thresh):
    """Cluster label per row: greedy first match against each cluster's first observation."""
    labels = [None] * len(anchor_obs)
    next_label = 0
    for idx in sorted(set(index)):
        clusters = []  # [rep, label]
        for loc in [i for i in range(len(index)) if index[i] == idx]:
            obs = anchor_obs[loc]
            for rep, lab in clusters:
                if difflib.SequenceMatcher(None, obs, rep).ratio() >= thresh:
                    labels[loc] = lab
                    break
            else:
                clusters.append((obs, next_label))
                labels[loc] = next_label
                next_label += 1
    return labels


def _norm(values, keys, remove_std):
    """verl-agent's per-key normalisation: one member -> mean 0 (episode) handled by the caller."""
    out = []
    for v, k in zip(values, keys):
        members = [values[j] for j in range(len(values)) if keys[j] == k]
        mean = sum(members) / len(members)
        if remove_std:
            out.append(v - mean)
        else:
            std = np.std(members, ddof=1) if len(members) > 1 else 1.0
            out.append((v - mean) / (std + 1e-6))
    return out


def verl_gigpo(rewards, traj, index, anchor_obs, gamma, w, remove_std, thresh):
    """compute_gigpo_outcome_advantage on rows in batch order (one scalar per row)."""
    n = len(rewards)
    returns = [0.0] * n
    for t in set(traj):
        rows = [i for i in range(n) if traj[i] == t]
        running = 0.0
        for i in reversed(rows):
            running = rewards[i] + gamma * running
            returns[i] = running
    score = {t: sum(rewards[i] for i in range(n) if traj[i] == t) for t in set(traj)}
    # Episode level over the task group's rows, each with its trajectory's score.
    episode = _norm([score[traj[i]] for i in range(n)], index, remove_std)
    labels = verl_build_step_group(anchor_obs, index, thresh)
    step = _norm(returns, labels, remove_std)
    return np.array([episode[i] + w * step[i] for i in range(n)]), labels


# ---- verl-agent-shaped batches ----
def _observation(rng, near_duplicates):
    text = OBS[rng.integers(len(OBS))]
    if near_duplicates and rng.random() < 0.5:
        # One changed object number (ratio ~0.98-0.99) or an appended sentence (~0.84-0.97).
        text = text.replace("1", str(int(rng.integers(4, 7))), 1) if rng.random() < 0.5 else text + " Done."
    return text


def _batch(seed, near_duplicates, groups=3):
    rng = np.random.default_rng(seed)
    rows = {k: [] for k in ("group_id", "traj_id", "step", "reward", "obs")}
    for g in range(groups):
        for r in range(GROUP_SIZE):
            length = int(rng.integers(1, 9))
            won = rng.random() < 0.5
            for s in range(length):
                rows["group_id"].append(g)
                rows["traj_id"].append(g * GROUP_SIZE + r)
                rows["step"].append(s)
                rows["reward"].append(10.0 if won and s == length - 1 else 0.0)
                # The first observation of a task group is shared: the reset state.
                rows["obs"].append("You are in the middle of a room." if s == 0 else _observation(rng, near_duplicates))
    return rows


def _ours(rows, thresh, norm, gamma, omega):
    n = len(rows["reward"])
    obs_hash = similarity_groups(rows["obs"], np.asarray(rows["group_id"]), thresh)
    batch = StepBatch.from_numpy(
        group_id=np.asarray(rows["group_id"], np.int32),
        traj_id=np.asarray(rows["traj_id"], np.int32),
        step=np.asarray(rows["step"], np.int32),
        reward=np.asarray(rows["reward"], np.float32),
        obs_hash=obs_hash,
        fingerprint=np.zeros((n, 4), np.float32),
        action_key=np.zeros(n, np.int32),
        mask=np.ones(n, bool),
    )
    cfg = EstimatorConfig(
        name="gigpo", gamma=gamma, omega=omega, norm=norm, episode_stats="rows", similarity_thresh=thresh
    )
    adv, _ = compute_advantages(batch, cfg)
    return np.asarray(adv), obs_hash, np.asarray(step_group_labels(batch, cfg))


def _partition(labels):
    groups = {}
    for i, lab in enumerate(labels):
        groups.setdefault(int(lab), []).append(i)
    return sorted(groups.values())


@pytest.mark.slow
@pytest.mark.parametrize("near_duplicates", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gigpo_with_similarity_groups_matches_verl_agent_restatement(seed, near_duplicates):
    rows = _batch(seed, near_duplicates)
    exact_groups = len(set(zip(rows["group_id"], rows["obs"])))
    for thresh, norm, gamma, omega in ((0.95, "mean_std", 0.95, 1.0), (0.9, "mean", 0.5, 0.5)):
        adv, obs_hash, labels = _ours(rows, thresh, norm, gamma, omega)
        want, want_labels = verl_gigpo(
            rows["reward"], rows["traj_id"], rows["group_id"], rows["obs"], gamma, omega, norm == "mean", thresh
        )
        assert _partition(obs_hash) == _partition(want_labels)
        assert _partition(labels) == _partition(want_labels)
        np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-4)
        if near_duplicates:
            # Near-duplicates merge: fewer step groups than exact text gives.
            assert len(set(want_labels)) < exact_groups
        else:
            # Distinct texts here are far apart (ratio <= 0.54): similarity groups are the exact ones.
            assert len(set(want_labels)) == exact_groups
            exact_adv, _, _ = _ours(rows, 0.0, norm, gamma, omega)
            np.testing.assert_allclose(adv, exact_adv, rtol=0, atol=0)


def test_hand_computed_ratios_threshold_order_and_task_groups():
    # ratio("abcd", "abce") = 2 * 3 / 8 = 0.75: joins at 0.75 (>=), not at 0.76.
    assert similarity_groups(["abcd", "abce"], [0, 0], 0.75).tolist() == [0, 0]
    assert similarity_groups(["abcd", "abce"], [0, 0], 0.76).tolist() == [0, 1]
    # Against each cluster's FIRST text, so not transitive: "bcex" is 0.75 from "abce" but 2*2/8 = 0.5
    # from the cluster's first text "abcd", so it opens a cluster, which "bcey" (0.75) joins.
    assert similarity_groups(["abcd", "abce", "bcex", "bcey"], [0, 0, 0, 0], 0.7).tolist() == [0, 0, 1, 1]
    # First match wins, in creation order: "abcf" is 0.75 from both "abcd" and "xbcf" (0.5 apart).
    assert similarity_groups(["abcd", "xbcf", "abcf"], [0, 0, 0], 0.75).tolist() == [0, 1, 0]
    assert similarity_groups(["xbcf", "abcd", "abcf"], [0, 0, 0], 0.75).tolist() == [0, 1, 0]
    # Equal texts in different task groups never share a cluster (ids are numbered by first appearance).
    assert similarity_groups(["abcd", "abcd", "abce"], [0, 1, 1], 0.7).tolist() == [0, 1, 1]
    # threshold 0 is exact text, the rollout's old assign_ids.
    assert similarity_groups(["abcd", "abce", "abcd"], [0, 0, 0], 0.0).tolist() == [0, 1, 0]


def test_shortcuts_equal_the_plain_loop_on_random_strings():
    rng = np.random.default_rng(7)
    for trial in range(40):
        n = int(rng.integers(1, 60))
        # Short strings of a 3-letter alphabet: many quick_ratio passes, many ratio failures.
        texts = ["".join(rng.choice(list("abc"), int(rng.integers(0, 12)))) for _ in range(n)]
        groups = rng.integers(0, 3, n)
        thresh = float(rng.choice([0.3, 0.5, 0.7, 0.8, 0.95]))
        got = similarity_groups(texts, groups, thresh)
        want = verl_build_step_group(texts, groups.tolist(), thresh)
        assert _partition(got) == _partition(want), (trial, thresh)
        # Labels never cross task groups.
        assert all(len({int(groups[i]) for i in part}) == 1 for part in _partition(got))


@pytest.mark.parametrize(
    "args,match",
    [
        ((["a"], [0], 1.0), r"threshold must be in \[0, 1\)"),
        ((["a"], [0], -0.1), r"threshold must be in \[0, 1\)"),
        ((["a"], [0], float("nan")), "threshold must be a float"),
        ((["a"], [0], True), "threshold must be a float"),
        (([b"a"], [0], 0.5), r"observations\[0\] must be a str"),
        ((["a", "b"], [0], 0.5), "task_group_ids must be 1-D with 2 entries"),
        ((["a"], [0.5], 0.5), "task_group_ids must be integers"),
    ],
)
def test_similarity_groups_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        similarity_groups(*args)


def test_config_field_checks_and_plumbing():
    assert EstimatorConfig().similarity_thresh == 0.0
    with pytest.raises(ValueError, match="EstimatorConfig.similarity_thresh: expected 0"):
        EstimatorConfig(name="gigpo", similarity_thresh=1.0)
    with pytest.raises(ValueError, match="needs an estimator that groups by observation"):
        EstimatorConfig(name="bigpo", similarity_thresh=0.9)
    # omega: any finite float, as verl-agent's step_advantage_w.
    assert EstimatorConfig(name="gigpo", omega=-0.5).omega == -0.5
    with pytest.raises(ValueError, match="RolloutConfig.similarity_thresh"):
        RolloutConfig(similarity_thresh=1.5)
    c = base.get_config()
    c.estimator.name = "gigpo"
    c.estimator.similarity_thresh = 0.95
    assert estimator_config(c).similarity_thresh == 0.95
    assert rollout_config(c, group_size=8).similarity_thresh == 0.95
    c.estimator.similarity_thresh = 1.0
    with pytest.raises(ConfigError, match=r"config\.estimator\.similarity_thresh"):
        validate(c, abstract=True)


def test_a_similarity_run_records_the_fingerprint_clusters_beside_its_groups():
    """The trainer's cluster_* metrics of a GiGPO run on similarity groups: BiGPO's clusters at the same
    epsilon (similarity_thresh shapes obs_hash only; BiGPO refuses it, which crashed iteration 1)."""
    from bipace_jax.trainer import cluster_view

    rows = _batch(3, near_duplicates=True)
    n = len(rows["reward"])
    fp = np.random.default_rng(4).normal(size=(n, 4)).astype(np.float32)
    batch = StepBatch.from_numpy(
        group_id=np.asarray(rows["group_id"], np.int32),
        traj_id=np.asarray(rows["traj_id"], np.int32),
        step=np.asarray(rows["step"], np.int32),
        reward=np.asarray(rows["reward"], np.float32),
        obs_hash=similarity_groups(rows["obs"], np.asarray(rows["group_id"]), 0.9),
        fingerprint=fp / np.linalg.norm(fp, axis=1, keepdims=True),
        action_key=np.zeros(n, np.int32),
        mask=np.ones(n, bool),
    )
    view = cluster_view(EstimatorConfig(name="gigpo", epsilon=0.3, similarity_thresh=0.9))
    bigpo = EstimatorConfig(name="bigpo", epsilon=0.3)
    assert view == bigpo
    labels = np.asarray(step_group_labels(batch, view))
    assert 1 < len(set(labels.tolist())) < n  # real clusters: neither one group nor all singletons
    assert (
        compute_advantages(batch, view)[1]["singleton_group_rate"]
        == compute_advantages(batch, bigpo)[1]["singleton_group_rate"]
    )
