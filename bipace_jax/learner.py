"""The learner core shared by RL (``ppo.py``) and the warm start (``sft.py``).

A ``Learner`` holds a model's parameters (global arrays over the mesh, plus a host-local copy for the
sampler and the no-gradient forwards) and the optimizer state; ``step`` sums a loss's gradients over
fixed-shape micro-batches, refuses a non-finite loss or gradient, then applies the update.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax import distributed, sharding

#: ``loss_fn(model, micro_batch, denom) -> (loss, stats)``: a scalar and a dict of scalars, summed over
#: the micro-batches of a step. It must be hashable by value (a frozen dataclass), so learners of the
#: same model, loss and optimizer share compiled programs.
LossFn = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN/Inf; the update was not applied."""


@functools.lru_cache(maxsize=32)
def _programs(graphdef, loss_fn: LossFn, tx: optax.GradientTransformation):
    def loss(params, rest, mb, denom):
        return loss_fn(nnx.merge(graphdef, params, rest), mb, denom)

    @jax.jit
    def accumulate(params, rest, grads_acc, stats_acc, mb, denom):
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, rest, mb, denom)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        stats_acc = jax.tree.map(jnp.add, stats_acc, dict(stats, loss=value))
        return grads_acc, stats_acc

    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))
    return accumulate, jax.jit(apply, donate_argnums=(0, 1)), zeros, jax.jit(optax.tree.norm)


def shard_rows(mesh, tree: Any) -> Any:
    """Place a pytree of host-local row arrays ``[B, ...]`` as global arrays split over ("data", "fsdp")."""
    return jax.tree.map(
        lambda v: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P(("data", "fsdp"), *([None] * (v.ndim - 1)))), v
        ),
        tree,
    )


class Learner:
    """Parameters, optimizer state and one jitted accumulate-then-apply step (no games, no files).

    Args:
      actor: the (host-local) model; its ``nnx.Param`` state becomes the learner's global parameters.
      mesh: the global mesh (axes data, fsdp, tensor); parameters follow ``sharding.param_shardings``.
      tx: the optax transformation.
      local_mesh: the mesh of this host's devices for ``params_local``, the host-local copy the sampler
        and the no-gradient forwards use (default: ``mesh`` with one process, else the host's first device).
      keep_reference: keep a frozen host-local copy of the initial parameters (``ref_params_local``).
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
        self.opt_state = jax.jit(tx.init)(self.params)
        self.local_shardings = None
        if local_mesh is not None and jax.process_count() > 1:
            self.local_shardings = sharding.param_shardings(params, local_mesh)
        self.ref_params_local = None
        if keep_reference:
            self.ref_params_local = jax.tree.map(jnp.copy, distributed.host_local(self.params, self.local_shardings))
        self.sync_local()

    def sync_local(self) -> None:
        """Refresh the host-local parameters and point the actor at them (after an update or restore)."""
        self.params_local = distributed.host_local(self.params, self.local_shardings)
        nnx.update(self.actor, self.params_local)

    def step(
        self, loss_fn: LossFn, micro_batches: Iterable[Any], denom: float, stat_keys: Sequence[str], where: str = ""
    ) -> tuple[dict[str, float], float]:
        """One optimizer step on the summed gradients of ``loss_fn`` over ``micro_batches``.

        Args:
          loss_fn: see ``LossFn``; its stats must have exactly ``stat_keys`` (``"loss"`` is added).
          micro_batches: global-array pytrees of one fixed shape (``shard_rows``), every process the same count.
          denom: the loss's normaliser (e.g. the step's real-token count over all processes).
          where: text naming the step for the error message (default "update").

        Returns:
          (stats summed over the micro-batches, as floats; global gradient norm before clipping).

        Raises:
          NonFiniteError: NaN/Inf loss or gradient; the step is not applied.
        """
        accumulate, apply, zeros, global_norm = _programs(self.graphdef, loss_fn, self.tx)
        grads = zeros(self.params)
        stats = {k: jnp.zeros((), jnp.float32) for k in (*stat_keys, "loss")}
        for mb in micro_batches:
            grads, stats = accumulate(self.params, self.rest, grads, stats, mb, jnp.float32(denom))
        stats = {k: float(v) for k, v in stats.items()}
        gnorm = float(global_norm(grads))
        if not (math.isfinite(stats["loss"]) and math.isfinite(gnorm)):
            raise NonFiniteError(
                f"non-finite {where or 'update'}: loss={stats['loss']}, grad_norm={gnorm}; the update was not applied"
            )
        self.params, self.opt_state = apply(self.params, self.opt_state, grads)
        return stats, gnorm
