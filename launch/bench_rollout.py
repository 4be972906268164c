"""Rollout schedulers: lockstep vs continuous (slot) batching on the same games and keys.

    python -m launch.bench_rollout                  # CPU, about a minute: writes benchmarks/rollout.json
    python -m launch.bench_rollout --games=32 --slots=16 --eos_every=12 --latency_s=0.02

A fake paced game (``PacedPool``: TextCraft prompts, every game lasts ``--turns`` steps, each pool
``step`` call sleeps ``--latency_s``, as a pool stepping its games in parallel would; a submitted step
is answered ``--latency_s`` after its submit, while the continuous scheduler decodes) is driven by a
random tiny Qwen2 actor doing real compute. Response lengths are set by the EOS set: every
``--eos_every``-th token id ends a response, so lengths are roughly geometric with mean
``eos_every`` (capped at ``--new_tokens``); a larger value widens the spread. Both schedulers play the
same games with the same per-(game, turn) keys (sampled, temperature 1), so they produce the same
tokens (checked: ``tokens_match``). Measured: wall time of ``collect`` (median of ``--reps`` after one
untimed warm-up run that compiles), decode steps (lockstep: the longest response of each turn summed
over turns; continuous: the chunk steps run) and slot use. ``speedup_wall`` and ``speedup_decode_steps``
are lockstep / continuous.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("games", 16, "games (task groups of 8)")
flags.DEFINE_integer("slots", 16, "continuous scheduler slots")
flags.DEFINE_integer("turns", 4, "steps per game")
flags.DEFINE_integer("new_tokens", 32, "sampler max_new_tokens")
flags.DEFINE_integer("eos_every", 10, "every n-th token id is an EOS id (mean response length ~ n)")
flags.DEFINE_integer("chunk", 8, "decode steps per continuous chunk")
flags.DEFINE_float("latency_s", 0.02, "seconds each pool step call sleeps")
flags.DEFINE_integer("reps", 2, "timed runs per scheduler")
flags.DEFINE_string("out", "benchmarks/rollout.json", "result file")


class PacedPool:
    """A pool of fake games with TextCraft prompts: each lasts ``turns`` steps; ``step`` sleeps ``latency_s``
    (games step in parallel); a ``submit``-ted step is answered by ``poll`` ``latency_s`` after its submit."""

    env = "textcraft"

    def __init__(self, n: int, turns: int, latency_s: float):
        self.n, self.turns, self.latency_s = n, turns, latency_s
        self.t = [0] * n
        self._due: dict[int, tuple[float, int]] = {}  # ticket -> (when it is answered, env)
        self._ticket = 0

    def submit(self, jobs):
        now, tickets = time.monotonic(), []
        for job in jobs:
            self._due[self._ticket] = (now + self.latency_s, job.env)
            tickets.append(self._ticket)
            self._ticket += 1
        return tickets

    def poll(self, timeout=0.0):
        from environments.pool import StepResult

        if not self._due:
            return []
        first = min(due for due, _ in self._due.values())
        wait = first - time.monotonic()
        if wait > 0:
            time.sleep(wait if timeout is None else min(wait, timeout))
        now, out = time.monotonic(), []
        for ticket in sorted(self._due):
            due, i = self._due[ticket]
            if due <= now:
                del self._due[ticket]
                self.t[i] += 1
                out.append((ticket, StepResult(self._obs(i), 0.0, self.t[i] >= self.turns, {})))
        return out

    def __len__(self):
        return self.n

    def _obs(self, i):
        from environments.base import Observation

        text = f"Crafting commands: craft 4 oak planks using 1 oak log. Goal: craft item {i % 7}. Step {self.t[i]}."
        return Observation(text=text, anchor=text, task=text)

    def reset(self, envs, tasks, seeds):
        from environments.pool import ResetResult

        for i in envs:
            self.t[i] = 0
        return [ResetResult(self._obs(i), {}) for i in envs]

    def task_info(self, envs):
        from environments.pool import TaskInfoResult

        return [TaskInfoResult({"goal": "item"}) for _ in envs]

    def step(self, envs, actions):
        from environments.pool import StepResult

        time.sleep(self.latency_s)
        out = []
        for i in envs:
            self.t[i] += 1
            out.append(StepResult(self._obs(i), 0.0, self.t[i] >= self.turns, {}))
        return out


def main(_):
    import jax
    import numpy as np
    from flax import nnx

    from bipace_jax.models import Qwen2Actor
    from bipace_jax.rollout import RolloutConfig, collect
    from bipace_jax.sampling import Sampler, SamplerConfig
    from bipace_jax.tiny import tiny_actor_config, train_tokenizer

    corpus = [f"Crafting commands: craft {k} oak planks using 1 oak log. Goal: craft item {k}." for k in range(50)]
    tok = train_tokenizer(corpus * 4, vocab_size=400)
    actor = Qwen2Actor(tiny_actor_config(len(tok), eos_token_id=None), rngs=nnx.Rngs(0))
    eos = tuple(range(3, len(tok), FLAGS.eos_every))
    scfg = SamplerConfig(
        max_new_tokens=FLAGS.new_tokens,
        length_buckets=(1024,),
        batch_buckets=(1, 2, 4, 8, 16, 32, 64),
        eos_token_ids=eos,
    )
    sampler = Sampler(tok, scfg)
    groups = [(k, k) for k in range(max(1, FLAGS.games // 8))]
    rcfg = RolloutConfig(
        game="textcraft",
        group_size=8,
        max_steps=FLAGS.turns,
        max_prompt_length=1024,
        num_slots=FLAGS.slots,
        chunk_steps=FLAGS.chunk,
    )
    pool = PacedPool(len(groups) * 8, FLAGS.turns, FLAGS.latency_s)
    key = jax.random.key(0)
    report, results = {}, {}
    for sched in ("lockstep", "continuous"):
        collect(actor, sampler, pool, tok, groups, rcfg, key, progress=False, scheduler=sched)  # compile
        walls = []
        for _ in range(FLAGS.reps):
            t0 = time.perf_counter()
            res = collect(actor, sampler, pool, tok, groups, rcfg, key, progress=False, scheduler=sched)
            walls.append(time.perf_counter() - t0)
        results[sched] = res
        lengths = res.response_mask.sum(1)
        if sched == "lockstep":
            steps = np.asarray(res.steps.step)[: res.rows]
            decode_steps = int(sum(lengths[steps == t].max() - 1 for t in np.unique(steps)))
            use = float((lengths - 1).sum() / max(decode_steps * len(lengths[steps == 0]), 1))
        else:
            decode_steps, use = int(res.timing["decode_steps"]), res.stats["slot_use"]
        report[sched] = dict(
            wall_s=statistics.median(walls),
            decode_steps=decode_steps,
            slot_use=use,
            env_s=res.timing["env_s"],
            prefill_s=res.timing["prefill_s"],
            decode_s=res.timing["decode_s"],
        )
    lock, cont = results["lockstep"], results["continuous"]
    lengths = lock.response_mask.sum(1)
    report.update(
        setup=dict(
            games=len(groups) * 8,
            slots=FLAGS.slots,
            turns=FLAGS.turns,
            new_tokens=FLAGS.new_tokens,
            eos_every=FLAGS.eos_every,
            chunk=FLAGS.chunk,
            latency_s=FLAGS.latency_s,
            response_len_mean=float(lengths.mean()),
            response_len_std=float(lengths.std()),
            backend=jax.default_backend(),
        ),
        tokens_match=bool(np.array_equal(lock.response_ids, cont.response_ids)),
        speedup_wall=report["lockstep"]["wall_s"] / report["continuous"]["wall_s"],
        speedup_decode_steps=report["lockstep"]["decode_steps"] / max(report["continuous"]["decode_steps"], 1),
    )
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    app.run(main)
