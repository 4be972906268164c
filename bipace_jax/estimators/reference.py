"""The plain NumPy oracle of the estimator contract (`docs/estimators.md`): explicit loops.

The test oracle for `compute_advantages`; deliberately simple (Python loops over rows,
trajectories, task groups and clusters) and slow. The shared parts (validity, returns, episode
level, grouping, clustering, diagnostics) live here; each estimator's step level is the
`reference_step` twin of its `EstimatorSpec` (`cfg.spec`), next to its jitted formula. `dtype`
chooses the arithmetic (float32 like the jitted path, or float64 for exactness checks).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from bipace_jax.estimators import base
from bipace_jax.estimators.diagnostics import SIZE_STATS

STD_EPS = 1e-6
EQUAL_RTOL = 1e-5
JOIN_SLACK = 1e-6


def _fields(batch):
    names = ("group_id", "traj_id", "step", "reward", "obs_hash", "fingerprint", "action_key", "mask")
    a = {k: np.asarray(getattr(batch, k)) for k in names}
    # No penalty field reads as zeros: "in_reward" then subtracts 0 and "own_row" charges nothing.
    pen = getattr(batch, "penalty", None)
    a["penalty"] = np.zeros(a["reward"].shape, np.float32) if pen is None else np.asarray(pen)
    return a


def valid_rows(batch, group_capacity=None, row_capacity=None) -> tuple[list[int], int]:
    """Real rows whose trajectory passes every check (`docs/estimators.md`, "Inputs"), canonical order.

    A trajectory (all real rows of one traj_id) is invalid when it has a non-finite reward, a
    non-finite or negative penalty, rows in two task groups, steps that are not exactly 0..T-1, or (capacities given) a row whose task group
    ranks at or beyond `group_capacity` or which sits at or beyond `row_capacity` in its task group.
    Returns (valid rows in canonical order, number of real rows that are invalid).
    """
    a = _fields(batch)
    real = [i for i in range(len(a["mask"])) if a["mask"][i]]
    canonical = sorted(real, key=lambda i: (a["group_id"][i], a["traj_id"][i], a["step"][i], i))
    group_rank = {g: r for r, g in enumerate(sorted({int(a["group_id"][i]) for i in real}))}
    rows_seen = defaultdict(int)
    position = {}
    for i in canonical:
        position[i] = rows_seen[int(a["group_id"][i])]
        rows_seen[int(a["group_id"][i])] += 1
    by_traj = defaultdict(list)
    for i in canonical:
        by_traj[int(a["traj_id"][i])].append(i)
    bad_traj = set()
    for t, members in by_traj.items():
        groups = {int(a["group_id"][i]) for i in members}
        steps = sorted(int(a["step"][i]) for i in members)
        if len(groups) > 1 or steps != list(range(len(members))):
            bad_traj.add(t)
        for i in members:
            if not math.isfinite(float(a["reward"][i])):
                bad_traj.add(t)
            if not (math.isfinite(float(a["penalty"][i])) and float(a["penalty"][i]) >= 0):
                bad_traj.add(t)
            if group_capacity is not None and group_rank[int(a["group_id"][i])] >= group_capacity:
                bad_traj.add(t)
            if row_capacity is not None and position[i] >= row_capacity:
                bad_traj.add(t)
    valid = [i for i in canonical if int(a["traj_id"][i]) not in bad_traj]
    return valid, len(real) - len(valid)


def all_equal(v: np.ndarray) -> bool:
    """The span rule: values spanning at most 1e-5 * max(1, max|v|) are all-equal (`docs/estimators.md`)."""
    return bool(v.max() - v.min() <= EQUAL_RTOL * max(1.0, float(np.abs(v).max())))


def normalise(values: list, norm: str, dtype) -> list:
    """(v - mean) / (std + 1e-6) with the unbiased std ("mean_std") or v - mean ("mean").

    A single value or values spanning at most 1e-5 * max(1, max|v|) give zeros
    (`docs/estimators.md`, "Episode level": equal values stay equal).
    """
    v = np.asarray(values, dtype=dtype)
    if len(v) < 2 or all_equal(v):
        return [dtype(0.0)] * len(v)
    centred = v - v.mean(dtype=dtype)
    if norm == "mean_std":
        centred = centred / (v.std(ddof=1, dtype=dtype) + dtype(STD_EPS))
    return [dtype(x) for x in centred]


def renormalise(f: np.ndarray, dtype):
    """f / max|f| / ||.||; None when f is degenerate (a non-finite element or all zeros)."""
    f = np.asarray(f).astype(dtype)
    if not np.all(np.isfinite(f)):
        return None
    m = np.max(np.abs(f))
    if m == 0:
        return None
    g = f / m
    return g / np.sqrt(np.dot(g, g))


def greedy_clusters(fingerprints: list, epsilon: float, centroid: str, capacity: int, dtype):
    """BiGPO greedy clustering of one task group's rows in canonical order: the rule of
    `docs/estimators.md`, "Clustering", written as a loop (nearest cluster, first-created on a tie).

    Returns (cluster index per row or None for a singleton, degenerate flags, overflow flags).
    """
    threshold = dtype(np.float32(1.0 - epsilon - JOIN_SLACK))
    sums, leaders = [], []
    assignment, degenerate, overflow = [], [], []
    for fp in fingerprints:
        f = renormalise(fp, dtype)
        best, best_cos, slot = None, -math.inf, None
        for c in range(len(sums) if f is not None else 0):
            if centroid == "mean":
                cos = np.dot(f, sums[c]) / np.sqrt(np.dot(sums[c], sums[c]))
            else:
                cos = np.dot(f, leaders[c])
            if cos > best_cos:  # strictly larger: an equal cos stays with the cluster created first
                best, best_cos = c, cos
        if f is None:
            pass  # degenerate: a singleton that opens nothing
        elif best is not None and best_cos >= threshold:
            sums[best] = sums[best] + f
            slot = best
        elif len(sums) < capacity:
            sums.append(f.copy())
            leaders.append(f.copy())
            slot = len(sums) - 1
        assignment.append(slot)
        degenerate.append(f is None)
        overflow.append(f is not None and slot is None)
    return assignment, degenerate, overflow


def size_stats(groups: list, num_rows: int, prefix: str = "") -> dict:
    """The seven size statistics of a partition (`docs/estimators.md`, "Diagnostics")."""
    sizes = [len(s) for s in groups]
    n = len(sizes)
    singles = sum(1 for s in sizes if s == 1)
    out = {
        "num_step_groups": n,
        "singleton_group_rate": singles / n if n else 0.0,
        "singleton_row_rate": singles / num_rows if num_rows else 0.0,
        "mean_group_size": num_rows / n if n else 0.0,
        "p90_group_size": float(np.percentile(sizes, 90)) if n else 0.0,
        "max_group_size": max(sizes) if n else 0,
        "pairs": sum(s * (s - 1) // 2 for s in sizes),
    }
    return {prefix + k: v for k, v in out.items()}


def compute_advantages_reference(batch, cfg, dtype=np.float32, return_groups: bool = False):
    """The oracle of `compute_advantages`: (advantages [N] numpy, diagnostics dict[str, float|int]).

    `cfg` is an `EstimatorConfig`; its registered spec (`cfg.spec`) gives the grouping and the
    NumPy step level (the config is not imported here: the registry imports the estimator modules,
    which import this one). With `return_groups`, also returns the step groups as a list of
    frozensets of batch row indices (empty for grpo).
    """
    a = _fields(batch)
    n = len(a["mask"])
    gamma, omega = dtype(cfg.gamma), dtype(cfg.omega)
    caps = (batch.group_capacity, batch.row_capacity) if cfg.clusters else (None, None)
    rows, invalid = valid_rows(batch, *caps)
    num_rows = len(rows)

    # "Returns": backward recursion per trajectory; episode return G = sum of rewards.
    # "Protocol options", penalty: "in_reward" sums and discounts reward - penalty; "own_row" sums
    # and discounts reward, then charges each row its own penalty.
    own_row = cfg.penalty == "own_row"

    def summed(i):
        return dtype(a["reward"][i]) if own_row else dtype(dtype(a["reward"][i]) - dtype(a["penalty"][i]))

    def charge(i):
        return dtype(a["penalty"][i]) if own_row else dtype(0.0)

    by_traj = defaultdict(list)
    for i in rows:
        by_traj[int(a["traj_id"][i])].append(i)  # canonical order: ascending step
    step_return, score = {}, {}
    for members in by_traj.values():
        later = dtype(0.0)
        for i in reversed(members):
            later = summed(i) + gamma * later
            step_return[i] = dtype(later - charge(i))
        total = dtype(0.0)
        for i in members:
            total = dtype(total + summed(i))
        for i in members:
            score[i] = dtype(total - charge(i))

    # "Episode level": one value per trajectory ("trajectory") or per row ("rows"), normalised in
    # its task group.
    trajs_of_group = defaultdict(list)
    for t, members in by_traj.items():
        trajs_of_group[int(a["group_id"][members[0]])].append(t)
    a_ep = {}
    for trajs in trajs_of_group.values():
        if cfg.episode_stats == "rows":
            members = [i for t in trajs for i in by_traj[t]]
            for i, v in zip(members, normalise([score[i] for i in members], cfg.norm, dtype)):
                a_ep[i] = v
        else:
            for t, v in zip(trajs, normalise([score[by_traj[t][0]] for t in trajs], cfg.norm, dtype)):
                for i in by_traj[t]:
                    a_ep[i] = v

    # Exact-hash partition over (group_id, obs_hash), for gigpo and the hash_ diagnostics.
    hash_groups = defaultdict(list)
    for i in rows:
        hash_groups[(int(a["group_id"][i]), int(a["obs_hash"][i]))].append(i)
    hash_groups = list(hash_groups.values())

    # Step groups: the registered estimator's grouping.
    spec = cfg.spec
    degenerate_rows = overflow_rows = 0
    if spec.grouping == base.NO_GROUPS:
        step_groups = []
    elif spec.grouping == base.OBS_HASH:
        step_groups = hash_groups
    else:
        capacity = cfg.capacity or batch.row_capacity
        rows_of_group = defaultdict(list)
        for i in rows:
            rows_of_group[int(a["group_id"][i])].append(i)
        step_groups = []
        for members in rows_of_group.values():
            assignment, degenerate, overflow = greedy_clusters(
                [a["fingerprint"][i] for i in members], cfg.epsilon, cfg.centroid, capacity, dtype
            )
            clusters = defaultdict(list)
            for i, c, d, o in zip(members, assignment, degenerate, overflow):
                degenerate_rows += int(d)
                overflow_rows += int(o)
                if c is None:
                    step_groups.append([i])
                else:
                    clusters[c].append(i)
            step_groups.extend(clusters.values())

    # Step level ("Step level"): the estimator's NumPy twin, one step group at a time.
    a_step = {i: dtype(0.0) for i in rows}
    loo_rows = pace_rows = 0
    if spec.reference_rows is not None:
        # A step level across the rows of a trajectory: every task group's trajectories at once.
        groups = [[by_traj[t] for t in sorted(trajs)] for _, trajs in sorted(trajs_of_group.items())]
        nested = [[[(int(a["obs_hash"][i]), step_return[i], a_ep[i]) for i in m] for m in g] for g in groups]
        options = {field: getattr(cfg, field) for field in spec.options}
        out = spec.reference_rows(nested, cfg.norm, dtype, **options)
        for g, g_out in zip(groups, out):
            for m, m_out in zip(g, g_out):
                for i, v in zip(m, m_out):
                    a_step[i] = dtype(v)
        step_groups_for_level = []
    else:
        step_groups_for_level = step_groups
    for members in step_groups_for_level:
        keys = None
        if spec.uses_action_keys:
            # An unparsable (negative) key matches no other row: give each such row its own key.
            keys = [int(a["action_key"][i]) for i in members]
            keys = [k if k >= 0 else ("unparsable", i) for k, i in zip(keys, members)]
        options = {}
        if spec.uses_pace_options:
            options = dict(step_norm=cfg.step_norm, pace_fallback=cfg.pace_fallback)
        out = spec.reference_step([step_return[i] for i in members], keys, cfg.norm, dtype, **options)
        for i, v in zip(members, out.advantage):
            a_step[i] = v
        loo_rows += 0 if out.loo_rows is None else int(np.sum(out.loo_rows))
        pace_rows += 0 if out.pace_rows is None else int(np.sum(out.pace_rows))

    adv = np.zeros((n,), dtype)
    for i in rows:
        adv[i] = a_step[i] if spec.owns_episode_level else a_ep[i] + omega * a_step[i]

    diag = size_stats(hash_groups, num_rows, prefix="hash_")
    if spec.grouping == base.NO_GROUPS:
        diag.update({k: 0 for k in SIZE_STATS})
    else:
        diag.update(size_stats(step_groups, num_rows))
    diag.update(
        pace_row_rate=pace_rows / num_rows if num_rows else 0.0,
        loo_row_rate=loo_rows / num_rows if num_rows else 0.0,
        overflow_rows=overflow_rows,
        degenerate_rows=degenerate_rows,
        invalid_rows=invalid,
    )
    if return_groups:
        return adv, diag, [frozenset(s) for s in step_groups]
    return adv, diag
