"""Prompt templates, action parsing and the action_tag PACE key."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import environments
from environments.base import Observation
from environments.prompts import (
    PromptTemplate,
    action_tag,
    build_prompt,
    get_template,
    invalid_command,
    parse_action,
)

LADDER = 272


# ---------------------------------------------------------------------------------------------
# action_tag / parse_action: hand-computed cases
@pytest.mark.parametrize(
    "response,key",
    [
        ("<think>x</think><action>get 1 oak logs</action>", "get 1 oak logs"),
        ("<ACTION>  Craft 4 Stick\n using\t2 OAK planks </Action>", "craft 4 stick using 2 oak planks"),
        ("<action>a</action><action>b</action>", "a"),  # the first pair
        ("<action><action>x</action></action>", None),  # a body holding a format tag is never a command
        ("</action><action>late</action>", "late"),
        ("<action>\u00a0\u2003go\u3000to  desk 1\u2029</action>", "go to desk 1"),  # Unicode white space
        ("<action>   </action>", None),  # empty body
        ("<action></action>", None),
        ("<action>no closing tag", None),
        ("no tags at all", None),
        ("<act ion>x</action>", None),
        ("", None),
    ],
)
def test_action_tag_hand_computed(response, key):
    assert action_tag(response) == key
    action, valid = parse_action(response)
    assert valid == (key is not None)
    assert action == (key or "")


@pytest.mark.parametrize(
    "response,action,valid",
    [
        ("<think>ok</think><action>go to desk 1</action>", "go to desk 1", True),
        ("<think>\u53bb\u684c\u5b50</think><action>go to desk 1</action>", "go to desk 1", False),  # CJK in think
        ("<think>ok</think><action>go to \u684c 1</action>", "go to \u684c 1", False),
        ("<think>caf\u00e9 \u00fc\u00df \u3042</think><action>look</action>", "look", True),  # kana, Latin: not CJK
    ],
)
def test_reject_cjk_makes_a_response_with_an_ideograph_invalid(response, action, valid):
    assert parse_action(response, require_think=True, reject_cjk=True) == (action, valid)
    assert parse_action(response, require_think=True) == (action, True)


def test_invalid_command_fallback_or_verl_agent_projection():
    tagged = "<action>open drawer 1</action> (no think)"
    untagged = "I think I Should Open The Drawer Number One Now Please"
    assert invalid_command(tagged, "open drawer 1", "fallback", "inventory", 30) == "inventory"
    assert invalid_command(tagged, "open drawer 1", "projected", "inventory", 30) == "open drawer 1"
    assert invalid_command(untagged, "", "projected", "inventory", 30) == "open the drawer number one now please"[-30:]
    assert invalid_command(untagged, "", "projected", "inventory", 20) == "r number one now please"[-20:]
    assert invalid_command("short", "", "projected", "inventory", 30) == "short"


def test_action_tag_non_string_is_unparsable():
    for bad in (None, 3, b"<action>x</action>", ["<action>x</action>"]):
        assert action_tag(bad) is None
        assert parse_action(bad) == ("", False)
        assert parse_action(bad, require_think=True) == ("", False)


@pytest.mark.parametrize(
    "response,valid",
    [
        ("<think>plan</think><action>look</action>", True),
        ("<THINK>plan</THINK> then <action>look</action>", True),
        ("<think></think><action>look</action>", True),  # empty reasoning still has the tags
        ("<action>look</action><think>late</think>", False),  # think must close before the action
        ("<think>unclosed <action>look</action>", False),
        ("</think><think><action>look</action>", False),
        ("<action>look</action>", False),
    ],
)
def test_require_think_needs_a_closed_think_before_the_action(response, valid):
    assert parse_action(response, require_think=True) == ("look", valid)
    assert parse_action(response, require_think=False) == ("look", True)


# ---------------------------------------------------------------------------------------------
# fuzz: never raises, agrees with an independent regex reference, on >= 10,000 strings
_FRAGMENTS = [
    "<action>",
    "</action>",
    "<ACTION>",
    "</Action>",
    "<think>",
    "</think>",
    "<act",
    "ion>",
    "<",
    ">",
    "/",
    " ",
    "\n",
    "\t",
    "\u00a0",
    "\u2028",
    "\u3000",
    "\x1c",
    "get 1 oak logs",
    "İ",
    "ß",
    "\ud7ff",
    "🙂",
    "craft",
    "",
    "a",
]
_responses = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(_FRAGMENTS), max_size=40).map("".join),
    st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=5)), max_size=30).map("".join),
)


def _reference_key(response: str) -> str | None:
    m = re.search(r"<action>(.*?)</action>", response.lower(), flags=re.S)
    if m is None:
        return None
    body = re.sub(r"\s+", " ", m.group(1)).strip()
    if re.search(r"<action>|</?think>", body):
        return None
    return body or None


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(response=_responses, require_think=st.booleans())
def test_parse_action_never_raises_and_matches_reference_on_10000_strings(response, require_think):
    key = action_tag(response)
    assert key == _reference_key(response)
    action, valid = parse_action(response, require_think=require_think)
    assert isinstance(action, str) and isinstance(valid, bool)
    if key is None:
        assert (action, valid) == ("", False)
    else:
        assert action == key and key == key.strip() and "  " not in key
        if not require_think:
            assert valid


def test_an_action_body_holding_a_format_tag_is_invalid():
    assert parse_action("<action><action>open drawer 1</action></action>") == ("", False)
    assert parse_action("<action>go to <think>desk</think> 1</action>") == ("", False)
    assert parse_action("<think>x</think><action>open drawer 1</action>") == ("open drawer 1", True)
    assert action_tag("<action>take 1 <b>oak</b></action>") == "take 1 <b>oak</b>"  # other markup is text


def test_parse_action_handles_huge_inputs():
    big = "x" * 5_000_000
    assert parse_action(big + "<action>get 1 oak logs</action>") == ("get 1 oak logs", True)
    assert parse_action("<action>" + big) == ("", False)
    assert action_tag("<action>" + " a " * 1_000_000 + "</action>") == " ".join(["a"] * 1_000_000)


# ---------------------------------------------------------------------------------------------
# build_prompt
def _episode(steps=3):
    env = environments.make("textcraft")
    obs = env.reset(LADDER, 0)
    history = []
    for _ in range(steps):
        action = env.oracle_action()
        history.append((obs.text, action))
        obs, _, _, _ = env.step(action)
    return obs, history


def test_textcraft_first_prompt_shows_task_once_and_asks_for_tags():
    env = environments.make("textcraft")
    obs = env.reset(LADDER, 0)
    text = build_prompt("textcraft", obs, [], 0)
    assert text.count(obs.task) == 1 and text.count("Goal: craft ladder.") == 1
    assert "step 1" in text and "(the crafting commands above)" in text
    assert "<think> </think>" in text and "<action> </action>" in text
    assert "Inventory" not in text


def test_textcraft_history_prompt_shows_last_two_pairs_with_step_numbers():
    obs, history = _episode(3)
    text = build_prompt("textcraft", obs, history, 3, history_length=2)
    entries = re.findall(r"\[Observation (\d+): '(.*?)', Action (\d+): '(.*?)'\]", text)
    assert entries == [
        ("2", history[1][0], "2", history[1][1]),
        ("3", history[2][0], "3", history[2][1]),
    ]
    assert "You have taken 3 step(s)" in text and "at step 4" in text
    assert text.endswith(environments.game_spec("textcraft").template.later.rsplit("\n\n", 1)[1])
    assert f"current observation is: {obs.text}" in text
    # history_length larger than the history: everything, numbered from 1; the first
    # observation (the task) is shown by reference
    text = build_prompt("textcraft", obs, history, 3, history_length=10)
    assert "[Observation 1: '(the crafting commands above)', Action 1: 'get 1 acacia logs']" in text
    assert text.count(obs.task) == 1
    # history_length=0: the first template with the current observation
    text0 = build_prompt("textcraft", obs, history, 3, history_length=0)
    assert "[Observation" not in text0 and obs.text in text0 and "step 4" in text0


def test_show_inventory_adds_the_inventory_line_only_when_asked():
    obs, history = _episode(2)
    assert obs.inventory == "Inventory: [acacia planks] (4) "
    plain = build_prompt("textcraft", obs, history, 2)
    shown = build_prompt("textcraft", obs, history, 2, show_inventory=True)
    assert "Inventory:" not in plain
    assert shown.replace("\nInventory: [acacia planks] (4)", "") == plain
    bare = Observation("x", "x", "t", None)
    with pytest.raises(ValueError, match="carries no inventory"):
        build_prompt("alfworld", bare, [], 0, show_inventory=True)


def test_alfworld_prompt_lists_admissible_actions_without_help():
    obs = Observation(
        "You arrive at desk 1.",
        "You arrive at desk 1.",
        "put a mug in desk.",
        ["go to bed 1", "help", "take mug 1 from desk 1"],
    )
    text = build_prompt("alfworld", obs, [("-= Welcome =-", "go to desk 1")], 1)
    assert "Your task is to: put a mug in desk." in text
    assert "[Observation 1: '-= Welcome =-', Action 1: 'go to desk 1']" in text
    assert "Your admissible actions now are: ['go to bed 1'\n 'take mug 1 from desk 1']." in text
    assert "'help'" not in text


def test_webshop_prompt_lists_actions_one_per_line():
    obs = Observation("Search", "Search", "i need a red shirt", ["search[<your query>]", "click[next >]"])
    text = build_prompt("webshop", obs, [], 0)
    assert "[\n'search[<your query>]',\n'click[next >]'\n]." in text
    assert "WebShop" in text and "i need a red shirt" in text


def test_braces_in_observations_are_shown_verbatim():
    obs = Observation("{task} {0} }{", "{task}", "do {x}", None)
    text = build_prompt("alfworld", obs, [("{history}", "a{b}")], 1)
    assert "{task} {0} }{" in text and "'{history}'" in text and "do {x}" in text


def test_template_overrides_from_a_config_mapping():
    obs, history = _episode(1)
    text = build_prompt("textcraft", obs, history, 1, template={"later": "T={task}|S={current_step}|H={history}"})
    assert text == f"T={obs.task}|S=2|H=[Observation 1: '(the crafting commands above)', Action 1: '{history[0][1]}']"
    custom = PromptTemplate(first="{observation}", later="{history}", history_entry="{action}")
    assert build_prompt("anything", obs, history, 1, template=custom) == history[0][1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(game="chess"), r"unknown environment 'chess'; known: \[.*'textcraft'"),
        (dict(step=-1), "step must be an int >= 0"),
        (dict(history_length=-2), "history_length must be an int >= 0"),
        (dict(step=0), "history has 1 entries but step is 0"),
        (dict(history=[("only one element",)], step=1), "history entries must be"),
        (dict(template={"later": "{nope}"}), r"PromptTemplate.later uses unknown placeholder\(s\) \['nope'\]"),
        (dict(template={"colour": "red"}), r"unknown PromptTemplate field\(s\) \['colour'\]"),
        (dict(template={"first": "{"}), "PromptTemplate.first is not a valid format string"),
    ],
)
def test_build_prompt_rejects_bad_input_naming_the_field(kwargs, match):
    obs, history = _episode(1)
    args = dict(game="textcraft", obs=obs, history=history, step=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_prompt(**args)


def test_every_default_template_is_valid_and_uses_the_tags():
    for game in ("alfworld", "textcraft", "webshop"):
        tpl = environments.game_spec(game).template
        assert get_template(game) is tpl
        for text in (tpl.first, tpl.later):
            assert "<think> </think>" in text and "<action> </action>" in text
            assert "{task}" in text and "{current_step}" in text and "{observation}" in text
        assert "{history}" in tpl.later


def test_oracle_action_round_trips_through_the_response_format():
    env = environments.make("textcraft")
    obs = env.reset(0, 11)
    history, step = [], 0
    while True:
        prompt = build_prompt("textcraft", obs, history, step, show_inventory=True)
        assert obs.inventory.strip() in prompt
        expert = env.oracle_action()
        response = f"<think>follow the recipe</think>\n<action> {expert.upper()} </action>"
        action, valid = parse_action(response, require_think=True)
        assert valid and action == expert == action_tag(response)
        history.append((obs.text, action))
        obs, reward, done, _ = env.step(action)
        step += 1
        if done:
            break
    assert reward == 1.0 and obs.won
