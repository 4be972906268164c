"""What one ``collect`` call produces: its games (``Episode``), its rows (``StepRecord``) and the
``RolloutResult`` that carries them with their token arrays, ``StepBatch``, statistics and timing."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from bipace_jax.batch import TokenBatch
from bipace_jax.estimators import StepBatch
from bipace_jax.stats import HostStats
from environments.pool import Fault

__all__ = ["Episode", "RolloutResult", "StepRecord", "TIMING_KEYS", "SLOT_TIMING_KEYS"]

#: ``RolloutResult.timing`` of every call (seconds).
TIMING_KEYS = ("sampling_s", "prefill_s", "decode_s", "env_s", "host_s", "total_s")
#: Added by the continuous scheduler (counts, as floats).
SLOT_TIMING_KEYS = ("decode_steps", "chunks", "inserts")


@dataclasses.dataclass
class Episode:
    """One game of a ``collect`` call.

    Attributes:
      task_id, seed: the game played; ``group_id``: its task group; ``traj_id``: its pool env index.
      won: the game reported success. ``length``: steps taken. ``invalid_count``: unparsable responses.
      episode_return: undiscounted sum of the net step rewards (success term minus invalid-action charges).
      env_error: why the game ended early, else None: the pool's ``Fault`` (a ``StrEnum``: "timeout",
        "crash", "exception", "lost") when it failed at reset or mid-game, or the rollout's own
        ``turns.PROMPT_TOO_LONG`` ("prompt_too_long": its prompt did not fit ``max_prompt_length`` even
        with no history). Such a game's rows are left out of the batch (its return is not the game's), it
        is not counted in ``success_rate``. ``env_error_detail``: the account of it (e.g. ``"env 3 raised
        ValueError: TextCraftEnv task 12: step 2 gave reward nan ..."``).
      truncated: ended by ``max_steps`` (or the game's own cap) without success or error.
      score: the game's task score (``info["task_score"]``, WebShop) at the last step, else None.
      task_info: the game's ``task_info`` of the task (e.g. ``goal``, ``depth``).
    """

    task_id: int
    seed: int
    group_id: int
    traj_id: int
    won: bool = False
    length: int = 0
    invalid_count: int = 0
    episode_return: float = 0.0
    env_error: Fault | str | None = None
    env_error_detail: str = ""
    truncated: bool = False
    task_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    score: float | None = None


@dataclasses.dataclass
class StepRecord:
    """One (trajectory, step) row as played: what the prompt showed, what was sampled, what the game got."""

    traj: int
    group: int
    step: int
    reward: float  # the game's part: success_reward * env reward
    penalty: float  # the invalid-action charge, >= 0
    anchor: str
    fingerprint: np.ndarray  # float32[D]
    pace: Any  # the PACE key (action tag text or first token ids)
    prompt: list[int]
    tokens: np.ndarray  # int32[M]
    logprobs: np.ndarray  # float32[M]
    length: int
    text: str  # the decoded response, cut after the stop text
    action: str  # the command sent to the game
    valid: bool  # the response parsed into a valid command (False: the invalid-action path)
    finish: str  # why the response ended: "eos", "stop" (a stop string) or "length" (the token budget)
    label: str | None = None  # collect's labeler's label of the state the prompt showed (DAgger), or None
    observation: str = ""  # the observation text the prompt ends with (transcripts)
    state: Any = None  # the Observation the prompt showed (DAgger records, sft.dagger_records)
    policy_version: int = 0  # the learner updates behind the parameters that sampled it (asynchronous RL)
    # branching rollouts (``RolloutConfig.branch_turns``): the (traj, step) of the row that sampled this step
    # when this row repeats a forked game's prefix in a child (None: sampled by this game), and the game's
    # sibling index at each fork before this step (() without a fork)
    source: tuple[int, int] | None = None
    branch: tuple[int, ...] = ()


@dataclasses.dataclass
class RolloutResult:
    """One ``collect`` call's output; N rows = all (trajectory, step) pairs of the games without a fault,
    in canonical order (ascending group, trajectory, step; ``docs/estimators.md``).

    Attributes:
      tokens: the N rows as one ``TokenBatch`` (prompt left-padded to P = the engine's length bucket of the
        longest prompt, response right-padded to M = ``max_new_tokens``, response ids 0 past the length).
      sample_logprobs: float32[N, M] the engine's log-probs of the sampled tokens, 0 past the length.
      steps: ``StepBatch`` whose first N rows are the token rows (row i = token row i), padded with
        masked rows to ``len(games) * group_size * max_steps`` rows and fixed capacities
        (``group_capacity`` = task groups, ``row_capacity`` = G * max_steps rounded up to 16), so
        its shape, and the estimator's compiled program, is the same every call.
      rows: the N ``StepRecord``s, row i of ``tokens`` and ``steps`` (texts, actions, finish reasons,
        validity, labels, observations and states of the rows).
      episodes: one ``Episode`` per trajectory, in traj order.
      stats: ``stats.HostStats`` (rates as numerator and denominator, ``turns`` and ``prompt_tokens_max``
        as maxima, the rest counts; ``stats.values()`` this host's values): ``truncations`` (prompts whose
        history was cut), ``history_dropped`` (entries cut), ``turns``, ``rows``, ``response_tokens``,
        ``prompt_tokens_max``, ``finish_eos_rate``, ``finish_stop_rate``, ``finish_length_rate`` (why
        responses ended), ``budget_hits`` (responses that used all M tokens without EOS or stop text),
        ``invalid_rate``, ``success_rate`` (of the games without a fault), ``env_errors`` (games that
        ended early: ``Episode.env_error``; ``env_errors_<kind>`` per kind of ``ENV_ERRORS`` and
        ``env_errors_prompt_too_long``, "lost" being a worker mate's fault), ``env_error_rows`` (their rows,
        left out of the batch), ``reset_faults`` (env resets that faulted, including those a retry
        repaired); the continuous scheduler adds ``slot_use`` (busy slot-steps over slot-steps offered).
      timing: seconds (``TIMING_KEYS``): ``sampling_s`` (host time inside engine calls; of which
        ``prefill_s`` and ``decode_s``: lockstep as the engine reports them; continuous ``prefill_s`` the
        inserts' host time, their device time landing in ``decode_s``, the waits for the chunks queued
        behind them), ``env_s`` (pool reset and the host's time in submit / poll, env steps overlapping
        decode not counted), ``host_s`` (prompts, tokenization, parsing, assembling: the rest) and
        ``total_s``; the continuous scheduler adds ``SLOT_TIMING_KEYS`` (counts).
      labeled: ``collect`` was given a labeler (``StepRecord.label`` holds its labels).
    """

    tokens: TokenBatch
    sample_logprobs: np.ndarray
    steps: StepBatch
    rows: list[StepRecord]
    episodes: list[Episode]
    stats: HostStats
    timing: dict[str, float]
    labeled: bool = False

    @property
    def num_rows(self) -> int:
        """N, the played (trajectory, step) rows: the token rows and the first N rows of ``steps``."""
        return self.tokens.rows

    @property
    def prompt_ids(self) -> np.ndarray:
        """int32[N, P] the prompt tokens, left-padded with the pad id."""
        return self.tokens.input_ids[:, : self.tokens.prompt_len]

    @property
    def prompt_mask(self) -> np.ndarray:
        """int32[N, P], 1 on real prompt tokens."""
        return self.tokens.attention_mask[:, : self.tokens.prompt_len]

    @property
    def response_ids(self) -> np.ndarray:
        """int32[N, M] the sampled response tokens, 0 past each response (``tokens.response_ids``)."""
        return self.tokens.response_ids

    @property
    def response_mask(self) -> np.ndarray:
        """bool[N, M], True on the response's tokens, EOS and stop text included (``tokens.response_mask``)."""
        return self.tokens.response_mask

    def row_values(self, values) -> np.ndarray:
        """float32[N] of a per-``steps``-row array (e.g. advantages [num_rows]): its real rows, checked
        against ``steps.mask`` so token rows and step rows cannot drift apart.

        Raises:
          ValueError: ``values`` is not one entry per ``steps`` row, or the real rows are not the first N.
        """
        values = np.asarray(values, np.float32)
        mask = np.asarray(self.steps.mask)
        n = self.num_rows
        if values.shape != mask.shape or not mask[:n].all() or mask[n:].any():
            raise ValueError(
                f"values must have one entry per StepBatch row ({mask.shape}) whose first "
                f"{n} rows are the real ones, got shape {values.shape}, {int(mask.sum())} real rows"
            )
        return values[:n]
