"""Warm start: behaviour cloning and DAgger on a game's oracle, through the RL loop's own pieces.

``run(config, workdir, out)`` builds the tokenizer (``tiny.warm_start_tokenizer``, unless
``config.tokenizer_path`` names one); records one ``Example`` per oracle step on the training goals
(the prompt as ``rollout.encode_prompt`` encodes it, the response ``<action>{action}</action>`` +
``<|im_end|>``); trains a fresh tiny Qwen2 with ``learner.Learner`` and ``ResponseNLL`` (token-mean
NLL of the response tokens); runs DAgger rounds (the policy plays through ``rollout.collect`` with the
oracle as ``labeler``, every visited state joins the data); validates on ``tasks.validation_panel``
and writes the Hugging Face folder ``out``. Run folder, resumption and determinism: docs/warm_start.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from tqdm import tqdm

import environments
from bipace_jax import losses, runfolder, tasks
from bipace_jax.checkpointing import Checkpointer
from bipace_jax.config import resolve_template, system_prompt_of
from bipace_jax.learner import Learner, shard_rows
from bipace_jax.metrics import MetricsLogger
from bipace_jax.models import Qwen2Actor, load_tokenizer, save_hf_checkpoint
from bipace_jax.rollout import Episode, RolloutConfig, RolloutResult, collect, encode_prompt
from bipace_jax.sampling import Sampler, SamplerConfig
from bipace_jax.sharding import make_mesh
from bipace_jax.tiny import ACTION_RESPONSE, oracle_steps, tiny_actor_config, warm_start_tokenizer
from environments.pool import EnvPool

# -------------------------------------------------------------------------------------------------
# Examples: the RL loop's prompt/response format.


@dataclasses.dataclass
class Example:
    """One behaviour-cloning example: the chat-formatted prompt's token ids and the target response's."""

    prompt_ids: list[int]
    response_ids: list[int]
    depth: int = 0
    source: str = "expert"


def encode_response(tokenizer, action: str) -> list[int]:
    """Token ids of ``<action>{action}</action>`` followed by the end-of-turn token ``<|im_end|>``."""
    ids = tokenizer(ACTION_RESPONSE.format(action=action), add_special_tokens=False)["input_ids"]
    return list(ids) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def expert_examples(env, rcfg: RolloutConfig, tokenizer, pairs: Sequence[tuple[int, int]]):
    """The oracle's episodes on each (task_id, seed) as examples; returns (examples, stats).

    Raises:
      RuntimeError: the oracle has no action before the episode ends (it must always have a plan).
    """
    examples, wins = [], 0
    for s in oracle_steps(env, pairs, rcfg.max_steps):
        if s.action is None:
            raise RuntimeError(f"oracle has no action for task {s.task_id} seed {s.seed} at step {s.step}")
        ids, _ = encode_prompt(tokenizer, rcfg, s.obs, list(s.history), s.step, f"task {s.task_id} seed {s.seed}")
        depth = int(env.task_info(s.task_id).get("depth", 0))
        examples.append(Example(ids, encode_response(tokenizer, s.action), depth, "expert"))
        wins += bool(s.next_obs.won)
    n = max(len(pairs), 1)
    return examples, {"oracle_win_rate": wins / n, "oracle_mean_length": len(examples) / n}


def dagger_examples(res: RolloutResult, tokenizer) -> list[Example]:
    """The rows of a labelled ``collect`` as examples: each row's prompt tokens and its oracle label
    (rows whose state the oracle has no action for are left out)."""
    traj = np.asarray(res.steps.traj_id)[: res.rows]
    out = []
    for r, label in enumerate(res.labels):
        if label is not None:
            prompt = res.prompt_ids[r][res.prompt_mask[r].astype(bool)].tolist()
            depth = int(res.episodes[traj[r]].task_info.get("depth", 0))
            out.append(Example(prompt, encode_response(tokenizer, label), depth, "dagger"))
    return out


def summarize(episodes: Sequence[Episode], heldout: set[int] = frozenset()) -> dict[str, float]:
    """Success rates: overall, by depth, seen vs held-out goals; mean length and invalid rate."""

    def rate(eps):
        return float(np.mean([e.won for e in eps])) if eps else float("nan")

    def depth(e):
        return int(e.task_info.get("depth", 0))

    out: dict[str, float] = {"success": rate(episodes), "n": len(episodes)}
    for d in sorted({depth(e) for e in episodes}):
        out[f"success_depth{d}"] = rate([e for e in episodes if depth(e) == d])
    held = [e for e in episodes if e.task_id in heldout]
    out["success_seen"] = rate([e for e in episodes if e.task_id not in heldout])
    if held:
        out["success_heldout"] = rate(held)
        for d in sorted({depth(e) for e in held}):
            out[f"success_heldout_depth{d}"] = rate([e for e in held if depth(e) == d])
    steps = sum(e.length for e in episodes)
    out["mean_length"] = steps / len(episodes) if episodes else 0.0
    out["invalid_rate"] = sum(e.invalid_count for e in episodes) / max(steps, 1)
    return out


# -------------------------------------------------------------------------------------------------
# Batching: fixed batch size and length buckets so the train step compiles a few times only.


@flax.struct.dataclass
class SFTBatch:
    """B right-padded rows: T tokens, R response targets (the columns that predict them)."""

    input_ids: jax.Array  # int32[B, T]
    attention_mask: jax.Array  # int32[B, T]
    positions: jax.Array  # int32[B, R], column t predicts token t + 1
    targets: jax.Array  # int32[B, R]
    target_mask: jax.Array  # float32[B, R], 1 on real response tokens


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n. Raises ValueError naming the longest bucket when n exceeds it."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(
        f"sequence of {n} tokens exceeds the longest length bucket {buckets[-1]}; raise config.data.length_buckets"
    )


def make_batch(examples: Sequence[Example], length: int, pad_id: int, response_length: int) -> SFTBatch:
    """NumPy ``SFTBatch`` of the examples padded to ``length`` tokens and ``response_length`` targets.

    Raises:
      ValueError: an example longer than ``length`` or a response longer than ``response_length``.
    """
    b = len(examples)
    ids = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.int32)
    pos = np.zeros((b, response_length), np.int32)
    tgt = np.full((b, response_length), pad_id, np.int32)
    tmask = np.zeros((b, response_length), np.float32)
    for r, ex in enumerate(examples):
        seq = ex.prompt_ids + ex.response_ids
        n, p, m = len(seq), len(ex.prompt_ids), len(ex.response_ids)
        if n > length:
            raise ValueError(f"example of {n} tokens does not fit the length bucket {length}")
        if m > response_length:
            raise ValueError(f"response of {m} tokens exceeds config.data.response_length={response_length}")
        ids[r, :n], mask[r, :n] = seq, 1
        pos[r, :m] = np.arange(p - 1, n - 1)
        tgt[r, :m], tmask[r, :m] = ex.response_ids, 1.0
    return SFTBatch(ids, mask, pos, tgt, tmask)


def batches(
    examples: Sequence[Example], batch_size: int, buckets: Sequence[int], rng: np.random.Generator
) -> Iterator[tuple[int, list[Example]]]:
    """One epoch of (length bucket, examples): shuffled, grouped by bucket; a short last batch of a
    bucket is filled with random repeats of that bucket's examples."""
    by_bucket: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        by_bucket.setdefault(bucket_length(len(ex.prompt_ids) + len(ex.response_ids), buckets), []).append(i)
    chunks = []
    for length, idx in by_bucket.items():
        idx = list(rng.permutation(idx))
        if len(idx) % batch_size:
            idx += list(rng.choice(idx, batch_size - len(idx) % batch_size))
        chunks += [(length, idx[s : s + batch_size]) for s in range(0, len(idx), batch_size)]
    for k in rng.permutation(len(chunks)):
        length, idx = chunks[k]
        yield length, [examples[i] for i in idx]


# -------------------------------------------------------------------------------------------------
# The loss, a ``learner.LossFn``.


def token_nll(logits, targets, mask, denom=None):
    """(sum of the NLL of ``targets`` on ``mask`` / ``denom``, argmax accuracy on the same tokens / ``denom``).

    logits float32[B,R,V], targets int32[B,R], mask float32[B,R]; ``denom`` defaults to ``mask.sum()``
    (the token mean); a batch's real-token count makes micro-batch sums its exact token mean.
    """
    nll = -losses.token_logprobs(logits, targets)
    acc = jnp.argmax(logits, axis=-1) == targets
    return losses.token_mean(nll, mask, denom), losses.token_mean(acc, mask, denom)


@dataclasses.dataclass(frozen=True)
class ResponseNLL:
    """The behaviour-cloning loss of an ``SFTBatch``: the LM head runs at the response columns only."""

    def __call__(self, model, mb: SFTBatch, denom):
        h, _ = model.forward_hidden(mb.input_ids, mb.attention_mask)
        h = jnp.take_along_axis(h, mb.positions[..., None], axis=1)
        loss, acc = token_nll(model.lm_logits(h), mb.targets, mb.target_mask, denom)
        return loss, {"token_accuracy": acc}


def train_step(learner: Learner, batch: SFTBatch, micro_rows: int, where: str = "") -> dict[str, float]:
    """One optimizer step on a NumPy batch split into ``micro_rows``-row micro-batches (0: one)."""
    b = batch.input_ids.shape[0]
    micro_rows = micro_rows or b
    micros = (
        shard_rows(learner.mesh, jax.tree.map(lambda x, s=s: x[s : s + micro_rows], batch))
        for s in range(0, b, micro_rows)
    )
    denom = float(max(batch.target_mask.sum(), 1.0))
    stats, gnorm = learner.step(ResponseNLL(), micros, denom, ("token_accuracy",), where=where)
    return dict(stats, grad_norm=gnorm)


# -------------------------------------------------------------------------------------------------
# The run.


def _save_examples(path: epath.Path, examples: Sequence[Example]) -> None:
    rows = [{"p": e.prompt_ids, "r": e.response_ids, "d": e.depth, "s": e.source} for e in examples]
    runfolder.write_text(path, json.dumps(rows))


def _load_examples(path: epath.Path) -> list[Example]:
    return [Example(r["p"], r["r"], r["d"], r["s"]) for r in json.loads(path.read_text())]


def validate_config(c) -> None:
    """One-line errors for bad fields, before anything compiles."""
    checks = [
        ("train.batch_size", c.train.batch_size >= 1, ">= 1"),
        (
            "train.micro_batch_rows",
            c.train.micro_batch_rows >= 0 and c.train.batch_size % (c.train.micro_batch_rows or 1) == 0,
            ">= 0 and divide train.batch_size",
        ),
        ("train.learning_rate", c.train.learning_rate > 0, "> 0"),
        ("train.bc_steps", c.train.bc_steps >= 0, ">= 0"),
        ("train.steps_per_round", c.train.steps_per_round >= 0, ">= 0"),
        ("dagger.rounds", c.dagger.rounds >= 0, ">= 0"),
        ("dagger.episodes", c.dagger.episodes >= 1, ">= 1"),
        ("dagger.temperature", c.dagger.temperature >= 0, ">= 0 (0 = greedy)"),
        ("data.expert_seeds", c.data.expert_seeds >= 1, ">= 1"),
        ("data.length_buckets", list(c.data.length_buckets) == sorted(c.data.length_buckets), "sorted"),
        ("gen.batch_buckets", list(c.gen.batch_buckets) == sorted(c.gen.batch_buckets), "sorted"),
        ("env.history_length", c.env.history_length >= 0, ">= 0"),
        ("val.temperature", c.val.temperature >= 0, ">= 0"),
        ("val.seeds_per_goal", c.val.seeds_per_goal >= 1, ">= 1"),
        ("val.rl_every", c.val.rl_every >= 1, ">= 1"),
    ]
    for name, ok, expected in checks:
        if not ok:
            section, field = name.split(".")
            raise ValueError(f"config.{name} must be {expected}, got {c[section][field]!r}")


def make_optimizer(c) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; linear warmup to ``train.learning_rate``, cosine to 10% at the last update."""
    t = c.train
    total = t.bc_steps + c.dagger.rounds * t.steps_per_round
    lr = optax.warmup_cosine_decay_schedule(
        0.0, t.learning_rate, t.warmup_steps, max(total, t.warmup_steps + 1), end_value=0.1 * t.learning_rate
    )
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), optax.adamw(lr, weight_decay=t.weight_decay))


def _sampler(tokenizer, c, *, temperature: float) -> Sampler:
    g = c.gen
    return Sampler(
        tokenizer,
        SamplerConfig(
            max_new_tokens=g.max_new_tokens,
            temperature=temperature or 1.0,
            greedy=temperature == 0,
            batch_buckets=tuple(g.batch_buckets),
            length_buckets=tuple(g.length_buckets),
        ),
    )


def rollout_config(c) -> RolloutConfig:
    """How the warm start plays (one game per panel task, the RL loop's prompt settings)."""
    return RolloutConfig(
        game=c.env.game,
        group_size=1,
        max_steps=c.env.max_steps,
        history_length=c.env.history_length,
        max_prompt_length=c.gen.length_buckets[-1],
        fallback_action=c.env.fallback_action,
        show_inventory=c.env.show_inventory,
        system_prompt=system_prompt_of(c.env.system_prompt),
        template=resolve_template(c.env.template),
    )


def run(c, workdir: str, out: str | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Runs the whole warm start; returns the report dict (also written to ``workdir/report.json``).

    ``workdir`` and ``out`` may be local folders or ``gs://`` URLs (``bipace_jax.runfolder``).

    Raises:
      ValueError: a bad config field (``validate_config``).
      RunFolderError: ``workdir`` or ``out`` cannot be created or written (checked before anything loads).
    """
    validate_config(c)
    t_start = time.time()
    run_dir = runfolder.prepare(workdir, "--workdir")
    out_dir = runfolder.prepare(out, "--out") if out else None
    workdir = os.fspath(run_dir)
    template = resolve_template(c.env.template)

    # 1. tokenizer
    tok_dir = runfolder.path(c.tokenizer_path, "config.tokenizer_path") if c.tokenizer_path else run_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        with runfolder.staged(tok_dir) as local:
            warm_start_tokenizer(
                c.env.game, template, vocab_size=c.tokenizer_vocab_size, seeds=c.tokenizer_seeds
            ).save_pretrained(local)
    with runfolder.local_copy(tok_dir) as local:
        tokenizer = load_tokenizer(local)
    t_tok = time.time() - t_start

    # 2. tasks, the panel and expert data
    env = environments.make(c.env.game, max_steps=c.env.max_steps)
    train_ids, held_ids = tasks.split_holdout(
        tasks.select_tasks(c.env.tasks, env.num_tasks, env.task_info), [], c.env.holdout_every
    )
    seen, held = tasks.validation_panel(
        train_ids[:: c.val.rl_every],
        held_ids,
        c.val.num_seen,
        c.val.num_heldout,
        c.val.seed_base,
        "spread",
        c.val.seeds_per_goal,
    )
    panel, held_set = seen + held, set(held_ids)
    rcfg = rollout_config(c)
    data_path = run_dir / "examples.json"
    ostats = {}
    if data_path.exists():
        examples = _load_examples(data_path)
    else:
        pairs = [(t, s) for s in range(c.data.expert_seeds) for t in train_ids]
        examples, ostats = expert_examples(env, rcfg, tokenizer, pairs)
        _save_examples(data_path, examples)
    limit = c.data.length_buckets[-1]

    def fits(e):
        return len(e.prompt_ids) + len(e.response_ids) <= limit

    examples = [e for e in examples if fits(e)]

    # 3. model, optimizer, checkpoints
    m = c.model
    cfg = tiny_actor_config(
        len(tokenizer),
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        eos_token_id=tokenizer.eos_token_id,
    )
    actor = Qwen2Actor(cfg, rngs=nnx.Rngs(c.seed))
    learner = Learner(actor, make_mesh(1, 1, 1, devices=jax.devices()[:1]), make_optimizer(c))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(learner.params))
    ckpt = Checkpointer(workdir)
    start_round, step = 0, 0
    restored = ckpt.restore_latest(learner.params, learner.opt_state)
    if restored is not None:
        latest, (learner.params, learner.opt_state, _, meta) = restored
        learner.sync_local()
        start_round, step = latest + 1, int(meta["updates"])
    for r in range(start_round):  # DAgger data of the finished rounds
        path = run_dir / f"dagger_{r}.json"
        if path.exists():
            examples += _load_examples(path)
    metrics = MetricsLogger(workdir, start_iteration=step + 1 if restored is not None else 0)
    samplers = {
        "dagger": _sampler(tokenizer, c, temperature=c.dagger.temperature),
        "val": _sampler(tokenizer, c, temperature=c.val.temperature),
        "greedy": _sampler(tokenizer, c, temperature=0.0),
    }
    pool = EnvPool(
        c.env.game,
        max(len(panel), c.dagger.episodes),
        env_options={"max_steps": c.env.max_steps},
        num_workers=c.env.num_workers or None,
    )

    def play(kind: str, pairs, key, label=False) -> RolloutResult:
        return collect(
            learner.actor,
            samplers[kind],
            pool,
            tokenizer,
            pairs,
            rcfg,
            key,
            progress=progress,
            labeler=pool.oracle_actions if label else None,
        )

    def train(n_steps: int, rnd: int, rng: np.random.Generator):
        nonlocal step
        bar = tqdm(total=n_steps, desc=f"round {rnd} train", disable=not progress)
        done, window = 0, []
        while done < n_steps:
            for length, exs in batches(examples, c.train.batch_size, c.data.length_buckets, rng):
                batch = make_batch(exs, length, tokenizer.pad_token_id, c.data.response_length)
                window.append(train_step(learner, batch, c.train.micro_batch_rows, f"SFT update {step}"))
                step, done = step + 1, done + 1
                bar.update(1)
                if step % c.train.log_every == 0 or done == n_steps:
                    rec = {f"train/{k}": float(np.mean([w[k] for w in window])) for k in window[0]}
                    bar.set_postfix(loss=f"{rec['train/loss']:.3f}", acc=f"{rec['train/token_accuracy']:.3f}")
                    rec.update({"train/examples": len(examples), "time_s": time.time() - t_start})
                    metrics.write(step, {"round": rnd, **rec})
                    window = []
                if done >= n_steps:
                    break
        bar.close()
        learner.sync_local()

    history = []
    base_key = jax.random.key(c.seed)
    try:
        for rnd in range(start_round, c.dagger.rounds + 1):
            # Every round draws from (seed, round) only, so a resumed run repeats an uninterrupted one.
            rng, key = np.random.default_rng([c.seed, rnd]), jax.random.fold_in(base_key, rnd)
            t0 = time.time()
            train(c.train.bc_steps if rnd == 0 else c.train.steps_per_round, rnd, rng)
            rec = {"round": rnd, "train_s": time.time() - t0}
            if rnd < c.dagger.rounds:
                t1 = time.time()
                goals = [train_ids[i] for i in rng.integers(0, len(train_ids), c.dagger.episodes)]
                pairs = [(t, c.dagger.seed_base + rnd * 10_000 + k) for k, t in enumerate(goals)]
                res = play("dagger", pairs, jax.random.fold_in(key, 0), label=True)
                # States far off the expert's path can outgrow the longest bucket: left out, counted.
                new = dagger_examples(res, tokenizer)
                fit = [e for e in new if fits(e)]
                _save_examples(run_dir / f"dagger_{rnd}.json", fit)
                examples.extend(fit)
                s = summarize(res.episodes)
                rec.update(
                    {
                        "dagger/success": s["success"],
                        "dagger/invalid_rate": s["invalid_rate"],
                        "dagger/new_examples": len(fit),
                        "dagger/too_long": len(new) - len(fit),
                        "dagger_s": time.time() - t1,
                    }
                )
            if c.val.every_round and rnd < c.dagger.rounds:
                s = summarize(play("val", panel, jax.random.fold_in(key, 1)).episodes, held_set)
                rec.update({f"val/{k}": v for k, v in s.items()})
            metrics.write(step, rec)
            history.append(rec)
            if progress:
                print(json.dumps(rec), flush=True)
            ckpt.save(rnd, learner.params, learner.opt_state, key, {"round": rnd, "updates": step})

        key = jax.random.fold_in(base_key, c.dagger.rounds + 1)
        eps = play("val", panel, key).episodes
        geps = play("greedy", panel, key).episodes
    finally:
        pool.close()
        ckpt.close()
    final, greedy = summarize(eps, held_set), summarize(geps, held_set)
    metrics.write(
        step + 1, {**{f"final/{k}": v for k, v in final.items()}, **{f"final_greedy/{k}": v for k, v in greedy.items()}}
    )
    metrics.close()
    report = {
        "final_val": final,
        "panel_temperature": c.val.temperature,
        "wall_time_s": time.time() - t_start,
        "final_greedy": greedy,
        "greedy_first_games": summarize(geps[:16], held_set),
        "tokenizer_s": t_tok,
        "num_params": n_params,
        "vocab_size": len(tokenizer),
        "updates": step,
        "expert_examples": sum(e.source == "expert" for e in examples),
        "dagger_examples": sum(e.source == "dagger" for e in examples),
        "oracle": ostats,
        "rounds": history,
        "seed": c.seed,
        "train_goals": len(train_ids),
        "heldout_goals": held_ids,
        "panel": panel,
        "panel_episodes": [dataclasses.asdict(e) for e in eps],
        "config": c.to_dict(),
    }
    runfolder.write_text(run_dir / "report.json", json.dumps(report, indent=1, default=str))
    if out_dir is not None:
        with runfolder.staged(out_dir) as local:
            save_hf_checkpoint(learner.actor, local, tokenizer=tokenizer)
            # transformers' AutoTokenizer, seeing config.json's model_type "qwen2", would swap in Qwen's
            # pre-tokenizer: the tokenizer as trained also goes to <out>/tokenizer (no config.json beside it).
            tokenizer.save_pretrained(os.path.join(local, "tokenizer"))
            small = {k: v for k, v in report.items() if k not in ("panel", "panel_episodes")}
            with open(os.path.join(local, "sft_report.json"), "w") as f:
                json.dump(small, f, indent=1, default=str)
    return report
