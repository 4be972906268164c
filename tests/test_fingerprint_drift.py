"""launch.fingerprint_drift: the sampler's fingerprint on a tiny random actor against a NumPy oracle,
the drift statistics and step-group membership changes against NumPy and the estimators' reference
oracle, the lab's drift units, and the command's one-line argument errors."""

import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bipace_jax.estimators import EstimatorConfig, StepBatch
from bipace_jax.estimators.reference import compute_advantages_reference
from bipace_jax.models import Qwen2Actor
from bipace_jax.models.config import Qwen2Config
from launch import fingerprint_drift as fd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _normalise(x):
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _prompts(rng, rows=5, width=12, vocab=64):
    """Left-padded int32 prompts of different lengths (row 0 full width) and their masks."""
    ids = rng.integers(1, vocab, (rows, width)).astype(np.int32)
    lengths = np.array([width, 3, 7, width - 1, 5][:rows])
    mask = (np.arange(width)[None, :] >= width - lengths[:, None]).astype(np.int32)
    return np.where(mask == 1, ids, 0), mask


def test_fingerprints_are_the_final_normed_state_at_the_last_prompt_token_and_a_rescaled_norm_drifts_as_numpy():
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    actor = Qwen2Actor(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids, mask = _prompts(rng)
    f_a = fd.prompt_fingerprints(actor, ids, mask, chunk=2)  # 5 rows in chunks of 2: the padded last chunk
    # NumPy oracle: the full forward's final normed hidden state at the last column (left padding), normalised
    hidden = np.asarray(actor(jnp.asarray(ids), jnp.asarray(mask), output_hidden_states=True).hidden_states[-1])
    np.testing.assert_allclose(f_a, _normalise(hidden[:, -1]), atol=2e-5)
    assert f_a.shape == (5, 32) and f_a.dtype == np.float32

    # A version that only rescales the final RMSNorm by r > 0 moves each fingerprint to normalise(f * r):
    # the hand-computable drift (a common scale of r leaves it unchanged).
    r = rng.uniform(0.5, 1.5, 32)
    actor.final_norm.scale[...] = jnp.asarray(r, jnp.float32)
    f_b = fd.prompt_fingerprints(actor, ids, mask, chunk=2)
    want_b = _normalise(f_a * r)
    np.testing.assert_allclose(f_b, want_b, atol=2e-5)
    want = 1.0 - np.sum(_normalise(f_a) * want_b, axis=1)
    np.testing.assert_allclose(fd.one_minus_cos(f_a, f_b), want, atol=5e-6)
    assert want.min() > 1e-3  # the perturbation really moves every fingerprint
    actor.final_norm.scale[...] = jnp.full((32,), 3.0, jnp.float32)
    np.testing.assert_allclose(fd.one_minus_cos(f_a, fd.prompt_fingerprints(actor, ids, mask, chunk=2)), 0, atol=1e-6)


def test_changed_rows_compares_sets_of_co_members_not_label_values():
    c = fd.changed_rows
    assert c([0, 0, 1, -1], [5, 5, 7, -1]).tolist() == [False] * 4
    assert c([0, 0, 1, 2], [0, 0, 1, 1]).tolist() == [False, False, True, True]
    assert c([0, 0, 1, 1], [0, 1, 1, 1]).tolist() == [True, True, True, True]
    assert c([0, 0, 1, 1], [3, 3, 3, 3]).tolist() == [True] * 4
    # task group by task group (no step group crosses one): the same answer
    assert c([0, 0, 1, 1], [0, 1, 2, 2], groups=[0, 0, 1, 1]).tolist() == [True, True, False, False]
    assert c([0, 0, 1, 1], [0, 1, 2, 2]).tolist() == [True, True, False, False]


def _batch(rng):
    """2 task groups x 4 games x 3 steps; fingerprints near 3 centres per group (spread ~0.002 in 1 - cos)
    and a version 1 that moves every fingerprint by a common direction (1 - cos ~0.01)."""
    groups, games, steps, d = 2, 4, 3, 16
    n = groups * games * steps
    group = np.repeat(np.arange(groups), games * steps)
    traj = np.repeat(np.arange(groups * games), steps)
    step = np.tile(np.arange(steps), groups * games)
    centres = _normalise(rng.standard_normal((groups, steps, d)))
    f0 = _normalise(centres[group, step] + 0.06 / math.sqrt(d) * rng.standard_normal((n, d)))
    f1 = _normalise(f0 + 0.15 * _normalise(rng.standard_normal(d)))
    batch = StepBatch.from_numpy(
        group_id=group,
        traj_id=traj,
        step=step,
        reward=(step == steps - 1) * (traj % 2).astype(np.float32),
        obs_hash=step,
        fingerprint=f0.astype(np.float32),
        action_key=np.zeros(n, np.int32),
    )
    return batch, n, f0.astype(np.float32), f1.astype(np.float32)


def _oracle_changed(batch, n, fa, fb, cfg):
    """Fraction of rows whose step group (reference oracle's frozensets) differs between fa and fb."""

    def groups(f):
        full = np.array(batch.fingerprint, np.float32)
        full[:n] = f
        _, _, gs = compute_advantages_reference(batch.replace(fingerprint=full), cfg, return_groups=True)
        return {i: g for g in gs for i in g}

    a, b = groups(fa), groups(fb)
    return np.mean([a.get(i, frozenset()) != b.get(i, frozenset()) for i in range(n)])


def test_drift_report_against_numpy_and_the_reference_clusters():
    rng = np.random.default_rng(3)
    batch, n, f0, f1 = _batch(rng)
    cfg = EstimatorConfig(name="bigpo", epsilon=0.004)
    prompts = np.arange(n)

    same = fd.drift_report({0: f0, 1: f0.copy()}, batch, n, prompts, {"bigpo": cfg}, splits=2, seed=0)
    assert same["lags"][1]["mean"] < 1e-12 and same["lags"][1]["p90"] < 1e-12
    assert same["lags"][1]["bigpo/mixed_changed"] == 0.0 and same["lags"][1]["bigpo/pure_changed"] == 0.0

    rep = fd.drift_report({0: f0, 1: f1}, batch, n, prompts, {"bigpo": cfg}, splits=1, seed=7)
    x = 1.0 - np.sum(_normalise(f0) * _normalise(f1), axis=1)
    s = rep["lags"][1]
    np.testing.assert_allclose([s["mean"], s["median"], s["p90"]], [x.mean(), np.median(x), np.percentile(x, 90)])
    assert s["mean"] > 2 * cfg.epsilon  # far enough to split every cross-version cluster
    # the same draw of the mix as the report (one pair, one estimator, one split)
    mixed, at_old = fd.mixed_fingerprints(f0, f1, np.asarray(batch.traj_id)[:n], np.random.default_rng(7))
    assert 0 < at_old.mean() < 1
    want_mixed = _oracle_changed(batch, n, f1, mixed, cfg)
    assert want_mixed > 0
    assert rep["pairs"][0]["bigpo"]["mixed_changed"] == pytest.approx(want_mixed)
    assert s["bigpo/pure_changed"] == pytest.approx(_oracle_changed(batch, n, f1, f0, cfg))
    # duplicate prompts count once: rows 0 and 1 one prompt
    dup = fd.drift_report({0: f0, 1: f1}, batch, n, np.r_[0, np.arange(n - 1)], {"bigpo": cfg}, splits=1, seed=7)
    assert dup["distinct_prompts"] == n - 1 and dup["lags"][1]["mean"] == pytest.approx(np.delete(x, 1).mean())
    with pytest.raises(ValueError, match="at least two versions"):
        fd.drift_report({0: f0}, batch, n, prompts, {"bigpo": cfg}, splits=1, seed=0)


def test_lab_units_invert_the_labs_drift_model():
    # LabView.drift: cos(e_0, e_l) = 1 / sqrt(1 + l d^2)
    assert fd.lab_one_minus_cos(0.5, 1) == pytest.approx(1 - 1 / math.sqrt(1.25))
    for d, lag in ((0.05, 1), (0.2, 3), (0.5, 4)):
        assert fd.lab_drift(fd.lab_one_minus_cos(d, lag), lag) == pytest.approx(d)
    assert fd.lab_drift(0.0, 2) == 0.0 and math.isnan(fd.lab_drift(1.5, 1))
    rep = {"lags": {2: {"mean": 1e-4}}}
    fd.add_lab_units(rep, epsilon=5e-4, lab_epsilon=0.05)
    s = rep["lags"][2]
    assert s["mean_over_epsilon"] == pytest.approx(0.2)
    assert s["lab_drift_at_lab_epsilon"] == pytest.approx(fd.lab_drift(0.01, 2))


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    (run / "config.json").write_text("{}")
    (run / "checkpoints" / "1").mkdir(parents=True)
    return run


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(run=""), "--run: expected a run folder"),
        (dict(run="MISSING"), "--run: 'MISSING' is not a run folder (no config.json)"),
        (dict(versions="0,x"), "--versions: expected comma-separated ints >= 0, got '0,x'"),
        (dict(versions="0,2"), "--versions: [2] are not checkpoints of"),
        (dict(versions="1"), "--versions: need at least two versions, got [1]"),
        (dict(batch_version=3), "--batch_version: expected one of the versions [0, 1], got 3"),
        (dict(splits=0), "--splits: expected an int >= 1, got 0"),
        (dict(epsilon=1.0), "--epsilon: expected 0 (the run's) or a float in (0, 1), got 1.0"),
        (dict(estimators="grpo"), "--estimators: expected clustering estimators among"),
    ],
)
def test_bad_arguments_name_the_flag(run_folder, kw, expected):
    args = dict(run=str(run_folder), versions="", batch_version=0, estimators="bigpo", splits=1, chunk=8, epsilon=0.0)
    args.update(kw)
    with pytest.raises(ValueError) as e:
        fd.check_args(**args)
    assert str(e.value).startswith(expected), e.value


def test_good_arguments_and_the_command_says_a_bad_one_in_one_line(run_folder):
    args = dict(run=str(run_folder), versions="", batch_version=0, estimators="bigpo, bipace_q", splits=1, chunk=8)
    assert fd.check_args(**args, epsilon=0.0) == ([0, 1], ["bigpo", "bipace_q"])
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "launch.fingerprint_drift", f"--run={run_folder}", "--batch_version=3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == "error: --batch_version: expected one of the versions [0, 1], got 3"


def test_an_out_that_is_a_file_is_one_line_before_the_model_loads(run_folder):
    # it raised FileExistsError from os.makedirs after the whole replay (40 s on the tiny run)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = run_folder / "config.json"
    cmd = [sys.executable, "-m", "launch.fingerprint_drift", f"--run={run_folder}", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and lines == [f"error: --out: expected a folder, got the file '{out}'"], proc.stderr


def test_the_labs_membership_change_is_zero_without_drift_and_grows_with_it():
    names = ["bigpo"]
    assert fd.lab_changed(0.0, 2, names, seeds=2) == {"bigpo": 0.0}  # nothing moves: the same partition
    small, large = (fd.lab_changed(d, 2, names, seeds=2)["bigpo"] for d in (0.05, 1.0))
    assert small == 0.0 and 0.3 < large < 1.0  # 1 - cos 0.0025 < epsilon 0.05 < 0.42
    assert math.isnan(fd.lab_matching_drift(1.0, 2, "bigpo", seeds=2))  # above the lab's plateau
    mid = fd.lab_changed(0.3, 2, names, seeds=2)["bigpo"]
    # on the rising part: the bisection finds the drift that first changes that many rows, 0.3 or just below
    assert 0.25 < fd.lab_matching_drift(mid, 2, "bigpo", seeds=2) <= 0.3 + 1e-3


def test_a_config_that_differs_from_the_runs_is_refused_naming_the_field(tmp_path):
    import json

    import configs.textcraft_tiny
    from bipace_jax.config import ConfigError

    c = configs.textcraft_tiny.get_config()
    theirs = json.loads(c.to_json_best_effort())
    (tmp_path / "config.json").write_text(json.dumps(dict(theirs, num_iterations=4)))
    fd.check_run_config(c, str(tmp_path))  # num_iterations does not shape the batch or its fingerprints
    theirs["rollout"]["max_prompt_length"] = 400
    (tmp_path / "config.json").write_text(json.dumps(theirs))
    with pytest.raises(ConfigError, match=r"config.rollout.max_prompt_length: the run .* has 400, --config gives 448"):
        fd.check_run_config(c, str(tmp_path))


def test_a_by_process_runs_overrides_replay_on_one_process():
    # launch/README: "--config and overrides as the run's"; a run of async_rl.sampler_processes=1 (2
    # processes) was refused on this one process: "sampler_processes must be < the run's 1 processes"
    import configs.textcraft_tiny
    from bipace_jax import build

    c = configs.textcraft_tiny.get_config()
    c.async_rl.sampler_processes, c.async_rl.max_staleness, c.env.num_workers = 1, 1, 0
    one = fd.one_process(c)
    assert (c.async_rl.sampler_processes, c.async_rl.max_staleness) == (1, 1)  # the caller's config is kept
    a = build.build_spec(one, num_devices=1).async_rl
    assert (a.sampler_processes, a.sampler_devices, a.max_staleness, a.by_process) == (0, 0, 0, False)
    assert one.env.num_workers == 0 and one.rollout.to_dict() == c.rollout.to_dict()  # the rest as given
