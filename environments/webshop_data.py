"""WebShop's catalogue and goals, read from WebShop's own data files (no WebShop code needed).

Files (WebShop's ``setup.sh -d small`` downloads them into its ``data/`` folder; the full set is
``-d all``), looked up in ``data_dir``:

* products: ``items_shuffle_1000.json`` (or the one ``items_shuffle*.json`` there): a JSON list
  of scraped product records;
* attributes: ``items_ins_v2_1000.json`` (or the one ``items_ins_v2*.json``): asin -> product
  ``attributes`` and, for some products, a synthetic ``instruction`` + ``instruction_attributes``;
* human goals: ``items_human_ins.json`` (only for ``goals="human"``): asin -> the instructions
  crowd workers wrote for it;
* title nouns: ``title_nouns.json``, a cache this module writes (see ``title_nouns``).

``data_dir`` is the ``data_dir`` option, else ``$WEBSHOP_DATA``; ``"sample"`` names the 10-product
sample shipped in ``environments/data/webshop_sample`` (tests and examples).

Cleaning follows WebShop's loader: records with asin ``nan``, an asin longer than 10 characters
or a repeated asin are skipped; ``pricing`` "$a$b..." keeps the first two numbers (an empty one
means $100.0) and shows as ``$a`` or ``$a to $b`` with Python's float formatting ("$34.00" ->
"$34.0"); option names are lower-cased and option values stripped, lower-cased, with "/" shown as
" | "; a group whose contents are null is dropped; products missing from the attribute file get
the attribute ``DUMMY_ATTR``.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import glob
import itertools
import json
import os
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

DATA_ENV = "WEBSHOP_DATA"
SAMPLE = "sample"
SAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "webshop_sample")
PRODUCTS_FILE, PRODUCTS_GLOB = "items_shuffle_1000.json", "items_shuffle*.json"
ATTRIBUTES_FILE, ATTRIBUTES_GLOB = "items_ins_v2_1000.json", "items_ins_v2*.json"
HUMAN_GOALS_FILE = "items_human_ins.json"
NOUNS_FILE = "title_nouns.json"
GOAL_KINDS = ("synthetic", "human")
#: Price caps a goal may draw (WebShop's $10..$990 grid).
PRICE_GRID = tuple(10.0 * i for i in range(1, 100))
#: price_upper of a goal whose product costs $980 or more (no cap shown in the instruction).
NO_PRICE_CAP = 1000000
DATA_HINT = (
    "WebShop's data files come from its setup script: clone https://github.com/princeton-nlp/WebShop "
    "and run `./setup.sh -d small` (items_shuffle_1000.json, items_ins_v2_1000.json, "
    "items_human_ins.json in its data/ folder), then pass data_dir=<that folder> or set $WEBSHOP_DATA; "
    "data_dir='sample' plays the 10-product sample shipped with this package"
)
#: The spaCy pipeline WebShop tags title nouns with (``spacy.load("en_core_web_sm")`` in its goal.py).
NOUNS_MODEL = "en_core_web_sm"
SPACY_HINT = (
    'title nouns need spaCy\'s small English model once per catalogue: pip install "bipace_jax[webshop-nouns]" '
    "&& python -m spacy download en_core_web_sm (or bring a title_nouns.json cache into the data folder)"
)


@dataclasses.dataclass(frozen=True)
class Product:
    """One cleaned product record (the fields the pages, the search and the reward use).

    Attributes:
      asin: the product id, upper-case as in the data (clicks use it lower-cased).
      title: ``name``; description: ``full_description``; bullet_points: ``small_description``.
      price_tag: the price as pages show it ("$34.0", "$19.99 to $27.99").
      pricing: the one or two prices behind the tag.
      options: option name -> values, in the record's order.
      attributes: the attribute file's ``attributes`` (``("DUMMY_ATTR",)`` when missing).
      query, category, product_category: the scrape's search query (lower-cased), WebShop category
        (beauty, electronics, fashion, food, garden) and the store's "A › B › C" path.
      instruction, instruction_attributes: the synthetic instruction of the attribute file (or None).
      rating: always "N.A." (WebShop never loads ratings).
    """

    asin: str
    title: str
    description: str
    bullet_points: tuple[str, ...]
    price_tag: str
    pricing: tuple[float, ...]
    options: Mapping[str, tuple[str, ...]]
    attributes: tuple[str, ...]
    query: str
    category: str
    product_category: str
    instruction: str | None = None
    instruction_attributes: tuple[str, ...] = ()
    rating: str = "N.A."


@dataclasses.dataclass(frozen=True)
class Goal:
    """A shopping goal: buy ``asin`` with ``goal_options`` for at most ``price_upper``.

    ``goal_options`` is a dict option name -> value for synthetic goals and a tuple of values for
    human goals (the two are scored differently, as in WebShop); ``name`` is the target product's
    title, ``weight`` WebShop's sampling weight (not used here).
    """

    asin: str
    instruction_text: str
    attributes: tuple[str, ...]
    price_upper: float
    goal_options: Mapping[str, str] | tuple[str, ...]
    name: str
    query: str
    category: str
    product_category: str
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class Catalogue:
    """Products of one data folder, in file order, with their files."""

    products: tuple[Product, ...]
    by_asin: Mapping[str, Product]
    data_dir: str
    files: Mapping[str, str]


def resolve_data_dir(data_dir: str | os.PathLike | None) -> str:
    """The data folder: ``data_dir``, else ``$WEBSHOP_DATA``; ``"sample"`` is the shipped sample.

    Raises FileNotFoundError (saying where WebShop's setup gets the files) when neither is set or
    the folder does not exist.
    """
    if data_dir is None:
        data_dir = os.environ.get(DATA_ENV) or None
        if data_dir is None:
            raise FileNotFoundError(f"WebShop needs its data: pass data_dir or set ${DATA_ENV}. {DATA_HINT}")
    data_dir = os.fspath(data_dir)
    if data_dir == SAMPLE:
        return SAMPLE_DIR
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"WebShop data_dir {data_dir!r} is not a folder. {DATA_HINT}")
    return data_dir


def _find(data_dir: str, preferred: str, pattern: str, what: str) -> str:
    """``preferred`` in ``data_dir``, else the single file matching ``pattern``; raises otherwise."""
    path = os.path.join(data_dir, preferred)
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(data_dir, pattern)))
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(
            f"WebShop data_dir {data_dir!r} has no {what} file ({preferred} or {pattern}). {DATA_HINT}"
        )
    names = [os.path.basename(f) for f in found]
    raise ValueError(
        f"WebShop data_dir {data_dir!r} has several {what} files {names}: keep one, or name it {preferred}"
    )


def parse_pricing(pricing: str | None) -> tuple[tuple[float, ...], str]:
    """(prices, tag) of a ``pricing`` string: "$877.80" -> ((877.8,), "$877.8"); "$19.99$27.99" ->
    ((19.99, 27.99), "$19.99 to $27.99"); "" -> ((100.0,), "$100.0") (WebShop's rules).

    Raises ValueError when a "$" piece holds no number.
    """
    if not pricing:
        return (100.0,), "$100.0"
    values = []
    for piece in str(pricing).split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", piece)
        try:
            values.append(float(decimal.Decimal(digits)))
        except decimal.InvalidOperation:
            raise ValueError(f"pricing {pricing!r}: the piece {piece!r} holds no number") from None
    if not values:
        raise ValueError(f"pricing {pricing!r} holds no '$' price")
    if len(values) == 1:
        return (values[0],), f"${values[0]}"
    return (values[0], values[1]), f"${values[0]} to ${values[1]}"


def _options(custom: Any) -> dict[str, tuple[str, ...]]:
    options: dict[str, tuple[str, ...]] = {}
    if not custom:
        return options
    for name, contents in custom.items():
        if contents is None:
            continue
        options[name.lower()] = tuple(c["value"].strip().replace("/", " | ").lower() for c in contents)
    return options


def clean_product(record: Mapping[str, Any], attributes: Mapping[str, Any]) -> Product:
    """A raw product record -> ``Product`` (rules in the module docstring); ``attributes`` is the
    attribute file's dict. Raises KeyError naming a missing record field."""
    asin = record["asin"]
    bullets = record["small_description"]
    pricing, tag = parse_pricing(record.get("pricing"))
    entry = attributes.get(asin) or {}
    attrs = entry["attributes"] if "attributes" in entry else ["DUMMY_ATTR"]
    return Product(
        asin=asin,
        title=record["name"],
        description=record["full_description"],
        bullet_points=tuple(bullets) if isinstance(bullets, list) else (bullets,),
        price_tag=tag,
        pricing=pricing,
        options=_options(record["customization_options"]),
        attributes=tuple(attrs),
        query=record["query"].lower().strip(),
        category=record["category"],
        product_category=record["product_category"],
        instruction=entry.get("instruction"),
        instruction_attributes=tuple(entry.get("instruction_attributes") or ()),
    )


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@functools.lru_cache(maxsize=4)
def load_catalogue(data_dir: str) -> Catalogue:
    """The cleaned products of ``data_dir`` (an existing folder, see ``resolve_data_dir``), cached
    per process (an env pool worker builds it once for all its games).

    Raises FileNotFoundError / ValueError naming the missing or ambiguous file.
    """
    files = {
        "products": _find(data_dir, PRODUCTS_FILE, PRODUCTS_GLOB, "product"),
        "attributes": _find(data_dir, ATTRIBUTES_FILE, ATTRIBUTES_GLOB, "attribute"),
    }
    records = _read_json(files["products"])
    if not isinstance(records, list):
        raise ValueError(f"{files['products']} must hold a JSON list of product records")
    attributes = _read_json(files["attributes"])
    products, seen = [], set()
    for record in records:
        asin = record.get("asin")
        if not isinstance(asin, str) or asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        products.append(clean_product(record, attributes))
    if not products:
        raise ValueError(f"{files['products']} holds no usable product record")
    return Catalogue(tuple(products), {p.asin: p for p in products}, data_dir, files)


def draw_prices(products: Sequence[Product], rng: random.Random) -> dict[str, float]:
    """asin -> the price the reward checks: the one price, or uniform between the two of a range."""
    return {p.asin: p.pricing[0] if len(p.pricing) == 1 else rng.uniform(*p.pricing) for p in products}


def _price_cap(price: float, rng: random.Random) -> tuple[float, str]:
    """(price_upper, instruction suffix): the larger of two of the first four grid prices above ``price``."""
    above = [p for p in PRICE_GRID if p > price][:4]
    if len(above) < 2:
        return NO_PRICE_CAP, ""
    upper = max(rng.sample(above, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def synthetic_goals(products: Sequence[Product], prices: Mapping[str, float], rng: random.Random) -> list[Goal]:
    """One goal per option combination (names sorted) of each product with a synthetic instruction;
    one price cap per product. Raises ValueError for an instruction without attributes."""
    goals: list[Goal] = []
    for p in products:
        if p.instruction is None:
            continue
        if not p.instruction_attributes:
            raise ValueError(f"product {p.asin} has an instruction but no instruction_attributes")
        upper, price_text = _price_cap(prices[p.asin], rng)
        names = sorted(p.options)
        for combo in itertools.product(*(p.options[n] for n in names)):
            chosen = dict(zip(names, combo))
            with_text = ", and ".join(f"{k}: {v}" for k, v in chosen.items())
            goals.append(
                Goal(
                    asin=p.asin,
                    instruction_text=p.instruction + (f" with {with_text}" if with_text else "") + price_text,
                    attributes=p.instruction_attributes,
                    price_upper=upper,
                    goal_options=chosen,
                    name=p.title,
                    query=p.query,
                    category=p.category,
                    product_category=p.product_category,
                )
            )
    counts: dict[str, int] = {}
    for g in goals:
        for a in g.attributes:
            counts[a] = counts.get(a, 0) + 1
    return [
        dataclasses.replace(g, weight=sum(1.0 / counts[a] for a in g.attributes) / len(g.attributes)) for g in goals
    ]


def human_goals(
    products: Sequence[Product], human: Mapping[str, Any], prices: Mapping[str, float], rng: random.Random
) -> list[Goal]:
    """One goal per crowd-written instruction (``human[asin]``) with attributes, in product order;
    one price cap per instruction. Raises KeyError naming a missing instruction field."""
    goals = []
    for p in products:
        for entry in human.get(p.asin, ()):
            attrs = entry["instruction_attributes"]
            if not attrs:
                continue
            upper, price_text = _price_cap(prices[p.asin], rng)
            goals.append(
                Goal(
                    asin=p.asin,
                    instruction_text=entry["instruction"].strip(".") + price_text,
                    attributes=tuple(attrs),
                    price_upper=upper,
                    goal_options=tuple(entry["instruction_options"]),
                    name=p.title,
                    query=p.query,
                    category=p.category,
                    product_category=p.product_category,
                )
            )
    return goals


@functools.lru_cache(maxsize=8)
def build_goals(data_dir: str, kind: str, seed: int) -> tuple[dict[str, float], tuple[Goal, ...]]:
    """(asin -> price, goals in play order) of a catalogue, cached per process.

    verl-agent's order of draws from one ``random.Random(seed)``: the prices of ranged products,
    then the goals' price caps; then the goals are shuffled by a fresh ``random.Random(seed)``.
    Raises ValueError for an unknown ``kind`` and FileNotFoundError without the human goal file.
    """
    if kind not in GOAL_KINDS:
        raise ValueError(f"goals must be one of {GOAL_KINDS}, got {kind!r}")
    catalogue = load_catalogue(data_dir)
    rng = random.Random(seed)
    prices = draw_prices(catalogue.products, rng)
    if kind == "synthetic":
        goals = synthetic_goals(catalogue.products, prices, rng)
    else:
        path = os.path.join(data_dir, HUMAN_GOALS_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"goals='human' needs {HUMAN_GOALS_FILE} in {data_dir!r}. {DATA_HINT}")
        goals = human_goals(catalogue.products, _read_json(path), prices, rng)
    random.Random(seed).shuffle(goals)
    return prices, tuple(goals)


def spacy_title_nouns(titles: Sequence[str], model: str = NOUNS_MODEL) -> dict[str, list[str]]:
    """WebShop's title nouns (``engine/goal.py``'s ``get_type_reward``): ``nlp(title)`` with spaCy's
    ``model`` pipeline, then the lower-cased text of every token tagged NOUN or PROPN (WebShop's list
    also names "PNOUN", which spaCy never gives), in order, duplicates kept. Raises ImportError
    (what to install) without spaCy or the model."""
    try:
        import spacy  # optional: only to fill the noun cache of a new catalogue

        nlp = spacy.load(model)
    except (ImportError, OSError) as e:
        raise ImportError(f"{SPACY_HINT} ({type(e).__name__}: {e})") from e
    return {t: [tok.text.lower() for tok in nlp(t) if tok.pos_ in ("NOUN", "PROPN")] for t in titles}


@functools.lru_cache(maxsize=4)
def title_nouns(data_dir: str) -> dict[str, tuple[str, ...]]:
    """Title -> its nouns (``spacy_title_nouns``) for every product of the catalogue.

    Read from ``title_nouns.json`` in ``data_dir`` (``{"tagger": ..., "nouns": {title: [...]}}``);
    titles it lacks are tagged with spaCy and the cache is rewritten (when the folder is writable).
    Raises ImportError naming what to install when titles are missing and spaCy cannot tag them.
    """
    catalogue = load_catalogue(data_dir)
    path = os.path.join(data_dir, NOUNS_FILE)
    cache = _read_json(path) if os.path.isfile(path) else {"tagger": "spacy en_core_web_sm", "nouns": {}}
    nouns = dict(cache.get("nouns", {}))
    missing = sorted({p.title for p in catalogue.products} - set(nouns))
    if missing:
        try:
            nouns.update(spacy_title_nouns(missing))
        except ImportError as e:
            raise ImportError(f"{len(missing)} product titles of {data_dir!r} are not in {NOUNS_FILE}: {e}") from None
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({**cache, "nouns": nouns}, f, indent=1, sort_keys=True)
        except OSError:
            pass  # a read-only data folder: the nouns stay in this process
    return {t: tuple(v) for t, v in nouns.items()}
