"""ALFWorld adapter on the committed fixture games, played by the real (unmodified) alfworld engine.

Skipped where alfworld is not installed (``pip install alfworld==0.4.2``).
"""

import json
import os
import random
import shutil
import sys

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("textworld")

import environments  # noqa: E402
from environments import alfworld as alf  # noqa: E402

TASK_TYPE_NAMES = set(alf.TASK_TYPES.values())


def _traj(env, task_id):
    with open(os.path.join(os.path.dirname(env.game_files[task_id]), "traj_data.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def planner_env():
    env = alf.AlfWorldEnv(data_path=alf.FIXTURES_DIR, expert_type="planner")
    yield env
    env.close()


def test_fixtures_hold_two_games_of_each_of_the_six_task_types(planner_env):
    env = planner_env
    assert env.num_tasks == 12
    types = [env.task_info(i)["task_type"] for i in range(env.num_tasks)]
    assert set(types) == TASK_TYPE_NAMES
    assert all(types.count(t) == 2 for t in TASK_TYPE_NAMES)
    for i in range(env.num_tasks):  # task_info agrees with each game's own traj_data.json
        assert env.task_info(i)["task_type"] == _traj(env, i)["task_type"]
    # task ids follow the sorted relative paths
    games = [env.task_info(i)["game"] for i in range(env.num_tasks)]
    assert games == sorted(games)
    with pytest.raises(ValueError, match="task_id"):
        env.task_info(12)


def test_reset_shows_the_alfworld_intro_task_and_admissible_commands(planner_env):
    env = planner_env
    task_id = next(i for i in range(env.num_tasks) if "Pen-None-DiningTable" in env.task_info(i)["game"])
    obs = env.reset(task_id, seed=0)
    assert obs.text.startswith("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.")
    assert obs.text.endswith("Your task is to: put some pen on diningtable.")
    assert obs.anchor == obs.text
    assert obs.task == "put some pen on diningtable" == _traj(env, task_id)["task_desc"]
    assert not obs.won
    # Every receptacle the room lists can be gone to; nothing else but look/inventory/help yet.
    listed = obs.text.split("you see ", 1)[1].split(".\n\n")[0].replace(", and ", ", ").split(", ")
    receptacles = sorted(r[2:] for r in listed)  # drop the article "a "
    assert sorted(obs.admissible_actions) == sorted([f"go to {r}" for r in receptacles] + ["help", "inventory", "look"])


@pytest.mark.slow
def test_planner_oracle_solves_every_fixture_game_with_reward_only_at_the_end(planner_env):
    env = planner_env
    for task_id in range(env.num_tasks):
        env.reset(task_id, seed=0)
        actions, rewards, done, obs, info = [], [], False, None, {}
        while not done:
            action = env.oracle_action()
            assert action is not None
            obs, reward, done, info = env.step(action)
            actions.append(action)
            rewards.append(reward)
        assert obs.won and info["won"] and "truncated" not in info, env.task_info(task_id)
        assert rewards == [0.0] * (len(rewards) - 1) + [1.0]
        # The planner is deterministic: it replays the walkthrough recorded when the game was made.
        assert actions == _traj(env, task_id)["walkthrough"]
        assert env.oracle_action() is None


def test_planner_oracle_replans_after_the_agent_wanders_off(planner_env):
    env = planner_env
    task_id = next(i for i in range(env.num_tasks) if "heat" in env.task_info(i)["task_type"])
    obs = env.reset(task_id, seed=0)
    first = env.oracle_action()
    detour = [a for a in obs.admissible_actions if a.startswith("go to") and a != first][:2]
    for a in detour:  # mistakes: walk somewhere else, look around
        env.step(a)
    env.step("inventory")
    done, steps = False, 0
    while not done:
        obs, reward, done, _ = env.step(env.oracle_action())
        steps += 1
    assert obs.won and reward == 1.0
    assert steps <= len(_traj(env, task_id)["walkthrough"]) + 1


def test_unknown_command_changes_nothing_and_is_flagged(planner_env):
    env = planner_env
    obs0 = env.reset(0, seed=0)
    obs, reward, done, info = env.step("fly to the moon")
    assert obs.text == "Nothing happens."
    assert (reward, done, info["admissible"], info["won"]) == (0.0, False, False, False)
    assert obs.admissible_actions == obs0.admissible_actions
    _, _, _, info = env.step(obs0.admissible_actions[0])
    assert info["admissible"]


def test_step_cap_truncates_the_episode(planner_env):
    env = planner_env
    env.max_steps = 3
    try:
        env.reset(0, seed=0)
        results = [env.step("look") for _ in range(3)]
        assert [r[2] for r in results] == [False, False, True]
        assert results[-1][3].get("truncated") is True and results[-1][1] == 0.0
        with pytest.raises(RuntimeError):
            env.step("look")
    finally:
        env.max_steps = 50


def test_engine_side_effects_on_the_process_are_undone(planner_env, monkeypatch):
    argv = ["train.py", "--config=x"]
    monkeypatch.setattr("sys.argv", argv)
    state = random.getstate()
    env = planner_env
    env.reset(3, seed=0)
    env.step(env.oracle_action())
    assert sys.argv is argv and sys.argv == ["train.py", "--config=x"]  # fast-downward rewrites it
    assert random.getstate() == state


def _downward_copies():
    with open("/proc/self/maps") as f:
        return len({line.split()[-1] for line in f if "libdownward" in line})


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_switching_games_reuses_one_engine_instead_of_loading_fast_downward_again():
    env = alf.AlfWorldEnv(data_path=alf.FIXTURES_DIR, expert_type=None, task_types=(1, 2))
    env.reset(0, seed=0)
    before = _downward_copies()
    for task_id in (1, 2, 3, 0):
        env.reset(task_id, seed=0)
    assert _downward_copies() == before
    env.close()
    assert env.reset(2, seed=0).task == "put a book in sidetable"  # a closed env starts a new engine
    env.close()


def test_same_task_and_seed_give_the_same_initial_observation():
    a = alf.AlfWorldEnv(data_path=alf.FIXTURES_DIR, expert_type=None, task_types=(6,))
    b = alf.AlfWorldEnv(data_path=alf.FIXTURES_DIR, expert_type=None, task_types=(6,))
    try:
        assert a.num_tasks == 2  # task_types filters with ALFWorld's numbering (6 = pick two)
        assert {a.task_info(i)["task_type"] for i in range(2)} == {"pick_two_obj_and_place"}
        assert a.reset(1, seed=3) == b.reset(1, seed=3) == a.reset(1, seed=3)
        assert a.oracle_action() is None  # oracle off
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_handcoded_expert_solves_the_single_object_task_types():
    """ALFWorld's own HandCodedTWAgent, run alongside the game as AlfredExpert runs it."""
    env = alf.AlfWorldEnv(data_path=alf.FIXTURES_DIR, expert_type="handcoded", task_types=(1, 2, 3, 4, 5))
    try:
        assert env.num_tasks == 10
        state = random.getstate()
        for task_id in range(0, env.num_tasks, 2):  # one game per task type
            obs = env.reset(task_id, seed=task_id)
            assert env.oracle_action() == "look"  # AlfredExpert's first command
            done = False
            while not done:
                action = env.oracle_action()
                assert action in obs.admissible_actions
                obs, reward, done, info = env.step(action)
            assert obs.won and reward == 1.0, env.task_info(task_id)
        assert random.getstate() == state  # the expert's draws use the env's own generator
    finally:
        env.close()


def test_make_builds_alfworld_through_the_registry():
    env = environments.make("alfworld", max_steps=7, expert_type=None, task_types=[1], data_path=alf.FIXTURES_DIR)
    try:
        assert isinstance(env, alf.AlfWorldEnv)
        assert env.max_steps == 7 and env.num_tasks == 2 and env.data_source == "data_path"
    finally:
        env.close()


def test_alfworld_data_env_var_selects_the_real_data_layout(tmp_path, monkeypatch):
    game = "pick_and_place_simple-Book-None-SideTable-316"
    dst = tmp_path / "json_2.1.1" / "valid_unseen" / game
    shutil.copytree(os.path.join(alf.FIXTURES_DIR, game), dst)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    path, source = alf.resolve_data_path("eval_out_of_distribution")
    assert (path, source) == (str(tmp_path / "json_2.1.1" / "valid_unseen"), "ALFWORLD_DATA")
    env = alf.AlfWorldEnv(split="eval_out_of_distribution", expert_type=None, require_real_data=True)
    try:
        assert env.num_tasks == 1 and env.data_source == "ALFWORLD_DATA"
        assert env.task_info(0) == {"task_type": "pick_and_place_simple", "game": os.path.join(game, "trial_s0")}
    finally:
        env.close()
    # $ALFWORLD_DATA/json_2.1.1/train is missing: fixtures with a warning, or an error on request.
    with pytest.warns(UserWarning, match="fixture games"):
        assert alf.resolve_data_path("train") == (alf.FIXTURES_DIR, "fixtures")
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        alf.resolve_data_path("train", require_real_data=True)
    with pytest.raises(FileNotFoundError, match="data_path"):
        alf.resolve_data_path("train", data_path=str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"split": "valid"}, "split"),
        ({"expert_type": "oracle"}, "expert_type"),
        ({"task_types": (0, 1)}, "task_types"),
        ({"task_types": ()}, "task_types"),
        ({"num_games": 0}, "num_games"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        alf.AlfWorldEnv(data_path=alf.FIXTURES_DIR, **kwargs)


def test_task_sentence_parses_the_intro():
    intro = "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in ...\n\nYour task is to: put a hot apple in garbagecan."
    assert alf.task_sentence(intro) == "put a hot apple in garbagecan"
    with pytest.raises(ValueError, match="Your task is to"):
        alf.task_sentence("You arrive at desk 1.")


def test_generator_reproduces_the_committed_fixture_games():
    from launch import make_alfworld_fixtures as gen

    for name in (
        "pick_two_obj_and_place-Box-None-SideTable-316",
        "pick_heat_then_place_in_recep-Cup-None-SinkBasin-14",
    ):
        folder = os.path.join(alf.FIXTURES_DIR, name, "trial_s0")
        with open(os.path.join(folder, "traj_data.json")) as f:
            traj = json.load(f)
        with open(os.path.join(folder, "game.tw-pddl")) as f:
            committed = json.load(f)
        game, new_traj = gen.generate_game(
            traj["task_type"], traj["scene"]["floor_plan"], traj["scene"]["random_seed"], max_copies=1
        )
        assert game["pddl_problem"] == committed["pddl_problem"]
        assert game["grammar"] == committed["grammar"] and committed["solvable"] is True
        assert new_traj["pddl_params"] == traj["pddl_params"] and new_traj["task_desc"] == traj["task_desc"]
        assert f"Your task is to: {traj['task_desc']}." in game["grammar"]


@pytest.mark.slow
def test_task_group_plays_in_pool_workers_and_the_oracle_wins():
    from environments.pool import EnvPool

    options = {"data_path": alf.FIXTURES_DIR, "expert_type": "planner", "task_types": [4]}
    with EnvPool("alfworld", 2, env_options=options, num_workers=2, timeout_s=60.0) as pool:
        first = [r.obs for r in pool.reset([0, 1], [1, 1], [0, 0])]  # one task group: the pool checks they agree
        assert first[0] == first[1] and first[0].task
        assert [r.info["task_type"] for r in pool.task_info([0, 1])] == ["pick_heat_then_place_in_recep"] * 2
        won = [False, False]
        for _ in range(10):
            live = [i for i in (0, 1) if not won[i]]
            if not live:
                break
            results = pool.step(live, pool.oracle_actions(live))
            for i, res in zip(live, results):
                assert res.fault is None
                won[i] = res.done and res.obs.won and res.reward == 1.0
        assert won == [True, True]
