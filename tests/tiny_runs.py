"""The tiny training run the end-to-end tests share: a random one-layer actor on ``configs/textcraft_tiny``,
as command-line flags or set on a config, and one RL iteration with what the learner was given recorded."""

from __future__ import annotations

import jax
import numpy as np

# The random actor of these runs (`config.model` fields): D 32, L 1, N 2, K 1, F 64.
TINY_ACTOR = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
TINY_ACTOR_FLAGS = tuple(f"--config.model.{k}={v}" for k, v in TINY_ACTOR.items())

# `python -m launch.train` flags of a run small enough for CI: the random actor, 2 task groups of 2 games
# of 3 steps, validation on 2 + 1 tasks of one seed each.
TINY_RUN_FLAGS = (
    *TINY_ACTOR_FLAGS,
    "--config.model.checkpoint=",
    "--config.rollout.num_groups=2",
    "--config.rollout.group_size=2",
    "--config.env.max_steps=3",
    "--config.env.num_workers=1",
    "--config.sampler.max_new_tokens=16",
    "--config.sampler.batch_buckets=(4, 8)",
    "--config.val.num_tasks=2",
    "--config.val.num_holdout_tasks=1",
    "--config.val.seeds_per_goal=1",
    "--config.ppo.micro_batch_rows=8",
    "--config.log.progress=False",
)


def use_tiny_actor(c) -> None:
    """Sets ``c.model`` (a run config) to ``TINY_ACTOR``, a random actor: no checkpoint."""
    c.model.checkpoint = ""
    c.model.update(TINY_ACTOR)


def one_iteration_config(*, group_size: int, max_steps: int, batch_buckets: tuple[int, ...]):
    """``configs/textcraft_tiny`` for one RL iteration of the tiny actor: 2 task groups of ``group_size``
    games of up to ``max_steps`` steps on one env worker, responses of up to 16 tokens in sampler
    batches of ``batch_buckets``, micro-batches of 8 rows with recomputed old log-probs, no validation,
    no progress bar or plots."""
    import configs.textcraft_tiny

    c = configs.textcraft_tiny.get_config()
    use_tiny_actor(c)
    c.rollout.num_groups, c.rollout.group_size, c.env.max_steps, c.env.num_workers = 2, group_size, max_steps, 1
    c.sampler.max_new_tokens, c.sampler.batch_buckets = 16, batch_buckets
    c.ppo.micro_batch_rows, c.ppo.mini_batch_rows, c.ppo.old_logprobs = 8, 0, "recompute"
    c.val.every, c.val.at_start, c.log.progress, c.log.plots = 0, False, False, False
    return c


def recorded_iteration(tr):
    """Runs ``tr.train_iteration()`` once, then closes the trainer. Returns ``(record, result, batch,
    updated)``: the iteration's metrics, the rollout result ``tr._play`` returned, the ``TokenBatch`` the
    learner's ``update`` was given, and whether any parameter changed."""
    seen = {}
    play, update = tr._play, tr.learner.update
    tr._play = lambda *a, **k: seen.setdefault("res", play(*a, **k))
    tr.learner.update = lambda batch, *a, **k: update(seen.setdefault("batch", batch), *a, **k)
    before = jax.tree.map(np.asarray, tr.learner.params)
    try:
        rec = tr.train_iteration()
    finally:
        tr.close()
    after = jax.tree.map(np.asarray, tr.learner.params)
    updated = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    return rec, seen["res"], seen["batch"], updated
