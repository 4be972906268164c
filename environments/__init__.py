"""Host-side text games and the environment pool.

Each game is one module that registers its ``GameSpec`` (``environments.registry``: factory, prompt
template, fallback action, validation categories). Importing the package registers the games: TextCraft eagerly (pure Python, offline), ALFWorld and
WebShop lazily (their modules and heavy dependencies load on the first ``make("alfworld")`` /
``make("webshop")``).

WebShop is our own engine (``webshop.py``: pages, actions, options; ``webshop_data.py``: WebShop's
data files and goals; ``webshop_search.py``: Lucene-style BM25; ``webshop_reward.py``: the task
score) on WebShop's files, found through the ``data_dir`` option or ``$WEBSHOP_DATA`` (WebShop's
``./setup.sh -d small`` downloads them; ``data_dir="sample"`` is the shipped 10-product sample);
``make("webshop", engine="original")`` wraps WebShop's own ``web_agent_site`` instead.
"""

from environments import textcraft  # noqa: F401  (registers "textcraft")
from environments.base import Observation, TextEnv
from environments.registry import GameSpec, game_spec, make, register_game, register_lazy, registered

register_lazy("alfworld", "environments.alfworld")
register_lazy("webshop", "environments.webshop")

__all__ = ["GameSpec", "Observation", "TextEnv", "game_spec", "make", "register_game", "register_lazy", "registered"]
