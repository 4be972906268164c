"""Run configs (ml_collections): ``base.py`` documents every field; one file per setting.

The checks live with the library (``bipace_jax.config``, and ``bipace_jax.build`` which decodes a
config into a ``RunSpec``); they are re-exported here for callers that hold a config.
"""

from bipace_jax.build import build_spec, validate
from bipace_jax.config import (
    ConfigError,
    check_tensor_in_host,
    enable_compile_cache,
    mesh_shape,
    resolve_path,
    validate_selector,
)

__all__ = [
    "ConfigError",
    "build_spec",
    "check_tensor_in_host",
    "enable_compile_cache",
    "mesh_shape",
    "resolve_path",
    "validate",
    "validate_selector",
]
