"""Sharded clustering (whole task groups over the data axis of 8 emulated CPU devices) equals one
device: identical partitions and advantages. Runs in a subprocess so that the device count is set
before JAX initialises."""

import textwrap

import pytest

from tests.devices import run_on_cpu_devices

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    assert jax.device_count() == 8, jax.devices()
    from bipace_jax.estimators import EstimatorConfig, StepBatch, compute_advantages, step_group_labels
    from bipace_jax.estimators.synthetic import random_step_arrays, rollout_like_arrays
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    batches = [StepBatch.from_numpy(**random_step_arrays(np.random.default_rng(s), num_rows=64, dim=8),
                                    group_capacity=4, row_capacity=24) for s in range(3)]
    batches.append(StepBatch.from_numpy(**rollout_like_arrays(11, group_size=4, steps=6, dim=32, seed=1)))
    checked = 0
    def canon(labels):  # the partition, as labels in order of first appearance (-1 kept)
      seen = {}
      return np.array([-1 if l < 0 else seen.setdefault(l, len(seen)) for l in np.asarray(labels).tolist()])
    for b in batches:
      for cfg in (EstimatorConfig(name="bipace_q", epsilon=0.1),
                  EstimatorConfig(name="bigpo", centroid="leader", epsilon=0.3, capacity=3)):
        adv, diag = compute_advantages(b, cfg)
        s_adv, s_diag = compute_advantages(b, cfg, mesh=mesh)
        np.testing.assert_array_equal(np.asarray(s_adv), np.asarray(adv))
        np.testing.assert_array_equal(canon(step_group_labels(b, cfg, mesh=mesh)),
                                      canon(step_group_labels(b, cfg)))
        for k in diag:
          assert float(diag[k]) == float(s_diag[k]), k
        checked += 1
    print("CHECKED", checked)
""")


@pytest.mark.slow
def test_sharded_over_eight_devices_equals_one_device():
    out = run_on_cpu_devices(SCRIPT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "CHECKED 8" in out.stdout
