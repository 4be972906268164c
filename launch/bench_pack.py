"""Packed vs unpacked learner batches: the CPU default's update stage side by side, and the real-token
share of the learner's processed tokens (measured on the CPU default, modelled at the paper configs).

    python -m launch.bench_pack                    # CPU, several minutes: writes benchmarks/packing.json

Measured (``configs/textcraft_tiny.py``, the README main job's config): the trainer is built in a
scratch folder and plays iteration 0's rollout once (its seed, its task groups); its rows, the
sampler's log-probs (the config's ``ppo.old_logprobs``), the reference log-probs and the estimator's
advantages make one update batch. Two learners from the same checkpoint, ``ppo.pack`` off and on
(the config's ``pack_width`` / ``pack_response_width``), then run the same update (same key: same mini-batches and optimizer steps)
and the reference log-prob pass: each first once (compile), then ``--reps`` times, the two arms
interleaved; medians reported, ``speedup_update`` = unpacked / packed. The first updates' statistics
are compared (``max_rel_stat_diff``). Real-token share = the rows' real tokens / the micro-batch
columns a pass runs (padding included), from ``PPOLearner.last_tokens``.

Modelled (``paper``): an ALFWorld paper iteration's rows (``--paper_rows``; prompts uniform in
320-590 real tokens, ``launch.head_lengths``' range; responses lognormal with mean 150 tokens, log-sigma
0.8, cut to 1-512, the step-time model's draws) through the same planners: unpacked micro-batches of 8
rows at their prompt bucket + 512 response columns (``plan_micro_batches``), packed lines of the
batch's row width (widest prompt bucket + 512) and 1024 response slots (``pack_lines``), mini-batches
of 256 rows.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from launch._common import write_json

FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 3, "timed updates per arm after the compile (interleaved)")
flags.DEFINE_integer("paper_rows", 6400, "rows of the modelled paper iteration (128 games x 50 turns)")
flags.DEFINE_string("out", "benchmarks/packing.json", "JSON output")


def paper_share(rows: int, seed: int = 0) -> dict:
    """The modelled real-token share of an ALFWorld paper iteration, unpacked and packed (docstring)."""
    from bipace_jax.batch import pack_lines
    from bipace_jax.ppo import mini_batches, plan_micro_batches

    rng = np.random.default_rng(seed)
    m, micro, mini_rows = 512, 8, 256
    buckets = (128, 256, 512, 1024, 2048)
    prompts = rng.integers(320, 591, rows)
    mu = np.log(150.0) - 0.8**2 / 2  # lognormal with arithmetic mean 150
    responses = np.clip(np.round(rng.lognormal(mu, 0.8, rows)), 1, m).astype(np.int64)
    real = prompts + responses
    widest = next(b for b in buckets if b >= prompts.max())
    minis = mini_batches(np.array([rows]), 0, mini_rows, jax.random.key(seed))
    width_of = lambda need: next(b for b in buckets if b >= need)  # noqa: E731
    plans = plan_micro_batches(minis, prompts, micro, width_of, across_processes=False)
    unpacked = sum(micro * (w + m) for plan in plans for _, w in plan)
    width, rwidth = widest + m, min(widest + m, 2 * m)
    lines = [pack_lines(r, real, responses, width, rwidth) for r in minis]
    packed = sum(-(-len(x) // micro) * micro * width for x in lines)
    return dict(
        rows=rows,
        real_tokens=int(real.sum()),
        prompt_tokens_range=[320, 590],
        response_mean_drawn=float(responses.mean()),
        unpacked_processed=int(unpacked),
        packed_processed=int(packed),
        real_share_unpacked=float(real.sum() / unpacked),
        real_share_packed=float(real.sum() / packed),
        pack_width=width,
        pack_response_width=rwidth,
        rows_per_line=rows / sum(len(x) for x in lines),
    )


def main(_):
    from bipace_jax import build, tasks
    from bipace_jax.trainer import Trainer
    from configs import textcraft_tiny

    c = textcraft_tiny.get_config()
    c.log.progress = False
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(c, workdir)
        spec, plain = trainer.spec, trainer.learner
        groups = [tasks.train_task(trainer.train_ids, spec.seed, i) for i in range(trainer.groups_per_host)]
        t0 = time.perf_counter()
        res = trainer._play(trainer.rollout_cfg, groups, jax.random.key(spec.seed))
        rollout_s = time.perf_counter() - t0
        batch = res.tokens
        adv, _ = trainer._advantages(res)
        old = np.asarray(res.sample_logprobs, np.float32)
        ref = plain.logprobs(plain.ref_params_local, batch)
        full = batch.with_(old_logprobs=old, ref_logprobs=ref, advantages=adv)
        arms = {}
        for name, pack in (("unpacked", False), ("packed", True)):  # the config's pack widths for the packed arm
            arm = dataclasses.replace(spec, learner=dataclasses.replace(spec.learner, pack=pack))
            actor = build.build_actor(spec.model, trainer.tokenizer, trainer.mesh, seed=spec.seed)
            arms[name] = build.ppo_learner(arm, actor, trainer.mesh, trainer.local_mesh, support=len(trainer.tokenizer))
        key = jax.random.key(1)
        first, times, lp_times, stats = {}, {a: [] for a in arms}, {a: [] for a in arms}, {}
        for name, L in arms.items():  # compile (and the first update's statistics, from equal weights)
            t0 = time.perf_counter()
            stats[name] = L.update(full, key)
            first[name] = time.perf_counter() - t0
            L.logprobs(L.ref_params_local, batch)
        for _ in range(FLAGS.reps):
            for name, L in arms.items():
                t0 = time.perf_counter()
                L.update(full, key)
                times[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                L.logprobs(L.ref_params_local, batch)
                lp_times[name].append(time.perf_counter() - t0)
        tokens = {n: dict(L.last_tokens) for n, L in arms.items()}
    rel = {
        k: abs(stats["packed"][k] - v) / max(abs(v), 1e-12) for k, v in stats["unpacked"].items() if k != "loss/updates"
    }
    med = {n: statistics.median(t) for n, t in times.items()}
    lp_med = {n: statistics.median(t) for n, t in lp_times.items()}
    share = {n: {p: t[p]["real"] / t[p]["processed"] for p in ("update", "logprobs")} for n, t in tokens.items()}
    result = dict(
        config="textcraft_tiny",
        backend=jax.default_backend(),
        load_1min=os.getloadavg()[0],
        rows=batch.rows,
        prompt_len=batch.prompt_len,
        response_width=int(batch.response_ids.shape[1]),
        micro_batch_rows=spec.learner.micro_batch_rows,
        mini_batch_rows=spec.learner.mini_batch_rows,
        optimizer_steps=int(stats["unpacked"]["loss/updates"]),
        rollout_s=rollout_s,
        update_first_s=first,
        update_s=med,
        update_s_runs=times,
        ref_logprobs_s=lp_med,
        speedup_update=med["unpacked"] / med["packed"],
        speedup_ref_logprobs=lp_med["unpacked"] / lp_med["packed"],
        tokens=tokens,
        real_share=share,
        first_update_stats=stats,
        max_rel_stat_diff=max(rel.values()),
        paper=paper_share(FLAGS.paper_rows),
    )
    print(f"CPU default: {batch.rows} rows, prompt width {batch.prompt_len}, M {batch.response_ids.shape[1]}")
    print(f"{'arm':10s} {'update s':>9s} {'ref lp s':>9s} {'real share (update)':>20s}")
    for n in arms:
        print(f"{n:10s} {med[n]:9.2f} {lp_med[n]:9.2f} {share[n]['update']:20.3f}")
    print(f"speedup_update {result['speedup_update']:.2f}x, speedup_ref_logprobs {result['speedup_ref_logprobs']:.2f}x")
    p = result["paper"]
    print(
        f"paper (modelled): real share {p['real_share_unpacked']:.3f} unpacked -> {p['real_share_packed']:.3f} packed"
    )
    write_json(FLAGS.out, result, indent=2)


if __name__ == "__main__":
    app.run(main)
