"""Device mesh, logical axes and their mapping to mesh axes; knows nothing about any model.

Mesh axes (`MESH_AXES`, all `AxisType.Auto`: XLA's propagation places the collectives): ``data``
splits the batch; ``fsdp`` splits the batch and every parameter along its embedding dimension;
``tensor`` splits attention heads, the MLP width and the vocabulary (Megatron-style).

Every array dimension has a *logical axis* name ("batch", "embed", ...) that `LOGICAL_TO_MESH` maps to
mesh axes. Models declare each parameter's logical axes as `nnx.Param(value, logical_axes=(...))`
metadata, which `param_shardings` reads back; `constrain` pins an activation's sharding when a mesh is
set (`jax.set_mesh`) and does nothing otherwise. A mesh axis that does not divide a dimension is
dropped for it (replicated), never an error or an uneven split. No pmap: `jax.jit` with `NamedSharding`.

On several hosts `make_mesh` keeps every tensor group inside one host and gives each host one
contiguous block of the batch shards; `check_placement` asserts both from ``mesh.devices``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax.config import ConfigError, check_tensor_in_host

__all__ = [
    "MESH_AXES",
    "LOGICAL_TO_MESH",
    "LOGICAL_AXES_KEY",
    "make_mesh",
    "host_mesh",
    "process_devices",
    "PlacementError",
    "placement",
    "check_placement",
    "mesh_axis_sizes",
    "logical_to_spec",
    "logical_sharding",
    "shard_shape",
    "logical_axes",
    "param_shardings",
    "shard_params",
    "current_mesh",
    "constrain",
    "gather_param",
    "batch_sharding",
]

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_TO_MESH: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "cache_seq": None,
    "embed": "fsdp",  # parameters: FSDP splits D; activations keep D whole ("act_embed").
    "act_embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "norm": None,
}

# The nnx.Variable metadata field holding a parameter's logical axes (one name or None per dim).
# Not flax's own `out_sharding`: that one names mesh axes and shards eagerly at creation.
LOGICAL_AXES_KEY = "logical_axes"


# --------------------------------------------------------------------------------------------------
# Meshes.
def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` with axes ("data", "fsdp", "tensor") of the given sizes (Auto axis types), laid out by host.

    One size may be -1: it takes all remaining devices. The product must equal the device count.

    One process (every device has the same ``process_index``): ``jax.make_mesh``'s ICI-friendly order.
    Several processes (``jax.distributed``, or a TPU topology's devices): each process's devices form
    whole tensor groups and one contiguous block of the flattened batch axes (``data`` x ``fsdp``,
    row-major, process order): ``mesh_utils.create_hybrid_device_mesh`` with a per-host mesh
    ``(1, local_devices / tensor, tensor)`` in ICI order over the across-host mesh ``(1, processes, 1)``,
    reshaped to ``(data, fsdp, tensor)``. Process p then holds batch shards
    ``[p * k, (p + 1) * k)`` with ``k = data * fsdp / processes``, so the tensor all-reduces stay on
    the host's links and each host feeds only its own rows (`check_placement`).

    Args:
      data, fsdp, tensor: axis sizes (ints >= 1, or one -1).
      devices: the devices (default ``jax.devices()``); any order, any platform; devices carry
        ``process_index`` (missing: 0).

    Several slices (multi-slice TPU: devices carry ``slice_index``): processes come in slice order,
    so each slice holds ``data / slices`` consecutive data rows; fsdp and tensor never leave a slice.

    Raises:
      ValueError: a size is 0 or < -1, more than one is -1, the product does not equal the number of
        devices, or the processes hold different numbers of devices.
      bipace_jax.config.ConfigError: several processes and ``tensor`` does not divide the devices of
        one host (``config.mesh.tensor``; see ``config.check_tensor_in_host``), or ``data`` is not a
        multiple of the slice count (``config.mesh.data``).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, s in sizes.items():
        if not isinstance(s, (int, np.integer)) or s == 0 or s < -1:
            raise ValueError(f"mesh axis {name!r} size must be a positive int or -1, got {s!r}")
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis size may be -1, got {free}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if len(devices) % known:
            raise ValueError(
                f"mesh: {len(devices)} devices are not divisible by the fixed axis sizes {sizes} (product {known})"
            )
        sizes[free[0]] = len(devices) // known
    shape = tuple(int(sizes[n]) for n in MESH_AXES)
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"mesh shape data*fsdp*tensor={shape} has {math.prod(shape)} devices, "
            f"expected the device count {len(devices)}"
        )
    hosts = process_devices(devices)
    if len(hosts) == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    counts = {p: len(d) for p, d in hosts.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"mesh: every process must hold the same number of devices, got {counts} (process: devices)")
    local = len(devices) // len(hosts)
    check_tensor_in_host(shape[2], len(hosts), local)
    slices = len({_slice_of(d) for d in devices})
    if shape[0] % slices:
        # data parallel is the only axis that crosses slices (DCN); fsdp and tensor stay on ICI
        raise ConfigError(
            f"config.mesh.data: expected a multiple of the {slices} slices the devices span (data parallel "
            f"runs across slices over the data-center network; fsdp and tensor stay inside a slice), got {shape[0]}"
        )
    per_host, across = (1, local // shape[2], shape[2]), (1, len(hosts), 1)
    # split physical axes: a host's 2x2 chips give a 4-long batch block when tensor is 1
    grid = mesh_utils.create_hybrid_device_mesh(
        per_host, across, devices, process_is_granule=True, allow_split_physical_axes=True
    )
    return Mesh(grid.reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def host_mesh(mesh: Mesh, tensor: int = 0, process: int = 0) -> Mesh:
    """The mesh one host samples on (sampler, reference copy, log-prob forwards): process
    ``process``'s devices of ``mesh`` in ``mesh``'s own device order, regrouped as
    ``(data = local devices / tensor, fsdp 1, tensor)``.

    With ``tensor`` equal to ``mesh``'s (or 0) the rows are the host's own tensor groups of ``mesh``,
    so its shards are the host copy's with no move; a different ``tensor`` groups consecutive devices
    of the host's ICI-ordered block (`make_mesh`), e.g. a v5e host's 2x2 chips for ``tensor=4`` under
    a pure-FSDP training mesh. One process with ``tensor`` equal to ``mesh``'s: ``mesh`` itself.

    Raises:
      ValueError: ``tensor`` does not divide the process's device count, or the process holds no
        device of ``mesh``.
    """
    t = int(tensor) or mesh_axis_sizes(mesh)["tensor"]
    flat = list(np.asarray(mesh.devices).flat)
    if t == mesh_axis_sizes(mesh)["tensor"] and len(process_devices(flat)) == 1:
        return mesh
    mine = [d for d in flat if int(getattr(d, "process_index", 0)) == process]
    if not mine or len(mine) % t:
        raise ValueError(
            f"host_mesh: process {process} holds {len(mine)} devices of the mesh, not a multiple of tensor={t}"
        )
    return Mesh(np.array(mine, dtype=object).reshape(len(mine) // t, 1, t), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _slice_of(device: Any) -> int:
    """A device's slice (multi-slice TPU: ``slice_index``; any other device: 0)."""
    return int(getattr(device, "slice_index", 0) or 0)


def process_devices(devices: Sequence[Any]) -> dict[int, list[Any]]:
    """{process_index: its devices in the given order}, processes in increasing order (missing index: 0)."""
    out: dict[int, list[Any]] = {}
    for d in devices:
        out.setdefault(int(getattr(d, "process_index", 0)), []).append(d)
    return dict(sorted(out.items()))


class PlacementError(ValueError):
    """A mesh whose tensor groups or batch shards are split across processes (hosts)."""


def placement(mesh: Mesh) -> dict[str, Any]:
    """How ``mesh``'s devices (axes data, fsdp, tensor) sit on processes, read from ``mesh.devices``.

    A *batch shard* is one (data, fsdp) position: the rows ``batch_sharding`` gives its tensor group.
    Shards are numbered row-major over (data, fsdp), as ``P(("data", "fsdp"))`` splits the rows.

    Returns:
      A JSON-able dict: ``tensor_groups_in_one_process`` (every tensor group's devices share one
      ``process_index``), ``batch_shards_disjoint`` (no batch shard is held by two processes),
      ``batch_blocks_contiguous`` (each process holds one run of consecutive shards, as
      ``jax.make_array_from_process_local_data`` needs), ``process_batch_shards`` ({process: [first,
      last + 1)} of its shards, or the sorted list of them when not contiguous), ``device_process``
      ({device id: process_index}), ``processes`` (count) and ``crossing_tensor_groups`` (the first
      few (data, fsdp) positions whose tensor group spans processes), ``slices`` (multi-slice TPU:
      how many ``slice_index`` values) and ``data_rows_in_one_slice`` (each data index's fsdp x tensor
      block lies in one slice, so only the data axis crosses the data-center network).
    """
    grid = np.asarray(mesh.devices)
    sizes = mesh_axis_sizes(mesh)
    groups = grid.reshape(sizes["data"] * sizes["fsdp"], sizes["tensor"])
    procs = np.vectorize(lambda d: int(getattr(d, "process_index", 0)), otypes=[int])(groups)
    crossing = [int(b) for b in np.flatnonzero((procs != procs[:, :1]).any(1))]
    holders: dict[int, list[int]] = {}  # process -> batch shards it holds (any device of the group)
    for b, row in enumerate(procs):
        for p in sorted(set(row.tolist())):
            holders.setdefault(p, []).append(b)
    held = [b for shards in holders.values() for b in shards]
    contiguous = all(s == list(range(s[0], s[-1] + 1)) for s in holders.values())
    blocks = {
        str(p): ([s[0], s[-1] + 1] if s == list(range(s[0], s[-1] + 1)) else s) for p, s in sorted(holders.items())
    }
    slice_of = np.vectorize(_slice_of, otypes=[int])(grid)  # [data, fsdp, tensor]
    return dict(
        processes=len(holders),
        slices=len(np.unique(slice_of)),
        data_rows_in_one_slice=bool((slice_of == slice_of[:, :1, :1]).all()),
        tensor_groups_in_one_process=not crossing,
        batch_shards_disjoint=len(held) == len(set(held)),
        batch_blocks_contiguous=contiguous,
        process_batch_shards=blocks,
        crossing_tensor_groups=[list(divmod(b, sizes["fsdp"])) for b in crossing[:4]],  # (data, fsdp) positions
        device_process={str(d.id): int(getattr(d, "process_index", 0)) for d in grid.flat},
    )


def check_placement(mesh: Mesh) -> dict[str, Any]:
    """`placement` of ``mesh``, asserted: every tensor group in one process, different processes'
    batch shards disjoint and each process's block contiguous. Returns the `placement` dict.

    Without this, on several hosts the tensor all-reduces cross hosts, and two hosts feed different
    rows into replicas of one batch shard (silently wrong gradients).

    Raises:
      PlacementError: a check fails (the message names the positions and the processes); build the
        mesh with `make_mesh`.
    """
    info = placement(mesh)
    problems = []
    if not info["tensor_groups_in_one_process"]:
        problems.append(f"tensor groups at (data, fsdp) {info['crossing_tensor_groups']} span several processes")
    if not info["batch_shards_disjoint"]:
        problems.append("several processes hold the same batch shard")
    if not info["batch_blocks_contiguous"]:
        problems.append(f"a process's batch shards are not consecutive: {info['process_batch_shards']}")
    if not info["data_rows_in_one_slice"]:
        problems.append(f"an fsdp x tensor block spans several of the {info['slices']} slices (only data may)")
    if problems:
        raise PlacementError(
            f"mesh {dict(mesh_axis_sizes(mesh))} over {info['processes']} processes: " + "; ".join(problems) + ". "
            "Each host must hold whole tensor groups and one contiguous block of the batch axes "
            "(build the mesh with bipace_jax.sharding.make_mesh)"
        )
    return info


def mesh_axis_sizes(mesh: Mesh | Mapping[str, int] | Any) -> dict[str, int]:
    """{axis name: size} of a `Mesh` (concrete or abstract) or of a mapping of sizes (missing axes: 1)."""
    if isinstance(mesh, Mapping):
        return {n: int(mesh.get(n, 1)) for n in MESH_AXES}
    return dict(zip(mesh.axis_names, mesh.axis_sizes)) if hasattr(mesh, "axis_sizes") else dict(mesh.shape)


# --------------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec / NamedSharding.
def logical_to_spec(
    logical: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh | Mapping[str, int] | Any,
    rules: Mapping[str, Any] | None = None,
) -> P:
    """The `PartitionSpec` for an array of `shape` whose dims have the `logical` axis names.

    Mesh axes that are absent from the mesh, of size 1, already used by an earlier dim, or that do
    not divide the dim are dropped (that dim is replicated along them).

    Raises:
      ValueError: `logical` and `shape` have different lengths, or a logical name is unknown.
    """
    rules = LOGICAL_TO_MESH if rules is None else rules
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match the array rank of shape {tuple(shape)}")
    sizes = mesh_axis_sizes(mesh)
    used: set[str] = set()
    out = []
    for name, dim in zip(logical, shape):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(rules)}")
        target = rules[name]
        targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        kept = []
        remaining = dim
        for ax in targets:
            size = sizes.get(ax, 1)
            if size <= 1 or ax in used or remaining % size:
                continue
            kept.append(ax)
            used.add(ax)
            remaining //= size
        out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return P(*out)


def logical_sharding(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """The `NamedSharding` on `mesh` of an array of `shape` with the `logical` axis names."""
    return NamedSharding(mesh, logical_to_spec(logical, shape, mesh))


def shard_shape(shape: Sequence[int], spec: P, mesh: Mesh | Mapping[str, int] | Any) -> tuple[int, ...]:
    """The largest per-device block of an array of `shape` split by `spec` (dims ceil-divided)."""
    sizes = mesh_axis_sizes(mesh)
    out = list(shape)
    for i, entry in enumerate(spec):
        for ax in () if entry is None else ((entry,) if isinstance(entry, str) else entry):
            out[i] = -(-out[i] // sizes[ax])
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# Parameters: logical axes declared as nnx.Variable metadata at creation.
def _is_variable(x: Any) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Variable)


def logical_axes(variable: Any) -> tuple[str | None, ...]:
    """The logical axes an `nnx.Variable` was created with (its `LOGICAL_AXES_KEY` metadata).

    Raises:
      KeyError: the variable carries no logical axes.
    """
    axes = variable.get_metadata(LOGICAL_AXES_KEY, None)
    if axes is None:
        raise KeyError(
            f"{type(variable).__name__} of shape {getattr(variable, 'shape', '?')} was created without "
            f"{LOGICAL_AXES_KEY}= metadata (declare it where the module creates the parameter)"
        )
    return tuple(axes)


def param_shardings(state: Any, mesh: Mesh) -> Any:
    """A pytree like the nnx `state` (Variables of arrays or `jax.ShapeDtypeStruct`s) whose Variables
    hold the `NamedSharding` of their logical axes on `mesh` (for `jax.device_put`, `jax.jit`).

    Raises:
      KeyError: a Variable carries no logical axes.
    """

    def one(v):
        return v.replace(logical_sharding(logical_axes(v), v.shape, mesh))

    return jax.tree.map(one, state, is_leaf=_is_variable)


def shard_params(model: Any, mesh: Mesh) -> Any:
    """Moves every `nnx.Param` of `model` to its `NamedSharding` on `mesh` (in place); returns model."""
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh)))
    return model


# --------------------------------------------------------------------------------------------------
# Activations.
def current_mesh() -> Any:
    """The abstract mesh set by `jax.set_mesh` when it has any of `MESH_AXES`; None otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", True) or not set(MESH_AXES) & set(mesh.axis_names):
        return None
    return mesh


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` of activation `x` to its logical `axes` when a mesh is set.

    Without a current mesh (`jax.set_mesh`) this returns `x` unchanged, so a model runs the same
    on one device.
    """
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(tuple(axes), x.shape, mesh))


def gather_param(w: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """FSDP all-gather of a parameter at its point of use, when a mesh is set.

    Constrains `w` to its logical axes with "embed" (the FSDP-split dimension) replicated, so XLA
    gathers the weight over "fsdp" and keeps activations split over the batch, instead of
    resharding activations to follow the weight. Tensor-parallel splits are kept. No-op without
    a mesh.
    """
    mesh = current_mesh()
    if mesh is None:
        return w
    axes = tuple(None if a == "embed" else a for a in logical)
    return jax.lax.with_sharding_constraint(w, logical_to_spec(axes, w.shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """`NamedSharding` splitting dim 0 (the batch) over ("data", "fsdp"), other dims replicated.

    Use it to `jax.device_put` input_ids/attention_mask [B, T] (ndim=2) or per-row arrays [B]
    (ndim=1); B must be divisible by data*fsdp.
    """
    return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))
