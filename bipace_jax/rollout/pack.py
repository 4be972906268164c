"""The played rows as the learner's arrays: the kept rows (games without a fault, canonical order), their
``TokenBatch`` and fixed-shape ``StepBatch``, and the call's ``HostStats``."""

from __future__ import annotations

import numpy as np

from bipace_jax.batch import TokenBatch
from bipace_jax.buckets import Buckets
from bipace_jax.estimators import StepBatch, assign_ids, similarity_groups
from bipace_jax.rollout.config import RolloutConfig
from bipace_jax.rollout.records import Episode, StepRecord
from bipace_jax.rollout.turns import PROMPT_TOO_LONG
from bipace_jax.stats import HostStats
from environments.pool import ENV_ERRORS

__all__ = ["ERROR_KINDS", "episode_stats", "kept_rows", "step_batch", "token_batch"]

#: Every ``Episode.env_error`` kind, counted in ``stats["env_errors_<kind>"]``.
ERROR_KINDS = (*ENV_ERRORS, PROMPT_TOO_LONG)


def kept_rows(rows: list[StepRecord], episodes: list[Episode], game: str) -> list[StepRecord]:
    """The rows of the games without a fault, in canonical order (group, traj, step).

    Raises:
      RuntimeError: no row is left (every game faulted or was over at reset).
    """
    faulted = {ep.traj_id for ep in episodes if ep.env_error is not None}
    kept = [r for r in rows if r.traj not in faulted]
    if not kept:
        kinds = sorted({str(ep.env_error) for ep in episodes if ep.env_error is not None})
        raise RuntimeError(
            f"collect: no {game} step to train on: {len(rows)} rows played, {len(faulted)} of "
            f"{len(episodes)} games failed (env errors: {kinds or 'none'}), the rest were over at reset"
        )
    # rows of one traj were appended in step order: a stable sort keeps it
    return sorted(kept, key=lambda r: (r.group, r.traj, r.step))


def token_batch(rows: list[StepRecord], length_buckets, pad_id: int) -> tuple[TokenBatch, np.ndarray]:
    """The rows as a ``TokenBatch`` (prompts left-padded with ``pad_id`` to P, the first of
    ``length_buckets`` that holds the longest; responses right-padded with 0 to M) and their sampling
    log-probs float32[N, M] (0 past each response)."""
    n_rows = len(rows)
    width = Buckets.of(length_buckets, "SamplerConfig.length_buckets").fit_or_raise(max(len(r.prompt) for r in rows))
    prompt_ids = np.full((n_rows, width), pad_id, np.int32)
    prompt_mask = np.zeros((n_rows, width), np.int32)
    for k, r in enumerate(rows):
        prompt_ids[k, width - len(r.prompt) :] = r.prompt
        prompt_mask[k, width - len(r.prompt) :] = 1
    response_ids = np.stack([r.tokens for r in rows]).astype(np.int32)
    logprobs = np.stack([r.logprobs for r in rows]).astype(np.float32)
    resp_len = np.array([r.length for r in rows], np.int32)
    response_mask = np.arange(response_ids.shape[1])[None, :] < resp_len[:, None]
    response_ids = np.where(response_mask, response_ids, 0).astype(np.int32)
    batch = TokenBatch(
        np.concatenate([prompt_ids, response_ids], 1),
        np.concatenate([prompt_mask, response_mask.astype(np.int32)], 1),
        response_ids,
        response_mask,
        width,
        policy_version=np.array([r.policy_version for r in rows], np.int32),
    )
    return batch, logprobs


def step_batch(rows: list[StepRecord], num_groups: int, rcfg: RolloutConfig) -> StepBatch:
    """The rows as a ``StepBatch`` of fixed shape per (groups, G, max_steps): padded to the most rows a
    collect can produce (mask False) with static capacities, so the jitted estimator compiles once a run."""
    n_rows = len(rows)
    row_cap = num_groups * rcfg.group_size * rcfg.max_steps

    def padded(values, dtype, fill=0):
        out = np.full((row_cap,) + np.shape(values)[1:], fill, dtype)
        out[:n_rows] = values
        return out

    groups = [r.group for r in rows]
    tree = {}
    if rcfg.branch_turns:  # the tree: each row's sampled row (the first kept row holding that step), fork index
        first: dict[tuple[int, int], int] = {}
        source = [first.setdefault(r.source or (r.traj, r.step), k) for k, r in enumerate(rows)]
        tree = dict(
            source_row=padded(source, np.int32, fill=-1),
            branch=padded([r.branch[-1] if r.branch else 0 for r in rows], np.int32),
        )
    return StepBatch.from_numpy(
        group_id=padded(groups, np.int32),
        traj_id=padded([r.traj for r in rows], np.int32),
        step=padded([r.step for r in rows], np.int32),
        reward=padded([r.reward for r in rows], np.float32),
        penalty=padded([r.penalty for r in rows], np.float32),
        obs_hash=padded(similarity_groups([r.anchor for r in rows], groups, rcfg.similarity_thresh), np.int32),
        fingerprint=padded(np.stack([r.fingerprint for r in rows]), np.float32),
        action_key=padded(assign_ids([r.pace for r in rows]), np.int32, fill=-1),
        mask=padded(np.ones(n_rows, bool), bool, fill=False),
        group_capacity=num_groups,
        row_capacity=-(-rcfg.group_size * rcfg.max_steps // 16) * 16,
        **tree,
    )


def episode_stats(
    counters: dict[str, int], rows: list[StepRecord], episodes: list[Episode], played: int, reset_faults: int
) -> HostStats:
    """``RolloutResult.stats``: the turn counters, rates as (numerator, denominator) and fault counts of
    one call (rows: the kept rows; played: every row, the faulted games' included)."""
    errors = [ep.env_error for ep in episodes if ep.env_error is not None]
    n = len(rows)
    finished = [ep.won for ep in episodes if ep.env_error is None]
    counts = {k: v for k, v in counters.items() if k != "turns"}
    counts.update(
        rows=n,
        env_errors=len(errors),
        **{f"env_errors_{kind}": sum(e == kind for e in errors) for kind in ERROR_KINDS},
        env_error_rows=played - n,
        reset_faults=reset_faults,
    )
    rates = {
        "invalid_rate": (sum(not r.valid for r in rows), n),
        **{f"finish_{why}_rate": (sum(r.finish == why for r in rows), n) for why in ("eos", "stop", "length")},
        "success_rate": (sum(finished), len(finished)),
    }
    maxima = {"turns": counters["turns"], "prompt_tokens_max": max(len(r.prompt) for r in rows)}
    return HostStats(
        {k: int(v) for k, v in counts.items()},
        {k: (float(a), float(b)) for k, (a, b) in rates.items()},
        {k: float(v) for k, v in maxima.items()},
    )
