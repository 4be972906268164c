"""Sampler throughput: our jitted KV-cache sampler vs Hugging Face ``generate()`` (torch, CPU).

    python -m launch.bench_sampler                      # CPU: writes benchmarks/sampler.json
    python -m launch.bench_sampler --models=tiny --batches=16,64 --new_tokens=64 --reps=5

Both sides run the same random Qwen2 checkpoint (``tiny.random_hf_qwen2``, loaded by
``load_hf_checkpoint``), the same left-padded prompts (96-128 tokens), greedy decoding and the same
new-token budget, so they produce the same tokens (checked: ``tokens_match_hf``). Models: ``tiny``
(the tests' tiny Qwen2: V 512, D 64, 2 layers; the headline) and ``small`` (V 2048, D 256, 4 layers).
Measured per model and batch size (16 and 64):

* prefill tokens/s: real prompt tokens / time of the prompt pass (ours: the jitted prefill program,
  first token included; HF: one ``model(...)`` forward with ``use_cache=True, logits_to_keep=1``,
  what ``generate`` runs first);
* decode tokens/s: generated tokens / (whole call - prefill) (ours: the on-device decode loop);
* end to end: generated tokens / whole call;
* ours also: ``decode_ms_per_step``, the decode loop's time per step (all rows advance together).

``speedup_vs_hf`` is the smallest end-to-end ratio (HF time / our time) over the batch sizes on the
first model of ``--models`` (target: >= 3 on CPU). Each measurement is the median of ``--reps`` runs,
ours and HF alternating, each timed run right after an untimed run of the same side (``--warm_each``);
compilation is reported as ``compile_s`` and excluded; torch runs with its faster thread count (1 or
all cores). Why this protocol, and past results: docs/performance.md.

On a GPU backend: the Qwen2.5 0.5B and 1.5B presets with random bf16 weights against the HBM roofline
``B * bandwidth / (parameter bytes + B * mean context * KV bytes per token)`` (a decode step reads
every parameter and the KV cache so far), written to ``benchmarks/sampler_gpu.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time

from absl import app, flags

from launch._common import seconds, write_json

FLAGS = flags.FLAGS
flags.DEFINE_string("batches", "16,64", "comma-separated batch sizes")
flags.DEFINE_string("models", "tiny,small", "CPU models (keys of BENCH_MODELS); the first gives speedup_vs_hf")
flags.DEFINE_integer("new_tokens", 64, "new tokens per response (budget, both sides)")
flags.DEFINE_integer("prompt_min", 96, "shortest prompt (tokens)")
flags.DEFINE_integer("prompt_max", 128, "longest prompt (tokens)")
flags.DEFINE_integer("reps", 21, "timed repetitions per measurement (median reported)")
flags.DEFINE_string("out", "benchmarks/sampler.json", "JSON output path")
flags.DEFINE_bool("skip_hf", False, "skip the torch baseline")
flags.DEFINE_bool("warm_each", True, "run each side once, untimed, right before each of its timed runs")
flags.DEFINE_float("hbm_gbps", 0.0, "GPU memory bandwidth in GB/s for the roofline (0: from the device kind)")
flags.DEFINE_string("gpu_presets", "0.5b,1.5b", "Qwen2Config.preset names measured on a GPU backend")
flags.DEFINE_integer("gpu_prompt", 512, "prompt length on the GPU presets")
flags.DEFINE_integer("gpu_new_tokens", 256, "new tokens on the GPU presets")

# CPU benchmark models (overrides of Qwen2Config.tiny()). "tiny" is the tests' tiny Qwen2: per-step overheads
# dominate. "small" has 16x the matrix work per token, where both sides approach the CPU's arithmetic limit.
BENCH_MODELS = {
    "tiny": {},
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4),
}

# Peak HBM bandwidth by device kind substring (GB/s, vendor data sheets).
_HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0, "A10": 600.0, "V100": 900.0}


def _tokenizer(vocab_size: int):
    """A byte-level BPE with Qwen's special tokens (the sampler needs EOS ids and token texts)."""
    from bipace_jax.tiny import train_tokenizer

    corpus = ["<think>craft the planks</think><action>craft 4 oak planks using 1 oak log</action>"] * 50
    return train_tokenizer(
        corpus, vocab_size=min(vocab_size, 600), tags=(), min_frequency=0, chat_template=None, model_max_length=None
    )


def _prompts(n: int, vocab: int, lo: int, hi: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _ours_runner(actor, tok, prompts, new_tokens):
    """(run, compile_s): ``run()`` -> (SampleOutput, total_s, prefill_s, decode_s), compiled and warm."""
    import jax

    from bipace_jax.sampling import Engine, SamplerConfig

    cfg = SamplerConfig(
        max_new_tokens=new_tokens,
        greedy=True,
        stop_strings=(),
        batch_buckets=(len(prompts),),
        length_buckets=(max(FLAGS.prompt_max, 8),),
    )
    sampler = Engine(tok, cfg)
    key = jax.random.key(0)

    def run():
        t0 = time.perf_counter()
        out = sampler.generate(actor, prompts, key)
        total = time.perf_counter() - t0
        return out, total, out.timing.prefill_s, out.timing.decode_s

    return run, seconds(run)  # compile + warm-up


def _hf_runner(folder, prompts, new_tokens, pad_id, eos_ids, support):
    """(run, threads, trial): ``run()`` -> (new tokens int[B, M'], total_s, prefill_s), warm, with the
    fastest torch thread count (torch's intra-op threads spin; on a loaded machine one thread can be
    several times faster than all cores, so the baseline gets its best setting)."""
    import torch
    import transformers

    model = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run():
        with torch.no_grad():
            t0 = time.perf_counter()
            # The prompt pass generate() starts with (it passes logits_to_keep=1: last column's logits only).
            model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            t1 = time.perf_counter()
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=list(eos_ids),
                pad_token_id=pad_id,
                # Ours draws only ids the tokenizer has (below `support`); the same support for HF's argmax.
                suppress_tokens=list(range(support, model.config.vocab_size)) or None,
            )
            t2 = time.perf_counter()
        return gen[:, width:].numpy(), t2 - t1, t1 - t0

    trial = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        run()  # warm-up
        trial[threads] = run()[1]
    threads = min(trial, key=trial.get)
    torch.set_num_threads(threads)
    return run, threads, trial


def _side(times, n_prompt: float, new: float, **extra) -> dict:
    """Medians of (total_s, prefill_s, decode_s) rows, ``extra`` and the tokens/s they give."""
    t = {k: statistics.median(r[i] for r in times) for i, k in enumerate(("total_s", "prefill_s", "decode_s"))}
    return dict(
        t,
        **extra,
        prefill_tok_s=n_prompt / t["prefill_s"],
        decode_tok_s=new / t["decode_s"],
        end_to_end_tok_s=new / t["total_s"],
    )


def run_cpu_model(name: str, overrides: dict) -> dict:
    import numpy as np

    from bipace_jax.models import Qwen2Config, load_hf_checkpoint
    from bipace_jax.tiny import random_hf_qwen2

    cfg = Qwen2Config.tiny(**overrides)
    folder = tempfile.mkdtemp(prefix=f"bench_sampler_{name}_")
    random_hf_qwen2(cfg, path=folder)
    tok = _tokenizer(cfg.vocab_size)
    actor = load_hf_checkpoint(folder)
    result = {"model": dataclasses.asdict(cfg), "batches": {}}
    for b in [int(x) for x in FLAGS.batches.split(",")]:
        prompts = _prompts(b, cfg.vocab_size, FLAGS.prompt_min, FLAGS.prompt_max, seed=b)
        n_prompt = float(sum(map(len, prompts)))
        ours_run, compile_s = _ours_runner(actor, tok, prompts, FLAGS.new_tokens)
        hf_run = None
        if not FLAGS.skip_hf:
            hf_run, threads, trial = _hf_runner(
                folder, prompts, FLAGS.new_tokens, tok.pad_token_id, (tok.eos_token_id,), len(tok)
            )
        # Alternating sides, medians over reps, each timed call after an untimed one (module docstring).
        ours_t, hf_t = [], []
        for _ in range(FLAGS.reps):
            if FLAGS.warm_each:
                ours_run()
            out, total, pre, dec = ours_run()
            ours_t.append((total, pre, dec))
            if hf_run is not None:
                if FLAGS.warm_each:
                    hf_run()
                hf_tokens, total, pre = hf_run()
                hf_t.append((total, pre, total - pre))
        new = float(out.lengths.sum())
        steps = int(out.lengths.max()) - 1  # decode-loop iterations (the first token comes from the prefill)
        ours = _side(ours_t, n_prompt, new, compile_s=compile_s, decode_steps=steps)
        ours["decode_ms_per_step"] = 1e3 * ours["decode_s"] / max(steps, 1)
        row = {"prompt_tokens": n_prompt, "new_tokens": new, "ours": ours}
        if hf_run is not None:
            trial_s = {str(k): v for k, v in trial.items()}
            hf = row["hf"] = _side(hf_t, n_prompt, new, torch_threads=threads, threads_trial_s=trial_s)
            n = out.lengths
            row["tokens_match_hf"] = float(
                np.mean([np.array_equal(out.tokens[i, : n[i]], hf_tokens[i, : n[i]]) for i in range(b)])
            )
            for what, k in (("prefill", "prefill_s"), ("decode", "decode_s"), ("end_to_end", "total_s")):
                row[f"speedup_{what}"] = hf[k] / ours[k]
        result["batches"][str(b)] = row
        print(name, b, json.dumps({k: v for k, v in row.items() if k.startswith("speedup")}), flush=True)
    speedups = [r["speedup_end_to_end"] for r in result["batches"].values() if "speedup_end_to_end" in r]
    if speedups:
        result["speedup_end_to_end_min"] = min(speedups)
    return result


def run_cpu() -> dict:
    import jax

    results = {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "new_tokens": FLAGS.new_tokens,
        "prompt_tokens": [FLAGS.prompt_min, FLAGS.prompt_max],
        "reps": FLAGS.reps,
        "warm_each": FLAGS.warm_each,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "models": {},
    }
    names = [m for m in FLAGS.models.split(",") if m]
    for name in names:
        results["models"][name] = run_cpu_model(name, BENCH_MODELS[name])
    head = results["models"][names[0]]
    if "speedup_end_to_end_min" in head:
        results["speedup_vs_hf"] = head["speedup_end_to_end_min"]
        results["speedup_vs_hf_model"] = names[0]
    results["load_average_at_end"] = list(os.getloadavg())
    return results


def run_gpu() -> dict:
    """Qwen2.5 presets (random bf16 weights) against the HBM roofline; GPU backends only."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bipace_jax.models import Qwen2Actor, Qwen2Config
    from bipace_jax.sampling import Engine, SamplerConfig

    kind = str(jax.devices()[0].device_kind)
    gbps = FLAGS.hbm_gbps or next((v for k, v in _HBM_GBPS.items() if k in kind), 0.0)
    tok = _tokenizer(600)
    out = dict(device=kind, hbm_gbps=gbps, prompt=FLAGS.gpu_prompt, new_tokens=FLAGS.gpu_new_tokens, presets={})
    for name in [p for p in FLAGS.gpu_presets.split(",") if p]:
        cfg = Qwen2Config.preset(name)
        actor = Qwen2Actor(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
        out["presets"][name] = {"param_bytes": int(param_bytes), "batches": {}}
        for b in [int(x) for x in FLAGS.batches.split(",")]:
            prompts = _prompts(b, min(600, cfg.vocab_size), FLAGS.gpu_prompt, FLAGS.gpu_prompt, seed=b)
            scfg = SamplerConfig(
                max_new_tokens=FLAGS.gpu_new_tokens,
                greedy=True,
                stop_strings=(),
                eos_token_ids=(cfg.vocab_size - 1,),
                batch_buckets=(b,),
                length_buckets=(FLAGS.gpu_prompt,),
            )
            sampler = Engine(tok, scfg)
            sampler.generate(actor, prompts, jax.random.key(0))
            times = []
            for _ in range(FLAGS.reps):
                res = sampler.generate(actor, prompts, jax.random.key(0))
                times.append(dataclasses.asdict(res.timing))
            t = {k: statistics.median(x[k] for x in times) for k in times[0]}
            steps = FLAGS.gpu_new_tokens - 1
            kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # k+v, bf16
            mean_ctx = FLAGS.gpu_prompt + FLAGS.gpu_new_tokens / 2
            step_bytes = param_bytes + b * mean_ctx * kv_per_token
            roof = b * gbps * 1e9 / step_bytes if gbps else float("nan")
            decode_tok_s = b * steps / t["decode_s"]
            out["presets"][name]["batches"][str(b)] = {
                "prefill_tok_s": t["prompt_tokens"] / t["prefill_s"],
                "decode_tok_s": decode_tok_s,
                "roofline_decode_tok_s": roof,
                "fraction_of_roofline": decode_tok_s / roof if gbps else None,
                "new_tokens": float(res.lengths.sum()),
                **t,
            }
        del actor
    return out


def _table(results: dict) -> str:
    lines = [
        f"{'model':>5} | {'batch':>5} | {'side':>4} | {'prefill tok/s':>13} | {'decode tok/s':>12} | "
        f"{'e2e tok/s':>9} | speedup e2e"
    ]
    for name, res in results.get("models", {}).items():
        for b, row in res["batches"].items():
            for side in ("ours", "hf"):
                if side in row:
                    r = row[side]
                    sp = f"{row['speedup_end_to_end']:.2f}x" if side == "ours" and "speedup_end_to_end" in row else ""
                    lines.append(
                        f"{name:>5} | {b:>5} | {side:>4} | {r['prefill_tok_s']:>13.0f} | "
                        f"{r['decode_tok_s']:>12.0f} | {r['end_to_end_tok_s']:>9.0f} | {sp}"
                    )
    for name, p in results.get("gpu", {}).get("presets", {}).items():
        for b, r in p["batches"].items():
            lines.append(
                f"{name} B={b}: prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.0f} tok/s, "
                f"roofline {r['roofline_decode_tok_s']:.0f} tok/s ({(r['fraction_of_roofline'] or 0):.0%})"
            )
    return "\n".join(lines)


def main(argv):
    del argv
    import jax

    results = run_cpu() if jax.default_backend() == "cpu" else {"backend": jax.default_backend()}
    if jax.default_backend() == "gpu":
        results["gpu"] = run_gpu()
    print(_table(results))
    if "speedup_vs_hf" in results:
        print(
            f"speedup_vs_hf ({results['speedup_vs_hf_model']} model, min end-to-end over batches): "
            f"{results['speedup_vs_hf']:.2f}x"
        )
    out = FLAGS.out
    if jax.default_backend() != "cpu" and out == flags.FLAGS["out"].default:
        out = "benchmarks/sampler_gpu.json"  # keep the CPU-vs-HF headline file
    write_json(out, results, indent=2, sort_keys=True)


if __name__ == "__main__":
    app.run(main)
