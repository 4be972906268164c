"""Multi-host plumbing: ``jax.distributed`` start-up, host gathers, host-local <-> global placement.

One process: every function is the identity (or a trivial stack), so single-host code calls them
unconditionally.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from bipace_jax import sharding


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """``jax.distributed.initialize`` from explicit values or the environment.

    Explicit values win; otherwise ``BIPACE_COORDINATOR`` / ``BIPACE_NUM_PROCESSES`` /
    ``BIPACE_PROCESS_ID``; otherwise, on Cloud TPU / SLURM / etc., JAX's own auto-detection when
    ``BIPACE_DISTRIBUTED=auto``. Without any of these it does nothing (single process).

    Raises:
      ValueError: a coordinator address without ``num_processes >= 1`` and ``process_id >= 0``.
    """
    coord = coordinator_address or os.environ.get("BIPACE_COORDINATOR", "")
    n = num_processes or int(os.environ.get("BIPACE_NUM_PROCESSES", "0"))
    pid = process_id if process_id >= 0 else int(os.environ.get("BIPACE_PROCESS_ID", "-1"))
    if coord:
        if n < 1 or pid < 0:
            raise ValueError(
                f"distributed: coordinator {coord!r} needs num_processes >= 1 and process_id >= 0, got {n} and {pid}"
            )
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coord, num_processes=n, process_id=pid)
    elif os.environ.get("BIPACE_DISTRIBUTED") == "auto":
        jax.distributed.initialize()


def allgather(x: np.ndarray) -> np.ndarray:
    """Stack a host-local array over processes: ``[num_processes, *x.shape]``."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def host_sum(x) -> np.ndarray:
    """float64 ``[*x.shape]``: the element-wise sum of a host-local array (or list of numbers) over processes."""
    return allgather(np.asarray(x, np.float64)).sum(0)


def host_mean(d: dict[str, float]) -> dict[str, float]:
    """The mean over processes of each value of a dict of float scalars (the same keys on every host)."""
    if jax.process_count() == 1 or not d:
        return d
    keys = sorted(d)
    vals = allgather(np.array([d[k] for k in keys], np.float64)).mean(0)
    return dict(zip(keys, map(float, vals)))


def host_local(tree: Any, local_shardings: Any = None) -> Any:
    """A host-local copy of a pytree of (possibly multi-host) global arrays, placed on
    ``local_shardings`` (over this host's devices; default its first device). One process: the tree."""
    if jax.process_count() == 1:
        return tree

    def full(x):
        if x.is_fully_replicated:
            return x.addressable_data(0)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    if local_shardings is None:
        dev = jax.local_devices()[0]
        return jax.tree.map(lambda x: jax.device_put(full(x), dev), tree)
    return jax.tree.map(lambda x, s: jax.device_put(full(x), s), tree, local_shardings)


def to_global(tree: Any, shardings: Any) -> Any:
    """Place a host-local pytree (identical on every process) onto global shardings."""

    def one(x, s):
        a = np.asarray(x)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    return jax.tree.map(one, tree, shardings)


def local_mesh(mesh, tensor: int):
    """The mesh a host samples on: the global mesh with one process; else this host's devices with
    (data, fsdp=1, tensor) where tensor is the config's when it divides the local device count."""
    if jax.process_count() == 1:
        return mesh
    n = jax.local_device_count()
    t = tensor if tensor > 0 and n % tensor == 0 else 1
    return sharding.make_mesh(-1, 1, t, devices=jax.local_devices())
