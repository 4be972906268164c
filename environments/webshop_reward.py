"""WebShop's task score of a purchase (its ``get_reward``), reimplemented.

``score = (attribute matches + option matches + [price <= price_upper]) /
(len(goal attributes) + len(goal options) + 1) * r_type``

* Attribute match (per goal attribute): some product attribute has ``token_set_ratio > 85``, or the
  goal attribute is a substring of the lower-cased title, of the lower-cased bullet points joined
  by spaces, or of the lower-cased description.
* Option match (per goal option): after ``normalize_color`` of both sides, some chosen option
  value has ``token_set_ratio > 85``. Under the default scorer ``OptionScorer.VERL_AGENT`` (the
  revision of WebShop's ``goal.py`` that verl-agent vendors, GiGPO's code base: parity with the
  baseline) a synthetic goal's options are (name, value) pairs (``dict.items()``), so the name is
  part of the compared text and ``normalize_color`` of a pair changes nothing: a clicked
  "antique graywash" becomes "ash" while the goal's ("color", "antique graywash") does not, and
  the expert's purchase scores 0.8 (1 of the sample's 55 goals; 6.8% of the full data's
  option-bearing goals cannot reach 1). ``OptionScorer.UPSTREAM`` takes the later upstream
  revision's rule: the goal's option values (``dict.values()``), normalised like the clicked ones.
  Only that rule is taken; the later revision's other changes (exact matching for some option
  names, clicked values found in the title or bullet points) are not reproduced.
* ``r_type`` starts at 1; 0.5 when neither the search query, nor two or more "›" category levels,
  nor a title-noun score above 0.2 match; 0.1 when the title-noun score is below 0.1; 0 when it
  is 0. Title-noun score: distinct shared nouns / number of the goal title's nouns (0.2 when the
  goal title has none).
* ``token_set_ratio`` is thefuzz's (0.19): text forced to ASCII by dropping characters 128-255,
  non-word characters to spaces, lower case, then rapidfuzz's token-set ratio (the Indel ratio
  python-Levenshtein gives thefuzz) rounded to an integer.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from environments.webshop_data import Goal, Product

try:  # the webshop extra
    from rapidfuzz import fuzz
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    fuzz = None
    _IMPORT_ERROR: ImportError | None = _e
else:
    _IMPORT_ERROR = None

MATCH_THRESHOLD = 85


class OptionScorer(enum.StrEnum):
    """Which revision of WebShop's option rule scores a purchase (see the module docstring)."""

    VERL_AGENT = "verl_agent"  # goal options as (name, value) pairs: the baseline's scorer, the default
    UPSTREAM = "upstream"  # goal option values, colour-normalised like the clicked ones


#: WebShop's colour words (engine/normalize.py), in its order: the first one contained in an option wins.
COLOR_SET = (
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown burgundy "
    "camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac copper coral "
    "cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold granite grape graphite grass "
    "gray green grey heather indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon "
    "mauve merlot midnight mint mocha multicolor mushroom mustard natural navy nude olive orange peach pewter "
    "pink plum purple rainbow red rose royal rust sand sapphire seashell silver skull slate steel stone "
    "stonewash sunflower tan taupe teal tiger turquoise violet walnut wheat white wine yellow"
).split()
_LATIN1 = {c: None for c in range(128, 256)}
_NON_WORD = re.compile(r"(?u)\W")


def normalize_color(value: Any) -> Any:
    """The first colour word contained in ``value`` (substring of a str, element of a tuple), else ``value``."""
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def _process(value: Any) -> str:
    return _NON_WORD.sub(" ", str(value).translate(_LATIN1)).lower().strip()


def token_set_ratio(a: Any, b: Any) -> int:
    """thefuzz 0.19's ``fuzz.token_set_ratio(a, b)`` (0-100; non-strings compared as ``str(x)``).

    Raises ImportError naming the extra when rapidfuzz is missing.
    """
    if _IMPORT_ERROR is not None:
        raise ImportError(f'WebShop\'s reward needs rapidfuzz: pip install "bipace_jax[webshop]" ({_IMPORT_ERROR})')
    pa, pb = _process(a), _process(b)
    if not pa or not pb:
        return 0
    return int(round(fuzz.token_set_ratio(pa, pb, processor=None)))


@dataclasses.dataclass(frozen=True)
class Score:
    """A purchase's task score and its parts (``r_option`` None without goal options)."""

    total: float
    r_type: float
    query_match: bool
    category_match: bool
    title_score: float
    attribute_matches: int
    option_matches: int
    r_price: bool
    r_option: float | None


def type_reward(product: Product, goal: Goal, nouns: Callable[[str], Sequence[str]]) -> tuple[float, bool, bool, float]:
    """(r_type, query_match, category_match, title_score); ``nouns(title)`` gives a title's nouns."""
    query_match = product.query == goal.query
    levels = {x.strip() for x in product.product_category.split("›")}
    category_match = len(levels & {x.strip() for x in goal.product_category.split("›")}) >= 2
    bought, wanted = nouns(product.title), nouns(goal.name)
    title_score = len(set(bought) & set(wanted)) / len(wanted) if wanted else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def attribute_matches(product: Product, goal: Goal) -> int:
    """How many goal attributes the product has (fuzzy attribute match or a substring of its text)."""
    texts = (product.title.lower(), " ".join(product.bullet_points).lower(), product.description.lower())
    n = 0
    for wanted in goal.attributes:
        if any(token_set_ratio(have, wanted) > MATCH_THRESHOLD for have in product.attributes):
            n += 1
        elif any(wanted in t for t in texts):
            n += 1
    return n


def goal_option_items(goal: Goal, scorer: OptionScorer = OptionScorer.VERL_AGENT) -> list[Any]:
    """The goal options as WebShop scores them: for a synthetic goal's dict, (name, value) pairs
    under ``VERL_AGENT``, the values under ``UPSTREAM``; a list of values as it is."""
    opts = goal.goal_options
    if isinstance(opts, Mapping):
        return list(opts.values()) if scorer is OptionScorer.UPSTREAM else list(opts.items())
    return list(opts)


def option_matches(chosen: Sequence[str], goal: Goal, scorer: OptionScorer = OptionScorer.VERL_AGENT) -> int:
    """How many goal options some chosen option value matches (after colour normalisation)."""
    have = [normalize_color(o) for o in chosen]
    n = 0
    for wanted in (normalize_color(o) for o in goal_option_items(goal, OptionScorer(scorer))):
        if any(token_set_ratio(h, wanted) > MATCH_THRESHOLD for h in have):
            n += 1
    return n


def task_score(
    product: Product,
    goal: Goal,
    price: float,
    options: Mapping[str, str],
    nouns: Callable[[str], Sequence[str]],
    scorer: OptionScorer = OptionScorer.VERL_AGENT,
) -> Score:
    """WebShop's score of buying ``product`` at ``price`` with ``options`` (name -> value, in the
    order chosen) for ``goal``; ``nouns(title)`` gives a title's nouns (``webshop_data.title_nouns``);
    ``scorer`` the option rule's revision.

    Raises KeyError when ``nouns`` lacks a title, ValueError for a ``scorer`` that is no ``OptionScorer``.
    """
    r_type, query_match, category_match, title_score = type_reward(product, goal, nouns)
    n_attr = attribute_matches(product, goal)
    n_opt = option_matches(list(options.values()), goal, OptionScorer(scorer))
    n_goal_opts = len(goal.goal_options)
    r_price = price <= goal.price_upper
    total = (n_attr + n_opt + r_price) / (len(goal.attributes) + n_goal_opts + 1) * r_type
    return Score(
        total=total,
        r_type=r_type,
        query_match=query_match,
        category_match=category_match,
        title_score=title_score,
        attribute_matches=n_attr,
        option_matches=n_opt,
        r_price=bool(r_price),
        r_option=n_opt / n_goal_opts if n_goal_opts else None,
    )
