"""The RL trainer: collect -> old/reference log-probs -> advantages -> PPO update -> record.

One iteration (``Trainer.train_iteration``), top to bottom:

1. **Collect** (``rollout.collect``): this host's task groups, G games each, played in lockstep by the
   KV-cache sampler; the BiPACE fingerprints come out of its prefill (no extra forward).
2. **Old / reference log-probabilities**: ``ppo.old_logprobs`` ``"recompute"`` (verl's default),
   ``"sampler"`` (exact without top-p/top-k) or ``"fused"`` (inside the gradient pass, exact for one
   optimizer step); the reference forward uses the frozen initial parameters (skipped at kl_coef 0).
3. **Advantages**: ``estimators.compute_advantages`` (``docs/estimators.md``).
4. **Update**: ``PPOLearner.update``; a NaN/Inf stops the run (``NonFiniteError``) before it applies.
5. **Record**: episode, estimator, loss and timing metrics; ``train/*``, ``rollout/*`` and
   ``estimator/*`` pooled over hosts (``distributed.pooled``: counts summed, rates from summed
   numerators and denominators), validation from every host's panel tasks.

Multi-host: each process plays its share of the task groups on a host-local copy of the parameters;
the gradient step is one global ``jax.jit`` over all devices, the batch sharded over ("data", "fsdp").

Asynchronous RL (``config.async_rl.sampler_devices > 0``, ``bipace_jax.async_rl``): step 1 takes the
iteration a sampler thread played on the sampler group's devices (at most ``max_staleness`` ahead);
steps 2-5 run on the learner group's, and the new parameters are pushed to the sampler group after 5.
By process (``sampler_processes``, ``bipace_jax.async_processes``) the trainer runs on the learner
process, the sampler thread on the sampler process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from bipace_jax import async_processes as processes
from bipace_jax import async_rl, build, distributed, loglines, runfolder, sharding, tasks, transcripts, validation
from bipace_jax import config as config_lib
from bipace_jax import metric_keys as keys
from bipace_jax import plan as run_plan
from bipace_jax.checkpointing import Checkpointer, CheckpointMeta
from bipace_jax.config import OldLogprobs
from bipace_jax.estimators import EstimatorConfig, calibrate_epsilon, compute_advantages, step_details
from bipace_jax.estimators.diagnostics import SIZE_STATS, host_stats
from bipace_jax.metrics import MetricsLogger, read_metrics
from bipace_jax.models import load_tokenizer, save_hf_checkpoint
from bipace_jax.plots import make_plots
from bipace_jax.ppo import NonFiniteError
from bipace_jax.rollout import Episode, collect
from bipace_jax.sampling import Engine
from bipace_jax.stats import HostStats, StageTimer
from bipace_jax.tiny import build_game_tokenizer

log = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "Trainer", "cluster_view"]


def cluster_view(ecfg: EstimatorConfig) -> EstimatorConfig:
    """The config whose diagnostics give a non-clustering run's ``cluster_*`` metrics: BiGPO's greedy
    fingerprint clusters at ``ecfg``'s epsilon on the same batch. ``similarity_thresh`` is reset to 0:
    it shapes ``obs_hash`` (the hash_* partition), which fingerprint clusters do not read, and
    ``EstimatorConfig`` refuses it for an estimator that does not group by observation."""
    return dataclasses.replace(ecfg, name="bigpo", similarity_thresh=0.0)


class Trainer:
    """Owns the actor, learner, env pool, samplers, checkpoints and metrics of one run.

    Args:
      spec: the run (``build.build_spec``), or a ``configs/base.py``-layout config, built into one here.
      workdir: run folder, local or ``gs://`` (metrics.jsonl, tb/, plots/, checkpoints/, tokenizer/, hf_final/).
      resume: restore the latest checkpoint in ``workdir`` when there is one (a run started again in
        the same folder continues; pass False to refuse, which raises if a checkpoint exists).
      actor, tokenizer: optional pre-built actor/tokenizer (hooks for warm starts and tests);
        default: ``build.build_actor`` / the checkpoint's or the project's game tokenizer.
      env_factory: optional picklable callable building one game as ``env_factory(max_steps=...)``
        (a wrapped or custom ``TextEnv``, e.g. ``environments.testing.ChaosEnv``) in place of
        ``environments.make(spec.env.name)``; prompts still follow ``spec.env.name``.

    Raises:
      ConfigError: a bad config field, or a mesh that does not fit the devices (before anything compiles).
      RunFolderError: ``workdir`` cannot be created or written (before the model loads).
      FileExistsError: ``resume=False`` and ``workdir`` already has checkpoints.
    """

    def __init__(
        self,
        spec: build.RunSpec | ml_collections.ConfigDict,
        workdir: str,
        *,
        resume: bool = True,
        actor: nnx.Module | None = None,
        tokenizer: Any = None,
        env_factory: Callable[..., Any] | None = None,
    ):
        if not isinstance(spec, build.RunSpec):
            spec = build.build_spec(spec)
        self.spec, self.workdir = spec, workdir
        self.is_primary = jax.process_index() == 0
        if processes.enter_role(spec) == processes.SAMPLER:
            raise ValueError("Trainer: a sampler process runs async_processes.SamplerProcess, not the trainer")
        self.num_hosts = distributed.process_count()  # the learner group's (every process without process roles)
        self.sampler_mesh = self.sampler = self.policy = None  # asynchronous RL's roles (async_rl)
        if spec.async_rl.sampler_devices:  # the learner's devices are the run's mesh; the sampler has its own
            self.sampler_mesh, self.mesh = async_rl.role_meshes(spec.mesh, spec.async_rl, jax.local_devices())
            n = self.mesh.devices.size
            layout = run_plan.HostLayout.of(spec, 1, n, n)
        else:
            layout = run_plan.HostLayout.current(spec)
        run_plan.check_workdir(spec, workdir, self.num_hosts)
        runfolder.prepare(workdir)  # fails in seconds, before the model loads
        distributed.check_shared_workdir(workdir)
        if self.sampler_mesh is None:
            self.mesh = sharding.make_mesh(*layout.mesh_shape, devices=distributed.group_devices())
        sharding.check_placement(self.mesh)  # each host: whole tensor groups, its own batch block
        self.local_mesh = distributed.local_mesh(self.mesh, layout.sampler_tensor)  # this host's chips
        self.game = env_factory if env_factory is not None else spec.env.name
        self.panels = validation.select(spec, self.game)  # missing game data fails before the model loads
        self.plan = run_plan.plan(spec, layout, self.panels.games)  # every derived size, once
        self.train_ids, self.holdout_ids = self.panels.train_ids, self.panels.holdout_ids
        self.val_panel, self.holdout_panel = (self.panels.games[k] for k in validation.PANELS)

        # Model and learner.
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        if actor is None:
            actor = build.build_actor(spec.model, self.tokenizer, self.mesh, seed=spec.seed)
        self.actor = actor
        support = len(self.tokenizer)  # embedding rows past the tokenizer (Qwen2.5 pads V) are never drawn
        self.learner = build.ppo_learner(spec, self.actor, self.mesh, self.local_mesh, support=support)

        # Run state, restored from the latest checkpoint when there is one.
        self.iteration, self.task_cursor = 0, 0
        self.rng = jax.random.PRNGKey(spec.seed)
        self.epsilon = float(spec.estimator.epsilon)
        self.needs_calibration = spec.needs_calibration  # done on iteration 0
        self.controller = spec.new_controller()
        self.checkpointer = Checkpointer(workdir, keep=spec.checkpoint.keep, async_save=spec.checkpoint.async_save)
        latest = self.checkpointer.latest_step()
        if latest is not None and not resume:
            raise FileExistsError(
                f"{workdir} already holds checkpoints (latest step {latest}); pass --resume or use a new --workdir"
            )
        if latest is not None:
            self._restore()
        self._start_rollout()
        self.metrics = MetricsLogger(
            workdir,
            start_iteration=self.iteration,
            enabled=self.is_primary,
            **self._tracking() if self.is_primary else {},
        )
        if self.is_primary:
            runfolder.write_text(runfolder.path(workdir) / "config.json", spec.config.to_json_best_effort(indent=2))

    def _tracking(self) -> dict[str, Any]:
        """MetricsLogger's config, derived sizes and wandb project (TensorBoard text/hparams, wandb config)."""
        s = self.spec
        config = json.loads(s.config.to_json_best_effort())
        project = s.log.wandb_project if s.log.wandb else None
        return dict(config=config, derived=self.plan.summary(), wandb_project=project)

    _bar = None  # the run's tqdm bar while ``run`` is on (its description names the phase)

    def _phase(self, name: str) -> None:
        """Show the phase the iteration is in (rollout, validation seen/held-out, log-probs, update) on the bar."""
        if self._bar is not None:
            self._bar.set_description(f"RL iterations [{name}]")

    def _start_rollout(self) -> None:
        """The env pools (``validation.start_pools``: one for training and the panels of the training
        game, one per other panel game) and one sampling engine (validation passes its temperature per
        call), with the checkpoint's and tokenizer's stop ids."""
        s = self.spec
        self.groups_per_host = self.plan.groups_per_host
        train_games = 0 if s.async_rl.by_process else self.plan.games_per_host  # by process: validation only
        self.pool, self.val_pools = validation.start_pools(s, self.game, self.panels, self.num_hosts, train_games)
        eos = build.stop_token_ids(self.actor.config.eos_token_ids, self.tokenizer, s.model.checkpoint) or None
        scfg = dataclasses.replace(s.sampler, eos_token_ids=eos)
        self.engine = self.val_engine = Engine(self.tokenizer, scfg, mesh=self.local_mesh)
        self.rollout_cfg, self.val_rollout_cfg = s.rollout, s.val_rollout
        self.pool_lock = threading.Lock()  # the sampler thread and validation share the training pool
        if s.async_rl.by_process:  # the sampler is another process (async_processes): it starts where we are
            self.policy = processes.WeightSender(s, self.mesh, self.learner.params)
            self.sampler_shardings = self.policy.shardings
            self.policy.publish_start(self.iteration, self.task_cursor, self.rng)
            self._push()
        if self.sampler_mesh is not None:  # the sampler group's engine and policy (validation stays on the learner's)
            self.engine = Engine(self.tokenizer, scfg, mesh=self.sampler_mesh)
            L = self.learner
            self.sampler_shardings = sharding.param_shardings(L.params, self.sampler_mesh)
            rest = jax.device_put(L.rest, jax.sharding.NamedSharding(self.sampler_mesh, jax.sharding.PartitionSpec()))
            self.policy = async_rl.PolicySource(L.graphdef, rest)
            self._push()

    def _push(self) -> float:
        """Send the learner's parameters to the sampler group as version ``self.iteration``; returns seconds."""
        t0 = time.perf_counter()
        L = self.learner  # the sampler's copy holds the compute dtype, as the learner's host-local copy
        self.policy.publish(async_rl.push(L.params, self.sampler_shardings, L.local_dtype), self.iteration)
        return time.perf_counter() - t0

    def _start_sampler(self) -> None:
        """The sampler thread, from this iteration to the last (asynchronous RL)."""
        s = self.spec
        if s.async_rl.by_process:
            self.sampler = processes.RowsReceiver()
            return
        first, cursor = self.iteration, self.task_cursor

        def play(j: int, key):
            groups = async_rl.iteration_tasks(
                self.train_ids, s.seed, cursor, first, j, s.num_groups, self.groups_per_host
            )
            policy = async_rl.policy_reader(self.policy, s.async_rl.switch)
            with self.pool_lock:
                return collect(None, self.engine, self.pool, groups, self.rollout_cfg, key, policy=policy)

        k = s.async_rl.max_staleness
        self.sampler = async_rl.SamplerThread(play, self.policy, first, s.num_iterations, self.rng, k)

    def _load_tokenizer(self):
        m = self.spec.model
        if m.tokenizer or m.checkpoint:
            return build.load_model_tokenizer(m)
        path = runfolder.path(self.workdir) / "tokenizer"
        if (path / "tokenizer.json").exists():
            with runfolder.local_copy(path) as local:
                return load_tokenizer(local)
        if self.num_hosts > 1:
            raise config_lib.ConfigError("config.model.tokenizer must be set for a multi-host random init, got ''")
        with runfolder.staged(path) as local:
            return build_game_tokenizer(self.spec.config, local)

    def _play(self, rcfg, games: list[tuple[int, int]], key: jax.Array, pool=None, label="rollout", engine=None):
        """``rollout.collect`` of one task group per (task_id, game_seed) pair (on the training pool by
        default, with ``self.engine`` by default); ``label`` names the phase in the progress bar."""
        progress = (self.spec.log.progress and self.is_primary) and f"{label} {self.spec.env.name}"
        pool = self.pool if pool is None else pool
        engine = self.engine if engine is None else engine
        return collect(self.actor, engine, pool, games, rcfg, key, progress=progress)

    # ------------------------------------------------------------------------------------------
    def train_iteration(self) -> dict[str, Any]:
        """Run iteration ``self.iteration`` and advance the run state (not the checkpoint)."""
        s, L, timer = self.spec, self.learner, StageTimer()
        if self.policy is not None and self.sampler is None:
            self._start_sampler()
        self.rng, key = jax.random.split(self.rng)
        k_roll, k_ppo = async_rl.iteration_keys(key)  # k_ppo the same on every host: one global shuffle

        self._phase("rollout")
        with timer.stage("rollout"):  # 1. Collect.
            res = self._collect(k_roll)
            batch = res.tokens
        self._phase("log-probs")
        with timer.stage("old_logprobs"):  # 2. Old log-probs.
            sample_lp = np.asarray(res.sample_logprobs, np.float32)
            recompute = s.learner.old_logprobs is OldLogprobs.RECOMPUTE
            old_lp = L.logprobs(L.params_local, batch) if recompute else sample_lp
        with timer.stage("ref_logprobs"):  # 3. Reference log-probs (skipped at kl_coef 0).
            ref_lp = L.logprobs(L.ref_params_local, batch) if L.ref_params_local is not None else None
        with timer.stage("estimator"):  # 4. Advantages.
            calibrated = self._calibrate_epsilon(res.steps) if self.needs_calibration else None
            adv, diag = self._advantages(res)
        self._transcribe_rollout(res, adv)
        self._phase("update")
        with timer.stage("update"):  # 5. Update.
            try:
                tis = sample_lp if s.loss.tis_cap > 0 else None  # truncated IS needs the sampler's log-probs
                batch = batch.with_(old_logprobs=old_lp, ref_logprobs=ref_lp, advantages=adv, sampler_logprobs=tis)
                upd = L.update(batch, k_ppo, where=f"iteration {self.iteration}, ")
            except NonFiniteError as e:
                raise NonFiniteError(
                    f"{e}; the last good checkpoint is step {self.checkpointer.latest_step()} "
                    f"in {self.checkpointer.directory}"
                ) from None

        # 6. Record.
        rec = self._episode_metrics(res.episodes, "train")
        rec.update(upd)
        rec[keys.OPTIMIZER_STEPS] = upd["loss/updates"]
        diag = distributed.pooled(host_stats(diag))  # the pooled partition of every host's step groups
        rec.update({f"estimator/{k}": v for k, v in diag.items()})
        rec[keys.EPSILON] = self.epsilon
        if calibrated is not None:
            rec.update({f"{keys.CALIBRATION_RATE}/{e:g}": r for e, r in calibrated.items()})
        tokens = float(batch.response_mask.sum())
        # Sampler vs trainer log-probs of the same tokens: ~0 untruncated; a large value means the
        # sampling and training forwards disagree (positions, padding, dtype).
        gap = {}
        if s.learner.old_logprobs is OldLogprobs.FUSED:
            rec[keys.LOGPROB_GAP] = upd["loss/sampler_gap"]
        else:
            gap[keys.LOGPROB_GAP] = (float(np.abs(sample_lp - old_lp)[batch.response_mask].sum()), tokens)
        rec[keys.TASK_CURSOR] = self.task_cursor  # global index of this iteration's first task group
        rec["train/hosts"] = self.num_hosts
        a = np.asarray(adv, np.float64)
        stats = HostStats(
            counts={"train/rows": float(batch.rows), "train/response_tokens": tokens},
            rates={
                "train/prompt_tokens_mean": (float(batch.prompt_lengths().sum()), float(batch.rows)),
                "advantage/mean": (float(a.sum()), float(a.size)),
                "advantage/mean_square": (float(np.square(a).sum()), float(a.size)),
                **gap,
            },
            maxima={"advantage/abs_max": float(np.abs(a).max()) if a.size else 0.0},
        )
        rec.update(distributed.pooled(stats | res.stats.prefixed("rollout/")))
        rec["advantage/std"] = math.sqrt(max(rec.pop("advantage/mean_square") - rec["advantage/mean"] ** 2, 0.0))
        rec.update({keys.stage_seconds(k): v for k, v in timer.seconds.items()})
        rec.update({f"time/rollout_{k}": float(v) for k, v in res.timing.items()})
        rec[keys.ITERATION_SECONDS] = timer.total()
        # BiPACE's own cost: the grouping/advantage kernel (fingerprints are free from the prefill).
        rec[keys.BIPACE_SHARE] = rec[keys.stage_seconds("estimator")] / max(rec[keys.ITERATION_SECONDS], 1e-9)

        if self.controller is not None:
            self.epsilon = float(self.controller.update(diag["singleton_group_rate"]))
        self.task_cursor += s.num_groups
        self.iteration += 1
        if self.policy is not None:
            rec.update(self._after_update(batch))
        return rec

    def _collect(self, k_roll):
        """This iteration's rollout: played here with ``k_roll``, or (asynchronous RL) taken from the
        sampler thread, which played it with the same key."""
        if self.sampler is not None:
            return self.sampler.take(self.iteration)
        s = self.spec
        first = self.task_cursor + jax.process_index() * self.groups_per_host
        groups = [tasks.train_task(self.train_ids, s.seed, first + i) for i in range(self.groups_per_host)]
        return self._play(self.rollout_cfg, groups, k_roll)

    def _after_update(self, batch) -> dict[str, float]:
        """Asynchronous RL after update ``self.iteration - 1``: the rows' version lag behind the version
        they trained, then the push of the new parameters to the sampler group (its seconds)."""
        lag = (self.iteration - 1) - batch.policy_version
        return {
            keys.ASYNC_LAG_MEAN: float(lag.mean()),
            keys.ASYNC_LAG_MAX: float(lag.max()),
            keys.ASYNC_PUSH_SECONDS: self._push(),
            **self.sampler.transfer_stats,
        }

    def _advantages(self, res) -> tuple[np.ndarray, dict[str, Any]]:
        """Per-row advantages of the iteration at ``self.epsilon`` and the estimator's diagnostics.

        Every run records both partitions (hash_* always; cluster_* at this epsilon), so the singleton
        tax of exact hashing is visible beside the clusters whichever partition trains.

        Raises:
          NonFiniteError: a NaN/Inf advantage (no update is applied).
        """
        ecfg = self.spec.estimator_at(self.epsilon)
        adv, diag = compute_advantages(res.steps, ecfg)
        adv = res.row_values(jax.block_until_ready(adv))
        other = diag if ecfg.clusters else compute_advantages(res.steps, cluster_view(ecfg))[1]
        diag = dict(diag, **{f"cluster_{k}": other[k] for k in SIZE_STATS})
        if not np.all(np.isfinite(adv)):
            raise NonFiniteError(
                f"non-finite advantages at iteration {self.iteration} from estimator {ecfg.name}; no update applied"
            )
        return adv, diag

    def _episode_metrics(self, episodes: list[Episode], prefix: str) -> dict[str, float]:
        # a game that faulted (env_error) is not the policy's result: counted apart, not in the rates
        played = [e for e in episodes if e.env_error is None]
        n, steps = float(len(played)), float(sum(e.length for e in played))
        stats = HostStats(
            counts={"env_errors": float(len(episodes) - len(played)), "episodes": n},
            rates={
                "success_rate": (float(sum(e.won for e in played)), n),
                "episode_length": (steps, n),
                "invalid_rate": (float(sum(e.invalid_count for e in played)), steps),
                "return": (float(sum(e.episode_return for e in played)), n),
            },
        )
        return distributed.pooled(stats.prefixed(prefix + "/"))

    def _calibrate_epsilon(self, steps) -> dict[float, float]:
        """Sets ``self.epsilon`` by the one-shot sweep (``calibrate_epsilon``) on this iteration's batch.

        Each host sweeps its own rows; the run takes the largest of the hosts' choices (the smallest grid
        value at which every host's singleton rate meets the target). Returns this host's
        {epsilon: singleton_group_rate} for the values tried.

        Raises:
          ValueError: no grid value reaches ``estimator.calibration.target_singleton_rate`` (lists the rates).
        """
        cc, e = self.spec.calibration, self.spec.estimator
        sweep = dict(target_singleton_rate=cc.target_singleton_rate, grid=cc.grid, return_rates=True)
        failure = None
        try:
            eps, rates = calibrate_epsilon(steps, centroid=e.centroid, capacity=e.capacity, **sweep)
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
        """Play the fixed validation panel(s) at ``val.temperature`` (``validation.validate``); success
        overall and per category, and their transcripts when ``log.transcripts_every`` is on.

        Categories: the game's ``GameSpec.categories`` (``task_info`` keys, e.g. TextCraft's ``depth``:
        ``val/success_rate/depth_2``). Held-out goals go under ``val/holdout/``. A game whose
        ``task_info`` has ``best_score`` (WebShop) adds ``val/unwinnable_goals``: the panel tasks (of
        ``val/tasks``) that no purchase can win, so the success rate reads against its ceiling.
        """
        progress = self.spec.log.progress and self.is_primary
        args = (self.actor, self.val_engine, self.val_pools, self.spec, self.panels)
        with self.pool_lock:
            rec, results = validation.validate(*args, progress=progress, on_panel=self._phase)
        if self.spec.log.transcripts_every:
            for name, res in results.items():
                self._transcribe(res, name)
        return rec

    def _transcribe_rollout(self, res, adv: np.ndarray) -> None:
        """The training rollout's transcript, on iterations divisible by ``log.transcripts_every``."""
        every = self.spec.log.transcripts_every
        if every and self.iteration % every == 0:
            self._transcribe(res, transcripts.ROLLOUT, adv)

    def _transcribe(self, res, phase: str, advantages: np.ndarray | None = None) -> None:
        """Write ``phase``'s lines of ``episodes/<self.iteration>.jsonl`` (``transcripts``): every process
        offers its rows (None: it played none), process 0 writes them all. With ``advantages``
        (training) the lines carry the estimator's step groups and row kinds at ``self.epsilon``."""
        s = self.spec
        rows = []
        if res is not None:
            labels = kinds = None
            if advantages is not None:
                details = step_details(res.steps, s.estimator_at(self.epsilon))
                labels, kinds = (res.row_values(x).astype(np.int32) for x in details)
            what = dict(iteration=self.iteration, phase=phase, gamma=s.estimator.gamma)
            limits = dict(max_games=s.log.transcripts_max_games, advantages=advantages, labels=labels, kinds=kinds)
            rows = transcripts.step_rows(res, self.tokenizer, **what, **limits)
        rows = transcripts.gather(rows, s.log.transcripts_max_games)
        if self.is_primary:
            transcripts.write(self.workdir, self.iteration, phase, rows)

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to ``num_iterations`` (validating and checkpointing on schedule); returns a summary.

        Summary: ``first_val`` / ``last_val`` (validation records), ``last_train`` (the last iteration's
        record), ``iterations_run`` in this process's lifetime, ``workdir``.
        """
        s = self.spec
        summary: dict[str, Any] = {
            "workdir": self.workdir,
            "first_val": None,
            "last_val": None,
            "last_train": None,
            "iterations_run": 0,
            "start_iteration": self.iteration,
        }
        pending_val, last_checkpoint_s = None, None
        if s.val.at_start and self.iteration == 0 and s.num_iterations > 0:
            pending_val = summary["first_val"] = self.validate()
            if self.is_primary:
                loglines.log_validation(0, pending_val, before=True)
        elif self.iteration > 0:  # resumed: the before-RL validation is in the kept metrics
            first = next((r for r in read_metrics(self.workdir) if r.get(keys.ITERATION) == 0), {})
            summary["first_val"] = {keys.after(k): v for k, v in first.items() if k.startswith(keys.VAL_BEFORE + "/")}
            summary["first_val"] = summary["first_val"] or None
        progress = s.log.progress and self.is_primary
        bar = loglines.progress_bar(
            progress, total=s.num_iterations, initial=self.iteration, desc="RL iterations", dynamic_ncols=True
        )
        self._bar = bar if progress else None
        try:
            while self.iteration < s.num_iterations:
                rec = self.train_iteration()
                if pending_val is not None:  # the before-training validation goes with iteration 0
                    rec.update({keys.before(k): x for k, x in pending_val.items()})
                    pending_val = None
                last = self.iteration == s.num_iterations
                if s.val.every and (self.iteration % s.val.every == 0 or last):
                    rec.update(v := self.validate())
                    if self.is_primary:
                        loglines.log_validation(self.iteration, v)
                    summary["last_val"] = v
                    summary["first_val"] = summary["first_val"] or v
                if last_checkpoint_s is not None:
                    rec[keys.PREVIOUS_CHECKPOINT_SECONDS] = last_checkpoint_s
                # The line goes first: a kill between line and checkpoint re-runs the iteration, and
                # the re-run replaces the line (MetricsLogger drops lines past the restored step).
                self.metrics.write(self.iteration - 1, rec)
                if self.is_primary:
                    loglines.log_iteration(self.iteration, s.num_iterations, rec)
                if self.iteration % s.checkpoint.every == 0 or last:
                    t0 = time.perf_counter()
                    self.save_checkpoint()
                    last_checkpoint_s = time.perf_counter() - t0
                summary["last_train"] = rec
                summary["iterations_run"] += 1
                bar.update(1)
                bar.set_postfix(success=f"{rec[keys.TRAIN_SUCCESS]:.2f}", it_s=f"{rec[keys.ITERATION_SECONDS]:.1f}")
        finally:
            bar.close()
            self._bar = None
        if self.is_primary and s.log.plots:
            temps = dict(train_temperature=s.sampler.temperature, val_temperature=s.val.temperature)
            grouping = s.estimator_at(self.epsilon).spec.grouping
            summary["plots"] = make_plots(self.workdir, **temps, grouping=grouping)
        if s.checkpoint.export_hf:  # every process: the global master parameters are gathered for process 0
            summary["hf_export"] = self.export_hf(os.fspath(runfolder.path(self.workdir) / "hf_final"))
        if s.async_rl.by_process:  # done: the sampler process may leave (a failure instead ends it, named)
            self.policy.close()
        return summary

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        meta = CheckpointMeta(
            iteration=self.iteration,
            task_cursor=self.task_cursor,
            epsilon=self.epsilon,
            controller=self.controller.state_dict() if self.controller is not None else None,
            estimator=self.spec.estimator.name,
            seed=self.spec.seed,
            config=json.loads(self.spec.config.to_json_best_effort()),  # a resume checks it (resume.py)
        )
        self.checkpointer.save(self.iteration, self.learner.params, self.learner.opt_state, self.rng, meta)

    def _restore(self) -> None:
        L = self.learner
        restored = self.checkpointer.restore_latest(L.params, L.opt_state)
        if restored is None:  # every step was torn (each named in a WARNING): start afresh
            return
        step, (L.params, L.opt_state, self.rng, raw) = restored
        meta = CheckpointMeta.from_dict(raw)
        L.sync_local()
        self.iteration, self.task_cursor = int(meta.iteration), int(meta.task_cursor)
        if self.needs_calibration and self.iteration > 0 and meta.epsilon is not None:
            # calibrated on iteration 0 of this run: keep that value (a resumed run never re-calibrates)
            self.epsilon = float(meta.epsilon)
            self.needs_calibration = False
        if self.controller is not None and meta.controller is not None:
            # the controller's epsilon continues; a fixed epsilon comes from the config (overridable)
            self.controller.load_state_dict(meta.controller)
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
        if self.sampler is not None:
            self.sampler.close()
        if self.policy is not None and not self.spec.async_rl.by_process:  # by process: `run` closes it at its end
            self.policy.close()
        self.metrics.close()
        self.checkpointer.close()
        for pool in {id(p): p for p in (self.pool, *self.val_pools.values())}.values():
            pool.close()
