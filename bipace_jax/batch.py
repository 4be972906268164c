"""The token rows from the rollout to the gradient: one ``TokenBatch`` of N rows, cut into ``MicroBatch``es.

Shapes: N rows, P prompt columns (left-padded), M response columns (right-padded), T = P + M,
B micro-batch rows, W a micro-batch's prompt columns.

The rollout emits a ``TokenBatch`` (``RolloutResult.token_batch``); the learner adds the old and
reference log-probs and the advantages with ``with_`` and cuts fixed-shape micro-batches with ``take``.
This module sits below both (NumPy and JAX only), so learning never imports the rollout.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from bipace_jax import sharding

__all__ = ["MicroBatch", "PackedMicroBatch", "TokenBatch", "abstract_micro_batch", "pack_lines"]


@flax.struct.dataclass
class MicroBatch:
    """B rows of one forward (and backward) pass, a pytree (fixed shape; padding rows have all-zero
    response masks and one real prompt token, so no softmax is empty). A field the pass does not need
    is None (the log-prob pass carries no log-probs or advantages)."""

    input_ids: jax.Array  # int32[B, W + M]
    attention_mask: jax.Array  # int32[B, W + M]
    response_ids: jax.Array  # int32[B, M]
    response_mask: jax.Array  # bool[B, M]
    old_logprobs: jax.Array | None = None  # float32[B, M]
    ref_logprobs: jax.Array | None = None  # float32[B, M]
    advantages: jax.Array | None = None  # float32[B]
    sampler_logprobs: jax.Array | None = None  # float32[B, M], for truncated IS (``ppo.tis_cap``)


@flax.struct.dataclass
class PackedMicroBatch:
    """L packed lines of C columns, several rows per line (``TokenBatch.take_packed``), a pytree.

    Each row's real tokens (prompt, then response) are one contiguous run of a line with its own
    segment id (1, 2, ... within the line; 0 = padding); the model attends within a run and restarts
    positions at its start (``Qwen2Actor.forward_packed``). The response tokens of a line's rows are
    R slots: slot r is predicted by the hidden state at column ``head_index[l, r]``. Empty slots have
    ``response_mask`` False and zeros elsewhere.
    """

    input_ids: jax.Array  # int32[L, C]
    segment_ids: jax.Array  # int32[L, C]
    head_index: jax.Array  # int32[L, R]
    response_ids: jax.Array  # int32[L, R]
    response_mask: jax.Array  # bool[L, R]
    old_logprobs: jax.Array | None = None  # float32[L, R]
    ref_logprobs: jax.Array | None = None  # float32[L, R]
    advantages: jax.Array | None = None  # float32[L, R], each slot its row's advantage
    sampler_logprobs: jax.Array | None = None  # float32[L, R]


def pack_lines(
    rows: np.ndarray, tokens: np.ndarray, responses: np.ndarray, width: int, response_width: int
) -> list[list[int]]:
    """Rows packed into lines of at most ``width`` tokens and ``response_width`` response tokens each:
    first fit, longest rows first (deterministic: ties keep ``rows``' order).

    Args:
      rows: int[n] row indices; tokens, responses: int[N] real tokens and response tokens of every row
        (indexed by row index).

    Returns:
      the lines, each a list of row indices in packing order.

    Raises:
      ValueError: a row alone exceeds ``width`` tokens (``ppo.pack_width``) or ``response_width``
        response tokens (``ppo.pack_response_width``).
    """
    rows = np.asarray(rows, np.int64)
    order = rows[np.argsort(-np.asarray(tokens)[rows], kind="stable")]
    lines: list[list[int]] = []
    room: list[list[int]] = []  # [tokens, response tokens] left per line
    for r in order:
        t, m = int(tokens[r]), int(responses[r])
        if t > width:
            raise ValueError(f"pack_lines: row {r} has {t} real tokens > ppo.pack_width={width}")
        if m > response_width:
            raise ValueError(f"pack_lines: row {r} has {m} response tokens > ppo.pack_response_width={response_width}")
        for line, left in zip(lines, room):
            if t <= left[0] and m <= left[1]:
                line.append(int(r))
                left[0] -= t
                left[1] -= m
                break
        else:
            lines.append([int(r)])
            room.append([width - t, response_width - m])
    return lines


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """Host-side arrays of N rows: [prompt (left-padded) | response (right-padded)], and what the
    learner adds to them.

    Attributes:
      input_ids: int32[N, T], T = P + M.
      attention_mask: int32[N, T], 1 on real tokens.
      response_ids: int32[N, M], 0 past each response.
      response_mask: bool[N, M], True on the response's tokens.
      prompt_len: P.
      old_logprobs: float32[N, M] behaviour-policy log-probs of the responses, or None.
      ref_logprobs: float32[N, M] reference-policy log-probs, or None (no KL term).
      advantages: float32[N], one per row, or None.
      sampler_logprobs: float32[N, M] the sampler's log-probs of the responses, or None (needed by
        the truncated importance weights, ``ppo.tis_cap`` > 0).
      policy_version: int32[N], the policy version (learner updates applied) that sampled each row,
        or None (asynchronous RL, ``bipace_jax.async_rl``; the rollout sets it, 0 when synchronous).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    prompt_len: int
    old_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    advantages: np.ndarray | None = None
    sampler_logprobs: np.ndarray | None = None
    policy_version: np.ndarray | None = None

    @property
    def rows(self) -> int:
        """N."""
        return self.input_ids.shape[0]

    def prompt_lengths(self) -> np.ndarray:
        """int64[N] real prompt tokens of each row."""
        return self.attention_mask[:, : self.prompt_len].sum(1).astype(np.int64)

    def with_(self, **fields) -> TokenBatch:
        """A copy with ``old_logprobs`` / ``ref_logprobs`` / ``sampler_logprobs`` (float32[N, M]) and
        ``advantages`` (float32[N]) set (None clears one).

        Raises:
          TypeError: a field other than those four.
          ValueError: an array of another shape.
        """
        n, m = self.response_ids.shape
        want = {"old_logprobs": (n, m), "ref_logprobs": (n, m), "advantages": (n,), "sampler_logprobs": (n, m)}
        unknown = sorted(set(fields) - set(want))
        if unknown:
            raise TypeError(f"TokenBatch.with_: unknown fields {unknown}; expected some of {sorted(want)}")
        for k, v in list(fields.items()):
            if v is not None:
                fields[k] = v = np.asarray(v, np.float32)
                if v.shape != want[k]:
                    raise ValueError(f"TokenBatch.with_: {k} must have shape {want[k]}, got {v.shape}")
        return dataclasses.replace(self, **fields)

    def take(self, rows: np.ndarray, width: int, size: int) -> MicroBatch:
        """The micro-batch of ``rows`` (int indices, at most ``size``): the prompt part cut, or left-padded
        with masked zero columns, to ``width`` columns (positions come from the mask, so the values do
        not depend on it), the rows padded to ``size``; NumPy arrays.

        Raises:
          ValueError: more than ``size`` rows.
        """
        rows = np.asarray(rows, np.int64)
        if len(rows) > size:
            raise ValueError(f"TokenBatch.take: {len(rows)} rows do not fit a micro-batch of {size}")
        p = self.prompt_len

        def cols(x):
            x = x[rows]
            if width <= p:
                return _pad_rows(x[:, p - width :], size)
            return _pad_rows(np.concatenate([np.zeros((len(rows), width - p), x.dtype), x], 1), size)

        att = cols(self.attention_mask)
        att[:, -1] |= att.sum(1) == 0  # padding rows get one real token (no empty softmax)
        opt = {
            k: None if getattr(self, k) is None else _pad_rows(getattr(self, k)[rows], size)
            for k in ("old_logprobs", "ref_logprobs", "advantages", "sampler_logprobs")
        }
        return MicroBatch(
            input_ids=cols(self.input_ids),
            attention_mask=att,
            response_ids=_pad_rows(self.response_ids[rows], size),
            response_mask=_pad_rows(self.response_mask[rows], size),
            **opt,
        )

    def real_tokens(self) -> np.ndarray:
        """int64[N] real tokens (prompt and response) of each row."""
        return self.attention_mask.sum(1).astype(np.int64)

    def take_packed(
        self, lines: list[list[int]], width: int, response_width: int, num_lines: int
    ) -> tuple[PackedMicroBatch, np.ndarray, np.ndarray]:
        """The packed micro-batch of ``lines`` (``pack_lines``), padded to ``num_lines`` lines of
        ``width`` columns and ``response_width`` response slots; NumPy arrays.

        Returns:
          (micro-batch, slot_rows int64[L, R], slot_cols int64[L, R]): the row and response column of
          each slot (-1 for an empty slot), to scatter per-slot values back to [N, M].

        Raises:
          ValueError: more than ``num_lines`` lines, a line over ``width`` / ``response_width``, or a
            response token whose column is not a real token of ``attention_mask``.
        """
        if len(lines) > num_lines:
            raise ValueError(f"TokenBatch.take_packed: {len(lines)} lines do not fit a micro-batch of {num_lines}")
        L, C, R, P = num_lines, width, response_width, self.prompt_len
        ids = np.zeros((L, C), np.int32)
        seg = np.zeros((L, C), np.int32)
        head = np.zeros((L, R), np.int32)
        resp = np.zeros((L, R), np.int32)
        rmask = np.zeros((L, R), bool)
        slot_rows = np.full((L, R), -1, np.int64)
        slot_cols = np.full((L, R), -1, np.int64)
        for i, line in enumerate(lines):
            o = s = 0
            for k, r in enumerate(line):
                real = np.flatnonzero(self.attention_mask[r])
                n, cols = len(real), np.flatnonzero(self.response_mask[r])
                if o + n > C or s + len(cols) > R:
                    raise ValueError(f"TokenBatch.take_packed: line {i} overflows width {C} / response width {R}")
                ids[i, o : o + n] = self.input_ids[r, real]
                seg[i, o : o + n] = k + 1
                at = np.searchsorted(real, P + cols)
                if len(cols) and not np.array_equal(real[np.minimum(at, n - 1)], P + cols):
                    raise ValueError(f"TokenBatch.take_packed: row {r} has response tokens outside attention_mask")
                sl = slice(s, s + len(cols))
                head[i, sl] = o + at - 1  # the column before a token predicts it
                resp[i, sl] = self.response_ids[r, cols]
                rmask[i, sl] = True
                slot_rows[i, sl], slot_cols[i, sl] = r, cols
                o, s = o + n, s + len(cols)
        valid = slot_rows >= 0
        r_, c_ = np.maximum(slot_rows, 0), np.maximum(slot_cols, 0)

        def per_slot(x):
            return None if x is None else np.where(valid, x[r_, c_], 0.0).astype(np.float32)

        adv = None if self.advantages is None else np.where(valid, self.advantages[r_], 0.0).astype(np.float32)
        mb = PackedMicroBatch(
            input_ids=ids,
            segment_ids=seg,
            head_index=head,
            response_ids=resp,
            response_mask=rmask,
            old_logprobs=per_slot(self.old_logprobs),
            ref_logprobs=per_slot(self.ref_logprobs),
            advantages=adv,
            sampler_logprobs=per_slot(self.sampler_logprobs),
        )
        return mb, slot_rows, slot_cols


def abstract_micro_batch(
    mesh,
    rows: int,
    width: int,
    response: int,
    *,
    logprobs: bool = True,
    reference: bool = True,
    sampler: bool = False,
) -> MicroBatch:
    """A ``MicroBatch`` of ``jax.ShapeDtypeStruct``s with rows split over ``mesh``'s ("data", "fsdp") axes.

    Args:
      mesh: the mesh the micro-batch is placed on (``sharding.batch_sharding``).
      rows, width, response: B, W, M.
      logprobs: with ``old_logprobs`` and ``advantages`` (the gradient pass); False: the log-prob pass.
      reference: with ``ref_logprobs`` (only when ``logprobs``).
      sampler: with ``sampler_logprobs`` (only when ``logprobs``; truncated IS, ``ppo.tis_cap`` > 0).
    """

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape)))

    lp = sds((rows, response), np.float32)
    return MicroBatch(
        input_ids=sds((rows, width + response), np.int32),
        attention_mask=sds((rows, width + response), np.int32),
        response_ids=sds((rows, response), np.int32),
        response_mask=sds((rows, response), np.bool_),
        old_logprobs=lp if logprobs else None,
        ref_logprobs=lp if logprobs and reference else None,
        advantages=sds((rows,), np.float32) if logprobs else None,
        sampler_logprobs=lp if logprobs and sampler else None,
    )


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` [n, ...] with zero rows appended to ``rows`` (always a new array)."""
    x = np.asarray(x)
    if x.shape[0] == rows:
        return x.copy()
    return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)], 0)
