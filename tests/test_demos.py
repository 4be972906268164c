"""The demonstrations dataset (`bipace_jax.demos`) and its resumable grain stream (`bipace_jax.demo_stream`).

A tiny TextCraft build (16 goals x 2 seeds, 1 in 4 to validation) checks the schema against the oracle's
own episodes, the split by task and the no-op rebuild; the stream checks: 2 shards are disjoint and
cover the split, batches keep one bucket's shape, and a reader SIGKILLed mid-epoch resumes from its
orbax checkpoint on exactly the next records (compared with an uninterrupted read).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest

from bipace_jax import demo_stream, demos

TASKS = ",".join(map(str, range(16)))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("demos"))
    cfg = demos.demos_config("textcraft", tasks=TASKS, holdout_every=4, seeds=2, max_steps=30)
    return d, cfg, demos.build(cfg, d, progress=False)


def test_records_are_the_oracles_episodes_and_splits_are_by_task(built):
    import environments
    from bipace_jax.tiny import oracle_steps

    _, _, b = built
    train, val = demos.read_split(b, "train"), demos.read_split(b, "validation")
    tr = {int(r["task_id"]) for r in train}
    va = {int(r["task_id"]) for r in val}
    assert va == {3, 7, 11, 15} and tr == set(range(16)) - va
    env = environments.make("textcraft", max_steps=30)
    want = {
        (s.task_id, s.seed, s.step): s for s in oracle_steps(env, [(t, k) for k in range(2) for t in sorted(tr)], 30)
    }
    got = {(int(r["task_id"]), int(r["seed"]), int(r["turn"])): r for r in train}
    assert got.keys() == want.keys() and len(train) == len(want)
    for key, r in list(got.items())[:40]:
        s = want[key]
        assert r["action"].decode() == s.action
        assert r["response"].decode() == f"<action>{s.action}</action>"
        assert demos.observation_of(r) == s.obs
        assert demos.history_of(r) == list(s.history)
    assert all(bool(r["won"]) for r in train)  # the TextCraft planner wins every goal within 30 steps
    assert b.info.metadata["builder"] == demos.VERSION and "textcraft==" in b.info.metadata["oracle"]


def test_rebuild_is_a_noop_and_a_bad_split_is_named(built):
    d, cfg, b = built
    files = sorted(os.listdir(b.data_dir))
    mtimes = [os.path.getmtime(os.path.join(b.data_dir, f)) for f in files]
    demos.build(cfg, d, progress=False)
    assert [os.path.getmtime(os.path.join(b.data_dir, f)) for f in files] == mtimes
    with pytest.raises(ValueError, match="split must be one of"):
        demos.read_split(b, "test")


def _stream(source, shard, seed=0, batch=4):
    lengths = {i: 3 + (i * 7) % 20 for i in range(len(source))}
    return demo_stream.BucketStream(source, lambda i: i, lambda i: lengths[i], batch, (8, 16, 24), seed, shard)


def test_two_shards_are_disjoint_and_cover_the_records_and_batches_keep_their_bucket():
    source = list(range(50))
    seen = []
    for k in range(2):
        s = _stream(source, grain.sharding.ShardOptions(k, 2, drop_remainder=True))
        assert len(s.indices) == 25
        seen.append(set(s.indices))
        for bucket, items in (next(s) for _ in range(30)):
            assert len(items) == 4 and all(
                min(b for b in (8, 16, 24) if b >= 3 + (i * 7) % 20) == bucket for i in items
            )
            assert set(items) <= seen[k]
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(source)


def test_an_epoch_reads_every_record_once_and_the_next_epoch_reshuffles():
    s = demo_stream.BucketStream(list(range(12)), lambda i: i, lambda i: 1, 3, (8,), 5, grain.sharding.NoSharding())
    e1 = [i for _ in range(4) for i in next(s)[1]]
    e2 = [i for _ in range(4) for i in next(s)[1]]
    assert sorted(e1) == sorted(e2) == list(range(12)) and e1 != e2


def test_restored_state_continues_exactly():
    source = list(range(40))
    a = _stream(source, grain.sharding.NoSharding(), seed=3)
    for _ in range(7):
        next(a)
    state = json.loads(json.dumps(a.get_state()))
    b = _stream(source, grain.sharding.NoSharding(), seed=3)
    b.set_state(state)
    assert [next(a) for _ in range(20)] == [next(b) for _ in range(20)]


READER = textwrap.dedent(
    """
    import json, os, sys
    import grain, jax, jax.numpy as jnp
    from bipace_jax import demo_stream, demos
    from bipace_jax.checkpointing import Checkpointer
    data_dir, cfg_json, work, n_steps, log = sys.argv[1:6]
    b = demos.DemosBuilder(config=demos.demos_config(**json.loads(cfg_json)), data_dir=data_dir)
    src = demos.read_split(b, "train")
    key = lambda r: [int(r["task_id"]), int(r["seed"]), int(r["turn"])]
    s = demo_stream.BucketStream(src, key, lambda k: 8 + 4 * (k[2] % 3), 4, (10, 12, 16), 7,
                                 grain.sharding.NoSharding())
    ck, params = Checkpointer(work), {"w": jnp.zeros(2)}
    step = 0
    got = ck.restore_latest(params, params)
    if got is not None:
        step = got[0] + 1
        s.set_state(got[1][3]["data_stream"])
    with open(log, "a") as f:
        while step < int(n_steps):
            _, items = next(s)
            f.write(json.dumps([step, items]) + "\\n"); f.flush()
            ck.save(step, params, params, jax.random.key(0), {"data_stream": s.get_state()})
            if os.environ.get("KILL_AT") == str(step):
                os.kill(os.getpid(), 9)
            step += 1
    ck.close()
    """
)


@pytest.mark.slow
def test_reader_killed_mid_epoch_resumes_on_the_next_records(built, tmp_path):
    d, cfg, b = built
    n = len(demos.read_split(b, "train"))
    steps = n // 4 // 2 + 3  # stops and resumes well inside the first epoch
    cfg_json = json.dumps({"game": "textcraft", "tasks": TASKS, "holdout_every": 4, "seeds": 2, "max_steps": 30})
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")

    def run(work, log, kill=None):
        e = dict(env, KILL_AT=str(kill)) if kill is not None else env
        args = [sys.executable, "-c", READER, d, cfg_json, str(work), str(steps), str(log)]
        return subprocess.run(args, env=e, capture_output=True, text=True, timeout=300)

    whole = run(tmp_path / "w1", tmp_path / "l1")
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run(tmp_path / "w2", tmp_path / "l2", kill=steps // 2)
    assert killed.returncode == -signal.SIGKILL
    resumed = run(tmp_path / "w2", tmp_path / "l2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    ref = [json.loads(x) for x in open(tmp_path / "l1")]
    got = [json.loads(x) for x in open(tmp_path / "l2")]
    assert [s for s, _ in got] == list(range(steps))  # each step once: none repeated, none skipped
    assert got == ref
    seen = [tuple(k) for _, items in got for k in items]
    assert len(seen) == len(set(seen))  # within the first epoch no record comes twice


@pytest.mark.slow
def test_sft_step_specs_compile_and_match_the_learners_step():
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from bipace_jax.learner import Learner
    from bipace_jax.models import Qwen2Actor
    from bipace_jax.sft import Example, abstract_sft_batch, make_batch, sft_step_specs
    from bipace_jax.sharding import make_mesh
    from bipace_jax.tiny import tiny_actor_config

    cfg = tiny_actor_config(
        64,
        eos_token_id=None,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
    )
    tx = optax.sgd(0.1)
    L = Learner(Qwen2Actor(cfg, rngs=nnx.Rngs(0)), make_mesh(1, 1, 1, devices=jax.devices()[:1]), tx)
    specs = sft_step_specs(L.graphdef, tx, L.mesh, L.params, L.rest, L.opt_state, 2, 12, 4)
    assert specs["accumulate"].args[4].input_ids.shape == (2, 12)
    assert specs["accumulate"].args[4] == abstract_sft_batch(L.mesh, 2, 12, 4)
    acc = specs["accumulate"].fn.lower(*specs["accumulate"].args).compile()
    batch = make_batch([Example([1, 2, 3, 4], [5, 6, 7]), Example([1, 2], [8, 9])], 12, 0, 4)
    zeros = jax.tree.map(jnp.zeros_like, L.params)
    stats0 = {k: jnp.zeros((), jnp.float32) for k in ("token_accuracy", "loss")}
    grads, stats = acc(L.params, L.rest, zeros, stats0, jax.tree.map(jnp.asarray, batch), jnp.float32(5.0))
    assert np.isfinite(float(stats["loss"])) and float(stats["loss"]) > 0
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_dataset_examples_equal_the_in_memory_oracle_examples(tmp_path):
    import environments
    from bipace_jax.rollout import RolloutConfig
    from bipace_jax.sft import demo_examples, expert_examples
    from bipace_jax.tiny import warm_start_tokenizer
    from configs.textcraft_tasks import TEMPLATE

    tasks = [300, 301, 150]
    rcfg = RolloutConfig(
        game="textcraft", group_size=1, max_steps=15, history_length=2, max_prompt_length=448, template=TEMPLATE
    )
    tok = warm_start_tokenizer("textcraft", TEMPLATE, vocab_size=400, seeds=1, task_ids=tasks)
    cfg = demos.demos_config("textcraft", tasks="300,301,150", holdout_every=0, seeds=2, max_steps=15)
    got, gstats = demo_examples(demos.read_split(demos.build(cfg, str(tmp_path), progress=False), "train"), rcfg, tok)
    env = environments.make("textcraft", max_steps=15)
    want, wstats = expert_examples(env, rcfg, tok, [(t, s) for s in range(2) for t in sorted(tasks)])
    key = lambda e: (tuple(e.prompt_ids), tuple(e.response_ids), e.depth, e.key)  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want)) and len(got) == len(want) > 6
    assert gstats == pytest.approx(wstats)


@pytest.mark.slow
@pytest.mark.parametrize("game", ["alfworld", "webshop"])
def test_default_configs_of_the_other_games_build_split_by_task(game, tmp_path):
    b = demos.build(game, str(tmp_path), progress=False)
    assert b.builder_config.name == game
    train, val = demos.read_split(b, "train"), demos.read_split(b, "validation")
    tr, va = {int(r["task_id"]) for r in train}, {int(r["task_id"]) for r in val}
    assert tr and va and not tr & va
    rec = train[0]
    assert rec["game"].decode() == game and rec["response"].decode() == f"<action>{rec['action'].decode()}</action>"
    assert demos.observation_of(rec).text


SHARD_READER = textwrap.dedent(
    """
    import json, sys
    from bipace_jax import demo_stream, demos, distributed
    coord, pid, data_dir, cfg_json = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    distributed.initialize(coord, 2, pid)
    import jax
    b = demos.DemosBuilder(config=demos.demos_config(**json.loads(cfg_json)), data_dir=data_dir)
    src = demos.read_split(b, "train")
    key = lambda r: f"{int(r['task_id'])}_{int(r['seed'])}_{int(r['turn'])}"
    s = demo_stream.BucketStream(src, key, lambda k: 1, 3, (8,), 11)  # the default shard: ShardByJaxProcess
    epoch = [k for _ in range(len(s.indices) // 3) for k in next(s)[1]]
    print(json.dumps({"process": jax.process_index(), "count": jax.process_count(),
                      "indices": [int(i) for i in s.indices], "epoch": epoch}))
    """
)


@pytest.mark.slow
@pytest.mark.e2e
def test_two_jax_processes_read_disjoint_shards_whose_union_is_the_split(built):
    from tests.devices import run_processes

    d, _, b = built
    src = demos.read_split(b, "train")
    keys = [f"{int(r['task_id'])}_{int(r['seed'])}_{int(r['turn'])}" for r in src]
    cfg_json = json.dumps({"game": "textcraft", "tasks": TASKS, "holdout_every": 4, "seeds": 2, "max_steps": 30})
    outs = run_processes(SHARD_READER, [[str(p), d, cfg_json] for p in (0, 1)], devices=1, timeout=300)
    got = sorted((json.loads(o.strip().splitlines()[-1]) for o in outs), key=lambda x: x["process"])
    assert [(g["process"], g["count"]) for g in got] == [(0, 2), (1, 2)]
    a, c = set(got[0]["indices"]), set(got[1]["indices"])
    n = len(keys)
    assert not a & c and len(a) == len(c) == n // 2  # equal shares, the odd record (if any) dropped
    assert a | c == set(range(n)) - ({n - 1} if n % 2 else set())
    for g in got:  # an epoch of a process reads each record of its own shard once, none of the other's
        per = len(g["indices"]) // 3 * 3
        assert len(g["epoch"]) == len(set(g["epoch"])) == per
        assert set(g["epoch"]) <= {keys[i] for i in g["indices"]}
    assert len(set(got[0]["epoch"]) | set(got[1]["epoch"])) == 2 * (n // 2 // 3 * 3)
