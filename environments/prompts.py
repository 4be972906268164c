"""Prompts and action parsing for the text games, in the verl-agent style.

A prompt (the user message of one turn) shows the task, the last ``history_length``
(observation, action) pairs, the current step number and observation, the admissible actions
where the game lists them, and asks for reasoning inside ``<think>...</think>`` and the command
inside ``<action>...</action>``. Templates are data (``PromptTemplate``: ``str.format`` strings),
overridable field by field from a config mapping; each game's default is its ``GameSpec.template``
(``environments.registry``), defined in the game's module.

Action parsing follows the spec's ``action_tag`` PACE key (``docs/estimators.md``, "PACE keys"):
lower-case the whole response, take the text inside the first ``<action>...</action>``, strip
surrounding Unicode white space and collapse inner runs to one space; a missing closing tag or
an empty body is unparsable. ``parse_action`` returns that same text as the command, so the
command a game receives and the PACE key of the response agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from environments.base import Observation
from environments.registry import game_spec
from environments.templates import TEMPLATE_FIELDS, THINK_ACT, PromptTemplate

__all__ = [
    "PromptTemplate",
    "TEMPLATE_FIELDS",
    "THINK_ACT",
    "build_prompt",
    "invalid_command",
    "parse_action",
    "action_tag",
    "get_template",
]


def get_template(game: str, template: PromptTemplate | Mapping[str, Any] | None = None) -> PromptTemplate:
    """The template to use: ``template`` itself, the game's default (its ``GameSpec.template``)
    overridden by a mapping, or the default.

    Raises ValueError naming ``game`` when it is not registered and ``template`` is not a full
    ``PromptTemplate``, or naming a bad override field.
    """
    if isinstance(template, PromptTemplate):
        return template
    default = game_spec(game).template
    if template is None:
        return default
    if not isinstance(template, Mapping):
        raise ValueError(f"template must be a PromptTemplate, a mapping or None, got {type(template).__name__}")
    return default.replace(**dict(template))


def build_prompt(
    game: str,
    obs: Observation,
    history: Sequence[tuple[str, str]],
    step: int,
    history_length: int = 2,
    template: PromptTemplate | Mapping[str, Any] | None = None,
    show_inventory: bool = False,
) -> str:
    """The user message for one turn (verl-agent style; see the module docstring).

    Args:
      game: a registered game (``environments.registered()``); selects its ``GameSpec.template``.
      obs: the current observation.
      history: (observation_text, action) of earlier steps, oldest first; entry k holds the
        observation seen before action k+1 and that action. It may be truncated at the front.
      step: actions taken so far in the episode (0 at reset); the prompt names step ``step + 1``.
      history_length: how many of the last pairs to show (verl-agent default 2; 0 shows none).
      template: a ``PromptTemplate``, a mapping of fields overriding the game's default, or None.
      show_inventory: add ``Observation.inventory`` (off by default, as in the papers' configs).

    Returns:
      The prompt text (str).

    Raises:
      ValueError: on an unknown game, a negative ``step`` or ``history_length``, more history
        entries than ``step``, a malformed history entry, or ``show_inventory`` with an
        observation that carries no inventory.
    """
    tpl = get_template(game, template)
    if not isinstance(obs, Observation):
        raise ValueError(f"obs must be an environments.base.Observation, got {type(obs).__name__}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0 (actions taken so far), got {step!r}")
    if not isinstance(history_length, int) or history_length < 0:
        raise ValueError(f"history_length must be an int >= 0, got {history_length!r}")
    if len(history) > step:
        raise ValueError(f"history has {len(history)} entries but step is {step}: at most one entry per step taken")
    shown = list(history[len(history) - history_length :]) if history_length else []
    for entry in shown:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
            raise ValueError(f"history entries must be (observation_text, action) str pairs, got {entry!r}")

    def show(text: str) -> str:
        return tpl.task_echo if text == obs.task else text

    first_index = step - len(shown) + 1
    rendered = tpl.history_separator.join(
        tpl.history_entry.format(index=first_index + k, observation=show(o), action=a) for k, (o, a) in enumerate(shown)
    )
    admissible = ""
    if obs.admissible_actions is not None:
        actions = [a for a in obs.admissible_actions if a not in tpl.excluded_actions]
        admissible = tpl.admissible_block.format(
            actions=tpl.action_separator.join(tpl.action_format.format(action=a) for a in actions)
        )
    inventory = ""
    if show_inventory:
        if obs.inventory is None:
            raise ValueError(f"show_inventory=True but this {game} observation carries no inventory")
        inventory = tpl.inventory_block.format(inventory=obs.inventory.strip())
    values = dict(
        task=obs.task,
        observation=show(obs.text),
        step_count=step,
        current_step=step + 1,
        history_length=len(shown),
        history=rendered,
        admissible=admissible,
        inventory=inventory,
    )
    return (tpl.later if shown else tpl.first).format(**values)


_OPEN, _CLOSE = "<action>", "</action>"


_FORMAT_TAGS = (_OPEN, "<think>", "</think>")


def _tag_span(lowered: str) -> tuple[int, int] | None:
    start = lowered.find(_OPEN)
    if start < 0:
        return None
    end = lowered.find(_CLOSE, start + len(_OPEN))
    if end < 0:
        return None
    return start, end


def action_tag(response: Any) -> str | None:
    """The spec's ``action_tag`` PACE key of a response (``docs/estimators.md``, "PACE keys").

    Lower-cases the whole response, takes the text inside the first ``<action>...</action>``,
    strips surrounding Unicode white space and collapses inner runs to one space (Python's
    ``str.split()`` notion of white space). Returns None (unparsable: key id -1) when there is
    no ``<action>``, no ``</action>`` after it, the body is empty or holds a tag of the response format
    (``<action>``, ``<think>``, ``</think>``: a nested or garbled answer, never a game command), and for a
    non-str. Never raises.
    """
    if not isinstance(response, str):
        return None
    lowered = response.lower()
    span = _tag_span(lowered)
    if span is None:
        return None
    body = " ".join(lowered[span[0] + len(_OPEN) : span[1]].split())
    if any(tag in body for tag in _FORMAT_TAGS):
        return None
    return body or None


_CJK = re.compile("[\u4e00-\u9fff]")  # CJK unified ideographs: the range verl-agent's projection rejects


def parse_action(response: Any, require_think: bool = False, reject_cjk: bool = False) -> tuple[str, bool]:
    """The command in a response, and whether the response is valid. Never raises.

    The command is ``action_tag(response)`` (lower-cased, white space normalised). The
    response is invalid when that is None (no tags, no closing tag, empty body; the command is
    then ""), with ``require_think`` when no ``<think>`` ... ``</think>`` pair closes before the
    first ``<action>``, and with ``reject_cjk`` when it holds a CJK ideograph (U+4E00..U+9FFF);
    in the last two cases the command is still returned. The caller charges the invalid-action
    penalty and sends the game ``invalid_command`` for invalid responses.
    """
    try:
        key = action_tag(response)
        if key is None:
            return "", False
        if reject_cjk and _CJK.search(response):
            return key, False
        if require_think:
            lowered = response.lower()
            start = lowered.find(_OPEN)
            t_open = lowered.find("<think>", 0, start)
            t_close = lowered.find("</think>", t_open + 7, start) if t_open >= 0 else -1
            if t_open < 0 or t_close < 0:
                return key, False
        return key, True
    except Exception:  # noqa: BLE001  (a parser for arbitrary model output must not raise)
        return "", False


def invalid_command(response: str, command: str, mode: str, fallback: str, tail_chars: int) -> str:
    """What the game receives for an invalid response (``RolloutConfig.invalid_action``).

    ``"fallback"``: ``fallback`` (e.g. ``"inventory"``). ``"projected"`` (verl-agent's projection): the
    parsed ``command`` when the response had action tags (invalid for a missing think or CJK), else
    the last ``tail_chars`` characters of the lower-cased response (ALFWorld 30, WebShop 20), which
    the game answers as an unknown command.
    """
    if mode == "fallback":
        return fallback
    return command if command else response.lower()[-tail_chars:]
