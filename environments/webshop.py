"""WebShop adapter: WebShop's text environment (``web_agent_site``) behind the ``TextEnv`` contract.

WebShop (Yao et al., 2022) is not on PyPI in usable form (the ``webshop`` 0.1.0 package lacks the
site code and data). A user installs it from its repository, with its product data and search
index (pyserini, which needs Java 21)::

    git clone https://github.com/princeton-nlp/WebShop && cd WebShop
    ./setup.sh -d all            # pip installs, product data, search index
    export PYTHONPATH=$PWD:$PYTHONPATH   # makes `web_agent_site` importable

Without it, ``make("webshop")`` raises ImportError with these instructions. The formatting and
parsing functions below need nothing installed.

Conventions (verl-agent's WebShop setup, which the GiGPO and BiPACE papers use):

- The engine runs in ``observation_mode="text"``: each page is its visible strings joined by
  " [SEP] " (``SEP``). The first page reads "WebShop [SEP] Instruction: [SEP] <instruction> [SEP]
  Search"; ``task`` is that instruction (``extract_instruction``).
- ``text`` = ``anchor`` = ``format_page(page, instruction)``: the page's parts after the
  instruction, each in single quotes, joined by " [SEP] " ("'Back to Search' [SEP] 'Page 1 ...'");
  a page without the instruction (the purchase confirmation) is kept as it is.
- ``admissible_actions`` = ``format_available_actions``: "search[<your query>]" when the page has
  a search bar, then "click[<clickable>]" for each clickable the engine lists (lower-cased button
  texts, product ids, option values).
- Reward = the engine's task score in [0, 1], given when the agent clicks "buy now" (which ends the
  episode), or with ``reward="success"`` (verl-agent's) 1 only for a score of exactly 1; ``won`` =
  the score is exactly 1; ``info["task_score"]`` is the score. ``max_steps`` defaults to 15.
- Task ids: ``split="test"`` plays goals 0..499, ``split="train"`` goals 500.. (verl-agent's split of
  WebShop's human goals); ``task_info`` gives the goal index. WebShop has no expert:
  ``oracle_action()`` returns None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from environments.base import Observation, TextEnv, register

SEP = " [SEP] "
INSTRUCTION_MARK = "Instruction:"
SEARCH_TEMPLATE = "search[<your query>]"
TEST_GOALS = 500  # goals [0, 500) are the test split; the rest train (verl-agent)
_ACTION_RE = re.compile(r"^(search|click)\[(.+)\]$", re.DOTALL)

INSTALL_HINT = (
    "WebShop is not installed: the `web_agent_site` package was not found. Install WebShop from "
    "https://github.com/princeton-nlp/WebShop (git clone, then `./setup.sh -d all` for the product "
    "data and search index; pyserini needs Java 21) and put the clone on PYTHONPATH. "
    "The PyPI package `webshop` does not contain it."
)


def extract_instruction(page: str) -> str:
    """The shopping instruction of a WebShop text page (the part after "Instruction:").

    Raises ValueError when the page has no "Instruction:" part or nothing after it.
    """
    parts = page.split(SEP)
    if INSTRUCTION_MARK not in parts:
        raise ValueError(f"WebShop page has no {INSTRUCTION_MARK!r} part: {page[:200]!r}")
    i = parts.index(INSTRUCTION_MARK)
    if i + 1 >= len(parts) or not parts[i + 1].strip():
        raise ValueError(f"WebShop page has no instruction after {INSTRUCTION_MARK!r}: {page[:200]!r}")
    return parts[i + 1]


def format_page(page: str, instruction: str) -> str:
    """The page as the agent sees it: parts after the instruction, quoted, joined by " [SEP] ".

    Everything up to and including the instruction part is dropped (so the anchor for exact step
    grouping does not repeat the task); a page that does not contain ``instruction`` as a part is
    returned unchanged.
    """
    parts = page.split(SEP)
    if instruction not in parts:
        return page
    rest = parts[parts.index(instruction) + 1 :]
    return SEP.join(f"'{p}'" for p in rest)


def format_available_actions(available: Mapping[str, Any]) -> list[str]:
    """Admissible action strings from the engine's ``get_available_actions()`` dict.

    ``available`` must have exactly the keys "has_search_bar" (bool) and "clickables" (list of
    str); returns ["search[<your query>]"] if there is a search bar, then "click[<c>]" per
    clickable, in the engine's order. Raises ValueError on other keys or missing ones.
    """
    keys = set(available)
    if keys != {"has_search_bar", "clickables"}:
        raise ValueError(f"available actions must have keys ['clickables', 'has_search_bar'], got {sorted(keys)}")
    actions = [SEARCH_TEMPLATE] if available["has_search_bar"] else []
    actions.extend(f"click[{c}]" for c in available["clickables"])
    return actions


def parse_action(action: str) -> tuple[str, str] | None:
    """("search", query) or ("click", target) for a WebShop command, None if malformed.

    A command is exactly ``search[...]`` or ``click[...]`` with a non-blank argument (whitespace
    around the command and the argument is ignored; anything else, e.g. text after the closing
    bracket, makes it malformed, where the engine's own looser parser would guess); never raises.
    """
    m = _ACTION_RE.match(str(action).strip())
    if m is None or not m.group(2).strip():
        return None
    return m.group(1), m.group(2).strip()


def is_available(action: str, available: Mapping[str, Any]) -> bool:
    """Whether ``action`` is one of the actions the page lists (``format_available_actions``).

    A search needs the page's search bar; a click needs its target among the clickables,
    compared lower-cased (the engine lower-cases click and search arguments before matching).
    """
    parsed = parse_action(action)
    if parsed is None:
        return False
    kind, arg = parsed
    if kind == "search":
        return bool(available["has_search_bar"])
    return arg.lower() in available["clickables"]


REWARDS = ("score", "success")


def score_outcome(score: float, done: bool, reward: str = "score") -> tuple[float, bool]:
    """(reward, won) for an engine step: won = done with score exactly 1; the reward is the task score
    (``reward="score"``, partial credit) or 1.0 exactly when won, else 0 (``"success"``, verl-agent)."""
    score = float(score or 0.0)
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"WebShop score must lie in [0, 1], got {score}")
    won = bool(done and score == 1.0)
    return (score if reward == "score" else float(won)), won


def _import_text_env():
    try:
        from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed with: {e})") from e
    return WebAgentTextEnv


class WebShopEnv(TextEnv):
    """WebShop's text environment, one session at a time (conventions in the module docstring).

    Args:
      max_steps: step cap (default 15, verl-agent's WebShop setting).
      split: "train" (goals 500..) or "test" (goals 0..499).
      num_products: products to load (None = all, WebShop's default; small numbers for smoke tests).
      human_goals: use the human-written instructions (WebShop's default); verl-agent, and so the
        paper, trains on the synthetic ones (False).
      reward: ``"score"`` (the task score in [0, 1]) or ``"success"`` (1 only for a score of exactly 1,
        verl-agent's); ``info["task_score"]`` holds the score either way.
      engine_kwargs: further keyword arguments for ``WebAgentTextEnv``.

    Raises ImportError (with install instructions) when ``web_agent_site`` is missing and
    ValueError for a bad option.
    """

    def __init__(
        self,
        max_steps: int = 15,
        split: str = "train",
        num_products: int | None = None,
        human_goals: bool = True,
        reward: str = "score",
        engine_kwargs: Mapping[str, Any] | None = None,
    ):
        super().__init__(max_steps)
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        self.reward_mode = reward
        text_env_cls = _import_text_env()
        self._engine = text_env_cls(
            observation_mode="text", num_products=num_products, human_goals=human_goals, **dict(engine_kwargs or {})
        )
        num_goals = len(self._engine.server.goals)
        self.split = split
        self._offset = 0 if split == "test" else TEST_GOALS
        self._num_tasks = min(TEST_GOALS, num_goals) if split == "test" else max(0, num_goals - TEST_GOALS)
        if self._num_tasks == 0:
            raise ValueError(f"WebShop has {num_goals} goals: none left for split {split!r}")
        self._instruction = ""
        self._available: dict[str, Any] = {"has_search_bar": False, "clickables": []}

    @property
    def num_tasks(self) -> int:
        return self._num_tasks

    def task_info(self, task_id: int) -> dict[str, Any]:
        """``{"goal_index": <WebShop session index>}``."""
        if not 0 <= int(task_id) < self.num_tasks:
            raise ValueError(f"task_id must lie in [0, {self.num_tasks}), got {task_id}")
        return {"goal_index": self._offset + int(task_id)}

    def _observation(self, page: str, won: bool = False) -> Observation:
        self._available = dict(self._engine.get_available_actions())
        text = format_page(page, self._instruction)
        return Observation(
            text=text,
            anchor=text,
            task=self._instruction,
            admissible_actions=format_available_actions(self._available),
            won=won,
        )

    def _reset(self, task_id: int, seed: int) -> Observation:
        # WebShop's text environment is deterministic given the goal: ``seed`` is not used.
        page, _ = self._engine.reset(session=self._offset + task_id)
        self._instruction = extract_instruction(page)
        return self._observation(page)

    def _step(self, action: str):
        action = str(action).strip()
        valid = is_available(action, self._available)
        if parse_action(action) is None:
            # Malformed commands never reach the engine (its parser may raise on them); the page
            # stays as it was, as the engine leaves it for commands it cannot act on.
            page, score, done = self._engine.observation, 0.0, False
        else:
            page, score, done, _ = self._engine.step(action)
        reward, won = score_outcome(score, done, self.reward_mode)
        # info["admissible"]: the command was among the page's listed actions (is_available).
        info = {"won": won, "task_score": float(score or 0.0), "admissible": valid}
        return self._observation(page, won), reward, bool(done), info

    def oracle_action(self) -> str | None:
        """WebShop has no expert: always None."""
        return None


@register("webshop")
def make_webshop(**options) -> WebShopEnv:
    """``environments.make("webshop", **options)``: a ``WebShopEnv`` (options as its arguments)."""
    return WebShopEnv(**options)
