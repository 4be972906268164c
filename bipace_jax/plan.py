"""The run plan: every size a run derives from its ``RunSpec`` and its devices, derived once.

``HostLayout`` is where the run lives (processes, devices, the training mesh, the hosts' sampler
meshes); ``plan(spec, layout, panels)`` turns it and the spec into a frozen ``RunPlan`` holding the
sampler batch, prompt bucket, row and group capacities, slots, validation rows, micro-batch rows and
optimizer steps. The trainer, ``launch.train --print_config`` / ``--dry_run`` and its tracking,
``launch.aot`` (`bipace_jax.aot`) and the step-time model (``RunPlan.run_shape``) read these numbers
instead of restating their rules.

``spec`` everywhere here is a ``build.RunSpec`` (read by its fields: this module sits below ``build``
so that every layer may read the plan). Padding follows `bipace_jax.buckets.Buckets`, the one rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from bipace_jax import distributed, step_time
from bipace_jax.buckets import Buckets
from bipace_jax.config import ConfigError, MeshConfig, OldLogprobs, check_tensor_in_host, fail
from bipace_jax.models import Qwen2Config
from bipace_jax.models.config import DType

__all__ = [
    "PANELS",
    "REMAT_AUTO_BUDGET",
    "ROW_ALIGN",
    "HostLayout",
    "RunPlan",
    "check_workdir",
    "device_hbm_bytes",
    "plan",
    "remat_estimate",
    "resolve_remat",
    "row_capacity",
]

#: The validation panels, in the order they are played (``validation.PANELS``: seen goals, held-out goals).
PANELS = ("val", "val/holdout")
#: A task group's step rows are padded to a multiple of this (the estimator's row capacity).
ROW_ALIGN = 16
#: ``model.remat="auto"`` takes the least recompute whose estimated gradient program fits in this share
#: of a chip's HBM: ``launch.aot``'s 0.9 budget less 0.1 for what `step_time.update_memory` leaves out
#: (XLA's buffers: on v5e it is 11-22% under the compiled save_dots and full programs, more under none).
REMAT_AUTO_BUDGET = 0.8


def row_capacity(group_size: int, max_steps: int) -> int:
    """Step rows of one task group's ``StepBatch`` segment: ``group_size * max_steps`` (every game plays
    every turn) rounded up to a multiple of `ROW_ALIGN`, so the estimator compiles one shape per game."""
    return -(-group_size * max_steps // ROW_ALIGN) * ROW_ALIGN


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """The processes and meshes of a run on ``devices`` devices over ``processes`` hosts.

    Attributes:
      processes: hosts (JAX processes), each with ``local_devices`` devices.
      devices: devices of the whole slice (``processes * local_devices``).
      local_devices: devices (chips) of one host.
      data, fsdp, tensor: the training mesh's axis sizes (``config.mesh``, the -1 axis resolved).
      sampler_tensor: the tensor axis of each host's sampler / log-prob mesh (``mesh.sampler_tensor``,
        0 resolved to ``tensor``); its other devices split rows (`sampler_row_shards`).
    """

    processes: int
    devices: int
    local_devices: int
    data: int
    fsdp: int
    tensor: int
    sampler_tensor: int

    @classmethod
    def of(cls, spec: Any, processes: int, devices: int, local_devices: int) -> HostLayout:
        """The layout of ``spec`` (a ``RunSpec``) on ``devices`` over ``processes`` hosts of
        ``local_devices`` each, after the checks that need the process count: every host the same
        number of devices, task groups and micro-batch rows split evenly over hosts and their batch
        shards, the tensor axes inside a host. `sharding.make_mesh` then lays out the same sizes by host.

        Raises:
          ValueError: ``devices != processes * local_devices``.
          ConfigError: the mesh does not fit ``devices`` (``config.mesh``), or a field does not split
            over the hosts (``rollout.num_groups``, ``mesh.tensor``, ``ppo.micro_batch_rows``,
            ``mesh.sampler_tensor``), naming it.
        """
        if devices != processes * local_devices:
            raise ValueError(f"HostLayout: {devices} devices are not {processes} hosts x {local_devices} devices")
        mesh: MeshConfig = spec.mesh
        mesh.check_devices(devices)
        if spec.num_groups % processes:
            fail("rollout.num_groups", f"be a multiple of the process count {processes}", spec.num_groups)
        data, fsdp, tensor = mesh.shape(devices)
        check_tensor_in_host(tensor, processes, local_devices)
        # each host holds data*fsdp/processes consecutive batch shards (make_mesh); its rows split over them
        rows = spec.learner.micro_batch_rows
        if (rows * processes) % (data * fsdp):
            fail(
                "ppo.micro_batch_rows",
                f"be a multiple of the {data * fsdp // processes} batch shards of each host "
                f"(mesh data*fsdp={data * fsdp} over {processes} processes)",
                rows,
            )
        t = mesh.sampler_tensor or tensor
        if local_devices % t:
            fail(
                "mesh.sampler_tensor",
                f"divide the {local_devices} devices of each of the {processes} hosts (a host samples on its "
                f"own chips): one of {_divisors(local_devices)}, or 0 for mesh.tensor",
                t,
            )
        return cls(processes, devices, local_devices, data, fsdp, tensor, t)

    @classmethod
    def current(cls, spec: Any) -> HostLayout:
        """``of`` this process's JAX devices: its group's (``distributed.process_count()``, their devices;
        every process's without process roles) and its ``local_device_count()``."""
        return cls.of(spec, distributed.process_count(), len(distributed.group_devices()), jax.local_device_count())

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """The training mesh's (data, fsdp, tensor)."""
        return self.data, self.fsdp, self.tensor

    @property
    def sampler_row_shards(self) -> int:
        """How many ways a host's sampler mesh splits rows (its data x fsdp): a host's sampler and
        log-prob batches are multiples of it."""
        return self.local_devices // self.sampler_tensor


def check_workdir(spec: Any, workdir: str, processes: int) -> None:
    """A run of several processes needs a ``--workdir`` every host sees (orbax writes one checkpoint
    from all hosts; process 0 writes the metrics): ``gs://...``, or a path the spec declares shared
    (``checkpoint.shared_workdir``, e.g. an NFS mount; `distributed.check_shared_workdir` proves it).

    Raises:
      ConfigError: ``processes > 1``, ``workdir`` is not ``gs://`` and ``checkpoint.shared_workdir`` is False.
    """
    if processes <= 1 or str(workdir).startswith("gs://") or spec.checkpoint.shared_workdir:
        return
    raise ConfigError(
        f"--workdir={workdir!r}: a run of {processes} processes needs a folder every host sees "
        "(each host writes its shards of the checkpoints): use gs://..., or set "
        "config.checkpoint.shared_workdir=True when it is a shared file system"
    )


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Every derived size of a run (``plan``). Row counts are per host unless they say global.

    Attributes:
      layout: the `HostLayout`.
      groups_per_host: task groups a host plays per iteration (``rollout.num_groups / processes``);
        also the estimator's group capacity.
      games_per_host: games a host plays per iteration (groups x ``rollout.group_size``).
      sampler_batch: a host's lockstep sampler batch: ``games_per_host`` fitted to
        ``sampler.batch_buckets`` and rounded up to the sampler's row shards.
      sampler_calls: sampler calls per turn (games beyond the largest batch bucket are served in
        further calls of it).
      prompt_bucket: the first ``sampler.length_buckets`` entry holding ``rollout.max_prompt_length``
        (the prefill's widest prompt; the slots' T_max).
      response_tokens: ``sampler.max_new_tokens``.
      row_capacity: step rows of one task group, ``group_size * env.max_steps`` padded to a multiple of
        16 (the estimator's ``StepBatch.row_capacity``).
      group_capacity: task groups of a host's estimator call (``groups_per_host``).
      estimator_rows: step rows a host's rollout can hold (``games_per_host * env.max_steps``).
      slots: the continuous scheduler's decode slots (``rollout.num_slots``, 0: one per game capped
        at the largest batch bucket).
      slot_rows: ``slots`` rounded up to the sampler's row shards (the slot state's rows).
      chunk_steps: ``rollout.chunk_steps``.
      val_games: panel name (``PANELS``) -> games it plays over all hosts (goals x seeds x
        ``val.group_size``): exact from the selected panels, else the config's bound (goals before
        clipping to the goals that exist, `val_games_exact` False). Every panel 0 when the run never
        validates.
      val_games_exact: whether ``val_games`` counts the selected panels.
      val_rows_per_host: the most games one host plays of a panel (its validation sampler rows;
        each host plays every ``processes``-th (goal, seed) pair, ``val.group_size`` times).
      val_sampler_batch: those rows fitted to the batch buckets (0: no validation).
      val_sampler_calls: validation sampler calls per turn (as ``sampler_calls``).
      val_panels: panels that play games.
      micro_batch_rows_global: rows of one gradient micro-batch over the whole mesh
        (``ppo.micro_batch_rows`` per process x processes).
      logprob_rows_per_host: rows of one log-prob micro-batch on a host (``ppo.micro_batch_rows``
        rounded up to the sampler's row shards).
      rows_per_iteration: step rows of one iteration over all hosts at most (every game plays
        ``env.max_steps`` turns).
      mini_batch_rows: rows of one optimizer step over the whole run, ``ppo.mini_batch_rows`` with 0
        ("all rows") decoded here to ``rows_per_iteration``.
      optimizer_steps_per_epoch: ceil(rows_per_iteration / mini_batch_rows) at most (1 for 0).
      micro_batches_per_optimizer_step: gradient micro-batches of one optimizer step at most.
      turns: turns per game at most (``env.max_steps``).
      logprob_passes: log-prob forwards per row before the update (old: ``ppo.old_logprobs ==
        "recompute"``; reference: ``ppo.kl_coef > 0``).
      batch_buckets: ``sampler.batch_buckets`` (`batch_bucket` fits rows to them).
      iterations, val_every, checkpoint_every: ``num_iterations``, ``val.every``, ``checkpoint.every``
        (the step-time model's run length and amortisations).
      remat: the ``model.remat`` policy the update runs: the config's, or ``"auto"`` resolved by
        `resolve_remat` (none / save_dots / full).
      remat_estimate: with ``"auto"``: ``hbm_bytes`` of a chip (0 on CPU), the ``cutoff_bytes`` a
        policy must fit (`REMAT_AUTO_BUDGET` of it) and each policy's estimated gradient program
        bytes per chip (``bytes``, `remat_estimate`); {} otherwise.
    """

    layout: HostLayout
    groups_per_host: int
    games_per_host: int
    sampler_batch: int
    sampler_calls: int
    prompt_bucket: int
    response_tokens: int
    row_capacity: int
    group_capacity: int
    estimator_rows: int
    slots: int
    slot_rows: int
    chunk_steps: int
    val_games: dict[str, int]
    val_games_exact: bool
    val_rows_per_host: int
    val_sampler_batch: int
    val_sampler_calls: int
    val_panels: int
    micro_batch_rows_global: int
    logprob_rows_per_host: int
    rows_per_iteration: int
    mini_batch_rows: int
    optimizer_steps_per_epoch: int
    micro_batches_per_optimizer_step: int
    turns: int
    logprob_passes: int
    batch_buckets: tuple[int, ...]
    iterations: int
    val_every: int
    checkpoint_every: int
    remat: str = "none"
    remat_estimate: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def hosts(self) -> int:
        return self.layout.processes

    @property
    def validation_games(self) -> int:
        """Games of one validation over every panel."""
        return sum(self.val_games.values())

    def batch_bucket(self, rows: int) -> int:
        """A host's sampler batch for ``rows`` prompts (`Buckets.fit` at the sampler's row shards)."""
        return Buckets(self.batch_buckets, "sampler.batch_buckets").fit(rows, self.layout.sampler_row_shards)

    def summary(self) -> dict[str, Any]:
        """A JSON-ready dict of the plan (``--print_config``, ``--dry_run``, tracking): the layout's
        mesh and every size, plus ``validation_games`` and ``games_per_iteration``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        lay = self.layout
        out["layout"] = dict(
            processes=lay.processes,
            devices=lay.devices,
            local_devices=lay.local_devices,
            mesh=dict(data=lay.data, fsdp=lay.fsdp, tensor=lay.tensor),
            sampler_tensor=lay.sampler_tensor,
        )
        out["games_per_iteration"] = self.games_per_host * self.hosts
        out["validation_games"] = self.validation_games
        return out

    def sync_replica(self, model: Any) -> bool:
        """Whether the sampler copy comes by `distributed.local_copy`'s replica route: a copy of its own
        (several hosts, or compute dtype != parameter dtype) on a host mesh whose tensor size differs
        from training's. ``model``: a ``build.ModelConfig``."""
        separate = self.hosts > 1 or model.dtype != model.param_dtype
        return separate and self.layout.sampler_tensor != self.layout.tensor

    def run_shape(self, model: Any, **overrides: Any) -> step_time.RunShape:
        """The step-time model's ``RunShape`` of this plan (``model``: the spec's ``build.ModelConfig``,
        for ``remat`` and the sampler copy's route); ``overrides`` replace fields (the scheduler
        model's response lengths, env latency, measured heads)."""
        lay = self.layout
        shape = dict(
            chips=lay.devices,
            hosts=lay.processes,
            fsdp=lay.fsdp,
            tensor=lay.tensor,
            sampler_tensor=lay.sampler_tensor,
            prompt_tokens=self.prompt_bucket,
            response_tokens=self.response_tokens,
            games_per_host=self.sampler_batch,
            sampler_calls=self.sampler_calls,
            micro_batch_rows=self.micro_batch_rows_global,
            logprob_rows_per_host=self.logprob_rows_per_host,
            mini_batch_rows=self.mini_batch_rows,
            remat=self.remat,
            val_games_per_host=self.val_sampler_batch,
            val_sampler_calls=self.val_sampler_calls,
            sync_replica=self.sync_replica(model),
            val_panels=self.val_panels,
            batch_buckets=self.batch_buckets,
            chunk_steps=self.chunk_steps,
            response_cap=self.response_tokens,
            turns=self.turns,
            logprob_passes=self.logprob_passes,
            iterations=self.iterations,
            val_every=self.val_every,
            checkpoint_every=self.checkpoint_every,
        )
        return step_time.RunShape(**{**shape, **overrides})


def _panel_counts(spec: Any, panels: Mapping[str, Sequence] | None) -> tuple[dict[str, int], bool]:
    """Panel name -> its (goal, seed) pairs: counted from ``panels`` (``validation.Panels.games``), else
    the config's bound (goals x ``val.seeds_per_goal``)."""
    v = spec.val
    if panels is not None:
        return {k: len(panels[k]) for k in PANELS}, True
    return dict(zip(PANELS, (v.num_tasks * v.seeds_per_goal, v.num_holdout_tasks * v.seeds_per_goal))), False


def device_hbm_bytes(device: Any) -> int:
    """HBM of ``device`` in bytes: its allocator's limit (``memory_stats()["bytes_limit"]``), else the
    chip's data sheet (`step_time.chip_for`); 0 for a CPU device (host memory: ample for ``"auto"``).

    Raises:
      ValueError: an accelerator that reports no limit (or whose allocator this process cannot ask)
        and whose kind the data sheets do not name.
    """
    if device.platform == "cpu":
        return 0
    try:
        stats = device.memory_stats() or {}
    except Exception:  # another process's device, or a topology description's: the data sheet says it
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return step_time.chip_for(device.device_kind).hbm_bytes


def remat_estimate(spec: Any, run_plan: RunPlan) -> dict[str, float]:
    """Each ``model.remat`` policy's estimated gradient program bytes per chip at ``run_plan``'s shapes
    (`step_time.update_memory`: state, the layers' saved activations, the layer being differentiated),
    the model's sizes from its preset (the tiny preset's from ``model``'s fields), its activations in
    ``model.dtype``."""
    m = spec.model
    if m.preset == "tiny":
        arch = Qwen2Config.tiny(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        )  # fmt: skip
    else:
        arch = Qwen2Config.preset(m.preset)
    shape, model = run_plan.run_shape(m), step_time.ModelShape.of(arch)
    compute_bytes = DType(m.dtype).jnp.itemsize  # activations, the gathered weights and the head
    kw = dict(reference=spec.loss.kl_coef > 0, logprob_chunk=spec.learner.logprob_chunk, compute_bytes=compute_bytes)
    return {p: step_time.update_memory(model, shape, p, **kw)["total"] for p in step_time.REMAT_POLICIES}


def resolve_remat(estimate: Mapping[str, float], hbm_bytes: int) -> str:
    """``model.remat="auto"``: the least recompute (none, then save_dots, then full) whose ``estimate``
    (`remat_estimate`) is at most `REMAT_AUTO_BUDGET` of ``hbm_bytes``; ``none`` when ``hbm_bytes`` is 0
    (CPU: host memory, the fastest policy); ``full`` when none fits (the least memory: ``launch.aot``
    then says whether it fits)."""
    if not hbm_bytes:
        return "none"
    cutoff = REMAT_AUTO_BUDGET * hbm_bytes
    return next((p for p in step_time.REMAT_POLICIES if estimate[p] <= cutoff), "full")


def plan(
    spec: Any, layout: HostLayout, panels: Mapping[str, Sequence] | None = None, hbm_bytes: int | None = None
) -> RunPlan:
    """The `RunPlan` of ``spec`` (a ``build.RunSpec``) on ``layout``.

    Args:
      panels: the selected validation panels (``validation.select(spec, game).games``: panel name ->
        its (task_id, game_seed) pairs); None counts the config's bound instead (``launch.aot``, which
        has no game data).
      hbm_bytes: a chip's HBM for ``model.remat="auto"`` (`resolve_remat`); None: this process's first
        device's (`device_hbm_bytes`; ``launch.aot`` passes its topology's).

    Raises:
      ConfigError: ``rollout.max_prompt_length`` exceeds the largest ``sampler.length_buckets`` entry.
    """
    s, r, lay = spec.sampler, spec.rollout, layout
    batch = Buckets(s.batch_buckets, "sampler.batch_buckets")
    shards = lay.sampler_row_shards
    try:
        prompt = Buckets(s.length_buckets, "sampler.length_buckets").fit_or_raise(r.max_prompt_length)
    except ValueError as e:
        raise ConfigError(f"config.rollout.max_prompt_length: {e}") from None
    groups = spec.num_groups // lay.processes
    games = groups * r.group_size
    slots = r.num_slots or min(games, batch.largest)

    v = spec.val
    pairs, exact = _panel_counts(spec, panels)
    if not v.validating:
        pairs = dict.fromkeys(PANELS, 0)
    val_rows = max(-(-n // lay.processes) for n in pairs.values()) * v.group_size
    learner = spec.learner
    rows = spec.num_groups * r.group_size * r.max_steps
    mini = learner.mini_batch_rows or rows  # 0: all rows, one optimizer step
    micro = learner.micro_batch_rows * lay.processes
    logprob_passes = int(learner.old_logprobs is OldLogprobs.RECOMPUTE) + int(spec.loss.kl_coef > 0)
    out = RunPlan(
        layout=lay,
        groups_per_host=groups,
        games_per_host=games,
        sampler_batch=batch.fit(games, shards),
        sampler_calls=-(-games // batch.largest),
        prompt_bucket=prompt,
        response_tokens=s.max_new_tokens,
        row_capacity=row_capacity(r.group_size, r.max_steps),
        group_capacity=groups,
        estimator_rows=games * r.max_steps,
        slots=slots,
        slot_rows=-(-slots // shards) * shards,
        chunk_steps=r.chunk_steps,
        val_games={k: n * v.group_size for k, n in pairs.items()},
        val_games_exact=exact,
        val_rows_per_host=val_rows,
        val_sampler_batch=batch.fit(val_rows, shards) if val_rows else 0,
        val_sampler_calls=max(1, -(-val_rows // batch.largest)),
        val_panels=sum(n > 0 for n in pairs.values()),
        micro_batch_rows_global=micro,
        logprob_rows_per_host=-(-learner.micro_batch_rows // shards) * shards,
        rows_per_iteration=rows,
        mini_batch_rows=mini,
        optimizer_steps_per_epoch=max(1, math.ceil(rows / mini)),
        micro_batches_per_optimizer_step=-(-mini // micro),
        turns=r.max_steps,
        logprob_passes=logprob_passes,
        batch_buckets=batch.sizes,
        iterations=spec.num_iterations,
        val_every=v.every,
        checkpoint_every=spec.checkpoint.every,
        remat=str(spec.model.remat),
    )
    if out.remat != "auto":
        return out
    estimate = remat_estimate(spec, dataclasses.replace(out, remat="full"))
    hbm = device_hbm_bytes(jax.local_devices()[0]) if hbm_bytes is None else hbm_bytes
    info = dict(hbm_bytes=hbm, cutoff_bytes=REMAT_AUTO_BUDGET * hbm, bytes=estimate)
    return dataclasses.replace(out, remat=resolve_remat(estimate, hbm), remat_estimate=info)
