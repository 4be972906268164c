"""Multi-host metrics pool from numerators and denominators (``stats.HostStats``,
``distributed.pooled``), never as means of per-host rates; checked on hand-made records, on the
estimator's diagnostics of a batch split over two hosts, and on a 2-process run against 1 process."""

import json
import textwrap

import numpy as np
import pytest

from bipace_jax import distributed
from bipace_jax.estimators import EstimatorConfig, StepBatch, compute_advantages
from bipace_jax.estimators.diagnostics import host_stats
from bipace_jax.estimators.synthetic import rollout_like_arrays
from bipace_jax.stats import HostStats
from tests.devices import run_processes


def test_rates_pool_from_summed_numerators_and_denominators():
    a = HostStats({"rows": 2.0}, {"invalid_rate": (1.0, 2.0), "success_rate": (0.0, 0.0)}, {"turns": 3.0})
    b = HostStats({"rows": 8.0}, {"invalid_rate": (0.0, 8.0), "success_rate": (3.0, 4.0)}, {"turns": 5.0})
    assert a.values() == {"rows": 2.0, "invalid_rate": 0.5, "success_rate": 0.0, "turns": 3.0}  # empty rate: 0.0
    pooled = HostStats.pool([a, b]).values()
    # 1 invalid row of 10, not the mean (0.5 + 0.0) / 2 of the hosts' rates
    assert pooled == {"rows": 10.0, "invalid_rate": 0.1, "success_rate": 0.75, "turns": 5.0}
    assert a.like(b.vector()) == b and distributed.pooled(a) == a.values()  # one process: its own values
    assert (a.prefixed("rollout/") | HostStats({"train/rows": 1.0})).keys() == [
        "rollout/invalid_rate",
        "rollout/rows",
        "rollout/success_rate",
        "rollout/turns",
        "train/rows",
    ]


def test_records_with_other_names_are_refused():
    a = HostStats({"rows": 2.0})
    with pytest.raises(ValueError, match=r"another host holds other names than \['rows'\]"):
        a.like(HostStats({"tokens": 2.0}).vector())
    with pytest.raises(ValueError, match=r"other names than \['rows'\]"):
        HostStats.pool([a, HostStats(rates={"rows": (1.0, 2.0)})])  # same name, another kind
    with pytest.raises(ValueError, match=r"more than one of counts/rates/maxima: \['rows'\]"):
        HostStats({"rows": 1.0}, {"rows": (1.0, 2.0)})
    with pytest.raises(ValueError, match=r"denominator >= 0"):
        HostStats(rates={"r": (1.0, -1.0)})
    with pytest.raises(ValueError, match=r"both records hold \['rows'\]"):
        a | a


def _diag(arrays, rows):
    part = {k: v[rows] for k, v in arrays.items()}
    part["group_id"] = part["group_id"] - part["group_id"].min()  # each host numbers its own task groups
    _, diag = compute_advantages(StepBatch.from_numpy(**part), EstimatorConfig(name="bipace_q", epsilon=0.05))
    return diag


@pytest.mark.slow
def test_estimator_diagnostics_of_two_hosts_pool_to_those_of_the_whole_batch():
    arrays = rollout_like_arrays(4, group_size=4, steps=6, dim=32, seed=1)
    whole = {k: float(v) for k, v in _diag(arrays, np.arange(len(arrays["group_id"]))).items()}
    # host 0 plays task group 0 (24 rows), host 1 groups 1-3 (72 rows): unequal shares
    hosts = [_diag(arrays, arrays["group_id"] == 0), _diag(arrays, arrays["group_id"] > 0)]
    per_host = [host_stats(d) for d in hosts]
    pooled = HostStats.pool(per_host).values()
    assert sorted(pooled) == sorted(whole)
    for k, v in whole.items():
        if k.endswith("p90_group_size"):  # not poolable from per-host statistics: the max of the hosts'
            assert pooled[k] == max(float(d[k]) for d in hosts) >= v - 1e-6, k
        else:
            assert pooled[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert 0 < whole["singleton_group_rate"] < 1 and whole["pace_row_rate"] > 0  # the rates say something
    # what the mean of the hosts' rates gave: (12/18 + 56/63) / 2 = 0.778, not 68/81 = 0.840
    assert whole["hash_singleton_group_rate"] == pytest.approx(68 / 81)
    mean_of_rates = np.mean([float(d["hash_singleton_group_rate"]) for d in hosts])
    assert mean_of_rates == pytest.approx((12 / 18 + 56 / 63) / 2)
    with pytest.raises(ValueError, match=r"no pooling rule for \['surprise'\]"):
        host_stats({**hosts[0], "surprise": 1.0})


RUN_SCRIPT = textwrap.dedent(r"""
    import dataclasses, json, sys
    from bipace_jax import distributed

    coord, nproc, pid, workdir, tokenizer, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]
    if nproc > 1:
        distributed.initialize(coord, nproc, pid)
    import configs.textcraft_tiny
    from bipace_jax import metric_keys
    from bipace_jax.sampling import Engine
    from bipace_jax.trainer import Trainer
    from tests.tiny_runs import use_tiny_actor

    c = configs.textcraft_tiny.get_config()
    use_tiny_actor(c)
    c.model.tokenizer = tokenizer
    c.rollout.num_groups, c.rollout.group_size, c.env.max_steps, c.env.num_workers = 4, 2, 3, 1
    c.sampler.max_new_tokens, c.sampler.batch_buckets = 16, (8, 16)
    c.val.num_tasks, c.val.num_holdout_tasks, c.val.seeds_per_goal = 3, 1, 1
    c.estimator.calibration.enabled = False  # each host would sweep its own rows
    c.estimator.epsilon = 0.002
    c.checkpoint.shared_workdir = True
    c.log.progress = False
    tr = Trainer(c, workdir)
    # greedy: every host plays exactly the games one process plays (the sampling keys differ per host)
    tr.engine = Engine(tr.tokenizer, dataclasses.replace(tr.engine.config, greedy=True), mesh=tr.local_mesh)
    rec = {metric_keys.before(k): v for k, v in tr.validate().items()}
    rec.update(tr.train_iteration())
    tr.close()
    if pid == 0:
        json.dump(rec, open(out, "w"))
""")

# Host-local by nature (wall seconds, this host's sweep) or differing by design (the host count).
NOT_POOLED = ("time/", "val_before/validation_s", "train/hosts", "loss/", "train/optimizer_steps")


@pytest.mark.slow
@pytest.mark.e2e
def test_two_processes_report_the_metrics_of_one_process_playing_the_same_games(tmp_path):
    one = tmp_path / "one.json"
    run_processes(RUN_SCRIPT, [["1", "0", str(tmp_path / "run1"), "", str(one)]], devices=2)
    tokenizer = str(tmp_path / "run1" / "tokenizer")  # a multi-host random init needs a saved tokenizer
    two = tmp_path / "two.json"
    args = [["2", str(p), str(tmp_path / "run2"), tokenizer, str(two)] for p in (0, 1)]
    run_processes(RUN_SCRIPT, args, devices=1)
    one, two = json.load(open(one)), json.load(open(two))
    assert two["train/hosts"] == 2 and one["train/hosts"] == 1
    # every row of both hosts: 4 task groups x 2 games, the batch the learner trained on
    assert two["rollout/rows"] == two["train/rows"] == one["train/rows"] > 8
    assert two["rollout/response_tokens"] == two["train/response_tokens"] == one["rollout/response_tokens"]
    assert two["train/episodes"] == 8 and two["val_before/tasks"] == 3
    compared = [k for k in one if not k.startswith(NOT_POOLED)]
    assert {k for k in two if not k.startswith(NOT_POOLED)} == set(compared)
    assert any(k.startswith("estimator/") for k in compared) and "rollout/finish_length_rate" in compared
    for k in compared:
        a, b = one[k], two[k]
        if isinstance(a, float) and isinstance(b, float):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-6), k
        else:
            assert b == a, k
