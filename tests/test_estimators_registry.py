"""The estimator registry: built-in names, lookup errors, and a toy estimator registered from here
is usable by `EstimatorConfig`, the jitted `compute_advantages` and the NumPy reference alike."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bipace_jax.estimators import EstimatorConfig, StepBatch, compute_advantages, reference, registry, step_group_labels
from bipace_jax.estimators.registry import EstimatorSpec, StepOutput

PAPER = ("grpo", "gigpo", "bigpo", "bipace_q", "bipace_diff")  # the paper's five, first among the built-ins
BUILTINS = tuple(spec.name for spec in registry.BUILTINS)


def _min_baseline_step(inputs):
    """Toy step level: A_step = R - min over the step group (a per-group constant baseline)."""
    assert inputs.action_key is None  # the toy does not declare uses_action_keys
    ids = jnp.where(inputs.include, inputs.labels, inputs.num_segments)
    low = jax.ops.segment_min(jnp.where(inputs.include, inputs.returns, jnp.inf), ids, inputs.num_segments)
    base = low[jnp.clip(inputs.labels, 0, inputs.num_segments - 1)]
    return StepOutput(jnp.where(inputs.include, inputs.returns - base, 0.0))


def _min_baseline_reference(returns, keys, norm, dtype):
    assert keys is None
    return StepOutput(np.asarray([r - min(returns) for r in returns], dtype))


@pytest.fixture(params=[registry.OBS_HASH, registry.CLUSTER])
def toy(request):
    spec = registry.register(
        EstimatorSpec("toy_min_baseline", request.param, _min_baseline_step, _min_baseline_reference)
    )
    yield spec
    registry.unregister(spec.name)


# One task group, observations A=0, B=1, C=2 (one-hot fingerprints, so clusters = observations):
#   traj 10: rewards [0, 1] obs [A, B]; traj 11: rewards [2] obs [A]; traj 12: rewards [0, 0, 3] obs [A, B, C]
# gamma 0.5: returns [0.5, 1], [2], [0.75, 1.5, 3]; group minima A 0.5, B 1, C 3.
SPEC = [(10, 0, 0.0, 0), (10, 1, 1.0, 1), (11, 0, 2.0, 0), (12, 0, 0.0, 0), (12, 1, 0.0, 1), (12, 2, 3.0, 2)]
A_STEP = np.array([0.0, 0.0, 1.5, 0.25, 0.5, 0.0])
A_EP_MEAN = np.array([-1.0, -1.0, 0.0, 1.0, 1.0, 1.0])  # episode returns 1, 2, 3 minus their mean


def _batch(pad=4):
    n = len(SPEC) + pad
    a = dict(
        group_id=np.full(n, 7, np.int32),
        traj_id=np.zeros(n, np.int32),
        step=np.zeros(n, np.int32),
        reward=np.full(n, np.nan, np.float32),
        obs_hash=np.zeros(n, np.int32),
        fingerprint=np.full((n, 8), np.nan, np.float32),
        action_key=np.zeros(n, np.int32),
        mask=np.zeros(n, bool),
    )
    for i, (t, s, r, o) in enumerate(SPEC):
        a["traj_id"][i], a["step"][i], a["reward"][i], a["obs_hash"][i] = t, s, r, o
        a["fingerprint"][i] = np.eye(8, dtype=np.float32)[o]
        a["mask"][i] = True
    return StepBatch.from_numpy(**a)


def test_builtin_names_start_with_the_papers_five_estimators_in_order():
    assert registry.names() == BUILTINS and BUILTINS[:5] == PAPER
    assert [registry.get(n).grouping for n in PAPER] == ["none", "obs_hash", "cluster", "cluster", "cluster"]
    assert [registry.get(n).uses_action_keys for n in PAPER] == [False, False, False, True, True]
    assert [EstimatorConfig(name=n).clusters for n in PAPER] == [False, False, True, True, True]


def test_unknown_names_raise_naming_the_registered_estimators():
    with pytest.raises(ValueError, match=r"unknown estimator 'ppo'; registered: grpo, gigpo, bigpo, bipace_q"):
        registry.get("ppo")
    with pytest.raises(ValueError, match=r"EstimatorConfig.name: expected one of .*'bipace_diff'.*got 'ppo'"):
        EstimatorConfig(name="ppo")
    with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
        registry.unregister("ppo")


def test_duplicate_and_malformed_specs_are_rejected():
    with pytest.raises(ValueError, match="'gigpo' is already registered"):
        registry.register(registry.get("gigpo"))
    with pytest.raises(TypeError, match="expected an EstimatorSpec"):
        registry.register("gigpo")
    with pytest.raises(ValueError, match="EstimatorSpec.grouping"):
        EstimatorSpec("toy", "by_colour", _min_baseline_step, _min_baseline_reference)
    with pytest.raises(ValueError, match="EstimatorSpec.step_advantage"):
        EstimatorSpec("toy", registry.OBS_HASH, None, _min_baseline_reference)
    with pytest.raises(ValueError, match="EstimatorSpec.name"):
        EstimatorSpec("not a name", registry.OBS_HASH, _min_baseline_step, _min_baseline_reference)
    assert registry.names() == BUILTINS


@pytest.mark.slow
def test_a_registered_toy_estimator_runs_jitted_and_in_the_reference(toy):
    assert registry.names() == (*BUILTINS, toy.name)
    cfg = EstimatorConfig(name=toy.name, gamma=0.5, norm="mean", omega=2.0)
    assert cfg.spec is toy and cfg.clusters == (toy.grouping == registry.CLUSTER)
    batch = _batch()
    adv, diag = compute_advantages(batch, cfg)
    adv = np.asarray(adv)
    np.testing.assert_allclose(adv[:6], A_EP_MEAN + 2.0 * A_STEP, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(adv[6:], 0.0)
    assert int(diag["num_step_groups"]) == 3 and int(diag["max_group_size"]) == 3
    assert float(diag["pace_row_rate"]) == 0.0 and float(diag["loo_row_rate"]) == 0.0
    labels = np.asarray(step_group_labels(batch, cfg))
    assert labels[0] == labels[2] == labels[3] != labels[1] == labels[4] != labels[5]

    ref_adv, ref_diag, ref_groups = reference.compute_advantages_reference(batch, cfg, return_groups=True)
    np.testing.assert_allclose(ref_adv[:6], A_EP_MEAN + 2.0 * A_STEP, rtol=0, atol=1e-6)
    np.testing.assert_allclose(adv, ref_adv, rtol=0, atol=1e-6)
    assert sorted(sorted(g) for g in ref_groups) == [[0, 2, 3], [1, 4], [5]]
    for k, v in ref_diag.items():
        assert float(diag[k]) == pytest.approx(float(v)), k


def test_unregistering_the_toy_makes_its_name_unknown_again(toy):
    registry.unregister(toy.name)
    assert registry.names() == BUILTINS
    with pytest.raises(ValueError, match="EstimatorConfig.name"):
        EstimatorConfig(name=toy.name)
    registry.register(toy)  # the fixture unregisters it


@pytest.mark.e2e
def test_a_registered_toy_estimator_trains_one_rl_iteration(tmp_path, toy):
    """Adding an estimator is its module plus one registry line: the trainer accepts the name from the
    config, uses its advantages (checked against the NumPy oracle of the same spec) and updates."""
    from bipace_jax.build import estimator_config
    from bipace_jax.tiny import build_game_tokenizer
    from bipace_jax.trainer import Trainer
    from tests.tiny_runs import one_iteration_config, recorded_iteration

    c = one_iteration_config(group_size=2, max_steps=3, batch_buckets=(4, 8))
    c.estimator.name, c.estimator.controller.enabled = toy.name, False
    tokenizer = build_game_tokenizer(c, str(tmp_path / "tok"), num_tasks=8)
    tr = Trainer(c, str(tmp_path / "run"), tokenizer=tokenizer)
    rec, res, batch, updated = recorded_iteration(tr)
    want, _ = reference.compute_advantages_reference(res.steps, estimator_config(c, tr.epsilon))
    np.testing.assert_allclose(batch.advantages, want[: res.num_rows], rtol=1e-5, atol=1e-5)
    assert tr.iteration == 1 and rec["loss/updates"] == 1 and rec["train/rows"] == res.num_rows
    # both partitions are recorded whichever one trains: exact hashing and the clusters at this epsilon
    bigpo = dataclasses.replace(estimator_config(c, tr.epsilon), name="bigpo")
    _, hash_diag = reference.compute_advantages_reference(res.steps, estimator_config(c, tr.epsilon))
    _, cluster_diag = reference.compute_advantages_reference(res.steps, bigpo)
    for k in ("singleton_group_rate", "pairs", "num_step_groups"):
        assert rec[f"estimator/hash_{k}"] == pytest.approx(float(hash_diag[f"hash_{k}"]))
        assert rec[f"estimator/cluster_{k}"] == pytest.approx(float(cluster_diag[k]))
    assert updated
