"""Weights load into their mesh shardings; the learner's programs run under the mesh; the sampler and
reference copies are made on device (in the compute dtype): on 8 emulated CPU devices, against one."""

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r"""
    import json, tempfile
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from bipace_jax import losses, ppo, sharding as shd
    from bipace_jax.models import Qwen2Actor, Qwen2Config, load_hf_checkpoint, save_hf_checkpoint
    from bipace_jax.rollout import TokenBatch

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
    small = Qwen2Config.tiny(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
    rng = np.random.default_rng(0)
    n, p, m = 6, 7, 5
    pid, pm = np.zeros((n, p), np.int32), np.zeros((n, p), np.int32)
    rid, rm = np.zeros((n, m), np.int32), np.zeros((n, m), bool)
    for i in range(n):
        lp_, lr = rng.integers(2, p + 1), rng.integers(1, m + 1)
        pid[i, p - lp_:] = rng.integers(3, V, lp_); pm[i, p - lp_:] = 1
        rid[i, :lr] = rng.integers(3, V, lr); rm[i, :lr] = True
    batch = TokenBatch(np.concatenate([pid, rid], 1), np.concatenate([pm, rm.astype(np.int32)], 1), rid, rm, p)
    adv = rng.normal(size=n).astype(np.float32)

    seen = []
    program = ppo._logprobs_program
    def spy(*a):
        fn = program(*a)
        def run(params, rest, ids, att, resp):
            seen.append(str(ids.sharding.spec))
            return fn(params, rest, ids, att, resp)
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
        stats = L.update(batch, old, refl, adv, jax.random.PRNGKey(0))
        new = L.logprobs(L.params_local, batch)
        leaves = jax.tree.leaves(L.params)
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
    print("RESULT" + json.dumps(out))
""")


def test_loads_into_shardings_and_learner_runs_under_the_mesh_on_8_cpu_devices():
    env = dict(
        os.environ,
        JAX_NUM_CPU_DEVICES="8",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=REPO,
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
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
    # bf16 compute: bf16 copies (values the cast of the fp32 masters, same shardings), same log-probs.
    assert r["bf16_dtypes"] == ["bfloat16"] and r["master_dtypes"] == ["float32"], r
    assert r["bf16_values"] and r["bf16_shardings"] and r["bf16_actor"] == "bfloat16", r
    assert r["bf16_logprob_err"] <= 1e-6, r
    assert r["bf16_export_dtype"] == "float32", r
