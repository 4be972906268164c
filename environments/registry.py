"""The game registry: one ``GameSpec`` per game holds everything the rollout and the trainer know of it.

A game is one module: its ``TextEnv`` subclass (with ``oracle_action`` where it has an expert) and one
``register_game(GameSpec(...))`` call at the bottom. The rollout reads the prompt template and the
fallback action from the spec, the trainer the validation categories; neither compares game names.
Games with heavy dependencies are named with ``register_lazy(name, module)`` and their module is
imported on the first ``game_spec(name)`` / ``make(name)``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from environments.base import TextEnv
from environments.templates import PromptTemplate

__all__ = ["GameSpec", "game_spec", "make", "register_game", "register_lazy", "registered", "unregister"]


@dataclasses.dataclass(frozen=True)
class GameSpec:
    """One registered game.

    Attributes:
      name: the name ``make``, ``EnvPool`` and ``config.env.name`` use (a non-empty str).
      factory: builds one game as ``factory(**options) -> TextEnv`` (``max_steps`` is among the options
        the trainer passes); a module-level callable, so ``EnvPool`` can pickle it into its workers.
      template: the game's default ``PromptTemplate`` (``config.rollout.template`` overrides fields).
      fallback_action: the command sent for an invalid response (``RolloutConfig.invalid_action="fallback"``)
        when ``RolloutConfig.fallback_action`` is unset; a non-empty str.
      categories: ``task_info`` keys that validation splits success by (``val/success_rate/<key>_<value>``,
        ``val/tasks/<key>_<value>``), in this order; tasks without the key are in no category.

    Raises:
      ValueError: naming the ``GameSpec`` field, on a wrong type or an empty name or fallback action.
    """

    name: str
    factory: Callable[..., TextEnv]
    template: PromptTemplate
    fallback_action: str
    categories: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"GameSpec.name must be a non-empty str, got {self.name!r}")
        if not callable(self.factory):
            raise ValueError(f"GameSpec.factory of {self.name!r} must be callable, got {self.factory!r}")
        if not isinstance(self.template, PromptTemplate):
            raise ValueError(
                f"GameSpec.template of {self.name!r} must be a PromptTemplate, got {type(self.template).__name__}"
            )
        if not isinstance(self.fallback_action, str) or not self.fallback_action.strip():
            raise ValueError(
                f"GameSpec.fallback_action of {self.name!r} must be a non-empty str, got {self.fallback_action!r}"
            )
        categories = tuple(self.categories) if isinstance(self.categories, (tuple, list)) else None
        if categories is None or not all(isinstance(k, str) and k for k in categories):
            raise ValueError(
                f"GameSpec.categories of {self.name!r} must be a tuple of task_info keys, got {self.categories!r}"
            )
        object.__setattr__(self, "categories", categories)


_REGISTRY: dict[str, GameSpec] = {}
_LAZY: dict[str, str] = {}


def register_game(spec: GameSpec) -> GameSpec:
    """Registers ``spec`` under ``spec.name`` and returns it; raises ValueError when the name is taken."""
    if not isinstance(spec, GameSpec):
        raise ValueError(f"register_game takes a GameSpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY:
        raise ValueError(f"environment {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Removes a registered game (tests); raises ValueError for an unknown name."""
    if name not in _REGISTRY:
        raise ValueError(f"environment {name!r} is not registered; registered: {sorted(_REGISTRY)}")
    del _REGISTRY[name]


def register_lazy(name: str, module: str) -> None:
    """Names ``name`` as provided by ``module``, imported only on the first ``game_spec(name)``.

    Keeps heavy game dependencies (alfworld, webshop) out of ``import environments``; the module
    must call ``register_game`` for ``name`` when imported.
    """
    _LAZY[name] = module


def game_spec(name: str) -> GameSpec:
    """The ``GameSpec`` of ``name``, importing a lazily registered game's module on first use.

    Raises:
      ValueError: ``name`` is unknown (naming the known games), its lazy module is missing, or that
        module did not register it. An ImportError from the module's own dependencies propagates.
    """
    if name not in _REGISTRY and name in _LAZY:
        try:
            importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as e:
            if e.name != _LAZY[name]:
                raise
            raise ValueError(f"environment {name!r} is not available: module {_LAZY[name]} is missing") from e
        if name not in _REGISTRY:
            raise ValueError(f"module {_LAZY[name]} did not register environment {name!r}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; known: {registered()}")
    return _REGISTRY[name]


def make(name: str, **options) -> TextEnv:
    """One game: ``game_spec(name).factory(**options)``; raises as ``game_spec`` and as the game's factory."""
    return game_spec(name).factory(**options)


def registered() -> list[str]:
    """Names ``game_spec`` and ``make`` accept (eagerly and lazily registered), sorted."""
    return sorted(set(_REGISTRY) | set(_LAZY))
