"""Asynchronous RL vs synchronous, side by side in one run: the trainer's iteration time on a paced game.

    python -m launch.bench_async                 # CPU, 2 emulated devices (1 samples, 1 learns): benchmarks/async.json
    python -m launch.bench_async --iterations=4 --latency_steps=8

Both arms are the same `bipace_jax.trainer.Trainer` run (the tiny TextCraft config of the tests: a
random one-layer actor, ``--groups`` task groups of ``--group_size`` games of ``--turns`` turns, 16-token
responses) with the sampler and the learner on devices of their own (``async_rl.sampler_devices=1``
of 2 CPU devices): **sync** at ``async_rl.max_staleness=0`` (the learner waits for the rollout, the
sampler for the update) and **async** at ``max_staleness=1`` (the sampler plays iteration i + 1 while
the learner trains on iteration i).

The game is paced as ``launch.bench_rollout``'s: every env step is answered ``latency_s`` after its
submit (`PacedPort`, around the run's real TextCraft pool), with ``latency_s = --latency_steps`` x one
measured decode step of the sampler (its lockstep ``decode_s`` over the decode steps of a warm-up
rollout). The learner's cost is its own: recomputed old log-probs and ``--epochs`` PPO epochs over the
iteration's rows (``ppo.epochs``), chosen so that it is comparable to the rollout; both are reported.

Measured: the wall seconds of ``Trainer.train_iteration`` per iteration after ``--warmup`` iterations
(compiles); the arms run one after the other (each is one trainer), ``--iterations`` timed iterations
each, and the median is kept. ``speedup_iteration`` = sync / async. Also per arm: the learner's wait
for the rollout (``time/rollout_s``), the rollout's own wall time and env time, the learner's stages
(old log-probs, estimator, update), the weight push and the mean version lag. The machine's load
average is recorded beside the numbers (a shared 2-core machine slows compute, and the two roles'
compute competes for it; the env's latency is a wait).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")

import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("groups", 2, "task groups per iteration")
flags.DEFINE_integer("group_size", 4, "games per task group")
flags.DEFINE_integer("turns", 6, "turns per game (env.max_steps)")
flags.DEFINE_integer("epochs", 1, "PPO epochs per iteration (the learner's cost)")
flags.DEFINE_float("latency_steps", 4.0, "env step latency, in measured decode steps")
flags.DEFINE_float("latency_s", None, "env step latency in seconds (overrides --latency_steps)")
flags.DEFINE_integer("warmup", 3, "iterations run before timing (compiles)")
flags.DEFINE_integer("iterations", 5, "timed iterations per arm")
flags.DEFINE_string("out", "benchmarks/async.json", "result file")


class PacedPort:
    """A game pool whose every step is answered ``latency_s`` after its submit (resets pass through):
    the real pool steps at once, its answer is held until due. Games step in parallel, as
    ``launch.bench_rollout``'s ``PacedPool``."""

    def __init__(self, pool, latency_s: float):
        self.pool, self.latency_s = pool, latency_s
        self._due: dict[int, float] = {}
        self._held: list = []

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def __len__(self):
        return len(self.pool)

    def submit(self, jobs):
        tickets = self.pool.submit(jobs)
        due = time.monotonic() + self.latency_s
        self._due.update(dict.fromkeys(tickets, due))
        return tickets

    def poll(self, timeout=0.0):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._held += self.pool.poll(timeout=0.0 if self._held else timeout)
            now = time.monotonic()
            ready = [(t, r) for t, r in self._held if self._due.get(t, 0.0) <= now]
            if ready or (deadline is not None and now >= deadline):
                self._held = [(t, r) for t, r in self._held if self._due.get(t, 0.0) > now]
                for t, _ in ready:
                    self._due.pop(t, None)
                return ready
            waits = [self._due.get(t, now) - now for t, _ in self._held]
            time.sleep(max(min(waits, default=0.001), 0.0005))


#: The random actor of the bench (``config.model`` sizes; the tests' tiny actor): D 32, L 1, N 2, K 1, F 64.
ACTOR = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def _config(k: int):
    """``configs/textcraft_tiny`` with the random actor ``ACTOR``: ``--groups`` x ``--group_size`` games of
    ``--turns`` turns on one env worker, 16-token responses, micro-batches of 8 rows with recomputed old
    log-probs, ``--epochs`` PPO epochs, no validation; the roles 1 + 1 at ``max_staleness`` k."""
    import configs.textcraft_tiny

    c = configs.textcraft_tiny.get_config()
    c.model.checkpoint = ""
    c.model.update(ACTOR)
    c.rollout.num_groups, c.rollout.group_size, c.env.max_steps, c.env.num_workers = (
        FLAGS.groups,
        FLAGS.group_size,
        FLAGS.turns,
        1,
    )
    c.sampler.max_new_tokens, c.sampler.batch_buckets = 16, (4, 8)
    c.ppo.micro_batch_rows, c.ppo.mini_batch_rows, c.ppo.old_logprobs = 8, 0, "recompute"
    c.val.every, c.val.at_start, c.log.progress, c.log.plots = 0, False, False, False
    c.num_iterations = FLAGS.warmup + FLAGS.iterations
    c.checkpoint.export_hf = False
    c.ppo.epochs = FLAGS.epochs
    c.async_rl.sampler_devices, c.async_rl.max_staleness = 1, k
    return c


def _arm(k: int, latency_s: float | None) -> dict:
    from bipace_jax.trainer import Trainer

    tr = Trainer(_config(k), tempfile.mkdtemp(), resume=False)
    try:
        recs, walls = [], []
        for i in range(FLAGS.warmup + FLAGS.iterations):
            if i == 0 and latency_s is None:  # the warm-up rollout prices a decode step
                rec = tr.train_iteration()
                steps = rec["rollout/turns"] * tr.spec.sampler.max_new_tokens
                latency_s = FLAGS.latency_steps * rec["time/rollout_decode_s"] / steps
                tr.pool = PacedPort(tr.pool, latency_s)
                decode_step_s = rec["time/rollout_decode_s"] / steps
                continue
            if i == 0:
                tr.pool = PacedPort(tr.pool, latency_s)
            t0 = time.perf_counter()
            rec = tr.train_iteration()
            if i >= FLAGS.warmup:
                walls.append(time.perf_counter() - t0)
                recs.append(rec)
    finally:
        tr.close()

    def med(key):
        return statistics.median(r[key] for r in recs)

    return dict(
        max_staleness=k,
        iteration_s=statistics.median(walls),
        iteration_s_all=walls,
        rollout_wait_s=med("time/rollout_s"),
        rollout_play_s=med("time/rollout_total_s"),
        rollout_env_s=med("time/rollout_env_s"),
        learner_s=med("time/old_logprobs_s") + med("time/update_s") + med("time/estimator_s"),
        weight_push_s=med("async/weight_push_s"),
        version_lag_mean=statistics.mean(r["async/version_lag_mean"] for r in recs),
        latency_s=latency_s,
        decode_step_s=locals().get("decode_step_s"),
    )


def main(argv):
    del argv
    load = os.getloadavg()
    sync = _arm(0, FLAGS.latency_s)
    asyn = _arm(1, sync["latency_s"])
    load = [max(a, b) for a, b in zip(load, os.getloadavg())]
    out = dict(
        sync=sync,
        asynchronous=asyn,
        speedup_iteration=sync["iteration_s"] / asyn["iteration_s"],
        latency_steps=FLAGS.latency_steps,
        settings=dict(
            groups=FLAGS.groups,
            group_size=FLAGS.group_size,
            turns=FLAGS.turns,
            epochs=FLAGS.epochs,
            warmup=FLAGS.warmup,
            iterations=FLAGS.iterations,
            devices="2 CPU (1 sampler + 1 learner)",
        ),
        loadavg=load,
    )
    print(f"{'arm':<8} {'iteration s':>12} {'rollout wait s':>15} {'rollout play s':>15} {'learner s':>10} {'lag':>5}")
    for name, r in (("sync", sync), ("async", asyn)):
        print(
            f"{name:<8} {r['iteration_s']:>12.3f} {r['rollout_wait_s']:>15.3f} {r['rollout_play_s']:>15.3f} "
            f"{r['learner_s']:>10.3f} {r['version_lag_mean']:>5.2f}"
        )
    print(
        f"env latency {sync['latency_s'] * 1e3:.1f} ms per step ({FLAGS.latency_steps:g} decode steps); "
        f"speedup_iteration {out['speedup_iteration']:.2f}x; load average {load[0]:.2f}"
    )
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
