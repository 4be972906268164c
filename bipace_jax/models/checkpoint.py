"""Hugging Face Qwen2 checkpoint I/O (safetensors only) for `Qwen2Actor`.

`load_hf_checkpoint` checks every tensor name and shape against config.json *before* reading any
weight, then streams tensors one at a time to their `NamedSharding` (each device receives only its
shard), so the model is never whole on one device or in host memory. `save_hf_checkpoint` writes a
folder that transformers (and vLLM) load to the same logits. Only safetensors are read (pickle
`.bin` checkpoints are refused with how to convert); no remote code runs. Name mapping (HF linear
weights are stored [out, in]):

  model.embed_tokens.weight [V, D]                     -> embed/embedding [V, D]
  model.layers.i.input_layernorm.weight [D]            -> layers/i/input_norm/scale
  model.layers.i.self_attn.q_proj.weight [N*Hd, D]     -> layers/i/attn/q_proj/kernel [D, N, Hd]
  model.layers.i.self_attn.q_proj.bias [N*Hd]          -> layers/i/attn/q_proj/bias [N, Hd]
  model.layers.i.self_attn.{k,v}_proj.{weight,bias}    -> ... [D, K, Hd] / [K, Hd]
  model.layers.i.self_attn.o_proj.weight [D, N*Hd]     -> layers/i/attn/o_proj/kernel [N, Hd, D]
  model.layers.i.post_attention_layernorm.weight [D]   -> layers/i/post_attn_norm/scale
  model.layers.i.mlp.{gate,up}_proj.weight [F, D]      -> layers/i/mlp/{gate,up}_proj/kernel [D, F]
  model.layers.i.mlp.down_proj.weight [D, F]           -> layers/i/mlp/down_proj/kernel [F, D]
  model.norm.weight [D]                                -> final_norm/scale
  lm_head.weight [V, D] (untied only)                  -> lm_head/kernel [D, V]
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bipace_jax import sharding as shd
from bipace_jax.models.config import Qwen2Config
from bipace_jax.models.qwen2 import Qwen2Actor

__all__ = ["CheckpointError", "hf_tensor_specs", "load_hf_checkpoint", "save_hf_checkpoint"]

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# Non-parameter buffers some older exports contain; they are recomputed, so they are skipped.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_CONVERT_HINT = (
    'convert it once with torch + transformers: python -c "from transformers import '
    "AutoModelForCausalLM as M; M.from_pretrained('{src}').save_pretrained('{src}-safetensors')\" "
    "(writes model.safetensors; transformers>=5 always saves safetensors)"
)


class CheckpointError(ValueError):
    """A checkpoint folder does not match the expected Qwen2 safetensors layout."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor and its actor parameter.

    Attributes:
      hf_name: name in the safetensors file.
      path: actor parameter path, e.g. ("layers", 0, "attn", "q_proj", "kernel").
      hf_shape: shape stored by HF.
      to_actor: maps the HF array to the actor layout; to_hf: the inverse.
    """

    hf_name: str
    path: tuple[Any, ...]
    hf_shape: tuple[int, ...]
    to_actor: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _identity(x):
    return x


def _linear(out_split: tuple[int, ...] | None, in_split: tuple[int, ...] | None):
    """HF weight [out, in] <-> actor kernel [*in_split or in, *out_split or out]."""

    def to_actor(w):
        k = w.T
        shape = (in_split or (k.shape[0],)) + (out_split or (k.shape[1],))
        return k.reshape(shape)

    def to_hf(k):
        n_in = int(np.prod(in_split)) if in_split else k.shape[0]
        return k.reshape(n_in, -1).T

    return to_actor, to_hf


def _bias(split: tuple[int, ...]):
    return (lambda b: b.reshape(split)), (lambda b: b.reshape(-1))


def hf_tensor_specs(config: Qwen2Config) -> list[TensorSpec]:
    """Every HF tensor of a Qwen2ForCausalLM with this config, in file order, with its mapping."""
    c = config
    d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    n, k, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    same, plain = (_identity, _identity), _linear(None, None)
    specs = [TensorSpec("model.embed_tokens.weight", ("embed", "embedding"), (v, d), *same)]
    for i in range(c.num_hidden_layers):
        layer = [("input_layernorm.weight", ("input_norm", "scale"), (d,), same)]
        for name, heads in (("q_proj", n), ("k_proj", k), ("v_proj", k)):
            attn = f"self_attn.{name}"
            layer.append((attn + ".weight", ("attn", name, "kernel"), (heads * hd, d), _linear((heads, hd), None)))
            layer.append((attn + ".bias", ("attn", name, "bias"), (heads * hd,), _bias((heads, hd))))
        layer += [
            ("self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), (d, n * hd), _linear(None, (n, hd))),
            ("post_attention_layernorm.weight", ("post_attn_norm", "scale"), (d,), same),
            ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), (f, d), plain),
            ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), (f, d), plain),
            ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), (d, f), plain),
        ]
        specs += [TensorSpec(f"model.layers.{i}.{h}", ("layers", i, *p), sh, *maps) for h, p, sh, maps in layer]
    specs.append(TensorSpec("model.norm.weight", ("final_norm", "scale"), (d,), *same))
    if not c.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head", "kernel"), (v, d), *plain))
    return specs


# --------------------------------------------------------------------------------------------------
# Reading.
def _weight_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the index or the single file; raises CheckpointError."""
    from safetensors import safe_open

    index_path = os.path.join(path, SAFE_INDEX)
    single_path = os.path.join(path, SAFE_SINGLE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as fh:
            index = json.load(fh)
        if not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{index_path}: missing 'weight_map' (tensor name -> shard file)")
        files = {}
        for name, fname in index["weight_map"].items():
            full = os.path.join(path, fname)
            if not os.path.isfile(full):
                raise CheckpointError(f"{index_path}: shard file {fname!r} for tensor {name!r} does not exist")
            files[name] = full
        return files  # each shard's header is checked against the index in _check_names_and_shapes
    if os.path.isfile(single_path):
        with safe_open(single_path, framework="numpy") as fh:
            return {name: single_path for name in fh.keys()}
    pickles = sorted(os.path.basename(p) for e in ("bin", "pt", "pth") for p in glob.glob(os.path.join(path, "*." + e)))
    if pickles:
        raise CheckpointError(
            f"{path}: only safetensors checkpoints are read, found pickle file(s) {pickles} "
            f"(pickle can execute code on load); " + _CONVERT_HINT.format(src=path)
        )
    others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
    if others:
        raise CheckpointError(
            f"{path}: found {others} but neither {SAFE_SINGLE} nor {SAFE_INDEX} "
            f"(sharded checkpoints need their index file)"
        )
    raise CheckpointError(f"{path}: no weights found (expected {SAFE_SINGLE} or {SAFE_INDEX})")


def _check_names_and_shapes(files: dict[str, str], specs: list[TensorSpec], config: Qwen2Config, path: str) -> None:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[str, list[str]] = {}
    for name, full in files.items():
        by_file.setdefault(full, []).append(name)
    for full, names in by_file.items():
        with safe_open(full, framework="numpy") as fh:
            present = set(fh.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(
                        f"{os.path.join(path, SAFE_INDEX)}: tensor {name!r} is mapped to "
                        f"{os.path.basename(full)!r} but that file does not contain it"
                    )
                shapes[name] = tuple(fh.get_slice(name).get_shape())
    expected = {s.hf_name for s in specs}
    missing = [s.hf_name for s in specs if s.hf_name not in shapes]
    if missing:
        raise CheckpointError(
            f"{path}: missing tensor {missing[0]!r} (expected shape "
            f"{next(s.hf_shape for s in specs if s.hf_name == missing[0])})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    unexpected = sorted(n for n in shapes if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    # A tied config's extra lm_head.weight is checked for equality with the embedding at load time.
    if unexpected and not (unexpected == ["lm_head.weight"] and config.tie_word_embeddings):
        raise CheckpointError(
            f"{path}: unexpected tensor {unexpected[0]!r} with shape "
            f"{shapes[unexpected[0]]} (not part of a Qwen2 model with this config.json)"
            + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else "")
        )
    for s in specs:
        if shapes[s.hf_name] != s.hf_shape:
            raise CheckpointError(
                f"{path}: tensor {s.hf_name!r} has shape {shapes[s.hf_name]} in the "
                f"checkpoint, expected {s.hf_shape} from config.json"
            )


def _read(full: str, name: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(full, framework="numpy") as fh:
        return fh.get_tensor(name)


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any | None = None,
    fingerprint_layer: int = -1,
) -> Qwen2Actor:
    """Loads a HF Qwen2/Qwen2.5 folder into a `Qwen2Actor`.

    Args:
      path: folder with config.json and model.safetensors or model.safetensors.index.json + shards.
      mesh: when given, every parameter is placed with the `NamedSharding` of the logical axes
        it declares (`bipace_jax.sharding.param_shardings`); each device receives only its shard.
      dtype: activation dtype of the actor (and parameter dtype unless `param_dtype` is given).
      param_dtype: parameter storage dtype (default: `dtype`).
      fingerprint_layer: HF hidden-state index of the fingerprint (see `Qwen2Actor`).

    Returns:
      The actor with the checkpoint's weights (cast to `param_dtype`).

    Raises:
      FileNotFoundError: `path` is not a folder or has no config.json.
      CheckpointError (a ValueError): pickle-only checkpoint (.bin, with how to convert), no
        weights, a broken index, or a missing / unexpected / mis-shaped tensor (named with both
        shapes); a tied config whose file also stores a different lm_head.weight.
      ValueError: a config.json the actor does not support.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_hf_checkpoint: {path} is not a folder")
    config = Qwen2Config.from_hf_config(path)
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    files = _weight_files(path)
    specs = hf_tensor_specs(config)
    _check_names_and_shapes(files, specs, config, path)

    kw = dict(fingerprint_layer=fingerprint_layer, dtype=dtype, param_dtype=param_dtype)
    abstract = nnx.eval_shape(lambda: Qwen2Actor(config, rngs=nnx.Rngs(0), **kw))
    graphdef, state = nnx.split(abstract)
    flat = {tuple(k): v for k, v in nnx.to_flat_state(state)}

    for s in specs:
        host = s.to_actor(_read(files[s.hf_name], s.hf_name)).astype(param_dtype)
        variable = flat[s.path]
        if host.shape != tuple(variable.shape):  # the mapping is internal; a mismatch is a bug, not user error
            raise AssertionError(f"{s.hf_name}: mapped shape {host.shape} != parameter {tuple(variable.shape)}")
        if mesh is not None:
            target = shd.logical_sharding(shd.logical_axes(variable), host.shape, mesh)
            value = jax.make_array_from_callback(host.shape, target, lambda idx, h=host: h[idx])
        else:
            value = jnp.asarray(host)
        variable.set_value(value)
        del host

    if config.tie_word_embeddings and "lm_head.weight" in files:
        head = _read(files["lm_head.weight"], "lm_head.weight")
        emb = _read(files["model.embed_tokens.weight"], "model.embed_tokens.weight")
        if head.shape != emb.shape or not np.array_equal(head, emb):
            raise CheckpointError(
                f"{path}: config.json has tie_word_embeddings=true but lm_head.weight "
                f"differs from model.embed_tokens.weight; set tie_word_embeddings=false"
            )
    state = nnx.from_flat_state([(k, v) for k, v in flat.items()])
    return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------------------------------
# Writing.
_DTYPES = ("float32", "bfloat16", "float16")


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def save_hf_checkpoint(
    actor: Qwen2Actor,
    path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    dtype: Any | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> str:
    """Writes `actor` as a HF Qwen2ForCausalLM folder (safetensors) that transformers/vLLM load.

    Files: config.json, generation_config.json (eos/bos ids), model.safetensors or, when the
    weights exceed `max_shard_bytes`, model-0000k-of-0000n.safetensors + model.safetensors.index.json;
    plus the tokenizer's files when `tokenizer` is given. Tensors are gathered to host one at a
    time (all processes must call this; only process 0 writes).

    Args:
      actor: the `Qwen2Actor`.
      path: output folder (created; existing weight files of the same names are overwritten).
      tokenizer: optional transformers tokenizer, saved with `save_pretrained`.
      dtype: storage dtype (float32, bfloat16, float16); default the actor's `param_dtype`.
      max_shard_bytes: largest shard file in bytes.

    Returns:
      `path` as a string.

    Raises:
      ValueError: unsupported dtype or non-positive max_shard_bytes.
    """
    from safetensors.numpy import save_file

    path = os.fspath(path)
    out_dtype = jnp.dtype(actor.param_dtype if dtype is None else dtype)
    if out_dtype.name not in _DTYPES:
        raise ValueError(f"save_hf_checkpoint: dtype must be one of {sorted(_DTYPES)}, got {out_dtype.name}")
    if max_shard_bytes <= 0:
        raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be > 0, got {max_shard_bytes}")
    config = actor.config
    specs = hf_tensor_specs(config)
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
    params = {tuple(k): v for k, v in nnx.to_flat_state(nnx.state(actor, nnx.Param))}

    shards: list[dict[str, np.ndarray]] = [{}]
    size = total = 0
    for s in specs:
        host = np.ascontiguousarray(s.to_hf(_to_host(params[s.path].get_value())).astype(out_dtype))
        nbytes = host.nbytes
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][s.hf_name] = host
        size += nbytes
        total += nbytes
    if writer:
        meta = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], os.path.join(path, SAFE_SINGLE), metadata=meta)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(path, fname), metadata=meta)
                weight_map.update({name: fname for name in shard})
            with open(os.path.join(path, SAFE_INDEX), "w", encoding="utf-8") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        stale = os.path.join(path, SAFE_INDEX if len(shards) == 1 else SAFE_SINGLE)  # of an earlier save
        if os.path.exists(stale):
            os.remove(stale)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(config.to_hf_dict(torch_dtype=out_dtype.name), fh, indent=2)
        gen = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else config.eos_token_id,
        }
        with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as fh:
            json.dump({k: v for k, v in gen.items() if v is not None}, fh, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    return path
