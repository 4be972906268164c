"""A credit-assignment lab: the project's estimators scored against exact advantages (`docs/lab.md`).

Synthetic crafting games with a latent MDP (`game`), what the estimators see of them (`observe`:
paraphrased observation text, history, noise tokens, fingerprints with noise and false merges and
splits, tree-shaped games that fork at chosen turns, policy-version lags with fingerprint drift, the
`StepBatch` as the rollout builds it), exact Q^pi / V^pi by dynamic programming, scores
against A* = Q - V (`scores`) and policy-gradient learning with exact success curves (`experiment`).
"""

from bipace_jax.lab.experiment import (
    anchor,
    bonus_policy,
    estimate,
    estimator_configs,
    learn,
    mean_group_size,
    score_estimators,
    singleton_rates,
)
from bipace_jax.lab.game import Game, crafting_game, policy_values, success_probability
from bipace_jax.lab.observe import (
    LabBatch,
    LabView,
    Rollouts,
    branch_leaders,
    build_batch,
    ground_truth,
    sample_rollouts,
)
from bipace_jax.lab.scores import SCORE_KEYS, interval, score_rows

__all__ = [
    "SCORE_KEYS",
    "Game",
    "LabBatch",
    "LabView",
    "Rollouts",
    "anchor",
    "bonus_policy",
    "branch_leaders",
    "build_batch",
    "crafting_game",
    "estimate",
    "estimator_configs",
    "ground_truth",
    "interval",
    "learn",
    "mean_group_size",
    "policy_values",
    "sample_rollouts",
    "score_estimators",
    "score_rows",
    "singleton_rates",
    "success_probability",
]
