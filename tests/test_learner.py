"""Weights load into their mesh shardings; the learner's programs run under the mesh; the sampler and
reference copies are made on device (in the compute dtype): on 8 emulated CPU devices, against one."""

import json
import os
import textwrap

import pytest

from tests.devices import run_on_cpu_devices, run_processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r"""
    import json, tempfile
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from bipace_jax import losses, ppo, sharding as shd
    from bipace_jax.models import Qwen2Actor, Qwen2Config, load_hf_checkpoint, save_hf_checkpoint
    from tests.qwen_fixtures import one_layer_config, random_token_batch

    assert len(jax.devices()) == 8, jax.devices()
    out = {}

    # 1. A checkpoint loads straight into each parameter's NamedSharding, with the one-device values.
    cfg = Qwen2Config.tiny(tie_word_embeddings=False)
    ckpt = save_hf_checkpoint(Qwen2Actor(cfg, rngs=nnx.Rngs(0)), tempfile.mkdtemp())
    one = nnx.state(load_hf_checkpoint(ckpt), nnx.Param)
    mesh = shd.make_mesh(2, 2, 2)
    state = nnx.state(load_hf_checkpoint(ckpt, mesh=mesh), nnx.Param)
    want = shd.param_shardings(state, mesh)
    flat = lambda t: dict(nnx.to_flat_state(t))
    got, ref, exp = flat(state), flat(one), flat(want)
    out["load_sharding_mismatch"] = [str(k) for k in got if got[k].get_value().sharding != exp[k].get_value()]
    out["load_max_err"] = max(float(np.abs(np.asarray(got[k].get_value()) - np.asarray(ref[k].get_value())).max()) for k in got)
    q = got[("layers", 0, "attn", "q_proj", "kernel")].get_value()
    out["load_q_shard"] = list(q.addressable_shards[0].data.shape)

    # 2. PPO learner on the 2x2x2 mesh vs one device: log-probs (rows split over data*fsdp) and the update.
    V = 48
    small = one_layer_config(V)
    rng = np.random.default_rng(0)
    n, p, m = 6, 7, 5
    batch = random_token_batch(rng, n, p, m, V)
    adv = rng.normal(size=n).astype(np.float32)

    seen = []
    program = ppo._logprobs_program
    def spy(*a):
        fn = program(*a)
        def run(params, rest, mb):
            seen.append(str(mb.input_ids.sharding.spec))
            return fn(params, rest, mb)
        return run
    ppo._logprobs_program = spy

    tx = optax.adamw(3e-3)
    loss_cfg = losses.PPOLossConfig(kl_coef=0.1, entropy_coef=0.001)
    results = {}
    for name, mesh_ in (("one", shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])), ("mesh", mesh)):
        actor = Qwen2Actor(small, rngs=nnx.Rngs(1))
        L = ppo.PPOLearner(actor, mesh_, loss_cfg, tx, micro_batch_rows=4)
        old = L.logprobs(L.params_local, batch)
        refl = L.logprobs(L.ref_params_local, batch)
        stats = L.update(batch.with_(old_logprobs=old, ref_logprobs=refl, advantages=adv), jax.random.PRNGKey(0))
        new = L.logprobs(L.params_local, batch)
        leaves = jax.tree.leaves(L.params)
        # AdamW's moments live where their parameters do (never replicated on every device)
        mu = jax.tree.leaves(L.opt_state[0].mu)
        out[f"moments_sharded_{name}"] = all(
            x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(mu, jax.tree.leaves(L.param_shardings))
        ) and len(mu) == len(leaves)
        results[name] = dict(old=old, new=new, stats=stats, params=[np.asarray(x) for x in leaves],
                             same_local=all(a is b for a, b in zip(jax.tree.leaves(L.params_local), leaves)),
                             local_sharded=all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(jax.tree.leaves(L.params_local),
                                                                               jax.tree.leaves(L.param_shardings))))
    a, b = results["one"], results["mesh"]
    out["logprob_specs"] = sorted(set(seen))
    out["old_err"] = float(np.abs(a["old"] - b["old"]).max())
    out["new_err"] = float(np.abs(a["new"] - b["new"]).max())
    out["param_err"] = max(float(np.abs(x - y).max()) for x, y in zip(a["params"], b["params"]))
    out["stat_err"] = max(abs(a["stats"][k] - b["stats"][k]) for k in a["stats"])
    out["same_local"] = [a["same_local"], b["same_local"]]
    out["local_sharded"] = b["local_sharded"]

    # 3. bf16 compute over fp32 master parameters: bf16 sampler/reference copies, same shardings, same log-probs.
    actor = Qwen2Actor(small, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(1))
    L = ppo.PPOLearner(actor, mesh, loss_cfg, tx, micro_batch_rows=3)  # log-prob rows padded to 4
    loc, ref_, master = (jax.tree.leaves(t) for t in (L.params_local, L.ref_params_local, L.params))
    out["bf16_dtypes"] = sorted({str(x.dtype) for x in loc + ref_})
    out["master_dtypes"] = sorted({str(x.dtype) for x in master})
    out["bf16_values"] = all(np.array_equal(np.asarray(x), np.asarray(y.astype(jnp.bfloat16))) for x, y in zip(loc, master))
    out["bf16_shardings"] = all(x.sharding.is_equivalent_to(y.sharding, x.ndim) for x, y in zip(loc, master))
    out["bf16_actor"] = str(L.actor.layers[0].attn.q_proj.kernel.get_value().dtype)
    out["bf16_logprob_err"] = float(np.abs(L.logprobs(L.params_local, batch) - L.logprobs(L.params, batch)).max())
    out["bf16_export_dtype"] = str(L.master_model().layers[0].attn.q_proj.kernel.get_value().dtype)

    # 4. Pure-FSDP training (1, 8, 1) under a tensor-parallel 4 sampler mesh (mesh.sampler_tensor): the
    # host copy comes by the replica route; log-probs and the update are one device's.
    fmesh = shd.make_mesh(1, 8, 1)
    from bipace_jax import distributed
    F = ppo.PPOLearner(Qwen2Actor(small, rngs=nnx.Rngs(1)), fmesh, loss_cfg, tx, micro_batch_rows=8,
                       local_mesh=distributed.local_mesh(fmesh, 4))
    out["fsdp_local_shape"] = list(F.local_mesh.devices.shape)
    out["fsdp_local_specs"] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(F.params_local)})
    old_f = F.logprobs(F.params_local, batch)
    F.update(batch.with_(old_logprobs=old_f, ref_logprobs=F.logprobs(F.ref_params_local, batch), advantages=adv),
             jax.random.PRNGKey(0))
    out["fsdp_old_err"] = float(np.abs(a["old"] - old_f).max())
    out["fsdp_new_err"] = float(np.abs(a["new"] - F.logprobs(F.params_local, batch)).max())
    out["fsdp_param_err"] = max(float(np.abs(x - np.asarray(y)).max()) for x, y in zip(a["params"], jax.tree.leaves(F.params)))
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_loads_into_shardings_and_learner_runs_under_the_mesh_on_8_cpu_devices():
    proc = run_on_cpu_devices(SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    r = json.loads(line[len("RESULT") :])
    # Loading: every parameter on its NamedSharding, values those of the one-device load.
    assert r["load_sharding_mismatch"] == [] and r["load_max_err"] == 0.0, r
    assert r["load_q_shard"] == [32, 2, 16]  # q kernel [D=64, N=4, Hd=16] split over fsdp=2 x tensor=2
    # Log-probs: each micro-batch's rows split over data*fsdp; values, update and stats those of one device.
    assert r["logprob_specs"] == ["P(('data', 'fsdp'), None)"], r["logprob_specs"]
    assert r["old_err"] <= 1e-5 and r["new_err"] <= 1e-5, r
    assert r["param_err"] <= 1e-5 and r["stat_err"] <= 1e-4, r
    # One process, same dtype: the sampler's copy is the global parameters themselves (no copy).
    assert r["same_local"] == [True, True] and r["local_sharded"], r
    assert r["moments_sharded_one"] and r["moments_sharded_mesh"], r
    # bf16 compute: bf16 copies (values the cast of the fp32 masters, same shardings), same log-probs.
    assert r["bf16_dtypes"] == ["bfloat16"] and r["master_dtypes"] == ["float32"], r
    assert r["bf16_values"] and r["bf16_shardings"] and r["bf16_actor"] == "bfloat16", r
    assert r["bf16_logprob_err"] <= 1e-6, r
    # Pure FSDP training, tensor-parallel host copy: the same log-probs and update as one device.
    assert r["fsdp_local_shape"] == [2, 1, 4], r
    assert any("tensor" in spec for spec in r["fsdp_local_specs"]), r["fsdp_local_specs"]
    assert r["fsdp_old_err"] <= 1e-5 and r["fsdp_new_err"] <= 1e-5 and r["fsdp_param_err"] <= 1e-5, r
    assert r["bf16_export_dtype"] == "float32", r


TWO_PROCESS_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import jax
    from bipace_jax import distributed

    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
    import jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.experimental import multihost_utils
    from bipace_jax import sharding as shd
    from bipace_jax.learner import Learner
    from bipace_jax.models import Qwen2Actor
    from tests.qwen_fixtures import one_layer_config

    hops = []
    gather = multihost_utils.process_allgather
    def counted(*a, **k):
        hops.append(1)
        return gather(*a, **k)
    distributed.multihost_utils.process_allgather = counted

    cfg = one_layer_config(48)
    want = [np.asarray(x) for x in jax.tree.leaves(nnx.state(Qwen2Actor(cfg, rngs=nnx.Rngs(1)), nnx.Param))]
    mesh = shd.make_mesh(1, 4, 2)  # fsdp over both hosts, tensor inside each
    out = {"process": jax.process_index(), "local_devices": jax.local_device_count()}
    actor = Qwen2Actor(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(1))
    L = Learner(actor, mesh, optax.sgd(0.1), local_mesh=distributed.local_mesh(mesh, 2), keep_reference=True)
    local, ref = jax.tree.leaves(L.params_local), jax.tree.leaves(L.ref_params_local)
    shardings = jax.tree.leaves(L.local_shardings)
    out["global_addressable"] = all(x.is_fully_addressable for x in jax.tree.leaves(L.params))
    out["addressable"] = all(x.is_fully_addressable for x in local + ref)
    out["on_local"] = all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(local, shardings))
    out["dtypes"] = sorted({str(x.dtype) for x in local + ref})
    bf = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16)).astype(np.float32)
    out["values"] = all(np.array_equal(np.asarray(x).astype(np.float32), bf(w)) for x, w in zip(local, want))
    out["ref_values"] = all(np.array_equal(np.asarray(x).astype(np.float32), bf(w)) for x, w in zip(ref, want))
    out["hops_on_device"] = len(hops)
    # no local shardings: one copy on the host's first device
    first = distributed.local_copy(L.params)
    out["first_device"] = all(x.devices() == {jax.local_devices()[0]} for x in jax.tree.leaves(first))
    out["first_values"] = all(np.array_equal(np.asarray(x), w) for x, w in zip(jax.tree.leaves(first), want))
    # a local tensor axis of another size than the global one: the replica route (whole-mesh
    # all-gather, then a slice on this host's devices), still on device
    wide = shd.param_shardings(L.params, shd.make_mesh(1, 1, 4, devices=jax.local_devices()))
    hops.clear()
    other = jax.tree.leaves(distributed.local_copy(L.params, wide, jnp.bfloat16))
    out["other_tensor_values"] = all(np.array_equal(np.asarray(x).astype(np.float32), bf(w)) for x, w in zip(other, want))
    out["other_tensor_on_local"] = all(
        x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(other, jax.tree.leaves(wide))
    )
    out["hops_other_tensor"] = len(hops)
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_two_processes_make_their_local_copies_on_device():
    outs = run_processes(TWO_PROCESS_SCRIPT, [["0"], ["1"]], devices=4)
    for stdout in outs:
        r = json.loads([ln for ln in stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT") :])
        assert r["local_devices"] == 4 and not r["global_addressable"], r
        # bf16 copies of the fp32 masters on this host's (data, 1, tensor) mesh, made without a host hop
        assert r["addressable"] and r["on_local"] and r["dtypes"] == ["bfloat16"], r
        assert r["values"] and r["ref_values"] and r["hops_on_device"] == 0, r
        assert r["first_device"] and r["first_values"], r
        # a local tensor size the host's shards cannot give (4, global 2) comes by the replica route
        assert r["other_tensor_values"] and r["other_tensor_on_local"] and r["hops_other_tensor"] == 0, r


@pytest.mark.parametrize(
    "schedule, expected",
    [
        # linear warmup over 2 steps to 1.0, then constant
        ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
        # warmup, then cosine from 1.0 at step 2 to 0.1 at step 6: 0.1 + 0.45 (1 + cos(pi (k - 2) / 4))
        ("warmup_cosine", [0.0, 0.5, 1.0, 0.868198, 0.55, 0.231802]),
    ],
)
def test_make_optimizer_follows_the_schedule_step_by_step(schedule, expected):
    # one parameter, gradient 1 every step, no weight decay: Adam's bias-corrected step is m/sqrt(v) = 1,
    # so each update is -lr_k / (1 + eps): the schedule itself (up to float32 rounding)
    import jax.numpy as jnp

    from bipace_jax.config import OptimConfig
    from bipace_jax.learner import make_optimizer

    optim = OptimConfig(learning_rate=1.0, warmup_steps=2, schedule=schedule, weight_decay=0.0)
    tx = make_optimizer(optim, total_steps=6)
    params, grads = {"w": jnp.zeros(())}, {"w": jnp.ones(())}
    state, got = tx.init(params), []
    for _ in range(6):
        updates, state = tx.update(grads, state, params)
        got.append(-float(updates["w"]))
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)  # float32 bias corrections: ~1e-5 off
