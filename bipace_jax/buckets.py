"""Padding buckets: the one rule for turning a row count or a token length into a compiled shape.

Every jitted program of the project is compiled for a few fixed shapes; a batch of ``n`` rows or a
prompt of ``t`` tokens is padded to the first bucket that holds it. The sampler's batch and prompt
lengths, the learner's prompt widths, the warm start's sequence lengths, ``launch.aot`` and the
step-time model all read this one rule (they used to restate it).

Pure Python, no JAX: a leaf of the import layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Buckets:
    """An increasing tuple of padded sizes (rows or tokens).

    Attributes:
      sizes: strictly increasing positive ints, e.g. ``(8, 16, 32)`` rows or ``(512, 1024, 2048)``
        tokens.
      name: the config field the sizes come from, named in errors (``"sampler.length_buckets"``).

    Raises:
      ValueError: at construction, when ``sizes`` is empty, holds a non-positive entry or is not
        strictly increasing.
    """

    sizes: tuple[int, ...]
    name: str = "buckets"

    def __post_init__(self):
        sizes = tuple(int(s) for s in self.sizes)
        object.__setattr__(self, "sizes", sizes)
        if not sizes:
            raise ValueError(f"{self.name} is empty; expected strictly increasing positive sizes")
        if any(s <= 0 for s in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"{self.name} must be strictly increasing positive sizes, got {sizes}")

    @classmethod
    def of(cls, sizes: Sequence[int], name: str = "buckets") -> Buckets:
        return cls(tuple(sizes), name)

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def fit(self, n: int, multiple: int = 1) -> int:
        """The first size >= ``n``, else the largest (more rows are served in chunks of it), rounded up
        to a multiple of ``multiple`` (the mesh's row shards).

        Args:
          n: rows (or tokens) to hold, >= 0.
          multiple: the result is a multiple of this (>= 1).
        """
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        b = next((s for s in self.sizes if s >= n), self.sizes[-1])
        return -(-b // multiple) * multiple

    def fit_or_raise(self, n: int, multiple: int = 1) -> int:
        """Like ``fit`` but for sizes that cannot be chunked (a prompt's tokens).

        Raises:
          ValueError: ``n`` exceeds the largest size; the message names ``self.name``.
        """
        if n > self.sizes[-1]:
            raise ValueError(f"{n} exceeds the largest {self.name} entry {self.sizes[-1]}; raise {self.name}")
        return self.fit(n, multiple)

    def fit_within(self, n: int, cap: int) -> int:
        """The first size that holds ``max(n, 1)``, capped at ``cap``; ``cap`` when none holds it (the
        learner's prompt width: never wider than the widest prompt column it was given)."""
        fit = [s for s in self.sizes if max(n, 1) <= s]
        return min(fit[0], cap) if fit else cap
