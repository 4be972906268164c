"""Test helpers: tiny Hugging Face Qwen2 checkpoints and a tiny tokenizer, written offline.

Nothing is downloaded. Checkpoints are real `transformers.Qwen2ForCausalLM` models (torch, fp32)
saved with `save_pretrained` (safetensors), with every weight (including q/k/v biases and RMSNorm
scales) drawn at random so that parity tests exercise all of them. The tokenizer is a byte-level
BPE trained with `tokenizers` on a small built-in corpus, with Qwen's special tokens.

Typical use (other test files import these):

    from tests.qwen_fixtures import write_tiny_qwen2_folder
    path = write_tiny_qwen2_folder(tmp_path / "ckpt")          # config.json, model.safetensors, tokenizer
    actor = bipace_jax.models.load_hf_checkpoint(path)
    tok = bipace_jax.models.load_tokenizer(path)

Importing this module imports torch and transformers: only tests and benchmarks may use it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "TINY_KWARGS",
    "SPECIAL_TOKENS",
    "hf_tiny_config",
    "build_hf_model",
    "write_tiny_qwen2_checkpoint",
    "write_tiny_tokenizer",
    "write_tiny_qwen2_folder",
    "random_batch",
    "one_layer_config",
    "random_token_batch",
]

# Default tiny architecture (HF Qwen2Config keyword names). Matches `Qwen2Config.tiny()`.
TINY_KWARGS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Qwen2.5's special tokens, in this order they get ids 0, 1, 2 in the tiny tokenizer.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS_WORDS = (
    "craft get inventory stick planks oak log stone pickaxe crafting table iron ingot nugget "
    "go to open close take put in on from the a an you are in the middle of a room looking "
    "quickly around you see cabinet drawer countertop fridge microwave sinkbasin apple mug "
    "think action observation task goal nothing happens could not find execute got crafted "
    "minecraft item 1 2 3 4 5 6 7 8 9 0 . , : ; ! ? < > / ( ) [ ] yes no step"
).split()


def hf_tiny_config(**overrides):
    """A `transformers.Qwen2Config` with `TINY_KWARGS` updated by `overrides` (fp32, eager attention)."""
    import transformers

    kwargs = {**TINY_KWARGS, **overrides}
    rope_theta = kwargs.pop("rope_theta")
    cfg = transformers.Qwen2Config(**kwargs, rope_parameters={"rope_theta": rope_theta, "rope_type": "default"})
    cfg._attn_implementation = "eager"
    return cfg


def build_hf_model(seed: int = 0, weight_std: float = 0.08, **overrides):
    """A random fp32 `Qwen2ForCausalLM` (eval mode) of the tiny config updated by `overrides`.

    Every parameter is redrawn from N(0, weight_std) with `torch.manual_seed(seed)`; RMSNorm
    scales are 1 + N(0, weight_std) so none of them is the identity.
    """
    import torch
    import transformers

    cfg = hf_tiny_config(**overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, dtype=torch.float32) * weight_std
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


def write_tiny_qwen2_checkpoint(path: str | os.PathLike, seed: int = 0, weight_std: float = 0.08, **overrides) -> str:
    """Writes a random tiny HF Qwen2 checkpoint (config.json + model.safetensors) to `path`.

    `overrides` are HF Qwen2Config keywords (e.g. tie_word_embeddings=False, num_key_value_heads=1).
    Returns `path` as a string.
    """
    model = build_hf_model(seed=seed, weight_std=weight_std, **overrides)
    path = os.fspath(path)
    model.save_pretrained(path)
    return path


def write_tiny_tokenizer(
    path: str | os.PathLike,
    vocab_size: int = 384,
    chat_template: str | None = None,
    corpus: Sequence[str] | None = None,
) -> str:
    """Trains a byte-level BPE (`vocab_size` tokens incl. Qwen's special tokens) on `corpus` (None: 400
    random 12-word lines of a fixed word list, seed 0) and saves it to `path`.

    Special tokens: <|endoftext|> (id 0, pad), <|im_start|> (id 1), <|im_end|> (id 2, eos).
    No chat template is stored unless `chat_template` is given, so `load_tokenizer` falls back to
    the bundled Qwen2.5 template. Returns `path` as a string.
    """
    from transformers import PreTrainedTokenizerFast

    from bipace_jax.tiny import train_bpe

    if corpus is None:
        rng = np.random.default_rng(0)
        corpus = [" ".join(rng.choice(_CORPUS_WORDS, size=12)) for _ in range(400)]
    tok = train_bpe(corpus, vocab_size=vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    path = os.fspath(path)
    fast.save_pretrained(path)
    return path


def write_tiny_qwen2_folder(
    path: str | os.PathLike, seed: int = 0, tokenizer_vocab_size: int = 384, **overrides
) -> str:
    """A complete tiny folder: HF checkpoint (see `write_tiny_qwen2_checkpoint`) + tokenizer.

    The model vocabulary (default 512) must be >= `tokenizer_vocab_size`.
    """
    write_tiny_qwen2_checkpoint(path, seed=seed, **overrides)
    write_tiny_tokenizer(path, vocab_size=tokenizer_vocab_size)
    return os.fspath(path)


def one_layer_config(vocab_size: int, heads: int = 4, kv_heads: int = 2, layers: int = 1):
    """`Qwen2Config.tiny` cut to one layer (``layers`` when given; D 32, F 64) of `heads` query and
    `kv_heads` KV heads over `vocab_size` ids: the smallest actor the learner tests train."""
    from bipace_jax.models import Qwen2Config

    return Qwen2Config.tiny(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def random_token_batch(rng: np.random.Generator, rows: int, prompt: int, response: int, vocab_size: int):
    """A learner's `TokenBatch` of `rows` random rows: a left-padded prompt of 2..`prompt` ids and a
    right-padded response of 1..`response` ids each, ids in [3, vocab_size) (0-2: Qwen's special tokens),
    drawn from `rng` row by row (prompt length, response length, prompt ids, response ids)."""
    from bipace_jax.batch import TokenBatch

    pid, pm = np.zeros((rows, prompt), np.int32), np.zeros((rows, prompt), np.int32)
    rid, rm = np.zeros((rows, response), np.int32), np.zeros((rows, response), bool)
    for i in range(rows):
        lp, lr = rng.integers(2, prompt + 1), rng.integers(1, response + 1)
        pid[i, prompt - lp :] = rng.integers(3, vocab_size, lp)
        pm[i, prompt - lp :] = 1
        rid[i, :lr] = rng.integers(3, vocab_size, lr)
        rm[i, :lr] = True
    return TokenBatch(np.concatenate([pid, rid], 1), np.concatenate([pm, rm.astype(np.int32)], 1), rid, rm, prompt)


def random_batch(
    batch: int, length: int, vocab_size: int, padding: str = "left", seed: int = 0, min_real: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Random (input_ids int32[B, T], attention_mask int32[B, T]) with varied real lengths.

    padding: "left" (real tokens at the end of each row), "right", or "none". Row 0 is always
    full length; other rows have between `min_real` and T real tokens. Pad ids are 0.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    if padding != "none":
        for b in range(1, batch):
            n = int(rng.integers(min_real, length + 1))
            if padding == "left":
                mask[b, : length - n] = 0
            elif padding == "right":
                mask[b, n:] = 0
            else:
                raise ValueError(f"padding must be 'left', 'right' or 'none', got {padding!r}")
    ids = np.where(mask == 1, ids, 0).astype(np.int32)
    return ids, mask
