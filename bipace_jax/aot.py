"""Every program of a run as an abstract ``ProgramSpec``, at the run plan's largest shapes: what
``launch.aot`` compiles for a device topology without weights or data.

``abstract_run(spec, plan, devices, local_devices)`` builds the run's meshes (as the trainer:
``sharding.make_mesh`` by host, each host sampling on its own chips) and its long-lived state as
``jax.ShapeDtypeStruct``s carrying their shardings: the actor by ``nnx.eval_shape``, the fp32 master
parameters, the AdamW moments, the host-local copies in the compute dtype. ``abstract_programs``
then lists the library's own program specs (``learner.step_specs``, ``ppo.logprobs_spec``, the
sampler's and slots' programs through `engine_programs`, the estimator, the sampler copy's gather),
each with the resident arrays it does not take as arguments. Every size comes from the
``plan.RunPlan``; no config field is read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import PartitionSpec as P

from bipace_jax import build, learner, ppo, sampling, sft, sharding, step_time
from bipace_jax import plan as plan_lib
from bipace_jax.batch import PackedMicroBatch, abstract_micro_batch
from bipace_jax.config import OldLogprobs, fail
from bipace_jax.estimators import StepBatch
from bipace_jax.estimators.core import jitted_advantages
from bipace_jax.plan import HostLayout, RunPlan
from bipace_jax.programs import ProgramSpec, abstract

__all__ = [
    "PACKED_PROGRAMS",
    "PROGRAMS",
    "ROLE_PROGRAMS",
    "SFT_PROGRAMS",
    "SLOT_PROGRAMS",
    "AbstractRun",
    "Program",
    "REMAT_ORDER",
    "abstract_packed_micro_batch",
    "choose_remat",
    "abstract_programs",
    "pack_widths",
    "abstract_run",
    "bytes_per_chip",
    "engine_programs",
    "role_devices",
    "role_plans",
    "role_programs",
    "role_slices",
    "shapes",
    "slot_run_shape",
    "slot_step_time",
    "sync_route",
    "transients",
]

#: The programs of an RL run, in the order they are compiled.
PROGRAMS = (
    "ppo_grad",
    "ppo_apply",
    "logprobs",
    "prefill",
    "decode",
    "val_prefill",
    "val_decode",
    "estimator",
    "sync_gather",
)
#: The programs of each role when a sampler group and a learner group of hosts run apart
#: (``launch.aot --roles``); ``push_gather`` is the weight push over the whole slice.
ROLE_PROGRAMS = dict(
    sampler=("prefill", "decode", "val_prefill", "val_decode"),
    learner=("ppo_grad", "ppo_apply", "logprobs", "estimator", "sync_gather"),
    push=("push_gather",),
)
#: The packed learner programs (``ppo.pack``: token-budget lines, `abstract_packed_micro_batch`): on request
#: only; with ``ppo.pack`` on, ``ppo_grad`` and ``logprobs`` themselves are these.
PACKED_PROGRAMS = ("ppo_grad_packed", "logprobs_packed")
#: ``model.remat`` policies from the least compute to the least memory (none keeps every activation;
#: save_dots recomputes the elementwise work; full recomputes each layer: a third more FLOPs).
REMAT_ORDER = ("none", "save_dots", "full")
#: The warm start's programs (``sft.sft_step_specs``): on request only.
SFT_PROGRAMS = ("sft_grad", "sft_apply")
#: The continuous scheduler's slot programs (the engine's ``insert`` and ``decode`` chunk): on request only.
SLOT_PROGRAMS = ("insert_1", "insert", "decode_chunk")


def bytes_per_chip(tree) -> int:
    """Bytes of one device's shard of every array of ``tree`` (ShapeDtypeStructs with shardings)."""
    return int(
        sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
    )


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile.

    Attributes:
      name: its name in the report (`PROGRAMS`, `SFT_PROGRAMS`, `SLOT_PROGRAMS`).
      mesh: the mesh it is compiled under (the training mesh or a host's sampler mesh).
      spec: the program (None for one reported ``same_as`` another).
      other: keys of ``AbstractRun.resident`` that stay resident beside it (not its arguments).
      same_as: the same program at the same shapes as that one: reported as it, not compiled again,
        when that one was compiled (else compiled from ``spec``; without one, left out).
      slot_state_bytes: a slot program's chip share of the donated slot state (0: not a slot program).
    """

    name: str
    mesh: Any
    spec: ProgramSpec | None = None
    other: tuple[str, ...] = ()
    same_as: str = ""
    slot_state_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """A run's meshes and long-lived state as ShapeDtypeStructs (``abstract_run``).

    Attributes:
      spec, plan: the ``build.RunSpec`` and its ``plan.RunPlan``.
      devices, local_devices: the slice's devices and one host's (numbered from 0 for the TPU compiler).
      mesh, local_mesh: the training mesh and a host's sampler / log-prob mesh.
      placement: ``sharding.check_placement`` of ``mesh``.
      arch, actor: the actor's ``Qwen2Config`` and the abstract actor; graphdef, rest: its split
        (``nnx.Param`` apart).
      master: fp32 master parameters (training mesh); local_params: the host-local copy in the
        compute dtype; opt_state: the AdamW state; tx: the optimizer.
      separate: the sampler's copy is a copy (several hosts, or dtypes differ), not the master itself.
      resident: bytes per chip of ``params``, ``opt_state``, ``reference``, ``sampler_params``.
    """

    spec: Any
    plan: RunPlan
    devices: list
    local_devices: list
    mesh: Any
    local_mesh: Any
    placement: dict
    arch: Any
    actor: Any
    graphdef: Any
    rest: Any
    master: Any
    local_params: Any
    opt_state: Any
    tx: Any
    separate: bool
    num_params: int
    resident: dict[str, int]

    @property
    def host_other(self) -> tuple[str, ...]:
        """What stays resident beside a program on the host-local copy."""
        return ("params", "opt_state", "reference") if self.separate else ("opt_state", "reference")

    @property
    def replica(self) -> bool:
        """The sampler copy comes by the replica route (`RunPlan.sync_replica`)."""
        return self.plan.sync_replica(self.spec.model)


def abstract_run(spec: Any, plan: RunPlan, devices: Sequence, local_devices: Sequence) -> AbstractRun:
    """The meshes and abstract long-lived state of ``spec`` (a ``build.RunSpec``) planned by ``plan``
    on ``devices``; ``local_devices``: one host's (a TPU slice's single-host topology)."""
    lay, m = plan.layout, spec.model
    mesh = sharding.make_mesh(*lay.mesh_shape, devices=list(devices))
    placement = sharding.check_placement(mesh)  # as the trainer: tensor groups in a host, disjoint batch blocks
    # As `distributed.local_mesh`: a host samples on its own chips, tensor-parallel by its sampler tensor
    if lay.processes == 1 and lay.sampler_tensor == lay.tensor:
        local_mesh = mesh
    else:
        local_mesh = sharding.make_mesh(-1, 1, lay.sampler_tensor, devices=list(local_devices))
    arch = build.actor_architecture(m, m.vocab_size)
    dtype = m.dtype.jnp
    actor = nnx.eval_shape(lambda: build.init_actor(m, arch, seed=spec.seed))
    graphdef, params, rest = nnx.split(actor, nnx.Param, ...)
    master = abstract(params, sharding.param_shardings(params, mesh))
    # The sampler's and the reference's host-local copies (the global parameters themselves on one host).
    local_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)  # copies in compute dtype
    local_params = abstract(local_params, sharding.param_shardings(local_params, local_mesh))
    tx = build.make_optimizer(spec.optim)
    opt_shardings = learner.opt_state_shardings(tx, master, sharding.param_shardings(params, mesh), mesh)
    opt_state = abstract(jax.eval_shape(tx.init, master), opt_shardings)
    # one host with equal dtypes: the sampler's copy is the master parameters themselves
    separate = lay.processes > 1 or m.dtype != m.param_dtype
    resident = dict(
        params=bytes_per_chip(master),
        opt_state=bytes_per_chip(opt_state),
        reference=bytes_per_chip(local_params) if spec.loss.kl_coef > 0 else 0,
        sampler_params=bytes_per_chip(local_params) if separate else 0,
    )
    return AbstractRun(
        spec=spec,
        plan=plan,
        devices=list(devices),
        local_devices=list(local_devices),
        mesh=mesh,
        local_mesh=local_mesh,
        placement=placement,
        arch=arch,
        actor=actor,
        graphdef=graphdef,
        rest=rest,
        master=master,
        local_params=local_params,
        opt_state=opt_state,
        tx=tx,
        separate=separate,
        num_params=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
        resident=resident,
    )


def shapes(run: AbstractRun) -> dict[str, int]:
    """The report's shapes of an RL run (the plan's sizes the programs are compiled at)."""
    p, learn = run.plan, run.spec.learner
    return dict(
        prompt_tokens=p.prompt_bucket,
        response_tokens=p.response_tokens,
        micro_batch_rows=p.micro_batch_rows_global,
        mini_batch_rows=p.mini_batch_rows,
        sampler_batch=p.sampler_batch,
        estimator_rows=p.estimator_rows,
        logprob_chunk=learn.logprob_chunk,
        val_rows_per_host=p.val_rows_per_host,
        val_sampler_batch=p.val_sampler_batch,
    )


def engine_programs(run: AbstractRun, names: Sequence[str]) -> tuple[list[Program], dict[str, int]]:
    """The sampler's programs of ``names`` (prefill / decode at the rollout's batch, at the validation
    batch, and the slot programs) on the host's sampler mesh, with the slot shapes for the report.

    The one place that asks the sampling engine for its programs (``sampling.abstract_programs``: the
    specs ``Engine.generate`` and ``SlotHandle`` run).
    """
    p, arch, mesh = run.plan, run.arch, run.local_mesh
    s = dataclasses.replace(run.spec.sampler, eos_token_ids=tuple(arch.eos_token_ids))
    gdef, state = nnx.split(run.actor)  # the sampler merges the whole actor from one state
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, s_dtype(run)), state)
    state = abstract(state, sharding.param_shardings(state, mesh))
    other = run.host_other

    def specs(**sizes) -> dict[str, ProgramSpec]:
        return sampling.abstract_programs(
            s, gdef, state, vocab=arch.vocab_size, prompt_len=p.prompt_bucket, mesh=mesh, **sizes
        )

    lockstep = specs(batch=p.sampler_batch)
    out = [
        Program("prefill", mesh, lockstep["prefill"], other),
        Program("decode", mesh, lockstep["decode"], other),
    ]
    # Validation: each panel is one sampler call per turn over the rows this host plays, bucketed like
    # the rollout's; at the rollout's batch the rollout's programs serve it
    if p.val_sampler_batch == p.sampler_batch:
        out += [Program("val_prefill", mesh, same_as="prefill"), Program("val_decode", mesh, same_as="decode")]
    elif p.val_rows_per_host:
        val = specs(batch=p.val_sampler_batch)
        out += [Program("val_prefill", mesh, val["prefill"], other), Program("val_decode", mesh, val["decode"], other)]
    slot_shapes: dict[str, int] = {}
    if set(SLOT_PROGRAMS) & set(names):
        one, every = p.batch_bucket(1), p.batch_bucket(p.slots)
        slot = specs(slots=p.slot_rows, insert_rows=sorted({one, every}), chunk=p.chunk_steps)
        chunk = slot["decode_chunk"]
        state_bytes = bytes_per_chip(chunk.args[chunk.donate_argnums[0]])  # the donated slot state
        slot_shapes = dict(
            slots=p.slot_rows, slot_cache_columns=p.prompt_bucket + p.response_tokens, chunk_steps=p.chunk_steps,
            insert_1_batch=one, insert_batch=every, slot_state_bytes_per_chip=state_bytes,
        )  # fmt: skip
        same = "insert_1" if every == one else ""  # one program when both batches are one bucket
        out += [
            Program("insert_1", mesh, slot[f"insert_{one}"], other, slot_state_bytes=state_bytes),
            Program("insert", mesh, slot[f"insert_{every}"], other, same_as=same, slot_state_bytes=state_bytes),
            Program("decode_chunk", mesh, chunk, other, slot_state_bytes=state_bytes),
        ]
    return out, slot_shapes


def s_dtype(run: AbstractRun):
    """The compute dtype the sampler's copy is held in."""
    return run.spec.model.dtype.jnp


def abstract_programs(run: AbstractRun, names: Sequence[str]) -> tuple[list[Program], dict[str, int]]:
    """The programs of ``names`` in compile order (see `Program`),
    and the slot programs' shapes for the report ({} without them)."""
    spec, p, mesh = run.spec, run.plan, run.mesh
    ppo_objective = ppo.PPOObjective(
        spec.loss, spec.learner.old_logprobs is OldLogprobs.FUSED, run.arch.vocab_size, spec.learner.logprob_chunk
    )
    rows, prompt, response = p.micro_batch_rows_global, p.prompt_bucket, p.response_tokens
    kl, tis = spec.loss.kl_coef > 0, spec.loss.tis_cap > 0
    packed = spec.learner.pack

    def micro(on, n, *, logprobs=True, pack=False):
        if pack:
            width, rwidth = pack_widths(run)
            return abstract_packed_micro_batch(on, n, width, rwidth, logprobs=logprobs, reference=kl, sampler=tis)
        return abstract_micro_batch(on, n, prompt, response, logprobs=logprobs, reference=kl, sampler=tis)

    def update(pack: bool) -> dict[str, ProgramSpec]:
        args = (run.graphdef, ppo_objective, run.tx, mesh, run.master, run.rest, run.opt_state)
        return learner.step_specs(*args, micro(mesh, rows, pack=pack), ppo_objective.stat_keys)

    step = update(packed)
    # `PPOLearner.update` frees the sampler copy for its steps (`Learner.release_local`)
    out = [
        Program("ppo_grad", mesh, step["accumulate"], ("opt_state", "reference")),
        Program("ppo_apply", mesh, step["apply"], ("reference",)),
    ]
    if "ppo_grad_packed" in names:  # the optimizer step does not see the micro-batch: ppo_apply serves both
        out.append(Program("ppo_grad_packed", mesh, update(True)["accumulate"], ("opt_state", "reference")))
    if set(SFT_PROGRAMS) & set(names):
        # the warm start keeps no reference and frees its sampler copy for its steps (`sft._WarmStart.train`)
        sft_step = sft.sft_step_specs(
            run.graphdef, run.tx, mesh, run.master, run.rest, run.opt_state, rows, prompt + response, response
        )
        out += [
            Program("sft_grad", mesh, sft_step["accumulate"], ("opt_state",)),
            Program("sft_apply", mesh, sft_step["apply"]),
        ]
    for name, pack in (("logprobs", packed), ("logprobs_packed", True)):
        if name == "logprobs" or name in names:
            lmb = micro(run.local_mesh, p.logprob_rows_per_host, logprobs=False, pack=pack)
            logprobs = ppo.logprobs_spec(run.graphdef, ppo_objective, run.local_params, run.rest, lmb)
            out.append(Program(name, run.local_mesh, logprobs, run.host_other))
    engine, slot_shapes = engine_programs(run, names)
    out += engine
    out.append(_estimator_program(run))
    if run.replica:
        # `Learner.sync_local`: with another tensor size on the host than in training, each array comes
        # whole to every chip by one all-gather over the slice, then a host-local slice (the
        # `local_copy` replica route); compiled at the largest array, so libtpu's routing of it is proven too.
        gather = jax.jit(lambda x: x.astype(s_dtype(run)), out_shardings=jax.sharding.NamedSharding(mesh, P()))
        spec_ = ProgramSpec("sync_gather", gather, (_largest(run),))
        out.append(Program("sync_gather", mesh, spec_, tuple(run.resident)))
    return out, slot_shapes


def pack_widths(run: AbstractRun) -> tuple[int, int]:
    """(C, R) of a packed line at the plan's largest rows, as ``PPOLearner`` takes them: ``ppo.pack_width``
    or the prompt bucket + the response width, and ``ppo.pack_response_width`` or min(C, 2 x the
    response width)."""
    learn, p = run.spec.learner, run.plan
    width = learn.pack_width or p.prompt_bucket + p.response_tokens
    return width, learn.pack_response_width or min(width, 2 * p.response_tokens)


def abstract_packed_micro_batch(
    mesh,
    lines: int,
    width: int,
    response_width: int,
    *,
    logprobs: bool = True,
    reference: bool = True,
    sampler: bool = False,
) -> PackedMicroBatch:
    """A ``PackedMicroBatch`` of ``jax.ShapeDtypeStruct``s (L = ``lines``, C = ``width``, R =
    ``response_width``) with lines split over ``mesh``'s ("data", "fsdp") axes, as
    ``batch.abstract_micro_batch`` for padded rows; ``logprobs``: with the old log-probs and
    advantages (the gradient pass), ``reference``: with the reference log-probs too, ``sampler``: with
    the sampler's log-probs (truncated importance weights, ``ppo.tis_cap`` > 0)."""

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape)))

    per_slot = sds((lines, response_width), np.float32)
    return PackedMicroBatch(
        input_ids=sds((lines, width), np.int32),
        segment_ids=sds((lines, width), np.int32),
        head_index=sds((lines, response_width), np.int32),
        response_ids=sds((lines, response_width), np.int32),
        response_mask=sds((lines, response_width), np.bool_),
        old_logprobs=per_slot if logprobs else None,
        ref_logprobs=per_slot if logprobs and reference else None,
        advantages=per_slot if logprobs else None,
        sampler_logprobs=per_slot if logprobs and sampler else None,
    )


def _largest(run: AbstractRun):
    return max(jax.tree.leaves(run.master), key=lambda x: int(np.prod(x.shape)))


def _estimator_program(run: AbstractRun) -> Program:
    """The advantage estimator at a host's rollout capacity, on one device of the host."""
    p, one_device = run.plan, run.local_devices[0]
    fn, scalars = jitted_advantages(run.spec.estimator)
    n = p.estimator_rows
    one = jax.sharding.SingleDeviceSharding(one_device)

    def vec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=one)

    steps = StepBatch(
        group_id=vec((n,), jnp.int32),
        traj_id=vec((n,), jnp.int32),
        step=vec((n,), jnp.int32),
        reward=vec((n,), jnp.float32),
        obs_hash=vec((n,), jnp.int32),
        fingerprint=vec((n, run.arch.hidden_size), jnp.float32),
        action_key=vec((n,), jnp.int32),
        mask=vec((n,), jnp.bool_),
        penalty=vec((n,), jnp.float32),
        group_capacity=p.group_capacity,
        row_capacity=p.row_capacity,
    )
    scalars = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=one) for x in scalars)
    mesh = jax.sharding.Mesh(np.array([one_device]), ("data",))
    return Program("estimator", mesh, ProgramSpec("estimator", fn, (steps, *scalars)), tuple(run.resident))


def transients(run: AbstractRun, names: Sequence[str]) -> dict[str, int]:
    """Peaks no compiled program shows, bytes per chip: ``sync_local`` (the new sampler copy is built,
    the old one freed first; by the replica route one array at a time through its whole replica) and
    ``grad_init`` (the fp32 gradient accumulator's zeros beside every long-lived array, the sampler
    copy released)."""
    r, lay = run.resident, run.plan.layout
    whole = int(np.prod(_largest(run).shape)) * np.dtype(s_dtype(run)).itemsize
    sync_extra = whole + whole // lay.sampler_tensor if run.replica else 0
    ref = r["reference"] if set(names) & set(PROGRAMS) else 0  # the warm start keeps no reference
    return dict(
        sync_local=r["params"] + r["opt_state"] + ref + r["sampler_params"] + sync_extra,
        grad_init=2 * r["params"] + r["opt_state"] + ref,
    )


def sync_route(run: AbstractRun) -> str:
    """How the sampler copy is refreshed: ``replica``, ``host_wide`` (a copy of its own) or ``shared``."""
    return "replica" if run.replica else ("host_wide" if run.separate else "shared")


def slot_run_shape(run: AbstractRun, slot_shapes: dict[str, int]) -> step_time.RunShape:
    """The step-time model's shape of one host's slot programs: its sampler mesh alone (fsdp 1, the
    sampler's tensor axis), ``slots`` games, the prompt bucket as T_max (no training rows)."""
    p = run.plan
    t = p.layout.sampler_tensor
    return step_time.RunShape(
        chips=p.layout.devices, hosts=p.hosts, fsdp=1, tensor=t, sampler_tensor=t,
        prompt_tokens=p.prompt_bucket, response_tokens=p.response_tokens, games_per_host=slot_shapes["slots"],
        turns=p.turns, micro_batch_rows=1, logprob_rows_per_host=1, mini_batch_rows=1,
    )  # fmt: skip


def slot_step_time(run: AbstractRun, slot_shapes: dict[str, int], chip: step_time.Chip) -> dict[str, Any]:
    """`step_time.program_costs` at the slot shapes: an insert (prefill at T_max) per batch, and one
    dense decode step, where every slot reads all S = T_max + M cache columns, and a chunk of them."""
    base = slot_run_shape(run, slot_shapes)
    t_max, m = base.prompt_tokens, base.response_tokens
    model = step_time.ModelShape.of(run.arch)
    out = dict(chip=dataclasses.asdict(chip), run_shape=dataclasses.asdict(base), programs={})
    for name in ("insert_1", "insert"):
        r = dataclasses.replace(base, games_per_host=slot_shapes[f"{name}_batch"])
        out["programs"][name] = step_time.program_costs(model, r)["prefill"].seconds(chip)
    # program_costs' decode step attends to prompt + M/2 columns on average; a dense slot reads all S
    r = dataclasses.replace(base, prompt_tokens=t_max + m - m // 2)
    step = step_time.program_costs(model, r)["decode_step"].seconds(chip)
    chunk = slot_shapes["chunk_steps"]
    out["programs"]["decode_step"] = step
    out["programs"]["decode_chunk"] = {k: v * chunk if k.endswith("_s") else v for k, v in step.items()}
    out["programs"]["decode_chunk"]["seconds"] = step["seconds"] * chunk
    out["decode_tokens_per_s_per_host"] = slot_shapes["slots"] / step["seconds"]
    return out


# ------------------------------------------------------------------------------------------------
# Disaggregated roles: a sampler group and a learner group of whole hosts (the asynchronous schedule).


def role_devices(devices: Sequence, sampler_hosts: int) -> tuple[list, list]:
    """``(learner, sampler)`` devices of a slice split by hosts: the first ``hosts - sampler_hosts``
    processes learn (the TPU compiler numbers a program's devices from the slice's first), the rest sample.

    Raises:
      ValueError: ``sampler_hosts`` not in [1, hosts - 1].
    """
    hosts = sorted({d.process_index for d in devices})
    if not 1 <= sampler_hosts < len(hosts):
        raise ValueError(
            f"--roles: sampler hosts must be in [1, {len(hosts) - 1}] of {len(hosts)}, got {sampler_hosts}"
        )
    learners = set(hosts[: len(hosts) - sampler_hosts])
    return [d for d in devices if d.process_index in learners], [d for d in devices if d.process_index not in learners]


def role_slices(devices: Sequence, sampler_hosts: int, sampler_slice: Sequence, learner_slice: Sequence) -> None:
    """Checks that two slices of their own can hold the roles of ``devices`` (the committed slice) split
    with ``sampler_hosts`` sampling: ``sampler_slice`` has that many hosts, ``learner_slice`` the rest,
    each the slice's chips per host and device kind (``launch.aot --role_topologies``).

    Raises:
      ValueError: a host count, chips per host or device kind differs, naming the slice.
    """
    hosts = len({d.process_index for d in devices})
    per_host = len(devices) // hosts
    for role, want, got in (
        ("sampler", sampler_hosts, sampler_slice),
        ("learner", hosts - sampler_hosts, learner_slice),
    ):
        n = len({d.process_index for d in got})
        if n != want or len(got) != want * per_host or got[0].device_kind != devices[0].device_kind:
            raise ValueError(
                f"--role_topologies: the {role} slice must be {want} hosts of {per_host} x {devices[0].device_kind}, "
                f"got {n} hosts, {len(got)} x {got[0].device_kind}"
            )


def role_plans(spec: Any, plan: RunPlan, sampler_hosts: int) -> tuple[RunPlan, RunPlan]:
    """``(sampler, learner)`` run plans of ``plan`` (the whole slice's) with ``sampler_hosts`` hosts
    sampling and the others learning.

    The sampler group plays all ``rollout.num_groups`` task groups (`plan_lib.plan` on its hosts: a
    bigger batch a host). The learner group trains on a mesh of its chips with data 1, FSDP over the
    rest and the config's tensor axis, the same ``ppo.micro_batch_rows`` a host, and the iteration's
    task groups split over its hosts (a host's share rounded up) for the log-prob pass and the estimator.

    Raises:
      ConfigError: the task groups do not split over the sampler hosts, or the micro-batch rows over
        the learner's batch shards (``rollout.num_groups``, ``ppo.micro_batch_rows``).
    """
    lay = plan.layout
    cph, learn = lay.local_devices, lay.processes - sampler_hosts
    if spec.num_groups % sampler_hosts:
        fail("rollout.num_groups", f"be a multiple of the {sampler_hosts} sampler hosts of --roles", spec.num_groups)

    def layout(hosts: int) -> HostLayout:
        # a role's own mesh: data 1, FSDP over its chips, the config's tensor axis (inside a host)
        chips = hosts * cph
        return dataclasses.replace(lay, processes=hosts, devices=chips, data=1, fsdp=chips // lay.tensor)

    sampler = plan_lib.plan(spec, layout(sampler_hosts))
    rows, shards = spec.learner.micro_batch_rows, cph // lay.tensor
    if rows % shards:
        fail("ppo.micro_batch_rows", f"be a multiple of the {shards} batch shards of each learner host", rows)
    groups = -(-spec.num_groups // learn)
    games = groups * spec.rollout.group_size
    micro = rows * learn
    learner = dataclasses.replace(
        plan,
        layout=layout(learn),
        groups_per_host=groups,
        games_per_host=games,
        group_capacity=groups,
        estimator_rows=games * plan.turns,
        micro_batch_rows_global=micro,
        micro_batches_per_optimizer_step=-(-plan.mini_batch_rows // micro),
    )
    return sampler, learner


def role_programs(
    sampler: AbstractRun, learner: AbstractRun, whole: AbstractRun | None
) -> tuple[dict[str, list[Program]], dict[str, int]]:
    """The programs of each role (`ROLE_PROGRAMS`): the sampler's on a sampler host's mesh with nothing
    else resident (no master weights, moments or reference live on a sampler host), the learner's as in
    a synchronous run on the learner group's mesh, and the weight push on the whole slice.

    The push: one XLA program runs on one device set, and the two groups' are disjoint (a jitted
    program with its input on the learner mesh and its output on the sampler mesh is refused), so the
    push is compiled as `distributed.local_copy`'s replica route over every chip of the slice: each
    array all-gathered whole to every chip in the compute dtype, at the largest array, then each
    sampler host slices its tensor shard (``push_gather``). ``whole`` None: the roles are slices of
    their own (``launch.aot --role_topologies``), joined only by the data-center network; the push's
    compiled part is then the same gather over the learner slice alone (each array whole on every
    learner chip, what its hosts send from), and the crossing itself is no XLA program (its time is
    `step_time.push_cost` at the DCN bandwidth).

    Returns the programs by role and the resident bytes per chip their ``other`` keys name (the
    learner run's arrays, and ``learner_state``, all of them: what a learner chip holds during the push).
    """
    names = ROLE_PROGRAMS
    s_progs, _ = engine_programs(sampler, names["sampler"])
    out = dict(
        sampler=[dataclasses.replace(p, other=()) for p in s_progs if p.name in names["sampler"]],
        learner=[p for p in abstract_programs(learner, PROGRAMS)[0] if p.name in names["learner"]],
    )
    over = learner if whole is None else whole
    gather = jax.jit(lambda x: x.astype(s_dtype(over)), out_shardings=jax.sharding.NamedSharding(over.mesh, P()))
    push = ProgramSpec("push_gather", gather, (_largest(over),))
    out["push"] = [Program("push_gather", over.mesh, push, ("learner_state",))]
    return out, dict(learner.resident, learner_state=sum(learner.resident.values()))


def choose_remat(totals: dict[str, int], budget_bytes: float) -> str | None:
    """The first policy of `REMAT_ORDER` (the least recompute) whose gradient program's per-chip total
    (``totals``: policy -> bytes, e.g. ``memory_analysis`` peak + resident arrays) is at most
    ``budget_bytes``; None when none fits. Policies missing from ``totals`` are skipped."""
    for policy in REMAT_ORDER:
        if policy in totals and totals[policy] <= budget_bytes:
            return policy
    return None


def topology_devices(name: str, num_slices: int = 1) -> list:
    """The devices of ``name``: ``cpu:N`` (this machine's CPU devices; N must not exceed them) or a TPU
    topology (``jax.experimental.topologies``; needs libtpu), ``num_slices`` copies of it joined over
    the data-center network (devices carry ``slice_index``; processes are numbered slice after slice).

    Raises:
      ValueError: a malformed name, too few CPU devices, slices of CPU devices, or a TPU topology
        without libtpu.
    """
    if num_slices < 1 or (num_slices > 1 and name.startswith("cpu:")):
        raise ValueError(f"--num_slices={num_slices}: expected 1, or more slices of a TPU topology")
    if name.startswith("cpu:"):
        n = int(name[4:]) if name[4:].isdigit() else 0
        devices = jax.devices("cpu")
        if n < 1 or n > len(devices):
            raise ValueError(f"--topology={name}: expected cpu:N with 1 <= N <= {len(devices)} CPU devices")
        return devices[:n]

    try:
        # v4 lists two devices (TensorCores) per chip unless megacore; meshes need one per chip
        kw = dict(chip_config_name="megacore") if name.startswith("v4:") else {}
        if num_slices > 1:
            kw["num_slices"] = num_slices
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **kw).devices)
    except Exception as e:  # libtpu missing or an unknown slice name
        raise ValueError(
            f"--topology={name}: not a TPU topology this machine can describe ({type(e).__name__}: {e}); "
            'TPU topologies need libtpu: pip install -e ".[tpu]"'
        ) from e


def parse_roles(value: str, hosts: int) -> int:
    """The sampler hosts of ``--roles=sampler:S,learner:L``.

    Raises:
      ValueError: not that form, a count < 1, or S + L is not the slice's ``hosts``.
    """
    try:
        parts = dict(kv.split(":") for kv in value.split(","))
        s, learn = int(parts.pop("sampler")), int(parts.pop("learner"))
        if parts:
            raise ValueError
    except (ValueError, KeyError):
        raise ValueError(f"--roles={value!r}: expected sampler:S,learner:L (host counts)") from None
    if s < 1 or learn < 1 or s + learn != hosts:
        raise ValueError(f"--roles={value!r}: S and L must be >= 1 and add up to the slice's {hosts} hosts")
    return s
