"""WebShop: the shared page formatting and action parsing on recorded page strings (tests/data), the
original engine's adapter (engine="original") on a recorded session replayed by a stand-in engine,
and the error raised when WebShop is not installed."""

import importlib.util
import json
import os
import sys
import types

import pytest

import environments
from environments import webshop as ws

with open(os.path.join(os.path.dirname(__file__), "data", "webshop_pages.json")) as f:
    RECORDED = json.load(f)
TASK = RECORDED["instruction"]
STEPS = RECORDED["steps"]


def test_extract_instruction_reads_the_landing_page():
    assert ws.extract_instruction(STEPS[0]["page"]) == TASK
    assert ws.extract_instruction(STEPS[1]["page"]) == TASK  # later pages repeat it
    with pytest.raises(ValueError, match="Instruction:"):
        ws.extract_instruction(STEPS[-1]["page"])
    with pytest.raises(ValueError, match="no instruction"):
        ws.extract_instruction("WebShop [SEP] Instruction:")


def test_format_page_drops_the_instruction_and_quotes_each_part():
    assert ws.format_page(STEPS[0]["page"], TASK) == "'Search'"
    assert ws.format_page(STEPS[1]["page"], TASK) == (
        "'Back to Search' [SEP] 'Page 1 (Total results: 50)' [SEP] 'Next >' [SEP] 'B08KBVJ4XN' "
        "[SEP] 'Vanilla Cake Mix, Gluten Free, 16 Ounce' [SEP] '$15.95' [SEP] 'B07V1CR4HS' "
        "[SEP] 'Keto Baking Mix | Low Carb (Vanilla Cake)' [SEP] '$12.99'"
    )
    assert ws.format_page(STEPS[2]["page"], TASK) == (
        "'Back to Search' [SEP] '< Prev' [SEP] 'size' [SEP] '16 ounce' [SEP] '2 pound' "
        "[SEP] 'Vanilla Cake Mix, Gluten Free, 16 Ounce' [SEP] 'Price: $15.95' [SEP] 'Rating: N.A.' "
        "[SEP] 'Description' [SEP] 'Features' [SEP] 'Reviews' [SEP] 'Buy Now'"
    )
    # The purchase page does not repeat the instruction: kept as the engine wrote it.
    assert ws.format_page(STEPS[-1]["page"], TASK) == STEPS[-1]["page"]
    # The instruction must match a whole part, not a substring of one.
    assert ws.format_page(STEPS[1]["page"], TASK[:-1]) == STEPS[1]["page"]


def test_available_actions_list_search_then_clicks_in_engine_order():
    assert ws.format_available_actions(STEPS[0]["available"]) == ["search[<your query>]", "click[search]"]
    assert ws.format_available_actions(STEPS[1]["available"]) == [
        "click[back to search]",
        "click[next >]",
        "click[b08kbvj4xn]",
        "click[b07v1cr4hs]",
    ]
    assert ws.format_available_actions(STEPS[-1]["available"]) == []
    with pytest.raises(ValueError, match="keys"):
        ws.format_available_actions({"has_search_bar": True, "clickables": [], "images": []})
    with pytest.raises(ValueError, match="keys"):
        ws.format_available_actions({"clickables": []})


# Hand-computed from the original's rule (web_agent_site @ 64fa2a5, engine.parse_action and
# WebAgentTextEnv.step): re.match(r"(.+)\[(.+)\]", action), no strip, name == "search"/"click"
# exactly, argument lower-cased. No recording of the original holds these whitespace cases.
@pytest.mark.parametrize(
    "action, parsed",
    [
        ("search[gluten free vanilla cake mix]", ("search", "gluten free vanilla cake mix")),
        ("click[< prev]", ("click", "< prev")),
        ("click[next >]", ("click", "next >")),
        ("click[Buy Now]", ("click", "buy now")),  # the argument is lower-cased
        ("  click[buy now]\n", None),  # the name is "  click": nothing is stripped
        (" click[buy now]", None),
        ("\tsearch[dress]", None),
        (" search[dress]", None),
        ("\nclick[buy now]", None),  # "." does not match the newline, so nothing matches
        ("click[buy now]\n", ("click", "buy now")),  # re.match need not reach the end
        ("search[cake] please", ("search", "cake")),
        ("search[dress]\nclick[buy now]", ("search", "dress")),
        ("click[ buy now ]", ("click", " buy now ")),  # the argument is not stripped either
        ("search[ ]", ("search", " ")),
        ("search[a] and click[b]", None),  # greedy: the name is "search[a] and click"
        ("click[a[b]c]", None),  # the name is "click[a"
        ("click[buy\nnow]", None),
        ("click []", None),
        ("click[]", None),
        ("Click[buy now]", None),  # the name is compared as written
        ("buy now", None),
        ("", None),
    ],
)
def test_parse_action_reads_commands_as_webagenttextenv(action, parsed):
    assert ws.parse_action(action) == parsed


def test_is_available_follows_the_pages_search_bar_and_clickables():
    landing, results, item = (s["available"] for s in STEPS[:3])
    assert ws.is_available("search[cake mix]", landing)
    assert not ws.is_available("search[cake mix]", results)
    assert ws.is_available("click[b08kbvj4xn]", results)
    assert ws.is_available("click[B08KBVJ4XN]", results)  # the engine lower-cases click arguments
    assert not ws.is_available("click[b08kbvj4xm]", results)
    assert ws.is_available("click[16 ounce]", item) and not ws.is_available("click[3 pound]", item)
    assert not ws.is_available("purchase", item)
    assert ws.is_available("click[16 ounce] now", item)  # the engine clicks it
    for ignored in (" click[16 ounce]", "\tclick[16 ounce]", "Click[16 ounce]", " search[cake mix]"):
        assert not ws.is_available(ignored, item | {"has_search_bar": True}), ignored


@pytest.mark.parametrize(
    "score, done, expected",
    [
        (1.0, True, (1.0, True)),
        (0.75, True, (0.75, False)),
        (0.0, False, (0.0, False)),
        (None, False, (0.0, False)),
    ],
)
def test_reward_is_the_score_and_success_is_score_one(score, done, expected):
    assert ws.score_outcome(score, done) == expected


@pytest.mark.parametrize("score, done, expected", [(1.0, True, (1.0, True)), (0.75, True, (0.0, False))])
def test_success_reward_pays_only_a_perfect_score(score, done, expected):
    assert ws.score_outcome(score, done, "success") == expected


def test_success_reward_keeps_the_score_in_info(replay_engine):
    env = ws.OriginalWebShopEnv(reward="success", human_goals=False)
    assert replay_engine.instances[-1].kwargs["human_goals"] is False
    env.reset(0, seed=0)
    for step in STEPS[1:]:
        obs, reward, done, info = env.step(step["action"])
    assert (reward, done, info["task_score"]) == (1.0, True, 1.0)
    with pytest.raises(ValueError, match=r"reward must be one of \('score', 'success'\)"):
        ws.OriginalWebShopEnv(reward="partial")


def test_score_outside_unit_interval_is_rejected():
    with pytest.raises(ValueError, match="score"):
        ws.score_outcome(1.5, True)


class _ReplayEngine:
    """Stand-in for ``WebAgentTextEnv`` that replays the recorded session (any goal index)."""

    instances = []

    def __init__(self, observation_mode, num_products, human_goals):
        assert observation_mode == "text"
        self.kwargs = dict(num_products=num_products, human_goals=human_goals)
        self.server = types.SimpleNamespace(goals=[{"instruction_text": TASK}] * 600)
        self.calls = []
        self.i = 0
        _ReplayEngine.instances.append(self)

    @property
    def observation(self):
        return STEPS[self.i]["page"]

    def reset(self, session=None):
        self.calls.append(("reset", session))
        self.i = 0
        return self.observation, None

    def step(self, action):
        self.calls.append(("step", action))
        if self.i + 1 < len(STEPS) and STEPS[self.i + 1]["action"] == action:
            self.i += 1
            return self.observation, STEPS[self.i]["score"], STEPS[self.i]["done"], None
        return self.observation, 0.0, False, None  # the engine ignores what it cannot act on

    def get_available_actions(self):
        return dict(STEPS[self.i]["available"])


@pytest.fixture
def replay_engine(monkeypatch):
    pkg = types.ModuleType("web_agent_site")
    envs = types.ModuleType("web_agent_site.envs")
    text_env = types.ModuleType("web_agent_site.envs.web_agent_text_env")
    text_env.WebAgentTextEnv = _ReplayEngine
    for name, mod in (
        ("web_agent_site", pkg),
        ("web_agent_site.envs", envs),
        ("web_agent_site.envs.web_agent_text_env", text_env),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    _ReplayEngine.instances.clear()
    return _ReplayEngine


def test_adapter_plays_a_recorded_session_with_verl_agent_conventions(replay_engine):
    env = environments.make("webshop", engine="original")
    engine = replay_engine.instances[-1]
    assert env.max_steps == 15 and env.num_tasks == 100  # 600 goals, the first 500 are the test split
    assert env.task_info(0) == {"goal_index": 500}
    obs = env.reset(0, seed=0)
    assert engine.calls == [("reset", 500)]
    assert obs.task == TASK
    assert obs.text == obs.anchor == "'Search'"
    assert obs.admissible_actions == ["search[<your query>]", "click[search]"]
    rewards, infos = [], []
    for step in STEPS[1:]:
        obs, reward, done, info = env.step(step["action"])
        assert obs.text == obs.anchor == ws.format_page(step["page"], TASK)
        assert TASK not in obs.anchor
        assert obs.admissible_actions == ws.format_available_actions(step["available"])
        rewards.append(reward)
        infos.append(info)
    assert rewards == [0.0, 0.0, 0.0, 1.0]
    assert done and obs.won and infos[-1] == {"won": True, "task_score": 1.0, "admissible": True}
    assert env.oracle_action() is None


def test_adapter_sends_every_command_to_the_engine_as_written(replay_engine):
    env = ws.OriginalWebShopEnv(split="test", max_steps=6)
    engine = replay_engine.instances[-1]
    assert env.num_tasks == 500 and env.task_info(3) == {"goal_index": 3}
    first = env.reset(3, seed=0)
    for action in ("buy the cake mix", " search[gluten free vanilla cake mix]", "click[b08kbvj4xn]"):
        obs, reward, done, info = env.step(action)
        assert engine.calls[-1] == ("step", action)  # not stripped, not filtered: WebShop decides
        assert (obs, reward, done) == (first, 0.0, False) and info["admissible"] is False
    obs, reward, done, info = env.step("search[gluten free vanilla cake mix]")
    assert engine.calls[-1] == ("step", "search[gluten free vanilla cake mix]") and info["admissible"] is True
    with pytest.raises(TypeError, match="str"):
        env.step(None)
    with pytest.raises(ValueError, match="split"):
        ws.OriginalWebShopEnv(split="eval")


@pytest.mark.skipif(importlib.util.find_spec("web_agent_site") is not None, reason="WebShop is installed")
def test_make_webshop_without_webshop_installed_says_what_to_install():
    with pytest.raises(ImportError, match="web_agent_site") as err:
        environments.make("webshop", engine="original")
    assert "github.com/princeton-nlp/WebShop" in str(err.value)
