"""bipace_jax: a JAX/Flax library and trainer for RL of LLM agents on multi-turn text games."""

__version__ = "0.1.0"
