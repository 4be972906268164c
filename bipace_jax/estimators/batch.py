"""`StepBatch`, the padded batch of step records every estimator reads, and `assign_ids`.

Contract: `docs/estimators.md`, section "Inputs".
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

_INT_FIELDS = ("group_id", "traj_id", "step", "obs_hash", "action_key")
_FINGERPRINT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
_ROW_CAPACITY_MULTIPLE = 16


@flax.struct.dataclass
class StepBatch:
    """N padded step records (one row per (trajectory, step)); a JAX pytree.

    Fields (`docs/estimators.md`, "Inputs"; N rows, D = fingerprint width):
      group_id: int32[N] task group.
      traj_id: int32[N] trajectory, unique across the batch.
      step: int32[N] step index inside the trajectory (0..T-1).
      reward: float32[N] per-step reward (with `penalty` absent, the invalid-action charge already
        subtracted; with `penalty`, the game's part only).
      obs_hash: int32[N] id of the exact anchor observation text (`assign_ids`: equal text, equal id).
      fingerprint: float32 or bfloat16 [N, D] actor hidden state at the last prompt token.
      action_key: int32[N] id of the PACE action key; negative = unparsable (matches no other row).
      mask: bool[N] True for real rows, False for padding (padding may hold anything, NaN included).
      penalty: float32[N] >= 0, the row's invalid-action charge, or None (= zeros). How it enters the
        returns is `EstimatorConfig.penalty` ("Protocol options"); None and zeros give the same result.
      source_row: int32[N] or None (no branching). Branching rollouts (`RolloutConfig.branch_turns`): the
        row that sampled this row's step, the first real row holding it (itself for a sampled row; a
        child game repeats its parent's rows before the fork). Padding: -1. A child's first sampled row
        at step t has parent row `source_row` of its own row at step t-1.
      branch: int32[N] or None: the row's game's sibling index at its latest fork before this step
        (0 before any fork), with `source_row`.
    Static metadata (not traced; part of the pytree structure, so a change recompiles):
      group_capacity: at most this many task groups (the clustering layout's first axis), or None.
      row_capacity: at most this many real rows per task group (the clustering layout's second axis
        and the default cluster capacity K), or None.
    The clustering estimators need both capacities; `from_numpy` sets them. Real rows beyond them are
    not clustered: the jitted path counts their trajectories in the `invalid_rows` diagnostic.
    """

    group_id: jax.Array
    traj_id: jax.Array
    step: jax.Array
    reward: jax.Array
    obs_hash: jax.Array
    fingerprint: jax.Array
    action_key: jax.Array
    mask: jax.Array
    penalty: jax.Array | None = None
    source_row: jax.Array | None = None
    branch: jax.Array | None = None
    group_capacity: int | None = flax.struct.field(pytree_node=False, default=None)
    row_capacity: int | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def num_rows(self) -> int:
        """N, the padded number of rows."""
        return self.reward.shape[0]

    @classmethod
    def from_numpy(
        cls,
        *,
        group_id,
        traj_id,
        step,
        reward,
        obs_hash,
        fingerprint,
        action_key,
        mask=None,
        penalty=None,
        source_row=None,
        branch=None,
        group_capacity: int | None = None,
        row_capacity: int | None = None,
    ) -> StepBatch:
        """Validates host arrays and builds a device `StepBatch`.

        Args:
          group_id, traj_id, step, obs_hash, action_key: integer arrays [N] with values that fit int32.
          reward: floating array [N] (stored as float32).
          fingerprint: floating array [N, D]; float32 and bfloat16 are kept, other floats become float32.
            Non-finite or all-zero rows become degenerate singletons (`docs/estimators.md`, "Clustering").
          mask: bool [N], True for real rows; None means every row is real.
          penalty: floating array [N] (stored as float32), finite and >= 0 on real rows; None: no
            separate penalty (the field stays None).
          source_row, branch: integer arrays [N], both or neither (None: no tree); on real rows
            ``source_row`` indexes a real row whose own ``source_row`` is itself, and ``branch`` >= 0.
          group_capacity: static number of task-group slots; default: the number of task groups.
          row_capacity: static row slots per task group; default: the largest group's real rows
            rounded up to a multiple of 16 (small changes in episode length do not recompile).

        Returns a `StepBatch` of jax arrays with the capacities set.

        Raises:
          ValueError: naming the field, when a field is missing its shape or dtype, lengths differ, a
            value does not fit int32, or a real row has a non-finite reward, a non-finite or negative
            penalty, a negative step, a
            trajectory in two task groups, a duplicate (traj_id, step), steps that are not exactly
            0..T-1, or when the batch exceeds the given capacities.
        """
        raw = dict(
            group_id=group_id,
            traj_id=traj_id,
            step=step,
            reward=reward,
            obs_hash=obs_hash,
            fingerprint=fingerprint,
            action_key=action_key,
        )
        arrays: dict[str, np.ndarray] = {}
        for name, value in raw.items():
            if value is None:
                raise ValueError(f"StepBatch.{name}: missing (expected an array)")
            arrays[name] = np.asarray(value)
        n = arrays["reward"].shape[0] if arrays["reward"].ndim == 1 else -1
        if arrays["reward"].ndim != 1 or n < 1:
            raise ValueError(f"StepBatch.reward: expected shape [N] with N >= 1, got {arrays['reward'].shape}")
        if mask is None:
            arrays["mask"] = np.ones((n,), bool)
        else:
            arrays["mask"] = np.asarray(mask)
            if arrays["mask"].dtype != np.bool_:
                raise ValueError(f"StepBatch.mask: expected dtype bool, got {arrays['mask'].dtype}")

        for name in (*_INT_FIELDS, "reward", "mask"):
            if arrays[name].shape != (n,):
                raise ValueError(f"StepBatch.{name}: expected shape ({n},) like reward, got {arrays[name].shape}")
        for name in _INT_FIELDS:
            a = arrays[name]
            if not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"StepBatch.{name}: expected an integer dtype (int32), got {a.dtype}")
            if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
                raise ValueError(f"StepBatch.{name}: values must fit int32, got range [{a.min()}, {a.max()}]")
            arrays[name] = a.astype(np.int32)
        if not np.issubdtype(arrays["reward"].dtype, np.floating):
            raise ValueError(f"StepBatch.reward: expected a floating dtype (float32), got {arrays['reward'].dtype}")
        arrays["reward"] = arrays["reward"].astype(np.float32)
        if penalty is not None:
            pen = np.asarray(penalty)
            if pen.shape != (n,):
                raise ValueError(f"StepBatch.penalty: expected shape ({n},) like reward, got {pen.shape}")
            if not np.issubdtype(pen.dtype, np.floating):
                raise ValueError(f"StepBatch.penalty: expected a floating dtype (float32), got {pen.dtype}")
            arrays["penalty"] = pen.astype(np.float32)
        if (source_row is None) != (branch is None):
            raise ValueError("StepBatch.source_row and StepBatch.branch: give both (the tree) or neither")
        if source_row is not None:
            arrays.update(_tree_fields(np.asarray(source_row), np.asarray(branch), arrays["mask"], n))
        fp = arrays["fingerprint"]
        if fp.ndim != 2 or fp.shape[0] != n or fp.shape[1] < 1:
            raise ValueError(f"StepBatch.fingerprint: expected shape ({n}, D) with D >= 1, got {fp.shape}")
        if fp.dtype not in _FINGERPRINT_DTYPES:
            if not np.issubdtype(fp.dtype, np.floating):
                raise ValueError(f"StepBatch.fingerprint: expected float32 or bfloat16, got {fp.dtype}")
            fp = fp.astype(np.float32)
        arrays["fingerprint"] = fp

        num_groups, max_rows = _validate_real_rows(arrays)
        if group_capacity is None:
            group_capacity = max(num_groups, 1)
        if row_capacity is None:
            row_capacity = -(-max(max_rows, 1) // _ROW_CAPACITY_MULTIPLE) * _ROW_CAPACITY_MULTIPLE  # round up
        for name, cap, need in (
            ("group_capacity", group_capacity, num_groups),
            ("row_capacity", row_capacity, max_rows),
        ):
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(f"StepBatch.{name}: expected an int >= 1, got {cap!r}")
            if cap < need:
                raise ValueError(f"StepBatch.{name}: the batch needs at least {need}, got {cap}")
        return cls(
            **{k: jnp.asarray(v) for k, v in arrays.items()}, group_capacity=group_capacity, row_capacity=row_capacity
        )


def _tree_fields(source: np.ndarray, branch: np.ndarray, mask: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """Checked int32 ``source_row`` and ``branch`` (the branching tree, see the class docstring)."""
    for name, a in (("source_row", source), ("branch", branch)):
        if a.shape != (n,) or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"StepBatch.{name}: expected an integer array of shape ({n},), got {a.dtype}{a.shape}")
    idx = np.flatnonzero(mask)
    src = source[idx]
    bad = (src < 0) | (src >= n)
    if not bad.any():
        bad = ~mask[src] | (source[src] != src) | (branch[idx] < 0)
    if bad.any():
        i = idx[np.argmax(bad)]
        raise ValueError(
            f"StepBatch.source_row: expected a real row that is its own source (and branch >= 0) on real rows, "
            f"got source_row {source[i]} (branch {branch[i]}) at row {i}"
        )
    return {"source_row": source.astype(np.int32), "branch": branch.astype(np.int32)}


def _validate_real_rows(a: dict[str, np.ndarray]) -> tuple[int, int]:
    """The caller errors on real rows (`docs/estimators.md`, "Inputs"); returns (task groups, max rows/group)."""
    idx = np.flatnonzero(a["mask"])
    if idx.size == 0:
        return 0, 0

    def check(field: str, bad: np.ndarray, expected: str) -> None:
        if bad.any():
            i = idx[np.argmax(bad)]
            raise ValueError(f"StepBatch.{field}: expected {expected} on real rows, got {a[field][i]} at row {i}")

    check("reward", ~np.isfinite(a["reward"][idx]), "finite values")
    if "penalty" in a:
        pen = a["penalty"][idx]
        check("penalty", ~(np.isfinite(pen) & (pen >= 0)), "finite values >= 0")
    step = a["step"][idx]
    check("step", step < 0, "step >= 0")
    g, t = a["group_id"][idx], a["traj_id"][idx]
    order = np.lexsort((g, t))
    ts, gs = t[order], g[order]
    split = (ts[1:] == ts[:-1]) & (gs[1:] != gs[:-1])
    if split.any():
        k = np.argmax(split)
        raise ValueError(
            f"StepBatch.traj_id: trajectory {ts[k]} appears in task groups {gs[k]} and "
            f"{gs[k + 1]} (expected one task group per trajectory)"
        )
    order = np.lexsort((step, t))
    ts, ss = t[order], step[order]
    dup = (ts[1:] == ts[:-1]) & (ss[1:] == ss[:-1])
    if dup.any():
        k = np.argmax(dup)
        raise ValueError(f"StepBatch.step: duplicate (traj_id, step) = ({ts[k]}, {ss[k]}) on real rows")
    first = np.ones(ts.shape, bool)
    first[1:] = ts[1:] != ts[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(ts.size), 0))
    rank = np.arange(ts.size) - start
    gap = ss != rank
    if gap.any():
        k = np.argmax(gap)
        raise ValueError(
            f"StepBatch.step: trajectory {ts[k]} has steps that are not exactly 0..T-1 "
            f"(step {ss[k]} where {rank[k]} was expected)"
        )
    _, group_rows = np.unique(g, return_counts=True)
    return int(group_rows.size), int(group_rows.max())


def assign_ids(values: Iterable[Hashable | None]) -> np.ndarray:
    """Per-batch dictionary ids: equal value -> equal id, in order of first appearance; None -> -1.

    Use it for `obs_hash` (exact anchor observation text) and `action_key` (PACE key; None means
    unparsable). Ids are exact (a dictionary, not a lossy hash), so they are only comparable within
    one batch.

    Args:
      values: an iterable of hashable values (str, int, tuple of token ids, ...) or None.
    Returns:
      int32 numpy array [N].
    Raises:
      ValueError: when a value is not hashable.
    """
    table: dict[Any, int] = {}
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(-1)
            continue
        try:
            out.append(table.setdefault(v, len(table)))
        except TypeError:
            raise ValueError(
                f"assign_ids: values[{i}] is not hashable ({type(v).__name__}); expected str, int, tuple or None"
            ) from None
    return np.asarray(out, dtype=np.int32)
