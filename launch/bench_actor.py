"""Forward throughput of the jitted Qwen2Actor against HF transformers (torch) on the same model.

    python -m launch.bench_actor [--batch 8] [--length 256] [--repeats 5] [--out benchmarks/actor.json]

CPU (always): a small Qwen2 (`CPU_CONFIG`: D 256, L 4, N 8, K 2, F 1024, V 2048) with random weights
(`tiny.random_hf_qwen2`, torch fp32) is loaded into the actor, so both sides run identical weights on
the same batch; warm-up, then `--repeats` runs alternating the two sides. Reported: median forward
tokens/s (B*T / seconds; ours includes the fingerprint), `speedup_vs_hf`, max |logit difference|.

GPU/TPU (when JAX's default backend is not cpu): also the Qwen2.5-0.5B and 1.5B presets with random
bf16 weights (no download): forward tokens/s and model-FLOPs utilisation (MFU) against the chip's
dense bf16 peak (table below; `--peak_tflops` overrides). Forward FLOPs = 2 * matmul params * tokens
+ 2 * L * N * Hd * B * T^2 (causal QK^T and AV, each half of a full T x T product).

Writes a table to stdout and JSON to `--out` (benchmarks/actor.json).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bipace_jax.models import Qwen2Actor, Qwen2Config, count_params, load_hf_checkpoint
from launch._common import seconds, write_json

# Dense bf16 peak TFLOP/s per chip, by substring of `device_kind` (vendor data sheets).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L4": 121.0,
    "A10": 125.0,
    "TPU v6": 918.0,
    "TPU v5p": 459.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v4": 275.0,
}

# The CPU comparison's model: overrides of Qwen2Config.tiny() (D 256, L 4, N 8, K 2, F 1024, V 2048, untied).
CPU_CONFIG = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rope_theta=1e6,
)


def _batch(batch: int, length: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    for b in range(1, batch):  # left padding of up to a quarter of the row
        mask[b, : int(rng.integers(0, length // 4 + 1))] = 0
    return ids, mask


def _jitted_forward(actor):
    graphdef, state = nnx.split(actor)

    @jax.jit
    def forward(state, ids, mask):
        out = nnx.merge(graphdef, state)(ids, mask)
        return out.logits, out.fingerprint

    return lambda ids, mask: jax.block_until_ready(forward(state, ids, mask))


def bench_cpu(batch: int, length: int, repeats: int) -> dict:
    """Our jitted actor vs HF torch on the same small model, batch and length."""
    import torch
    import transformers

    from bipace_jax.tiny import random_hf_qwen2

    with tempfile.TemporaryDirectory() as tmp:
        model = random_hf_qwen2(Qwen2Config.tiny(**CPU_CONFIG), weight_std=0.02, path=tmp)
        actor = load_hf_checkpoint(tmp)
    ids, mask = _batch(batch, length, CPU_CONFIG["vocab_size"])
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    t_ids, t_mask, t_pos = (torch.tensor(x, dtype=torch.long) for x in (ids, mask, pos))

    def hf():
        with torch.inference_mode():
            return model(input_ids=t_ids, attention_mask=t_mask, position_ids=t_pos).logits

    ours = functools.partial(_jitted_forward(actor), jnp.asarray(ids), jnp.asarray(mask))
    compile_s = seconds(ours)
    logits, _ = ours()
    max_err = float(np.abs(np.asarray(logits) - hf().numpy())[mask.astype(bool)].max())
    times_ours, times_hf = [], []
    for _ in range(repeats):  # the two sides interleaved, so load from other processes hits both alike
        times_ours.append(seconds(ours))
        times_hf.append(seconds(hf))
    ours_s, hf_s = statistics.median(times_ours), statistics.median(times_hf)
    return {
        "config": CPU_CONFIG,
        "batch": batch,
        "length": length,
        "repeats": repeats,
        "jax_forward_tokens_per_s": batch * length / ours_s,
        "hf_torch_forward_tokens_per_s": batch * length / hf_s,
        "speedup_vs_hf": hf_s / ours_s,
        "jax_compile_s": compile_s,
        "jax_median_s": ours_s,
        "hf_median_s": hf_s,
        "max_abs_logit_diff": max_err,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def forward_flops(cfg: Qwen2Config, batch: int, length: int) -> float:
    """Model FLOPs of one forward over [batch, length] (see module docstring)."""
    matmul_params = count_params(cfg) - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    # The embedding lookup is not a matmul; the head is (when tied, the embedding is the head).
    dense = 2.0 * matmul_params * batch * length
    attention = 2.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * batch * length**2
    return dense + attention


def bench_accelerator(batch: int, length: int, repeats: int, peak_tflops: float | None) -> list[dict]:
    """0.5B and 1.5B presets in bf16 with random weights: tokens/s and MFU on one chip."""
    kind = jax.devices()[0].device_kind
    peak = peak_tflops
    if peak is None:
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k.lower() in kind.lower()), None)
    rows = []
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        cfg = Qwen2Config.preset(name)
        actor = Qwen2Actor(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        ids, mask = _batch(batch, length, cfg.vocab_size)
        run = functools.partial(_jitted_forward(actor), jnp.asarray(ids), jnp.asarray(mask))
        compile_s = seconds(run)
        sec = statistics.median(seconds(run) for _ in range(repeats))
        flops = forward_flops(cfg, batch, length)
        rows.append(
            {
                "model": name,
                "batch": batch,
                "length": length,
                "dtype": "bfloat16",
                "forward_tokens_per_s": batch * length / sec,
                "median_s": sec,
                "compile_s": compile_s,
                "model_tflops_per_s": flops / sec / 1e12,
                "peak_bf16_tflops": peak,
                "mfu": (flops / sec / 1e12 / peak) if peak else None,
                "device_kind": kind,
            }
        )
        del actor, run
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--accel_batch", type=int, default=16)
    parser.add_argument("--accel_length", type=int, default=1024)
    parser.add_argument("--peak_tflops", type=float, default=None)
    parser.add_argument("--skip_cpu", action="store_true", help="on an accelerator, skip the torch comparison")
    parser.add_argument("--out", default=os.path.join("benchmarks", "actor.json"))
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    result = {
        "backend": backend,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if backend == "cpu" or not args.skip_cpu:
        with jax.default_device(jax.devices("cpu")[0]):  # HF runs on the CPU; so does our actor here
            cpu = bench_cpu(args.batch, args.length, args.repeats)
        result.update(cpu)
        print(f"\nForward, {args.batch} x {args.length} tokens, config {CPU_CONFIG} (fp32, CPU)")
        print(f"{'implementation':<28}{'tokens/s':>12}{'median s':>11}")
        print(f"{'bipace_jax (jit)':<28}{cpu['jax_forward_tokens_per_s']:>12.0f}{cpu['jax_median_s']:>11.4f}")
        print(
            f"{'HF transformers (torch)':<28}{cpu['hf_torch_forward_tokens_per_s']:>12.0f}{cpu['hf_median_s']:>11.4f}"
        )
        print(f"speedup_vs_hf = {cpu['speedup_vs_hf']:.2f}x   max |dlogit| = {cpu['max_abs_logit_diff']:.2e}")
    if backend != "cpu":
        rows = bench_accelerator(args.accel_batch, args.accel_length, args.repeats, args.peak_tflops)
        result["accelerator"] = rows
        print(f"\nForward on {rows[0]['device_kind']}, bf16, {args.accel_batch} x {args.accel_length} tokens")
        print(f"{'model':<16}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}")
        for r in rows:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
            print(f"{r['model']:<16}{r['forward_tokens_per_s']:>12.0f}{r['model_tflops_per_s']:>10.1f}{mfu:>8}")
    write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
