"""Prompt templates as data: ``PromptTemplate`` (``str.format`` strings, checked field by field) and the
response instruction every built-in game's template ends with.

Below the game registry (a ``GameSpec`` holds a ``PromptTemplate``) and ``environments.prompts`` (which
renders templates); imports nothing of the project.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any

__all__ = ["TEMPLATE_FIELDS", "THINK_ACT", "PromptTemplate"]

#: Placeholders the two main templates may use (all optional).
TEMPLATE_FIELDS = frozenset(
    {
        "task",  # Observation.task
        "observation",  # the current observation text
        "step_count",  # actions taken so far (the `step` argument)
        "current_step",  # step_count + 1
        "history_length",  # number of (observation, action) pairs shown
        "history",  # the shown pairs, each rendered with `history_entry`
        "admissible",  # `admissible_block` when the game lists actions, else ""
        "inventory",  # `inventory_block` with show_inventory=True, else ""
    }
)
_ENTRY_FIELDS = frozenset({"index", "observation", "action"})
_ACTION_FIELDS = frozenset({"action"})
_ADMISSIBLE_FIELDS = frozenset({"actions"})
_INVENTORY_FIELDS = frozenset({"inventory"})


def _fields(template: str, what: str) -> set[str]:
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"PromptTemplate.{what} is not a valid format string: {e}") from None


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """One game's prompt, as ``str.format`` templates.

    Attributes:
      first: the prompt when no history is shown (step 0, or ``history_length=0``).
      later: the prompt with history. Both may use the names in ``TEMPLATE_FIELDS``.
      history_entry: one shown (observation, action) pair; names ``index`` (1-based step of the
        action), ``observation``, ``action``.
      history_separator: between history entries.
      admissible_block: replaces ``{admissible}`` when the game lists admissible actions; name
        ``actions`` (the actions, each rendered with ``action_format``, joined by
        ``action_separator``).
      action_format, action_separator: see ``admissible_block``.
      excluded_actions: admissible actions never shown (ALFWorld's ``help``).
      inventory_block: replaces ``{inventory}`` with ``show_inventory=True``; name ``inventory``
        (``Observation.inventory``).
      task_echo: shown instead of an observation whose text equals the task (TextCraft's first
        observation IS the task: the crafting commands), so the long text appears once.

    Raises:
      ValueError: naming the field, when a template uses an unknown placeholder or is malformed.
    """

    first: str
    later: str
    history_entry: str = "[Observation {index}: '{observation}', Action {index}: '{action}']"
    history_separator: str = "\n"
    admissible_block: str = "\nYour admissible actions now are: [{actions}]."
    action_format: str = "'{action}'"
    action_separator: str = "\n "
    excluded_actions: tuple[str, ...] = ("help",)
    inventory_block: str = "\n{inventory}"
    task_echo: str = "(the task above)"

    def __post_init__(self):
        allowed = {
            "first": TEMPLATE_FIELDS,
            "later": TEMPLATE_FIELDS,
            "history_entry": _ENTRY_FIELDS,
            "admissible_block": _ADMISSIBLE_FIELDS,
            "action_format": _ACTION_FIELDS,
            "inventory_block": _INVENTORY_FIELDS,
        }
        for name, names in allowed.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"PromptTemplate.{name} must be a str, got {type(value).__name__}")
            unknown = _fields(value, name) - names
            if unknown:
                raise ValueError(
                    f"PromptTemplate.{name} uses unknown placeholder(s) {sorted(unknown)}; "
                    f"expected a subset of {sorted(names)}"
                )
        for name in ("history_separator", "action_separator", "task_echo"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"PromptTemplate.{name} must be a str")
        object.__setattr__(self, "excluded_actions", tuple(self.excluded_actions))

    def replace(self, **overrides: Any) -> PromptTemplate:
        """A copy with some fields changed (e.g. from a config); unknown fields raise ValueError."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown PromptTemplate field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **overrides)


#: The closing instruction of every built-in game's prompt (the response format ``parse_action`` reads).
THINK_ACT = (
    "Now it is your turn to act. First reason step by step about the current situation; the "
    "reasoning MUST be enclosed in <think> </think> tags. Then give exactly one action for this "
    "step, enclosed in <action> </action> tags."
)

#: The history block of a later turn's prompt (verl-agent's layout).
HISTORY = "You have taken {step_count} step(s). Your last {history_length} observation(s) and action(s):\n{history}\n"
#: The current step, its admissible commands and inventory (when shown), and the response format.
CURRENT_STEP = (
    "You are at step {current_step} and your current observation is: {observation}"
    "{admissible}{inventory}\n\n" + THINK_ACT
)


def turn_template(intro: str, current: str = CURRENT_STEP, **options: Any) -> PromptTemplate:
    """verl-agent's prompt layout: ``intro`` (the game and task), then on later turns `HISTORY`, then
    ``current``; ``options`` are the other `PromptTemplate` fields."""
    return PromptTemplate(first=intro + current, later=intro + HISTORY + current, **options)
