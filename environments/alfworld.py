"""ALFWorld (text) adapter: the real ``alfworld`` TextWorld engine behind the ``TextEnv`` contract.

Engine: ``alfworld==0.4.2``'s ``AlfredTWEnv`` collects the games (same config keys, same filters:
task types 1-6, no ``movable``/``Sliced`` paths, only games marked solvable), and each game is
played by TextWorld's PDDL engine (fast-downward) with ALFWorld's own wrappers
(``AlfredDemangler`` for the "countertop 1" names, ``AlfredInfos``), exactly as
``AlfredTWEnv.init_env`` builds them, minus the gym batching and its step limit (one game per
``TextEnv``, which enforces the cap; the ``EnvPool`` runs many in worker processes). Nothing of
the engine is modified.

Game data, in this order:

1. ``data_path=...`` passed to ``make("alfworld", data_path=...)``: any folder holding
   ``<game>/traj_data.json`` + ``<game>/game.tw-pddl`` pairs.
2. ``$ALFWORLD_DATA`` (default ``~/.cache/alfworld``), when it holds them: the real ALFWorld
   games in the layout ALFWorld's own configs use, ``$ALFWORLD_DATA/json_2.1.1/train`` (3,553
   games), ``valid_seen`` (140, split ``"eval_in_distribution"``) and ``valid_unseen`` (134, split
   ``"eval_out_of_distribution"``). A user fetches them once, on a machine with internet access,
   with the download script the ``alfworld`` package installs (GitHub release archives of the
   trajectories, PDDL and TextWorld game files, plus a detector checkpoint the text games do
   not use)::

       pip install alfworld==0.4.2
       export ALFWORLD_DATA=~/.cache/alfworld   # where the script writes (or --data-dir DIR)
       alfworld-download                        # -f overwrites, -ff downloads again

3. Otherwise the small games committed in ``environments/data/alfworld_fixtures`` (12 games, two
   of each of the six task types; generated offline from the wheel by
   ``python -m launch.make_alfworld_fixtures``), for every split, with a warning;
   ``require_real_data=True`` raises instead. ``env.data_source`` says which one is in use.

Task ids: ``task_id`` indexes the collected game files sorted by their path relative to the data
folder (a fixed order, independent of the file system's listing order). ``num_tasks`` is the number
of games found.

Observation (verl-agent conventions): ``text`` = ``anchor`` = the engine's raw feedback (on reset
the whole intro: the room's receptacles and "Your task is to: ..."); ``task`` = the task sentence
without "Your task is to: " (e.g. "put a clean mug in coffeemachine"); ``admissible_actions`` = the
engine's admissible commands (sorted, as TextWorld returns them). Reward: 1.0 on the step that
solves the task (the episode then ends), else 0.0. ``max_steps`` (default 50, verl-agent's) is
enforced by ``TextEnv``; ``info["truncated"]`` marks a capped episode. ``info`` also has
``won`` and ``admissible`` (whether the command was among the admissible ones; an inadmissible
command leaves the game unchanged and reads "Nothing happens.").

Oracle: ``oracle_action()`` returns the expert's next command from the current state.
``expert_type="planner"`` (default) asks fast-downward for a plan from the current state, so it
re-plans after any mistake; it is computed only when ``oracle_action()`` is called (one search per
state; seconds on large kitchens) and solves all 12 fixture games. ``expert_type="handcoded"`` runs
ALFWorld's own ``HandCodedTWAgent`` alongside the game the way ``AlfredExpert`` does (it observes
every step, so it keeps up after the agent's own moves; its command is "look" where it has none
admissible); if it gives up (it raises on some states) the oracle returns None for the rest of the
episode and ``info["oracle_error"]`` says why. In ``alfworld==0.4.2`` it loses track of what it
holds after a "move" command (its bookkeeping looks for "put", the grammar says "move"), so it
fails pick-two tasks (0 of 2 fixture games; the other 10 solved). ``expert_type=None`` turns the
oracle off (fastest: no facts are computed).
Randomness (the handcoded expert's tie-breaks, the optional ``domain_randomization`` name
shuffle) draws from a private generator seeded by ``reset``'s ``seed``; Python's global
``random`` state is left as it was, and so is ``sys.argv`` (fast-downward's translator overwrites
it whenever it parses a game; the adapter restores it).

Cost (engine CPU time per call, random admissible commands, oracle off): on the fixtures (7-16
receptacles, 9-23 objects) a reset takes 0.2 s and a step 31 ms; on larger generated games (random
rooms, up to 2 copies of each object: 7-52 receptacles, 9-42 objects) 1.0 s and 86 ms. Switching
to another game adds a parse of its file (about one more reset). The planner oracle adds one
fast-downward search per state asked (tens of ms in small rooms, seconds in big kitchens).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import sys
import warnings
from typing import Any

from environments.base import Observation, TextEnv
from environments.registry import GameSpec, register_game
from environments.templates import turn_template

TASK_TYPES = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}
SPLITS = {  # AlfredTWEnv split name -> folder under $ALFWORLD_DATA/json_2.1.1
    "train": "train",
    "eval_in_distribution": "valid_seen",
    "eval_out_of_distribution": "valid_unseen",
}
EXPERT_TYPES = ("handcoded", "planner", None)
FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "alfworld_fixtures")
_TASK_PREFIX = "Your task is to: "

_INSTALL_HINT = (
    "ALFWorld is not installed: `pip install alfworld==0.4.2` (it compiles fast-downward; "
    "needs cmake and a C++ compiler)"
)


def _import_engine():
    try:
        import textworld  # noqa: F401
        from alfworld.agents.environment import alfred_tw_env  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT}; import failed with: {e}") from e
    return alfred_tw_env


def resolve_data_path(split: str, data_path: str | None = None, require_real_data: bool = False) -> tuple[str, str]:
    """The folder holding the games of ``split`` and where it comes from.

    Order: ``data_path`` if given; else ``$ALFWORLD_DATA/json_2.1.1/<train|valid_seen|valid_unseen>``
    if that folder exists; else the bundled fixtures (a warning names the missing folder), unless
    ``require_real_data``, which raises instead. (Importing ``alfworld`` sets $ALFWORLD_DATA to
    ``~/.cache/alfworld`` when unset, so the variable alone does not mean the data is there.)

    Returns (path, source) with source one of "data_path", "ALFWORLD_DATA", "fixtures".
    Raises ValueError for an unknown split, FileNotFoundError for a missing ``data_path`` or,
    with ``require_real_data``, missing real data.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if data_path is not None:
        path = os.path.expanduser(data_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"ALFWorld games folder data_path={path!r} does not exist")
        return path, "data_path"
    root = os.path.expanduser(os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld")
    real = os.path.join(root, "json_2.1.1", SPLITS[split])
    if os.path.isdir(real):
        return real, "ALFWORLD_DATA"
    if require_real_data:
        raise FileNotFoundError(
            f"ALFWorld data folder {real!r} does not exist: set $ALFWORLD_DATA and run "
            "`alfworld-download` (see environments/alfworld.py)"
        )
    warnings.warn(
        f"ALFWorld data folder {real!r} does not exist: playing the {split!r} split on the bundled "
        f"fixture games in {FIXTURES_DIR} (run `alfworld-download` with $ALFWORLD_DATA set for the "
        "real games)",
        stacklevel=2,
    )
    return FIXTURES_DIR, "fixtures"


def task_sentence(intro: str) -> str:
    """The task sentence of an ALFWorld intro ("...Your task is to: put a mug in microwave.").

    Returns the text after "Your task is to: " without the final period; raises ValueError when
    the intro has no such sentence.
    """
    start = intro.rfind(_TASK_PREFIX)
    if start < 0:
        raise ValueError(f"observation has no {_TASK_PREFIX!r} sentence: {intro[:200]!r}")
    return intro[start + len(_TASK_PREFIX) :].strip().rstrip(".")


def _task_type_of(game_file: str) -> str:
    """Task type of a game from its folder name (ALFWorld names them '<task_type>-<obj>-...')."""
    folder = os.path.basename(os.path.dirname(os.path.dirname(game_file)))
    for name in sorted(TASK_TYPES.values(), key=len, reverse=True):
        if folder.startswith(name + "-"):
            return name
    with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
        return json.load(f)["task_type"]


class AlfWorldEnv(TextEnv):
    """One ALFWorld text game at a time (see the module docstring for data, observations, oracle).

    Args:
      max_steps: step cap (default 50, verl-agent's ALFWorld setting); an int >= 1.
      split: "train", "eval_in_distribution" (valid_seen) or "eval_out_of_distribution"
        (valid_unseen); selects the folder under $ALFWORLD_DATA.
      data_path: a folder of games overriding $ALFWORLD_DATA and the fixtures.
      require_real_data: raise FileNotFoundError instead of falling back to the fixtures when
        $ALFWORLD_DATA holds no games for ``split`` (for real training runs).
      task_types: subset of 1..6 (ALFWorld's numbering, ``TASK_TYPES``) to keep.
      expert_type: "handcoded", "planner" or None (no oracle).
      domain_randomization: shuffle the object numbering at each reset (ALFWorld's option; off in
        verl-agent and here by default).
      num_games: keep only the first ``num_games`` games (ALFWorld's ``num_train_games``); -1 = all.

    Raises ImportError (with the pip line) when alfworld is missing, ValueError on a bad option,
    FileNotFoundError when the games folder does not exist or holds no game.
    """

    def __init__(
        self,
        max_steps: int = 50,
        split: str = "train",
        data_path: str | None = None,
        task_types=(1, 2, 3, 4, 5, 6),
        expert_type: str | None = "planner",
        domain_randomization: bool = False,
        num_games: int = -1,
        require_real_data: bool = False,
    ):
        super().__init__(max_steps)
        if expert_type not in EXPERT_TYPES:
            raise ValueError(f"expert_type must be one of {EXPERT_TYPES}, got {expert_type!r}")
        task_types = tuple(task_types)
        if not task_types or any(t not in TASK_TYPES for t in task_types):
            raise ValueError(f"task_types must be a non-empty subset of {sorted(TASK_TYPES)}, got {task_types!r}")
        if not isinstance(num_games, int) or (num_games < 1 and num_games != -1):
            raise ValueError(f"num_games must be -1 (all) or an int >= 1, got {num_games!r}")
        alfred_tw_env = _import_engine()
        self._alfred = alfred_tw_env
        self.data_path, self.data_source = resolve_data_path(split, data_path, require_real_data)
        self.split = split
        self.expert_type = expert_type
        self.domain_randomization = bool(domain_randomization)
        config = {
            "env": {
                "goal_desc_human_anns_prob": 0.0,
                "task_types": list(task_types),
                "domain_randomization": self.domain_randomization,
                "expert_type": expert_type or "handcoded",
            },
            "dataset": {
                "data_path": self.data_path,
                "eval_id_data_path": self.data_path,
                "eval_ood_data_path": self.data_path,
                "num_train_games": -1,
                "num_eval_games": -1,
            },
            "general": {"training_method": "dagger"},
            "dagger": {"training": {"max_nb_steps_per_episode": max_steps}},
            "logic": {"domain": "", "grammar": ""},  # read only by AlfredTWEnv.get_game_logic (unused)
        }
        argv = sys.argv
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            collector = alfred_tw_env.AlfredTWEnv(config, train_eval=split)  # prints, shows a tqdm bar
        sys.argv = argv
        files = sorted(collector.game_files, key=lambda p: os.path.relpath(p, self.data_path))
        if num_games != -1:
            files = files[:num_games]
        if not files:
            raise FileNotFoundError(f"no solvable ALFWorld game of task types {task_types} under {self.data_path!r}")
        self.game_files = files
        self._task_types = [_task_type_of(p) for p in files]
        self._env = None
        self._loaded = None
        self._rng = random.Random(0)
        self._expert = None
        self._oracle: str | None = None
        self._oracle_error: str | None = None
        self._plan_cached = False
        self._state = None
        self._task = ""

    # -- TextEnv -------------------------------------------------------------------------------
    @property
    def num_tasks(self) -> int:
        return len(self.game_files)

    def task_info(self, task_id: int) -> dict[str, Any]:
        """``{"task_type": <ALFWorld task type name>, "game": <game folder relative to the data>}``."""
        if not 0 <= int(task_id) < self.num_tasks:
            raise ValueError(f"task_id must lie in [0, {self.num_tasks}), got {task_id}")
        rel = os.path.relpath(os.path.dirname(self.game_files[task_id]), self.data_path)
        return {"task_type": self._task_types[task_id], "game": rel}

    @contextlib.contextmanager
    def _engine_context(self):
        """Run engine/expert code on this env's own ``random`` stream (they call the global module)
        and undo the engine's process-wide side effect (fast-downward's translator overwrites
        ``sys.argv`` each time it parses a game)."""
        saved, argv = random.getstate(), sys.argv
        random.setstate(self._rng.getstate())
        try:
            yield
        finally:
            self._rng.setstate(random.getstate())
            random.setstate(saved)
            sys.argv = argv

    def _load(self, game_file: str) -> None:
        if self._env is None:
            # One engine for the env's lifetime, wrapped as AlfredTWEnv.init_env wraps it; games are
            # switched with load() (each PddlEnv holds its own copy of fast-downward's 33 MB
            # library, which TextWorld never unloads: a new engine per game would leak it).
            import textworld
            from textworld.envs.pddl import PddlEnv

            infos = textworld.EnvInfos(
                won=True, admissible_commands=True, extras=["gamefile"], facts=self.expert_type == "handcoded"
            )
            env = PddlEnv(infos)
            for wrapper in (self._alfred.AlfredDemangler(shuffle=self.domain_randomization), self._alfred.AlfredInfos):
                env = wrapper(env)
            self._env = env
        self._env.load(game_file)
        self._loaded = game_file

    def _reset(self, task_id: int, seed: int) -> Observation:
        self._rng.seed(seed)
        game_file = self.game_files[task_id]
        with self._engine_context():
            if game_file != self._loaded or self.domain_randomization:
                self._load(game_file)  # parses the PDDL; randomised names are drawn here
            state = self._env.reset()
            self._oracle_error = None
            self._expert = None
            if self.expert_type == "handcoded":
                from alfworld.agents.expert import HandCodedTWAgent

                self._expert = HandCodedTWAgent(max_steps=200)
                self._expert.reset(game_file)
                self._expert.observe(state["feedback"])
                self._oracle = "look"  # AlfredExpert's first command
        self._state = state
        self._task = task_sentence(state["feedback"])
        self._plan_cached = False
        return self._observation(state)

    def _step(self, action: str):
        action = str(action)
        admissible = self._state["admissible_commands"]
        with self._engine_context():
            state, _, done = self._env.step(action)
            if self._expert is not None and not done:
                self._oracle = self._handcoded_action(state, action)
        self._state = state
        won = bool(state["won"])
        self._plan_cached = False
        if done:
            self._oracle = None
        info = {"won": won, "admissible": action in admissible}
        if self._oracle_error is not None:
            info["oracle_error"] = self._oracle_error
        return self._observation(state), (1.0 if won else 0.0), bool(done or won), info

    # -- oracle --------------------------------------------------------------------------------
    def oracle_action(self) -> str | None:
        """The expert's next command from the current state, or None (oracle off, game over, expert failed)."""
        if self._done:
            return None
        if self.expert_type == "planner" and not self._plan_cached:
            self._oracle = self._planner_action()
            self._plan_cached = True
        return self._oracle

    def _handcoded_action(self, state, last_action: str) -> str | None:
        try:
            nxt = self._expert.act(state, 0, state["won"], last_action)
        except Exception as e:  # the expert gives up on some states (HandCodedAgentFailed/Timeout, ...)
            self._expert = None
            self._oracle_error = f"{type(e).__name__}: {e}"
            return None
        return nxt if nxt in state["admissible_commands"] else "look"

    def _planner_action(self) -> str | None:
        # What TextWorld's PddlEnv computes for ``policy_commands``, asked only when needed:
        # fast-downward's plan from the current state, as commands.
        pddl_env = self._env.unwrapped
        with self._engine_context():
            plan = pddl_env._pddl_state.replan(pddl_env._entity_infos)
        return plan[0] if plan else None

    def _observation(self, state) -> Observation:
        text = state["feedback"]
        return Observation(
            text=text,
            anchor=text,
            task=self._task,
            admissible_actions=list(state["admissible_commands"]),
            won=bool(state["won"]),
        )

    def close(self) -> None:
        """Drop the engine; a later reset starts a new one. (TextWorld offers no way to unload the
        engine's fast-downward library copy: unloading it by hand crashes the process.)"""
        if self._env is not None:
            self._env.close()
            self._env = None
            self._loaded = None


def make_alfworld(**options) -> AlfWorldEnv:
    """``environments.make("alfworld", **options)``: an ``AlfWorldEnv`` (options as its arguments)."""
    return AlfWorldEnv(**options)


_INTRO = (
    "You are an expert agent acting in ALFWorld, the text version of the ALFRED household "
    "environment. Your task is to: {task}\n"
)
#: ALFWorld's default prompt (verl-agent style, with the admissible commands but ``help``).
TEMPLATE = turn_template(_INTRO)


SPEC = register_game(
    GameSpec(
        name="alfworld",
        factory=make_alfworld,
        template=TEMPLATE,
        fallback_action="inventory",  # a real command that changes nothing
        categories=("task_type",),
    )
)
