"""Shared prompt heads: which rows of a sampler call prefill a common prompt head once.

The G games of a task group start from the same prompt, and on later turns their prompts still
begin with the same head (system prompt, instructions, goal, recipes; the history comes after it).
A plain prefill runs that head once per row. With shared heads, the sampler prefills each distinct
head once (H head rows), copies its KV into the rows that share it, and prefills only each row's
suffix on top (``Qwen2Actor.extend``). This module makes the host-side plan and the head arrays; the
device side is the ``prefill`` program given a ``PromptBatch`` with ``heads`` (``sampling.programs``).

Layout (static shapes): the call's prompt bucket P is split into a head width Th and a suffix width
Ts = P - Th, Ts from a short ladder (32, 128, 512, ...). Row b's cache columns are its head, left-padded
into [0, Th), then its suffix, left-padded into [Th, P); decoding appends at P exactly as after a
plain prefill of P columns, so both paths share the decode program. A row with no partner (its
group has one row, or a head shorter than ``min_tokens``) is split too: its head row is its own.

The plan is taken only when it prefills at most ``MAX_COST_FRACTION`` of the plain path's padded
tokens (H_bucket * Th + B_bucket * Ts versus B_bucket * P); otherwise ``plan_heads`` returns None
and the call prefills as before. Shape letters: B rows, H head rows, P prompt bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "HeadPlan",
    "MAX_COST_FRACTION",
    "MIN_SUFFIX",
    "common_prefix_length",
    "head_arrays",
    "plan_heads",
    "suffix_ladder",
]

MAX_COST_FRACTION = 0.75  # below a 25% saving the extra program (and its compile) is not worth it
MIN_SUFFIX = 32  # the smallest suffix width: a turn's new text and the generation prompt
SUFFIX_STEP = 4  # ladder ratio: few widths, so a run compiles few shared-prefill programs


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """How one sampler call splits its B prompts into shared heads and per-row suffixes.

    Attributes:
      head_width: Th, the head columns (left-padded heads); ``head_width + suffix_width`` = P.
      suffix_width: Ts, the suffix columns (left-padded suffixes).
      heads: the H distinct heads (int32 token arrays of 1..Th tokens), in first-use order.
      row_head: int32[B] each row's head index into ``heads``.
      split: int32[B] each row's head length: row b's suffix is ``prompt[b][split[b]:]`` (1..Ts tokens).
      shared_rows: rows whose head is shared with at least one other row.
      tokens: padded tokens prefilled, H_bucket * Th + B_bucket * Ts (H_bucket = ``head_bucket(H)``).
      plain_tokens: padded tokens of the plain prefill, B_bucket * P.
    """

    head_width: int
    suffix_width: int
    heads: tuple[np.ndarray, ...]
    row_head: np.ndarray
    split: np.ndarray
    shared_rows: int
    tokens: int
    plain_tokens: int


def common_prefix_length(arrays: Sequence[np.ndarray]) -> int:
    """The length of the longest common prefix of 1-D token arrays (the shortest one's length at most)."""
    m = min(a.size for a in arrays)
    if len(arrays) == 1:
        return m
    stacked = np.stack([a[:m] for a in arrays])
    differs = np.any(stacked != stacked[:1], axis=0)
    return int(np.argmax(differs)) if differs.any() else m


def suffix_ladder(prompt_bucket: int) -> tuple[int, ...]:
    """The suffix widths Ts tried for a prompt bucket P: ``MIN_SUFFIX`` times powers of ``SUFFIX_STEP``, up to P / 2."""
    out, ts = [], MIN_SUFFIX
    while 2 * ts <= prompt_bucket:
        out.append(ts)
        ts *= SUFFIX_STEP
    return tuple(out)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def plan_heads(
    arrays: Sequence[np.ndarray],
    groups: Sequence[int],
    prompt_bucket: int,
    batch_bucket: int,
    *,
    min_tokens: int,
    head_bucket: Callable[[int], int] = _pow2_at_least,
) -> HeadPlan | None:
    """The cheapest shared-head split of a call's prompts, or None when it saves too little.

    Args:
      arrays: B prompts, int32 1-D arrays of 1..P tokens.
      groups: B ints: rows with the same value may share a head (the rollout passes each game's task
        group); the shared head of a group is its rows' longest common prefix, less at least one
        token so every row keeps a suffix to run its last token.
      prompt_bucket: P, the call's padded prompt length.
      batch_bucket: the call's padded batch size (>= B).
      min_tokens: (>= 1) the shortest head worth sharing.
      head_bucket: the padded head rows for H heads (the sampler passes its batch bucket); at most
        ``batch_bucket`` rows are charged.

    Returns:
      a ``HeadPlan`` with H <= B heads, or None: for no suffix width Ts on the ladder does a group
      share a head of ``min_tokens`` or more with its suffixes within Ts (a one-token prompt without
      a partner also rules a width out), or the cheapest plan prefills more than
      ``MAX_COST_FRACTION`` of the plain path's tokens. A group is shared at the longest head
      that fits the head width P - Ts; rows of groups that do not fit are their own heads.

    Raises:
      ValueError: ``groups`` not B ints, ``min_tokens`` < 1, a prompt longer than P or empty.
    """
    n = len(arrays)
    if len(groups) != n:
        raise ValueError(f"plan_heads: groups must hold one id per prompt ({n}), got {len(groups)}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"plan_heads: min_tokens must be an int >= 1, got {min_tokens!r}")
    lens = np.array([a.size for a in arrays], np.int64)
    if n and (lens.min() < 1 or lens.max() > prompt_bucket):
        raise ValueError(f"plan_heads: prompts must hold 1..{prompt_bucket} tokens, got {lens.min()}..{lens.max()}")
    members: dict[int, list[int]] = {}
    for r, g in enumerate(groups):
        members.setdefault(int(g), []).append(r)
    # each sharing candidate: (its rows, the longest head it can share: its common prefix less one token)
    candidates = [
        (rows, min(common_prefix_length([arrays[r] for r in rows]), int(lens[rows].min()) - 1))
        for rows in members.values()
        if len(rows) >= 2
    ]
    plain = batch_bucket * prompt_bucket
    best = None
    for ts in suffix_ladder(prompt_bucket):
        th = prompt_bucket - ts
        head_len = np.zeros(n, np.int64)
        owner = np.arange(n)  # the row whose head row b reads (itself when it shares with no one)
        for rows, lcp in candidates:
            h = min(lcp, th)  # a shorter head leaves a longer suffix: fine while it fits Ts
            if h >= min_tokens and int(lens[rows].max()) - h <= ts:
                head_len[rows], owner[rows] = h, rows[0]
        alone = head_len == 0
        if alone.all() or (lens[alone] < 2).any():  # a one-token prompt alone has no head to split off
            continue
        # a row without a partner is its own head, as long as Th allows, with >= 1 token left as its suffix
        head_len[alone] = np.maximum(lens[alone] - ts, 1)
        num_heads = len(set(owner.tolist()))
        cost = min(head_bucket(num_heads), batch_bucket) * th + batch_bucket * ts
        if best is None or cost < best[0]:
            best = (cost, ts, th, head_len, owner)
    if best is None or best[0] > MAX_COST_FRACTION * plain:
        return None
    cost, ts, th, head_len, owner = best
    heads, row_head, slot = [], np.zeros(n, np.int32), {}
    for r in range(n):
        if owner[r] not in slot:
            slot[owner[r]] = len(heads)
            heads.append(np.asarray(arrays[r][: head_len[r]], np.int32))
        row_head[r] = slot[owner[r]]
    shared_rows = int(np.sum(np.bincount(owner, minlength=n)[owner] > 1))
    split = head_len.astype(np.int32)
    return HeadPlan(
        head_width=th,
        suffix_width=ts,
        heads=tuple(heads),
        row_head=row_head,
        split=split,
        shared_rows=shared_rows,
        tokens=int(cost),
        plain_tokens=int(plain),
    )


def head_arrays(plan: HeadPlan, rows: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The plan's heads left-padded into (head_ids, head_mask) int32[rows, Th], ``rows`` >= H (the
    sampler passes the batch bucket of H, at most its rows' bucket); a padding head holds one pad token
    so no attention row is empty."""
    h = len(plan.heads)
    ids = np.full((rows, plan.head_width), pad_id, np.int32)
    mask = np.zeros((rows, plan.head_width), np.int32)
    for i, a in enumerate(plan.heads):
        ids[i, plan.head_width - a.size :] = a
        mask[i, plan.head_width - a.size :] = 1
    mask[h:, -1] = 1
    return ids, mask
