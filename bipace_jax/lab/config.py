"""The lab's run config (ml_collections) and its validation; `launch/lab.py` reads it.

Every field can be overridden on the command line, `--config.view.paraphrases=8`, as in
`launch/train.py`. A bad field raises `bipace_jax.config.ConfigError` naming it (`config.<section>.<field>`)
and the expected value, before anything is compiled.
"""

from __future__ import annotations

import math

import ml_collections

from bipace_jax.config import ConfigError
from bipace_jax.estimators import EstimatorConfig, registry
from bipace_jax.lab.game import Game, crafting_game
from bipace_jax.lab.observe import LabView

MODES = ("grid", "cell")
POLICIES = ("latent", "observation")


def default_config() -> ml_collections.ConfigDict:
    """The documented grid (`docs/lab.md`); `mode="cell"` runs one cell of it instead."""
    c = ml_collections.ConfigDict()
    c.mode = "grid"  # "grid": the documented sweep with plots; "cell": one (view, estimators) cell
    c.out = ""  # "" -> docs/results/lab (grid) or benchmarks/lab.json (cell)
    c.seed = 0  # numpy seed of rollouts, noise tokens and fingerprints
    c.delta = 1e-3  # rows with |A*| <= delta are left out of corr and sign
    c.render_text = True  # anchor texts + assign_ids as the rollout does (False: the same partition, faster)
    c.score_bonus = 1.0  # the scored policy: softmax with this logit bonus on each live stage's recipe action
    c.game = ml_collections.ConfigDict(
        dict(
            tasks=4,
            stages=3,
            actions=4,
            slip=0.2,
            trap_prob=0.5,
            success_reward=1.0,
            invalid_penalty=0.1,
            horizon=10,
            recipe_seed=0,
        )
    )
    c.view = ml_collections.ConfigDict(
        dict(
            paraphrases=1,
            history=0,
            noise_tokens=0,
            noise_vocab=50,
            sigma=0.0,
            dim=32,
            false_merge=0.0,
            false_split=0.0,
            drift=0.0,  # fingerprint drift per policy version (the staleness model; rows with a lag only)
        )
    )
    c.batch = ml_collections.ConfigDict(
        dict(
            seeds=200,
            groups=4,
            group_size=8,
            # The lab's model of the rollout's `rollout.branch`: fork every game at these turns
            # ("2" or "1,4"; "" = independent games) into branch_children continuations, G games in all.
            branch_turns="",
            branch_children=1,
            # The lab's model of asynchronous RL's `async.max_staleness`: each game plays the policy
            # of 0..k versions ago (learning; the scored cells model only the fingerprint drift).
            max_staleness=0,
        )
    )
    c.estimator = ml_collections.ConfigDict(
        dict(
            names="",
            gamma=0.95,
            omega=1.0,
            norm="mean",
            epsilon=0.05,
            centroid="mean",
            hgpo_history=2,
            hgpo_alpha=1.0,
            hgpo_base_group=False,
        )
    )
    c.learn = ml_collections.ConfigDict(dict(iterations=20, lr=2.0, policy="latent"))
    c.grid = ml_collections.ConfigDict(
        dict(
            paraphrases="1,2,4,8,16,32,64",
            sigmas="0,0.1,0.2,0.3,0.5",
            sigma_at_paraphrases=8,  # the sigma sweep's m
            paraphrases_at_sigma=0.1,  # the m sweep's sigma
            false_merges="0,0.25,0.5,1",
            merge_paraphrases="1,8,64",
            # Learning-curve cells "m:sigma:false_merge:policy" joined by ";" (policy: latent | observation).
            learning="1:0:0:latent;16:0.1:0:latent;16:0.5:0:latent;4:0.1:0:observation;4:0.1:1:observation",
            anchor_report="docs/results/estimators_textcraft_tiny/report.json",
            # Branching: settings "turns:children" ("none" = independent games) joined by ";", scored at
            # each of branch_paraphrases (sigma paraphrases_at_sigma); learning for branch_learning's.
            branch="none;1:2;3:2;3:4;1,4:2",
            branch_paraphrases="1,16",
            branch_learning="none;3:4",
            branch_learning_paraphrases=16,
            # Staleness: max lags k x drifts per version, scored at stale_paraphrases (sigma
            # paraphrases_at_sigma, drift only); learning for each k at stale_learning_drift.
            staleness="0,1,2,4",
            drifts="0.05,0.2,0.5",
            stale_paraphrases=16,
            stale_learning_drift=0.2,
        )
    )
    return c


def _fail(field: str, expected: str, got) -> None:
    raise ConfigError(f"config.{field} must {expected}, got {got!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_list(c: ml_collections.ConfigDict, field: str, kind=float) -> list:
    """The comma-separated list `config.<field>` as `kind` values; raises ConfigError naming it."""
    text = c
    for part in field.split("."):
        text = text[part]
    try:
        out = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        _fail(field, f"be a comma-separated list of {kind.__name__} values", text)
    if not out:
        _fail(field, "list at least one value", text)
    return out


def learning_cells(c: ml_collections.ConfigDict) -> list[tuple[int, float, float, str]]:
    """`config.grid.learning` as (paraphrases, sigma, false_merge, policy) tuples; raises ConfigError."""
    out = []
    for item in str(c.grid.learning).split(";"):
        parts = item.strip().split(":")
        try:
            m, sigma, fm, policy = int(parts[0]), float(parts[1]), float(parts[2]), parts[3]
            if len(parts) != 4 or m < 1 or sigma < 0 or not 0 <= fm <= 1 or policy not in POLICIES:
                raise ValueError
        except (ValueError, IndexError):
            _fail(
                "grid.learning",
                "be 'm:sigma:false_merge:policy' items (m >= 1, sigma >= 0, false_merge in [0, 1], policy "
                "latent or observation) joined by ';'",
                c.grid.learning,
            )
        out.append((m, sigma, fm, policy))
    return out


def branch_turns(c: ml_collections.ConfigDict, field: str = "batch.branch_turns", text=None) -> tuple[int, ...]:
    """`config.batch.branch_turns` ("" or comma-separated turns) as a tuple; raises ConfigError naming it."""
    text = c.batch.branch_turns if text is None else text
    try:
        turns = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        turns = None
    if turns is None or any(t < 0 or t >= c.game.horizon for t in turns) or len(set(turns)) != len(turns):
        _fail(field, f"be '' or distinct comma-separated turns in [0, {c.game.horizon})", text)
    return tuple(sorted(turns))


def _check_branch(c, turns: tuple, children, field: str) -> None:
    """The tree fits the task group: children >= 2 with turns (1 without), G a multiple of c^b."""
    if not _is_int(children) or children < 1:
        _fail(field, "be an int >= 1", children)
    if turns and children < 2:
        _fail(field, "be an int >= 2 when branch turns are set (1 = independent games)", children)
    if not turns and children != 1:
        _fail(field, "be 1 when no branch turn is set", children)
    leaves = children ** len(turns)
    if c.batch.group_size % leaves:
        _fail(
            field,
            f"make children ** len(turns) divide batch.group_size={c.batch.group_size} (the same number of games "
            f"per task group; {children} ** {len(turns)} = {leaves})",
            children,
        )


def branch_settings(c: ml_collections.ConfigDict, field: str = "grid.branch") -> list[tuple[tuple[int, ...], int]]:
    """`config.grid.branch` (or `grid.branch_learning`) as (turns, children) settings; raises ConfigError."""
    out = []
    for item in str(c.grid[field.split(".")[-1]]).split(";"):
        item = item.strip()
        if item == "none":
            out.append(((), 1))
            continue
        turns_text, _, children = item.partition(":")
        try:
            kids = int(children)
        except ValueError:
            _fail(field, "be 'none' or 'turns:children' items (e.g. '3:4', '1,4:2') joined by ';'", c.grid[field[5:]])
        turns = branch_turns(c, field, turns_text)
        if not turns:
            _fail(field, "be 'none' or 'turns:children' items (e.g. '3:4', '1,4:2') joined by ';'", c.grid[field[5:]])
        _check_branch(c, turns, kids, field)
        out.append((turns, kids))
    return out


def validate(c: ml_collections.ConfigDict) -> None:
    """Checks every field; raises ConfigError naming the first bad one (`config.<section>.<field>`)."""
    if c.mode not in MODES:
        _fail("mode", f"be one of {list(MODES)}", c.mode)
    for field, v, ok, want in (
        ("seed", c.seed, _is_int(c.seed) and c.seed >= 0, "be an int >= 0"),
        ("delta", c.delta, _is_num(c.delta) and c.delta >= 0, "be a float >= 0"),
        ("score_bonus", c.score_bonus, _is_num(c.score_bonus), "be a finite float"),
        ("render_text", c.render_text, isinstance(c.render_text, bool), "be a bool"),
        ("game.horizon", c.game.horizon, _is_int(c.game.horizon) and c.game.horizon >= 1, "be an int >= 1"),
        ("batch.seeds", c.batch.seeds, _is_int(c.batch.seeds) and c.batch.seeds >= 2, "be an int >= 2 (intervals)"),
        ("batch.groups", c.batch.groups, _is_int(c.batch.groups) and c.batch.groups >= 1, "be an int >= 1"),
        (
            "batch.group_size",
            c.batch.group_size,
            _is_int(c.batch.group_size) and c.batch.group_size >= 2,
            "be an int >= 2",
        ),
        (
            "learn.iterations",
            c.learn.iterations,
            _is_int(c.learn.iterations) and c.learn.iterations >= 1,
            "be an int >= 1",
        ),
        ("learn.lr", c.learn.lr, _is_num(c.learn.lr) and c.learn.lr > 0, "be a float > 0"),
        (
            "grid.sigma_at_paraphrases",
            c.grid.sigma_at_paraphrases,
            _is_int(c.grid.sigma_at_paraphrases) and c.grid.sigma_at_paraphrases >= 1,
            "be an int >= 1",
        ),
        (
            "grid.paraphrases_at_sigma",
            c.grid.paraphrases_at_sigma,
            _is_num(c.grid.paraphrases_at_sigma) and c.grid.paraphrases_at_sigma >= 0,
            "be a float >= 0",
        ),
    ):
        if not ok:
            _fail(field, want, v)
    for name in ("tasks", "stages", "actions", "recipe_seed"):
        if not _is_int(c.game[name]):
            _fail(f"game.{name}", "be an int", c.game[name])
    for name in ("slip", "trap_prob", "success_reward", "invalid_penalty"):
        if not _is_num(c.game[name]):
            _fail(f"game.{name}", "be a finite float", c.game[name])
    if c.learn.policy not in POLICIES:
        _fail("learn.policy", f"be one of {list(POLICIES)}", c.learn.policy)
    _check_branch(c, branch_turns(c), c.batch.branch_children, "batch.branch_children")
    if not (_is_int(c.batch.max_staleness) and c.batch.max_staleness >= 0):
        _fail("batch.max_staleness", "be an int >= 0 (0 = synchronous)", c.batch.max_staleness)
    if c.batch.max_staleness > 0 and c.batch.branch_turns:
        _fail(
            "batch.max_staleness",
            "be 0 when batch.branch_turns is set (the lab models them apart)",
            c.batch.max_staleness,
        )
    for field, ok, want in (
        ("grid.branch_learning_paraphrases", _is_int(c.grid.branch_learning_paraphrases), "be an int >= 1"),
        ("grid.stale_paraphrases", _is_int(c.grid.stale_paraphrases), "be an int >= 1"),
        ("grid.stale_learning_drift", _is_num(c.grid.stale_learning_drift), "be a float >= 0"),
    ):
        if not ok or c.grid[field[5:]] < (1 if "paraphrases" in field else 0):
            _fail(field, want, c.grid[field[5:]])
    branch_settings(c, "grid.branch")
    branch_settings(c, "grid.branch_learning")
    game(c)
    view(c)
    estimator_configs(c)
    for field, kind, lo, hi in (
        ("grid.paraphrases", int, 1, None),
        ("grid.sigmas", float, 0.0, None),
        ("grid.false_merges", float, 0.0, 1.0),
        ("grid.merge_paraphrases", int, 1, None),
        ("grid.branch_paraphrases", int, 1, None),
        ("grid.staleness", int, 0, None),
        ("grid.drifts", float, 0.0, None),
    ):
        for v in parse_list(c, field, kind):
            if v < lo or (hi is not None and v > hi):
                _fail(field, f"hold values >= {lo}" + (f" and <= {hi}" if hi is not None else ""), v)
    learning_cells(c)


def game(c: ml_collections.ConfigDict) -> Game:
    """The `crafting_game` of `config.game`; raises ConfigError naming the field."""
    g = c.game
    try:
        return crafting_game(
            tasks=g.tasks,
            stages=g.stages,
            actions=g.actions,
            slip=g.slip,
            trap_prob=g.trap_prob,
            success_reward=g.success_reward,
            invalid_penalty=g.invalid_penalty,
            seed=g.recipe_seed,
        )
    except ValueError as e:
        # "crafting_game: <arg> must be ..." names the argument; `seed` is the field `recipe_seed`.
        msg = str(e).split(": ", 1)[-1]
        name = msg.split()[0]
        name = "recipe_seed" if name == "seed" else name
        raise ConfigError(f"config.game.{name}: {msg}") from None


def view(c: ml_collections.ConfigDict, **changes) -> LabView:
    """The `LabView` of `config.view` with `changes`; raises ConfigError naming the field."""
    fields = dict(c.view.to_dict(), **changes)
    try:
        return LabView(**fields)
    except ValueError as e:
        name = str(e).split(":")[0].split(".")[-1]
        raise ConfigError(f"config.view.{name}: {str(e).split(': ', 1)[1]}") from None


def estimator_configs(c: ml_collections.ConfigDict) -> dict[str, EstimatorConfig]:
    """One `EstimatorConfig` per name of `config.estimator.names` ("" = every registered estimator)."""
    e = c.estimator
    names = [n.strip() for n in str(e.names).split(",") if n.strip()] or list(registry.names())
    out = {}
    for n in names:
        try:
            out[n] = EstimatorConfig(
                name=n,
                gamma=e.gamma,
                omega=e.omega,
                norm=e.norm,
                epsilon=e.epsilon,
                centroid=e.centroid,
                hgpo_history=e.hgpo_history,
                hgpo_alpha=e.hgpo_alpha,
                hgpo_base_group=e.hgpo_base_group,
            )
        except ValueError as err:
            field = str(err).split(":")[0].split(".")[-1]
            field = "names" if field == "name" else field
            raise ConfigError(f"config.estimator.{field}: {str(err).split(': ', 1)[1]}") from None
    return out
