"""Run configs (ml_collections): ``base.py`` documents every field; one file per setting."""

from configs.validation import ConfigError, mesh_shape, resolve_path, validate, validate_selector

__all__ = ["ConfigError", "mesh_shape", "resolve_path", "validate", "validate_selector"]
