"""One global PPO protocol: ``ppo.mini_batch_rows`` counts rows over all hosts, and the optimizer steps
and their rows do not depend on how many processes hold the rows (``ppo.mini_batches``)."""

import json
import os
import textwrap

import jax
import numpy as np
import pytest

from bipace_jax.batch import TokenBatch
from bipace_jax.ppo import mini_batches, plan_micro_batches
from tests.devices import run_processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _global_minis(counts, mini, key):
    """Each mini-batch as sorted global row ids, gathered from every process's local answer."""
    first = np.concatenate([[0], np.cumsum(counts)])
    per = [mini_batches(np.array(counts), p, mini, key) for p in range(len(counts))]
    return [sorted(int(first[p] + r) for p in range(len(counts)) for r in per[p][j]) for j in range(len(per[0]))]


@pytest.mark.parametrize("split", [[10, 0], [4, 6], [3, 3, 4], [1, 8, 1]])
def test_mini_batches_are_the_same_rows_whatever_the_process_count(split):
    key = jax.random.PRNGKey(3)
    one = _global_minis([10], 4, key)
    assert len(one) == 3  # ceil(10 / 4) optimizer steps
    assert sorted(len(m) for m in one) == [3, 3, 4]  # floor / ceil of 10 / 3, never over 4
    assert sorted(r for m in one for r in m) == list(range(10))  # every row once
    assert _global_minis(split, 4, key) == one
    assert _global_minis([10], 4, jax.random.PRNGKey(4)) != one  # the key shuffles


def test_each_process_gets_its_share_of_every_mini_batch():
    # 3 steps over 4 hosts x 30 rows: every run of 3 global rows gives one to each step, so a host
    # holds 10 rows of every step (its 30 rows are 10 whole runs).
    counts = np.array([30, 30, 30, 30])
    minis = [mini_batches(counts, p, 40, jax.random.PRNGKey(0)) for p in range(4)]
    assert [[len(m) for m in per] for per in minis] == [[10, 10, 10]] * 4
    (all_rows,) = mini_batches(np.array([7]), 0, 0, jax.random.PRNGKey(0))  # 0: one step of all rows
    assert all_rows.tolist() == list(range(7))


def test_micro_batch_plan_orders_by_prompt_length_and_cuts_to_the_bucket():
    plen = np.array([9, 2, 5, 3, 1, 8])
    (plan,) = plan_micro_batches([np.arange(6)], plen, 2, lambda need: 4 if need <= 4 else 10, across_processes=False)
    assert [(r.tolist(), w) for r, w in plan] == [([4, 1], 4), ([3, 2], 10), ([5, 0], 10)]
    two = plan_micro_batches([np.array([0, 2]), np.array([], np.int64)], plen, 4, int, across_processes=False)
    assert [[(r.tolist(), w) for r, w in g] for g in two] == [[([2, 0], 9)], [([], 1)]]  # empty: one padding micro


def test_token_batch_with_checks_fields_and_shapes():
    b = TokenBatch(np.zeros((3, 5), np.int32), np.ones((3, 5), np.int32), np.zeros((3, 2), np.int32),
                   np.ones((3, 2), bool), 3)  # fmt: skip
    c = b.with_(advantages=[1, 2, 3])
    assert c.advantages.dtype == np.float32 and b.advantages is None
    with pytest.raises(ValueError, match=r"old_logprobs must have shape \(3, 2\), got \(3, 3\)"):
        b.with_(old_logprobs=np.zeros((3, 3)))
    with pytest.raises(TypeError, match="unknown fields .'returns'."):
        b.with_(returns=np.zeros(3))
    mb = c.take(np.array([2, 0]), 2, 3)
    assert mb.input_ids.shape == (3, 4) and mb.advantages.tolist() == [3.0, 1.0, 0.0] and mb.old_logprobs is None


SCRIPT = textwrap.dedent(r"""
    import json, sys
    import jax
    from bipace_jax import distributed

    coord, nproc, pid, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pack = sys.argv[5] == "pack"
    if nproc > 1:
        distributed.initialize(coord, nproc, pid)
    import numpy as np, optax
    from flax import nnx
    from bipace_jax import losses, sharding
    from bipace_jax.batch import TokenBatch
    from bipace_jax.models import Qwen2Actor
    from bipace_jax.ppo import PPOLearner
    from tests.qwen_fixtures import one_layer_config, random_token_batch

    V, n, p, m = 48, 12, 7, 5
    rng = np.random.default_rng(0)
    full = random_token_batch(rng, n, p, m, V)
    adv = rng.normal(size=n).astype(np.float32)
    # the same 12 global rows: all on one process, or 5 on process 0 and 7 on process 1
    rows = np.arange(n) if nproc == 1 else (np.arange(5) if pid == 0 else np.arange(5, n))
    mine = TokenBatch(full.input_ids[rows], full.attention_mask[rows], full.response_ids[rows], full.response_mask[rows], p)

    cfg = one_layer_config(V)
    mesh = sharding.make_mesh(1, 2, 1)  # 2 devices: both on one process, or one per process
    L = PPOLearner(Qwen2Actor(cfg, rngs=nnx.Rngs(1)), mesh, losses.PPOLossConfig(kl_coef=0.01), optax.sgd(0.5),
                   micro_batch_rows=4 // nproc,  # per host: the gradient program's global batch is 4 either way
                   mini_batch_rows=5, epochs=2, pack=pack, pack_width=16, pack_response_width=8)
    before = [np.asarray(x) for x in jax.tree.leaves(distributed.local_copy(L.params))]
    old = L.logprobs(L.params_local, mine) - 0.05
    ref = L.logprobs(L.ref_params_local, mine)
    stats = L.update(mine.with_(old_logprobs=old, ref_logprobs=ref, advantages=adv[rows]), jax.random.PRNGKey(7))
    after = [np.asarray(x) for x in jax.tree.leaves(distributed.local_copy(L.params))]
    json.dump(dict(stats=stats, before=[x.tolist() for x in before], after=[x.tolist() for x in after]),
              open(out_path, "w"))
""")


def _spawn(nproc, tmp_path, pack=False):
    outs = [str(tmp_path / f"n{nproc}_p{pid}_{pack}.json") for pid in range(nproc)]
    arm = "pack" if pack else "rows"
    run_processes(SCRIPT, [[str(nproc), str(pid), outs[pid], arm] for pid in range(nproc)], devices=2 // nproc)
    return [json.load(open(o)) for o in outs]


@pytest.mark.slow
def test_one_and_two_processes_make_the_same_optimizer_steps_from_the_same_rows(tmp_path):
    (one,) = _spawn(1, tmp_path)
    two = _spawn(2, tmp_path)
    # 12 global rows, mini_batch_rows 5: ceil(12 / 5) = 3 optimizer steps per epoch, 2 epochs
    assert one["stats"]["loss/updates"] == 6
    for r in two:
        assert r["stats"]["loss/updates"] == 6
        for k, v in one["stats"].items():
            assert r["stats"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        for a, b in zip(one["after"], r["after"]):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(one["after"], one["before"]))
    assert moved > 1e-3  # the update is not a no-op that any split would reproduce


@pytest.mark.slow
def test_packed_updates_agree_over_process_counts_and_with_unpacked_rows(tmp_path):
    # each process packs its own rows (lines of 16 tokens, 8 response slots), micro-batch counts agreed
    (plain,) = _spawn(1, tmp_path)
    (one,) = _spawn(1, tmp_path, pack=True)
    two = _spawn(2, tmp_path, pack=True)
    for r in (one, *two):
        assert r["stats"]["loss/updates"] == 6
        for k, v in plain["stats"].items():
            assert r["stats"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        for a, b in zip(plain["after"], r["after"]):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5)
