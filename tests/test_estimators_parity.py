"""Jitted estimators vs the NumPy oracle on thousands of random padded batches (hypothesis).

Every batch has the same padded shapes (N=64, D=8, 4 task-group slots, 24 rows per group), so each
estimator config compiles once. Batches have random group sizes, trajectory lengths, padding rows
anywhere holding garbage (NaN rewards and fingerprints, ids colliding with real rows), duplicate,
zero and NaN fingerprints, exact ties (fingerprints whose float32 arithmetic is exact), and
unparsable action keys. The protocol options ("Protocol options") are checked on the same batches
with a random `penalty` field, every valid option combination for every built-in estimator (each
combination under one `norm`, both norms for every option value).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bipace_jax.estimators import (
    EstimatorConfig,
    StepBatch,
    clustering,
    compute_advantages,
    reference,
    registry,
    step_group_labels,
)
from bipace_jax.estimators.config import EPISODE_STATS, NORMS, PACE_FALLBACKS, PENALTIES, STEP_NORMS
from bipace_jax.estimators.core import jitted_advantages
from bipace_jax.estimators.synthetic import random_step_arrays

pytestmark = pytest.mark.parity

N, D, GROUPS, ROWS = 64, 8, 4, 24
EPSILONS = (0.0, 0.02, 0.1, 0.3, 0.6)
GAMMAS = (0.0, 0.5, 0.95, 1.0)
SETTINGS = settings(
    max_examples=int(os.environ.get("EST_EXAMPLES", 400)),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
_KERNEL = jax.jit(clustering.greedy_cosine_clusters, static_argnames=("capacity", "centroid", "block", "chunk"))
_SCALES = jax.jit(clustering.row_scales)
# (norm, centroid, capacity): two compiled variants per clustering estimator.
CLUSTER_VARIANTS = {
    "bigpo": (("mean_std", "mean", None), ("mean", "leader", 3)),
    "bipace_q": (("mean", "mean", None), ("mean_std", "leader", 3)),
    "bipace_diff": (("mean_std", "mean", 3), ("mean", "leader", None)),
}


def _batch(seed, penalty=False):
    arrays = random_step_arrays(np.random.default_rng(seed), num_rows=N, dim=D, max_groups=GROUPS, penalty=penalty)
    return StepBatch.from_numpy(**arrays, group_capacity=GROUPS, row_capacity=ROWS)


def _partition(labels):
    groups = {}
    for i, lab in enumerate(np.asarray(labels)):
        if lab >= 0:
            groups.setdefault(int(lab), set()).add(i)
    return sorted(sorted(s) for s in groups.values())


# XLA's LLVM optimisation level changes no HLO (the estimator's arithmetic) but roughly halves each
# config's compile (bipace_q: 4.5 -> 2.6 s); every batch has the same shapes, so one program per config.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_COMPILED = {}


def _estimate(batch, cfg):
    """(advantages, diagnostics, step-group labels) of `compute_advantages`'s own jitted program
    (`jitted_advantages`: same function, same traced scalars), compiled once per config and batch layout."""
    fn, scalars = jitted_advantages(cfg)
    key = (fn, jax.tree.structure(batch), tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch)))
    if key not in _COMPILED:
        _COMPILED[key] = fn.lower(batch, *scalars).compile(compiler_options=FAST_COMPILE)
    adv, diag, labels, _ = _COMPILED[key](batch, *scalars)
    return adv, diag, labels


def _kernel(*args, **static):
    """`_KERNEL(*args, **static)`, compiled once per static arguments (every call has the same shapes)."""
    key = ("kernel", *sorted(static.items()))
    if key not in _COMPILED:
        _COMPILED[key] = _KERNEL.lower(*args, **static).compile(compiler_options=FAST_COMPILE)
    return _COMPILED[key](*args)


def _check(batch, cfg):
    adv, diag, labels = _estimate(batch, cfg)
    ref_adv, ref_diag, ref_groups = reference.compute_advantages_reference(batch, cfg, return_groups=True)
    assert _partition(labels) == sorted(sorted(s) for s in ref_groups)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-4, atol=1e-4)
    assert not np.isnan(np.asarray(adv)).any()
    assert set(diag) == set(ref_diag)
    for k, v in ref_diag.items():
        np.testing.assert_allclose(float(diag[k]), float(v), rtol=1e-5, atol=1e-6, err_msg=k)


def test_the_checked_program_is_what_compute_advantages_and_step_group_labels_run():
    batch, cfg = _batch(0, penalty=True), EstimatorConfig(name="gigpo", penalty="own_row", episode_stats="rows")
    adv, diag, labels = _estimate(batch, cfg)
    want_adv, want_diag = compute_advantages(batch, cfg)
    np.testing.assert_allclose(np.asarray(adv), np.asarray(want_adv), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(labels), np.asarray(step_group_labels(batch, cfg)))
    assert set(diag) == set(want_diag)
    for k, v in want_diag.items():
        np.testing.assert_allclose(float(diag[k]), float(v), rtol=1e-6, atol=1e-6, err_msg=k)


common = dict(seed=st.integers(0, 2**32 - 1), gamma=st.sampled_from(GAMMAS), omega=st.sampled_from((1.0, 0.5)))


@pytest.mark.slow
@SETTINGS
@given(norm=st.sampled_from(("mean_std", "mean")), **common)
def test_grpo_matches_oracle_on_random_batches(seed, gamma, omega, norm):
    _check(_batch(seed), EstimatorConfig(name="grpo", gamma=gamma, omega=omega, norm=norm))


@pytest.mark.slow
@SETTINGS
@given(norm=st.sampled_from(("mean_std", "mean")), **common)
def test_gigpo_matches_oracle_on_random_batches(seed, gamma, omega, norm):
    _check(_batch(seed), EstimatorConfig(name="gigpo", gamma=gamma, omega=omega, norm=norm))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bigpo", "bipace_q", "bipace_diff"])
@SETTINGS
@given(variant=st.sampled_from((0, 1)), epsilon=st.sampled_from(EPSILONS), **common)
def test_clustering_estimators_match_oracle_partitions_advantages_and_diagnostics(
    name, seed, gamma, omega, variant, epsilon
):
    norm, centroid, capacity = CLUSTER_VARIANTS[name][variant]
    cfg = EstimatorConfig(
        name=name, gamma=gamma, omega=omega, norm=norm, epsilon=epsilon, centroid=centroid, capacity=capacity
    )
    _check(_batch(seed), cfg)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("EST_EXAMPLES", 500)), deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    epsilon=st.sampled_from(EPSILONS),
    centroid=st.sampled_from(("mean", "leader")),
    capacity=st.sampled_from((24, 3)),
)
def test_kernel_blocks_and_chunks_give_the_oracle_greedy_clusters(seed, epsilon, centroid, capacity):
    """Small blocks (4 rows) and chunks (8 slots) exercise the cross-block bookkeeping."""
    rng = np.random.default_rng(seed)
    g, r = 3, 24
    kind = rng.choice(["palette", "gaussian"])
    if kind == "palette":
        pal = np.zeros((int(rng.integers(1, 12)), D), np.float32)
        for i in range(len(pal)):
            idx = rng.choice(D, 1 if rng.random() < 0.5 else 4, replace=False)
            pal[i, idx] = rng.choice([-1.0, 1.0], len(idx))
        fp = pal[rng.integers(0, len(pal), (g, r))]
    else:
        fp = rng.standard_normal((g, r, D)).astype(np.float32)
        fp[:, 1::3] = fp[:, 0:-1:3]
    fp[rng.random((g, r)) < 0.05] = 0.0
    present = rng.random((g, r)) < 0.9
    max_abs, nrm, degenerate = _SCALES(jnp.asarray(fp.reshape(g * r, D)))
    shape = (g, r)
    degenerate = degenerate.reshape(shape)
    ok = jnp.asarray(present) & ~degenerate
    slot, over = _kernel(
        jnp.asarray(fp.reshape(g * r, D)),
        jnp.arange(g * r).reshape(shape),
        max_abs.reshape(shape),
        nrm.reshape(shape),
        ok,
        clustering.join_threshold(epsilon),
        capacity=capacity,
        centroid=centroid,
        block=4,
        chunk=8,
    )
    slot, over = np.asarray(slot), np.asarray(over)
    for gi in range(g):
        rows = [i for i in range(r) if present[gi, i]]
        assign, deg, ovf = reference.greedy_clusters([fp[gi, i] for i in rows], epsilon, centroid, capacity, np.float32)
        for i, a, d, o in zip(rows, assign, deg, ovf):
            assert slot[gi, i] == (-1 if a is None else a)
            assert bool(over[gi, i]) == o
            assert bool(degenerate[gi, i]) == d


# Every valid (penalty, episode_stats, step_norm, pace_fallback); own_row needs episode_stats="rows".
PROTOCOLS = [
    (p, e, s, f)
    for p in PENALTIES
    for e in EPISODE_STATS
    for s in STEP_NORMS
    for f in PACE_FALLBACKS
    if not (p == "own_row" and e == "trajectory")
]
OPTIONS = (PENALTIES, EPISODE_STATS, STEP_NORMS, PACE_FALLBACKS)
# step_norm and pace_fallback only reach the PACE step levels: the others see each (penalty, episode_stats) once.
# norm is static (one compile each), so each case gets one: the parity of the estimator's and the options'
# indices, which gives every estimator, and every option value of it, both norms across its cases.
PROTOCOL_CASES = [
    (name, protocol, NORMS[(k + sum(opts.index(v) for opts, v in zip(OPTIONS, protocol))) % 2])
    for k, name in enumerate(registry.names()[:5])
    for protocol in PROTOCOLS
    if registry.get(name).uses_pace_options or protocol[2:] == (STEP_NORMS[0], PACE_FALLBACKS[0])
]


@pytest.mark.slow
@pytest.mark.parametrize("name,protocol,norm", PROTOCOL_CASES)
@settings(
    max_examples=max(1, int(os.environ.get("EST_EXAMPLES", 400)) // 50),  # 8 per case: 33 cases
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(epsilon=st.sampled_from(EPSILONS), **common)
def test_protocol_options_match_oracle_on_random_batches(name, protocol, norm, seed, gamma, omega, epsilon):
    penalty, episode_stats, step_norm, pace_fallback = protocol
    cfg = EstimatorConfig(
        name=name,
        gamma=gamma,
        omega=omega,
        norm=norm,
        epsilon=epsilon,
        penalty=penalty,
        episode_stats=episode_stats,
        step_norm=step_norm,
        pace_fallback=pace_fallback,
    )
    _check(_batch(seed, penalty=True), cfg)
