"""Host-side text games and the environment pool.

Importing the package registers the games: TextCraft eagerly (pure Python, offline), ALFWorld and
WebShop lazily (their modules and heavy dependencies load on the first ``make("alfworld")`` /
``make("webshop")``).
"""

from environments import textcraft  # noqa: F401  (registers "textcraft")
from environments.base import Observation, TextEnv, make, register, register_lazy, registered

register_lazy("alfworld", "environments.alfworld")
register_lazy("webshop", "environments.webshop")

__all__ = ["Observation", "TextEnv", "make", "register", "register_lazy", "registered"]
