"""The CPU default's rollout (README command 1's config): plain prefill vs shared prompt heads vs the
continuous scheduler, on the same TextCraft games and keys.

    python -m launch.bench_rollout_default          # CPU, a few minutes: the "cpu_default" entry of benchmarks/rollout.json

It builds the main job's trainer (``configs/textcraft_tiny.py``: the shipped warm-started tiny actor,
8 task groups x 8 games, 15 turns, lockstep) in a scratch folder and plays the rollout of one
iteration's task groups with three samplers / schedulers:

* ``lockstep_plain``: lockstep, every row prefills its whole prompt (``sampler.shared_head_tokens=0``);
* ``lockstep_shared``: lockstep, a task group's games prefill their common head once (the config's
  ``sampler.shared_head_tokens``, the default since the shared-head change);
* ``continuous``: the slot scheduler (one slot per game, ``rollout.chunk_steps``), plain inserts.

Each arm first plays the groups once untimed (every program shape compiles), then ``--reps`` timed
runs, the arms interleaved; ``wall_s`` is the fastest run (the 2 shared cores' speed moves by tens of
percent). Tokens are compared with ``lockstep_plain`` (the oracle): ``tokens_match`` per arm.
``speedup_shared`` and ``speedup_continuous`` are lockstep_plain's wall time over the arm's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 3, "timed runs per arm, interleaved; wall_s is the fastest")
flags.DEFINE_integer("first_group", 0, "index of the first training task group played (the iteration's cursor)")
flags.DEFINE_string("out", "benchmarks/rollout.json", "result file (its cpu_default entry is replaced)")


def main(_):
    from bipace_jax import tasks
    from bipace_jax.rollout import Scheduler
    from bipace_jax.sampling import Engine
    from bipace_jax.trainer import Trainer
    from configs import textcraft_tiny

    c = textcraft_tiny.get_config()
    c.log.progress = False
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(c, workdir)
        trainer._start_rollout()
        spec = trainer.spec
        scfg = trainer.engine.config
        shared_tokens = scfg.shared_head_tokens or 64
        samplers = {
            "lockstep_plain": Engine(trainer.tokenizer, dataclasses.replace(scfg, shared_head_tokens=0)),
            "lockstep_shared": Engine(trainer.tokenizer, dataclasses.replace(scfg, shared_head_tokens=shared_tokens)),
            "continuous": Engine(trainer.tokenizer, dataclasses.replace(scfg, shared_head_tokens=0)),
        }
        groups = [
            tasks.train_task(trainer.train_ids, spec.seed, FLAGS.first_group + i)
            for i in range(trainer.groups_per_host)
        ]
        key = jax.random.key(spec.seed)

        def play(arm):
            rcfg = trainer.rollout_cfg
            if arm == "continuous":
                rcfg = dataclasses.replace(rcfg, scheduler=Scheduler.CONTINUOUS)
            t0 = time.perf_counter()
            res = trainer._play(rcfg, groups, key, engine=samplers[arm])
            return time.perf_counter() - t0, res

        first = {arm: play(arm)[1] for arm in samplers}  # compiles every shape the groups need
        runs = {arm: [] for arm in samplers}
        timing = {}
        for _ in range(FLAGS.reps):
            for arm in samplers:
                wall, res = play(arm)
                runs[arm].append(wall)
                if wall == min(runs[arm]):
                    timing[arm] = res.timing
        oracle = first["lockstep_plain"]
        out = {}
        for arm in samplers:
            res = first[arm]
            same = res.response_ids.shape == oracle.response_ids.shape and np.array_equal(
                res.response_ids, oracle.response_ids
            )
            out[arm] = dict(
                wall_s=min(runs[arm]),
                wall_s_runs=runs[arm],
                rows=res.num_rows,
                success_rate=res.stats.values()["success_rate"],
                tokens_match=bool(same),
                **{k: timing[arm][k] for k in ("prefill_s", "decode_s", "env_s") if k in timing[arm]},
            )
    base = out["lockstep_plain"]["wall_s"]
    result = dict(
        out,
        setup=dict(
            config="textcraft_tiny",
            task_groups=len(groups),
            games=len(groups) * spec.rollout.group_size,
            max_turns=spec.rollout.max_steps,
            shared_head_tokens=shared_tokens,
            chunk_steps=spec.rollout.chunk_steps,
            load_1min=os.getloadavg()[0],
            backend=jax.default_backend(),
        ),
        speedup_shared=base / out["lockstep_shared"]["wall_s"],
        speedup_continuous=base / out["continuous"]["wall_s"],
    )
    print(f"{'arm':16s} {'wall s':>8s} {'prefill s':>10s} {'decode s':>9s} {'rows':>5s} {'success':>8s} tokens")
    for arm in samplers:
        r = out[arm]
        print(
            f"{arm:16s} {r['wall_s']:8.2f} {r.get('prefill_s', 0):10.2f} {r.get('decode_s', 0):9.2f} "
            f"{r['rows']:5d} {r['success_rate']:8.3f} {'same' if r['tokens_match'] else 'DIFFER'}"
        )
    print(f"speedup_shared {result['speedup_shared']:.2f}x, speedup_continuous {result['speedup_continuous']:.2f}x")
    doc = {}
    if os.path.exists(FLAGS.out):
        with open(FLAGS.out) as f:
            doc = json.load(f)
    doc["cpu_default"] = result
    with open(FLAGS.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    app.run(main)
