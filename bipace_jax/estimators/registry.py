"""The estimator registry: every name-based choice in the package derives from it.

An estimator is a `base.EstimatorSpec` (re-exported here). `compute_advantages`, the NumPy oracle,
`EstimatorConfig`'s name check and the run-config validation all ask this module, so a built-in
estimator is one module defining `SPEC` plus its entry in `BUILTINS`, and outside the package one
`register(spec)` call does the same. Contract: `docs/estimators.md`, "Registry".

    from bipace_jax.estimators import registry
    registry.names()            # ("grpo", "gigpo", "bigpo", "bipace_q", "bipace_diff", "hgpo")
    registry.get("bipace_q")    # EstimatorSpec(name="bipace_q", grouping="cluster", ...)
"""

from __future__ import annotations

from bipace_jax.estimators import bigpo, bipace_diff, bipace_q, gigpo, grpo, hgpo
from bipace_jax.estimators.base import (
    CLUSTER,
    GROUPINGS,
    NO_GROUPS,
    OBS_HASH,
    EstimatorSpec,
    StepInputs,
    StepOutput,
)

__all__ = [
    "BUILTINS",
    "CLUSTER",
    "GROUPINGS",
    "NO_GROUPS",
    "OBS_HASH",
    "EstimatorSpec",
    "StepInputs",
    "StepOutput",
    "get",
    "names",
    "register",
    "unregister",
]

BUILTINS = (grpo.SPEC, gigpo.SPEC, bigpo.SPEC, bipace_q.SPEC, bipace_diff.SPEC, hgpo.SPEC)
"""The built-in estimators, registered at import in this order."""

_SPECS: dict[str, EstimatorSpec] = {}


def register(spec: EstimatorSpec) -> EstimatorSpec:
    """Adds `spec`; returns it.

    Raises:
      TypeError: when `spec` is not an EstimatorSpec.
      ValueError: when its name is already registered.
    """
    if not isinstance(spec, EstimatorSpec):
        raise TypeError(f"registry.register: expected an EstimatorSpec, got {type(spec).__name__}")
    if spec.name in _SPECS:
        raise ValueError(
            f"registry.register: an estimator named {spec.name!r} is already registered "
            f"(registered: {', '.join(_SPECS)})"
        )
    _SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> EstimatorSpec:
    """Removes a registered estimator (for tests and plug-ins); returns its spec.

    Raises: ValueError when `name` is not registered.
    """
    spec = get(name)
    del _SPECS[name]
    return spec


def get(name: str) -> EstimatorSpec:
    """The spec registered under `name`.

    Raises: ValueError naming the registered estimators when `name` is not one of them.
    """
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown estimator {name!r}; registered: {', '.join(_SPECS)}") from None


def names() -> tuple[str, ...]:
    """Registered estimator names, built-ins first, then in order of registration."""
    return tuple(_SPECS)


for _spec in BUILTINS:
    register(_spec)
