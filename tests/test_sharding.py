"""Mesh, logical axes declared on the parameters, abstract sizes, the actor on 8 emulated CPU devices."""

from __future__ import annotations

import functools
import json
import textwrap

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax import sharding as shd
from bipace_jax.models import Qwen2Actor, Qwen2Config, abstract_params, count_params, per_device_bytes
from bipace_jax.models.kv_cache import cache_shardings
from bipace_jax.models.layers import ACTIVATION_AXES
from tests.devices import run_on_cpu_devices


def test_logical_axes_map_to_mesh_axes_and_drop_what_does_not_divide():
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    assert shd.logical_to_spec(("batch", "seq", "act_embed"), (8, 12, 64), mesh) == P(("data", "fsdp"), None, None)
    # 6 rows: data=4 does not divide them, fsdp=2 does.
    assert shd.logical_to_spec(("batch", None), (6, 3), {"data": 4, "fsdp": 2}) == P("fsdp", None)
    # 2 kv heads cannot be split 4 ways: replicated along tensor.
    assert shd.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), {"fsdp": 4, "tensor": 4}) == P(
        "fsdp", None, None
    )
    with pytest.raises(ValueError, match="unknown logical axis 'nope'"):
        shd.logical_to_spec(("nope",), (4,), mesh)
    with pytest.raises(ValueError, match="do not match the array rank"):
        shd.logical_to_spec(("batch",), (4, 4), mesh)


# Hand-written: the PartitionSpec every parameter had under the path-regex rules this metadata replaced.
EXPECTED_SPECS = {
    # (config, mesh) -> {parameter path: spec}
    ("tiny_untied", "fsdp4_tensor2"): {
        "embed/embedding": P("tensor", "fsdp"),
        "layers/0/attn/q_proj/kernel": P("fsdp", "tensor", None),
        "layers/0/attn/q_proj/bias": P("tensor", None),
        "layers/1/attn/k_proj/kernel": P("fsdp", "tensor", None),
        "layers/1/attn/v_proj/bias": P("tensor", None),
        "layers/1/attn/o_proj/kernel": P("tensor", None, "fsdp"),
        "layers/0/mlp/gate_proj/kernel": P("fsdp", "tensor"),
        "layers/0/mlp/up_proj/kernel": P("fsdp", "tensor"),
        "layers/0/mlp/down_proj/kernel": P("tensor", "fsdp"),
        "layers/0/input_norm/scale": P(None),
        "layers/1/post_attn_norm/scale": P(None),
        "final_norm/scale": P(None),
        "lm_head/kernel": P("fsdp", "tensor"),
    },
    # Qwen2.5-0.5B: N 14 and K 2 do not split 4 ways over tensor, D 896 splits 8 ways over fsdp.
    ("0.5b", "fsdp8_tensor4"): {
        "embed/embedding": P("tensor", "fsdp"),
        "layers/0/attn/q_proj/kernel": P("fsdp", None, None),
        "layers/0/attn/q_proj/bias": P(None, None),
        "layers/23/attn/k_proj/kernel": P("fsdp", None, None),
        "layers/23/attn/o_proj/kernel": P(None, None, "fsdp"),
        "layers/5/mlp/down_proj/kernel": P("tensor", "fsdp"),
        "final_norm/scale": P(None),
    },
    # Qwen2.5-1.5B on data 2 x fsdp 2 x tensor 2: K 2 splits over tensor.
    ("1.5b", "data2_fsdp2_tensor2"): {
        "embed/embedding": P("tensor", "fsdp"),
        "layers/27/attn/v_proj/kernel": P("fsdp", "tensor", None),
        "layers/27/attn/v_proj/bias": P("tensor", None),
        "layers/0/mlp/gate_proj/kernel": P("fsdp", "tensor"),
    },
    # Qwen2.5-3B: N 16 splits 4 ways, K 2 does not.
    ("3b", "fsdp8_tensor4"): {
        "layers/0/attn/q_proj/kernel": P("fsdp", "tensor", None),
        "layers/0/attn/k_proj/kernel": P("fsdp", None, None),
        "layers/35/attn/o_proj/kernel": P("tensor", None, "fsdp"),
    },
    # Qwen2.5-7B (untied): N 28 and K 4 split 4 ways; over 64 x 4 D 3584 splits 64 ways.
    ("7b", "fsdp64_tensor4"): {
        "embed/embedding": P("tensor", "fsdp"),
        "lm_head/kernel": P("fsdp", "tensor"),
        "layers/0/attn/q_proj/kernel": P("fsdp", "tensor", None),
        "layers/0/attn/k_proj/bias": P("tensor", None),
        "layers/27/mlp/down_proj/kernel": P("tensor", "fsdp"),
        "layers/27/input_norm/scale": P(None),
    },
    # 3 and 7 divide no dimension of the tiny model: everything is replicated.
    ("tiny_untied", "fsdp3_tensor7"): {
        "embed/embedding": P(None, None),
        "layers/0/attn/q_proj/kernel": P(None, None, None),
        "layers/0/mlp/down_proj/kernel": P(None, None),
    },
}
CONFIGS = {
    "tiny_untied": lambda: Qwen2Config.tiny(tie_word_embeddings=False),
    **{name: functools.partial(Qwen2Config.preset, name) for name in ("0.5b", "1.5b", "3b", "7b")},
}
MESHES = {
    "fsdp4_tensor2": {"fsdp": 4, "tensor": 2},
    "fsdp8_tensor4": {"fsdp": 8, "tensor": 4},
    "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp64_tensor4": {"fsdp": 64, "tensor": 4},
    "fsdp3_tensor7": {"fsdp": 3, "tensor": 7},
}


@pytest.mark.slow
@pytest.mark.parametrize("config,mesh", sorted(EXPECTED_SPECS))
def test_parameters_declare_logical_axes_giving_the_expected_specs(config, mesh):
    state = abstract_params(CONFIGS[config](), jnp.float32)
    specs = {}
    for path, var in nnx.to_flat_state(state):
        axes = shd.logical_axes(var)
        assert len(axes) == var.ndim, (path, axes)
        specs["/".join(map(str, path))] = shd.logical_to_spec(axes, var.shape, MESHES[mesh])
    for name, spec in EXPECTED_SPECS[config, mesh].items():
        assert specs[name] == spec, name


def test_param_shardings_follow_the_metadata_and_keep_the_state_structure():
    cfg = Qwen2Config.tiny(tie_word_embeddings=False)
    state = abstract_params(cfg, jnp.float32)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    shardings = shd.param_shardings(state, mesh)
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    q = shardings["layers"][0]["attn"]["q_proj"]["kernel"].get_value()
    assert isinstance(q, NamedSharding) and q.mesh == mesh and q.spec == P(None, None, None)
    # A parameter created without logical axes is refused by name, not silently replicated.
    with pytest.raises(KeyError, match="without logical_axes= metadata"):
        shd.logical_axes(nnx.Param(jnp.zeros((2, 3))))


def test_make_mesh_checks_sizes_against_the_device_count():
    n = len(jax.devices())
    mesh = shd.make_mesh(data=-1)
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.size == n
    with pytest.raises(ValueError, match="expected the device count"):
        shd.make_mesh(data=n + 1)
    with pytest.raises(ValueError, match="at most one mesh axis size may be -1"):
        shd.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="'tensor' size must be a positive int or -1"):
        shd.make_mesh(tensor=0)


def test_make_mesh_on_one_process_keeps_jax_make_mesh_order_and_passes_the_placement_check():
    devices = jax.devices()
    mesh = shd.make_mesh(data=-1, devices=devices)
    want = jax.make_mesh((len(devices), 1, 1), shd.MESH_AXES, devices=devices)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in want.devices.flat]
    info = shd.check_placement(mesh)
    assert info["processes"] == 1 and info["process_batch_shards"] == {"0": [0, len(devices)]}


@pytest.mark.slow
def test_parameter_counts_of_the_qwen2_5_presets():
    # Exact counts of the published checkpoints (tied heads counted once).
    assert count_params(Qwen2Config.preset("0.5b")) == 494_032_768
    assert count_params(Qwen2Config.preset("1.5b")) == 1_543_714_304
    assert count_params(Qwen2Config.preset("3b")) == 3_085_938_688
    assert count_params(Qwen2Config.preset("7b")) == 7_615_616_512


def test_per_device_bytes_hand_computed_for_tiny_and_7b():
    cfg = Qwen2Config.tiny()  # V 512, D 64, F 128, L 2, N 4, K 2, Hd 16, tied
    # Unsharded: per layer q 4096+64, k,v 2*(2048+32), o 4096, mlp 3*8192, norms 128 -> 37120;
    # 2 layers + embedding 32768 + final norm 64 = 107072 floats.
    assert count_params(cfg) == 107_072
    assert per_device_bytes(cfg, {}, jnp.float32) == 107_072 * 4
    # fsdp=4 x tensor=2: per layer q 16*2*16 + 2*16, k,v 2*(16*1*16 + 16), o 2*16*16, gate/up 2*16*64,
    # down 64*16, norms 128 (replicated) -> 4800; embedding 256*16; final norm 64 -> 13760 floats.
    assert per_device_bytes(cfg, {"fsdp": 4, "tensor": 2}, jnp.float32) == 13_760 * 4
    # 7B in bf16 over fsdp=8 x tensor=4: every big matrix divides by 32, the norms do not shrink.
    seven = Qwen2Config.preset("7b")
    norms = (2 * 28 + 1) * 3584
    biases = 28 * (28 + 4 + 4) * 128  # split over tensor only
    big = 7_615_616_512 - norms - biases
    assert per_device_bytes(seven, {"fsdp": 8, "tensor": 4}) == 2 * (big // 32 + norms + biases // 4)


def test_constrain_is_identity_without_a_mesh():
    x = jnp.ones((4, 3, 8))
    assert shd.constrain(x, ("batch", "seq", "act_embed")) is x


SCRIPT = textwrap.dedent(r"""
    import json, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from bipace_jax import sharding as shd
    from bipace_jax.models import Qwen2Actor, Qwen2Config, load_hf_checkpoint, save_hf_checkpoint

    assert len(jax.devices()) == 8, jax.devices()
    cfg = Qwen2Config.tiny(tie_word_embeddings=False)
    actor = Qwen2Actor(cfg, fingerprint_layer=-2, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (8, 10)).astype(np.int32)
    mask = np.ones((8, 10), np.int32)
    for b in range(1, 8):
        mask[b, : b] = 0
    new = rng.integers(0, cfg.vocab_size, (8, 2)).astype(np.int32)
    graphdef, state = nnx.split(actor)

    def run(state, ids, mask, new):
        model = nnx.merge(graphdef, state)
        out = model(ids, mask)
        first, cache = model.prefill(ids, mask, model.init_cache(ids.shape[0], 12))
        step1, cache = model.decode_step(new[:, 0], cache)
        step2, cache = model.decode_step(new[:, 1], cache)
        return out.logits, out.fingerprint, first.logits, step1, step2

    ref = [np.asarray(x) for x in jax.jit(run)(state, ids, mask, new)]
    ckpt = save_hf_checkpoint(actor, tempfile.mkdtemp())
    results = {}
    for shape in [(1, 4, 2), (8, 1, 1), (2, 2, 2)]:
        mesh = shd.make_mesh(*shape)
        sharded = jax.device_put(state, shd.param_shardings(state, mesh))
        loaded = load_hf_checkpoint(ckpt, mesh=mesh, fingerprint_layer=-2)
        loaded_state = nnx.state(loaded)
        with jax.set_mesh(mesh):
            put = lambda x: jax.device_put(x, shd.batch_sharding(mesh, x.ndim))
            outs = jax.jit(run)(sharded, put(ids), put(mask), put(new))
            outs_loaded = jax.jit(run)(loaded_state, put(ids), put(mask), put(new))
        q = sharded["layers"][0]["attn"]["q_proj"]["kernel"][...]
        lq = loaded.layers[0].attn.q_proj.kernel[...]
        results[str(shape)] = {
            "max_err": max(float(np.abs(np.asarray(o) - r).max()) for o, r in zip(outs, ref)),
            "max_err_loaded": max(float(np.abs(np.asarray(o) - r).max()) for o, r in zip(outs_loaded, ref)),
            "q_spec": str(q.sharding.spec), "q_shard": list(q.addressable_shards[0].data.shape),
            "loaded_q_spec": str(lq.sharding.spec), "loaded_q_shard": list(lq.addressable_shards[0].data.shape),
            "logits_spec": str(outs[0].sharding.spec),
        }
    print("RESULT" + json.dumps(results))
""")


@pytest.mark.slow
def test_sharded_forward_and_cache_on_8_cpu_devices_equal_unsharded():
    proc = run_on_cpu_devices(SCRIPT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # FSDP gathers weights, never activations the partitioner cannot reshard.
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    results = json.loads(line[len("RESULT") :])
    fsdp_tp, data, mixed = results["(1, 4, 2)"], results["(8, 1, 1)"], results["(2, 2, 2)"]
    for r in (fsdp_tp, data, mixed):
        assert r["max_err"] <= 1e-5 and r["max_err_loaded"] <= 1e-5, r
    # fsdp=4 x tensor=2: q kernel [D=64, N=4, Hd=16] is split 4 x 2 on every device, also when streamed.
    assert fsdp_tp["q_spec"] == fsdp_tp["loaded_q_spec"] == "P('fsdp', 'tensor', None)"
    assert fsdp_tp["q_shard"] == fsdp_tp["loaded_q_shard"] == [16, 2, 16]
    assert fsdp_tp["logits_spec"].startswith("P('fsdp', None, 'tensor')")
    # data=8: parameters replicated, the batch split 8 ways.
    assert data["q_shard"] == data["loaded_q_shard"] == [64, 4, 16]
    assert data["logits_spec"].startswith("P('data',")
    # data=2 x fsdp=2 x tensor=2: q kernel split 2 x 2, batch over data and fsdp.
    assert mixed["q_shard"] == mixed["loaded_q_shard"] == [32, 2, 16]
    assert mixed["logits_spec"].startswith("P(('data', 'fsdp'), None, 'tensor')")


@pytest.mark.slow
def test_cache_logical_axes_name_the_key_and_value_layouts():
    """Each layer's keys are [B, K, Hd, S] and values [B, K, S, Hd]: each logical name must sit on the dim
    of its size (a rule that split "cache_seq" would otherwise split the keys' head_dim)."""
    cfg = Qwen2Config.tiny(num_hidden_layers=3, num_key_value_heads=2, head_dim=8)
    actor = Qwen2Actor(cfg, rngs=nnx.Rngs(0))
    sizes = {"batch": 5, "kv_heads": 2, "head_dim": 8, "cache_seq": 11}
    cache = actor.init_cache(5, 11)
    assert len(cache.k) == len(cache.v) == 3
    for kind, x in (("cache_k", cache.k), ("cache_v", cache.v)):
        axes = ACTIVATION_AXES[kind]
        assert tuple(sizes[a] for a in axes) == x[0].shape, (kind, axes, x[0].shape)
    shardings = cache_shardings(cache, shd.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert jax.tree.structure(shardings) == jax.tree.structure(cache)
    # With a rule that splits the slots, keys and values are split along their own slot dims.
    rules = dict(shd.LOGICAL_TO_MESH, cache_seq="tensor")
    mesh = {"data": 1, "fsdp": 1, "tensor": 11}
    assert shd.logical_to_spec(ACTIVATION_AXES["cache_k"], (5, 2, 8, 11), mesh, rules) == P(None, None, None, "tensor")
    assert shd.logical_to_spec(ACTIVATION_AXES["cache_v"], (5, 2, 11, 8), mesh, rules) == P(None, None, "tensor", None)
