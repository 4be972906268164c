"""Public descriptions of the library's compiled programs, for the code that runs them and for ``launch.aot``.

A ``ProgramSpec`` is one jitted program together with abstract arguments (``jax.ShapeDtypeStruct``
carrying the ``NamedSharding`` the library places each argument on) for one set of sizes, and which
arguments are static or donated. The sampling engine (``sampling.programs``: ``prefill_spec``,
``insert_spec``, ``decode_spec``; ``sampling.abstract_programs`` for ``launch.aot``) and the
learners (``learner.step_specs``, ``ppo.logprobs_spec``) build their specs with these functions and
call ``spec(*args)``, and ``launch.aot`` lowers the same specs with ``spec.lower()``: what is compiled
ahead of time is what runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["ProgramSpec", "abstract"]


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """One jitted program and its call signature at one set of sizes.

    Attributes:
      name: the program's name (``"ppo_grad"``, ``"ppo_apply"``, ``"logprobs"``, ``"prefill"``, ``"decode"``,
        ``"insert"``, ``"decode_chunk"``).
      fn: the ``jax.jit``-wrapped program; it takes every argument by position and reads the
        placement of each array argument from the argument itself.
      args: the positional arguments as ``jax.ShapeDtypeStruct`` pytrees with their shardings (the
        ones the library gives them); static arguments are the values themselves.
      static_argnums: positions of the static (hashable, compile-time) arguments.
      donate_argnums: positions of the arguments whose buffers the program reuses for its outputs
        (the caller must not read them after the call).
    """

    name: str
    fn: Callable[..., Any]
    args: tuple
    static_argnums: tuple[int, ...] = ()
    donate_argnums: tuple[int, ...] = ()

    @property
    def in_shardings(self) -> tuple:
        """Per positional argument: a pytree of its arrays' shardings (None for a static argument or
        an array without one)."""
        return tuple(
            None if i in self.static_argnums else jax.tree.map(lambda x: getattr(x, "sharding", None), a)
            for i, a in enumerate(self.args)
        )

    def __call__(self, *args):
        """Runs the program on concrete arguments of the same structure (any sizes).

        Raises:
          TypeError: not ``len(self.args)`` positional arguments.
        """
        if len(args) != len(self.args):
            raise TypeError(f"program {self.name!r} takes {len(self.args)} positional arguments, got {len(args)}")
        return self.fn(*args)

    def lower(self) -> jax.stages.Lowered:
        """``fn.lower(*args)``: the program at these sizes and shardings, ready for ``.compile()``."""
        return self.fn.lower(*self.args)


def abstract(tree: Any, shardings: Any = None) -> Any:
    """``tree`` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs with ``shardings``.

    ``shardings``: a pytree of shardings matching ``tree``, one sharding for every leaf, or None to
    keep each leaf's own (``x.sharding``; none for a NumPy array).
    """

    def one(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    if shardings is None:
        return jax.tree.map(lambda x: one(x, getattr(x, "sharding", None)), tree)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)
