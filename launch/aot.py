"""Compile every program of a run for a device topology from abstract shapes: does a config fit?

    python -m launch.aot --config=configs/alfworld_qwen2_5_1_5b.py --topology=v5e:4x4
    python -m launch.aot --config=configs/alfworld_qwen2_5_7b.py --topology=v5e:8x8 --config.ppo.micro_batch_rows=4
    python -m launch.aot --topology=cpu:8                       # the CPU default on 8 emulated CPU devices
    python -m launch.aot --config=configs/alfworld_qwen2_5_7b.py --topology=v5e:8x8 --roles=sampler:2,learner:14 \
        --role_topologies=v5e:2x4,v5e:4x14         # the roles on slices of their own
    python -m launch.aot --config=configs/alfworld_qwen2_5_1_5b.py --topology=v5e:4x4 --remat_search

No weights and no data: the actor is built with ``nnx.eval_shape`` at the config's sizes and dtypes,
every argument is a ``jax.ShapeDtypeStruct`` carrying the ``NamedSharding`` the trainer gives it, and
each program is the library's own ``ProgramSpec`` (``learner.step_specs``, ``ppo.logprobs_spec``,
``sampling.prefill_spec`` / ``decode_spec``: the objects the trainer runs), listed by
``bipace_jax.aot.abstract_programs`` at the shapes of the run plan (``bipace_jax.plan``: the sizes
``launch.train --print_config`` prints; validation rows at the config's panel bound, no game data
here), and ``spec.lower().compile()`` runs the target's own compiler. A TPU topology
(``v5e:4x4``, ``v5e:8x8``, ``v5p:2x2x4``, ``v4:2x2x4``, ``v6e:4x4``, ...) needs libtpu
(``pip install -e ".[tpu]"``), not a TPU: ``jax.experimental.topologies`` describes the slice on any
machine. ``cpu:N`` compiles for N CPU devices of this machine (for tests).

Programs (the ones a run compiles, at their largest shapes):
  ppo_grad   the micro-batch gradient (``learner``'s accumulate: forward, PPO loss, backward)
  ppo_apply  the optimizer update (fp32 master weights and AdamW moments)
  logprobs   the old / reference log-prob pass of a micro-batch (host-local parameter copy)
  prefill    the sampler's prefill and first token, largest batch and prompt bucket
  decode     the sampler's decode loop over ``sampler.max_new_tokens`` from that prefilled state
  val_prefill, val_decode   the same at the validation batch each host really plays
             (ceil(panel x val.group_size / hosts), bucketed; ``same_as`` when it is the rollout's)
  estimator  the advantage estimator at the rollout's row capacity (one device per host)
  sync_gather  the sampler copy's all-gather of the largest array to every chip, when the host's
             sampler mesh has another tensor size than training (``mesh.sampler_tensor``)

The warm start's step (behaviour cloning on demonstrations, ``sft.sft_step_specs``) on request only
(``--programs=sft_grad,sft_apply``), at the run's model, mesh, optimizer and micro-batch rows, each row
``prompt + response`` tokens with ``response`` targets; its report is ``<config>__<topology>__sft.json``:
  sft_grad   the micro-batch gradient (forward, response-token NLL, backward)
  sft_apply  the optimizer update

The packed learner programs (``ppo.pack``: ``micro_batch_rows`` lines of C = ``ppo.pack_width`` tokens,
0: the prompt bucket + the response width, and R = ``ppo.pack_response_width`` response slots, 0:
min(C, 2 x the response width); ``aot.abstract_packed_micro_batch``): with ``ppo.pack`` on, ``ppo_grad``
and ``logprobs`` are compiled packed (what the trainer runs); ``--programs=ppo_grad_packed,logprobs_packed``
compiles them packed beside an unpacked config, into ``<config>__<topology>__packed.json`` (``ppo_apply``
does not see the micro-batch). The report's ``shapes`` carry ``pack_width`` and ``pack_response_width``.

The continuous scheduler's slot programs (``rollout.scheduler="continuous"``, ``sampling.Engine.slots``) on
request only (``--programs=insert_1,insert,decode_chunk``), on the host's sampler mesh with the slot state
(NS = ``rollout.num_slots`` or the host's games capped at the largest batch bucket, rounded up to the
mesh's batch shards; S = T_max + M) sharded by ``sampling.state.state_shardings`` and donated; the report is
``<config>__<topology>__slots.json``:
  insert_1   one prompt prefilled (padded to its batch bucket) at T_max and written into its slot
  insert     every slot's prompt at once (the first turn), same T_max
  decode_chunk  ``rollout.chunk_steps`` decode steps of every slot (the ``while_loop`` with early exit)
Each reports ``slot_state_bytes`` (a chip's share of the donated state) and ``slot_state_aliased``
(``alias_bytes`` covers it: donation worked, the cache is updated in place); ``insert`` is
``same_as: insert_1`` when both batches are one bucket. ``slot_step_time`` holds `bipace_jax.step_time`'s
roofline of each insert, of one dense decode step (every slot reads all S columns) and of a chunk of
them (TPU topologies).

A disaggregated run (the asynchronous schedule, ``step_time.async_iteration``) with
``--roles=sampler:S,learner:L`` (S + L = the slice's hosts; ``--programs`` picks among them): the sampler
group's programs (prefill, decode, validation) on a sampler host's mesh at the batch a sampler host plays
when S hosts play every task group, nothing else resident; the learner group's (gradient, AdamW,
log-probs, estimator, its copy's gather) on a training mesh of the first L hosts' chips (data 1, FSDP,
the config's tensor axis; ``aot.role_plans``); the weight push (``push_gather``) over the whole slice
beside a learner chip's resident arrays (``aot.role_programs`` says why it is a whole-slice gather, not
a learner-to-sampler program). The report ``<config>__<topology>__roles-<S>s<L>l.json`` lists each
role's programs, ``fits`` per role, and the step-time model of the split; ``launch.step_table`` shows it
in the asynchronous table. libtpu compiles no program over part of a slice with limited ICI routing
(v5e:8x8), so ``--role_topologies=SAMPLER,LEARNER`` compiles each role on a slice of its own instead
(S and L hosts of the slice's chips per host, e.g. v5e:2x4 and v5e:4x14 for 2 + 14 of a v5e:8x8;
libtpu describes shapes Cloud TPU does not sell): the push's compiled part is then the learner slice's
gather, its time `step_time.push_cost` at ``step_time.DCN_BYTES_PER_S_PER_HOST`` (``push_link``: DCN),
and the report records ``role_topologies``.

``--remat_search`` also compiles ``ppo_grad`` under every ``model.remat`` policy (none, save_dots, full)
and reports each one's per-chip total and ``chosen``: the least recompute whose total fits the budget
(``aot.choose_remat``; full remat costs a third more FLOPs than none), beside the run plan's estimate
(``plan.remat_estimate``) and what ``model.remat="auto"`` would resolve to (``estimate_chosen``,
``estimate_matches_compile``); the search is also written alone to ``--out/remat/<config>__<topology>.json``.
With ``model.remat="auto"`` the plan resolves the policy at the topology's HBM (``plan.resolve_remat``),
the report's ``remat_auto`` records it and the estimate, and the programs compile under it (``fits``
checks it); with ``--roles`` it is resolved on the whole slice's plan.

Two peaks are not programs and are counted from the resident arrays (``transients``): ``sync_local``
(the new sampler copy is built, the old one freed first; by the replica route one array at a time) and ``grad_init`` (the fp32 gradient
accumulator beside every long-lived array). ``placement`` records each device's host and the mesh
checks (`sharding.check_placement`); ``step_time`` is `bipace_jax.step_time`'s roofline model of every
program, one iteration and the whole run (TPU topologies), with the rollout under both schedulers
(``rollout_s_lockstep``, ``rollout_s_continuous``, ``speedup_continuous_rollout``; ``launch.step_table``
recomputes them from committed reports without compiling). ``--num_slices=2`` joins two copies of the
slice over the data-center network (data parallel across them; the report is ``<config>__2x<topology>``).

Per chip, a program needs its own peak (``memory_analysis``) plus the long-lived arrays it does not take
as arguments (master weights, AdamW moments, the reference and sampler copies): ``total_bytes_per_chip``.
The config fits when every program's total and every transient is at most ``--budget`` (0.9) of the chip's HBM; otherwise the
command exits with status 1. Writes a table to stdout and JSON to
``--out/<config>__<topology>.json`` (default ``runs/aot/``, so the committed reports in ``benchmarks/aot/``
change only when asked: ``--out=benchmarks/aot``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from bipace_jax import aot, build, step_time
from bipace_jax import config as config_lib
from bipace_jax import plan as plan_lib
from bipace_jax.aot import PACKED_PROGRAMS, PROGRAMS, SFT_PROGRAMS, SLOT_PROGRAMS, parse_roles, topology_devices
from launch import cli
from launch._common import ROOT, write_json

_CONFIG = cli.define_config_file("config", os.path.join(ROOT, "configs", "textcraft_tiny.py"), "Run config.")
_TOPOLOGY = flags.DEFINE_string("topology", "cpu:8", "TPU topology (e.g. v5e:4x4, v5p:2x2x4) or cpu:N.")
_OUT = flags.DEFINE_string(
    "out", os.path.join("runs", "aot"), "Folder of the JSON report (--out=benchmarks/aot updates the committed ones)."
)
_BUDGET = flags.DEFINE_float("budget", 0.9, "Largest fraction of a chip's HBM a program may use.")
_PROGRAMS = flags.DEFINE_list("programs", "", "Compile only these programs (default: all).")
_ROLES = flags.DEFINE_string(
    "roles",
    "",
    "sampler:S,learner:L: compile a disaggregated run instead, S hosts sampling and L learning (S + L = the "
    "slice's hosts); the report is <config>__<topology>__roles-<S>s<L>l.json.",
)
_ROLE_TOPOLOGIES = flags.DEFINE_list(
    "role_topologies",
    "",
    "With --roles: SAMPLER_TOPOLOGY,LEARNER_TOPOLOGY (e.g. v5e:2x4,v5e:4x14): compile each role on a slice of "
    "its own (S and L hosts of --topology's chips per host), the weight push crossing the data-center network.",
)
_REMAT_SEARCH = flags.DEFINE_bool(
    "remat_search",
    False,
    "Also compile ppo_grad under every model.remat policy and report the least-recompute one that fits "
    "(remat_search: the memory that is actually free decides).",
)
_SLICES = flags.DEFINE_integer(
    "num_slices", 1, "TPU slices joined over the data-center network (multi-slice: data parallel across them)."
)

GiB = 1 << 30
# HBM per chip by `device_kind` substring (Cloud TPU data sheets); first match wins.
HBM_BYTES = (
    ("v5 lite", 16 * GiB),
    ("v5e", 16 * GiB),
    ("v5p", 95 * 10**9),
    ("v5", 95 * 10**9),
    ("v6 lite", 32 * GiB),
    ("v6e", 32 * GiB),
    ("v4", 32 * GiB),
)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def host_devices(name: str, devices: list) -> list:
    """The devices one host compiles its own programs for (sampler, log-probs, estimator): for a TPU
    slice the single-host topology of its first host's block of chips (the TPU compiler numbers a
    program's devices from 0), for ``cpu:N`` all N."""
    local = [d for d in devices if d.process_index == devices[0].process_index]
    if len(local) == len(devices) or devices[0].platform == "cpu":
        return local
    coords = np.array([d.coords for d in local])
    dims = len(name.split(":")[1].split("x"))
    block = "x".join(str(int(x)) for x in (coords.max(0) - coords.min(0) + 1)[:dims])
    return topology_devices(f"{name.split(':')[0]}:{block}")


def hbm_bytes(device) -> int:
    """HBM of one chip; for CPU devices this machine's memory divided among them."""
    if device.platform == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(jax.devices("cpu"))
    kind = device.device_kind.lower()
    for key, size in HBM_BYTES:
        if key in kind:
            return size
    raise ValueError(f"unknown HBM size of device kind {device.device_kind!r}; add it to HBM_BYTES")


def _slice_fields(devices: list, hosts: list[int]) -> dict:
    """A report's fields naming the compiled-for chips (``topology`` is set by the caller that knows it)."""
    return dict(
        topology=None,
        chips=len(devices),
        hosts=len(hosts),
        device_kind=devices[0].device_kind,
        hbm_bytes_per_chip=hbm_bytes(devices[0]),
    )


def _stats(compiled, compile_s: float, other_resident: int) -> dict:
    mem = compiled.memory_analysis()
    arg, out, temp = mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.temp_size_in_bytes
    alias = mem.alias_size_in_bytes
    peak = getattr(mem, "peak_memory_in_bytes", 0) or arg + out + temp - alias
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost or {}
    try:
        text = compiled.as_text()
        counts = {c: len(re.findall(rf"\s{c}(?:-start)?\(", text)) for c in COLLECTIVES}
        counts["pallas_kernels"] = text.count('custom_call_target="tpu_custom_call"')  # e.g. splash attention
    except jax.errors.JaxRuntimeError:  # libtpu cannot print some programs' async collectives back as HLO
        counts = None
    return dict(
        peak_bytes_per_chip=int(peak),
        argument_bytes=int(arg),
        temp_bytes=int(temp),
        output_bytes=int(out),
        alias_bytes=int(alias),
        other_resident_bytes=int(other_resident),
        total_bytes_per_chip=int(peak + other_resident),
        flops=float(cost.get("flops", 0.0)),
        collectives=counts,
        compile_s=round(compile_s, 1),
    )


def compile_all(spec, devices, local, programs=PROGRAMS) -> dict:
    """Compiles ``programs`` of ``spec`` (a ``build.RunSpec``) for ``devices`` (``local``: one host's,
    `host_devices`); returns the report (see the module doc)."""
    hosts = sorted({d.process_index for d in devices})
    layout = plan_lib.HostLayout.of(spec, len(hosts), len(devices), len(devices) // len(hosts))
    plan = plan_lib.plan(spec, layout)  # validation rows at the config's bound: no game data here
    run = aot.abstract_run(spec, plan, devices, local)
    m = spec.model
    report = dict(
        **_slice_fields(devices, hosts),
        param_dtype=str(jnp.dtype(m.param_dtype.jnp)),
        compute_dtype=str(jnp.dtype(m.dtype.jnp)),
        mesh=dict(zip(("data", "fsdp", "tensor"), layout.mesh_shape)),
        placement=run.placement,
        sampler_mesh=dict(run.local_mesh.shape),
        model=dict(
            preset=m.preset,
            params=run.num_params,
            layers=run.arch.num_hidden_layers,
            remat=m.remat,
            scan_layers=m.scan_layers,
        ),  # fmt: skip
        shapes=aot.shapes(run),
        resident_bytes_per_chip=run.resident,
        programs={},
    )
    specs, slot_shapes = aot.abstract_programs(run, programs)
    report["shapes"].update(slot_shapes)
    if spec.learner.pack or set(programs) & set(PACKED_PROGRAMS):
        width, rwidth = aot.pack_widths(run)
        report["shapes"].update(pack=spec.learner.pack, pack_width=width, pack_response_width=rwidth)
    for p in specs:
        if p.name not in programs:
            continue
        if p.same_as and p.same_as in report["programs"]:
            report["programs"][p.name] = dict(report["programs"][p.same_as], same_as=p.same_as)
            continue
        if p.spec is None:
            continue
        t0 = time.perf_counter()
        with jax.set_mesh(p.mesh):
            done = p.spec.lower().compile()
        other = sum(run.resident[k] for k in p.other)
        report["programs"][p.name] = stats = _stats(done, time.perf_counter() - t0, other)
        print(f"  compiled {p.name} in {stats['compile_s']} s", flush=True)
        if p.slot_state_bytes:
            stats["slot_state_bytes"] = p.slot_state_bytes
            stats["slot_state_aliased"] = stats["alias_bytes"] >= p.slot_state_bytes
    tpu = devices[0].platform != "cpu"
    chip = step_time.chip_for(devices[0].device_kind) if tpu else None
    if slot_shapes and tpu:
        report["slot_step_time"] = aot.slot_step_time(run, slot_shapes, chip)
    report["transients"] = aot.transients(run, programs)
    report["sync_route"] = aot.sync_route(run)
    if tpu and set(programs) & set(PROGRAMS):  # the model of an RL iteration
        shape = plan.run_shape(m)
        estimate = step_time.estimate(step_time.ModelShape.of(run.arch), shape, chip)
        report["step_time"] = dict(run_shape=dataclasses.asdict(shape), **estimate)
    return report


def _compile(program: aot.Program, other: int) -> dict:
    t0 = time.perf_counter()
    with jax.set_mesh(program.mesh):
        done = program.spec.lower().compile()
    stats = _stats(done, time.perf_counter() - t0, other)
    print(f"  compiled {program.name} in {stats['compile_s']} s", flush=True)
    return stats


def compile_roles(
    spec, devices, local, sampler_hosts: int, only: tuple[str, ...] = (), slices: tuple[list, list] | None = None
) -> dict:
    """Compiles a disaggregated run (`aot.role_programs`) of ``spec`` on ``devices``: the sampler
    group's programs on a sampler host's mesh, the learner group's on the learner hosts' devices, the
    weight push over the whole slice (``only``: these programs alone); ``slices``: (sampler, learner)
    devices of two slices of their own instead of parts of ``devices`` (the push then crosses the
    data-center network: its learner-side gather is compiled, its time modelled at the DCN
    bandwidth). Returns the report (``roles``: per role, its programs' stats)."""
    hosts = sorted({d.process_index for d in devices})
    layout = plan_lib.HostLayout.of(spec, len(hosts), len(devices), len(devices) // len(hosts))
    plan = plan_lib.plan(spec, layout)
    s_plan, l_plan = aot.role_plans(spec, plan, sampler_hosts)
    if slices is None:
        learn_devices, sampler_devices = aot.role_devices(devices, sampler_hosts)
    else:
        aot.role_slices(devices, sampler_hosts, *slices)
        sampler_devices, learn_devices = slices
    runs = dict(
        sampler=aot.abstract_run(spec, s_plan, sampler_devices, local),
        learner=aot.abstract_run(spec, l_plan, learn_devices, local),
    )
    whole = None if slices else aot.abstract_run(spec, plan, devices, local)
    programs, resident = aot.role_programs(runs["sampler"], runs["learner"], whole)
    report = dict(
        **_slice_fields(devices, hosts),
        sampler_hosts=sampler_hosts,
        learner_hosts=len(hosts) - sampler_hosts,
        meshes=dict(
            sampler=dict(runs["sampler"].local_mesh.shape),
            learner=dict(zip(("data", "fsdp", "tensor"), l_plan.layout.mesh_shape)),
            learner_host=dict(runs["learner"].local_mesh.shape),
            push=dict((whole or runs["learner"]).mesh.shape),
        ),
        push_link="DCN" if slices else "ICI",
        model=dict(preset=spec.model.preset, params=runs["learner"].num_params, remat=spec.model.remat),
        shapes=dict(sampler=aot.shapes(runs["sampler"]), learner=aot.shapes(runs["learner"])),
        resident_bytes_per_chip=dict(learner=runs["learner"].resident),
        roles={},
    )
    done: dict[str, dict] = {}
    for role, progs in programs.items():
        report["roles"][role] = {}
        for p in progs:
            if only and p.name not in only:
                continue
            if p.same_as and p.same_as in done:
                report["roles"][role][p.name] = dict(done[p.same_as], same_as=p.same_as)
                continue
            if p.spec is None:
                continue
            try:
                stats = _compile(p, sum(resident[k] for k in p.other))
            except jax.errors.JaxRuntimeError as e:
                if "should include all slice devices" not in str(e):
                    raise
                # libtpu on slices with limited ICI routing (v5e:8x8) compiles only over the whole slice
                raise ValueError(
                    f"--roles: {p.name} of the {role} group cannot be compiled on {len(p.mesh.devices.flat)} of the "
                    f"slice's {len(devices)} chips: libtpu needs every device of this slice in a program (limited "
                    "ICI routing); put the roles on slices of their own (--role_topologies=SAMPLER,LEARNER)"
                ) from None
            report["roles"][role][p.name] = done[p.name] = stats
    if devices[0].platform != "cpu":
        chip = step_time.chip_for(devices[0].device_kind)
        shape = plan.run_shape(spec.model)
        # the push crosses the data-center network when the slice is several slices or the roles are slices apart
        across = slices is not None or len({getattr(d, "slice_index", 0) for d in devices}) > 1
        dcn = step_time.DCN_BYTES_PER_S_PER_HOST if across else None
        report["step_time"] = step_time.async_iteration(
            step_time.ModelShape.of(runs["learner"].arch), shape, chip, sampler_hosts, dcn_bytes_per_s_per_host=dcn
        )
    return report


def resolve_auto_remat(spec, devices) -> tuple:
    """``model.remat="auto"`` resolved by the run plan at this topology's HBM (`plan.resolve_remat`):
    the spec with that policy and the report's ``remat_auto`` (``resolved``, ``hbm_bytes``,
    ``cutoff_bytes``, each policy's estimated ``bytes`` per chip and share of HBM); the spec unchanged
    and None for any other ``model.remat``."""
    if spec.model.remat != build.REMAT_AUTO:
        return spec, None
    hosts = sorted({d.process_index for d in devices})
    layout = plan_lib.HostLayout.of(spec, len(hosts), len(devices), len(devices) // len(hosts))
    hbm = hbm_bytes(devices[0])
    p = plan_lib.plan(spec, layout, hbm_bytes=hbm)
    info = dict(p.remat_estimate, resolved=p.remat)
    info["fraction_of_hbm"] = {k: round(v / hbm, 4) for k, v in info["bytes"].items()}
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, remat=p.remat)), info


def remat_search(spec, devices, local, budget: float) -> dict:
    """``ppo_grad`` compiled under each ``model.remat`` policy (`aot.REMAT_ORDER`) on ``devices``: per
    policy its per-chip total (the larger of the compiler's peak and arguments + outputs + temporaries
    - aliased, plus the resident arrays beside it), share of HBM, FLOPs and compile
    seconds (``compiles`` False with the compiler's ``error`` where libtpu refuses it for HBM), and
    ``chosen`` (`aot.choose_remat` at ``budget`` of HBM: the least recompute that fits);
    beside it the run plan's estimate (``estimate``: `plan.remat_estimate` per policy and share of HBM,
    ``estimate_chosen``: what ``model.remat="auto"`` resolves to, `plan.resolve_remat`, and
    ``estimate_matches_compile``)."""
    hosts = sorted({d.process_index for d in devices})
    layout = plan_lib.HostLayout.of(spec, len(hosts), len(devices), len(devices) // len(hosts))
    hbm = hbm_bytes(devices[0])
    full = dataclasses.replace(spec, model=dataclasses.replace(spec.model, remat="full"))
    estimate = plan_lib.remat_estimate(full, plan_lib.plan(full, layout))
    out = {}
    for policy in aot.REMAT_ORDER:
        s = dataclasses.replace(spec, model=dataclasses.replace(spec.model, remat=policy))
        run = aot.abstract_run(s, plan_lib.plan(s, layout), devices, local)
        (grad,) = [p for p in aot.abstract_programs(run, ("ppo_grad",))[0] if p.name == "ppo_grad"]
        other = sum(run.resident[k] for k in grad.other)
        try:
            stats = _compile(grad, other)
        except jax.errors.JaxRuntimeError as e:
            # libtpu refuses a program whose temporaries exceed the chip: that policy does not fit
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            found = re.search(r"HLO temporaries \(([\d.]+)G\)", str(e))
            out[policy] = dict(
                compiles=False,
                error=str(e).splitlines()[0][:300],
                temp_gib_reported=float(found.group(1)) if found else None,
            )
            print(f"  ppo_grad under remat {policy} does not fit: {out[policy]['error']}", flush=True)
            continue
        # XLA:CPU's peak leaves out the temporaries; the static sum bounds what the program holds at once
        held = stats["argument_bytes"] + stats["output_bytes"] + stats["temp_bytes"] - stats["alias_bytes"]
        total = max(stats["peak_bytes_per_chip"], held) + other
        out[policy] = dict(
            compiles=True,
            total_bytes_per_chip=total,
            temp_bytes=stats["temp_bytes"],
            fraction_of_hbm=round(total / hbm, 4),
            flops=stats["flops"],
            compile_s=stats["compile_s"],
        )
    totals = {k: v["total_bytes_per_chip"] for k, v in out.items() if v["compiles"]}
    chosen = aot.choose_remat(totals, budget * hbm)
    guess = plan_lib.resolve_remat(estimate, hbm)
    return dict(
        policies=out,
        configured=str(spec.model.remat),
        chosen=chosen,
        estimate={k: dict(bytes_per_chip=int(v), fraction_of_hbm=round(v / hbm, 4)) for k, v in estimate.items()},
        estimate_cutoff_fraction=plan_lib.REMAT_AUTO_BUDGET,
        estimate_chosen=guess,
        estimate_matches_compile=guess == chosen,
    )


def print_report(report: dict, setting: str, name: str) -> None:
    """The report as a table: each program's memory, FLOPs and compile time, the transients, the step-time model."""
    hbm = report["hbm_bytes_per_chip"]
    gib = lambda b: f"{b / GiB:7.2f}"  # noqa: E731
    print(f"\n{setting} on {name}: HBM {hbm / GiB:.1f} GiB per chip, budget {_BUDGET.value:.0%}")
    print(
        f"{'program':11s} {'peak':>7s} {'args':>7s} {'temp':>7s} {'out':>7s} {'+resid':>7s} {'total':>7s}  {'HBM':>5s}  {'TFLOP':>7s}  {'compile':>7s}  collectives (memory in GiB per chip)"
    )
    for k, p in report["programs"].items():
        coll = "?" if p["collectives"] is None else " ".join(f"{n}={v}" for n, v in p["collectives"].items() if v)
        print(
            f"{k:11s} {gib(p['peak_bytes_per_chip'])} {gib(p['argument_bytes'])} {gib(p['temp_bytes'])} "
            f"{gib(p['output_bytes'])} {gib(p['other_resident_bytes'])} {gib(p['total_bytes_per_chip'])}  "
            f"{p['fraction_of_hbm']:5.0%}  {p['flops'] / 1e12:7.2f}  {p['compile_s']:6.1f}s  {coll}"
        )
    for k, t in report["transients"].items():
        print(
            f"{k:11s} {'':55s} {gib(t['bytes_per_chip'])}  {t['fraction_of_hbm']:5.0%}  (not a program: see the module doc)"
        )
    if "step_time" in report:
        st = report["step_time"]
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in st["stages_s"].items())
        print(
            f"\nstep-time model (roofline, {st['chip']['name']}): {st['iteration_s']:.0f} s per iteration ({stages}); "
        )
        print(f"{st['iterations']} iterations: {st['run_hours']:.1f} h, {st['chip_hours']:.0f} chip-hours")
        print(
            f"with drawn response lengths (step_time.rollout_model): rollout {st['rollout_s_lockstep']:.1f} s lockstep, "
            f"{st['rollout_s_continuous']:.1f} s continuous (speedup {st['speedup_continuous_rollout']:.2f}x); "
            f"iteration {st['iteration_s_lockstep']:.0f} / {st['iteration_s_continuous']:.0f} s, "
            f"{st['iterations']} iterations {st['run_hours_lockstep']:.1f} / {st['run_hours_continuous']:.1f} h"
        )
    if "slot_step_time" in report:
        st = report["slot_step_time"]
        each = ", ".join(f"{k} {v['seconds'] * 1e3:.1f} ms" for k, v in st["programs"].items())
        print(
            f"\nslot programs' roofline ({st['chip']['name']}): {each}; {st['decode_tokens_per_s_per_host']:.0f} tokens/s a host"
        )
    print(f"fits: {report['fits']}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    name = _TOPOLOGY.value
    if name.startswith("cpu:") and name[4:].isdigit() and int(name[4:]) > 0:
        jax.config.update("jax_num_cpu_devices", int(name[4:]))  # before the CPU backend starts
    try:
        devices = topology_devices(name, _SLICES.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    c = _CONFIG.value
    if _ROLE_TOPOLOGIES.value and not _ROLES.value:
        raise app.UsageError("--role_topologies needs --roles=sampler:S,learner:L")
    if _ROLES.value:
        known = sum(aot.ROLE_PROGRAMS.values(), ())
        if set(_PROGRAMS.value) - set(known):
            raise app.UsageError(
                f"--programs with --roles: unknown {sorted(set(_PROGRAMS.value) - set(known))}; expected some of {known}"
            )
        return _main_roles(name, devices)
    programs = tuple(_PROGRAMS.value) or PROGRAMS
    known = PROGRAMS + SFT_PROGRAMS + SLOT_PROGRAMS + PACKED_PROGRAMS
    unknown = sorted(set(programs) - set(known))
    if unknown:
        raise app.UsageError(f"--programs: unknown {unknown}; expected some of {known}")
    print(f"{name}: {len(devices)} x {devices[0].device_kind}; compiling {', '.join(programs)}", flush=True)
    try:
        spec, auto = resolve_auto_remat(build.build_spec(c, num_devices=len(devices), abstract=True), devices)
        if auto:
            each = ", ".join(f"{k} {v:.0%}" for k, v in auto["fraction_of_hbm"].items())
            print(f"model.remat=auto -> {auto['resolved']} (estimated update per chip: {each} of HBM)", flush=True)
        report = compile_all(spec, devices, host_devices(name, devices), programs)
    except config_lib.ConfigError as e:
        raise app.UsageError(f"{e} (on {len(devices)} devices of --topology={name})") from None
    if auto:
        report["remat_auto"] = auto  # the compile below checks the resolved policy (`fits`)
    if _REMAT_SEARCH.value:
        report["remat_search"] = remat_search(spec, devices, host_devices(name, devices), _BUDGET.value)
        rs = report["remat_search"]
        each = ", ".join(
            f"{k} {v['total_bytes_per_chip'] / GiB:.2f} GiB" if v["compiles"] else f"{k} out of HBM"
            for k, v in rs["policies"].items()
        )
        print(
            f"ppo_grad per remat policy: {each}; the least recompute that fits: {rs['chosen']}; "
            f"the plan's estimate picks {rs['estimate_chosen']}"
        )
    report["topology"], report["num_slices"] = name, _SLICES.value
    hbm = report["hbm_bytes_per_chip"]
    report["budget_fraction"] = _BUDGET.value
    for p in report["programs"].values():
        p["fraction_of_hbm"] = round(p["total_bytes_per_chip"] / hbm, 4)
    report["transients"] = {
        k: dict(bytes_per_chip=v, fraction_of_hbm=round(v / hbm, 4)) for k, v in report["transients"].items()
    }
    peaks = [*report["programs"].values(), *report["transients"].values()]
    report["fits"] = all(p["fraction_of_hbm"] <= _BUDGET.value for p in peaks)
    for apply in ("ppo_apply", "sft_apply"):
        if apply in report["programs"]:
            mesh = report["mesh"]  # parameters split over fsdp x tensor, replicated over data (slices)
            share = report["model"]["params"] / (mesh["fsdp"] * mesh["tensor"])
            report[f"{apply}_argument_bytes_per_param"] = round(report["programs"][apply]["argument_bytes"] / share, 2)

    report["jax_version"] = jax.__version__
    setting = os.path.splitext(os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"])))[0]
    report["config"] = setting
    # the command's --config.<field>=<value> overrides, so a check can compile the same setting again
    report["overrides"] = dict(
        a[len("--config.") :].split("=", 1) for a in sys.argv if a.startswith("--config.") and "=" in a
    )
    print_report(report, setting, name)
    slices = f"{_SLICES.value}x" if _SLICES.value > 1 else ""
    # beside, not over, the run's report
    kinds = (("__sft", SFT_PROGRAMS), ("__slots", SLOT_PROGRAMS), ("__packed", PACKED_PROGRAMS))
    warm = next((suffix for suffix, names in kinds if set(programs) <= set(names)), "")
    write_json(os.path.join(_OUT.value, f"{setting}__{slices}{name.replace(':', '-')}{warm}.json"), report, indent=1)
    if _REMAT_SEARCH.value:  # on its own too, in a folder the committed-report checks do not read
        keep = ("config", "topology", "num_slices", "overrides", "device_kind", "hbm_bytes_per_chip", "mesh", "shapes")
        search = dict({k: report[k] for k in keep}, budget_fraction=_BUDGET.value, **report["remat_search"])
        write_json(
            os.path.join(_OUT.value, "remat", f"{setting}__{slices}{name.replace(':', '-')}.json"), search, indent=1
        )
    if not report["fits"]:
        sys.exit(1)


def _main_roles(name: str, devices: list) -> None:
    """``--roles``: compile the disaggregated run, report per role, exit 1 when a role does not fit."""
    try:
        sampler_hosts = parse_roles(_ROLES.value, len({d.process_index for d in devices}))
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    slices = None
    if _ROLE_TOPOLOGIES.value:
        if len(_ROLE_TOPOLOGIES.value) != 2:
            raise app.UsageError(
                f"--role_topologies={','.join(_ROLE_TOPOLOGIES.value)}: expected SAMPLER_TOPOLOGY,LEARNER_TOPOLOGY"
            )
        try:
            slices = tuple(topology_devices(t) for t in _ROLE_TOPOLOGIES.value)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    where = f" on slices {', '.join(_ROLE_TOPOLOGIES.value)}" if slices else ""
    print(f"{name}: {len(devices)} x {devices[0].device_kind}; roles {_ROLES.value}{where}", flush=True)
    try:
        spec, auto = resolve_auto_remat(
            build.build_spec(_CONFIG.value, num_devices=len(devices), abstract=True), devices
        )
        only = tuple(_PROGRAMS.value)
        report = compile_roles(spec, devices, host_devices(name, devices), sampler_hosts, only, slices)
    except (config_lib.ConfigError, ValueError) as e:
        raise app.UsageError(f"{e} (--roles={_ROLES.value} on --topology={name})") from None
    report["topology"], report["num_slices"] = name, _SLICES.value
    if auto:
        report["remat_auto"] = auto
    if slices:
        report["role_topologies"] = dict(zip(("sampler", "learner"), _ROLE_TOPOLOGIES.value))
    hbm = report["hbm_bytes_per_chip"]
    report["budget_fraction"] = _BUDGET.value
    for progs in report["roles"].values():
        for p in progs.values():
            p["fraction_of_hbm"] = round(p["total_bytes_per_chip"] / hbm, 4)
    report["fits"] = {
        role: all(p["fraction_of_hbm"] <= _BUDGET.value for p in progs.values())
        for role, progs in report["roles"].items()
    }
    report["jax_version"] = jax.__version__
    setting = os.path.splitext(os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"])))[0]
    report["config"] = setting
    report["overrides"] = dict(
        a[len("--config.") :].split("=", 1) for a in sys.argv if a.startswith("--config.") and "=" in a
    )
    print(
        f"\n{setting} on {name}, {report['sampler_hosts']} sampler + {report['learner_hosts']} learner hosts "
        f"(memory in GiB per chip, HBM {hbm / GiB:.1f}, budget {_BUDGET.value:.0%})"
    )
    for role, progs in report["roles"].items():
        for k, p in progs.items():
            print(
                f"{role:8s} {k:12s} total {p['total_bytes_per_chip'] / GiB:7.2f}  {p['fraction_of_hbm']:5.0%}  "
                f"compile {p['compile_s']:6.1f}s"
            )
    if "step_time" in report:
        a = report["step_time"]
        print(
            f"step-time floor: sampler {a['sampler_s']:.0f} s, learner {a['learner_s']:.0f} s, push {a['push_s']:.2f} s; "
            f"iteration {a['iteration_s']:.0f} s vs synchronous {a['synchronous_s']:.0f} s"
        )
    print(f"fits: {report['fits']}")
    slices = f"{_SLICES.value}x" if _SLICES.value > 1 else ""
    stem = f"{setting}__{slices}{name.replace(':', '-')}__roles-{report['sampler_hosts']}s{report['learner_hosts']}l"
    write_json(os.path.join(_OUT.value, f"{stem}.json"), report, indent=1)
    if not all(report["fits"].values()):
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
