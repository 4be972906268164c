"""WebShop (Yao et al., 2022): our own engine on WebShop's data files, and an adapter over the original.

``environments.make("webshop", **options)`` builds ``WebShopEnv``, a pure-Python engine that
reproduces what verl-agent's WebShop agents see and are paid, with no Java, search index, Flask or
(given a noun cache) spaCy. ``engine="original"`` builds ``OriginalWebShopEnv`` instead, the
adapter over WebShop's own ``web_agent_site`` package (installed from its repository).

Data: WebShop's files (``environments/webshop_data.py``): ``items_shuffle_1000.json`` (products),
``items_ins_v2_1000.json`` (attributes, synthetic instructions), ``items_human_ins.json`` (human
goals, only for ``goals="human"``), which WebShop's ``./setup.sh -d small`` downloads (repository
github.com/princeton-nlp/WebShop). Point ``data_dir`` (or ``$WEBSHOP_DATA``) at that folder;
``data_dir="sample"`` plays the 10-product sample shipped in ``environments/data/webshop_sample``.
The reward's title nouns come from ``title_nouns.json`` next to the data, written on first use
with spaCy (``pip install "bipace_jax[webshop-nouns]" && python -m spacy download en_core_web_sm``;
the sample ships its file, recorded with spaCy 3.8.18 and en_core_web_sm 3.8.0).

Options of ``WebShopEnv`` (``make("webshop", ...)``):

* ``data_dir``: the data folder (default ``$WEBSHOP_DATA``; ``"sample"``: the shipped sample).
* ``goals``: ``"synthetic"`` (one per option combination of each product with an instruction,
  verl-agent's choice, and so the paper's) or ``"human"`` (crowd-written instructions).
* ``split``: ``"test"`` plays goals ``[0, num_test_goals)``, ``"train"`` the rest (verl-agent's
  split; ``num_test_goals`` is 500 there, smaller for the sample's 55 goals).
* ``goal_seed`` (233): the seed of the ranged products' prices, the price caps and the goal order.
  The default 233 is the seed WebShop's ``SimServer`` always shuffles its goals with
  (``random.seed(233); random.shuffle(goals)``), so the default test split (goals
  ``[0, num_test_goals)``, WebShop's own test goals 0-499 on the full data) is the original's: the
  same product and options at every position. Other seeds are ours (verl-agent seeds them per
  worker; here one order serves every game, so task ids are stable).
* ``reward``: ``"score"`` (the task score in [0, 1]) or ``"success"`` (1 only for a score of
  exactly 1, verl-agent's; the trainer's ``rollout.success_reward`` makes it 10).
* ``max_steps`` (15, verl-agent's WebShop cap).

The game (exact page texts, ``render_*`` below): each page is its visible strings joined by
" [SEP] ". The start page is "WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search";
``search[<words>]`` (on any page) shows "Page p (Total results: n)" and 10 of the 50 best hits
(asin, title, price), with "< Prev" (p > 1) and "Next >" (always); ``click[<asin>]`` opens an item
page (option groups and values, title, price, "Rating: N.A.", Description / Features / Reviews /
Buy Now); ``click[<option value>]`` chooses it (the page text does not show the choice);
``click[< prev]`` goes back one level, ``click[back to search]`` to the start page; ``click[buy
now]`` ends the episode with the task score (``environments/webshop_reward.py``). Anything else
(unknown action, a click on something the page does not list, ``click[search]``) changes nothing.
Commands are parsed as WebShop's ``WebAgentTextEnv`` parses them (``parse_action``): ``name[argument]``
from the first character, nothing stripped (" click[buy now]", a leading tab or " search[dress]"
does nothing), the name matched as written ("Click[...]" does nothing), the argument lower-cased
and running to the last "]" of the first line, anything after it ignored. ``engine="original"``
hands every command to WebShop as written.

Differences from WebShop's own code (``web_agent_site`` at 64fa2a5) that are left, and why:

* Prices and price caps: WebShop draws the prices of ranged products and each goal's price cap
  from Python's unseeded ``random`` before it seeds the shuffle, so they change between its runs;
  here they come from ``random.Random(goal_seed)`` (verl-agent's order of draws), so a goal's
  instruction ("price lower than ...") is fixed. The products and options of the goals are not
  affected.
* Search: the analyzer gives Lucene's terms on every recorded string and the ranking Anserini's on
  every recorded query (``environments/webshop_search.py``, which names the three corner cases
  left: Unicode version of the word-break classes, UTF-16 length of the 255-character cut,
  float32 score sums).
* Title nouns: tagged with spaCy 3.8 and en_core_web_sm 3.8.0 (the model on offer today; WebShop
  pins spaCy 3.3.0), so a title may get other nouns than under WebShop's pinned model.
* ``search[<a> ...]`` (attribute search) shows an empty results page; WebShop's text environment
  raises a TypeError there (its ``SimServer`` passes the search no attribute index), and a model's
  command must not end the game with an error.

What the agent sees (verl-agent's formatting, used by both engines):

* ``task`` is the instruction; ``text`` = ``anchor`` = ``format_page(page, instruction)``: the
  page's parts after the instruction, each in single quotes, joined by " [SEP] " ("'Back to
  Search' [SEP] 'Page 1 ...'"); the purchase page, which lacks the instruction, is kept whole.
* ``admissible_actions`` = ``format_available_actions``: "search[<your query>]" on the start page,
  then "click[<clickable>]" per clickable: lower-cased buttons, product ids, option values.
* ``info["task_score"]`` is the score, ``info["won"]`` (and ``Observation.won``) a score of
  exactly 1, ``info["admissible"]`` whether the action was among the listed ones.
* ``task_info(t)`` = ``{"goal_index", "asin", "task_type"}`` (task_type: WebShop's category).
* ``oracle_action()`` (our engine): search the goal product's title, open it (paging if needed),
  choose the goal's options, buy.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from environments import webshop_data as data
from environments.base import Observation, TextEnv
from environments.registry import GameSpec, register_game
from environments.templates import turn_template
from environments.webshop_reward import OptionScorer, Score, task_score
from environments.webshop_search import TOP_K, SearchIndex, document_text

SEP = " [SEP] "
#: WebShop's own goal shuffle seed (``SimServer``: ``random.seed(233)``), the default ``goal_seed``.
GOAL_SEED = 233
INSTRUCTION_MARK = "Instruction:"
SEARCH_TEMPLATE = "search[<your query>]"
TEST_GOALS = 500  # goals [0, 500) are the test split; the rest train (verl-agent)
# WebShop's action grammar (engine.parse_action): re.match of "name[arg]", both greedy, from the
# first character, "." not matching a newline; WebAgentTextEnv compares the name as written.
_ACTION_RE = re.compile(r"(.+)\[(.+)\]")
ACTION_NAMES = ("search", "click")

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
    r"""("search", words) or ("click", target) as WebShop's ``WebAgentTextEnv.step`` reads ``action``;
    None for a command it does nothing with. Never raises (a non-str is None).

    The original's rule (``web_agent_site`` at 64fa2a5: ``engine.parse_action`` and ``step``):
    ``re.match(r"(.+)\[(.+)\]", action)``, so the match starts at the first character, ends at the
    last "]" it can reach and "." does not cross a newline; nothing is stripped; the name must be
    exactly "search" or "click" and the argument is lower-cased. Hence ``" click[buy now]"``,
    ``"\tsearch[dress]"`` and ``"Click[buy now]"`` are None; ``"click[Buy Now] please"`` and
    ``"click[buy now]\n"`` are ("click", "buy now"); ``"search[a] and click[b]"`` is None (the
    name is "search[a] and click"); ``"search[ ]"`` is ("search", " ").
    """
    m = _ACTION_RE.match(action) if isinstance(action, str) else None
    if m is None or m.group(1) not in ACTION_NAMES:
        return None
    return m.group(1), m.group(2).lower()


def is_available(action: str, available: Mapping[str, Any]) -> bool:
    """Whether the engine acts on ``action`` (``parse_action``) as one of the actions the page lists
    (``format_available_actions``): a search needs the page's search bar, a click its lower-cased
    target among the clickables. A command the engine ignores (" click[buy now]") is not available.
    """
    parsed = parse_action(action)
    if parsed is None:
        return False
    kind, arg = parsed
    if kind == "search":
        return bool(available["has_search_bar"])
    return arg in available["clickables"]


REWARDS = ("score", "success")


def score_outcome(score: float, done: bool, reward: str = "score") -> tuple[float, bool]:
    """(reward, won) for an engine step: won = done with score exactly 1; the reward is the task score
    (``reward="score"``, partial credit) or 1.0 exactly when won, else 0 (``"success"``, verl-agent)."""
    score = float(score or 0.0)
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"WebShop score must lie in [0, 1], got {score}")
    won = bool(done and score == 1.0)
    return (score if reward == "score" else float(won)), won


# --- our engine: pages --------------------------------------------------------------------------
PRODUCTS_PER_PAGE = 10
SUB_PAGES = ("description", "features", "reviews")
ENGINES = ("native", "original")
_HTML_SPACE = " \t\n\r\f"


def _field(text: str) -> list[str]:
    """The text field a template value becomes: none for "" or blank text with a newline (the
    HTML parser folds it into a dropped "\\n"), "" for other blank text, else the stripped text."""
    if text == "":
        return []
    if not text.strip(_HTML_SPACE):
        return [] if "\n" in text else [""]
    return [text.strip()]


@dataclasses.dataclass(frozen=True)
class Page:
    """A rendered page: its text fields, its clickables (key -> ``(kind, payload)``; kinds
    "button", "product" (payload: asin), "option" (payload: option name)) in page order, and
    whether it has the search bar."""

    fields: tuple[str, ...]
    clickables: Mapping[str, tuple[str, str | None]]
    has_search_bar: bool = False

    @property
    def text(self) -> str:
        return SEP.join(self.fields)

    def available(self) -> dict[str, Any]:
        """The page's ``get_available_actions()`` dict (``format_available_actions`` input)."""
        return {"has_search_bar": self.has_search_bar, "clickables": list(self.clickables)}


def _header(instruction: str) -> list[str]:
    return [INSTRUCTION_MARK, *_field(instruction), "Back to Search"]


def render_search(instruction: str) -> Page:
    """The start page: "WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search"."""
    return Page(("WebShop", INSTRUCTION_MARK, *_field(instruction), "Search"), {"search": ("button", None)}, True)


def render_results(instruction: str, products: Sequence[data.Product], page: int, total: int) -> Page:
    """A results page: page ``page`` of ``total`` hits showing ``products`` (asin, title, price tag)."""
    fields = _header(instruction) + [f"Page {page} (Total results: {total})"]
    clickables: dict[str, tuple[str, str | None]] = {"back to search": ("button", None)}
    if page > 1:
        fields.append("< Prev")
        clickables["< prev"] = ("button", None)
    fields.append("Next >")
    clickables["next >"] = ("button", None)
    for p in products:
        fields += [*_field(p.asin), *_field(p.title), *_field(p.price_tag)]
        clickables[p.asin.lower()] = ("product", p.asin)
    return Page(tuple(fields), clickables)


def render_item(instruction: str, product: data.Product) -> Page:
    """An item page: option groups with their values, title, price, rating and the four buttons."""
    fields = _header(instruction) + ["< Prev"]
    for name, values in product.options.items():
        fields += _field(name)
        for v in values:
            fields += _field(v)
    fields += [*_field(product.title), f"Price: {product.price_tag}", f"Rating: {product.rating}"]
    fields += ["Description", "Features", "Reviews", "Buy Now"]
    buttons = ("back to search", "< prev", *SUB_PAGES, "buy now")
    clickables: dict[str, tuple[str, str | None]] = {b: ("button", None) for b in buttons}
    for name, values in product.options.items():
        for v in values:
            clickables[v] = ("option", name)  # a repeated value keeps its first place, points to its last group
    return Page(tuple(fields), clickables)


def render_sub_page(instruction: str, product: data.Product, which: str) -> Page:
    """The description, features (one field per bullet point) or reviews (always empty) page."""
    fields = _header(instruction) + ["< Prev"]
    if which == "description":
        fields += _field(product.description)
    elif which == "features":
        for bullet in product.bullet_points:
            fields += _field(" " + bullet)
    elif which != "reviews":
        raise ValueError(f"sub-page must be one of {SUB_PAGES}, got {which!r}")
    return Page(tuple(fields), {"back to search": ("button", None), "< prev": ("button", None)})


def _options_json(options: Mapping[str, str]) -> str:
    # Flask's tojson: sorted keys, ASCII, and <, >, &, ' escaped for HTML.
    text = json.dumps(dict(options), sort_keys=True)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("'", "\\u0027")):
        text = text.replace(ch, esc)
    return text


def render_done(asin: str, options: Mapping[str, str], score: float) -> Page:
    """The purchase page (no instruction; its hidden parts are text too, as in WebShop's template)."""
    fields = ["Thank you for shopping with us!", "Your code:", "None", "(Paste it in your MTurk interface.)"]
    fields += ["Purchased", "asin", *_field(asin), "options", _options_json(options)]
    for label in ("attrs", "category", "query", "product category"):
        fields += [label, "None"]
    fields += ["Target", "asin", "options", "attrs", "price upper", "instuction text"]
    fields += ["category", "product category", "query", "Goal", "None", "Reward"]
    fields += ["Your score (min 0.0, max 1.0)", str(float(score)), "Reward Details", "None"]
    return Page(tuple(fields), {})


@functools.lru_cache(maxsize=4)
def _search_index(data_dir: str) -> SearchIndex:
    products = data.load_catalogue(data_dir).products
    return SearchIndex([(p.asin, document_text(p.title, p.description, p.bullet_points, p.options)) for p in products])


def search_query(text: str) -> str:
    """``text`` as a search argument the engine parses back whole: lower case, no brackets, single spaces."""
    return " ".join(re.sub(r"[\[\]]", " ", text.lower()).split())


# --- our engine ---------------------------------------------------------------------------------
class WebShopEnv(TextEnv):
    """WebShop on its own data files (conventions and options in the module docstring).

    Args:
      data_dir: WebShop's data folder (default ``$WEBSHOP_DATA``); ``"sample"``: the shipped sample.
      goals: ``"synthetic"`` or ``"human"``.
      split: ``"train"`` (goals ``num_test_goals``..) or ``"test"`` (goals 0..``num_test_goals``-1).
      reward: ``"score"`` or ``"success"``.
      max_steps: step cap (default 15).
      num_test_goals: size of the test split (default 500, verl-agent's).
      scorer: the option rule's revision, ``"verl_agent"`` (default: the baseline's, parity with
        GiGPO/verl-agent) or ``"upstream"`` (goal option values compared after colour normalisation,
        as the clicked ones; ``environments.webshop_reward.OptionScorer``). A run sets it with
        ``--config.env.webshop_scorer=upstream``.
      goal_seed: seed of the prices, price caps and goal order (default 233, WebShop's: the
        original test split; other values give splits of our own).

    Raises:
      FileNotFoundError: no data folder, or a data file missing (the message says where WebShop's
        setup gets them).
      ImportError: the title nouns are not cached and spaCy cannot compute them, or the search /
        reward libraries (the ``webshop`` extra) are missing.
      ValueError: a bad option (named, with the values it takes), or a split without goals.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        goals: str = "synthetic",
        split: str = "train",
        reward: str = "score",
        max_steps: int = 15,
        num_test_goals: int = TEST_GOALS,
        goal_seed: int = GOAL_SEED,
        scorer: str = OptionScorer.VERL_AGENT,
    ):
        super().__init__(max_steps)
        if scorer not in tuple(OptionScorer):
            raise ValueError(f"scorer must be one of {[str(o) for o in OptionScorer]}, got {scorer!r}")
        self.scorer = OptionScorer(scorer)
        if goals not in data.GOAL_KINDS:
            raise ValueError(f"goals must be one of {data.GOAL_KINDS}, got {goals!r}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        if not isinstance(num_test_goals, int) or isinstance(num_test_goals, bool) or num_test_goals < 0:
            raise ValueError(f"num_test_goals must be an int >= 0, got {num_test_goals!r}")
        if not isinstance(goal_seed, int) or isinstance(goal_seed, bool):
            raise ValueError(f"goal_seed must be an int, got {goal_seed!r}")
        self.data_dir = data.resolve_data_dir(data_dir)
        self.catalogue = data.load_catalogue(self.data_dir)
        self.prices, all_goals = data.build_goals(self.data_dir, goals, goal_seed)
        self.goals = all_goals[:num_test_goals] if split == "test" else all_goals[num_test_goals:]
        if not self.goals:
            raise ValueError(
                f"WebShop split {split!r} has no goals: {len(all_goals)} {goals} goals in {self.data_dir!r}, "
                f"the first num_test_goals={num_test_goals} are the test split"
            )
        self._offset = 0 if split == "test" else num_test_goals
        self.split, self.reward_mode, self.goal_kind = split, reward, goals
        self.nouns = data.title_nouns(self.data_dir)
        self.index = _search_index(self.data_dir)
        self._hits_cache: dict[str, list[data.Product]] = {}
        self.goal: data.Goal | None = None
        self.last_score: Score | None = None

    @property
    def num_tasks(self) -> int:
        return len(self.goals)

    def task_info(self, task_id: int) -> dict[str, Any]:
        """``{"goal_index": <index among all goals>, "asin": <target>, "task_type": <WebShop category>,
        "best_score": <the expert's purchase's score under this env's scorer>}`` (the goal's product,
        options and price; a goal below 1.0 no purchase can win: ``val/unwinnable_goals``)."""
        if not 0 <= int(task_id) < self.num_tasks:
            raise ValueError(f"task_id must lie in [0, {self.num_tasks}), got {task_id}")
        g = self.goals[int(task_id)]
        return {
            "goal_index": self._offset + int(task_id),
            "asin": g.asin,
            "task_type": g.category,
            "best_score": self.best_score(int(task_id)),
        }

    def best_score(self, task_id: int) -> float:
        """The task score of buying goal ``task_id``'s product with its goal options at its price."""
        g = self.goals[task_id]
        opts = g.goal_options
        chosen = dict(opts) if isinstance(opts, Mapping) else {str(i): v for i, v in enumerate(opts)}
        product = self.catalogue.by_asin[g.asin]
        return task_score(product, g, self.prices[g.asin], chosen, self.nouns.__getitem__, self.scorer).total

    # -- search ------------------------------------------------------------------------------
    def hits(self, keywords: Sequence[str]) -> list[data.Product]:
        """The products a search for ``keywords`` (split on " ") returns, best first.

        First keywords with special meaning, as in WebShop: ``<r>`` 50 random products (this
        episode's seed), ``<c> <category>``, ``<q> <query...>`` (equality); ``<a>`` returns nothing
        (WebShop's text environment raises a TypeError there: see the module docstring).
        """
        products = self.catalogue.products
        head = keywords[0] if keywords else ""
        if head == "<r>":
            return self._rng.sample(list(products), k=min(len(products), TOP_K))
        if head == "<c>":
            cat = keywords[1].strip() if len(keywords) > 1 else ""
            return [p for p in products if p.category == cat]
        if head == "<q>":
            q = " ".join(keywords[1:]).strip()
            return [p for p in products if p.query == q]
        if head == "<a>":
            return []
        query = " ".join(keywords)
        if query not in self._hits_cache:
            self._hits_cache[query] = [products[i] for i in self.index.search(query)]
        return self._hits_cache[query]

    # -- game --------------------------------------------------------------------------------
    def _show(self, page: Page, kind: str) -> None:
        self._page, self._kind = page, kind

    def _start_page(self) -> None:
        self._keywords, self._page_no, self._asin, self._options = None, None, None, {}
        self._show(render_search(self.goal.instruction_text), "search")

    def _results(self, keywords: list[str], page_no: int) -> None:
        self._keywords, self._page_no, self._asin, self._options = keywords, page_no, None, {}
        hits = self.hits(keywords)
        shown = hits[(page_no - 1) * PRODUCTS_PER_PAGE : page_no * PRODUCTS_PER_PAGE] if page_no >= 1 else []
        self._show(render_results(self.goal.instruction_text, shown, page_no, len(hits)), "results")

    def _item(self) -> None:
        self._show(render_item(self.goal.instruction_text, self.catalogue.by_asin[self._asin]), "item")

    # the episode's state (catalogue, index and prices are shared, read-only data): what a fork copies;
    # the "<r>" search's generator included, so a restored game draws what the original would
    _EPISODE_STATE = (
        "goal",
        "_rng",
        "last_score",
        "_instruction",
        "_page",
        "_kind",
        "_keywords",
        "_page_no",
        "_asin",
        "_options",
    )

    def _snapshot_state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._EPISODE_STATE}

    def _restore_state(self, state: dict[str, Any]) -> None:
        for name in self._EPISODE_STATE:
            setattr(self, name, state[name])

    def _reset(self, task_id: int, seed: int) -> Observation:
        self.goal = self.goals[task_id]
        self._rng = random.Random(seed)  # only the "<r>" search draws from it
        self.last_score = None
        self._instruction = self.goal.instruction_text.strip()
        self._start_page()
        return self._observation()

    def _click(self, key: str) -> tuple[float, bool]:
        kind, payload = self._page.clickables[key]
        at = self._kind
        if key == "buy now":
            product = self.catalogue.by_asin[self._asin]
            nouns = self.nouns.__getitem__
            price = self.prices[self._asin]
            self.last_score = task_score(product, self.goal, price, self._options, nouns, self.scorer)
            self._show(render_done(self._asin, self._options, self.last_score.total), "done")
            return self.last_score.total, True
        if key == "back to search":
            self._start_page()
        elif key == "next >" and at == "results":
            self._results(self._keywords, self._page_no + 1)
        elif key == "< prev" and at == "results":
            self._results(self._keywords, self._page_no - 1)
        elif key == "< prev" and at in SUB_PAGES:
            self._item()
        elif key == "< prev" and at == "item":
            self._results(self._keywords, self._page_no)
        elif key in SUB_PAGES:
            self._show(render_sub_page(self.goal.instruction_text, self.catalogue.by_asin[self._asin], key), key)
        else:
            if kind == "product":
                self._asin = payload
            elif kind == "option":
                self._options[payload] = key
            self._item()
        return 0.0, False

    def _observation(self, won: bool = False) -> Observation:
        text = format_page(self._page.text, self._instruction)
        actions = format_available_actions(self._page.available())
        return Observation(text=text, anchor=text, task=self._instruction, admissible_actions=actions, won=won)

    def _step(self, action: str):
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        admissible = is_available(action, self._page.available())
        score, done = 0.0, False
        parsed = parse_action(action)  # as WebAgentTextEnv: no strip, " click[buy now]" does nothing
        if parsed is not None:
            name, arg = parsed
            if name == "search":
                self._results(arg.split(" "), 1)
            elif arg in self._page.clickables and arg != "search":
                score, done = self._click(arg)
        reward, won = score_outcome(score, done, self.reward_mode)
        info = {"won": won, "task_score": float(score), "admissible": admissible}
        return self._observation(won), reward, done, info

    # -- expert ------------------------------------------------------------------------------
    def _wanted_options(self) -> list[str]:
        """The option values the goal asks for that the item page offers, not yet chosen."""
        clickables = self._page.clickables
        if isinstance(self.goal.goal_options, Mapping):
            wanted = [(name, v) for name, v in self.goal.goal_options.items()]
        else:
            wanted = [(clickables.get(v, ("", None))[1], v) for v in self.goal.goal_options]
        return [v for name, v in wanted if clickables.get(v) == ("option", name) and self._options.get(name) != v]

    def oracle_action(self) -> str | None:
        """The expert's next action (see the module docstring); None when done or when searching the
        goal product's title does not find it."""
        if self.goal is None or self._done or self._kind == "done":
            return None
        target = self.goal.asin
        query = search_query(self.catalogue.by_asin[target].title)
        if self._kind == "item" and self._asin == target:
            todo = self._wanted_options()
            return f"click[{todo[0]}]" if todo else "click[buy now]"
        if self._kind in SUB_PAGES and self._asin == target:
            return "click[< prev]"
        if self._kind == "results":
            if target.lower() in self._page.clickables:
                return f"click[{target.lower()}]"
            asins = [p.asin for p in self.hits(self._keywords)]
            if target in asins:
                return (
                    "click[next >]" if asins.index(target) // PRODUCTS_PER_PAGE + 1 > self._page_no else "click[< prev]"
                )
            if self._keywords == query.split(" "):
                return None
        return f"search[{query}]"


def _import_text_env():
    try:
        from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed with: {e})") from e
    return WebAgentTextEnv


# --- the original engine -------------------------------------------------------------------------
class OriginalWebShopEnv(TextEnv):
    """WebShop's own text environment (``web_agent_site``), one session at a time: the option
    ``engine="original"`` (conventions in the module docstring; it has no expert).

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
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        valid = is_available(action, self._available)
        # Every command reaches the engine as written (WebShop's parser never raises on a str).
        page, score, done, _ = self._engine.step(action)
        reward, won = score_outcome(score, done, self.reward_mode)
        # info["admissible"]: the command was among the page's listed actions (is_available).
        info = {"won": won, "task_score": float(score or 0.0), "admissible": valid}
        return self._observation(page, won), reward, bool(done), info

    def oracle_action(self) -> str | None:
        """The original engine has no expert: always None."""
        return None


def make_webshop(engine: str = "native", **options) -> TextEnv:
    """``environments.make("webshop", **options)``: our ``WebShopEnv`` (``engine="native"``, the
    default) or the adapter ``OriginalWebShopEnv`` (``engine="original"``), options as their
    arguments. Raises ValueError for another engine name."""
    if engine == "native":
        return WebShopEnv(**options)
    if engine == "original":
        return OriginalWebShopEnv(**options)
    raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


_INTRO = "You are an expert shopping agent in WebShop, a simulated online store. Your task is to: {task}\n"
TEMPLATE = turn_template(
    _INTRO,
    admissible_block="\nYour admissible actions now are:\n[\n{actions}\n].",
    action_separator=",\n",
)

SPEC = register_game(
    GameSpec(
        name="webshop",
        factory=make_webshop,
        template=TEMPLATE,
        fallback_action="inventory",  # no WebShop action: the page stays as it was
        categories=("task_type",),
    )
)
