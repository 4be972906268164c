"""Host-side statistics: per-host records that pool over hosts, stage wall times, binomial intervals.

``HostStats`` keeps each rate as its numerator and denominator so a multi-host run pools it exactly
(``distributed.pooled``); ``StageTimer`` times the trainer's named stages; ``wilson`` and
``panel_games`` give a validation rate's interval and the games behind it; ``panel_metrics`` turns a
panel's per-task arrays into its record. A leaf: imports nothing from the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class HostStats:
    """One host's statistics in the form that pools over hosts (``distributed.pooled``).

    A rate is kept as its (numerator, denominator) sums, so the run's rate is the summed numerator
    over the summed denominator (a mean of per-host rates would weight a host with 2 rows like one
    with 200). All values are float (float64 once pooled); keys are full metric keys or bare names
    (``prefixed`` adds a section).

    Attributes:
      counts: name -> this host's count (an int stays an int in ``values()``); pooled: the float sum over hosts.
      rates: name -> (numerator, denominator) of this host; pooled: sum(num) / sum(den), 0.0 when the
        summed denominator is 0 (no row, no game: the project's convention for an empty rate).
      maxima: name -> this host's value; pooled: the max over hosts.

    Raises:
      ValueError: a name in two of the three maps, or a negative denominator.
    """

    counts: dict[str, float | int] = dataclasses.field(default_factory=dict)
    rates: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    maxima: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        shared = (self.counts.keys() & self.rates.keys()) | (
            self.maxima.keys() & (self.counts.keys() | self.rates.keys())
        )
        if shared:
            raise ValueError(f"HostStats: names in more than one of counts/rates/maxima: {sorted(shared)}")
        bad = sorted(k for k, (_, den) in self.rates.items() if not den >= 0)
        if bad:
            raise ValueError(f"HostStats: rates {bad} need a denominator >= 0, got {[self.rates[k][1] for k in bad]}")

    def keys(self) -> list[str]:
        """Every name, sorted (the order ``distributed.pooled`` gathers them in)."""
        return sorted([*self.counts, *self.rates, *self.maxima])

    def values(self) -> dict[str, float]:
        """The statistics as metric values (this host's alone: the run's with one process)."""
        out = {k: v if isinstance(v, int) else float(v) for k, v in self.counts.items()}  # an int count stays one
        out.update({k: float(num) / float(den) if den > 0 else 0.0 for k, (num, den) in self.rates.items()})
        out.update({k: float(v) for k, v in self.maxima.items()})
        return out

    def prefixed(self, prefix: str) -> HostStats:
        """The same statistics with ``prefix`` before every name (``"rollout/"``)."""
        return HostStats(
            {prefix + k: v for k, v in self.counts.items()},
            {prefix + k: v for k, v in self.rates.items()},
            {prefix + k: v for k, v in self.maxima.items()},
        )

    def vector(self) -> np.ndarray:
        """float64 ``[1 + len(counts) + 2 * len(rates) + len(maxima)]``: a checksum of the names (equal
        records hold equal names), then the counts, each rate's (numerator, denominator) and the maxima,
        each in sorted name order; ``like`` reads it back."""
        c, r, m = sorted(self.counts), sorted(self.rates), sorted(self.maxima)
        crc = zlib.crc32("\0".join(["c", *c, "r", *r, "m", *m]).encode())
        values = [*(self.counts[k] for k in c), *(x for k in r for x in self.rates[k]), *(self.maxima[k] for k in m)]
        return np.array([crc, *values], np.float64)

    def like(self, vector: np.ndarray) -> HostStats:
        """The record of another host from its ``vector()``, with this record's names.

        Raises:
          ValueError: the vector's checksum or length is not this record's (the hosts hold other names).
        """
        mine = self.vector()
        vector = np.asarray(vector, np.float64)
        if vector.shape != mine.shape or vector[0] != mine[0]:
            raise ValueError(
                f"HostStats: another host holds other names than {self.keys()} (every host must report the same "
                "statistics)"
            )
        c, r, m = sorted(self.counts), sorted(self.rates), sorted(self.maxima)
        v = vector[1:].tolist()
        nums = v[len(c) : len(c) + 2 * len(r)]
        return HostStats(
            dict(zip(c, v[: len(c)])),
            {k: (nums[2 * i], nums[2 * i + 1]) for i, k in enumerate(r)},
            dict(zip(m, v[len(c) + 2 * len(r) :])),
        )

    @staticmethod
    def pool(records: Sequence[HostStats]) -> HostStats:
        """Every host's record as the run's: counts summed, each rate's numerator and denominator
        summed, maxima the max.

        Raises:
          ValueError: no record, or records with other names.
        """
        if not records:
            raise ValueError("HostStats.pool: expected at least one record, got none")
        first = records[0]
        if any(r.keys() != first.keys() or set(r.rates) != set(first.rates) for r in records):
            raise ValueError(f"HostStats.pool: the records hold other names than {first.keys()}")
        return HostStats(
            {k: sum(float(r.counts[k]) for r in records) for k in first.counts},
            {
                k: (sum(float(r.rates[k][0]) for r in records), sum(float(r.rates[k][1]) for r in records))
                for k in first.rates
            },
            {k: max(float(r.maxima[k]) for r in records) for k in first.maxima},
        )

    def __or__(self, other: HostStats) -> HostStats:
        """Both records in one (names must not repeat: ValueError)."""
        repeated = set(self.keys()) & set(other.keys())
        if repeated:
            raise ValueError(f"HostStats: both records hold {sorted(repeated)}")
        return HostStats(
            {**self.counts, **other.counts}, {**self.rates, **other.rates}, {**self.maxima, **other.maxima}
        )


class StageTimer:
    """Wall seconds of named stages: ``with timer.stage("rollout"): ...``; a stage entered again adds up.

    ``seconds``: stage name -> seconds, in first-entered order; ``total()``: their sum.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def total(self) -> float:
        return sum(self.seconds.values())


def panel_metrics(
    name: str, won: np.ndarray, length: np.ndarray, errors: np.ndarray, score: np.ndarray
) -> dict[str, float]:
    """A validation panel's record from its per-task float arrays ``[num_tasks]`` (NaN: every game of
    the task faulted, left out of the means): ``<name>/success_rate``, ``/episode_length`` (means over
    tasks, NaN when all are NaN), ``/tasks``, ``/env_errors`` (faulted games, summed) and ``/score``
    (only when some task has one, e.g. WebShop's)."""

    def mean(a):
        return float(np.nanmean(a)) if not np.isnan(a).all() else float("nan")

    out = {f"{name}/score": mean(score)} if not np.isnan(score).all() else {}
    out[f"{name}/success_rate"] = mean(won)
    out[f"{name}/episode_length"] = mean(length)
    out[f"{name}/tasks"] = len(won)
    out[f"{name}/env_errors"] = int(errors.sum())
    return out


def wilson(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (default 95%) of a binomial proportion ``successes / n``.

    ``successes`` may be fractional (a panel's rate x games). Returns ``(low, high)`` in [0, 1].

    Raises:
      ValueError: ``n <= 0`` or ``successes`` outside ``[0, n]``.
    """
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson: expected 0 <= successes <= n and n > 0, got {successes} of {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def panel_games(record: dict[str, Any], prefix: str, group_size: int, category: str | None = None) -> int:
    """Games behind a validation rate: ``tasks x group_size`` minus faulted games (``env_errors``,
    panel-wide only). ``prefix``: ``"val"``, ``"val/holdout"`` or a ``val_before`` copy; ``category``:
    ``"<key>_<value>"`` for a per-category rate (its ``tasks/<category>``). 0 when the record lacks it."""
    tasks = record.get(f"{prefix}/tasks" + (f"/{category}" if category else ""))
    if tasks is None:
        return 0
    errors = 0 if category else int(record.get(f"{prefix}/env_errors") or 0)
    return max(int(tasks) * int(group_size) - errors, 0)
