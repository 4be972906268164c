"""Compile every program of a run for a device topology from abstract shapes: does a config fit?

    python -m launch.aot --config=configs/alfworld_qwen2_5_1_5b.py --topology=v5e:4x4
    python -m launch.aot --config=configs/alfworld_qwen2_5_7b.py --topology=v5e:8x8 --config.ppo.micro_batch_rows=4
    python -m launch.aot --topology=cpu:8                       # the CPU default on 8 emulated CPU devices

No weights and no data: the actor is built with ``nnx.eval_shape`` at the config's sizes and dtypes,
every argument is a ``jax.ShapeDtypeStruct`` carrying the ``NamedSharding`` the trainer gives it, and
each program is the library's own ``ProgramSpec`` (``learner.step_specs``, ``ppo.logprobs_spec``,
``sampling.prefill_spec`` / ``decode_spec``: the objects the trainer runs), and
``spec.lower().compile()`` runs the target's own compiler. A TPU topology
(``v5e:4x4``, ``v5e:8x8``, ``v5p:2x2x4``, ``v4:2x2x4``, ``v6e:4x4``, ...) needs libtpu
(``pip install -e ".[tpu]"``), not a TPU: ``jax.experimental.topologies`` describes the slice on any
machine. ``cpu:N`` compiles for N CPU devices of this machine (for tests).

Programs (the ones a run compiles, at their largest shapes):
  ppo_grad   the micro-batch gradient (``learner``'s accumulate: forward, PPO loss, backward)
  ppo_apply  the optimizer update (fp32 master weights and AdamW moments)
  logprobs   the old / reference log-prob pass of a micro-batch (host-local parameter copy)
  prefill    the sampler's prefill and first token, largest batch and prompt bucket
  decode     the sampler's decode loop over ``sampler.max_new_tokens`` from that cache
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

The continuous scheduler's slot programs (``rollout.scheduler="continuous"``, ``slots.SlotSampler``) on
request only (``--programs=insert_1,insert,decode_chunk``), on the host's sampler mesh with the slot state
(NS = ``rollout.num_slots`` or the host's games capped at the largest batch bucket, rounded up to the
mesh's batch shards; S = T_max + M) sharded by ``slots.slot_shardings`` and donated; the report is
``<config>__<topology>__slots.json``:
  insert_1   one prompt prefilled (padded to its batch bucket) at T_max and written into its slot
  insert     every slot's prompt at once (the first turn), same T_max
  decode_chunk  ``rollout.chunk_steps`` decode steps of every slot (the ``while_loop`` with early exit)
Each reports ``slot_state_bytes`` (a chip's share of the donated state) and ``slot_state_aliased``
(``alias_bytes`` covers it: donation worked, the cache is updated in place); ``insert`` is
``same_as: insert_1`` when both batches are one bucket. ``slot_step_time`` holds `bipace_jax.step_time`'s
roofline of each insert, of one dense decode step (every slot reads all S columns) and of a chunk of
them (TPU topologies).

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
from flax import nnx
from jax.experimental import topologies
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags

from bipace_jax import build, learner, ppo, sampling, sft, sharding, slots, step_time
from bipace_jax import config as config_lib
from bipace_jax.batch import abstract_micro_batch
from bipace_jax.estimators import StepBatch
from bipace_jax.estimators.core import jitted_advantages
from bipace_jax.programs import ProgramSpec, abstract
from launch import cli
from launch._common import ROOT, write_json

_CONFIG = cli.define_config_file("config", os.path.join(ROOT, "configs", "textcraft_tiny.py"), "Run config.")
_TOPOLOGY = flags.DEFINE_string("topology", "cpu:8", "TPU topology (e.g. v5e:4x4, v5p:2x2x4) or cpu:N.")
_OUT = flags.DEFINE_string(
    "out", os.path.join("runs", "aot"), "Folder of the JSON report (--out=benchmarks/aot updates the committed ones)."
)
_BUDGET = flags.DEFINE_float("budget", 0.9, "Largest fraction of a chip's HBM a program may use.")
_PROGRAMS = flags.DEFINE_list("programs", "", "Compile only these programs (default: all).")
_SLICES = flags.DEFINE_integer(
    "num_slices", 1, "TPU slices joined over the data-center network (multi-slice: data parallel across them)."
)

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
#: The warm start's programs: compiled only when ``--programs`` names them.
SFT_PROGRAMS = ("sft_grad", "sft_apply")
#: The continuous scheduler's slot programs (``slots.insert_spec`` / ``decode_chunk_spec``): on request only.
SLOT_PROGRAMS = ("insert_1", "insert", "decode_chunk")
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


def _bucket(rows: int, buckets, dp_local: int) -> int:
    """The sampler's batch for ``rows`` prompts: the first bucket that holds them (more are served in
    chunks of the largest), rounded up to the host's row shards."""
    b = next((b for b in buckets if b >= rows), buckets[-1])
    return -(-b // dp_local) * dp_local


def _bytes_per_chip(tree) -> int:
    """Bytes of one device's shard of every array of ``tree`` (ShapeDtypeStructs with shardings)."""
    return int(
        sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
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


def _slot_programs(c, report, run, programs, local_mesh, graphdef, state, static, table, num_eos, games, other) -> None:
    """Compiles the slot programs (`SLOT_PROGRAMS`) on the host's sampler mesh into ``report``."""
    s_cfg = build.sampler_config(c)
    dp_local = local_mesh.shape["data"] * local_mesh.shape["fsdp"]
    n_slots = c.rollout.num_slots or min(games, s_cfg.batch_buckets[-1])  # as `rollout._play_continuous`
    rows = -(-n_slots // dp_local) * dp_local  # as `SlotSampler.rows`
    abs_slots = slots.abstract_slots(graphdef, state, static, rows, table[0], local_mesh)
    rep = jax.sharding.NamedSharding(local_mesh, P())
    consts = (
        jax.ShapeDtypeStruct(table, jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((table[0],), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((num_eos,), jnp.int32, sharding=rep),
    )
    t_max = static.cache_length - static.max_new_tokens
    state_bytes = _bytes_per_chip(abs_slots)
    one, every = _bucket(1, s_cfg.batch_buckets, dp_local), _bucket(n_slots, s_cfg.batch_buckets, dp_local)
    report["shapes"].update(
        slots=rows, slot_cache_columns=static.cache_length, chunk_steps=c.rollout.chunk_steps,
        insert_1_batch=one, insert_batch=every, slot_state_bytes_per_chip=state_bytes,
    )  # fmt: skip
    specs = dict(
        insert_1=slots.insert_spec(
            graphdef, state, static, abs_slots, batch=one, prompt_len=t_max, consts=consts, mesh=local_mesh
        ),
        insert=slots.insert_spec(
            graphdef, state, static, abs_slots, batch=every, prompt_len=t_max, consts=consts, mesh=local_mesh
        ),
        decode_chunk=slots.decode_chunk_spec(
            graphdef, state, static, abs_slots, chunk=c.rollout.chunk_steps, consts=consts, mesh=local_mesh
        ),
    )
    for name, spec in specs.items():
        if name == "insert" and name in programs and every == one and "insert_1" in report["programs"]:
            report["programs"]["insert"] = dict(report["programs"]["insert_1"], same_as="insert_1")  # one program
        elif run(name, local_mesh, spec, other=other) is not None:
            p = report["programs"][name]
            p["slot_state_bytes"] = state_bytes
            p["slot_state_aliased"] = p["alias_bytes"] >= state_bytes


def _slot_step_time(c, report, cfg, devices, hosts: int, local_mesh) -> dict:
    """`step_time.program_costs` at the slot shapes: an insert (prefill at T_max) per batch, and one dense
    decode step, where every slot reads all S = T_max + M cache columns, and a chunk of them."""
    sh = report["shapes"]
    t_max, m = sh["prompt_tokens"], sh["response_tokens"]
    base = step_time.RunShape(
        chips=len(devices), hosts=hosts, fsdp=1, tensor=local_mesh.shape["tensor"],
        sampler_tensor=local_mesh.shape["tensor"], prompt_tokens=t_max, response_tokens=m,
        games_per_host=sh["slots"], turns=c.env.max_steps, micro_batch_rows=1, logprob_rows_per_host=1,
        mini_batch_rows=1,
    )  # fmt: skip
    model, chip = step_time.ModelShape.of(cfg), step_time.chip_for(devices[0].device_kind)
    out = dict(chip=dataclasses.asdict(chip), run_shape=dataclasses.asdict(base), programs={})
    for name in ("insert_1", "insert"):
        r = dataclasses.replace(base, games_per_host=sh[f"{name}_batch"])
        out["programs"][name] = step_time.program_costs(model, r)["prefill"].seconds(chip)
    # program_costs' decode step attends to prompt + M/2 columns on average; a dense slot reads all S
    r = dataclasses.replace(base, prompt_tokens=t_max + m - m // 2)
    step = step_time.program_costs(model, r)["decode_step"].seconds(chip)
    out["programs"]["decode_step"] = step
    out["programs"]["decode_chunk"] = {k: v * sh["chunk_steps"] if k.endswith("_s") else v for k, v in step.items()}
    out["programs"]["decode_chunk"]["seconds"] = step["seconds"] * sh["chunk_steps"]
    out["decode_tokens_per_s_per_host"] = sh["slots"] / step["seconds"]
    return out


def compile_all(c, devices, local, programs=PROGRAMS) -> dict:
    """Compiles ``programs`` of config ``c`` for ``devices`` (``local``: one host's, `host_devices`);
    returns the report (see the module doc)."""

    m = c.model
    hosts = sorted({d.process_index for d in devices})
    data, fsdp, tensor = config_lib.process_layout(c, len(hosts), len(devices), len(local))
    mesh = sharding.make_mesh(data, fsdp, tensor, devices=devices)
    placement = sharding.check_placement(mesh)  # as the trainer: tensor groups in a host, disjoint batch blocks
    # As `distributed.local_mesh`: a host samples on its own chips, tensor-parallel by
    # `config.mesh.sampler_tensor` (``local``: one host's topology, its devices numbered from 0)
    t_local = config_lib.sampler_tensor(c, len(hosts), len(devices), len(local))
    local_mesh = mesh if len(hosts) == 1 and t_local == tensor else sharding.make_mesh(-1, 1, t_local, devices=local)
    cfg = build.actor_architecture(c.model, m.vocab_size)
    dtype, param_dtype = jnp.dtype(m.dtype), jnp.dtype(m.param_dtype)
    actor = nnx.eval_shape(lambda: build.init_actor(c.model, cfg, seed=c.seed))
    graphdef, params, rest = nnx.split(actor, nnx.Param, ...)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    master = abstract(params, sharding.param_shardings(params, mesh))
    # The sampler's and the reference's host-local copies (the global parameters themselves on one host).
    local_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)  # copies in compute dtype
    local_params = abstract(local_params, sharding.param_shardings(local_params, local_mesh))
    tx = build.make_optimizer(c.optim)
    opt_shardings = learner.opt_state_shardings(tx, master, sharding.param_shardings(params, mesh), mesh)
    opt_state = abstract(jax.eval_shape(tx.init, master), opt_shardings)

    s = build.sampler_config(c, eos_token_ids=cfg.eos_token_ids)
    prompt = next(b for b in s.length_buckets if b >= c.rollout.max_prompt_length)
    response = s.max_new_tokens
    rows = c.ppo.micro_batch_rows * len(hosts)
    games = c.rollout.num_groups // len(hosts) * c.rollout.group_size
    dp_local = local_mesh.shape["data"] * local_mesh.shape["fsdp"]
    batch = _bucket(games, s.batch_buckets, dp_local)
    validating = bool(c.val.every or c.val.at_start)
    panel = max(c.val.num_tasks, c.val.num_holdout_tasks) * c.val.seeds_per_goal  # goals x seeds, at most
    val_rows = -(-panel * c.val.group_size // len(hosts)) if validating else 0
    # one host with equal dtypes: the sampler's copy is the master parameters themselves
    separate = len(hosts) > 1 or dtype != param_dtype
    resident = dict(
        params=_bytes_per_chip(master),
        opt_state=_bytes_per_chip(opt_state),
        reference=_bytes_per_chip(local_params) if c.ppo.kl_coef > 0 else 0,
        sampler_params=_bytes_per_chip(local_params) if separate else 0,
    )
    # programs on the host-local copy: the rest of the long-lived state stays resident meanwhile
    host_other = ("params", "opt_state", "reference") if separate else ("opt_state", "reference")
    report = dict(
        topology=None,
        chips=len(devices),
        hosts=len(hosts),
        device_kind=devices[0].device_kind,
        hbm_bytes_per_chip=hbm_bytes(devices[0]),
        param_dtype=str(param_dtype),
        compute_dtype=str(dtype),
        mesh=dict(data=data, fsdp=fsdp, tensor=tensor),
        placement=placement,
        sampler_mesh=dict(local_mesh.shape),
        model=dict(
            preset=m.preset, params=n_params, layers=cfg.num_hidden_layers, remat=m.remat, scan_layers=m.scan_layers
        ),
        shapes=dict(
            prompt_tokens=prompt,
            response_tokens=response,
            micro_batch_rows=rows,
            mini_batch_rows=c.ppo.mini_batch_rows,
            sampler_batch=batch,
            estimator_rows=games * c.env.max_steps,
            logprob_chunk=c.ppo.logprob_chunk,
        ),
        resident_bytes_per_chip=resident,
        programs={},
    )

    def run(name, mesh_, spec: ProgramSpec, other=()):
        if name not in programs:
            return None
        t0 = time.perf_counter()
        with jax.set_mesh(mesh_):
            compiled = spec.lower().compile()
        report["programs"][name] = _stats(compiled, time.perf_counter() - t0, sum(resident[k] for k in other))
        print(f"  compiled {name} in {report['programs'][name]['compile_s']} s", flush=True)
        return compiled

    def sampler_programs(pre: ProgramSpec, prefill: str, decode: str) -> None:
        """Compile a prefill spec and the decode loop that continues from its outputs."""
        compiled = run(prefill, local_mesh, pre, other=host_other)
        if decode in programs:
            with jax.set_mesh(local_mesh):
                lowered = pre.lower()
                compiled = compiled or lowered.compile()
            first = abstract(lowered.out_info, compiled.output_shardings)
            run(decode, local_mesh, sampling.decode_spec(pre, first), other=host_other)

    # The library's own program specs at the run's largest shapes: what compiles here is what runs.
    objective = ppo.PPOObjective(
        build.loss_config(c), c.ppo.old_logprobs == "fused", cfg.vocab_size, c.ppo.logprob_chunk
    )
    mb = abstract_micro_batch(mesh, rows, prompt, response, reference=c.ppo.kl_coef > 0)
    step = learner.step_specs(graphdef, objective, tx, mesh, master, rest, opt_state, mb, ppo.STAT_KEYS)
    # `PPOLearner.update` frees the sampler copy for its steps (`Learner.release_local`)
    run("ppo_grad", mesh, step["accumulate"], other=("opt_state", "reference"))
    run("ppo_apply", mesh, step["apply"], other=("reference",))
    if set(SFT_PROGRAMS) & set(programs):
        # the warm start keeps no reference and frees its sampler copy for its steps (`sft._WarmStart.train`)
        sft_step = sft.sft_step_specs(graphdef, tx, mesh, master, rest, opt_state, rows, prompt + response, response)
        run("sft_grad", mesh, sft_step["accumulate"], other=("opt_state",))
        run("sft_apply", mesh, sft_step["apply"])

    lrows = -(-c.ppo.micro_batch_rows // dp_local) * dp_local
    lmb = abstract_micro_batch(local_mesh, lrows, prompt, response, logprobs=False)
    run("logprobs", local_mesh, ppo.logprobs_spec(graphdef, objective, local_params, rest, lmb), other=host_other)

    static = sampling.StaticSettings.of(s, prompt, pad_id=0, support=cfg.vocab_size)
    q = max([len(x.encode("utf-8")) for x in s.stop_strings], default=1)
    gdef_s, state_s = nnx.split(actor)  # the sampler merges the whole actor from one state
    state_s = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), state_s)
    state = abstract(state_s, sharding.param_shardings(state_s, local_mesh))
    table = (len(s.stop_strings), q, cfg.vocab_size)
    pre = sampling.prefill_spec(
        gdef_s, state, static, local_mesh, batch=batch, stop_table_shape=table, num_eos=len(cfg.eos_token_ids)
    )
    sampler_programs(pre, "prefill", "decode")
    # Validation: each panel is one sampler call per turn over the rows this host plays, as the trainer
    # sizes them (ceil(panel x val.group_size / hosts)), bucketed like the rollout's
    val_batch = _bucket(val_rows, s.batch_buckets, dp_local)
    report["shapes"]["val_rows_per_host"], report["shapes"]["val_sampler_batch"] = val_rows, val_batch
    if val_batch == batch:  # the same shapes: the rollout's programs serve validation
        for name, same in (("val_prefill", "prefill"), ("val_decode", "decode")):
            if same in report["programs"] and name in programs:
                report["programs"][name] = dict(report["programs"][same], same_as=same)
    elif val_rows:
        vpre = sampling.prefill_spec(
            gdef_s, state, static, local_mesh, batch=val_batch, stop_table_shape=table, num_eos=len(cfg.eos_token_ids)
        )
        sampler_programs(vpre, "val_prefill", "val_decode")

    if set(SLOT_PROGRAMS) & set(programs):
        # the trainer's long-lived arrays stay resident during a rollout, as for prefill / decode
        slot_args = (gdef_s, state, static, table, len(cfg.eos_token_ids), games, host_other)
        _slot_programs(c, report, run, programs, local_mesh, *slot_args)
        if devices[0].platform != "cpu":
            report["slot_step_time"] = _slot_step_time(c, report, cfg, devices, len(hosts), local_mesh)

    ecfg = build.estimator_config(c)
    fn, scalars = jitted_advantages(ecfg)
    n = games * c.env.max_steps
    one = jax.sharding.SingleDeviceSharding(local[0])

    def vec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=one)

    steps = StepBatch(
        group_id=vec((n,), jnp.int32),
        traj_id=vec((n,), jnp.int32),
        step=vec((n,), jnp.int32),
        reward=vec((n,), jnp.float32),
        obs_hash=vec((n,), jnp.int32),
        fingerprint=vec((n, cfg.hidden_size), jnp.float32),
        action_key=vec((n,), jnp.int32),
        mask=vec((n,), jnp.bool_),
        penalty=vec((n,), jnp.float32),
        group_capacity=c.rollout.num_groups // len(hosts),
        row_capacity=-(-c.rollout.group_size * c.env.max_steps // 16) * 16,
    )
    scalars = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=one) for x in scalars)
    estimator = ProgramSpec("estimator", fn, (steps, *scalars))
    run("estimator", jax.sharding.Mesh(np.array(local[:1]), ("data",)), estimator, other=tuple(resident))

    # `Learner.sync_local`: with another tensor size on the host than in training, each array comes
    # whole to every chip by one all-gather over the slice, then a host-local slice (the `local_copy`
    # replica route); compiled at the largest array, so libtpu's routing of it is proven too.
    replica = separate and t_local != tensor
    leaves = jax.tree.leaves(master)
    big = max(leaves, key=lambda x: int(np.prod(x.shape)))
    whole = int(np.prod(big.shape)) * dtype.itemsize
    if replica:
        gather = jax.jit(lambda x: x.astype(dtype), out_shardings=jax.sharding.NamedSharding(mesh, P()))
        run("sync_gather", mesh, ProgramSpec("sync_gather", gather, (big,)), other=tuple(resident))
    # Peaks no compiled program shows: the new sampler copy is built (the old one freed first), by the
    # replica route one array at a time through its whole replica, and the fp32 gradient
    # accumulator's zeros exist beside every long-lived array.
    r = resident
    sync_extra = whole + whole // t_local if replica else 0
    ref = r["reference"] if set(programs) & set(PROGRAMS) else 0  # the warm start keeps no reference
    report["transients"] = dict(
        sync_local=r["params"] + r["opt_state"] + ref + r["sampler_params"] + sync_extra,
        grad_init=2 * r["params"] + r["opt_state"] + ref,  # the sampler copy is released
    )
    report["sync_route"] = "replica" if replica else ("host_wide" if separate else "shared")
    if devices[0].platform != "cpu" and set(programs) & set(PROGRAMS):  # the model of an RL iteration
        shape = step_time.RunShape(
            chips=len(devices),
            hosts=len(hosts),
            fsdp=fsdp,
            tensor=tensor,
            sampler_tensor=local_mesh.shape["tensor"],
            prompt_tokens=prompt,
            response_tokens=response,
            games_per_host=batch,
            sampler_calls=-(-games // s.batch_buckets[-1]),
            turns=c.env.max_steps,
            micro_batch_rows=rows,
            logprob_rows_per_host=lrows,
            mini_batch_rows=c.ppo.mini_batch_rows,
            logprob_passes=int(c.ppo.old_logprobs == "recompute") + int(c.ppo.kl_coef > 0),
            remat=m.remat,
            iterations=c.num_iterations,
            val_games_per_host=val_batch if val_rows else 0,
            val_sampler_calls=max(1, -(-val_rows // s.batch_buckets[-1])),
            sync_replica=replica,
            val_panels=int(c.val.num_tasks > 0) + int(c.val.num_holdout_tasks > 0),
            val_every=c.val.every,
            checkpoint_every=c.checkpoint.every,
            batch_buckets=tuple(s.batch_buckets),
            chunk_steps=c.rollout.chunk_steps,
            response_cap=response,
        )
        chip = step_time.chip_for(devices[0].device_kind)
        report["step_time"] = dict(
            run_shape=dataclasses.asdict(shape), **step_time.estimate(step_time.ModelShape.of(cfg), shape, chip)
        )
    return report


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
    programs = tuple(_PROGRAMS.value) or PROGRAMS
    known = PROGRAMS + SFT_PROGRAMS + SLOT_PROGRAMS
    unknown = sorted(set(programs) - set(known))
    if unknown:
        raise app.UsageError(f"--programs: unknown {unknown}; expected some of {known}")

    print(f"{name}: {len(devices)} x {devices[0].device_kind}; compiling {', '.join(programs)}", flush=True)
    try:
        build.validate(c, num_devices=len(devices), abstract=True)
        report = compile_all(c, devices, host_devices(name, devices), programs)
    except config_lib.ConfigError as e:
        raise app.UsageError(f"{e} (on {len(devices)} devices of --topology={name})") from None
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
    slices = f"{_SLICES.value}x" if _SLICES.value > 1 else ""
    # beside, not over, the run's report
    warm = "__sft" if set(programs) <= set(SFT_PROGRAMS) else "__slots" if set(programs) <= set(SLOT_PROGRAMS) else ""
    write_json(os.path.join(_OUT.value, f"{setting}__{slices}{name.replace(':', '-')}{warm}.json"), report, indent=1)
    if not report["fits"]:
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
