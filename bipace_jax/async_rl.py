"""Asynchronous RL with a staleness bound: a sampler group and a learner group of devices, overlapped.

``config.async_rl`` (``config.AsyncConfig``) splits one process's devices into two roles
(`role_meshes`): the first ``sampler_devices`` play the games, the rest compute log-probs and
updates, each on its own mesh by `sharding.make_mesh`'s rules. A `SamplerThread` plays iterations
into a queue while the learner trains; it starts iteration ``j`` only once the learner's policy
version (updates applied) is at least ``j - k`` (``k = async_rl.max_staleness``), so it is never more
than ``k`` iterations ahead and every row's version lag (the learner's version at its update minus
the row's version) lies in ``[0, k]``. ``k = 0`` is on-policy: iteration ``j`` samples with the
parameters of updates ``0 .. j-1``, as the synchronous loop does.

After each update the learner `push`es its parameters to the sampler group (cast to the compute
dtype on the learner's devices, then ``jax.device_put`` onto the sampler's shardings: a
device-to-device copy) and publishes them on a `PolicySource` with their version; the sampler adopts
the newest at a turn boundary (``switch="turn"``, partial rollouts) or when its games start
(``"game"``).

Faults: the queue is not checkpointed. A checkpoint holds the learner's state after update ``i``
(iteration ``i + 1``, the rng chain, the task cursor); a restarted run replays the queue from there
(iteration ``j``'s keys and tasks follow from the chain, `iteration_keys`), so no iteration is lost
or trained twice; iterations that were sampled ahead but not trained are sampled again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bipace_jax import distributed, sharding, tasks
from bipace_jax.config import AsyncConfig, MeshConfig, Switch, fail

__all__ = ["PolicySource", "SamplerThread", "iteration_keys", "iteration_tasks", "policy_reader", "push", "role_meshes"]


def iteration_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(rollout key of this process, PPO shuffle key: the same on every host) of one iteration's key.
    The rollout key folds in the process's place in its group (`distributed.process_index`): a
    sampler process plays what the learner's process 0 would."""
    k_roll = jax.random.split(jax.random.fold_in(key, distributed.process_index()))[0]
    k_ppo = jax.random.split(jax.random.fold_in(key, 0))[1]
    return k_roll, k_ppo


def iteration_tasks(
    train_ids: list[int], seed: int, cursor: int, first: int, j: int, num_groups: int, groups: int
) -> list[tuple[int, int]]:
    """(task_id, game_seed) of iteration ``j``'s first ``groups`` task groups (`tasks.train_task`): the
    task cursor is ``cursor`` at iteration ``first`` and advances ``num_groups`` an iteration."""
    at = cursor + (j - first) * num_groups
    return [tasks.train_task(train_ids, seed, at + i) for i in range(groups)]


def policy_reader(source: PolicySource, switch: Switch) -> Callable[[], tuple[nnx.Module, int]]:
    """What ``rollout.collect(policy=...)`` reads for (actor, version): ``source``'s newest at every
    turn (``Switch.TURN``, partial rollouts) or the policy newest now, for the whole rollout (``GAME``)."""
    if switch is Switch.TURN:
        return source.latest
    actor, version = source.latest()
    return lambda: (actor, version)


def role_meshes(mesh: MeshConfig, roles: AsyncConfig, devices: list[Any]) -> tuple[Any, Any]:
    """(sampler mesh, learner mesh) over ``devices`` (one process's): the first
    ``roles.sampler_devices`` sample on a (data, 1, sampler tensor) mesh, the rest learn on
    ``mesh``'s (data, fsdp, tensor) shape resolved for them.

    Raises:
      ConfigError: the roles or a mesh do not fit the devices (``async_rl.sampler_devices``, ``mesh``,
        ``mesh.sampler_tensor``).
    """
    roles.check_devices(len(devices), jax.process_count())
    n = roles.sampler_devices
    sampler, learner = list(devices[:n]), list(devices[n:])
    mesh.check_devices(len(learner))
    learn_shape = mesh.shape(len(learner))
    t = mesh.sampler_tensor or learn_shape[2]
    if n % t:
        fail("mesh.sampler_tensor", f"divide async_rl.sampler_devices={n} (0: mesh.tensor={learn_shape[2]})", t)
    return sharding.make_mesh(n // t, 1, t, devices=sampler), sharding.make_mesh(*learn_shape, devices=learner)


def push(params: Any, shardings: Any, dtype: Any = None) -> Any:
    """The learner's parameters on the sampler group: floating leaves cast to ``dtype`` (None: kept)
    on the learner's devices, then ``jax.device_put`` onto ``shardings`` (device to device, no host
    copy); waited for, so the learner may donate ``params`` to its next update."""

    def recast(x):
        return dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.dtype(dtype)

    if any(recast(x) for x in jax.tree.leaves(params)):
        params = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dtype) if recast(x) else x, t))(params)
    return jax.block_until_ready(jax.device_put(params, shardings))


class PolicySource:
    """The newest published policy ``(actor, version)``, shared by the learner (``publish``) and the
    sampler thread (``latest``, ``wait_for``); thread-safe.

    Args:
      graphdef, rest: the actor's graph and non-parameter state (``nnx.split(actor, nnx.Param, ...)``),
        ``rest`` already on the sampler's devices.
    """

    def __init__(self, graphdef, rest):
        self.graphdef, self.rest = graphdef, rest
        self._cond = threading.Condition()
        self._actor, self._version, self._closed = None, -1, False

    def publish(self, params: Any, version: int) -> None:
        """Make ``params`` (on the sampler's devices) the newest policy, of ``version`` updates."""
        actor = nnx.merge(self.graphdef, params, self.rest)
        with self._cond:
            self._actor, self._version = actor, int(version)
            self._cond.notify_all()

    @property
    def version(self) -> int:
        """The newest version (-1: none published yet)."""
        with self._cond:
            return self._version

    def latest(self) -> tuple[nnx.Module, int]:
        """(actor, version) of the newest policy."""
        with self._cond:
            return self._actor, self._version

    def wait_for(self, version: int) -> bool:
        """Block until a policy of at least ``version`` is published (True) or ``close`` (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._version >= version or self._closed)
            return not self._closed

    def close(self) -> None:
        """Release every ``wait_for``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class SamplerThread:
    """Plays iterations ``first, first + 1, ...`` into a queue, at most ``max_staleness`` ahead.

    Iteration ``j`` starts once ``source`` holds version ``>= j - max_staleness`` (``k = 0``: after
    the update of iteration ``j - 1``); ``play(j, key)`` then collects it (``key``: the j-th key of the
    rng chain starting at ``rng``, `iteration_keys`). The learner takes iteration ``j`` with `take`.
    ``started`` records ``(j, version when it started)`` of every iteration (the bound's evidence).

    Args:
      play: ``play(iteration, rollout key) -> result``, run on the thread.
      source: the `PolicySource` the learner publishes to.
      first, last: the iterations to play, ``range(first, last)``.
      rng: the run's key before iteration ``first`` (``Trainer.rng``).
      max_staleness: k.
    """

    def __init__(self, play: Callable[[int, jax.Array], Any], source: PolicySource, first: int, last: int, rng, k: int):
        self.play, self.source, self.first, self.last, self.k = play, source, first, last, k
        self._rng = rng
        self._cond = threading.Condition()
        self._ready: dict[int, Any] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._finished = False  # the loop has returned: a take of an iteration it never played wakes
        self.started: list[tuple[int, int]] = []
        self.transfer_stats: dict[str, float] = {}  # in one process nothing crosses between processes
        self._thread = threading.Thread(target=self._loop, name="bipace-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        rng = self._rng
        try:
            for j in range(self.first, self.last):
                rng, key = jax.random.split(rng)
                k_roll, _ = iteration_keys(key)
                if not self.source.wait_for(j - self.k) or self._stop:
                    return
                self.started.append((j, self.source.version))
                res = self.play(j, k_roll)
                with self._cond:
                    self._ready[j] = res
                    self._cond.notify_all()
        except BaseException as e:  # handed to the learner's take
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:  # e.g. the source closed (a failed weight pull by process): a waiting take raises
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def take(self, iteration: int) -> Any:
        """Iteration ``iteration``'s result, waiting for the thread to play it.

        Raises:
          the thread's exception, if it failed; RuntimeError: the thread stopped first (`close`, or
          the source closed before the iteration's version came).
        """
        with self._cond:
            self._cond.wait_for(
                lambda: iteration in self._ready or self._error is not None or self._stop or self._finished
            )
            if iteration in self._ready:
                return self._ready.pop(iteration)
            if self._error is not None:
                raise self._error
            raise RuntimeError(f"async_rl: the sampler stopped before iteration {iteration}")

    def queued(self) -> list[int]:
        """Iterations played and not yet taken."""
        with self._cond:
            return sorted(self._ready)

    def close(self, timeout: float = 60.0) -> None:
        """Stop after the iteration being played (it is dropped) and join the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.source.close()
        self._thread.join(timeout)
