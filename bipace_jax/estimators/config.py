"""`EstimatorConfig`: the hyper-parameters of one advantage estimator (`docs/estimators.md`)."""

from __future__ import annotations

import dataclasses
import enum
import math

from bipace_jax.estimators import registry

NORMS = ("mean_std", "mean")
CENTROIDS = ("mean", "leader")
PENALTIES = ("in_reward", "own_row")
EPISODE_STATS = ("trajectory", "rows")
STEP_NORMS = ("none", "std")
PACE_FALLBACKS = ("same_key_cluster", "singleton_pool")


class ActionKey(enum.StrEnum):
    """The PACE action key the rollout puts in ``StepBatch.action_key`` (``docs/estimators.md``, "PACE
    keys"): ``action_tag`` (the response's ``<action>`` text) or ``first_tokens`` (its first 8 token ids)."""

    ACTION_TAG = "action_tag"
    FIRST_TOKENS = "first_tokens"


@dataclasses.dataclass(frozen=True)
class EstimatorConfig:
    """Hyper-parameters of one advantage estimator; validated on construction.

    Attributes:
      name: a registered estimator, `registry.names()` (built-in: "grpo", "gigpo", "bigpo",
        "bipace_q", "bipace_diff", "hgpo").
      gamma: discount of the step return `R[t] = reward[t] + gamma * R[t+1]`, in [0, 1]
        (`docs/estimators.md`, "Returns").
      omega: weight of the step level, `A = A_ep + omega * A_step` (not read by hgpo, whose step
        level gives the whole advantage); any finite float (verl-agent's
        `step_advantage_w` is not restricted either; a negative omega rewards the opposite of the
        step ranking, which is only useful for ablations).
      norm: "mean_std" (divide by the unbiased std + 1e-6) or "mean" (centre only); governs the episode
        level and the gigpo/bigpo step level; the BiPACE step level only with step_norm="std".
      epsilon: cosine slack of the clustering, join when `cos >= 1 - epsilon - 1e-6`; in [0, 1).
        Only read by the clustering estimators; it is a traced value, so changing it does not recompile.
      centroid: "mean" (re-normalised running sum of members) or "leader" (the cluster's first member).
      key: the PACE action key the rollout puts in `StepBatch.action_key` (`ActionKey`: "action_tag" or
        "first_tokens"); carried for the caller, the estimators only read the integer ids.
      capacity: fixed number of clusters per task group (K), or None for the batch's row capacity per
        task group (which never overflows). Rows that would open a cluster beyond it become singletons
        counted in the `overflow_rows` diagnostic.
      penalty, episode_stats, step_norm, pace_fallback: the protocol options (`docs/estimators.md`,
        "Protocol options"); each default keeps the rest of the contract unchanged.
        penalty: "in_reward" (`reward - penalty` is the reward everywhere) or "own_row" (a row's return
          and episode score lose only its own `StepBatch.penalty`; needs episode_stats="rows").
        episode_stats: "trajectory" (episode level over trajectories) or "rows" (over the task group's
          rows, each with its own episode score).
        step_norm: "none" or "std" (bipace_q/bipace_diff under norm="mean_std": the step term is divided
          by the cluster's unbiased std of R + 1e-6); other estimators ignore it.
        pace_fallback: "same_key_cluster" (leave-one-out when the whole cluster shares one key) or
          "singleton_pool" (leave-one-out when the row's PACE pool is empty); read by bipace_* only.
      similarity_thresh: how the rollout turns anchor observation texts into `StepBatch.obs_hash`:
        0.0 (default) exact text, or a float in (0, 1), verl-agent's `similarity_thresh`
        (`similarity_groups`: greedy clusters of `difflib` ratio >= it per task group). Carried for
        the caller like `key` (the rollout reads it from `RolloutConfig.similarity_thresh`); it
        changes the groups of the `obs_hash` estimators (gigpo, hgpo), not the clusters of the others.
      hgpo_history, hgpo_alpha, hgpo_base_group: HGPO's options (`docs/estimators.md`, "HGPO"), read
        by hgpo only; each value compiles once.
        hgpo_history: H >= 0, the history levels: rows are grouped by their last k anchor
          observations for k = 1 .. H + 1 (verl-agent's `env.history_length`, default 2).
        hgpo_alpha: finite float, the level weight (k + 1) ** alpha (verl-agent's
          `length_weight_alpha`, default 1.0; 0 weighs the levels equally).
        hgpo_base_group: bool, whether A_ep joins the mixture as a level-0 item (verl-agent's
          `base_group`, default False).

    Raises:
      ValueError: on an unknown name, norm, centroid, key, penalty, episode_stats, step_norm or
        pace_fallback, gamma outside [0, 1], epsilon outside [0, 1), a non-finite omega, a capacity
        below 1, hgpo_history not an int >= 0, a non-finite hgpo_alpha, hgpo_base_group not a bool,
        similarity_thresh outside [0, 1) or > 0 for an estimator that does not group by
        observation, or penalty="own_row" with episode_stats="trajectory".
    """

    name: str = "bipace_q"
    gamma: float = 0.95
    omega: float = 1.0
    norm: str = "mean_std"
    epsilon: float = 0.05
    centroid: str = "mean"
    key: str = "action_tag"
    capacity: int | None = None
    penalty: str = "in_reward"
    episode_stats: str = "trajectory"
    step_norm: str = "none"
    pace_fallback: str = "same_key_cluster"
    similarity_thresh: float = 0.0
    hgpo_history: int = 2
    hgpo_alpha: float = 1.0
    hgpo_base_group: bool = False

    def __post_init__(self):
        if self.name not in registry.names():
            raise ValueError(f"EstimatorConfig.name: expected one of {registry.names()}, got {self.name!r}")
        for field, value in (
            ("gamma", self.gamma),
            ("omega", self.omega),
            ("epsilon", self.epsilon),
            ("similarity_thresh", self.similarity_thresh),
            ("hgpo_alpha", self.hgpo_alpha),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"EstimatorConfig.{field}: expected a float, got {value!r}")
        if not math.isfinite(self.hgpo_alpha):
            raise ValueError(f"EstimatorConfig.hgpo_alpha: expected a finite float, got {self.hgpo_alpha!r}")
        if isinstance(self.hgpo_history, bool) or not isinstance(self.hgpo_history, int) or self.hgpo_history < 0:
            raise ValueError(f"EstimatorConfig.hgpo_history: expected an int >= 0, got {self.hgpo_history!r}")
        if not isinstance(self.hgpo_base_group, bool):
            raise ValueError(f"EstimatorConfig.hgpo_base_group: expected True or False, got {self.hgpo_base_group!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"EstimatorConfig.gamma: expected a value in [0, 1], got {self.gamma!r}")
        if not math.isfinite(self.omega):
            raise ValueError(f"EstimatorConfig.omega: expected a finite float, got {self.omega!r}")
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError(f"EstimatorConfig.epsilon: expected a value in [0, 1), got {self.epsilon!r}")
        if not 0.0 <= self.similarity_thresh < 1.0:
            raise ValueError(
                "EstimatorConfig.similarity_thresh: expected 0 (exact observation groups) or a value in (0, 1), "
                f"got {self.similarity_thresh!r}"
            )
        if self.similarity_thresh > 0 and self.spec.grouping != registry.OBS_HASH:
            # Only observation-group step levels read obs_hash; elsewhere the option would do nothing.
            raise ValueError(
                f"EstimatorConfig.similarity_thresh: {self.similarity_thresh!r} needs an estimator that groups by "
                f"observation (grouping 'obs_hash', e.g. 'gigpo'), got name={self.name!r}; use 0.0"
            )
        for field, allowed in (
            ("norm", NORMS),
            ("centroid", CENTROIDS),
            ("key", tuple(map(str, ActionKey))),
            ("penalty", PENALTIES),
            ("episode_stats", EPISODE_STATS),
            ("step_norm", STEP_NORMS),
            ("pace_fallback", PACE_FALLBACKS),
        ):
            if getattr(self, field) not in allowed:
                raise ValueError(f"EstimatorConfig.{field}: expected one of {allowed}, got {getattr(self, field)!r}")
        if self.capacity is not None and (
            isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1
        ):
            raise ValueError(f"EstimatorConfig.capacity: expected None or an int >= 1, got {self.capacity!r}")
        if self.penalty == "own_row" and self.episode_stats != "rows":
            # A per-row charge gives the rows of one trajectory different scores: only "rows" defines them.
            raise ValueError(
                "EstimatorConfig.penalty: 'own_row' requires EstimatorConfig.episode_stats='rows', "
                f"got episode_stats={self.episode_stats!r}"
            )

    @property
    def spec(self) -> registry.EstimatorSpec:
        """The registered `EstimatorSpec` of `name`."""
        return registry.get(self.name)

    @property
    def clusters(self) -> bool:
        """True when the step groups are fingerprint clusters (e.g. bigpo, bipace_q, bipace_diff)."""
        return self.spec.clusters

    def replace(self, **changes) -> EstimatorConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)
