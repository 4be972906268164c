"""Scores of an estimated advantage against the exact A* = Q^pi - V^pi, per seed, with intervals.

For one seed's real rows (estimated A-hat, exact A*, error e = A-hat - A*):
  corr: Pearson correlation of A-hat with A* over the rows with |A*| > delta (0 when either is constant).
  sign: share of those rows where sign(A-hat) == sign(A*) (A-hat = 0 counts as a disagreement).
  nmse: sum e^2 / sum A*^2 over all rows (1 for A-hat = 0; scale matters: under norm="mean" both
    are in return units).
  state_err, action_err: nmse split by the law of total variance over the cells c = (task group,
    turn, latent state), whose rows share V: state_err = sum_c n_c mean_c(e)^2 / sum A*^2 (a shift
    common to a state's rows: the baseline's error against V), action_err = sum (e - mean_c(e))^2 /
    sum A*^2 (what differs between the actions taken in one state); they add up to nmse.
  no_signal: share of rows whose step-level term is exactly 0 (A-hat equal to the episode-level
    advantage, i.e. grpo's, on that row; 1 for grpo itself).
"""

from __future__ import annotations

import numpy as np

SCORE_KEYS = ("corr", "sign", "nmse", "state_err", "action_err", "no_signal")
"""The per-seed scores `score_rows` returns."""

Z95 = 1.959963984540054
"""Normal 97.5% quantile: intervals are mean +- Z95 * std / sqrt(seeds) (hundreds of seeds)."""


def score_rows(
    adv: np.ndarray,
    a_star: np.ndarray,
    cell: np.ndarray,
    seed: np.ndarray,
    num_seeds: int,
    *,
    delta: float = 1e-3,
    episode_adv: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The module docstring's scores of every seed.

    Args:
      adv: float[N] estimated advantages of the real rows (batch order = `a_star`'s).
      a_star: float[N] exact advantages.
      cell: int[N] (task group, turn, state) cell ids (`observe.LabBatch.cell`).
      seed: int[N] in [0, num_seeds), the seed of each row.
      delta: rows with |A*| <= delta are left out of corr and sign.
      episode_adv: float[N] the episode-level advantage (grpo's) for `no_signal`; None gives NaN.
    Returns: dict of float64[num_seeds] per key of `SCORE_KEYS`; NaN where a seed has no row to score.
    Raises: ValueError when the arrays' lengths differ or delta < 0.
    """
    adv, a_star = np.asarray(adv, np.float64), np.asarray(a_star, np.float64)
    n = adv.shape[0]
    for name, x in (("a_star", a_star), ("cell", cell), ("seed", seed)):
        if np.shape(x) != (n,):
            raise ValueError(f"score_rows: {name} must have shape ({n},) like adv, got {np.shape(x)}")
    if delta < 0:
        raise ValueError(f"score_rows: delta must be >= 0, got {delta}")

    def per_seed(x, where=None):
        w = np.ones(n) if where is None else where.astype(np.float64)
        return np.bincount(seed, weights=x * w, minlength=num_seeds)

    sel = np.abs(a_star) > delta
    cnt = per_seed(np.ones(n), sel)
    with np.errstate(invalid="ignore", divide="ignore"):
        mx, my = per_seed(adv, sel) / cnt, per_seed(a_star, sel) / cnt
        dx, dy = adv - mx[seed], a_star - my[seed]
        sxy, sxx, syy = per_seed(dx * dy, sel), per_seed(dx * dx, sel), per_seed(dy * dy, sel)
        den = np.sqrt(sxx * syy)
        corr = np.where(cnt > 0, np.where(den > 0, sxy / np.where(den > 0, den, 1.0), 0.0), np.nan)
        sign = per_seed((np.sign(adv) == np.sign(a_star)).astype(np.float64), sel) / cnt
        err = adv - a_star
        total = per_seed(a_star * a_star)
        _, inv, cell_n = np.unique(cell, return_inverse=True, return_counts=True)
        inv = inv.reshape(-1)
        cell_mean = np.bincount(inv, weights=err) / cell_n
        between = per_seed(cell_mean[inv] ** 2)
        within = per_seed((err - cell_mean[inv]) ** 2)
        rows = per_seed(np.ones(n))
        out = dict(
            corr=corr,
            sign=np.where(cnt > 0, sign, np.nan),
            nmse=(between + within) / total,
            state_err=between / total,
            action_err=within / total,
            no_signal=(
                np.full(num_seeds, np.nan)
                if episode_adv is None
                else per_seed((np.asarray(adv, np.float32) == np.asarray(episode_adv, np.float32)).astype(float)) / rows
            ),
        )
    return out


def interval(x) -> tuple[float, float, int]:
    """(mean, 95% half-width, seeds) of per-seed values `x`, NaNs left out; half-width NaN below 2 seeds."""
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return (float("nan"), float("nan"), 0)
    hw = Z95 * x.std(ddof=1) / np.sqrt(x.size) if x.size > 1 else float("nan")
    return (float(x.mean()), float(hw), int(x.size))
