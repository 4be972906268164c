"""The metric keys of a run's records (``metrics.jsonl``), defined once for producers and consumers.

Keys are ``<section>/<name>``. The trainer writes them; ``plots.make_plots``, ``launch.report`` and
``launch.sweep`` read them. Validation panels are named ``VAL`` (goals from the training set) and
``VAL_HOLDOUT`` (held-out goals); the validation before any update is recorded with iteration 0
under ``VAL_BEFORE`` (``before``/``after`` map the two). Imports nothing from the library.

``TABLE`` describes every key a run records (``<...>`` stands for a name part); ``docs/metrics.md`` is
generated from it (``markdown_table``) and a test fails when the page is stale. ``x_of`` is the one
rule for the x of a record's key, "iterations completed": a training record of iteration ``i`` was
played by the policy after ``i`` updates (x = i), its validation after ``i + 1`` (x = i + 1), the
before-RL validation at 0.
"""

from __future__ import annotations

import dataclasses
import re

ITERATION = "iteration"

# Validation panels (prefixes) and the before-training copy of the first validation.
VAL = "val"
VAL_HOLDOUT = "val/holdout"
VAL_BEFORE = "val_before"

TRAIN_SUCCESS = "train/success_rate"
VAL_SUCCESS = "val/success_rate"
VAL_HOLDOUT_SUCCESS = "val/holdout/success_rate"
TASK_CURSOR = "train/task_cursor"
OPTIMIZER_STEPS = "train/optimizer_steps"
LOGPROB_GAP = "rollout/logprob_gap"
# Asynchronous RL (bipace_jax.async_rl): rows' policy-version lag behind the learner, the weight push.
ASYNC_LAG_MEAN = "async/version_lag_mean"
ASYNC_LAG_MAX = "async/version_lag_max"
ASYNC_PUSH_SECONDS = "async/weight_push_s"
# ... by process (bipace_jax.async_processes): the sampler's pull of the weights, the rows' transfer.
ASYNC_PULL_SECONDS = "async/weight_pull_s"
ASYNC_ROWS_SEND_SECONDS = "async/rows_send_s"
ASYNC_ROWS_RECEIVE_SECONDS = "async/rows_receive_s"
ASYNC_ROWS_BYTES = "async/rows_bytes"

EPSILON = "estimator/epsilon"
CALIBRATION_RATE = "estimator/calibration_singleton_rate"  # + "/<epsilon>"
HASH_SINGLETON_GROUPS = "estimator/hash_singleton_group_rate"
CLUSTER_SINGLETON_GROUPS = "estimator/cluster_singleton_group_rate"
PACE_ROWS = "estimator/pace_row_rate"
LOO_ROWS = "estimator/loo_row_rate"
SINGLETON_ROWS = "estimator/singleton_row_rate"
PAIRS = "estimator/pairs"

ITERATION_SECONDS = "time/iteration_s"
VALIDATION_SECONDS = "time/validation_s"
PREVIOUS_CHECKPOINT_SECONDS = "time/previous_checkpoint_s"
BIPACE_SHARE = "time/bipace_share"  # estimator stage seconds / iteration seconds


def stage_seconds(stage: str) -> str:
    """The key of a stage's wall seconds: ``"rollout"`` -> ``"time/rollout_s"``."""
    return f"time/{stage}_s"


def before(key: str) -> str:
    """A validation record's key as recorded before training: its first section becomes
    ``VAL_BEFORE`` (``"val/x"`` -> ``"val_before/x"``, ``"val/holdout/x"`` -> ``"val_before/holdout/x"``,
    ``"time/validation_s"`` -> ``"val_before/validation_s"``).

    Raises:
      ValueError: ``key`` has no section (no "/").
    """
    section, sep, rest = key.partition("/")
    if not sep:
        raise ValueError(f"metric_keys.before: expected a '<section>/<name>' key, got {key!r}")
    return f"{VAL_BEFORE}/{rest}"


def after(key: str) -> str:
    """A ``VAL_BEFORE`` key as the validation key it copies: ``"val_before/x"`` -> ``"val/x"``.

    Raises:
      ValueError: ``key`` is not under ``VAL_BEFORE``.
    """
    if not key.startswith(VAL_BEFORE + "/"):
        raise ValueError(f"metric_keys.after: expected a key under {VAL_BEFORE + '/'!r}, got {key!r}")
    return VAL + key[len(VAL_BEFORE) :]


def x_of(key: str, iteration: int) -> int:
    """Iterations completed when ``key`` of iteration ``iteration``'s record was measured: 0 for
    ``VAL_BEFORE/*``, ``iteration + 1`` for ``val/*`` and ``time/validation_s``, else ``iteration``."""
    if key.startswith(VAL_BEFORE + "/"):
        return 0
    if key.startswith(VAL + "/") or key == VALIDATION_SECONDS:
        return int(iteration) + 1
    return int(iteration)


def series_of(key: str) -> str:
    """The series a key is drawn in: ``VAL_BEFORE/*`` joins its ``val/*`` series (``after``), and
    ``val_before/validation_s`` joins ``time/validation_s``; other keys are their own series."""
    if key == VAL_BEFORE + "/validation_s":
        return VALIDATION_SECONDS
    return after(key) if key.startswith(VAL_BEFORE + "/") else key


@dataclasses.dataclass(frozen=True)
class Key:
    """One documented key (``pattern``: the key, ``<...>`` a name part), its unit and meaning."""

    pattern: str
    unit: str
    meaning: str

    def matches(self, key: str) -> bool:
        parts = re.split(r"<[^>]+>", self.pattern)
        return re.fullmatch("[^/]+".join(map(re.escape, parts)), key) is not None


_ESTIMATOR_SIZES = (  # estimators.diagnostics.SIZE_STATS: (name, unit, meaning)
    ("num_step_groups", "count", "step groups in the batch"),
    ("singleton_group_rate", "fraction", "step groups of one row (no comparison possible)"),
    ("singleton_row_rate", "fraction", "rows in a singleton step group"),
    ("mean_group_size", "rows", "mean step-group size"),
    ("p90_group_size", "rows", "90th percentile of step-group size"),
    ("max_group_size", "rows", "largest step group"),
    ("pairs", "count", "row pairs inside step groups (sum of s(s-1)/2)"),
)
_PARTITIONS = (
    ("", "the partition the estimator trains with"),
    ("hash_", "exact observation hashing (GiGPO's), recorded by every run"),
    ("cluster_", "fingerprint clusters at this epsilon (BiGPO's/BiPACE's), recorded by every run"),
)
_PANEL = (  # stats.panel_metrics and the trainer's categories, per validation panel
    ("success_rate", "fraction", "mean over tasks of the games won (a task whose games all faulted is left out)"),
    ("success_rate/<category>_<value>", "fraction", "success over the panel's tasks of one category value"),
    ("episode_length", "turns", "mean turns per game"),
    ("tasks", "count", "tasks in the panel"),
    ("tasks/<category>_<value>", "count", "tasks of one category value"),
    ("env_errors", "count", "games that faulted (not counted in the rates)"),
    ("score", "0..1", "mean task score where the game has one (WebShop)"),
)
_PANELS = (
    (VAL, "validation after iteration i, goals from the training set"),
    (VAL_HOLDOUT, "validation after iteration i, held-out goals"),
    (VAL_BEFORE, "the first validation, before any update (iteration 0's record only)"),
    (VAL_BEFORE + "/holdout", "held-out goals before any update"),
)

TABLE: tuple[Key, ...] = (
    Key(ITERATION, "index", "iteration of the record, from 0 (x = iterations completed: see x_of)"),
    # train/*: the trainer's episode metrics over this iteration's games (every host).
    Key(TRAIN_SUCCESS, "fraction", "training games won (faulted games left out)"),
    Key("train/episode_length", "turns", "mean turns per training game"),
    Key("train/invalid_rate", "fraction", "turns whose response parsed to no valid action"),
    Key("train/env_errors", "count", "training games that faulted"),
    Key("train/return", "reward", "mean episode return"),
    Key("train/episodes", "count", "training games played without fault"),
    Key("train/rows", "count", "step rows in the PPO batch (all hosts)"),
    Key("train/response_tokens", "tokens", "response tokens in the PPO batch (all hosts)"),
    Key("train/prompt_tokens_mean", "tokens", "mean prompt length of this host's rows"),
    Key("train/hosts", "count", "processes in the run"),
    Key(TASK_CURSOR, "index", "global index of this iteration's first task group"),
    Key(OPTIMIZER_STEPS, "count", "optimizer steps of this iteration's update"),
    # loss/*: ppo.PPOLearner.update, means over optimizer steps.
    Key("loss/loss", "nats x advantage", "the objective minimised: pg_loss + kl_coef x kl - entropy_coef x entropy"),
    Key("loss/pg_loss", "nats x advantage", "clipped policy-gradient loss"),
    Key("loss/kl", "nats/token", "KL to the reference policy (0 at kl_coef 0)"),
    Key("loss/entropy", "nats/token", "policy entropy on the response tokens"),
    Key("loss/clip_frac", "fraction", "response tokens whose ratio was clipped"),
    Key("loss/approx_kl_old", "nats/token", "0.5 (log p - log p_old)^2, drift from the rollout policy"),
    Key("loss/sampler_gap", "nats/token", "sampler vs trainer log-prob gap (fused old log-probs)"),
    Key(
        "loss/is_weight",
        "ratio",
        "mean truncated importance weight min(pi_old / pi_sampler, ppo.tis_cap) (tis_cap > 0)",
    ),
    Key(
        "loss/is_truncated_frac",
        "fraction",
        "response tokens whose importance weight exceeded ppo.tis_cap (tis_cap > 0)",
    ),
    Key("loss/grad_norm", "norm", "mean global gradient norm over optimizer steps"),
    Key("loss/grad_norm_max", "norm", "largest global gradient norm"),
    Key("loss/updates", "count", "optimizer steps (as train/optimizer_steps)"),
    Key("advantage/mean", "advantage", "mean per-row advantage"),
    Key("advantage/std", "advantage", "standard deviation of the per-row advantages"),
    Key("advantage/abs_max", "advantage", "largest absolute advantage"),
    # estimator/*: estimators.diagnostics of this iteration's batch.
    *(
        Key(f"estimator/{p}{name}", unit, f"{meaning}; {where}")
        for p, where in _PARTITIONS
        for name, unit, meaning in _ESTIMATOR_SIZES
    ),
    Key(PACE_ROWS, "fraction", "rows whose advantage is PACE's Q - V"),
    Key(LOO_ROWS, "fraction", "rows whose advantage is the leave-one-out baseline"),
    Key("estimator/overflow_rows", "count", "rows left unclustered: the cluster table (estimator.capacity) was full"),
    Key("estimator/degenerate_rows", "count", "rows whose fingerprint is non-finite or all zeros (not clustered)"),
    Key("estimator/invalid_rows", "count", "real rows past the batch's group/row capacities (not clustered)"),
    Key(EPSILON, "cosine distance", "the clustering threshold epsilon used this iteration"),
    Key(CALIBRATION_RATE + "/<epsilon>", "fraction", "singleton rate at each epsilon tried (iteration 0 only)"),
    # rollout/*: rollout.collect's statistics of this host's training games.
    Key(LOGPROB_GAP, "nats/token", "mean |sampler - trainer| old log-prob (~0 means the forwards agree)"),
    Key("rollout/truncations", "count", "prompts whose history was cut to fit"),
    Key("rollout/history_dropped", "turns", "history turns dropped to fit the prompt"),
    Key("rollout/turns", "count", "sampling turns (batched decode calls)"),
    Key("rollout/response_tokens", "tokens", "tokens sampled"),
    Key("rollout/budget_hits", "count", "responses that hit the token budget"),
    Key("rollout/rows", "count", "step rows kept"),
    Key("rollout/prompt_tokens_max", "tokens", "longest prompt"),
    Key("rollout/invalid_rate", "fraction", "rows with an invalid action"),
    Key("rollout/finish_<reason>_rate", "fraction", "rows that ended by eos, stop or length"),
    Key("rollout/success_rate", "fraction", "this host's training games won"),
    Key("rollout/slot_use", "fraction", "busy slot decode steps over those offered (rollout.scheduler=continuous)"),
    Key("rollout/env_errors", "count", "this host's faulted games"),
    Key(
        "rollout/env_errors_<fault>",
        "count",
        "faulted games of one fault kind (environments.pool.Fault, or prompt_too_long: no fit without history)",
    ),
    Key("rollout/env_error_rows", "count", "rows dropped with faulted games"),
    Key("rollout/reset_faults", "count", "games whose reset faulted"),
    # async/*: asynchronous RL (config.async_rl.sampler_devices or sampler_processes > 0) only.
    Key(ASYNC_LAG_MEAN, "iterations", "mean over rows of the learner's version minus the version that sampled the row"),
    Key(ASYNC_LAG_MAX, "iterations", "largest row version lag (at most async_rl.max_staleness)"),
    Key(ASYNC_PUSH_SECONDS, "s", "the learner's parameters sent to the sampler group after the update"),
    # ... by process (config.async_rl.sampler_processes > 0) only.
    Key(ASYNC_PULL_SECONDS, "s", "the sampler process's pull of the version its iteration started with"),
    Key(ASYNC_ROWS_SEND_SECONDS, "s", "the sampler process pickling the iteration's rows into the key-value store"),
    Key(ASYNC_ROWS_RECEIVE_SECONDS, "s", "the learner reading and unpickling the iteration's rows"),
    Key(ASYNC_ROWS_BYTES, "bytes", "the iteration's pickled rows"),
    Key("rollout/branch_forks", "count", "games forked at a branch turn (rollout.branch_turns)"),
    Key("rollout/branch_copied_rows", "count", "prefix rows a forked game's children repeat (rollout.branch_turns)"),
    Key(
        "rollout/branch_released",
        "count",
        "envs that played a lone game from the reset: their subtree's game ended before its fork",
    ),
    Key(
        "rollout/sampled_singleton_row_rate",
        "fraction",
        "sampled steps (repeated prefix rows once) alone in their exact-anchor step group (rollout.branch_turns)",
    ),
    # time/*: wall seconds.
    Key("time/<stage>_s", "s", "a stage of the iteration: rollout, old_logprobs, ref_logprobs, estimator, update"),
    Key("time/rollout_<part>_s", "s", "rollout time split: sampling, env, prefill, decode, host, total"),
    Key("time/rollout_decode_steps", "count", "decode steps the slot scheduler ran (rollout.scheduler=continuous)"),
    Key("time/rollout_chunks", "count", "decode chunks the slot scheduler dispatched (rollout.scheduler=continuous)"),
    Key("time/rollout_inserts", "count", "prompt inserts of the slot scheduler (rollout.scheduler=continuous)"),
    Key(ITERATION_SECONDS, "s", "sum of the stages"),
    Key(BIPACE_SHARE, "fraction", "estimator stage seconds / iteration seconds"),
    Key(VALIDATION_SECONDS, "s", "the validation after this iteration (x = i + 1)"),
    Key(VAL_BEFORE + "/validation_s", "s", "the before-RL validation"),
    Key(PREVIOUS_CHECKPOINT_SECONDS, "s", "saving the previous iteration's checkpoint"),
    *(
        Key(f"{panel}/{name}", unit, f"{meaning}; {which}")
        for panel, which in _PANELS
        for name, unit, meaning in _PANEL
    ),
)


def describe(key: str) -> Key | None:
    """The ``TABLE`` entry of ``key`` (the first whose pattern matches), or None when undocumented."""
    return next((k for k in TABLE if k.matches(key)), None)


def undocumented(record_keys) -> list[str]:
    """The keys among ``record_keys`` that no ``TABLE`` entry matches, sorted."""
    return sorted(k for k in record_keys if describe(k) is None)


def markdown_table() -> str:
    """``TABLE`` as a Markdown table (the body of docs/metrics.md between its markers)."""
    lines = ["| key | unit | meaning |", "|---|---|---|"]
    lines += [f"| `{k.pattern}` | {k.unit} | {k.meaning} |" for k in TABLE]
    return "\n".join(lines) + "\n"
