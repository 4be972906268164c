"""What the estimators see of a lab game: rollouts, observation text, fingerprints, the `StepBatch`.

`sample_rollouts` plays G games per task group, several task groups per seed and many seeds at once
(numpy, vectorised over every game). `LabView` holds the observation knobs; `build_batch` turns the
rows into a `StepBatch` exactly as `bipace_jax.rollout.collect` does (rows in canonical order,
`obs_hash = assign_ids(anchor texts)`, `action_key = assign_ids(PACE keys)` with -1 for the
unparsable action, `penalty` kept apart, rows padded to `seeds * groups * G * H` with static
capacities), together with the exact Q^pi, V^pi and A* = Q - V of every row. Seeds are packed as
disjoint task groups of one batch: every estimator statistic (episode level, hash groups, clusters)
is computed per task group, so one compiled call scores all seeds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bipace_jax.estimators import StepBatch, assign_ids
from bipace_jax.lab.game import Game, policy_values
from bipace_jax.plan import row_capacity

_OPENERS = ("You look around.", "Your workbench is in front of you.", "You check your inventory.", "Status report:")


@dataclasses.dataclass(frozen=True)
class LabView:
    """The observation knobs: how each latent state is rendered and fingerprinted.

    Attributes:
      paraphrases: m >= 1 surface forms per latent state; each visit draws one uniformly.
      history: h >= 0 previous (observation, action) turns included in the anchor text.
      noise_tokens: n >= 0 irrelevant tokens appended to the anchor text, each from `noise_vocab`.
      noise_vocab: >= 1 distinct noise tokens.
      sigma: >= 0 fingerprint noise: f = normalise(e + sigma * z / sqrt(D)), z ~ N(0, I_D), so the
        noise has norm about sigma against the unit latent embedding e.
      dim: D >= 2 fingerprint width.
      false_merge: in [0, 1], the probability (per seed and trap state) that a trap state's embedding
        is its live twin's (two states of different value mapped together).
      false_split: in [0, 1], the probability (per row) that the embedding follows the surface form
        (a sign-flipped copy of e per paraphrase: one latent state, up to m directions).
      drift: >= 0, the fingerprint drift per policy version (the staleness model, `docs/lab.md`): a
        row sampled l versions ago is fingerprinted with e_l = normalise(e + drift * W_l / sqrt(D)),
        W_l a sum of l independent standard normal vectors per (seed, latent state), W_0 = 0, so
        cos(e_0, e_l) is about 1 / sqrt(1 + l drift^2). Only rows with a lag (`Rollouts.lag`) move.
    """

    paraphrases: int = 1
    history: int = 0
    noise_tokens: int = 0
    noise_vocab: int = 50
    sigma: float = 0.0
    dim: int = 32
    false_merge: float = 0.0
    false_split: float = 0.0
    drift: float = 0.0

    def __post_init__(self):
        for name, ok, want in (
            ("paraphrases", _is_int(self.paraphrases) and self.paraphrases >= 1, "an int >= 1"),
            ("history", _is_int(self.history) and self.history >= 0, "an int >= 0"),
            ("noise_tokens", _is_int(self.noise_tokens) and self.noise_tokens >= 0, "an int >= 0"),
            ("noise_vocab", _is_int(self.noise_vocab) and self.noise_vocab >= 1, "an int >= 1"),
            ("dim", _is_int(self.dim) and self.dim >= 2, "an int >= 2"),
            ("sigma", _is_float(self.sigma) and self.sigma >= 0, "a float >= 0"),
            ("false_merge", _is_float(self.false_merge) and 0 <= self.false_merge <= 1, "a float in [0, 1]"),
            ("false_split", _is_float(self.false_split) and 0 <= self.false_split <= 1, "a float in [0, 1]"),
            ("drift", _is_float(self.drift) and self.drift >= 0, "a float >= 0"),
        ):
            if not ok:
                raise ValueError(f"LabView.{name}: expected {want}, got {getattr(self, name)!r}")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_float(v) -> bool:
    return isinstance(v, (int, float, np.floating)) and not isinstance(v, bool) and np.isfinite(v)


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """Played games, rows in canonical order (seed, task group, trajectory, step); N real rows.

    Attributes (all numpy [N] unless noted):
      seed, group, traj, step: seed index, task group (global: seed * groups + b), trajectory
        (global: group * G + g), turn 0..T-1.
      state, form, action: latent state, paraphrase index, action id.
      reward, penalty: the game's reward and the invalid-action charge of the turn.
      task: int[seeds * groups] the task of each task group.
      seeds, groups, group_size, horizon: the shape (rows are padded to seeds * groups * G * H).
      history: int[N, h, 3] the previous h turns' (state, form, action), -1 before the first turn.
      obs_source: int[N] the first row with this row's observation node: a branched game repeats its
        parent's rows up to the fork and shares the fork turn's observation with its siblings (the
        same prompt, so the same anchor text, noise tokens and fingerprint); itself without branching.
      act_source: int[N] the first row with this row's action node: rows of a shared prefix repeat
        one step of one game (same state, action and reward); a fork turn's siblings act apart.
      lag: int[N] the policy-version lag of the game that played the row (0: the current policy).
    """

    seed: np.ndarray
    group: np.ndarray
    traj: np.ndarray
    step: np.ndarray
    state: np.ndarray
    form: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    penalty: np.ndarray
    task: np.ndarray
    history: np.ndarray
    seeds: int
    groups: int
    group_size: int
    horizon: int
    obs_source: np.ndarray | None = None
    act_source: np.ndarray | None = None
    lag: np.ndarray | None = None

    def __post_init__(self):
        # Defaults: every row its own observation node, every game on the current policy.
        n = self.step.shape[0]
        for name in ("obs_source", "act_source"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.arange(n))
        if self.lag is None:
            object.__setattr__(self, "lag", np.zeros(n, np.int64))

    @property
    def num_rows(self) -> int:
        """N real rows."""
        return self.step.shape[0]

    @property
    def capacity(self) -> int:
        """Padded rows: seeds * groups * G * H (the most a collect can produce)."""
        return self.seeds * self.groups * self.group_size * self.horizon


def _draw(rng, probs):
    """One categorical draw per row of probs [..., K] by inverse CDF."""
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[:-1] + (1,)) * cdf[..., -1:]
    return np.minimum(np.sum(cdf <= u, axis=-1), probs.shape[-1] - 1)


def branch_leaders(group_size: int, horizon: int, branch_turns=(), branch_children: int = 1):
    """Which game's draws each game repeats, per turn, in a tree of `group_size` games per task group.

    The games are the leaves of `R = G / c^b` trees (b = len(branch_turns), c = branch_children):
    every game is forked into c continuations at each branch turn, so before the first branch turn
    the games of a tree repeat one game, between the first and the second its c subtrees, and so on.
    At a branch turn t the children share the state and the observation (drawn before the fork) and
    draw their own actions. Leaders are the first game of each node (canonical order keeps them first).

    Returns: (obs int64[H, G], act int64[H, G]): the game whose surface form at turn t game g repeats,
      and the game whose action and transition it repeats (both g everywhere without branching).
    Raises: ValueError naming the argument when the turns are not distinct ints in [0, horizon), the
      children not an int >= 2 with turns (1 without), or G not a multiple of c^b.
    """
    turns = tuple(branch_turns)
    b = len(turns)
    if not all(isinstance(t, (int, np.integer)) and 0 <= t < horizon for t in turns) or len(set(turns)) != b:
        raise ValueError(f"branch_turns: expected distinct turns in [0, {horizon}), got {turns!r}")
    if not _is_int(branch_children) or branch_children < (2 if b else 1) or (not b and branch_children != 1):
        want = "an int >= 2 when branch_turns is set" if b else "1 when branch_turns is empty"
        raise ValueError(f"branch_children: expected {want}, got {branch_children!r}")
    leaves = branch_children**b
    if group_size % leaves:
        raise ValueError(
            f"group_size: expected a multiple of branch_children ** len(branch_turns) = {leaves} "
            f"(the same number of games per task group), got {group_size}"
        )
    g = np.arange(group_size)
    obs, act = np.zeros((horizon, group_size), np.int64), np.zeros((horizon, group_size), np.int64)
    for t in range(horizon):
        for out, forks in ((obs, sum(bt < t for bt in turns)), (act, sum(bt <= t for bt in turns))):
            width = branch_children ** (b - forks)  # games below one node at this depth
            out[t] = g - g % width
    return obs, act


def sample_rollouts(
    game: Game,
    pi: np.ndarray,
    rng: np.random.Generator,
    *,
    groups: int,
    group_size: int,
    horizon: int,
    paraphrases: int = 1,
    history: int = 0,
    branch_turns=(),
    branch_children: int = 1,
    lag: np.ndarray | None = None,
) -> Rollouts:
    """Plays `seeds * groups * group_size` games of `horizon` turns with policy `pi`.

    Args:
      game: the MDP.
      pi: float[seeds, S, A] (a policy over latent states) or float[seeds, S, m, A] (over the surface
        form: m must equal `paraphrases`); rows are probabilities. With `lag`, one more leading axis
        of policy versions: pi[l] is the policy l versions old.
      rng: numpy Generator (tasks, forms, actions, transitions).
      groups: task groups per seed; each draws a task uniformly; group_size: G games per group.
      horizon: H turns at most (a game also ends in the goal).
      paraphrases: m, forms drawn uniformly per visit; history: turns kept in `Rollouts.history`.
      branch_turns, branch_children: tree-shaped games at the same budget (`branch_leaders`): G games
        per task group, forked into `branch_children` continuations at each branch turn. The draws
        are those of independent games with each game's repeated from its leader, so without
        branching (the defaults) the result is unchanged.
      lag: int[seeds, groups, G] in [0, V) or None: the policy version lag of each game (a game plays
        pi[lag] throughout: the sampler switches versions at game boundaries).
    Returns: `Rollouts`.
    Raises: ValueError when pi's shape does not match the game or `paraphrases`, on a bad lag, on a
      lag together with branch turns, or as `branch_leaders` on a bad branch setting.
    """
    pi = np.asarray(pi, np.float64)
    s_, a_ = game.num_states, game.num_actions
    versions = pi if lag is not None else pi[None]
    obs_policy = versions.ndim == 5
    if (
        versions.ndim not in (4, 5)
        or versions.shape[2] != s_
        or versions.shape[-1] != a_
        or (obs_policy and versions.shape[3] != paraphrases)
    ):
        lead = "[versions, seeds, " if lag is not None else "[seeds, "
        raise ValueError(
            f"sample_rollouts: pi must be {lead}{s_}, {a_}] or {lead}{s_}, {paraphrases}, {a_}], got {pi.shape}"
        )
    n_seeds = versions.shape[1]
    shape = (n_seeds, groups, group_size)
    if lag is not None:
        lag = np.asarray(lag)
        if (
            lag.shape != shape
            or not np.issubdtype(lag.dtype, np.integer)
            or lag.min() < 0
            or lag.max() >= len(versions)
        ):
            raise ValueError(
                f"sample_rollouts: lag must be int{list(shape)} in [0, {len(versions)}) (one policy per version), "
                f"got {lag.dtype}{list(lag.shape)} in [{lag.min()}, {lag.max()}]"
            )
        if branch_turns:  # a child repeats its leader's draws, which a different version would not make
            raise ValueError("sample_rollouts: lag and branch_turns together are not modelled; pass one of them")
    else:
        lag = np.zeros(shape, np.int64)
    lead_obs, lead_act = branch_leaders(group_size, horizon, branch_turns, branch_children)
    task = rng.integers(0, game.tasks, (n_seeds, groups))
    state = np.broadcast_to(game.start[task][..., None], shape).copy()
    seed_ix = np.broadcast_to(np.arange(n_seeds)[:, None, None], shape)
    rec = {k: np.zeros(shape + (horizon,), np.int64) for k in ("state", "form", "action")}
    reward = np.zeros(shape + (horizon,))
    alive = np.zeros(shape + (horizon,), bool)
    live = ~game.terminal[state]
    for t in range(horizon):
        form = rng.integers(0, paraphrases, shape)[..., lead_obs[t]]
        probs = versions[lag, seed_ix, state, form] if obs_policy else versions[lag, seed_ix, state]
        action = _draw(rng, probs)[..., lead_act[t]]
        nxt = _draw(rng, game.transition[state, action])[..., lead_act[t]]
        rec["state"][..., t], rec["form"][..., t], rec["action"][..., t] = state, form, action
        reward[..., t] = np.where(game.terminal[nxt] & ~game.terminal[state], 1.0, 0.0)
        alive[..., t] = live
        state = np.where(live, nxt, state)
        live = live & ~game.terminal[state]
    idx = np.nonzero(alive)  # C order = (seed, group, traj, step): the canonical order
    sd, b, g, t = idx
    hist = np.full((len(t), history, 3), -1, np.int64)
    for i in range(1, history + 1):
        ok = t - i >= 0
        tt = np.maximum(t - i, 0)
        for c, k in enumerate(("state", "form", "action")):
            hist[:, i - 1, c] = np.where(ok, rec[k][sd, b, g, tt], -1)
    act = rec["action"][idx]
    gid = sd * groups + b

    def first_row(leaders):
        # A row's node: (task group, turn, leader game); its first row (canonical order) is the leader's.
        _, first, inverse = np.unique(
            (gid * group_size + leaders[t, g]) * horizon + t, return_index=True, return_inverse=True
        )
        return first[inverse.reshape(-1)]

    return Rollouts(
        seed=sd,
        group=gid,
        traj=gid * group_size + g,
        step=t,
        state=rec["state"][idx],
        form=rec["form"][idx],
        action=act,
        reward=reward[idx] * game.success_reward,
        penalty=game.penalty[rec["state"][idx], act],
        task=task.reshape(-1),
        history=hist,
        seeds=n_seeds,
        groups=groups,
        group_size=group_size,
        horizon=horizon,
        obs_source=first_row(lead_obs),
        act_source=first_row(lead_act),
        lag=lag[sd, b, g],
    )


def render_state(game: Game, state: int, form: int) -> str:
    """The text of latent `state` in surface form `form` (distinct (state, form) give distinct text)."""
    kind, task, k = game.state_name(int(state))
    opener = _OPENERS[form % len(_OPENERS)]
    variant = "" if form < len(_OPENERS) else f" (take {form // len(_OPENERS)})"
    if kind == "live":
        body = f"Recipe {task}: you have crafted {k} of {game.stages} parts."
    elif kind == "trap":
        body = f"Recipe {task}: your tool broke after {k} of {game.stages} parts."
    else:
        body = "You crafted the item."
    return f"{opener}{variant} {body}"


def anchor_texts(game: Game, ro: Rollouts, noise: np.ndarray) -> list[str]:
    """The anchor observation text of every row: the current state's paraphrase, the last h turns
    (observation and action), then the noise tokens (`noise` int[N, n])."""
    out = []
    for i in range(ro.num_rows):
        parts = [render_state(game, ro.state[i], ro.form[i])]
        for s, f, a in ro.history[i]:
            if s >= 0:
                parts.append(f"| earlier: {render_state(game, s, f)} > action {a}")
        parts.extend(f"~w{w}" for w in noise[i])
        out.append(" ".join(parts))
    return out


def observation_keys(ro: Rollouts, noise: np.ndarray) -> np.ndarray:
    """Dense ids of the anchor observation without rendering it: equal (state, form, history, noise)
    tuple -> equal id, which is the partition of `assign_ids(anchor_texts(...))` (the text is an
    injective function of the tuple). int32[N]."""
    key = np.concatenate([ro.state[:, None], ro.form[:, None], ro.history.reshape(ro.num_rows, -1), noise], axis=1)
    _, ids = np.unique(key, axis=0, return_inverse=True)
    return ids.reshape(-1).astype(np.int32)


def fingerprints(game: Game, ro: Rollouts, view: LabView, rng: np.random.Generator) -> np.ndarray:
    """Model of the actor's hidden state: float32[N, D] unit rows (see `LabView`).

    Each seed draws its latent embeddings e[s] (unit Gaussian directions); trap states copy their
    live twin's with probability `false_merge`; a row sampled `lag` versions ago sees e[s] drifted
    by `drift` per version (`LabView.drift`; drawn only when some row has a lag and drift > 0); a row
    follows its surface form with probability `false_split` (e[s] times a per-form random sign
    pattern, so the form's direction is unrelated). A row that repeats another's observation
    (`Rollouts.obs_source`: a branched game's shared prefix) repeats its fingerprint.
    """
    d = view.dim
    e = rng.standard_normal((ro.seeds, game.num_states, d))
    e /= np.linalg.norm(e, axis=-1, keepdims=True)
    merge = None
    if view.false_merge > 0:
        twin = np.flatnonzero(game.live)
        merge = rng.random((ro.seeds, twin.size)) < view.false_merge
        trap = game.trap_of[twin]
        e[:, trap] = np.where(merge[..., None], e[:, twin], e[:, trap])
    base = e[ro.seed, ro.state]
    max_lag = int(ro.lag.max(initial=0))
    if view.drift > 0 and max_lag > 0:
        # W_l = z_1 + ... + z_l per (seed, state): one random walk, so versions are nested.
        walk = np.cumsum(rng.standard_normal((max_lag, ro.seeds, game.num_states, d)), axis=0)
        walk = np.concatenate([np.zeros((1,) + walk.shape[1:]), walk])
        if merge is not None:  # a merged trap state drifts with its twin
            walk[:, :, trap] = np.where(merge[None, ..., None], walk[:, :, twin], walk[:, :, trap])
        moved = base + view.drift / np.sqrt(d) * walk[ro.lag, ro.seed, ro.state]
        base = moved / np.linalg.norm(moved, axis=-1, keepdims=True)
    if view.false_split > 0:
        signs = rng.choice([-1.0, 1.0], (view.paraphrases, d))
        signs[0] = 1.0  # form 0 keeps the latent direction
        split = rng.random(ro.num_rows) < view.false_split
        base = np.where(split[:, None], base * signs[ro.form], base)
    f = base + view.sigma / np.sqrt(d) * rng.standard_normal(base.shape)
    f = f[ro.obs_source]
    return (f / np.linalg.norm(f, axis=-1, keepdims=True)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class LabBatch:
    """A `StepBatch` of a lab rollout with the ground truth of its real rows.

    Attributes:
      steps: the `StepBatch` (first N rows real, padded to `Rollouts.capacity`).
      rollouts: the played rows.
      q, v, a_star: float64[N] Q^pi(s_t, a_t), V^pi(s_t) (of the row's observation when the policy
        reads surface forms) and A* = Q - V, in the estimators' return convention.
      cell: int64[N] id of (task group, turn, latent state): rows of one cell share V.
    """

    steps: StepBatch
    rollouts: Rollouts
    q: np.ndarray
    v: np.ndarray
    a_star: np.ndarray
    cell: np.ndarray


def ground_truth(game: Game, ro: Rollouts, pi: np.ndarray, gamma: float):
    """(Q, V, A*) float64[N] of every row of `ro` under the policy `pi` that played it (`sample_rollouts`'s
    pi); a surface-form policy is valued through its form-averaged latent policy (forms are drawn
    uniformly and independently each turn), and V of a row is that of its own form."""
    pi = np.asarray(pi, np.float64)
    pi_latent = pi.mean(axis=2) if pi.ndim == 4 else pi
    qq, _ = policy_values(game, pi_latent, ro.horizon, gamma)
    q_all = qq[ro.seed, ro.step, ro.state]  # [N, A]
    row_pi = pi[ro.seed, ro.state, ro.form] if pi.ndim == 4 else pi[ro.seed, ro.state]
    q = q_all[np.arange(ro.num_rows), ro.action]
    v = np.sum(row_pi * q_all, axis=-1)
    return q, v, q - v


def build_batch(
    game: Game,
    ro: Rollouts,
    pi: np.ndarray,
    view: LabView,
    rng: np.random.Generator,
    *,
    gamma: float,
    render_text: bool = True,
) -> LabBatch:
    """The `StepBatch` of `ro` as the rollout builds it, and the exact values of its rows.

    Args:
      game, ro, pi: the game, its rollouts and the policy that played them.
      view: observation knobs (its `paraphrases` and `history` must be those `ro` was sampled with).
      rng: draws the noise tokens and the fingerprints.
      gamma: the estimators' discount (for Q and V).
      render_text: build the anchor texts and `assign_ids` them (as the rollout does); False uses
        `observation_keys` (the same partition, faster).
    Raises: ValueError when `view.history` differs from the rollouts'.
    """
    if ro.history.shape[1] != view.history:
        raise ValueError(f"build_batch: view.history={view.history} but the rollouts kept {ro.history.shape[1]}")
    n, cap = ro.num_rows, ro.capacity
    noise = rng.integers(0, view.noise_vocab, (n, view.noise_tokens))[ro.obs_source]
    obs_hash = assign_ids(anchor_texts(game, ro, noise)) if render_text else observation_keys(ro, noise)
    fp = fingerprints(game, ro, view, rng)
    pace = assign_ids([None if a == game.invalid_action else int(a) for a in ro.action])

    def padded(values, dtype, fill=0):
        out = np.full((cap,) + np.shape(values)[1:], fill, dtype)
        out[:n] = values
        return out

    steps = StepBatch.from_numpy(
        group_id=padded(ro.group, np.int32),
        traj_id=padded(ro.traj, np.int32),
        step=padded(ro.step, np.int32),
        reward=padded(ro.reward, np.float32),
        penalty=padded(ro.penalty, np.float32),
        obs_hash=padded(obs_hash, np.int32),
        fingerprint=padded(fp, np.float32),
        action_key=padded(pace, np.int32, fill=-1),
        mask=padded(np.ones(n, bool), bool, fill=False),
        group_capacity=ro.seeds * ro.groups,
        row_capacity=row_capacity(ro.group_size, ro.horizon),
    )
    q, v, a_star = ground_truth(game, ro, pi, gamma)
    cell = (ro.group.astype(np.int64) * ro.horizon + ro.step) * game.num_states + ro.state
    return LabBatch(steps=steps, rollouts=ro, q=q, v=v, a_star=a_star, cell=cell)
