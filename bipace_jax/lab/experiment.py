"""The lab's experiments: every registered estimator scored on a lab batch, and policy-gradient learning.

`estimate` runs the real jitted estimator (`bipace_jax.estimators.core.jitted_advantages`, the
function behind `compute_advantages`) on a `LabBatch`; `score_estimators` scores every estimator on
one batch per seed (`scores.score_rows`) with per-seed step-group diagnostics; `learn` improves a
tabular softmax policy by policy gradient with one estimator's advantages and values each iterate
exactly (`game.success_probability`), all seeds at once (the seeds are disjoint task groups of one
batch, so each iteration is one compiled estimator call).
"""

from __future__ import annotations

import json
import os

import numpy as np

from bipace_jax.estimators import EstimatorConfig, registry
from bipace_jax.estimators.core import LOO_ROW, jitted_advantages
from bipace_jax.lab.game import Game, success_probability
from bipace_jax.lab.observe import LabBatch, LabView, build_batch, sample_rollouts
from bipace_jax.lab.scores import score_rows


def estimate(batch: LabBatch, cfg: EstimatorConfig, *, kinds: bool = False):
    """(advantages float64[N], batch diagnostics dict[str, float], step-group labels int32[N]) of the
    batch's real rows under `cfg` (labels -1 for grpo); with `kinds`, a fourth item: the row kinds
    int32[N] of `bipace_jax.estimators.step_details` (`LOO_ROW` marks the leave-one-out rows)."""
    fn, scalars = jitted_advantages(cfg)
    adv, diag, labels, row_kinds = fn(batch.steps, *scalars)
    n = batch.rollouts.num_rows
    out = (
        np.asarray(adv, np.float64)[:n],
        {k: float(v) for k, v in diag.items()},
        np.asarray(labels)[:n],
    )
    return out + (np.asarray(row_kinds)[:n],) if kinds else out


def singleton_rates(labels: np.ndarray, seed: np.ndarray, num_seeds: int) -> tuple[np.ndarray, np.ndarray]:
    """(singleton_row_rate, singleton_group_rate) float64[num_seeds] of a step-group partition
    (`labels` int[N]; -1 = no step group, counted as a singleton row and group)."""
    lab = np.where(labels < 0, -1 - np.arange(labels.size), labels)
    _, inv, size = np.unique(lab, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    single = size[inv] == 1
    rows = np.bincount(seed, minlength=num_seeds)
    row_rate = np.bincount(seed, weights=single, minlength=num_seeds) / np.maximum(rows, 1)
    w = 1.0 / size[inv]  # each group counted once: its rows carry 1/size each
    groups = np.bincount(seed, weights=w, minlength=num_seeds)
    singles = np.bincount(seed, weights=w * single, minlength=num_seeds)
    return row_rate, singles / np.maximum(groups, 1e-12)


def mean_group_size(labels: np.ndarray, seed: np.ndarray, num_seeds: int) -> np.ndarray:
    """float64[num_seeds]: rows per step group of a partition (`labels` int[N]; -1 = a one-row group)."""
    lab = np.where(labels < 0, -1 - np.arange(labels.size), labels)
    _, inv, size = np.unique(lab, return_inverse=True, return_counts=True)
    groups = np.bincount(seed, weights=1.0 / size[inv.reshape(-1)], minlength=num_seeds)
    return np.bincount(seed, minlength=num_seeds) / np.maximum(groups, 1e-12)


def score_estimators(batch: LabBatch, cfgs: dict[str, EstimatorConfig], *, delta: float = 1e-3):
    """Scores every estimator in `cfgs` (name -> config) on one batch.

    Returns: {name: {key: float64[seeds]}} and {name: pooled batch diagnostics}; keys: `SCORE_KEYS`
    of the whole advantage (what trains), the same with prefix "step_" (but no_signal) of the step
    term alone, (A - A_ep) / omega (the whole A for a spec with `owns_episode_level`, e.g. hgpo),
    "singleton_row_rate", "singleton_group_rate", "mean_group_size" (rows per step group),
    "node_corr" and "node_step_corr" (corr and step_corr over distinct steps: a branched prefix's
    copies scored once with their mean advantage; equal to corr / step_corr without branching) and
    "loo_row_rate" (the share of the seed's valid rows whose step term took the leave-one-out
    fallback; 0 for estimators without one). The episode level A_ep comes from a grpo config with
    the same gamma, norm and protocol options.
    """
    ro = batch.rollouts
    out, diags, episode = {}, {}, {}
    for name, cfg in cfgs.items():
        ep_cfg = cfg.replace(name="grpo")
        if ep_cfg not in episode:
            episode[ep_cfg] = estimate(batch, ep_cfg)[0]
        adv, diag, labels, kinds = estimate(batch, cfg, kinds=True)
        # The step term alone (A - A_ep) is each estimator's own estimate of Q - V; an estimator that
        # mixes A_ep into its own terms (hgpo) has no separate step term: its whole A is that estimate,
        # and its no-signal rows are those with A = 0.
        owns = cfg.spec.owns_episode_level
        ep = np.zeros_like(adv) if owns else episode[ep_cfg]
        s = score_rows(adv, batch.a_star, batch.cell, ro.seed, ro.seeds, delta=delta, episode_adv=ep)
        step = adv if owns else (adv - ep) / cfg.omega if cfg.omega > 0 else np.zeros_like(adv)
        for k, v in score_rows(step, batch.a_star, batch.cell, ro.seed, ro.seeds, delta=delta).items():
            if k != "no_signal":
                s["step_" + k] = v
        s["singleton_row_rate"], s["singleton_group_rate"] = singleton_rates(labels, ro.seed, ro.seeds)
        s["mean_group_size"] = mean_group_size(labels, ro.seed, ro.seeds)
        # Branched games repeat a prefix's rows: score each distinct step once, with its copies' mean
        # advantage (what the copies' summed gradient carries); equal to corr without branching.
        uniq, inv = np.unique(ro.act_source, return_inverse=True)
        inv = inv.reshape(-1)
        per_node = np.bincount(inv) if uniq.size < ro.num_rows else None
        for key, x in (("node_corr", adv), ("node_step_corr", step)):
            if per_node is None:
                s[key] = s["step_corr" if key == "node_step_corr" else "corr"]
                continue
            mean = np.bincount(inv, weights=x) / per_node
            s[key] = score_rows(mean, batch.a_star[uniq], batch.cell[uniq], ro.seed[uniq], ro.seeds, delta=delta)[
                "corr"
            ]
        valid = np.bincount(ro.seed, weights=kinds >= 0, minlength=ro.seeds)
        s["loo_row_rate"] = np.bincount(ro.seed, weights=kinds == LOO_ROW, minlength=ro.seeds) / np.maximum(valid, 1)
        out[name], diags[name] = s, diag
    return out, diags


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (float64)."""
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def learn(
    game: Game,
    view: LabView,
    cfg: EstimatorConfig,
    *,
    seeds: int,
    groups: int,
    group_size: int,
    horizon: int,
    iterations: int,
    lr: float,
    policy: str = "latent",
    rng_seed: int = 0,
    render_text: bool = False,
    delta: float = 1e-3,
    branch_turns=(),
    branch_children: int = 1,
    max_staleness: int = 0,
) -> dict[str, np.ndarray]:
    """Policy gradient with `cfg`'s advantages from the uniform policy, all seeds at once.

    Each iteration plays `groups * group_size` games per seed with pi_k, computes the advantages of
    every row, and steps the logits: theta[s, :] += lr / (groups * G) * sum_rows A_i (onehot(a_i) -
    pi_k(. | s_i)) (the row's surface form too when policy="observation").

    Staleness (`max_staleness` k > 0, `docs/lab.md`): each game of iteration i draws a version lag l
    uniformly from 0..k (capped at i: no version before the start) and plays pi_{i-l}; its rows'
    fingerprints drift by `view.drift` per version; the step is the same formula at pi_i (no
    importance correction) and the scores compare with A* of pi_i. k = 0 draws nothing extra: the
    result equals the synchronous run's exactly.

    Args:
      policy: "latent" (logits [S, A]) or "observation" (logits [S, m, A], one row per surface form).
      rng_seed: the numpy seed of rollouts, noise and fingerprints (the same for every estimator,
        so all arms start from the same draws).
      branch_turns, branch_children: tree-shaped games (`sample_rollouts`); a repeated prefix row
        enters the step once per game through it, as each child's whole transcript would.
      max_staleness: k >= 0 (above).
    Returns: dict with "success" float64[iterations + 1, seeds] (exact J(pi_k), k = 0..iterations),
      "corr" and "singleton_row_rate" float64[iterations, seeds] of each iteration's batch.
    Raises: ValueError on an unknown policy, lr <= 0, iterations < 1, max_staleness < 0, or (from
      `sample_rollouts`) a bad branch setting.
    """
    if policy not in ("latent", "observation"):
        raise ValueError(f"learn: policy must be 'latent' or 'observation', got {policy!r}")
    if not (lr > 0 and iterations >= 1):
        raise ValueError(f"learn: need lr > 0 and iterations >= 1, got lr={lr}, iterations={iterations}")
    if not (isinstance(max_staleness, int) and max_staleness >= 0):
        raise ValueError(f"learn: max_staleness must be an int >= 0, got {max_staleness!r}")
    rng = np.random.default_rng(rng_seed)
    s_, a_ = game.num_states, game.num_actions
    shape = (seeds, s_, a_) if policy == "latent" else (seeds, s_, view.paraphrases, a_)
    theta = np.zeros(shape)
    success = np.zeros((iterations + 1, seeds))
    corr = np.zeros((iterations, seeds))
    single = np.zeros((iterations, seeds))

    def latent(pi):
        return pi if policy == "latent" else pi.mean(axis=2)

    success[0] = success_probability(game, latent(softmax(theta)), horizon)
    older = []  # pi_{k-1}, pi_{k-2}, ... (at most max_staleness of them)
    for k in range(iterations):
        pi = softmax(theta)
        played, lag = pi, None
        if max_staleness > 0:
            lag = np.minimum(rng.integers(0, max_staleness + 1, (seeds, groups, group_size)), k)
            played = np.stack([pi] + older)
        ro = sample_rollouts(
            game,
            played,
            rng,
            groups=groups,
            group_size=group_size,
            horizon=horizon,
            paraphrases=view.paraphrases,
            history=view.history,
            branch_turns=branch_turns,
            branch_children=branch_children,
            lag=lag,
        )
        older = ([pi] + older)[:max_staleness]
        batch = build_batch(game, ro, pi, view, rng, gamma=cfg.gamma, render_text=render_text)
        adv, _, labels = estimate(batch, cfg)
        corr[k] = score_rows(adv, batch.a_star, batch.cell, ro.seed, seeds, delta=delta)["corr"]
        single[k] = singleton_rates(labels, ro.seed, seeds)[0]
        idx = (ro.seed, ro.state) if policy == "latent" else (ro.seed, ro.state, ro.form)
        g = -pi[idx] * adv[:, None]
        g[np.arange(ro.num_rows), ro.action] += adv
        grad = np.zeros(shape)
        np.add.at(grad, idx, g)
        theta = theta + lr / (groups * group_size) * grad
        success[k + 1] = success_probability(game, latent(softmax(theta)), horizon)
    return dict(success=success, corr=corr, singleton_row_rate=single)


def estimator_configs(base: EstimatorConfig, names=None) -> dict[str, EstimatorConfig]:
    """One config per registered estimator (or `names`), each `base` with its name replaced."""
    return {n: base.replace(name=n) for n in (names or registry.names())}


def bonus_policy(game: Game, bonus: float, seeds: int) -> np.ndarray:
    """float64[seeds, S, A]: softmax of logits 0 with `bonus` on each live stage's recipe action
    (bonus 0 is the uniform policy, the learning start)."""
    logits = np.zeros((game.num_states, game.num_actions))
    for task in range(game.tasks):
        for k in range(game.stages):
            logits[task * game.stages + k, game.correct[task, k]] = bonus
    return np.broadcast_to(softmax(logits), (seeds, game.num_states, game.num_actions)).copy()


def anchor(report_path: str, m_rows: list, s_rows: list, root: str = "") -> dict:
    """The real-game anchor: which paraphrase count m reproduces a TextCraft study's hash singleton
    step-group rate, and which fingerprint noise sigma its cluster rate, by linear interpolation along
    the lab's m sweep (``m_rows``, GiGPO's rate) and sigma sweep (``s_rows``, BiGPO's rate).

    ``report_path``: a ``launch.report`` ``report.json`` (relative paths are under ``root``). Returns a
    JSON-able dict; ``{"report": ..., "error": "not found"}`` when the file is missing, and ``None``
    for a rate no sweep interval brackets."""
    path = report_path if os.path.isabs(report_path) else os.path.join(root, report_path)
    if not os.path.exists(path):
        return {"report": report_path, "error": "not found"}
    with open(path) as f:
        arms = json.load(f)["arms"]
    hashed = [a["diagnostics"]["estimator/hash_singleton_group_rate"][0] for a in arms.values()]
    clustered = [
        a["diagnostics"]["estimator/cluster_singleton_group_rate"][0]
        for name, a in arms.items()
        if any(k in name for k in ("bigpo", "bipace"))
    ]
    eps = [a["diagnostics"]["estimator/epsilon"][0] for name, a in arms.items() if "bigpo" in name or "bipace" in name]
    h, cl = float(np.mean(hashed)), float(np.mean(clustered))

    def crossing(xs, ys, target):
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if (y0 - target) * (y1 - target) <= 0 and y1 != y0:
                return float(x0 + (target - y0) * (x1 - x0) / (y1 - y0))
        return None

    ms = [r["m"] for r in m_rows]
    gig = [r["summary"]["gigpo"]["singleton_group_rate"][0] for r in m_rows if "gigpo" in r["summary"]]
    sig = [r["sigma"] for r in s_rows]
    big = [r["summary"]["bigpo"]["singleton_group_rate"][0] for r in s_rows if "bigpo" in r["summary"]]
    return {
        "report": report_path,
        "textcraft_hash_singleton_group_rate": h,
        "textcraft_cluster_singleton_group_rate": cl,
        "textcraft_epsilon": float(np.mean(eps)) if eps else None,
        "m_matching_hash_rate": crossing(ms, gig, h) if len(gig) == len(ms) else None,
        "sigma_matching_cluster_rate": crossing(sig, big, cl) if len(big) == len(sig) else None,
    }
