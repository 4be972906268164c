"""TextCraft engine: goal table, observation format, hand-played episodes, oracle."""

from __future__ import annotations

import collections
import random
import re

import pytest

import environments
from environments.textcraft import (
    GOAL_TABLE_PATH,
    MAX_DISTRACTORS,
    TextCraftEnv,
    default_recipe_book,
    goal_table,
    goal_table_tsv,
    task_ids_by_depth,
)

LADDER = 272  # "craft 3 ladder using 7 stick": depth 2 via planks or bamboo sticks


def test_goal_table_has_291_117_11_goals_depth_descending():
    table = goal_table()
    assert len(table) == 419
    assert collections.Counter(r["depth"] for r in table) == {2: 291, 3: 117, 4: 11}
    depths = [r["depth"] for r in table]
    assert depths == sorted(depths, reverse=True)
    # the original's reset(seed=k) goal order with the recipe files listed sorted
    assert table[0]["goal"] == "cyan banner" and table[0]["depth"] == 4
    assert table[-1]["goal"] == "yellow wool"
    assert table[LADDER]["goal"] == "ladder"
    assert len(task_ids_by_depth(2)) == 291 and len(task_ids_by_depth(3, 4)) == 128
    with pytest.raises(ValueError, match="depth must be 2, 3 or 4"):
        task_ids_by_depth(1)


def test_packaged_goal_table_file_matches_the_engine():
    with open(GOAL_TABLE_PATH, encoding="utf-8") as fp:
        assert fp.read() == goal_table_tsv()


def test_make_builds_textcraft_with_contract_metadata():
    env = environments.make("textcraft", max_steps=7)
    assert isinstance(env, TextCraftEnv) and env.num_tasks == 419 and env.max_steps == 7
    assert env.task_info(LADDER) == {"depth": 2, "goal": "ladder"}
    with pytest.raises(ValueError, match="task_id must lie in"):
        env.task_info(419)
    with pytest.raises(ValueError, match="task_id must lie in"):
        env.reset(-1, 0)
    with pytest.raises(ValueError, match="max_distractors"):
        environments.make("textcraft", max_distractors=-1)


@pytest.mark.parametrize("task_id,seed", [(0, 0), (LADDER, 5), (150, 123456789)])
def test_first_observation_lists_tree_recipes_and_at_most_10_distractors(task_id, seed):
    env = environments.make("textcraft")
    obs = env.reset(task_id, seed)
    book = default_recipe_book()
    goal = book.goals[task_id][0]
    m = re.fullmatch(r"Crafting commands:\n(.*)\n\nGoal: craft (.*)\.", obs.text, flags=re.S)
    assert m and m.group(2) == env.task_info(task_id)["goal"]
    lines = m.group(1).split("\n")
    assert len(lines) == len(set(lines))
    tree = {r.line for r in book.tree(goal)}
    assert tree <= set(lines)
    assert 0 < len(set(lines) - tree) <= MAX_DISTRACTORS
    assert obs.anchor == obs.text and obs.task == obs.text
    assert obs.admissible_actions is None and not obs.won
    assert obs.inventory == "Inventory: You are not carrying anything."


def test_seed_changes_distractors_and_order_but_not_the_goal():
    env = environments.make("textcraft")
    a, b, a2 = env.reset(0, 1).text, env.reset(0, 2).text, env.reset(0, 1).text
    assert a == a2 and a != b
    assert a.split("\n\n")[1] == b.split("\n\n")[1]


def test_ladder_episode_feedback_strings_and_reward_hand_played():
    env = environments.make("textcraft", max_steps=50)
    env.reset(LADDER, 3)
    script = [
        ("inventory", "Inventory: You are not carrying anything."),
        ("get 1 stick", "Could not find stick"),
        ("get 2 planks", "Could not find planks"),
        ("get 3 unobtainium", "Could not find unobtainium"),
        ("get 1 acacia logs", "Got 1 acacia logs"),
        (
            "craft 4 spruce planks using 1 acacia logs",
            "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, "
            "item_id='minecraft:spruce_planks'), count=4)",
        ),
        ("craft 4 acacia planks using 1 acacia logs", "Crafted 4 minecraft:acacia_planks"),
        ("inventory", "Inventory: [acacia planks] (4) "),
        ("craft 4 stick using 2 planks", "Could not find enough items to craft minecraft:stick"),
        ("craft 4 planks using 1 acacia logs", "Could not find enough items to craft None"),
        ("craft stick using 2 acacia planks", "Crafted 4 minecraft:stick"),  # output count optional
        ("inventory", "Inventory: [acacia planks] (2) [stick] (4) "),
        ("craft 4 stick using two acacia planks", "Wrong item format: two acacia planks"),
        ("craft 3 ladder using 7 stick", "Could not find enough items to craft minecraft:ladder"),
        ("craft 4 stick using 2 acacia planks", "Crafted 4 minecraft:stick"),
        ("inventory", "Inventory: [stick] (8) "),
        (
            "craft 1 ladder using 6 stick",
            "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, "
            "item_id='minecraft:ladder'), count=1)",
        ),
        ("jump", "Could not execute jump"),
    ]
    for action, expected in script:
        obs, reward, done, info = env.step(action)
        assert (obs.text, reward, done) == (expected, 0.0, False), action
        assert obs.anchor == obs.text
    obs, reward, done, info = env.step("craft 3 ladder using 7 stick")
    assert (obs.text, reward, done, obs.won) == ("Crafted 3 minecraft:ladder", 1.0, True, True)
    assert obs.inventory == "Inventory: [stick] (1) [ladder] (3) "
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("inventory")
    with pytest.raises(TypeError, match="action must be a str"):
        env.reset(LADDER, 3) and env.step(None)


def test_step_cap_ends_episode_with_truncated_and_no_reward():
    env = environments.make("textcraft", max_steps=3)
    env.reset(LADDER, 0)
    results = [env.step("inventory") for _ in range(3)]
    assert [r[2] for r in results] == [False, False, True]
    assert results[-1][3] == {"truncated": True} and results[-1][1] == 0.0


def test_reset_leaves_recipe_tables_intact_for_later_episodes():
    # the original extends its recipe lists during reset; a deep goal then a shallow one then
    # the deep one again must give identical text and still solvable crafts
    env = environments.make("textcraft")
    first = env.reset(0, 9).text
    env.reset(LADDER, 1)
    for _ in range(10):
        env.step(env.oracle_action())
        if env._done:
            break
    assert env._done and env._won
    assert env.reset(0, 9).text == first


def _play_oracle(env, task_id, seed, mistake_rate=0.0, rng=None):
    env.reset(task_id, seed)
    book = env.book
    lines = [r.line for r in book.tree(env.goal)]
    while True:
        if rng is not None and rng.random() < mistake_rate:
            kind = rng.randrange(3)
            if kind == 0:  # a random shown recipe, possibly with an item of the wrong tag
                action = rng.choice(lines).replace("planks", rng.choice(["oak planks", "birch planks", "planks"]))
            elif kind == 1:  # get some base item of the tree, any amount
                base = [i.name for r in book.tree(env.goal) for i in r.inputs if book.is_gettable(i.name)]
                action = (
                    f"get {rng.randrange(1, 5)} {rng.choice(base).split(':')[1].replace('_', ' ')}"
                    if base
                    else "inventory"
                )
            else:  # the oracle's action with a wrong count
                a = env.oracle_action()
                action = re.sub(r"\d+", lambda m: str(int(m.group()) + 1), a, count=1)
        else:
            action = env.oracle_action()
            if action is None:
                return False, env._steps
        _, reward, done, _ = env.step(action)
        if done:
            return reward == 1.0, env._steps


def test_oracle_solves_all_419_goals_within_50_steps_with_one_get_per_base_item():
    env = environments.make("textcraft", max_steps=50)
    wins, lengths = 0, []
    for task_id in range(env.num_tasks):
        env.reset(task_id, task_id)
        plan = env.oracle_plan()
        gets = [a.split(" ", 2)[2] for a in plan if a.startswith("get ")]
        assert len(gets) == len(set(gets)), (task_id, plan)  # one get per base item, full count
        assert all(a.startswith("craft ") for a in plan[len(gets) :])
        won, n = _play_oracle(env, task_id, task_id)
        wins += won
        lengths.append(n)
        if won:
            assert n == len(plan)  # re-planning after each step follows the first plan
    assert wins / env.num_tasks >= 0.99, wins
    assert wins == 419  # all, at present
    assert max(lengths) <= 48


def test_oracle_uses_fewest_actions_for_needed_quantity():
    env = environments.make("textcraft")
    env.reset(LADDER, 0)
    # 7 sticks: planks (1 get, 1 plank craft, 2 stick crafts) beat bamboo (1 get, 7 stick crafts)
    assert env.oracle_plan() == [
        "get 1 acacia logs",
        "craft 4 acacia planks using 1 acacia logs",
        "craft 4 stick using 2 acacia planks",
        "craft 4 stick using 2 acacia planks",
        "craft 3 ladder using 7 stick",
    ]


def test_oracle_replans_from_the_current_inventory_after_mistakes():
    env = environments.make("textcraft")
    env.reset(LADDER, 0)
    env.step("get 1 oak logs")  # not the oracle's acacia: it now uses the oak logs it holds
    assert env.oracle_plan() == [
        "craft 4 oak planks using 1 oak logs",
        "craft 4 stick using 2 oak planks",
        "craft 4 stick using 2 oak planks",
        "craft 3 ladder using 7 stick",
    ]
    env.step("craft 4 oak planks using 1 oak logs")
    env.step("craft 4 stick using 2 oak planks")
    env.step("get 1 bamboo")
    env.step("get 6 stick")  # fails: stick is craftable
    # 4 sticks + 2 oak planks held: one more stick craft, then the ladder
    assert env.oracle_plan() == ["craft 4 stick using 2 oak planks", "craft 3 ladder using 7 stick"]


@pytest.mark.parametrize("depths", [(2,), (3, 4)])
def test_oracle_recovers_from_random_mistakes(depths):
    env = environments.make("textcraft", max_steps=300)
    rng = random.Random(sum(depths))
    ids = task_ids_by_depth(*depths)
    chosen = rng.sample(ids, min(40, len(ids)))
    results = [_play_oracle(env, t, 7 * t, mistake_rate=0.3, rng=rng) for t in chosen]
    assert all(won for won, _ in results), [t for t, (w, _) in zip(chosen, results) if not w]


def test_oracle_returns_none_before_reset_and_after_the_win():
    env = environments.make("textcraft")
    assert env.oracle_action() is None
    won, _ = _play_oracle(env, LADDER, 0)
    assert won and env.oracle_action() is None and env.oracle_plan() == []
