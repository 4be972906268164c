"""The embedded default's task set, held-out split, validation panel and prompt (configs/textcraft_tasks)."""

import pytest

import environments
from configs import textcraft_tasks as tasks


@pytest.fixture(scope="module")
def env():
    return environments.make(tasks.GAME, max_steps=tasks.MAX_STEPS)


def test_task_set_is_the_documented_rule_single_craft_depth2_goals(env):
    assert list(tasks.TRAIN_IDS) == tasks.single_craft_goals(env, depth=2, limit=80)
    assert all(env.task_info(t)["depth"] == 2 for t in tasks.TRAIN_IDS)


def test_heldout_goals_are_every_8th_and_disjoint_from_training(env):
    train, held = tasks.split(env)
    assert held == list(tasks.TRAIN_IDS[7::8]) and len(held) == 10
    assert not set(train) & set(held) and len(train) + len(held) == 80


def test_rl_task_set_is_every_4th_training_goal(env):
    train, held = tasks.split(env)
    assert list(tasks.RL_TRAIN_IDS) == train[::4] and len(tasks.RL_TRAIN_IDS) == 18
    assert tasks.RL_TRAIN == ",".join(map(str, train[::4]))


def test_validation_panel_is_fixed_and_uses_unseen_seeds(env):
    train, held = tasks.split(env)
    panel = tasks.validation_panel(train, held)
    assert panel == tasks.validation_panel(train, held)  # deterministic
    k = tasks.VAL_SEEDS_PER_GOAL
    assert len(panel) == (tasks.VAL_NUM_SEEN + len(held)) * k
    goals = [t for t, _ in panel]
    n_seen = tasks.VAL_NUM_SEEN * k
    assert goals[:n_seen:k] == list(tasks.RL_TRAIN_IDS) and goals[n_seen::k] == held
    assert all(s >= tasks.VAL_SEED_BASE for _, s in panel)
    assert len({s for _, s in panel}) == len(panel)


def test_the_rl_default_validates_on_the_same_panel(env):
    import configs.textcraft_tiny
    from bipace_jax.tasks import select_tasks, split_holdout, validation_panel

    c = configs.textcraft_tiny.get_config()
    train, held = split_holdout(
        select_tasks(c.tasks.train, env.num_tasks, env.task_info),
        select_tasks(c.tasks.holdout, env.num_tasks, env.task_info),
        c.tasks.holdout_every,
    )
    seen, held_panel = validation_panel(
        train, held, c.val.num_tasks, c.val.num_holdout_tasks, c.val.seed, c.val.panel, c.val.seeds_per_goal
    )
    assert train == list(tasks.RL_TRAIN_IDS)
    assert seen + held_panel == tasks.validation_panel(*tasks.split(env))


def test_selectors_filter_on_task_info_and_intersect(env):
    from bipace_jax.tasks import select_tasks

    assert select_tasks("depth=2&128:131", env.num_tasks, env.task_info) == [128, 129, 130]
    assert select_tasks("5,3", env.num_tasks, env.task_info) == [3, 5]
    with pytest.raises(ValueError, match="selector"):
        select_tasks("0:0", env.num_tasks, env.task_info)


def test_compact_template_shows_recipes_goal_step_feedback_and_inventory(env):
    from environments.prompts import build_prompt

    obs = env.reset(tasks.TRAIN_IDS[0], 5)
    first = build_prompt(
        tasks.GAME,
        obs,
        [],
        0,
        history_length=tasks.HISTORY_LENGTH,
        template=tasks.TEMPLATE,
        show_inventory=tasks.SHOW_INVENTORY,
    )
    assert first.startswith(obs.task)
    assert first.endswith("Step 1: start\nInventory: You are not carrying anything.\nAnswer <action>command</action>.")
    action = env.oracle_action()
    obs2, _, _, _ = env.step(action)
    later = build_prompt(
        tasks.GAME,
        obs2,
        [(obs.text, action)],
        1,
        history_length=tasks.HISTORY_LENGTH,
        template=tasks.TEMPLATE,
        show_inventory=tasks.SHOW_INVENTORY,
    )
    assert f"Step 2: {obs2.text}\n{obs2.inventory.strip()}\nAnswer" in later
    assert action not in later.split("Step 2:")[0]  # no history shown (history_length 0)
