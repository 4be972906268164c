"""Surface-text step groups: verl-agent's similarity grouping of anchor observations (host side).

`similarity_groups` is the `obs_hash` the rollout hands the jitted estimators when
`EstimatorConfig.similarity_thresh > 0` (`docs/estimators.md`, "Similarity grouping"): the same
step groups verl-agent's `build_step_group(..., enable_similarity=True, similarity_thresh=t)`
builds (`gigpo/core_gigpo.py`), so GiGPO's step level is unchanged and only its groups differ.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence

import numpy as np

from bipace_jax.estimators.batch import assign_ids


def similarity_groups(observations: Sequence[str], task_group_ids, threshold: float) -> np.ndarray:
    """Step-group ids of verl-agent's greedy text-similarity clustering; int32[N].

    Inside each task group, rows are visited in the order given (the rollout passes its canonical
    order: ascending group, trajectory, step, which is the order verl-agent's rollout loop gathers
    rows in: env index (envs of one task are adjacent), then step). A row joins the first cluster,
    in order of creation, whose first observation `rep` has
    `difflib.SequenceMatcher(None, observation, rep).ratio() >= threshold` (that argument order:
    `ratio` is not symmetric), else it opens a new cluster. Rows of different task groups never
    share a cluster. verl-agent's trainer may re-order rows before its advantage step
    (`trainer.balance_batch` sorts them by token count across data-parallel ranks); the greedy rule
    depends on order, so such a run can group differently from the gathered order used here.

    Exact shortcuts that do not change the result: an observation equal to one seen before in the
    group takes that one's cluster (representatives never change and clusters are only appended,
    so it fails the same earlier clusters), and a cluster whose `real_quick_ratio`/`quick_ratio`
    upper bound is below `threshold` is skipped without computing `ratio`.

    Args:
      observations: [N] anchor observation texts (str), in row order.
      task_group_ids: [N] integer task-group ids (`StepBatch.group_id`).
      threshold: 0.0 for exact groups (equal text, equal id: `assign_ids(observations)`), or a
        float in (0, 1): the similarity ratio a row needs against a cluster's first observation.

    Returns:
      int32 numpy array [N] of step-group ids, dense in [0, number of clusters), numbered in order
      of first appearance; only compared within one task group (it is `StepBatch.obs_hash`; GiGPO
      groups by `(group_id, obs_hash)`).

    Raises:
      ValueError: a threshold that is not a float in [0, 1) (`EstimatorConfig.similarity_thresh`),
        an observation that is not a str, or `task_group_ids` of another length than
        `observations` or not 1-D integers.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"similarity_groups: threshold must be a float in [0, 1), got {threshold!r}")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"similarity_groups: threshold must be in [0, 1) (0 = exact groups), got {threshold!r}")
    obs = list(observations)
    for i, o in enumerate(obs):
        if not isinstance(o, str):
            raise ValueError(f"similarity_groups: observations[{i}] must be a str, got {type(o).__name__}")
    groups = np.asarray(task_group_ids)
    if groups.ndim != 1 or groups.shape[0] != len(obs):
        raise ValueError(
            f"similarity_groups: task_group_ids must be 1-D with {len(obs)} entries (one per observation), "
            f"got shape {groups.shape}"
        )
    if groups.size and not np.issubdtype(groups.dtype, np.integer):
        raise ValueError(f"similarity_groups: task_group_ids must be integers, got dtype {groups.dtype}")
    if threshold == 0.0:
        return assign_ids(obs)

    out = np.empty(len(obs), np.int32)
    # Per task group: one SequenceMatcher per cluster with the representative as seq2 (its index
    # is built once), and the cluster of every distinct text seen so far.
    matchers: dict[int, list[difflib.SequenceMatcher]] = {}
    first_ids: dict[int, list[int]] = {}
    seen: dict[tuple[int, str], int] = {}
    next_id = 0
    for i, (g, text) in enumerate(zip(groups.tolist(), obs)):
        hit = seen.get((g, text))
        if hit is None:
            clusters = matchers.setdefault(g, [])
            ids = first_ids.setdefault(g, [])
            for m, cid in zip(clusters, ids):
                m.set_seq1(text)
                if m.real_quick_ratio() >= threshold and m.quick_ratio() >= threshold and m.ratio() >= threshold:
                    hit = cid
                    break
            if hit is None:
                clusters.append(difflib.SequenceMatcher(None, text, text))
                ids.append(next_id)
                hit = next_id
                next_id += 1
            seen[(g, text)] = hit
        out[i] = hit
    return out
