"""Multi-host plumbing: ``jax.distributed`` start-up, host gathers, host-local <-> global placement,
and a failure on one host stopping them all (``failures_shared``).

One process: the gathers are trivial stacks and the placements keep arrays where they are (or
reshard / cast them on device), so single-host code calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax import sharding
from bipace_jax.config import ConfigError
from bipace_jax.stats import HostStats


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


# The processes the run's host collectives span (None: all). Process roles (asynchronous RL by
# process, ``bipace_jax.async_processes``) give the learner and the sampler a group each.
_group: tuple[int, ...] | None = None


def set_group(processes: Any) -> None:
    """Make this process's host collectives (`allgather`, `pooled`, ...), `process_count`,
    `process_index` and `group_devices` span ``processes`` (increasing ``jax.process_index`` values,
    this process among them); None: every process again. The failure watch (`failures_shared`) keeps
    spanning every process.

    Raises:
      ValueError: this process is not in ``processes``, or they are several but not every process
        (a gather over a subgroup of processes has no implementation here).
    """
    global _group
    if processes is None:
        _group = None
        return
    group = tuple(sorted(int(p) for p in processes))
    if jax.process_index() not in group:
        raise ValueError(f"set_group: process {jax.process_index()} is not in {group}")
    if 1 < len(group) < jax.process_count():
        raise ValueError(f"set_group: {group} is several but not all {jax.process_count()} processes")
    _group = group


def group() -> tuple[int, ...]:
    """The ``jax.process_index`` values of this process's group (`set_group`; default every process)."""
    return _group if _group is not None else tuple(range(jax.process_count()))


def process_count() -> int:
    """The processes of this process's group (``jax.process_count()`` without `set_group`)."""
    return len(group())


def process_index() -> int:
    """This process's place in its group (``jax.process_index()`` without `set_group`)."""
    return group().index(jax.process_index())


def group_devices() -> list[Any]:
    """The devices of the group's processes, in ``jax.devices()`` order (all of them without `set_group`)."""
    mine = set(group())
    return [d for d in jax.devices() if int(getattr(d, "process_index", 0)) in mine]


def allgather(x: np.ndarray) -> np.ndarray:
    """Stack a host-local array over the group's processes: ``[process_count(), *x.shape]``, of ``x``'s
    dtype (64-bit values travel as int32 pairs: JAX without x64 would cut them to 32 bits)."""
    x = np.asarray(x)
    if process_count() == 1:
        return x[None]
    if x.dtype.itemsize == 8:
        words = np.ascontiguousarray(x).reshape(-1).view(np.int32)
        out = np.asarray(multihost_utils.process_allgather(words, tiled=False), np.int32)
        return np.ascontiguousarray(out).view(x.dtype).reshape((out.shape[0], *x.shape))
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def host_sum(x) -> np.ndarray:
    """float64 ``[*x.shape]``: the element-wise sum of a host-local array (or list of numbers) over processes."""
    return allgather(np.asarray(x, np.float64)).sum(0)


def pooled(stats: HostStats) -> dict[str, float]:
    """The run's metric values from every process's ``HostStats`` (``HostStats.pool``: counts summed,
    rates as summed numerator over summed denominator, maxima the max); ``stats.values()`` with one
    process. Every process of the group calls it, with the same names (one gather).

    Raises:
      ValueError: the processes hold different names.
    """
    if process_count() == 1:
        return stats.values()
    return HostStats.pool([stats.like(v) for v in allgather(stats.vector())]).values()


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def local_copy(tree: Any, local_shardings: Any = None, dtype: Any = None) -> Any:
    """This host's copy of a pytree of global arrays, made on device (never through host memory), with
    its floating arrays cast to ``dtype`` (None: kept).

    Three on-device routes, per array:

    - *same layout* (one process, ``local_shardings`` None or the arrays' own): the array itself when
      nothing is cast (the result shares the buffers), else one jitted cast keeping its sharding;
    - *host-wide gather* (the local mesh splits the array over axes of the global mesh's sizes, e.g.
      the host's own tensor groups under `sharding.make_mesh`): one jitted program gathers every such
      array over the global data/fsdp axes, tensor kept, and this host's shards are reassembled on
      ``local_shardings`` by device-to-device moves only (none for `local_mesh`'s mesh);
    - *replica* (the local mesh has another tensor size than the global one, e.g. a pure-FSDP
      training mesh under a tensor-parallel sampler, ``config.mesh.sampler_tensor``): array by array,
      one all-gather over every device of the global mesh to a full replica, then each host slices
      its own devices' parts with no collective. Array by array bounds the transient to one whole
      array per chip; a whole-slice all-gather because libtpu 0.10.2 cannot route the subgroup
      all-gather of a direct reshard on v5e (every 4th chip of the torus).

    A fully replicated array is copied from this host's own replica.

    Args:
      tree: pytree of ``jax.Array`` (global, over the learner's mesh).
      local_shardings: pytree like ``tree`` of this host's shardings (``NamedSharding`` over this
        host's devices, `local_mesh`), or None (one process: the arrays' own; several: replicated on
        the host's first device).
      dtype: the copy's floating dtype (e.g. the compute dtype for bf16 sampler/reference copies).

    Returns:
      A pytree like ``tree`` of fully addressable arrays.

    Raises:
      sharding.PlacementError: an array whose layout gives no on-device route to this host's copy
        (this host does not hold every tensor-parallel index of it: tensor groups that cross hosts);
        the reason names the array's shape. There is no silent ``process_allgather`` fallback.
    """

    def cast(t):
        return t if dtype is None else jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, t)

    leaves, treedef = jax.tree.flatten(tree)
    if local_shardings is None and process_count() == 1:
        local_shardings = jax.tree.map(lambda x: x.sharding, tree)
    elif local_shardings is None:
        dev = jax.local_devices()[0]
        local_shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(dev), tree)
    targets = treedef.flatten_up_to(local_shardings)
    out = [None] * len(leaves)
    batched = []  # (index, global sharding) of the arrays one jitted program gathers host-wide
    for i, (x, s) in enumerate(zip(leaves, targets)):
        if x.sharding == s or (x.sharding.is_equivalent_to(s, x.ndim) and process_count() == 1):
            needs = dtype is not None and _is_float(x) and x.dtype != jnp.dtype(dtype)
            out[i] = _cast_program(s, jnp.dtype(dtype))(x) if needs else x
            continue
        route = _host_wide(x, s)
        if isinstance(route, NamedSharding):
            batched.append((i, route))
        elif x.is_fully_replicated:
            # this host's own replica, cast and spread over its devices on device
            out[i] = jax.device_put(cast(x.addressable_data(0)), s)
        elif isinstance(s, NamedSharding):
            out[i] = _via_replica(x, s, dtype)
        else:
            raise sharding.PlacementError(f"local_copy: array of shape {tuple(x.shape)}: {route}")
    if batched:
        gathered = jax.jit(cast, out_shardings=[r for _, r in batched])([leaves[i] for i, _ in batched])
        for (i, _), y in zip(batched, gathered):
            out[i] = _reassemble(y, targets[i])
            if isinstance(out[i], str):
                raise sharding.PlacementError(f"local_copy: array of shape {tuple(y.shape)}: {out[i]}")
    return treedef.unflatten(out)


@functools.cache
def _cast_program(out: Any, dtype: Any) -> Any:
    """A jitted cast of one array to ``dtype`` onto sharding ``out`` (cached per target)."""
    return jax.jit(lambda x: x.astype(dtype), out_shardings=out)


def _via_replica(x: jax.Array, local: NamedSharding, dtype: Any) -> jax.Array:
    """``x`` (cast to ``dtype``) as this host's array on ``local``: one whole-mesh all-gather to a
    replica on every device of ``x``'s mesh, then a slice on this host's devices (no collective)."""
    dt = jnp.dtype(dtype) if dtype is not None and _is_float(x) else x.dtype
    full = _cast_program(NamedSharding(x.sharding.mesh, P()), dt)(x)
    on = {shard.device: shard.data for shard in full.addressable_shards}
    devices = list(np.asarray(local.mesh.devices).flat)
    missing = [d for d in devices if d not in on]
    if missing:
        raise sharding.PlacementError(
            f"local_copy: array of shape {tuple(x.shape)}: the local mesh's devices {missing[:4]} are not "
            "devices of the global mesh on this process"
        )
    replica = jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(local.mesh, P()), [on[d] for d in devices]
    )
    del full, on
    return _cast_program(local, dt)(replica)


def _host_wide(x: jax.Array, local: Any) -> Any:
    """The global sharding under which each host holds all of ``x`` the way ``local`` splits it
    (``local``'s spec on ``x``'s mesh), or the reason (a str) when the two meshes' axis sizes differ."""
    mesh = getattr(x.sharding, "mesh", None)
    spec = local.spec if isinstance(local, NamedSharding) else P()
    if mesh is None:
        return f"its sharding {x.sharding} has no mesh"
    local_sizes = sharding.mesh_axis_sizes(local.mesh) if isinstance(local, NamedSharding) else {}
    global_sizes = sharding.mesh_axis_sizes(mesh)
    for entry in spec:
        for ax in () if entry is None else ((entry,) if isinstance(entry, str) else entry):
            if local_sizes.get(ax) != global_sizes.get(ax):
                return f"this host's mesh splits it over {ax!r} of size {local_sizes.get(ax)}, the global mesh's has size {global_sizes.get(ax)}"
    return NamedSharding(mesh, spec)


def _index_key(index: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def _reassemble(y: jax.Array, local: Any) -> jax.Array | str:
    """``y``'s shards on this host as one array on ``local`` (device-to-device moves only); the reason
    (a str) when this host's shards do not cover every index ``local`` needs."""
    have = {}
    for shard in y.addressable_shards:
        have.setdefault(_index_key(shard.index, y.shape), {})[shard.device] = shard.data
    arrays = []
    for dev, index in local.addressable_devices_indices_map(y.shape).items():
        on = have.get(_index_key(index, y.shape))
        if not on:
            return (
                f"process {jax.process_index()} holds no shard {_index_key(index, y.shape)} (start, stop per dim) "
                "of it: its tensor groups cross hosts (sharding.check_placement; build the mesh with "
                "sharding.make_mesh)"
            )
        arrays.append(on[dev] if dev in on else jax.device_put(next(iter(on.values())), dev))
    return jax.make_array_from_single_device_arrays(y.shape, local, arrays)


def to_global(tree: Any, shardings: Any) -> Any:
    """Place a pytree onto global shardings.

    Arrays already on their sharding are kept (not copied: they share the buffers). Otherwise, one
    process: an on-device ``jax.device_put``; several: ``tree`` must be host-local and identical on
    every process, and each device takes its shard of it.
    """

    def one(x, s):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
            return x
        if process_count() == 1:
            return jax.device_put(x, s)
        a = np.asarray(x)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    return jax.tree.map(one, tree, shardings)


def local_mesh(mesh, tensor: int = 0):
    """The mesh this host samples on: `sharding.host_mesh` of this process (``tensor``: the sampler's
    tensor-parallel size, ``config.mesh.sampler_tensor``; 0: the global mesh's). One process with the
    global tensor size: the global mesh itself."""
    return sharding.host_mesh(mesh, tensor, jax.process_index())


def check_shared_workdir(workdir: str, timeout_s: float = 10.0) -> None:
    """Proves that every process sees the same local ``workdir`` (a declared shared file system):
    process 0 writes a token file, the others must read it within ``timeout_s`` seconds. Nothing to
    prove with one process or a ``gs://`` folder. Call it on every process after the folder exists.

    Raises:
      bipace_jax.config.ConfigError: a process does not see process 0's file in time
        (``config.checkpoint.shared_workdir`` declares a folder shared that is not).
    """
    if process_count() == 1 or str(workdir).startswith("gs://"):
        return
    token = int(allgather(np.int32(np.random.default_rng().integers(1, 2**31 - 1)))[0])  # process 0's
    probe = os.path.join(os.fspath(workdir), f".shared_workdir_{token}")
    if jax.process_index() == 0:
        with open(probe, "w") as f:
            f.write(str(token))
    allgather(np.int32(0))  # written before anyone looks
    deadline = time.monotonic() + timeout_s
    seen = False
    while not seen:
        try:
            with open(probe) as f:
                seen = f.read() == str(token)
        except OSError:
            pass
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    seen_by = allgather(np.int32(seen))
    if jax.process_index() == 0:
        os.remove(probe)
    blind = [int(p) for p in np.flatnonzero(seen_by == 0)]
    if blind:
        raise ConfigError(
            f"--workdir={workdir!r} is not shared: processes {blind} do not see the file process 0 wrote there "
            f"within {timeout_s} s; config.checkpoint.shared_workdir=True needs a folder every host sees "
            "(or use gs://...)"
        )


#: Key prefix in the ``jax.distributed`` key-value store under which a failing process posts its reason.
FAILURE_KEY = "bipace/failed/"


def check_same_config(text: str, timeout_s: float = 120.0) -> None:
    """Refuse a process started with another config than process 0's: every process of a run must
    build the same plan, mesh and roles, and one that differs would wait in a collective the others
    never enter. Compares sha256 digests of ``text`` (the run config's JSON) through the
    ``jax.distributed`` key-value store; nothing with one process.

    Raises:
      ConfigError: this process's config differs from process 0's (naming both digests), or process 0
        posted none within ``timeout_s`` seconds.
    """
    if jax.process_count() == 1:
        return
    client = kv_client()
    me, digest = jax.process_index(), hashlib.sha256(text.encode()).hexdigest()[:16]
    client.key_value_set(f"bipace/config/{me}", digest)
    try:
        first = client.blocking_key_value_get("bipace/config/0", int(timeout_s * 1000))
    except jax.errors.JaxRuntimeError as e:
        raise ConfigError(f"process 0 posted no config within {timeout_s:g} s ({e})") from None
    if first != digest:
        raise ConfigError(
            f"process {me}'s config (sha256 {digest}) differs from process 0's ({first}): start every process "
            "with the same --config and --config.* overrides"
        )


def kv_client() -> Any:
    """The ``jax.distributed`` coordination client (its key-value store: ``key_value_set``,
    ``blocking_key_value_get``, their ``_bytes`` forms, ``key_value_delete``), or None without one."""
    from jax._src import distributed as jax_distributed  # the store has no public API in jax 0.10

    return getattr(jax_distributed.global_state, "client", None)


def post_failure(reason: str) -> None:
    """Post this process's failure (``reason``, one line) for the other processes' ``failures_shared``
    watch. Nothing with one process; never raises (the store may be gone already)."""
    client = kv_client()
    if client is None or jax.process_count() == 1:
        return
    try:
        client.key_value_set(f"{FAILURE_KEY}{jax.process_index()}", " ".join(str(reason).split())[:2000])
    except Exception:  # noqa: BLE001 (the process is failing anyway; its exit still ends the run)
        pass


def posted_failures() -> dict[int, str]:
    """``{process index: reason}`` of every process that posted a failure (``post_failure``)."""
    client = kv_client()
    if client is None:
        return {}
    out = {}
    for key, value in client.key_value_dir_get(FAILURE_KEY):
        out[int(key.rsplit("/", 1)[-1])] = value
    return out


def _stop_now(line: str, code: int = 1) -> None:
    """Print ``line`` on stderr and leave at once: the main thread may sit in a collective that never
    returns, and ``jax.distributed``'s exit barrier would wait minutes for the failed process."""
    sys.stdout.flush()
    if line:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def failures_shared(
    grace_s: float = 5.0, every_s: float = 0.5, stop: Callable[[str, int], None] = _stop_now
) -> Iterator[None]:
    """One host's failure ends every process of a multi-process run, each saying which host and why.

    Inside the block, a daemon thread reads the key-value store every ``every_s`` seconds; when another
    process has posted a failure it calls ``stop("error: process <k> of <n> failed: <reason>; process
    <i> stops too", 1)`` (the default prints it and leaves with ``os._exit``: the main thread may wait
    in a collective forever). An exception leaving the block after another process posted a failure
    (e.g. a collective that the failed process left) stops the same way, naming that process. Any
    other exception leaving the block (``SystemExit`` with a non-zero code and
    ``KeyboardInterrupt`` included) is posted (``post_failure``: its type and message, one line); then
    an exception or failed ``SystemExit`` calls ``stop("error: <reason>", 1)`` (``stop("", code)`` for an
    exit whose line was printed: ``launch.cli.fail`` marks it ``printed``) and a ``KeyboardInterrupt``
    is raised on: at once on process 1 and up, after ``grace_s`` seconds on process 0, whose exit
    ends the store the others read. One process: the block runs as it is.
    """
    if jax.process_count() == 1:
        yield
        return
    me, n = jax.process_index(), jax.process_count()
    done = threading.Event()

    def others() -> str:
        """The line naming the first other process that posted a failure ("" when none has)."""
        try:
            failed = {k: v for k, v in posted_failures().items() if k != me}
        except Exception:  # noqa: BLE001 (the coordinator is gone: its own process reports why)
            return ""
        k = min(failed, default=None)
        return "" if k is None else f"error: process {k} of {n} failed: {failed[k]}; process {me} stops too"

    def watch() -> None:
        while not done.wait(every_s):
            if (line := others()) and not done.is_set():
                stop(line, 1)
                return

    watcher = threading.Thread(target=watch, name="failures_shared", daemon=True)
    watcher.start()
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (None, 0):
            raise
        if line := others():  # this error followed another host's (a collective it left): name the cause
            done.set()
            stop(line, 1)
        printed = getattr(e, "printed", None)  # a SystemExit whose line the command printed (launch.cli.fail)
        message = printed or (str(e.code) if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}")
        reason = " ".join(message.removeprefix("error: ").split()) or type(e).__name__
        post_failure(f"{reason} (process {me})" if isinstance(e, KeyboardInterrupt) else reason)
        done.set()
        if me == 0:  # the key-value store lives in this process: the others read the reason first
            time.sleep(grace_s)
        if isinstance(e, KeyboardInterrupt):
            raise
        stop("" if printed else f"error: {reason}", e.code if isinstance(e, SystemExit) and printed else 1)
        raise
    finally:
        done.set()
