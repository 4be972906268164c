"""HF checkpoint I/O: round trips with transformers in both directions, every loader error, config, tokenizer."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bipace_jax.models import (  # noqa: E402
    CheckpointError,
    Qwen2Actor,
    Qwen2Config,
    load_hf_checkpoint,
    load_tokenizer,
    save_hf_checkpoint,
)
from bipace_jax.models.tokenizer import qwen2_5_chat_template  # noqa: E402
from tests.qwen_fixtures import random_batch, write_tiny_qwen2_checkpoint, write_tiny_tokenizer  # noqa: E402


def params_of(actor):
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(actor, nnx.Param))}


def hf_logits(model, ids, mask):
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos, dtype=torch.long),
        ).logits.numpy()


@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder_loads_and_saves_back_to_identical_tensors_and_hf_logits(tmp_path, tied):
    src = write_tiny_qwen2_checkpoint(tmp_path / "src", seed=1, tie_word_embeddings=tied)
    actor = load_hf_checkpoint(src)
    dst = save_hf_checkpoint(actor, tmp_path / "dst")
    original, written = (
        load_file(os.path.join(src, "model.safetensors")),
        load_file(os.path.join(dst, "model.safetensors")),
    )
    assert sorted(original) == sorted(written)
    assert ("lm_head.weight" in written) is (not tied)
    for name in original:
        np.testing.assert_array_equal(written[name], original[name], err_msg=name)
    ids, mask = random_batch(3, 7, 512, padding="left", seed=2)
    a = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert b.config.tie_word_embeddings is tied
    real = mask.astype(bool)
    np.testing.assert_array_equal(hf_logits(a, ids, mask)[real], hf_logits(b, ids, mask)[real])


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_actor_saved_loads_in_transformers_to_the_same_logits(tmp_path, tied):
    cfg = Qwen2Config.tiny(tie_word_embeddings=tied, num_key_value_heads=1, eos_token_id=2, bos_token_id=None)
    actor = Qwen2Actor(cfg, rngs=nnx.Rngs(5))
    tok = load_tokenizer(write_tiny_tokenizer(tmp_path / "tok"))
    path = save_hf_checkpoint(actor, tmp_path / "out", tokenizer=tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = random_batch(3, 8, cfg.vocab_size, padding="right", seed=3)
    real = mask.astype(bool)
    ours = np.asarray(actor(ids, mask).logits)
    assert np.abs(hf_logits(model, ids, mask) - ours)[real].max() <= 1e-4
    # Loading our folder back gives bit-identical parameters and the same tokenizer.
    again = load_hf_checkpoint(path)
    for k, v in params_of(actor).items():
        np.testing.assert_array_equal(params_of(again)[k], v)
    assert transformers.AutoTokenizer.from_pretrained(path).encode("craft stick") == tok.encode("craft stick")
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2


@pytest.mark.slow
def test_sharded_save_writes_an_index_that_loads_back(tmp_path):
    actor = Qwen2Actor(Qwen2Config.tiny(tie_word_embeddings=False), rngs=nnx.Rngs(6))
    path = save_hf_checkpoint(actor, tmp_path / "sharded", max_shard_bytes=60_000)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not os.path.exists(os.path.join(path, "model.safetensors"))
    assert index["weight_map"]["lm_head.weight"] in files
    again = load_hf_checkpoint(path)
    for k, v in params_of(actor).items():
        np.testing.assert_array_equal(params_of(again)[k], v)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = random_batch(2, 5, 512, padding="none")
    np.testing.assert_allclose(hf_logits(hf, ids, mask), np.asarray(actor(ids, mask).logits), atol=1e-4)


def test_bf16_save_and_load_keep_bf16_values(tmp_path):
    actor = Qwen2Actor(Qwen2Config.tiny(), rngs=nnx.Rngs(7))
    path = save_hf_checkpoint(actor, tmp_path / "bf16", dtype=jnp.bfloat16)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert load_file(os.path.join(path, "model.safetensors"))["model.norm.weight"].dtype == ml_dtypes.bfloat16
    again = load_hf_checkpoint(path, dtype=jnp.bfloat16)
    assert again.dtype == jnp.bfloat16 and again.param_dtype == jnp.bfloat16
    for k, v in params_of(actor).items():
        np.testing.assert_array_equal(params_of(again)[k], v.astype(ml_dtypes.bfloat16))


# --------------------------------------------------------------------------------------------------
# Loader errors: each corrupts a fresh tiny folder and expects a clear error naming the problem.
def _rewrite(path, fn, tied=True):
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors = fn(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _reshape_q_bias(t):
    t["model.layers.1.self_attn.q_proj.bias"] = np.zeros((63,), np.float32)
    return t


def _add_extra(t):
    t["model.layers.0.mlp.extra.weight"] = np.zeros((4, 4), np.float32)
    return t


def _add_different_head(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0
    return t


def _to_pickle(path):
    os.remove(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        f.write(b"not read")


def _shards_without_index(path):
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "model-00001-of-00002.safetensors"))


def _index(**entries):
    """A corruption that writes model.safetensors.index.json: every tensor of model.safetensors in that
    file, then ``entries`` (tensor name -> file name) on top."""

    def fn(path):
        names = load_file(os.path.join(path, "model.safetensors"))
        weight_map = {**{n: "model.safetensors" for n in names}, **entries}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": weight_map}, f)

    return fn


_index_with_missing_file = _index(**{"model.norm.weight": "model-00002-of-00002.safetensors"})
_index_naming_absent_tensor = _index(**{"model.layers.7.mlp.up_proj.weight": "model.safetensors"})


def _config(**changes):
    def fn(path):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(changes)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)

    return fn


LOADER_ERRORS = [
    (
        "missing_tensor",
        lambda p: _rewrite(p, _drop("model.layers.1.mlp.down_proj.weight")),
        CheckpointError,
        r"missing tensor 'model.layers.1.mlp.down_proj.weight' \(expected shape \(64, 128\)\)",
    ),
    (
        "unexpected_tensor",
        lambda p: _rewrite(p, _add_extra),
        CheckpointError,
        r"unexpected tensor 'model.layers.0.mlp.extra.weight' with shape \(4, 4\)",
    ),
    (
        "misshaped_tensor",
        lambda p: _rewrite(p, _reshape_q_bias),
        CheckpointError,
        r"tensor 'model.layers.1.self_attn.q_proj.bias' has shape \(63,\) in the checkpoint, expected \(64,\)",
    ),
    (
        "tied_head_differs",
        lambda p: _rewrite(p, _add_different_head),
        CheckpointError,
        r"tie_word_embeddings=true but lm_head.weight differs",
    ),
    ("pickle_only", _to_pickle, CheckpointError, r"only safetensors .*pytorch_model.bin.*save_pretrained"),
    ("shards_without_index", _shards_without_index, CheckpointError, r"need their index file"),
    (
        "index_missing_file",
        _index_with_missing_file,
        CheckpointError,
        r"shard file 'model-00002-of-00002.safetensors' for tensor 'model.norm.weight' does not exist",
    ),
    (
        "index_names_absent_tensor",
        _index_naming_absent_tensor,
        CheckpointError,
        r"tensor 'model.layers.7.mlp.up_proj.weight' is mapped to 'model.safetensors' but that file does not contain it",
    ),
    ("no_weights", lambda p: os.remove(os.path.join(p, "model.safetensors")), CheckpointError, r"no weights found"),
    ("no_config", lambda p: os.remove(os.path.join(p, "config.json")), FileNotFoundError, r"no HF config.json"),
    ("wrong_model_type", _config(model_type="llama"), ValueError, r"model_type must be 'qwen2'"),
    (
        "rope_scaling",
        _config(rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}),
        ValueError,
        r"rope type 'yarn' is not supported",
    ),
    ("sliding_window", _config(use_sliding_window=True), ValueError, r"use_sliding_window=true is not supported"),
    (
        "config_shape_mismatch",
        _config(num_key_value_heads=1),
        CheckpointError,
        r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(32, 64\) in the checkpoint, expected \(16, 64\)",
    ),
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_tiny_qwen2_checkpoint(tmp_path_factory.mktemp("pristine"), seed=3, tie_word_embeddings=True)


@pytest.mark.parametrize("corrupt,error,message", [e[1:] for e in LOADER_ERRORS], ids=[e[0] for e in LOADER_ERRORS])
def test_loader_rejects_bad_folders_with_a_clear_error(tmp_path, pristine, corrupt, error, message):
    path = tmp_path / "ckpt"
    path.mkdir()
    for name in os.listdir(pristine):
        (path / name).write_bytes(open(os.path.join(pristine, name), "rb").read())
    corrupt(str(path))
    with pytest.raises(error, match=message):
        load_hf_checkpoint(path)


def test_loader_rejects_a_path_that_is_not_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_hf_checkpoint(tmp_path / "absent")


@pytest.mark.slow
def test_tied_checkpoint_that_also_stores_an_identical_head_loads(tmp_path, pristine):
    path = tmp_path / "ckpt"
    path.mkdir()
    for name in os.listdir(pristine):
        (path / name).write_bytes(open(os.path.join(pristine, name), "rb").read())

    def add_same_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
        return t

    _rewrite(str(path), add_same_head)
    reference = load_hf_checkpoint(pristine)
    ids, mask = random_batch(2, 4, 512)
    np.testing.assert_array_equal(
        np.asarray(load_hf_checkpoint(path)(ids, mask).logits), np.asarray(reference(ids, mask).logits)
    )


# --------------------------------------------------------------------------------------------------
# Config.
def test_config_reads_both_hf_layouts_to_the_same_fields():
    new = {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "eos_token_id": 151645,
        "bos_token_id": 151643,
    }
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "dtype")}
    old.update(rope_theta=1000000.0, torch_dtype="bfloat16", rope_scaling=None, use_sliding_window=False)
    a, b = Qwen2Config.from_hf_config(new), Qwen2Config.from_hf_config(old)
    assert a == b == Qwen2Config.preset("7b", eos_token_id=151645)
    assert (a.head_dim, a.num_groups, a.rope_theta, a.torch_dtype) == (128, 7, 1e6, "bfloat16")
    assert Qwen2Config.from_hf_config(a.to_hf_dict()) == a


def test_presets_have_the_published_qwen2_5_shapes():
    rows = {  # D, L, N, K, Hd, F, V, tied (the released Qwen2.5 config.json files)
        "0.5b": (896, 24, 14, 2, 64, 4864, 151936, True),
        "1.5b": (1536, 28, 12, 2, 128, 8960, 151936, True),
        "3b": (2048, 36, 16, 2, 128, 11008, 151936, True),
        "7b": (3584, 28, 28, 4, 128, 18944, 152064, False),
    }
    for name, row in rows.items():
        c = Qwen2Config.preset(name)
        assert (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
            c.tie_word_embeddings,
        ) == row, name
        assert (c.rope_theta, c.rms_norm_eps) == (1e6, 1e-6)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_attention_heads=8, num_key_value_heads=3), "must be a multiple of num_key_value_heads=3"),
        (dict(hidden_size=60, num_attention_heads=8), "hidden_size=60 must be divisible"),
        (dict(vocab_size=0), "vocab_size must be a positive int"),
        (dict(head_dim=7), "head_dim must be a positive even int"),
    ],
)
def test_config_rejects_inconsistent_shapes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Qwen2Config.tiny(**kwargs)


def test_config_requires_the_core_fields():
    with pytest.raises(ValueError, match=r"missing required field\(s\) \['intermediate_size'\]"):
        Qwen2Config.from_hf_config(
            {"vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
        )


# --------------------------------------------------------------------------------------------------
# Tokenizer and chat template.
def test_bundled_chat_template_is_used_when_the_folder_has_none(tmp_path):
    tok = load_tokenizer(write_tiny_tokenizer(tmp_path / "tok"))
    assert tok.chat_template == qwen2_5_chat_template()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "craft stick"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\ncraft stick<|im_end|>\n<|im_start|>assistant\n"
    )
    text = tok.apply_chat_template(
        [
            {"role": "system", "content": "Play."},
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "ok"},
        ],
        tokenize=False,
    )
    assert text == (
        "<|im_start|>system\nPlay.<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    )
    ids = tok.apply_chat_template([{"role": "user", "content": "go"}], add_generation_prompt=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] != tok.eos_token_id
    with pytest.raises(Exception, match="does not support tools"):
        tok.apply_chat_template(
            [{"role": "user", "content": "go"}],
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}},
                }
            ],
            tokenize=False,
        )


def test_folder_chat_template_is_kept(tmp_path):
    tok = load_tokenizer(write_tiny_tokenizer(tmp_path / "tok", chat_template="{{ messages[0]['content'] }}"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_load_tokenizer_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no loadable tokenizer"):
        load_tokenizer(tmp_path / "empty")
