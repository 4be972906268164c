"""Generate small ALFWorld text games offline, from what the ``alfworld`` wheel ships.

The real games come from ``alfworld-download``, which this machine cannot reach. This script writes
games in the same on-disk format, which the real, unmodified ``AlfredTWEnv`` (TextWorld PDDL engine
+ fast-downward) loads and plays:

    <out_dir>/<task_type>-<Object>-None-<Parent>-<floor plan number>/trial_s<seed>/
        game.tw-pddl     JSON: pddl_domain (the wheel's alfred.pddl), grammar (the wheel's alfred.twl2,
                         "UNKNOWN GOAL" replaced by the task sentence), pddl_problem (written here),
                         solvable (true once the planner solved it)
        traj_data.json   task_type, pddl_params (read by AlfredTWEnv and the handcoded expert),
                         scene (floor plan, seed), and the planner's walkthrough

Sources, all in the wheel: the PDDL domain and grammar (``alfworld/data``), the 120 floor plans
(``alfworld/gen/layouts``), the affordances (``alfworld/gen/constants.py``) and the goal templates
(``alfworld/gen/goal_library.py``). A game: the floor plan's static receptacles, each at its own
location; every placeable object type in 1..max_copies copies (the target in enough copies for the
task), each inside a receptacle that may hold it (never one of the goal's type); the agent in the
middle of the room; one goal. Only games the planner solves are written.

    python -m launch.make_alfworld_fixtures [--out_dir=DIR] [--games_per_type=2] [--seed=0]
        [--smallest_rooms=true] [--max_copies=1]

The committed fixtures (environments/data/alfworld_fixtures, the default ``--out_dir``) are this
command's output with its defaults (cheap games for CI); ``--nosmallest_rooms --max_copies=2`` gives
games closer in size to the real data.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

from environments.alfworld import FIXTURES_DIR

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
# Device receptacle each state-change task needs (the domain's CleanObject only accepts SinkBasin).
_DEVICE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable"),
}
_LAMP = "DeskLamp"
_LAMP_HOLDERS = ("Desk", "SideTable", "Dresser")
_AGENT_STEP_SIZE = 0.25  # metres per grid unit (alfworld.gen.constants.AGENT_STEP_SIZE)


def _alfworld_paths() -> dict[str, str]:
    import alfworld

    root = os.path.dirname(alfworld.__file__)
    return {
        "domain": os.path.join(root, "data", "alfred.pddl"),
        "grammar": os.path.join(root, "data", "alfred.twl2"),
        "layouts": os.path.join(root, "gen", "layouts"),
    }


def mangle(name: str) -> str:
    """THOR id -> PDDL symbol, ALFWorld's convention ('|' -> '_bar_', '-' -> '_minus_', ...)."""
    table = {"-": "_minus_", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"}
    return "".join(table.get(c, c) for c in name)


def _coord(v: float) -> str:
    return f"{v:+06.2f}"


def _thor_id(type_name: str, x: float, y: float, z: float) -> str:
    coords = f"{_coord(x)}|{_coord(y)}|{_coord(z)}"
    owner = {"SinkBasin": "Sink", "BathtubBasin": "Bathtub"}.get(type_name)  # e.g. Sink|x|y|z|SinkBasin
    return f"{owner}|{coords}|{type_name}" if owner else f"{type_name}|{coords}"


def _loc(x: float, z: float, rot: int, hor: int) -> str:
    return f"loc|{int(round(x / _AGENT_STEP_SIZE))}|{int(round(z / _AGENT_STEP_SIZE))}|{rot}|{hor}"


def floor_plans() -> list[str]:
    """Names of the floor plans the wheel ships (e.g. 'FloorPlan1'), sorted by number."""
    names = {f.split("-")[0] for f in os.listdir(_alfworld_paths()["layouts"]) if f.endswith("-objects.json")}
    return sorted(names, key=lambda n: int(n[len("FloorPlan") :]))


def _load_layout(floor_plan: str):
    import numpy as np

    layouts = _alfworld_paths()["layouts"]
    with open(os.path.join(layouts, f"{floor_plan}-objects.json")) as f:
        types = set(json.load(f))
    with open(os.path.join(layouts, f"{floor_plan}-openable.json")) as f:
        points = json.load(f)
    grid = np.load(os.path.join(layouts, f"{floor_plan}-layout.npy"))
    return types, points, [tuple(map(float, p)) for p in grid.tolist()]


class _Scene:
    """Receptacles, objects and locations of one generated game (THOR-style ids, unmangled)."""

    def __init__(self, floor_plan: str, rng: random.Random):
        import alfworld.gen.constants as C

        self.C = C
        types, points, grid = _load_layout(floor_plan)
        self.static = sorted(C.RECEPTACLES - C.MOVABLE_RECEPTACLES_SET)
        self.types = types
        self.receptacles: dict[str, str] = {}  # id -> type
        self.location: dict[str, str] = {}  # receptacle id -> location symbol
        used_locs: set[str] = set()
        used_grid: set[tuple[float, float]] = set()

        def add_location(rid, x, z, rot, hor):
            loc = _loc(x, z, rot, hor)
            while loc in used_locs:  # one receptacle per location (ALFWorld's "go to" names one)
                hor += 15
                loc = _loc(x, z, rot, hor)
            used_locs.add(loc)
            used_grid.add((x, z))
            self.location[rid] = loc

        for rid, (x, z, rot, hor) in sorted(points.items()):
            rtype = rid.split("|")[0]
            if rtype in self.static and rtype in types:
                self.receptacles[rid] = rtype
                add_location(rid, x, z, int(rot) // 90, int(hor))
        present = set(self.receptacles.values())
        free = [p for p in grid if p not in used_grid]
        rng.shuffle(free)
        for rtype in self.static:
            if rtype in types and rtype not in present:
                x, z = free.pop()
                rid = _thor_id(rtype, x + 0.5, 0.9, z + 0.5)
                self.receptacles[rid] = rtype
                add_location(rid, x, z, rng.randrange(4), 30)
        free = [p for p in free if p not in used_grid]
        x, z = free.pop()
        self.agent_location = _loc(x, z, rng.randrange(4), 30)
        while self.agent_location in used_locs:
            self.agent_location += "0"
        self.objects: dict[str, str] = {}  # id -> type
        self.inside: dict[str, str] = {}  # object id -> receptacle id

    def holders(self, otype: str) -> list[str]:
        """Receptacle ids in this scene that may hold ``otype`` (constants.VAL_RECEPTACLE_OBJECTS)."""
        if otype == _LAMP:
            return [r for r, t in sorted(self.receptacles.items()) if t in _LAMP_HOLDERS]
        vro = self.C.VAL_RECEPTACLE_OBJECTS
        return [r for r, t in sorted(self.receptacles.items()) if otype in vro.get(t, ())]

    def placeable_types(self) -> list[str]:
        return [t for t in sorted(self.types) if t not in self.static and t in self.C.OBJECTS_SET and self.holders(t)]

    def place(self, otype: str, rng: random.Random, avoid_types: set[str]) -> None:
        options = [r for r in self.holders(otype) if self.receptacles[r] not in avoid_types]
        if not options:
            raise ValueError(f"no receptacle for {otype}")
        rid = rng.choice(options)
        parts = rid.split("|")
        x, y, z = (float(v) for v in parts[1:4])
        while True:
            oid = f"{otype}|{_coord(x + rng.uniform(-0.3, 0.3))}|{_coord(y + rng.uniform(0.0, 0.2))}|{_coord(z + rng.uniform(-0.3, 0.3))}"
            if oid not in self.objects:
                break
        self.objects[oid] = otype
        self.inside[oid] = rid


def _choose_task(task_type: str, scene: _Scene, rng: random.Random) -> dict[str, Any]:
    C = scene.C
    placeable = scene.placeable_types()
    pickupable = [t for t in placeable if t != _LAMP]
    present_receptacles = sorted(set(scene.receptacles.values()))
    vro = C.VAL_RECEPTACLE_OBJECTS
    candidates = []
    for obj in pickupable:
        if task_type in _DEVICE:
            device, affordance = _DEVICE[task_type]
            if device not in present_receptacles or obj not in C.VAL_ACTION_OBJECTS[affordance]:
                continue
        if task_type == "look_at_obj_in_light":
            if _LAMP not in placeable:
                continue
            candidates.append((obj, "", _LAMP))
            continue
        for parent in present_receptacles:
            if obj not in vro.get(parent, ()):
                continue
            if task_type in _DEVICE and parent == _DEVICE[task_type][0]:
                continue
            # The target must start outside every receptacle of the goal's type.
            if not [r for r in scene.holders(obj) if scene.receptacles[r] != parent]:
                continue
            candidates.append((obj, parent, ""))
    if not candidates:
        raise ValueError(f"floor plan has no {task_type} task")
    obj, parent, toggle = rng.choice(candidates)
    return {
        "object_target": obj,
        "parent_target": parent,
        "toggle_target": toggle,
        "mrecep_target": "",
        "object_sliced": False,
    }


def _problem(name: str, task_type: str, params: dict[str, Any], scene: _Scene) -> str:
    import alfworld.gen.goal_library as glib

    C = scene.C
    otypes = sorted((C.OBJECTS_SET | {_LAMP}) - set(scene.static))
    m = mangle
    objs = sorted(scene.objects)
    receps = sorted(scene.receptacles)
    locations = sorted(set(scene.location.values()) | {scene.agent_location})
    ind = "\n        "
    declared = (
        ["agent1 - agent"]
        + [f"{t}Type - otype" for t in otypes]
        + [f"{t}Type - rtype" for t in scene.static]
        + [f"{m(o)} - object" for o in objs]
        + [f"{m(r)} - receptacle" for r in receps]
        + [f"{m(loc)} - location" for loc in locations]
    )
    init = ["(= (total-cost) 0)", f"(atLocation agent1 {m(scene.agent_location)})"]
    for r in receps:
        rtype = scene.receptacles[r]
        init += [f"(receptacleType {m(r)} {rtype}Type)", f"(receptacleAtLocation {m(r)} {m(scene.location[r])})"]
        if rtype in C.OPENABLE_CLASS_SET:
            init.append(f"(openable {m(r)})")
    present_otypes = sorted(set(scene.objects.values()))
    for rtype in sorted(set(scene.receptacles.values())):
        for otype in present_otypes:
            if otype in C.VAL_RECEPTACLE_OBJECTS.get(rtype, ()):
                init.append(f"(canContain {rtype}Type {otype}Type)")
    actions = C.VAL_ACTION_OBJECTS
    for o in objs:
        otype = scene.objects[o]
        init.append(f"(objectType {m(o)} {otype}Type)")
        if otype != _LAMP:
            init.append(f"(pickupable {m(o)})")
        if otype in C.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {m(o)})")
        for affordance in ("Cleanable", "Heatable", "Coolable", "Toggleable", "Sliceable"):
            if otype in actions[affordance]:
                init.append(f"({affordance.lower()} {m(o)})")
        r = scene.inside[o]
        init += [f"(inReceptacle {m(o)} {m(r)})", f"(objectAtLocation {m(o)} {m(scene.location[r])})"]
    goal = glib.gdict[task_type]["pddl"].format(
        obj=params["object_target"],
        recep=params["parent_target"],
        toggle=params["toggle_target"],
        mrecep=params["mrecep_target"],
    )
    goal = goal.replace("#", "-")  # the goal library writes PDDL's '-' as '#'
    objects, facts = ind.join(declared), ind.join(init)
    return (
        f"(define (problem plan_{name})\n    (:domain alfred)\n    (:objects{ind}{objects}\n    )\n"
        f"    (:init{ind}{facts}\n    )\n{goal.rstrip()}\n"
    )


def _game_folder(task_type: str, p: dict[str, Any], floor_plan: str) -> str:
    """ALFWorld's game folder name, e.g. pick_and_place_simple-Book-None-SideTable-316."""
    target = p["parent_target"] or p["toggle_target"]
    return f"{task_type}-{p['object_target']}-None-{target}-{floor_plan.removeprefix('FloorPlan')}"


def generate_game(
    task_type: str, floor_plan: str, seed: int, max_copies: int = 2
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One game of ``task_type`` in ``floor_plan`` (e.g. 'FloorPlan1'), deterministic for ``seed``.

    Each placeable object type gets 1..``max_copies`` copies (the target of a pick-two task 2..3).

    Returns (game, traj_data): the ``game.tw-pddl`` dict (``solvable`` still False) and the
    ``traj_data.json`` dict. Raises ValueError when the floor plan cannot host the task type
    (e.g. no Microwave for a heat task, no DeskLamp for a look-at-in-light task).
    """
    import alfworld.gen.goal_library as glib

    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type must be one of {TASK_TYPES}, got {task_type!r}")
    rng = random.Random(f"{task_type}/{floor_plan}/{seed}")
    scene = _Scene(floor_plan, rng)
    params = _choose_task(task_type, scene, rng)
    obj, parent = params["object_target"], params["parent_target"]
    for otype in scene.placeable_types():
        n = rng.randint(1, max_copies)
        if otype == obj and task_type == "pick_two_obj_and_place":
            n = rng.randint(2, 3)
        if otype == _LAMP:
            n = 1
        avoid = {parent} if otype == obj and parent else set()
        for _ in range(n):
            scene.place(otype, rng, avoid)
    template = rng.choice(glib.gdict[task_type]["templates"])
    sentence = template.format(obj=obj.lower(), recep=parent.lower(), toggle=params["toggle_target"].lower(), mrecep="")
    number = floor_plan[len("FloorPlan") :]
    paths = _alfworld_paths()
    with open(paths["domain"]) as f, open(paths["grammar"]) as g:
        domain, grammar = f.read(), g.read()
    game = {
        "pddl_domain": domain,
        "grammar": grammar.replace("UNKNOWN GOAL", sentence),
        "pddl_problem": _problem(f"{_game_folder(task_type, params, floor_plan)}_s{seed}", task_type, params, scene),
        "solvable": False,
    }
    traj = {
        "task_type": task_type,
        "pddl_params": params,
        "task_desc": sentence,
        "scene": {"floor_plan": floor_plan, "scene_num": int(number), "random_seed": seed},
        "generator": "bipace_jax launch/make_alfworld_fixtures.py (from the alfworld wheel's layouts)",
    }
    return game, traj


def solve_with_planner(game_file: str, max_steps: int = 60) -> list[str] | None:
    """Play ``game_file`` in TextWorld's PDDL engine following the planner; the commands if won, else None."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    infos = textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=True)
    env = textworld.start(game_file, infos, wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
    try:
        state = env.reset()
        commands = []
        for _ in range(max_steps):
            if state["won"]:
                return commands
            plan = state["policy_commands"]
            if not plan:
                return None
            commands.append(plan[0])
            state, _, _ = env.step(plan[0])
        return commands if state["won"] else None
    finally:
        env.close()


def write_game(out_dir: str, task_type: str, floor_plan: str, seed: int, max_copies: int = 2) -> str | None:
    """Generate, check with the planner and write one game; its folder, or None if unsolved."""
    game, traj = generate_game(task_type, floor_plan, seed, max_copies)
    folder = os.path.join(out_dir, _game_folder(task_type, traj["pddl_params"], floor_plan), f"trial_s{seed}")
    os.makedirs(folder, exist_ok=True)
    game_file = os.path.join(folder, "game.tw-pddl")
    with open(game_file, "w") as f:
        json.dump(game, f)
    walkthrough = solve_with_planner(game_file)
    if walkthrough is None:
        shutil.rmtree(os.path.dirname(folder) if len(os.listdir(os.path.dirname(folder))) == 1 else folder)
        return None
    game["solvable"] = True
    traj["walkthrough"] = walkthrough
    with open(game_file, "w") as f:
        json.dump(game, f)
    with open(os.path.join(folder, "traj_data.json"), "w") as f:
        json.dump(traj, f, indent=1)
    return folder


def room_size(floor_plan: str) -> int:
    """Number of static receptacles of a floor plan (what the game's room lists)."""
    return len(_Scene(floor_plan, random.Random(0)).receptacles)


def generate_fixtures(
    out_dir: str, games_per_type: int, seed: int, smallest_rooms: bool = False, max_copies: int = 2
) -> list[str]:
    """Write ``games_per_type`` solvable games of each of the six task types into ``out_dir``.

    Floor plans are tried in a seeded order, or smallest room first with ``smallest_rooms`` (cheap
    games for tests: the engine's step and reset cost grows with receptacles and objects); each
    game of a task type uses a different floor plan. Returns the game folders written.
    """
    rng = random.Random(seed)
    plans = floor_plans()
    written = []
    for task_type in TASK_TYPES:
        order = plans[:]
        rng.shuffle(order)
        if smallest_rooms:
            order.sort(key=room_size)
        count = 0
        for fp in order:
            if count == games_per_type:
                break
            try:
                folder = write_game(out_dir, task_type, fp, seed, max_copies)
            except ValueError:
                continue
            if folder is not None:
                written.append(folder)
                count += 1
        if count < games_per_type:
            raise RuntimeError(f"only {count} solvable {task_type} games could be generated")
    return written


def main(argv):
    del argv
    from absl import flags

    F = flags.FLAGS
    if os.path.isdir(F.out_dir) and F.overwrite:
        shutil.rmtree(F.out_dir)
    written = generate_fixtures(F.out_dir, F.games_per_type, F.seed, F.smallest_rooms, F.max_copies)
    for folder in written:
        with open(os.path.join(folder, "traj_data.json")) as f:
            traj = json.load(f)
        print(
            f"{os.path.relpath(folder, F.out_dir)}: {traj['task_desc']!r}, "
            f"planner solves it in {len(traj['walkthrough'])} steps"
        )
    print(f"wrote {len(written)} games to {F.out_dir}")


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("out_dir", FIXTURES_DIR, "folder to write the games into")
    flags.DEFINE_integer("games_per_type", 2, "games per task type (six task types)")
    flags.DEFINE_integer("seed", 0, "generation seed")
    flags.DEFINE_bool("overwrite", True, "remove out_dir first")
    flags.DEFINE_bool("smallest_rooms", True, "prefer the floor plans with the fewest receptacles (fast test games)")
    flags.DEFINE_integer("max_copies", 1, "at most this many copies of each object type (the task's target excepted)")
    app.run(main)
