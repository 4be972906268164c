"""The warm-start run: tokenizer -> tasks and expert data -> learner (restored) -> BC + DAgger rounds ->
the panel's validation (RL's record, ``validation.panel_record``) -> report and Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

import environments
from bipace_jax import build, demos, loglines, metric_keys, resume, runfolder, tasks, validation
from bipace_jax.checkpointing import Checkpointer, CheckpointMeta
from bipace_jax.demo_stream import BucketStream
from bipace_jax.learner import Learner, make_optimizer
from bipace_jax.metrics import MetricsLogger, read_metrics
from bipace_jax.models import load_tokenizer, save_hf_checkpoint
from bipace_jax.rollout import Episode, RolloutResult, collect
from bipace_jax.sampling import Engine
from bipace_jax.sft.batch import batches, make_batch, train_step
from bipace_jax.sft.examples import (
    Example,
    dagger_file,
    dagger_records,
    demo_examples,
    expert_dataset,
    read_dagger_examples,
    record_example,
)
from bipace_jax.sft.spec import MAX_POSITIONS, WarmStartSpec, build_warm_start
from bipace_jax.sharding import make_mesh
from bipace_jax.tiny import warm_start_tokenizer
from environments.pool import EnvPool

EXAMPLES_FILE = "examples.jsonl"


class _ExampleLog:
    """``examples.jsonl``: ``{"update", "round", "examples": [Example.key, ...]}`` per update, in order.

    Lines past ``start_update`` (updates a resumed run does again) are dropped when it opens, so the
    file names exactly the examples the weights were trained on. Rewritten whole by ``flush`` (runfolder).
    """

    def __init__(self, path: epath.Path, start_update: int):
        self.path = path
        lines = (runfolder.read_text(path) or "").splitlines()
        self.lines = [x for x in lines if x.strip() and json.loads(x)["update"] <= start_update]
        self.flush()

    def add(self, update: int, rnd: int, keys: list[str]) -> None:
        self.lines.append(json.dumps({"update": update, "round": rnd, "examples": keys}))

    def flush(self) -> None:
        runfolder.write_text(self.path, "".join(x + "\n" for x in self.lines))


FIRST_GAMES = 16  # the report's greedy_first_games: the games tests/test_tiny_shipped.py replays


def panel_record(
    episodes: Sequence[Episode], panels: dict[str, list[tuple[int, int]]], task_info, categories: Sequence[str]
) -> dict[str, Any]:
    """The validation record of the warm start's panel games, in RL's keys (``validation.panel_record``:
    ``val/success_rate``, ``val/success_rate/depth_<d>``, ``val/holdout/...``): ``episodes`` played one
    game per pair, panel after panel in ``validation.PANELS`` order (``play_order``)."""
    out, start = {}, 0
    for name in validation.PANELS:
        games = panels[name]
        arrays = validation.per_task(episodes[start : start + len(games)], range(len(games)), len(games), 1)
        start += len(games)
        if games:
            out.update(validation.panel_record(name, games, task_info, categories, arrays))
    return out


def play_order(panels: dict[str, list[tuple[int, int]]], limit: int | None = None) -> list[tuple[int, int]]:
    """The panels' ``(task_id, seed)`` pairs as the warm start plays them: seen goals, then held-out
    goals (``validation.PANELS``); with ``limit``, the first ``limit`` of them."""
    return [g for name in validation.PANELS for g in panels[name]][:limit]


def first_games(panels: dict[str, list[tuple[int, int]]], n: int) -> dict[str, list[tuple[int, int]]]:
    """``panels`` cut to the first ``n`` games of ``play_order``."""
    out, left = {}, n
    for name in validation.PANELS:
        out[name] = panels[name][:left]
        left -= len(out[name])
    return out


# -------------------------------------------------------------------------------------------------
# The run: tokenizer -> tasks and expert data -> learner (restored) -> BC + DAgger rounds -> report.


def _tokenizer(spec: WarmStartSpec, run_dir: epath.Path):
    """The tokenizer of ``model.tokenizer``, else the one built into ``<run_dir>/tokenizer`` (built once)."""
    m = spec.model
    tok_dir = runfolder.path(m.tokenizer, "config.model.tokenizer") if m.tokenizer else run_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        with runfolder.staged(tok_dir) as local:
            warm_start_tokenizer(
                spec.env.name, spec.rollout.template, vocab_size=m.vocab_size, seeds=spec.data.tokenizer_seeds
            ).save_pretrained(local)
    with runfolder.local_copy(tok_dir) as local:
        return load_tokenizer(local)


def _task_sets(spec: WarmStartSpec, env) -> tuple[list[int], list[int], dict[str, list[tuple[int, int]]]]:
    """(training goals, held-out goals, panel name (``validation.PANELS``) -> its (task_id, seed) pairs)."""
    train_ids, held_ids = tasks.split_holdout(
        tasks.select_tasks(spec.tasks.train, env.num_tasks, env.task_info), [], spec.tasks.holdout_every
    )
    v = spec.val
    seen, held = tasks.validation_panel(
        train_ids[:: v.rl_every], held_ids, v.num_tasks, v.num_holdout_tasks, v.seed, "spread", v.seeds_per_goal
    )
    return train_ids, held_ids, {metric_keys.VAL: seen, metric_keys.VAL_HOLDOUT: held}


class _WarmStart:
    """The state of one warm-start run: data, learner, engines, pool, metrics, update count."""

    def __init__(self, spec: WarmStartSpec, run_dir: epath.Path, tokenizer, examples, progress: bool):
        self.spec, self.run_dir, self.tokenizer, self.progress = spec, run_dir, tokenizer, progress
        self.limit = spec.data.length_buckets[-1]
        self.examples = [e for e in examples if self.fits(e)]
        arch = build.actor_architecture(
            spec.model, len(tokenizer), tokenizer.eos_token_id, max_position_embeddings=MAX_POSITIONS
        )
        actor = build.init_actor(spec.model, arch, seed=spec.seed)
        tx = make_optimizer(spec.optim, spec.total_updates)
        self.learner = Learner(actor, make_mesh(1, 1, 1, devices=jax.devices()[:1]), tx)
        self.checkpointer = Checkpointer(os.fspath(run_dir))
        # checkpoint steps count the saves; ``resume``: the position inside ``start_round`` (None: its start)
        self.start_round, self.step, self.next_save, self.resume = 0, 0, 0, None
        restored = self.checkpointer.restore_latest(self.learner.params, self.learner.opt_state)
        if restored is not None:
            latest, (self.learner.params, self.learner.opt_state, _, raw) = restored
            self.learner.sync_local()
            meta = CheckpointMeta.from_dict(raw)
            self.step, self.next_save, self.resume = meta.updates, latest + 1, meta.data_stream
            self.start_round = meta.iteration + (meta.data_stream is None)
        for r in range(min(self.start_round, spec.dagger.rounds)):  # DAgger data of the finished rounds
            self.examples += [e for e in read_dagger_examples(run_dir, r, spec.rollout, tokenizer) if self.fits(e)]
        start = self.step + 1 if restored is not None else 0
        self.metrics = MetricsLogger(os.fspath(run_dir), start_iteration=start)
        self.example_log = _ExampleLog(run_dir / EXAMPLES_FILE, self.step) if spec.train.log_examples else None
        temps = {"dagger": spec.dagger.temperature, "val": spec.val.temperature, "greedy": 0.0}
        self.engines = {k: Engine(tokenizer, spec.sampler_at(t)) for k, t in temps.items()}
        self.pool, self.task_info = None, None  # set by ``run``: the games' pool and the game's task_info

    def fits(self, e: Example) -> bool:
        return len(e.prompt_ids) + len(e.response_ids) <= self.limit

    def play(self, kind: str, pairs, key, label: bool = False) -> RolloutResult:
        """``rollout.collect`` of one game per (task_id, seed) with engine ``kind`` (oracle labels on request)."""
        learner, pool = self.learner, self.pool
        labeler = pool.oracle_actions if label else None
        return collect(
            learner.actor,
            self.engines[kind],
            pool,
            pairs,
            self.spec.rollout,
            key,
            progress=self.progress,
            labeler=labeler,
        )

    def save(self, rnd: int, key, data_stream: dict[str, Any] | None = None) -> None:
        """Checkpoint the learner after round ``rnd`` (``data_stream`` None) or inside it."""
        meta = CheckpointMeta(iteration=rnd, updates=self.step, seed=self.spec.seed, data_stream=data_stream)
        self.checkpointer.save(self.next_save, self.learner.params, self.learner.opt_state, key, meta)
        self.next_save += 1

    def _stream(self, n_steps: int, rnd: int, rng: np.random.Generator) -> tuple[BucketStream | None, int]:
        """The round's batch stream (its seed drawn from ``rng`` either way) and the updates already done:
        at a resumed round's saved position (``self.resume``), else at its start.

        Raises:
          ValueError: the saved position is over another number of examples (the data changed).
        """
        if not n_steps:
            return None, 0
        t, d = self.spec.train, self.spec.data
        stream = batches(self.examples, t.batch_size, d.length_buckets, rng)
        saved, self.resume = self.resume, None
        if saved is None:
            return stream, 0
        if saved["examples"] != len(self.examples):
            raise ValueError(
                f"round {rnd} was checkpointed over {saved['examples']} examples, this run has {len(self.examples)}: "
                "the demonstrations or config.data changed; resume with the run's config or start a new --workdir"
            )
        stream.set_state(saved["stream"])
        return stream, int(saved["round_updates"])

    def train(self, n_steps: int, rnd: int, rng: np.random.Generator, key, t_start: float) -> None:
        """``n_steps`` updates on epochs of the examples (batches from ``rng``), metrics every ``log_every``,
        a checkpoint (``key``, the stream's position) every ``checkpoint_every`` inside the round."""
        t, d = self.spec.train, self.spec.data
        stream, done = self._stream(n_steps, rnd, rng)
        bar = loglines.progress_bar(self.progress, total=n_steps, initial=done, desc=f"round {rnd} train")
        window = []
        self.learner.release_local()  # the steps do not run the actor: its copy's memory goes to them
        while done < n_steps:
            length, exs = next(stream)
            batch = make_batch(exs, length, self.tokenizer.pad_token_id, d.response_length)
            window.append(train_step(self.learner, batch, t.micro_batch_rows, f"SFT update {self.step}"))
            self.step, done = self.step + 1, done + 1
            bar.update(1)
            if self.example_log is not None:
                self.example_log.add(self.step, rnd, [e.key for e in exs])
            if self.step % t.log_every == 0 or done == n_steps:
                rec = {f"train/{k}": float(np.mean([w[k] for w in window])) for k in window[0]}
                bar.set_postfix(loss=f"{rec['train/loss']:.3f}", acc=f"{rec['train/token_accuracy']:.3f}")
                rec.update({"train/examples": len(self.examples), "time_s": time.time() - t_start})
                self.metrics.write(self.step, {"round": rnd, **rec})
                if self.example_log is not None:
                    self.example_log.flush()
                window = []
            if t.checkpoint_every and self.step % t.checkpoint_every == 0 and done < n_steps:
                pos = {"round_updates": done, "examples": len(self.examples), "stream": stream.get_state()}
                self.save(rnd, key, pos)
        bar.close()
        self.learner.sync_local()

    def dagger(self, rnd: int, rng: np.random.Generator, key, train_ids: list[int]) -> dict[str, Any]:
        """One DAgger round: the policy plays fresh seeds of training goals, the oracle labels every state."""
        d, t1 = self.spec.dagger, time.time()
        goals = [train_ids[i] for i in rng.integers(0, len(train_ids), d.episodes)]
        pairs = [(t, d.seed_base + rnd * 10_000 + k) for k, t in enumerate(goals)]
        res = self.play("dagger", pairs, key, label=True)
        records = dagger_records(res, rnd, self.spec.env.name)
        demos.write_records(dagger_file(self.run_dir, rnd), records)
        # States far off the expert's path can outgrow the longest bucket: left out, counted.
        fit = [e for e in (record_example(r, self.spec.rollout, self.tokenizer) for r in records) if self.fits(e)]
        self.examples.extend(fit)
        stats = res.stats.values()
        return {
            "dagger/success": stats["success_rate"],
            "dagger/invalid_rate": stats["invalid_rate"],
            "dagger/new_examples": len(fit),
            "dagger/too_long": len(records) - len(fit),
            "dagger_s": time.time() - t1,
        }

    def validate(self, kind: str, panels: dict[str, list[tuple[int, int]]], key) -> tuple[dict[str, Any], list]:
        """The panel games played with sampler ``kind``: (their record, ``panel_record``; the episodes)."""
        eps = self.play(kind, play_order(panels), key).episodes
        return panel_record(eps, panels, self.task_info, self.spec.rollout.spec.categories), eps

    def rounds(self, train_ids, panels, t_start: float) -> list[dict[str, Any]]:
        """BC (round 0) and the DAgger rounds from ``start_round``, checkpointed after each; their records."""
        spec, history = self.spec, []
        base_key = jax.random.key(spec.seed)
        for rnd in range(self.start_round, spec.dagger.rounds + 1):
            # Every round draws from (seed, round) only, so a resumed run repeats an uninterrupted one.
            rng, key = np.random.default_rng([spec.seed, rnd]), jax.random.fold_in(base_key, rnd)
            t0 = time.time()
            self.train(spec.train.bc_steps if rnd == 0 else spec.train.steps_per_round, rnd, rng, key, t_start)
            rec = {"round": rnd, "train_s": time.time() - t0}
            if rnd < spec.dagger.rounds:
                rec.update(self.dagger(rnd, rng, jax.random.fold_in(key, 0), train_ids))
            if spec.val.every_round and rnd < spec.dagger.rounds:
                rec.update(self.validate("val", panels, jax.random.fold_in(key, 1))[0])
            self.metrics.write(self.step, rec)
            history.append(rec)
            if self.progress:
                print(json.dumps(rec), flush=True)
            self.save(rnd, key)
        return history


def check_resume(spec: WarmStartSpec, run_dir: str | epath.Path, allow_change: bool = False) -> None:
    """Refuse to resume the warm start in ``run_dir`` with a config that differs from its ``config.json``
    outside ``resume.SFT_NEUTRAL`` (``resume.check_config_change``; ``allow_change`` keeps the old one as
    ``config.before_<updates>.json``), then write ``spec``'s config there. Reads two small files.

    Raises:
      ConfigChangeError: (a ``ValueError``) naming the folder, its logged updates and the changed fields.
    """
    workdir = os.fspath(run_dir)
    updates = max((r[metric_keys.ITERATION] for r in read_metrics(workdir) if "train/loss" in r), default=0)
    new = spec.config.to_dict()
    old = resume.stored_config(workdir)
    resume.check_config_change(workdir, old, new, updates, allow_change, neutral=resume.SFT_NEUTRAL, unit="updates")
    runfolder.write_text(runfolder.path(workdir) / resume.CONFIG_FILE, spec.config.to_json_best_effort(indent=2))


def run(
    c, workdir: str, out: str | None = None, *, progress: bool = True, allow_config_change: bool = False
) -> dict[str, Any]:
    """Runs the whole warm start; returns the report dict (also written to ``workdir/report.json``).

    ``c``: a warm-start config (``configs/sft_textcraft_tiny.py``) or its ``WarmStartSpec``.
    ``workdir`` and ``out`` may be local folders or ``gs://`` URLs (``bipace_jax.runfolder``). The
    config goes to ``workdir/config.json``; a resume (the same ``workdir`` again) with a config that
    changes the run is refused unless ``allow_config_change`` (``check_resume``).

    Raises:
      ConfigError: (a ``ValueError``) a bad config field (``build_warm_start``).
      RunFolderError: ``workdir`` or ``out`` cannot be created or written (checked before anything loads).
      ConfigChangeError: (a ``ValueError``) ``workdir`` holds a warm start of another config (checked
        before anything loads).
    """
    spec = c if isinstance(c, WarmStartSpec) else build_warm_start(c)
    t_start = time.time()
    run_dir = runfolder.prepare(workdir, "--workdir")
    out_dir = runfolder.prepare(out, "--out") if out else None
    check_resume(spec, run_dir, allow_config_change)
    tokenizer = _tokenizer(spec, run_dir)
    t_tok = time.time() - t_start

    env = environments.make(spec.env.name, max_steps=spec.env.max_steps)
    train_ids, held_ids, panels = _task_sets(spec, env)
    games = play_order(panels)
    builder = expert_dataset(spec, os.fspath(run_dir / "demos"), progress)
    examples, ostats = demo_examples(demos.read_split(builder, "train"), spec.rollout, tokenizer)

    ws = _WarmStart(spec, run_dir, tokenizer, examples, progress)
    ws.task_info = env.task_info
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ws.learner.params))
    n_envs, options = max(len(games), spec.dagger.episodes), {"max_steps": spec.env.max_steps}
    ws.pool = EnvPool(spec.env.name, n_envs, env_options=options, num_workers=spec.env.num_workers or None)
    try:
        history = ws.rounds(train_ids, panels, t_start)
        key = jax.random.fold_in(jax.random.key(spec.seed), spec.dagger.rounds + 1)
        (final, eps), (greedy, geps) = ws.validate("val", panels, key), ws.validate("greedy", panels, key)
    finally:
        ws.pool.close()
        ws.checkpointer.close()
    first = first_games(panels, FIRST_GAMES)
    categories = spec.rollout.spec.categories
    finals = {**{f"final/{k}": v for k, v in final.items()}, **{f"final_greedy/{k}": v for k, v in greedy.items()}}
    ws.metrics.write(ws.step + 1, finals)
    ws.metrics.close()
    report = {
        "final_val": final,
        "panel_temperature": spec.val.temperature,
        "wall_time_s": time.time() - t_start,
        "final_greedy": greedy,
        "greedy_first_games": panel_record(geps[:FIRST_GAMES], first, env.task_info, categories),
        "tokenizer_s": t_tok,
        "num_params": n_params,
        "vocab_size": len(tokenizer),
        "updates": ws.step,
        "expert_examples": sum(e.source == "expert" for e in ws.examples),
        "dagger_examples": sum(e.source == "dagger" for e in ws.examples),
        "oracle": ostats,
        "rounds": history,
        "seed": spec.seed,
        "train_goals": len(train_ids),
        "heldout_goals": held_ids,
        "panel": games,
        "panel_episodes": [dataclasses.asdict(e) for e in eps],
        "config": spec.config.to_dict(),
    }
    runfolder.write_text(run_dir / "report.json", json.dumps(report, indent=1, default=str))
    if out_dir is not None:
        _export(ws, tokenizer, report, out_dir)
    return report


def _export(ws: _WarmStart, tokenizer, report: dict[str, Any], out_dir: epath.Path) -> None:
    """The Hugging Face folder ``out_dir``: weights, config, tokenizer (also in ``tokenizer/``), the report."""
    with runfolder.staged(out_dir) as local:
        save_hf_checkpoint(ws.learner.actor, local, tokenizer=tokenizer)
        # transformers' AutoTokenizer, seeing config.json's model_type "qwen2", would swap in Qwen's
        # pre-tokenizer: the tokenizer as trained also goes to <out>/tokenizer (no config.json beside it).
        tokenizer.save_pretrained(os.path.join(local, "tokenizer"))
        small = {k: v for k, v in report.items() if k not in ("panel", "panel_episodes")}
        with open(os.path.join(local, "sft_report.json"), "w") as f:
            json.dump(small, f, indent=1, default=str)
