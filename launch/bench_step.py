"""The learner's and the sampler's programs on the current chip, measured beside `step_time`'s model.

    python -m launch.bench_step                                  # CPU: --preset=cpu -> benchmarks/step_cpu.json
    python -m launch.bench_step --preset=0.5b,1.5b               # accelerator: benchmarks/step_<device>.json
    python -m launch.bench_step --preset=0.5b --layers=2 --rows=4 --micro_batch=2 --prompt_tokens=256 \
        --response_tokens=256 --decode_batches=2 --decode_prompt=64 --new_tokens=8     # shape check on CPU

Programs (``--programs``, each in its own try/except, the JSON rewritten after each):

* ``logprobs``: ``PPOLearner.logprobs`` over ``--rows`` rows (micro-batches of ``--micro_batch`` rows),
  the pass the trainer runs for the old and the reference log-probs.
* ``update``: ``PPOLearner.update`` over the same rows, one optimizer step (``mini_batch_rows`` 0):
  the host-copy release, every micro-batch's gradient, the AdamW step, the host-copy refresh. Also
  ``accumulate_s``: one micro-batch's gradient program alone, its inputs already on the device.
* ``sampler``: ``sampling.Engine.generate`` at each of ``--decode_batches`` (prompts of ``--decode_prompt``
  tokens, ``--new_tokens`` new, greedy, no stop text): the prefill program and the decode loop.
* ``pack``: the update unpacked vs packed (``PPOLearner.pack``) on 2 x ``--rows`` rows of paper-like
  lengths (prompts uniform in 0.156-0.288 P real tokens, 320-590 at P 2048; responses lognormal with
  mean 0.293 M, log-sigma 0.8, cut to 1..M: mean 150 at M 512) in a batch whose prompt width is their
  smallest power-of-two bucket, unpacked micro-batches cut to the prompt buckets 128 ... P as the
  trainer does: ``speedup_update`` and each arm's real-token share of the processed tokens.

Presets: ``0.5b`` / ``1.5b`` are the ALFWorld paper config's learner shapes (configs/
alfworld_qwen2_5_1_5b.py: prompt P 2048, response M 512, micro-batch 8, bf16 compute over fp32
parameters, remat full, scanned layers, LM-head chunk 128; 16 rows = two micro-batches) and decode at
B 16 / 64 with a 512-token prompt and 256 new tokens; ``cpu`` is the CPU default's tiny Qwen2
(configs/textcraft_tiny.py: D 128, L 3, V 1024, P 448, M 32, micro-batch 32, fp32). Weights are random
(``nnx.Rngs(0)``), allocated on the device by the actor's own initialisers; nothing is read from disk
or a hub. Every row is full (all P + M tokens real), so tokens/s counts real tokens.

Each program: the first call (compile + one run) and the median of ``--reps`` steady calls;
``compile_s`` = first - median. Modelled: `step_time.program_costs` on one chip (``logprobs`` per
micro-batch x micro-batches; ``ppo_grad`` x micro-batches + ``ppo_apply``; ``prefill``; ``decode_step``
at the mean context x decode steps), reported as ``measured_over_model``. Model FLOPs utilisation
(``mfu``): model FLOPs / seconds / the chip's peak, counting forward = 2 x matmul params x tokens +
causal attention + the LM head on the response positions (`step_time.ModelShape.forward_flops`), the
backward as 2 forwards: the log-prob pass 1 forward, the update 3 (``hfu`` adds the forward that full
remat recomputes: 4). Decode: ``hbm_fraction`` = the roofline's memory seconds (every weight and the
KV cache so far read once per step) / measured seconds. Peak memory: ``device.memory_stats()``'s
``peak_bytes_in_use`` after the program (cumulative over the process; None where the backend has none).

The chip: `step_time.chip_for(device_kind)` (the H200's row: 989 TFLOP/s dense bf16, 4.8 TB/s,
141 GB, https://www.nvidia.com/en-us/data-center/h200/); on a CPU, peaks measured here (an fp32
matmul and an array copy); ``--peak_tflops`` / ``--hbm_gbps`` override either.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import os
import platform
import re
import statistics
import subprocess
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bipace_jax import step_time
from launch._common import ROOT, write_json

PROGRAMS = ("logprobs", "update", "sampler", "pack")


@dataclasses.dataclass(frozen=True)
class Preset:
    """One benchmark setting: the model and the shapes of its programs."""

    model: str  # Qwen2Config.preset name, or "tiny" (with `tiny`'s overrides)
    dtype: str
    param_dtype: str
    remat: str
    scan_layers: bool
    logprob_chunk: int
    prompt_tokens: int  # P of the learner's rows
    response_tokens: int  # M
    micro_batch: int
    rows: int
    decode_batches: tuple[int, ...]
    decode_prompt: int
    new_tokens: int
    fingerprint_layer: int = -1
    tiny: tuple[tuple[str, int], ...] = ()


_PAPER = dict(
    dtype="bfloat16",
    param_dtype="float32",
    remat="full",
    scan_layers=True,
    logprob_chunk=128,
    prompt_tokens=2048,
    response_tokens=512,
    micro_batch=8,
    rows=16,
    decode_batches=(16, 64),
    decode_prompt=512,
    new_tokens=256,
    fingerprint_layer=-12,
)
PRESETS = {
    "0.5b": Preset(model="0.5b", **_PAPER),
    "1.5b": Preset(model="1.5b", **_PAPER),
    "cpu": Preset(
        model="tiny",
        dtype="float32",
        param_dtype="float32",
        remat="none",
        scan_layers=False,
        logprob_chunk=0,
        prompt_tokens=448,
        response_tokens=32,
        micro_batch=32,
        rows=64,
        decode_batches=(16, 64),
        decode_prompt=128,
        new_tokens=32,
        tiny=(
            ("vocab_size", 1024),
            ("hidden_size", 128),
            ("num_hidden_layers", 3),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("intermediate_size", 384),
        ),
    ),
}


def device_name(kind: str) -> str:
    """``device_kind`` as a file-name part: ``"NVIDIA H200"`` -> ``nvidia_h200``, ``"cpu"`` -> ``cpu``."""
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"


def timed(fn, reps: int) -> dict:
    """``fn()`` once (compile + run), then ``reps`` times: first, median, min seconds and compile_s."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return dict(first_s=first, median_s=med, min_s=min(times), compile_s=max(first - med, 0.0), reps=reps), out


def memory() -> dict:
    """The default device's ``memory_stats()`` peak and current bytes (None where the backend has none)."""
    try:
        s = jax.devices()[0].memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        s = {}
    gib = lambda k: s[k] / 2**30 if k in s else None  # noqa: E731
    return dict(peak_gib=gib("peak_bytes_in_use"), in_use_gib=gib("bytes_in_use"), limit_gib=gib("bytes_limit"))


def measured_cpu_chip() -> step_time.Chip:
    """A `Chip` of this CPU's measured peaks: an fp32 1024^3 matmul's FLOP/s and a 128 MiB array's
    read+write bytes/s (best of 5 each); no data sheet applies."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    flop_s = max(2 * n**3 / _secs(lambda: mm(a).block_until_ready()) for _ in range(5))
    x = jnp.ones((32 << 20,), jnp.float32)
    cp = jax.jit(lambda v: v * 2.0)
    cp(x).block_until_ready()
    bytes_s = max(2 * x.nbytes / _secs(lambda: cp(x).block_until_ready()) for _ in range(5))
    return step_time.Chip("cpu", flop_s, bytes_s, 0, None, "measured here: fp32 1024^3 matmul, 128 MiB copy")


def _secs(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def the_chip(peak_tflops: float, hbm_gbps: float) -> step_time.Chip:
    """The chip the model prices programs on (see module docstring); overrides in TFLOP/s and GB/s."""
    kind = jax.devices()[0].device_kind
    if jax.default_backend() == "cpu":
        chip = measured_cpu_chip()
    else:
        try:
            chip = step_time.chip_for(kind)
        except ValueError:
            chip = step_time.Chip(device_name(kind), math.nan, math.nan, 0, None, "unknown: pass --peak_tflops")
    if peak_tflops:
        chip = dataclasses.replace(
            chip, peak_flops=peak_tflops * 1e12, source=chip.source + "; peak from --peak_tflops"
        )
    if hbm_gbps:
        chip = dataclasses.replace(chip, hbm_bandwidth=hbm_gbps * 1e9, source=chip.source + "; HBM from --hbm_gbps")
    return chip


def run_shape(p: Preset, games: int, prompt: int, response: int) -> step_time.RunShape:
    """A one-chip `step_time.RunShape` of the preset's programs."""
    return step_time.RunShape(
        chips=1,
        hosts=1,
        fsdp=1,
        tensor=1,
        sampler_tensor=1,
        prompt_tokens=prompt,
        response_tokens=response,
        games_per_host=games,
        turns=1,
        micro_batch_rows=p.micro_batch,
        logprob_rows_per_host=p.micro_batch,
        mini_batch_rows=p.rows,
        remat=p.remat,
    )


class Bench:
    """One preset's model, learner and batch, built on first use; its programs measured."""

    def __init__(self, p: Preset, chip: step_time.Chip, reps: int):
        from bipace_jax.models import Qwen2Config

        self.p, self.chip, self.reps = p, chip, reps
        tiny = dict(p.tiny)
        if p.model == "tiny":
            self.cfg = Qwen2Config.tiny(**tiny)
        else:
            self.cfg = Qwen2Config.preset(p.model, **tiny)
        self.shape = step_time.ModelShape.of(self.cfg)
        self._actor = self._learner = None
        self.setup = {}

    # -- building ------------------------------------------------------------------------------
    def actor(self):
        """The actor (random weights, built on the default device)."""
        if self._actor is None:
            from bipace_jax.models import Qwen2Actor

            p, L = self.p, self.cfg.num_hidden_layers
            t0 = time.perf_counter()
            self._actor = Qwen2Actor(
                self.cfg,
                fingerprint_layer=max(p.fingerprint_layer, -(L + 1)),
                dtype=jnp.dtype(p.dtype),
                param_dtype=jnp.dtype(p.param_dtype),
                rngs=nnx.Rngs(0),
                remat=p.remat,
                scan_layers=p.scan_layers,
            )
            jax.block_until_ready(nnx.state(self._actor))
            self.setup["init_actor_s"] = time.perf_counter() - t0
        return self._actor

    def learner(self):
        """A one-device `PPOLearner` with the paper's loss and AdamW (the actor then holds the
        learner's compute-dtype copy)."""
        if self._learner is None:
            import optax

            from bipace_jax import losses, sharding
            from bipace_jax.ppo import PPOLearner

            actor = self.actor()
            t0 = time.perf_counter()
            mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
            tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6, weight_decay=0.01))
            self._learner = PPOLearner(
                actor,
                mesh,
                losses.PPOLossConfig(),
                tx,
                micro_batch_rows=self.p.micro_batch,
                support=self.cfg.vocab_size,
                logprob_chunk=self.p.logprob_chunk,
            )
            jax.block_until_ready((self._learner.params, self._learner.opt_state))
            self.setup["init_learner_s"] = time.perf_counter() - t0
        return self._learner

    def batch(self, with_update_fields: bool = False):
        """``rows`` full rows (P real prompt tokens, M response tokens), random ids; seed 0."""
        from bipace_jax.batch import TokenBatch

        p = self.p
        rng = np.random.default_rng(0)
        ids = rng.integers(0, self.cfg.vocab_size, (p.rows, p.prompt_tokens + p.response_tokens)).astype(np.int32)
        b = TokenBatch(
            input_ids=ids,
            attention_mask=np.ones_like(ids),
            response_ids=ids[:, p.prompt_tokens :].copy(),
            response_mask=np.ones((p.rows, p.response_tokens), bool),
            prompt_len=p.prompt_tokens,
        )
        if with_update_fields:
            lp = rng.normal(-8.0, 1.0, (p.rows, p.response_tokens)).astype(np.float32)
            b = b.with_(old_logprobs=lp, ref_logprobs=lp + 0.01, advantages=rng.normal(size=p.rows))
        return b

    # -- the model's side ------------------------------------------------------------------------
    def _model(self, cost: step_time.Cost, measured_s: float, model_flops: float, hw_flops: float) -> dict:
        sec = cost.seconds(self.chip)
        peak = self.chip.peak_flops
        return dict(
            model_s=sec["seconds"],
            model_bound=sec["bound"],
            model_compute_s=sec["compute_s"],
            model_memory_s=sec["memory_s"],
            measured_over_model=measured_s / sec["seconds"],
            model_flops=model_flops,
            mfu=model_flops / measured_s / peak,
            hfu=hw_flops / measured_s / peak,
        )

    def _train_flops(self, rows: int) -> float:
        p = self.p
        t = p.prompt_tokens + p.response_tokens
        return self.shape.forward_flops(rows, t, t / 2, p.response_tokens)

    # -- programs --------------------------------------------------------------------------------
    def logprobs(self) -> dict:
        p, learner, batch = self.p, self.learner(), self.batch()
        t, _ = timed(lambda: learner.logprobs(learner.params_local, batch), self.reps)
        micro = -(-p.rows // p.micro_batch)
        costs = step_time.program_costs(self.shape, run_shape(p, p.micro_batch, p.prompt_tokens, p.response_tokens))
        f = self._train_flops(p.rows)
        tokens = p.rows * (p.prompt_tokens + p.response_tokens)
        out = dict(t, rows=p.rows, micro_batches=micro, tokens=tokens, tokens_per_s=tokens / t["median_s"])
        out.update(self._model(costs["logprobs"] * micro, t["median_s"], f, f), passes="1 forward")
        return out

    def update(self) -> dict:
        from bipace_jax.learner import shard_rows
        from bipace_jax.ppo import STAT_KEYS

        p, learner, batch = self.p, self.learner(), self.batch(with_update_fields=True)
        key = jax.random.key(0)
        t, stats = timed(lambda: learner.update(batch, key), self.reps)
        micro = -(-p.rows // p.micro_batch)
        costs = step_time.program_costs(self.shape, run_shape(p, p.micro_batch, p.prompt_tokens, p.response_tokens))
        model_f = 3 * self._train_flops(p.rows)
        hw_f = (4 if p.remat == "full" else 3) * self._train_flops(p.rows)
        tokens = p.rows * (p.prompt_tokens + p.response_tokens)
        out = dict(t, rows=p.rows, micro_batches=micro, optimizer_steps=int(stats["loss/updates"]), tokens=tokens)
        out["tokens_per_s"] = tokens / t["median_s"]
        out["loss"] = stats["loss/loss"]
        cost = costs["ppo_grad"] * micro + costs["ppo_apply"]
        passes = "3 (forward + backward as 2); hfu: 4 (+ the full-remat forward)" if p.remat == "full" else "3"
        out.update(self._model(cost, t["median_s"], model_f, hw_f), passes=passes)
        # one micro-batch's gradient program alone, its inputs on the device (no host work)
        mb = shard_rows(learner.mesh, batch.take(np.arange(min(p.micro_batch, p.rows)), p.prompt_tokens, p.micro_batch))
        specs = learner.step_specs(learner.objective, mb, STAT_KEYS)
        g0, s0 = learner._zero_accumulators(tuple(STAT_KEYS))(learner.params)  # the learner's own placement
        state = {"g": g0}

        def acc():
            state["g"], st = specs["accumulate"](learner.params, learner.rest, state["g"], s0, mb, jnp.float32(1.0))
            return jax.block_until_ready((state["g"], st))

        ta, _ = timed(acc, self.reps)
        state.clear()  # the accumulator's HBM back before the next program
        gf = self._train_flops(p.micro_batch)
        out["accumulate"] = dict(ta, rows=p.micro_batch)
        out["accumulate"].update(
            self._model(costs["ppo_grad"], ta["median_s"], 3 * gf, (4 if p.remat == "full" else 3) * gf)
        )
        return out

    def sampler(self) -> dict:
        from bipace_jax.sampling import Engine, SamplerConfig

        p, cfg = self.p, self.cfg
        # the learner's compute-dtype copy when it exists (what the trainer samples from), else the actor
        actor = self.actor()
        if self._learner is None and jnp.dtype(p.param_dtype) != jnp.dtype(p.dtype):
            graphdef, params, rest = nnx.split(actor, nnx.Param, ...)
            actor = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(p.dtype), params), rest)
        eos = cfg.vocab_size - 1
        out = {}
        for b in p.decode_batches:
            rng = np.random.default_rng(b)
            prompts = [rng.integers(0, eos, p.decode_prompt).tolist() for _ in range(b)]
            scfg = SamplerConfig(
                max_new_tokens=p.new_tokens,
                greedy=True,
                stop_strings=(),
                eos_token_ids=(eos,),
                batch_buckets=(b,),
                length_buckets=(p.decode_prompt,),
            )
            sampler = Engine(_Vocabulary(cfg.vocab_size, eos), scfg)
            runs = []

            def gen(sampler=sampler, prompts=prompts, runs=runs):
                res = sampler.generate(actor, prompts, jax.random.key(0))
                runs.append((dataclasses.asdict(res.timing), res.lengths))

            t, _ = timed(gen, self.reps)
            first, steady = runs[0], runs[1:]
            pre = statistics.median(r[0]["prefill_s"] for r in steady)
            dec = statistics.median(r[0]["decode_s"] for r in steady)
            lengths = steady[-1][1]
            steps = int(lengths.max()) - 1  # decode-loop iterations (the first token comes from the prefill)
            decoded = float(lengths.sum()) - b
            r = run_shape(p, b, p.decode_prompt, p.new_tokens)
            prompt_tokens = b * p.decode_prompt
            pf = self.shape.forward_flops(b, p.decode_prompt, p.decode_prompt / 2, 1)
            row = dict(
                batch=b,
                total=t,
                prefill_first_s=first[0]["prefill_s"],
                decode_first_s=first[0]["decode_s"],
                prefill_s=pre,
                decode_s=dec,
                decode_steps=steps,
                prefill_tok_s=prompt_tokens / pre,
                decode_tok_s=decoded / dec,
            )
            row["prefill"] = self._model(step_time.prefill_cost(self.shape, r, b, p.decode_prompt), pre, pf, pf)
            step = step_time.decode_cost(self.shape, r, b, p.decode_prompt + p.new_tokens / 2)
            df = steps * self.shape.forward_flops(b, 1, p.decode_prompt + p.new_tokens / 2, 1)
            row["decode"] = self._model(step * max(steps, 1), dec, df, df)
            row["decode"]["hbm_fraction"] = row["decode"]["model_memory_s"] / dec
            out[str(b)] = row
            del sampler
        return out

    def pack(self) -> dict:
        from bipace_jax.batch import TokenBatch

        p, learner = self.p, self.learner()
        n, m = 2 * p.rows, p.response_tokens
        rng = np.random.default_rng(0)
        prompts = rng.integers(max(int(0.156 * p.prompt_tokens), 1), int(0.288 * p.prompt_tokens) + 1, n)
        mu = np.log(0.293 * m) - 0.8**2 / 2  # lognormal with arithmetic mean 0.293 M
        responses = np.clip(np.round(rng.lognormal(mu, 0.8, n)), 1, m).astype(int)
        width = 1 << int(prompts.max() - 1).bit_length()  # the rows' prompt bucket
        ids = np.zeros((n, width + m), np.int32)
        mask = np.zeros_like(ids)
        for i, (lp, lr) in enumerate(zip(prompts, responses)):
            ids[i, width - lp : width + lr] = rng.integers(0, self.cfg.vocab_size, lp + lr)
            mask[i, width - lp : width + lr] = 1
        rmask = mask[:, width:].astype(bool)
        batch = TokenBatch(ids, mask, ids[:, width:] * rmask, rmask, width)
        lp = rng.normal(-8.0, 1.0, (n, m)).astype(np.float32)
        batch = batch.with_(old_logprobs=lp, ref_logprobs=lp + 0.01, advantages=rng.normal(size=n))
        key, buckets = jax.random.key(0), learner.prompt_buckets
        learner.prompt_buckets = tuple(1 << k for k in range(7, 16) if 1 << k <= p.prompt_tokens)
        out = dict(rows=n, prompt_width=width, real_tokens=int(mask.sum()), response_mean=float(responses.mean()))
        try:
            for arm, flag in (("unpacked", False), ("packed", True)):
                learner.pack = flag
                t, _ = timed(lambda: learner.update(batch, key), self.reps)
                tok = dict(learner.last_tokens["update"])
                out[arm] = dict(t, tokens=tok, real_share=tok["real"] / tok["processed"])
                out[arm]["tokens_per_s"] = tok["real"] / t["median_s"]
                out[arm]["memory"] = memory()
        finally:
            learner.pack, learner.prompt_buckets = False, buckets
        out["speedup_update"] = out["unpacked"]["median_s"] / out["packed"]["median_s"]
        out["pack_width"], out["pack_response_width"] = learner._pack_widths(batch, width)
        return out


class _Vocabulary:
    """The sampler's view of a tokenizer for random ids: V ids, one EOS, no text (no stop strings)."""

    def __init__(self, size: int, eos: int):
        self.size, self.eos_token_id, self.pad_token_id = size, eos, 0

    def __len__(self) -> int:
        return self.size

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def provenance(commit: str) -> dict:
    """Device, date, commit, versions of this run."""
    import flax

    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except Exception:
            commit = "unknown (no git here: pass --commit)"
    dev = jax.devices()[0]
    return dict(
        device=dev.device_kind,
        backend=jax.default_backend(),
        devices=jax.device_count(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=commit,
        jax=jax.__version__,
        jaxlib=getattr(getattr(jax, "lib", None), "__version__", None) or _version("jaxlib"),
        flax=flax.__version__,
        python=platform.python_version(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        load_1min_at_start=os.getloadavg()[0],  # other processes' share of the cores (CPU timings move with it)
    )


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(result: dict) -> str:
    """The results as a text table: one line per program (and per decode batch)."""
    head = (
        f"{'preset':<6} {'program':<16} {'first s':>8} {'median s':>9} {'model s':>9} {'meas/model':>10} "
        f"{'MFU':>6} {'tok/s':>10} {'HBM':>5} {'peak GiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, pr in result["presets"].items():
        for prog, r in pr["programs"].items():
            if "error" in r:
                lines.append(f"{name:<6} {prog:<16} ERROR {r['error'][:90]}")
                continue
            mem = _fmt(r.get("memory", {}).get("peak_gib"), ".1f")
            rows = []
            if prog == "pack":
                for arm in ("unpacked", "packed"):
                    a = r[arm]
                    lines.append(
                        f"{name:<6} {'update ' + arm:<16} {a['first_s']:>8.3f} {a['median_s']:>9.4f} {'':>9} {'':>10} "
                        f"{'':>6} {a['tokens_per_s']:>10.0f} {'':>5} {mem:>8}   real share {a['real_share']:.2f}"
                    )
                lines.append(f"{name:<6} {'  speedup_update':<16} {r['speedup_update']:.2f}x")
                continue
            if prog == "sampler":
                for b, s in r.items():
                    if b == "memory":
                        continue
                    for part in ("prefill", "decode"):
                        m = s[part]
                        tok = s[f"{part}_tok_s"]
                        hbm = _fmt(m.get("hbm_fraction"), ".0%") if part == "decode" else ""
                        first = s[f"{part}_first_s"]
                        rows.append((f"{part} B{b}", first, s[f"{part}_s"], m, tok, hbm))
            else:
                rows.append((prog, r["first_s"], r["median_s"], r, r["tokens_per_s"], ""))
                if "accumulate" in r:
                    a = r["accumulate"]
                    rows.append(("  accumulate", a["first_s"], a["median_s"], a, None, ""))
            for label, first, med, m, tok, hbm in rows:
                lines.append(
                    f"{name:<6} {label:<16} {first:>8.3f} {med:>9.4f} {_fmt(m['model_s'], '.4f'):>9} "
                    f"{_fmt(m['measured_over_model'], '.2f'):>10} {_fmt(m['mfu'], '.1%'):>6} "
                    f"{_fmt(tok, '.0f'):>10} {hbm:>5} {mem:>8}"
                )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="", help="comma-separated PRESETS keys (default: cpu on CPU, else 0.5b,1.5b)"
    )
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {PROGRAMS}")
    parser.add_argument("--reps", type=int, default=5, help="steady calls per program (median reported)")
    parser.add_argument("--out", default="", help="JSON path (default benchmarks/step_<device>.json)")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument("--peak_tflops", type=float, default=0.0, help="override the chip's dense peak")
    parser.add_argument("--hbm_gbps", type=float, default=0.0, help="override the chip's HBM bandwidth")
    # shape overrides (0: the preset's), for a quick check of a preset's code path at small sizes
    for name in ("layers", "vocab", "rows", "micro_batch", "prompt_tokens", "response_tokens"):
        parser.add_argument(f"--{name}", type=int, default=0)
    parser.add_argument("--decode_prompt", type=int, default=0)
    parser.add_argument("--new_tokens", type=int, default=0)
    parser.add_argument("--decode_batches", default="", help="comma-separated decode batch sizes")
    args = parser.parse_args(argv)

    names = [x for x in (args.preset or ("cpu" if jax.default_backend() == "cpu" else "0.5b,1.5b")).split(",") if x]
    programs = [x for x in args.programs.split(",") if x]
    for n in names:
        if n not in PRESETS:
            parser.error(f"--preset: {n!r} is not one of {sorted(PRESETS)}")
    for prog in programs:
        if prog not in PROGRAMS:
            parser.error(f"--programs: {prog!r} is not one of {PROGRAMS}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    kind = jax.devices()[0].device_kind
    out_path = args.out or os.path.join("benchmarks", f"step_{device_name(kind)}.json")
    chip = the_chip(args.peak_tflops, args.hbm_gbps)
    result = dict(
        provenance=provenance(args.commit),
        chip=dataclasses.asdict(chip),
        reps=args.reps,
        programs=programs,
        flops_counted=(
            "forward = 2 x matmul params x tokens + causal attention (4 x context x heads x head_dim per token "
            "per layer) + LM head on the response positions; log-prob pass 1 forward, update 3 "
            "(backward = 2 forwards), hfu adds full remat's recomputed forward"
        ),
        presets={},
    )
    for name in names:
        p = PRESETS[name]
        tiny = dict(p.tiny)
        if args.layers:
            tiny["num_hidden_layers"] = args.layers
        if args.vocab:
            tiny["vocab_size"] = args.vocab
        over = {
            k: getattr(args, k) for k in ("rows", "micro_batch", "prompt_tokens", "response_tokens") if getattr(args, k)
        }
        if args.decode_prompt:
            over["decode_prompt"] = args.decode_prompt
        if args.new_tokens:
            over["new_tokens"] = args.new_tokens
        if args.decode_batches:
            over["decode_batches"] = tuple(int(x) for x in args.decode_batches.split(","))
        p = dataclasses.replace(p, tiny=tuple(tiny.items()), **over)
        entry = result["presets"][name] = dict(preset=dataclasses.asdict(p), programs={})
        try:
            bench = Bench(p, chip, args.reps)
            entry["model"] = dataclasses.asdict(bench.cfg)
            entry["params"] = bench.shape.params
        except Exception as e:  # a preset that cannot be built still leaves the others
            entry["error"] = f"{type(e).__name__}: {e}"
            write_json(out_path, result, indent=2)
            continue
        for prog in programs:
            print(f"[{name}] {prog} ...", flush=True)
            try:
                r = getattr(bench, prog)()
                r["memory"] = memory()
            except Exception as e:
                traceback.print_exc()
                r = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:], memory=memory())
            entry["programs"][prog] = r
            entry["setup"] = bench.setup
            write_json(out_path, result, indent=2)
        del bench
        gc.collect()
    print(table(result))
    write_json(out_path, result, indent=2)


if __name__ == "__main__":
    main()
