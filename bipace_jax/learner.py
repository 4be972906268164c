"""The learner core shared by RL (``ppo.py``) and the warm start (``sft/``).

A ``Learner`` holds a model's parameters (global arrays over the mesh, plus a host-local copy for the
sampler and the no-gradient forwards) and the optimizer state; ``step`` sums a loss's gradients over
fixed-shape micro-batches, refuses a non-finite loss or gradient, then applies the update.
``make_optimizer`` is the one optax chain of both (``config.OptimConfig``, its ``schedule``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax import config as config_lib
from bipace_jax import distributed, sharding
from bipace_jax.programs import ProgramSpec, abstract

#: ``loss_fn(model, micro_batch, denom) -> (loss, stats)``: a scalar and a dict of scalars, summed over
#: the micro-batches of a step. It must be hashable by value (a frozen dataclass), so learners of the
#: same model, loss and optimizer share compiled programs.
LossFn = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def make_optimizer(optim: config_lib.OptimConfig, total_steps: int | None = None) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) after global-norm clipping, at the learning rate of ``optim.schedule``:
    ``constant`` (linear warmup from 0 over ``warmup_steps``, then ``learning_rate``) or ``warmup_cosine``
    (linear warmup, then cosine decay to 10% of ``learning_rate`` at step ``total_steps``: the warm start).
    ``optim``: an ``OptimConfig`` (or the ``config.optim`` section: same fields).

    Raises:
      ConfigError: ``warmup_cosine`` without ``total_steps`` (the run's optimizer steps).
    """
    o, schedule = optim, config_lib.Schedule(optim.schedule)
    if schedule is config_lib.Schedule.WARMUP_COSINE:
        if total_steps is None:
            config_lib.fail(
                "optim.schedule",
                "be 'constant' where the run's optimizer steps are not known in advance",
                "warmup_cosine",
            )
        end = max(total_steps, o.warmup_steps + 1)  # optax needs a decay of at least one step
        lr = optax.warmup_cosine_decay_schedule(
            0.0, o.learning_rate, o.warmup_steps, end, end_value=0.1 * o.learning_rate
        )
    else:
        lr = optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps) if o.warmup_steps else o.learning_rate
    return optax.chain(
        optax.clip_by_global_norm(optim.grad_clip),
        optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay),
    )


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN/Inf; the update was not applied."""


class StepPrograms(NamedTuple):
    """The jitted programs of one (model, loss, optimizer): ``accumulate(params, rest, grads, stats, mb,
    denom) -> (grads, stats)`` (``grads`` donated), ``apply(params, opt_state, grads) -> (params,
    opt_state)`` (``params`` and ``opt_state`` donated), ``zeros(params)`` and ``global_norm(grads)``."""

    accumulate: Callable
    apply: Callable
    zeros: Callable
    global_norm: Callable


@functools.lru_cache(maxsize=32)
def _step_programs(graphdef, loss_fn: LossFn, tx: optax.GradientTransformation) -> StepPrograms:
    def loss(params, rest, mb, denom):
        return loss_fn(nnx.merge(graphdef, params, rest), mb, denom)

    def accumulate(params, rest, grads_acc, stats_acc, mb, denom):
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, rest, mb, denom)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        stats_acc = jax.tree.map(jnp.add, stats_acc, dict(stats, loss=value))
        return grads_acc, stats_acc

    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return StepPrograms(
        jax.jit(accumulate, donate_argnums=(2,)),  # the fp32 accumulator is updated in place
        jax.jit(apply, donate_argnums=(0, 1)),
        jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p)),
        jax.jit(optax.tree.norm),
    )


def step_specs(
    graphdef, loss_fn: LossFn, tx: optax.GradientTransformation, mesh, params, rest, opt_state, micro_batch, stat_keys
) -> dict[str, ProgramSpec]:
    """The two programs of an optimizer step as ``ProgramSpec``s: ``"accumulate"`` (one micro-batch's
    loss gradient added to the accumulator, which is donated) and ``"apply"`` (the optimizer update).

    Args:
      graphdef, loss_fn, tx: the model's graph, the loss (``LossFn``) and the optax transformation.
      mesh: the global mesh (the loss normaliser and the stats are replicated over it).
      params, rest, opt_state: arrays or ``jax.ShapeDtypeStruct``s carrying their shardings (the
        parameters', e.g. ``sharding.param_shardings``; AdamW's moments ``opt_state_shardings``).
      micro_batch: one micro-batch pytree (arrays or ShapeDtypeStructs with their shardings).
      stat_keys: the loss's stats (``"loss"`` is added).
    """
    fns = _step_programs(graphdef, loss_fn, tx)
    rep = NamedSharding(mesh, P())
    p = abstract(params)
    stats = {k: jax.ShapeDtypeStruct((), jnp.float32, sharding=rep) for k in (*stat_keys, "loss")}
    denom = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    args = (p, abstract(rest), p, stats, abstract(micro_batch), denom)
    return {
        "accumulate": ProgramSpec("accumulate", fns.accumulate, args, donate_argnums=(2,)),
        "apply": ProgramSpec("apply", fns.apply, (p, abstract(opt_state), p), donate_argnums=(0, 1)),
    }


@functools.lru_cache(maxsize=8)
def _process_batch_shards(mesh, process: int) -> int:
    """How many of ``mesh``'s batch shards ``process`` holds (after `sharding.check_placement`)."""
    block = sharding.check_placement(mesh)["process_batch_shards"].get(str(process))
    return block[1] - block[0] if block else 0


def shard_rows(mesh, tree: Any) -> Any:
    """Place a pytree of host-local row arrays ``[B_local, ...]`` as global arrays ``[B_global, ...]``
    split over ("data", "fsdp"), each process's rows on its own batch shards.

    The global row count is derived from the mesh: this process holds ``k`` of the ``data * fsdp``
    batch shards (a contiguous block, `sharding.make_mesh`), each takes ``B_local / k`` rows, so
    ``B_global = B_local * data * fsdp / k`` (``B_local * processes`` for a `make_mesh` mesh). Every
    process must pass the same ``B_local``. The global shape is given to
    ``jax.make_array_from_process_local_data``, so replicas of one batch shard (its tensor group)
    get the same rows, never two hosts' different ones.

    Raises:
      sharding.PlacementError: ``mesh`` fails `sharding.check_placement` (tensor groups or batch
        shards split across processes).
      ValueError: a leaf has no rows dimension, or its ``B_local`` is not a multiple of ``k``.
    """
    sizes = sharding.mesh_axis_sizes(mesh)
    shards = sizes["data"] * sizes["fsdp"]
    local = shards if jax.process_count() == 1 else _process_batch_shards(mesh, jax.process_index())
    if not local:
        raise ValueError(f"shard_rows: process {jax.process_index()} holds no device of the mesh {sizes}")

    def one(path, v):
        if v.ndim == 0 or v.shape[0] % local:
            raise ValueError(
                f"shard_rows: {jax.tree_util.keystr(path) or 'the array'} has {v.shape[0] if v.ndim else 'no'} "
                f"local rows (shape {tuple(v.shape)}); this process holds {local} of the mesh's {shards} batch "
                f"shards (data*fsdp), so its rows must be a multiple of {local}"
            )
        global_shape = (v.shape[0] * shards // local, *v.shape[1:])
        return jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, v.ndim), v, global_shape)

    return jax.tree_util.tree_map_with_path(one, tree)


def mesh_context(mesh):
    """``jax.set_mesh(mesh)`` for a mesh of several devices, so the model's sharding constraints and
    FSDP gathers apply; a one-device mesh sets none (nothing to split, and CPU keeps its own
    attention schedules)."""
    return jax.set_mesh(mesh) if mesh is not None and mesh.devices.size > 1 else contextlib.nullcontext()


def opt_state_shardings(tx: optax.GradientTransformation, params: Any, param_shardings: Any, mesh) -> Any:
    """Shardings of ``tx.init(params)``: every parameter-shaped leaf (AdamW's moments) takes its
    parameter's sharding, everything else (step counts) is replicated over ``mesh``.

    Left to the compiler, ``jax.jit(tx.init)`` replicates the moments (zeros depend on no input's
    sharding): 8 bytes per parameter on every chip.
    """
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        tx,
        lambda _, s: s,
        jax.eval_shape(tx.init, params),
        param_shardings,
        transform_non_params=lambda _: replicated,
    )


class Learner:
    """Parameters, optimizer state and one jitted accumulate-then-apply step (no games, no files).

    Args:
      actor: the model; its ``nnx.Param`` state becomes the learner's global parameters (arrays already
        on their ``param_shardings``, e.g. from ``load_hf_checkpoint(mesh=...)``, are used as they are,
        not copied: the updates donate them, and the actor is pointed at ``params_local``).
      mesh: the global mesh (axes data, fsdp, tensor); parameters follow ``sharding.param_shardings``.
      tx: the optax transformation.
      local_mesh: the mesh of this host's devices for ``params_local``, the host-local copy the sampler
        and the no-gradient forwards use (default: ``mesh`` with one process, else the host's first device).
      keep_reference: keep a frozen host-local copy of the initial parameters (``ref_params_local``).

    ``params_local`` and ``ref_params_local`` hold the actor's compute dtype (``actor.dtype``, e.g. bf16
    over fp32 master parameters): the forward casts every parameter to it at use, so the values it
    computes are the same, in half the memory. With one process and equal dtypes ``params_local`` is
    ``params`` itself (no copy).
    """

    def __init__(
        self,
        actor: nnx.Module,
        mesh,
        tx: optax.GradientTransformation,
        *,
        local_mesh=None,
        keep_reference: bool = False,
    ):
        self.actor, self.mesh, self.tx = actor, mesh, tx
        self.graphdef, params, self.rest = nnx.split(actor, nnx.Param, ...)
        self.param_shardings = sharding.param_shardings(params, mesh)
        self.params = distributed.to_global(params, self.param_shardings)
        del params  # the caller's arrays may be the learner's now (donated by the first update)
        with mesh_context(mesh):
            # typed under the mesh as the updates' outputs are: else every program compiles again after the first
            self.params = jax.jit(lambda p: p, out_shardings=self.param_shardings)(self.params)
        opt_shardings = opt_state_shardings(tx, self.params, self.param_shardings, mesh)
        with mesh_context(mesh):
            self.opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(self.params)
        if jax.process_count() == 1 and (local_mesh is None or local_mesh is mesh):
            self.local_mesh, self.local_shardings = mesh, None
        else:
            self.local_mesh = local_mesh or sharding.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
            self.local_shardings = sharding.param_shardings(self.params, self.local_mesh)
        dtype = getattr(actor, "dtype", None)
        self.local_dtype = jnp.dtype(dtype) if dtype is not None else None
        self.ref_params_local = None
        if keep_reference:
            ref = distributed.local_copy(self.params, self.local_shardings, self.local_dtype)
            # a copy that shares the master buffers would be donated away by the first update
            self.ref_params_local = jax.tree.map(lambda r, p: jnp.copy(r) if r is p else r, ref, self.params)
        self.sync_local()

    def sync_local(self) -> None:
        """Refresh the host-local parameters and point the actor at them (after an update or restore):
        an on-device reshard (and cast to the compute dtype) of the global ones. The old copy is freed
        first (`release_local`), so two copies are never resident together."""
        self.release_local()
        self.params_local = distributed.local_copy(self.params, self.local_shardings, self.local_dtype)
        nnx.update(self.actor, self.params_local)

    def release_local(self) -> None:
        """Free the host-local copy until the next `sync_local` (its arrays that are not the master
        parameters themselves): the gradient steps then have its HBM, e.g. 3.5 GiB of a v5e chip for 7B
        (``launch.aot``). The actor must not run in between (its arrays are deleted)."""
        master = {id(x) for x in jax.tree.leaves(self.params)}
        for x in jax.tree.leaves(getattr(self, "params_local", None) or ()):
            if isinstance(x, jax.Array) and id(x) not in master and not x.is_deleted():
                x.delete()
        self.params_local = None

    def master_model(self) -> nnx.Module:
        """The model with the (global) master parameters in ``param_dtype``, e.g. for export."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    def step(
        self, loss_fn: LossFn, micro_batches: Iterable[Any], denom: float, stat_keys: Sequence[str], where: str = ""
    ) -> tuple[dict[str, float], float]:
        """One optimizer step on the summed gradients of ``loss_fn`` over ``micro_batches``, its programs
        run under the mesh (``mesh_context``).

        Args:
          loss_fn: see ``LossFn``; its stats must have exactly ``stat_keys`` (``"loss"`` is added).
          micro_batches: global-array pytrees of one fixed shape (``shard_rows``), every process the same count.
          denom: the loss's normaliser (e.g. the step's real-token count over all processes).
          where: text naming the step for the error message (default "update").

        Returns:
          (stats summed over the micro-batches, as floats; global gradient norm before clipping).

        Raises:
          NonFiniteError: NaN/Inf loss or gradient; the step is not applied.
          ValueError: no micro-batches.
        """
        fns = _step_programs(self.graphdef, loss_fn, self.tx)
        with mesh_context(self.mesh):
            grads, stats = self._zero_accumulators(tuple(stat_keys))(self.params)
            specs = None
            for mb in micro_batches:
                specs = specs or self.step_specs(loss_fn, mb, stat_keys)
                grads, stats = specs["accumulate"](self.params, self.rest, grads, stats, mb, jnp.float32(denom))
            if specs is None:
                raise ValueError(f"{where or 'update'}: no micro-batches")
            stats = {k: float(v) for k, v in stats.items()}
            gnorm = float(fns.global_norm(grads))
            if not (math.isfinite(stats["loss"]) and math.isfinite(gnorm)):
                raise NonFiniteError(
                    f"non-finite {where or 'update'}: loss={stats['loss']}, grad_norm={gnorm}; the update was not applied"
                )
            self.params, self.opt_state = specs["apply"](self.params, self.opt_state, grads)
        return stats, gnorm

    def _zero_accumulators(self, stat_keys: tuple[str, ...]) -> Callable:
        """``params -> (zero gradients, zero stats)`` placed as the accumulate program returns them
        (the parameters' shardings; stats replicated), so its first and later micro-batches share one
        compiled program (uncommitted zeros would compile it a second time)."""
        cache = self.__dict__.setdefault("_zeros_programs", {})
        if stat_keys not in cache:
            rep = NamedSharding(self.mesh, P())
            keys = (*stat_keys, "loss")
            cache[stat_keys] = jax.jit(
                lambda p: (jax.tree.map(jnp.zeros_like, p), {k: jnp.zeros((), jnp.float32) for k in keys}),
                out_shardings=(self.param_shardings, {k: rep for k in keys}),
            )
        return cache[stat_keys]

    def step_specs(self, loss_fn: LossFn, micro_batch: Any, stat_keys: Sequence[str]) -> dict[str, ProgramSpec]:
        """``step_specs`` of this learner's model, optimizer, mesh and state for ``micro_batch``'s shape."""
        return step_specs(
            self.graphdef, loss_fn, self.tx, self.mesh, self.params, self.rest, self.opt_state, micro_batch, stat_keys
        )
