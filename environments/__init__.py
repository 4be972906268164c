"""Host-side text games and the environment pool. Game modules register themselves on import."""

from environments.base import Observation, TextEnv, make, register, registered

__all__ = ["Observation", "TextEnv", "make", "register", "registered"]
