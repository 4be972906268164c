"""The CPU default's PPO update stage: the learner at the issue's filing against today's, side by side in one run.

    python -m launch.bench_update             # CPU, 5-15 minutes: writes benchmarks/update_cpu.json

The trainer of ``configs/textcraft_tiny.py`` (the README main job) is built in a scratch folder and plays
iteration 0's rollout once (its seed, its task groups, the epsilon calibration); its rows, the sampler's
log-probs (``ppo.old_logprobs = "sampler"``), the reference log-probs and the estimator's advantages make
one update batch (``--save_batch`` / ``--load_batch``: keep it in an .npz and skip the rollout). Each arm
is a learner from the same checkpoint with the same key (same mini-batches, same optimizer steps):

* ``before``: the learner at the issue's filing: ``ppo.pack`` off (one micro-batch shape per prompt
  bucket), the last decoder layer run over every column, then the response columns cut out
  (``BaselineObjective``), XLA's own gradient of the projections and stacked attention row chunks
  (``layers.CPU_DENSE_VJP``, ``attention.CPU_REMAT_ROW_CHUNKS`` off while its programs are traced).
* ``after``: ``ppo.pack`` off, the last layer only at the response-predicting columns
  (``Qwen2Actor.forward_hidden(query_index=...)``), the CPU gradient of today (both switches on).
* ``packed_xla_grad``: ``ppo.pack`` on at lines of 512 tokens with 96 response slots and the last layer
  at the head's columns, both switches off: the CPU default of the previous round.
* ``after_packed``: ``ppo.pack`` at the config's ``pack_width`` / ``pack_response_width``
  (``--pack_width`` / ``--pack_response_width`` override them), the last layer at the head's columns,
  both switches on: the CPU default as shipped.

Each arm runs its first update (compile + run), then ``--reps`` updates, the arms interleaved; reported
per arm: the first call, the fastest steady call (wall seconds) and its process CPU seconds (all threads:
steadier than wall time on shared cores), the first update's statistics (they must agree to float
tolerance: ``max_rel_stat_diff`` against ``before``), and the real-token share of the update's
processed tokens (``PPOLearner.last_tokens``). ``speedup_update_<arm>`` = before / arm (fastest steady
wall), ``speedup_update_cpu_<arm>`` the same in CPU seconds, ``speedup_update_first_<arm>`` of the
first calls; ``speedup_update`` / ``speedup_update_cpu`` are ``after_packed``'s (the shipped default).
The 1-minute load average is recorded before and after: the numbers are only comparable within a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from launch._common import write_json

FLAGS = flags.FLAGS
ARMS = ("before", "after", "packed_xla_grad", "after_packed")
flags.DEFINE_list("arms", list(ARMS), "arms to run (see the docstring)")
flags.DEFINE_integer("reps", 3, "timed updates per arm after the first (interleaved)")
flags.DEFINE_integer("pack_width", None, "after_packed: ppo.pack_width (default: the config's)")
flags.DEFINE_integer("pack_response_width", None, "after_packed: ppo.pack_response_width (default: the config's)")
flags.DEFINE_string("save_batch", "", "write the update batch to this .npz")
flags.DEFINE_string("load_batch", "", "read the update batch from this .npz instead of playing the rollout")
flags.DEFINE_string("out", "benchmarks/update_cpu.json", "JSON output")

BATCH_FIELDS = ("input_ids", "attention_mask", "response_ids", "response_mask", "old_logprobs", "ref_logprobs")


def _baseline_response_logprobs(model, input_ids, attention_mask, response_ids, **kw):
    """The log-prob pass as it was before the last layer ran at the response columns only."""
    from bipace_jax import ppo

    h, _ = model.forward_hidden(input_ids, attention_mask)  # [B, T, D]
    m = response_ids.shape[1]
    return ppo.head_logprobs(model, h[:, input_ids.shape[1] - m - 1 : -1], response_ids, **kw)


def _baseline_packed_response_logprobs(model, mb, **kw):
    """The packed log-prob pass as it was: the full forward, then the hidden states at ``head_index``."""
    import jax.numpy as jnp

    from bipace_jax import ppo

    h = model.forward_packed(mb.input_ids, mb.segment_ids)  # [L, C, D]
    h = jnp.take_along_axis(h, mb.head_index[..., None], axis=1)
    return ppo.head_logprobs(model, h, mb.response_ids, **kw)


@contextlib.contextmanager
def _baseline(forward: bool):
    """While a program is traced: XLA's own CPU gradient of the projections and stacked attention row
    chunks, and with ``forward`` ``ppo``'s log-prob functions swapped for the baseline ones."""
    from bipace_jax import ppo
    from bipace_jax.models import attention, layers

    saved = ppo.response_logprobs, ppo.packed_response_logprobs, layers.CPU_DENSE_VJP, attention.CPU_REMAT_ROW_CHUNKS
    if forward:
        ppo.response_logprobs = _baseline_response_logprobs
        ppo.packed_response_logprobs = _baseline_packed_response_logprobs
    layers.CPU_DENSE_VJP = attention.CPU_REMAT_ROW_CHUNKS = False
    try:
        yield
    finally:
        ppo.response_logprobs, ppo.packed_response_logprobs, layers.CPU_DENSE_VJP, attention.CPU_REMAT_ROW_CHUNKS = (
            saved
        )


def baseline_objective(objective, forward: bool = True):
    """``objective`` (a ``ppo.PPOObjective``) traced under ``_baseline(forward)``: a distinct class on
    every call, so its compiled programs are not shared with another arm's (``learner._step_programs``
    keys on it)."""
    from bipace_jax.ppo import PPOObjective

    class BaselineObjective(PPOObjective):
        def __call__(self, model, mb, denom):
            with _baseline(forward):
                return super().__call__(model, mb, denom)

    return BaselineObjective(**{f.name: getattr(objective, f.name) for f in dataclasses.fields(PPOObjective)})


def _rollout_batch(c):
    """iteration 0's update batch of the README main job (the module docstring)."""
    from bipace_jax import tasks
    from bipace_jax.trainer import Trainer

    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(c, workdir)
        spec, learner = trainer.spec, trainer.learner
        groups = [tasks.train_task(trainer.train_ids, spec.seed, i) for i in range(trainer.groups_per_host)]
        res = trainer._play(trainer.rollout_cfg, groups, jax.random.key(spec.seed))
        batch = res.tokens
        if trainer.needs_calibration:
            trainer._calibrate_epsilon(res.steps)
        adv, _ = trainer._advantages(res)
        ref = learner.logprobs(learner.ref_params_local, batch)
        old = np.asarray(res.sample_logprobs, np.float32)
        return batch.with_(old_logprobs=old, ref_logprobs=ref, advantages=adv)


def _save(path, batch):
    np.savez(
        path, prompt_len=batch.prompt_len, advantages=batch.advantages, **{k: getattr(batch, k) for k in BATCH_FIELDS}
    )


def _load(path):
    from bipace_jax.batch import TokenBatch

    z = np.load(path)
    return TokenBatch(prompt_len=int(z["prompt_len"]), advantages=z["advantages"], **{k: z[k] for k in BATCH_FIELDS})


def main(_):
    from bipace_jax import build, sharding
    from configs import textcraft_tiny

    c = textcraft_tiny.get_config()
    c.log.progress = False
    load = [os.getloadavg()[0]]
    batch = _load(FLAGS.load_batch) if FLAGS.load_batch else _rollout_batch(c)
    if FLAGS.save_batch:
        _save(FLAGS.save_batch, batch)
    spec = build.build_spec(c)
    mesh = sharding.make_mesh(1, 1, 1)
    tokenizer = build.load_model_tokenizer(spec.model)
    packed = dict(pack=True)
    for field in ("pack_width", "pack_response_width"):
        if getattr(FLAGS, field) is not None:
            packed[field] = getattr(FLAGS, field)
    overrides = {
        "before": dict(pack=False),
        "after": dict(pack=False),
        "packed_xla_grad": packed,
        "after_packed": packed,
    }
    learners = {}
    for name in FLAGS.arms:
        arm = dataclasses.replace(spec, learner=dataclasses.replace(spec.learner, **overrides[name]))
        actor = build.build_actor(arm.model, tokenizer, mesh, seed=arm.seed)
        learners[name] = build.ppo_learner(arm, actor, mesh, mesh, support=len(tokenizer))
        if name in ("before", "packed_xla_grad"):
            learners[name].objective = baseline_objective(learners[name].objective, forward=name == "before")
    key = jax.random.key(1)

    def run(learner):
        w0, c0 = time.perf_counter(), time.process_time()
        stats = learner.update(batch, key)
        return time.perf_counter() - w0, time.process_time() - c0, stats

    first, stats, walls, cpus = {}, {}, {n: [] for n in learners}, {n: [] for n in learners}
    for name, learner in learners.items():  # compile, and the first update's statistics from equal weights
        w, cpu, stats[name] = run(learner)
        first[name] = dict(wall_s=w, cpu_s=cpu)
        print(f"{name}: first update {w:.1f} s ({cpu:.1f} CPU s)", flush=True)
    for _ in range(FLAGS.reps):
        for name, learner in learners.items():
            w, cpu, _ = run(learner)
            walls[name].append(w)
            cpus[name].append(cpu)
    load.append(os.getloadavg()[0])
    tokens = {n: dict(L.last_tokens["update"]) for n, L in learners.items()}
    ref = FLAGS.arms[0]
    rel = {
        n: max(abs(s[k] - v) / max(abs(v), 1e-12) for k, v in stats[ref].items() if k != "loss/updates")
        for n, s in stats.items()
    }
    fastest = {n: min(t) for n, t in walls.items()}
    fastest_cpu = {n: min(t) for n, t in cpus.items()}
    result = dict(
        config="textcraft_tiny",
        backend=jax.default_backend(),
        load_1min_before_after=load,
        rows=batch.rows,
        prompt_len=batch.prompt_len,
        response_width=int(batch.response_ids.shape[1]),
        micro_batch_rows=spec.learner.micro_batch_rows,
        mini_batch_rows=spec.learner.mini_batch_rows,
        optimizer_steps=int(stats[ref]["loss/updates"]),
        arms=list(learners),
        update_first=first,
        update_fastest_s=fastest,
        update_fastest_cpu_s=fastest_cpu,
        update_s_runs=walls,
        update_cpu_s_runs=cpus,
        tokens=tokens,
        real_share={n: t["real"] / t["processed"] for n, t in tokens.items()},
        first_update_stats=stats,
        max_rel_stat_diff=rel,
    )
    for name in learners:
        if name != "before" and "before" in learners:
            result[f"speedup_update_{name}"] = fastest["before"] / fastest[name]
            result[f"speedup_update_cpu_{name}"] = fastest_cpu["before"] / fastest_cpu[name]
            result[f"speedup_update_first_{name}"] = first["before"]["wall_s"] / first[name]["wall_s"]
    if "speedup_update_after_packed" in result:
        result["speedup_update"] = result["speedup_update_after_packed"]
        result["speedup_update_cpu"] = result["speedup_update_cpu_after_packed"]
    print(f"CPU default: {batch.rows} rows, prompt width {batch.prompt_len}, M {batch.response_ids.shape[1]}")
    print(f"load (1 min) {load[0]:.1f} -> {load[1]:.1f}")
    print(
        f"{'arm':16s} {'first s':>8s} {'fastest s':>10s} {'CPU s':>8s} {'real share':>11s} {'max rel stat diff':>18s}"
    )
    for n in learners:
        print(
            f"{n:16s} {first[n]['wall_s']:8.1f} {fastest[n]:10.2f} {fastest_cpu[n]:8.2f} "
            f"{result['real_share'][n]:11.3f} {rel[n]:18.2e}"
        )
    for k, v in result.items():
        if k.startswith("speedup"):
            print(f"{k} {v:.2f}x")
    write_json(FLAGS.out, result, indent=2)


if __name__ == "__main__":
    app.run(main)
