"""Game snapshots for branching rollouts (``TextEnv.snapshot`` / ``restore``): TextCraft and WebShop copy their
episode state, ALFWorld replays its action prefix on the committed fixture games (checked observation by
observation), and a replay that diverges raises ``ReplayDivergedError``."""

from __future__ import annotations

import dataclasses

import pytest

import environments
from environments.base import ReplayDivergedError, observation_digest


def _play_on(a, b, actions):
    """Steps both games with ``actions``; asserts equal (observation, reward, done, info) each step."""
    for act in actions:
        ra, rb = a.step(act), b.step(act)
        assert ra == rb, act
        if ra[2]:
            break


def test_textcraft_restores_its_state_into_another_game_and_the_copy_is_its_own():
    a = environments.make("textcraft", max_steps=20)
    b = environments.make("textcraft", max_steps=20)
    a.reset(16, 3)
    for act in ("get 1 oak log", "craft 4 oak planks using 1 oak log", "get 1 iron ingot"):
        obs = a.step(act)[0]
    snap = a.snapshot()
    assert snap.state is not None and snap.actions[-1] == "get 1 iron ingot" and len(snap.digests) == 4
    b.reset(3, 9)  # another game: restore replaces it whole
    assert b.restore(snap) == obs and b.oracle_action() == a.oracle_action()
    a.step("get 2 oak log")  # the snapshot is a deep copy: the original's later steps leave it unchanged
    assert b.inventory != a.inventory and b.snapshot().digests == snap.digests
    b.step("get 2 oak log")
    _play_on(a, b, ["inventory", "craft 4 stick using 2 oak planks", "get 9 gold nugget"])
    c = environments.make("textcraft", max_steps=20)
    assert c.restore(dataclasses.replace(snap, state=None)) == obs  # the replay path gives the same state
    assert c.inventory == snap.state["inventory"]


def test_webshop_restores_its_page_and_search_generator():
    a = environments.make("webshop", data_dir="sample", split="test")
    b = environments.make("webshop", data_dir="sample", split="test")
    obs = a.reset(0, 5)
    obs = a.step("search[<r>]")[0]  # the "<r>" search draws from the episode's generator
    snap = a.snapshot()
    assert snap.state is not None
    b.reset(1, 0)
    assert b.restore(snap) == obs
    _play_on(a, b, ["click[next >]", "search[<r>]", "click[< prev]"])


def test_a_snapshot_needs_a_running_episode():
    env = environments.make("textcraft", max_steps=1)
    with pytest.raises(RuntimeError, match="snapshot\\(\\) needs a running episode"):
        env.snapshot()
    env.reset(16, 3)
    env.step("inventory")  # the step cap ends it
    with pytest.raises(RuntimeError, match="needs a running episode"):
        env.snapshot()


@pytest.fixture(scope="module")
def alfworld_envs():
    pytest.importorskip("alfworld")
    from environments import alfworld as alf

    envs = [alf.AlfWorldEnv(data_path=alf.FIXTURES_DIR, expert_type=None, max_steps=30) for _ in range(2)]
    yield envs
    for e in envs:
        e.close()


@pytest.mark.parametrize("task_id", [0, 5, 9])
def test_alfworld_replays_the_action_prefix_on_the_fixture_games(alfworld_envs, task_id):
    a, b = alfworld_envs
    obs = a.reset(task_id, 11)
    for k in range(4):  # a prefix through the admissible commands (some move the agent, some not)
        obs = a.step(obs.admissible_actions[(3 * k + 1) % len(obs.admissible_actions)])[0]
    snap = a.snapshot()
    assert snap.state is None and len(snap.actions) == 4  # no state copy: restore replays
    assert b.restore(snap) == obs and observation_digest(obs) == snap.digests[-1]
    nxt = [obs.admissible_actions[0], "look", "inventory"]
    _play_on(a, b, nxt)


def test_alfworld_replay_that_diverges_raises_the_named_error(alfworld_envs):
    a, b = alfworld_envs
    obs = a.reset(2, 4)
    for k in range(3):
        obs = a.step(obs.admissible_actions[k % len(obs.admissible_actions)])[0]
    snap = a.snapshot()
    # inject a divergence: the recorded observation after step 2 is not what the game shows
    bad = dataclasses.replace(snap, digests=(*snap.digests[:2], "0" * 64, *snap.digests[3:]))
    with pytest.raises(ReplayDivergedError, match=r"AlfWorldEnv task 2 seed 4: the replay's observation after step 2"):
        b.restore(bad)
    # a replay from another seed's reset state is caught at the reset (step 0)
    with pytest.raises(ReplayDivergedError, match="after step 0"):
        b.restore(dataclasses.replace(snap, digests=("f" * 64, *snap.digests[1:])))
