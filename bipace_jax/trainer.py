"""The RL trainer: collect -> old/reference log-probs -> advantages -> PPO update -> record.

One iteration (``Trainer.train_iteration``), top to bottom:

1. **Collect** (``rollout.collect``): this host's task groups, G games each, played in lockstep by the
   KV-cache sampler; the BiPACE fingerprints come out of its prefill (no extra forward).
2. **Old / reference log-probabilities**: ``ppo.old_logprobs`` ``"recompute"`` (verl's default),
   ``"sampler"`` (exact without top-p/top-k) or ``"fused"`` (inside the gradient pass, exact for one
   optimizer step); the reference forward uses the frozen initial parameters (skipped at kl_coef 0).
3. **Advantages**: ``estimators.compute_advantages`` (``docs/estimators.md``).
4. **Update**: ``PPOLearner.update``; a NaN/Inf stops the run (``NonFiniteError``) before it applies.
5. **Record**: episode, estimator, loss and timing metrics, summed or averaged over hosts.

Multi-host: each process plays its share of the task groups on a host-local copy of the parameters;
the gradient step is one global ``jax.jit`` over all devices, the batch sharded over ("data", "fsdp").
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from tqdm import tqdm

import environments
from bipace_jax import config as config_lib
from bipace_jax import distributed, runfolder, sharding, tasks
from bipace_jax.checkpointing import Checkpointer
from bipace_jax.estimators import calibrate_epsilon, compute_advantages
from bipace_jax.estimators.diagnostics import SIZE_STATS
from bipace_jax.metrics import MetricsLogger, make_plots, read_metrics
from bipace_jax.models import load_tokenizer, save_hf_checkpoint
from bipace_jax.ppo import NonFiniteError
from bipace_jax.rollout import Episode, collect
from bipace_jax.sampling import Sampler
from bipace_jax.tiny import build_game_tokenizer
from environments.pool import EnvPool

log = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "Trainer"]


_PANEL_OPTIONS = {"val": "val.options", "val/holdout": "val.holdout_options"}  # panel -> its game options


class Trainer:
    """Owns the actor, learner, env pool, samplers, checkpoints and metrics of one run.

    Args:
      config: a ``configs/base.py``-layout config (checked by ``bipace_jax.config.validate``).
      workdir: run folder, local or ``gs://`` (metrics.jsonl, tb/, plots/, checkpoints/, tokenizer/, hf_final/).
      resume: restore the latest checkpoint in ``workdir`` when there is one (a run started again in
        the same folder continues; pass False to refuse, which raises if a checkpoint exists).
      actor, tokenizer: optional pre-built actor/tokenizer (hooks for warm starts and tests);
        default: ``config.build_actor`` / the checkpoint's or the project's game tokenizer.
      env_factory: optional picklable callable building one game as ``env_factory(max_steps=...)``
        (a wrapped or custom ``TextEnv``, e.g. ``environments.testing.ChaosEnv``) in place of
        ``environments.make(config.env.name)``; prompts still follow ``config.env.name``.

    Raises:
      ConfigError: a bad config field (before anything compiles).
      RunFolderError: ``workdir`` cannot be created or written (before the model loads).
      FileExistsError: ``resume=False`` and ``workdir`` already has checkpoints.
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        workdir: str,
        *,
        resume: bool = True,
        actor: nnx.Module | None = None,
        tokenizer: Any = None,
        env_factory: Callable[..., Any] | None = None,
    ):
        config_lib.validate(config, num_devices=jax.device_count())
        c = self.config = config
        self.workdir = workdir
        self.is_primary = jax.process_index() == 0
        self.num_hosts = jax.process_count()
        data, fsdp, tensor = config_lib.process_layout(c, self.num_hosts, jax.device_count(), jax.local_device_count())
        runfolder.prepare(workdir)  # fails in seconds, before the model loads
        self.mesh = sharding.make_mesh(data, fsdp, tensor)
        self.local_mesh = distributed.local_mesh(self.mesh, tensor)

        # Tasks first (missing game data fails before the model loads): training and held-out goals, and
        # the validation panels (from the training goals, or from the games of val.options /
        # val.holdout_options, e.g. ALFWorld's valid splits).
        game = env_factory if env_factory is not None else c.env.name
        opts = {"max_steps": c.env.max_steps, **config_lib.game_options(c, "env.options")}
        own = {name: config_lib.game_options(c, field) for name, field in _PANEL_OPTIONS.items()}  # panel games
        probe = self._probe(game, opts, "env.options")
        probes = {k: self._probe(game, {**opts, **o}, _PANEL_OPTIONS[k]) if o else probe for k, o in own.items()}
        self._task_infos = {name: p.task_info for name, p in probes.items()}
        self.train_ids, self.holdout_ids = tasks.split_holdout(
            tasks.select_tasks(c.tasks.train, probe.num_tasks, probe.task_info),
            tasks.select_tasks(c.tasks.holdout, probe.num_tasks, probe.task_info),
            c.tasks.holdout_every,
        )
        if not self.train_ids:
            raise config_lib.ConfigError(
                f"config.tasks.train selects no task outside the held-out goals, got {c.tasks.train!r}"
            )
        v = c.val
        seen = list(range(probes["val"].num_tasks)) if own["val"] else self.train_ids
        held = list(range(probes["val/holdout"].num_tasks)) if own["val/holdout"] else self.holdout_ids
        panel_options = (v.num_tasks, v.num_holdout_tasks, v.seed, v.panel, v.seeds_per_goal)
        self.val_panel, self.holdout_panel = tasks.validation_panel(seen, held, *panel_options)

        # Model and learner.
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.actor = actor if actor is not None else config_lib.build_actor(c, self.tokenizer, self.mesh)
        support = len(self.tokenizer)  # embedding rows past the tokenizer (Qwen2.5 pads V) are never drawn
        self.learner = config_lib.ppo_learner(c, self.actor, self.mesh, self.local_mesh, support=support)

        # Run state, restored from the latest checkpoint when there is one.
        self.iteration, self.task_cursor = 0, 0
        self.rng = jax.random.PRNGKey(c.seed)
        self.epsilon = float(c.estimator.epsilon)
        # Epsilon tunes the clustering: without it (grpo, gigpo) it is neither calibrated nor controlled.
        clusters = config_lib.estimator_config(c).clusters
        self.needs_calibration = bool(c.estimator.calibration.enabled) and clusters  # done on iteration 0
        self.controller = config_lib.epsilon_controller(c) if clusters else None
        self.checkpointer = Checkpointer(workdir, keep=c.checkpoint.keep)
        latest = self.checkpointer.latest_step()
        if latest is not None and not resume:
            raise FileExistsError(
                f"{workdir} already holds checkpoints (latest step {latest}); pass --resume or use a new --workdir"
            )
        if latest is not None:
            self._restore()

        # Rollout: one env pool for training and the panels of the training game, one per other panel
        # game; a sampler per temperature.
        self.groups_per_host = c.rollout.num_groups // self.num_hosts
        validating = bool(c.val.every or c.val.at_start)
        rows = {
            name: math.ceil(len(panel) * c.val.group_size / self.num_hosts) if validating else 0
            for name, panel in (("val", self.val_panel), ("val/holdout", self.holdout_panel))
        }
        pool_kw = {"num_workers": c.env.num_workers} if c.env.num_workers else {}

        def pool(options, n):
            return EnvPool(game, n, env_options=options, timeout_s=c.env.timeout_s, **pool_kw)

        shared = [n for name, n in rows.items() if not own[name]]
        self.pool = pool(opts, max([self.groups_per_host * c.rollout.group_size, *shared]))
        self.val_pools = {k: pool({**opts, **own[k]}, n) if own[k] and n else self.pool for k, n in rows.items()}
        checkpoint = config_lib.resolve_path(c.model.checkpoint) if c.model.checkpoint else ""
        eos = config_lib.stop_token_ids(self.actor.config.eos_token_ids, self.tokenizer, checkpoint) or None
        scfg = config_lib.sampler_config(c, eos_token_ids=eos)
        vcfg = config_lib.sampler_config(c, eos_token_ids=eos, temperature=c.val.temperature)
        self.sampler = Sampler(self.tokenizer, scfg, mesh=self.local_mesh)
        self.val_sampler = Sampler(self.tokenizer, vcfg, mesh=self.local_mesh)
        self.rollout_cfg = config_lib.rollout_config(c, group_size=c.rollout.group_size, sampler=scfg)
        self.val_rollout_cfg = config_lib.rollout_config(c, group_size=c.val.group_size, sampler=vcfg)

        self.metrics = MetricsLogger(workdir, start_iteration=self.iteration, enabled=self.is_primary)
        if self.is_primary:
            runfolder.write_text(runfolder.path(workdir) / "config.json", config.to_json_best_effort(indent=2))

    def _load_tokenizer(self):
        m = self.config.model
        if m.tokenizer or m.checkpoint:
            return load_tokenizer(config_lib.resolve_path(m.tokenizer or m.checkpoint))
        path = runfolder.path(self.workdir) / "tokenizer"
        if (path / "tokenizer.json").exists():
            with runfolder.local_copy(path) as local:
                return load_tokenizer(local)
        if self.num_hosts > 1:
            raise config_lib.ConfigError("config.model.tokenizer must be set for a multi-host random init, got ''")
        with runfolder.staged(path) as local:
            return build_game_tokenizer(self.config, local)

    def _play(self, sampler: Sampler, rcfg, games: list[tuple[int, int]], key: jax.Array, pool=None):
        """``rollout.collect`` of one task group per (task_id, game_seed) pair (on the training pool by default)."""
        progress = self.config.log.progress and self.is_primary
        tids, seeds = [t for t, _ in games], [s for _, s in games]
        pool = self.pool if pool is None else pool
        return collect(self.actor, sampler, pool, self.tokenizer, tids, seeds, rcfg, key, progress=progress)

    def _probe(self, game, options: dict[str, Any], field: str):
        """One game built in this process with ``options`` (task count, task infos); bad options -> ConfigError."""
        try:
            return game(**options) if callable(game) else environments.make(game, **options)
        except (TypeError, ValueError, FileNotFoundError, ImportError) as e:
            raise config_lib.ConfigError(
                f"config.{field}: the game {self.config.env.name!r} refused {options}: {e}"
            ) from None

    # ------------------------------------------------------------------------------------------
    def train_iteration(self) -> dict[str, Any]:
        """Run iteration ``self.iteration`` and advance the run state (not the checkpoint)."""
        c, L = self.config, self.learner
        t = {"start": time.perf_counter()}
        self.rng, key = jax.random.split(self.rng)
        k_roll = jax.random.split(jax.random.fold_in(key, jax.process_index()))[0]
        k_ppo = jax.random.split(jax.random.fold_in(key, 0))[1]  # the same on every host: one global shuffle

        # 1. Collect.
        first = self.task_cursor + jax.process_index() * self.groups_per_host
        groups = [tasks.train_task(self.train_ids, c.seed, first + i) for i in range(self.groups_per_host)]
        res = self._play(self.sampler, self.rollout_cfg, groups, k_roll)
        batch = res.token_batch()
        t["rollout"] = time.perf_counter()

        # 2-3. Old and reference log-probs.
        sample_lp = np.asarray(res.sample_logprobs, np.float32)
        old_lp = L.logprobs(L.params_local, batch) if c.ppo.old_logprobs == "recompute" else sample_lp
        t["old_logprobs"] = time.perf_counter()
        ref_lp = L.logprobs(L.ref_params_local, batch) if L.ref_params_local is not None else None
        t["ref_logprobs"] = time.perf_counter()

        # 4. Advantages.
        calibrated = self._calibrate_epsilon(res.steps) if self.needs_calibration else None
        ecfg = config_lib.estimator_config(c, self.epsilon)
        adv, diag = compute_advantages(res.steps, ecfg)
        adv = res.row_values(jax.block_until_ready(adv))
        t["estimator"] = time.perf_counter()
        # Every run records both partitions (hash_* always; cluster_* at this epsilon), so the singleton
        # tax of exact hashing is visible beside the clusters whichever partition trains.
        other = diag if ecfg.clusters else compute_advantages(res.steps, dataclasses.replace(ecfg, name="bigpo"))[1]
        diag = dict(diag, **{f"cluster_{k}": other[k] for k in SIZE_STATS})
        if not np.all(np.isfinite(adv)):
            raise NonFiniteError(
                f"non-finite advantages at iteration {self.iteration} from estimator "
                f"{c.estimator.name}; no update applied"
            )

        # 5. Update.
        try:
            batch = batch.with_(old_logprobs=old_lp, ref_logprobs=ref_lp, advantages=adv)
            upd = L.update(batch, k_ppo, where=f"iteration {self.iteration}, ")
        except NonFiniteError as e:
            raise NonFiniteError(
                f"{e}; the last good checkpoint is step {self.checkpointer.latest_step()} "
                f"in {self.checkpointer.directory}"
            ) from None
        t["update"] = time.perf_counter()

        # 6. Record.
        rec = self._episode_metrics(res.episodes, "train")
        rec.update(upd)
        rec["train/optimizer_steps"] = upd["loss/updates"]
        diag = distributed.host_mean({k: float(v) for k, v in diag.items()})
        rec.update({f"estimator/{k}": v for k, v in diag.items()})
        rec["estimator/epsilon"] = self.epsilon
        if calibrated is not None:
            rec.update({f"estimator/calibration_singleton_rate/{e:g}": r for e, r in calibrated.items()})
        # Sampler vs trainer log-probs of the same tokens: ~0 untruncated; a large value means the
        # sampling and training forwards disagree (positions, padding, dtype).
        if c.ppo.old_logprobs == "fused":
            rec["rollout/logprob_gap"] = upd["loss/sampler_gap"]
        else:
            gap = float(np.abs(sample_lp - old_lp)[batch.response_mask].mean()) if batch.response_mask.any() else 0.0
            rec["rollout/logprob_gap"] = float(distributed.allgather(np.array([gap]))[:, 0].mean())
        rec["train/task_cursor"] = self.task_cursor  # global index of this iteration's first task group
        rec["train/hosts"] = self.num_hosts
        rec["advantage/mean"] = float(adv.mean()) if adv.size else 0.0
        rec["advantage/std"] = float(adv.std()) if adv.size else 0.0
        rec["advantage/abs_max"] = float(np.abs(adv).max()) if adv.size else 0.0
        rows, tokens = distributed.host_sum([batch.rows, batch.response_mask.sum()])
        rec["train/rows"], rec["train/response_tokens"] = float(rows), float(tokens)
        rec["train/prompt_tokens_mean"] = float(batch.prompt_lengths().mean()) if batch.rows else 0.0
        rec.update({f"rollout/{k}": float(v) for k, v in res.stats.items() if isinstance(v, (int, float, np.number))})
        stages = ("rollout", "old_logprobs", "ref_logprobs", "estimator", "update")
        prev = ("start", *stages)
        rec.update({f"time/{s}_s": t[s] - t[p] for s, p in zip(stages, prev)})
        rec.update({f"time/rollout_{k}": float(v) for k, v in res.timing.items()})
        rec["time/iteration_s"] = t["update"] - t["start"]
        # BiPACE's own cost: the grouping/advantage kernel (fingerprints are free from the prefill).
        rec["time/bipace_share"] = rec["time/estimator_s"] / max(rec["time/iteration_s"], 1e-9)

        if self.controller is not None:
            self.epsilon = float(self.controller.update(diag["singleton_group_rate"]))
        self.task_cursor += c.rollout.num_groups
        self.iteration += 1
        return rec

    def _episode_metrics(self, episodes: list[Episode], prefix: str) -> dict[str, float]:
        # a game that faulted (env_error) is not the policy's result: counted apart, not in the rates
        counts = [
            (1, e.won, e.length, e.invalid_count, 0, e.episode_return) if e.env_error is None else (0, 0, 0, 0, 1, 0)
            for e in episodes
        ]
        n, won, steps, invalid, errors, ret = distributed.host_sum(np.sum(counts, 0) if counts else np.zeros(6))
        return {
            f"{prefix}/success_rate": won / max(n, 1.0),
            f"{prefix}/episode_length": steps / max(n, 1.0),
            f"{prefix}/invalid_rate": invalid / max(steps, 1.0),
            f"{prefix}/env_errors": errors,
            f"{prefix}/return": ret / max(n, 1.0),
            f"{prefix}/episodes": n,
        }

    def _calibrate_epsilon(self, steps) -> dict[float, float]:
        """Sets ``self.epsilon`` by the one-shot sweep (``calibrate_epsilon``) on this iteration's batch.

        Each host sweeps its own rows; the run takes the largest of the hosts' choices (the smallest grid
        value at which every host's singleton rate meets the target). Returns this host's
        {epsilon: singleton_group_rate} for the values tried.

        Raises:
          ValueError: no grid value reaches ``estimator.calibration.target_singleton_rate`` (lists the rates).
        """
        cc, e = self.config.estimator.calibration, self.config.estimator
        sweep = dict(target_singleton_rate=cc.target_singleton_rate, grid=tuple(cc.grid), return_rates=True)
        failure = None
        try:
            eps, rates = calibrate_epsilon(steps, centroid=e.centroid, capacity=e.capacity or None, **sweep)
        except ValueError as err:
            failure, eps, rates = str(err), 2.0, {}  # 2.0: "no value" (every host joins the gather below)
        chosen = float(distributed.allgather(np.array([eps], np.float64))[:, 0].max())
        if chosen >= 1.0:
            raise ValueError(
                f"config.estimator.calibration: {failure or 'another host found no epsilon'} "
                f"(raise target_singleton_rate or extend the grid)"
            )
        self.epsilon = chosen
        if self.controller is not None:
            self.controller.epsilon = chosen
        self.needs_calibration = False
        if self.is_primary:
            log.info("calibrated epsilon = %g (singleton rates %s)", chosen, rates)
        return rates

    # ------------------------------------------------------------------------------------------
    def validate(self) -> dict[str, Any]:
        """Play the fixed validation panel(s) at ``val.temperature``; success overall and per category.

        Categories: every scalar ``task_info`` key of the game among ``depth``, ``task_type``
        (e.g. ``val/success_rate/depth_2``). Held-out goals go under ``val/holdout/``.
        """
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        G = self.config.val.group_size
        for name, panel in (("val", self.val_panel), ("val/holdout", self.holdout_panel)):
            if not panel:
                continue
            mine = list(range(jax.process_index(), len(panel), self.num_hosts))
            # zeros on the tasks of other hosts (each task has one owner: the gather sums); NaN on a
            # task whose games all faulted (left out of the means, counted in env_errors)
            won, length, errors, score = (np.zeros((len(panel),)) for _ in range(4))
            if mine:
                # 1 + len(name): 4 for "val", 12 for "val/holdout" (kept: it fixes the panels' draws)
                key = jax.random.fold_in(jax.random.PRNGKey(self.config.val.seed), 1 + len(name))
                res = self._play(
                    self.val_sampler, self.val_rollout_cfg, [panel[i] for i in mine], key, self.val_pools[name]
                )
                for j, i in enumerate(mine):  # G consecutive episodes per task group, groups in order
                    played = [e for e in res.episodes[j * G : (j + 1) * G] if e.env_error is None]
                    won[i] = np.mean([e.won for e in played]) if played else np.nan
                    length[i] = np.mean([e.length for e in played]) if played else np.nan
                    errors[i] = G - len(played)
                    scores = [e.score for e in played if e.score is not None]
                    score[i] = np.mean(scores) if scores else np.nan
            won, length, errors, score = (distributed.allgather(a).sum(0) for a in (won, length, errors, score))
            if not np.isnan(score).all():  # the game reports a task score (WebShop)
                out[f"{name}/score"] = float(np.nanmean(score))
            out[f"{name}/success_rate"] = float(np.nanmean(won)) if not np.isnan(won).all() else float("nan")
            out[f"{name}/episode_length"] = float(np.nanmean(length)) if not np.isnan(length).all() else float("nan")
            out[f"{name}/tasks"] = len(panel)
            out[f"{name}/env_errors"] = int(errors.sum())
            for key_name in ("depth", "task_type"):
                cats: dict[str, list] = {}
                for (tid, _), w in zip(panel, won):
                    v = self._task_infos[name](tid).get(key_name)
                    if v is not None and not np.isnan(w):
                        cats.setdefault(str(v), []).append(w)
                for v, ws in sorted(cats.items()):
                    out[f"{name}/success_rate/{key_name}_{v}"] = float(np.mean(ws))
                    out[f"{name}/tasks/{key_name}_{v}"] = len(ws)
        out["time/validation_s"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to ``num_iterations`` (validating and checkpointing on schedule); returns a summary.

        Summary: ``first_val`` / ``last_val`` (validation records), ``last_train`` (the last iteration's
        record), ``iterations_run`` in this process's lifetime, ``workdir``.
        """
        c = self.config
        summary: dict[str, Any] = {
            "workdir": self.workdir,
            "first_val": None,
            "last_val": None,
            "last_train": None,
            "iterations_run": 0,
            "start_iteration": self.iteration,
        }
        pending_val, last_checkpoint_s = None, None
        if c.val.at_start and self.iteration == 0 and c.num_iterations > 0:
            pending_val = summary["first_val"] = self.validate()
        elif self.iteration > 0:  # resumed: the before-RL validation is in the kept metrics
            first = next((r for r in read_metrics(self.workdir) if r.get("iteration") == 0), {})
            before = {"val/" + k.split("/", 1)[1]: v for k, v in first.items() if k.startswith("val_before/")}
            summary["first_val"] = before or None
        bar = tqdm(
            total=c.num_iterations,
            initial=self.iteration,
            desc="RL iterations",
            disable=not (c.log.progress and self.is_primary),
            dynamic_ncols=True,
        )
        try:
            while self.iteration < c.num_iterations:
                rec = self.train_iteration()
                if pending_val is not None:  # the before-training validation goes with iteration 0
                    rec.update({"val_before/" + k.split("/", 1)[1]: x for k, x in pending_val.items()})
                    pending_val = None
                last = self.iteration == c.num_iterations
                if c.val.every and (self.iteration % c.val.every == 0 or last):
                    rec.update(v := self.validate())
                    summary["last_val"] = v
                    summary["first_val"] = summary["first_val"] or v
                if last_checkpoint_s is not None:
                    rec["time/previous_checkpoint_s"] = last_checkpoint_s
                # The line goes first: a kill between line and checkpoint re-runs the iteration, and
                # the re-run replaces the line (MetricsLogger drops lines past the restored step).
                self.metrics.write(self.iteration - 1, rec)
                if self.iteration % c.checkpoint.every == 0 or last:
                    t0 = time.perf_counter()
                    self.save_checkpoint()
                    last_checkpoint_s = time.perf_counter() - t0
                summary["last_train"] = rec
                summary["iterations_run"] += 1
                bar.update(1)
                bar.set_postfix(success=f"{rec['train/success_rate']:.2f}", it_s=f"{rec['time/iteration_s']:.1f}")
        finally:
            bar.close()
        if self.is_primary and c.log.plots:
            temps = dict(train_temperature=c.sampler.temperature, val_temperature=c.val.temperature)
            grouping = config_lib.estimator_config(c, self.epsilon).spec.grouping
            summary["plots"] = make_plots(self.workdir, **temps, grouping=grouping)
        if c.checkpoint.export_hf:  # every process: the global master parameters are gathered for process 0
            summary["hf_export"] = self.export_hf(os.fspath(runfolder.path(self.workdir) / "hf_final"))
        return summary

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        meta = {
            "iteration": self.iteration,
            "task_cursor": self.task_cursor,
            "epsilon": self.epsilon,
            "controller": self.controller.state_dict() if self.controller is not None else None,
            "estimator": self.config.estimator.name,
            "seed": self.config.seed,
        }
        self.checkpointer.save(self.iteration, self.learner.params, self.learner.opt_state, self.rng, meta)

    def _restore(self) -> None:
        L = self.learner
        restored = self.checkpointer.restore_latest(L.params, L.opt_state)
        if restored is None:  # every step was torn (each named in a WARNING): start afresh
            return
        step, (L.params, L.opt_state, self.rng, meta) = restored
        L.sync_local()
        self.iteration, self.task_cursor = int(meta["iteration"]), int(meta["task_cursor"])
        if self.needs_calibration and self.iteration > 0:
            # calibrated on iteration 0 of this run: keep that value (a resumed run never re-calibrates)
            self.epsilon = float(meta["epsilon"])
            self.needs_calibration = False
        if self.controller is not None and meta.get("controller") is not None:
            # the controller's epsilon continues; a fixed epsilon comes from the config (overridable)
            self.controller.load_state_dict(meta["controller"])
            self.epsilon = float(self.controller.epsilon)
        if self.is_primary:
            log.info("resumed from %s step %d (iteration %d)", self.checkpointer.directory, step, self.iteration)

    def export_hf(self, path: str) -> str:
        """Write the current policy's master parameters as a Hugging Face folder (weights, config,
        tokenizer), local or gs://; every process calls it, process 0 writes."""
        with runfolder.staged(path) as local:
            save_hf_checkpoint(self.learner.master_model(), local, tokenizer=self.tokenizer)
        return path

    def close(self) -> None:
        self.metrics.close()
        self.checkpointer.close()
        for pool in {id(p): p for p in (self.pool, *self.val_pools.values())}.values():
            pool.close()
