"""TEMPORARY: today's ``sampling.Sampler`` / ``slots.SlotSampler`` behind the engine contract that
``rollout.protocols.EngineLike`` declares, until the ``sampling`` package's ``Engine`` lands.

At the merge this module goes: every ``from bipace_jax.rollout.engine_adapter import ...`` becomes
``from bipace_jax.sampling import ...`` (``Engine``, ``SampleOutput``, ``SampleTiming``: same names,
same constructor ``Engine(tokenizer, config, mesh=None)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from bipace_jax.sampling import Sampler, SamplerConfig
from bipace_jax.slots import SlotSampler

__all__ = ["Engine", "SampleOutput", "SampleTiming"]


@dataclasses.dataclass(frozen=True)
class SampleTiming:
    """Seconds of host wall time of one ``generate`` call: its prefills and its decode loops."""

    prefill_s: float
    decode_s: float


class SampleOutput(NamedTuple):
    """One engine call's rows: tokens int32[B, M] (pad past the length), lengths int32[B], logprobs
    float32[B, M] (0 past the length), fingerprints float32[B, D]; timing None for slot reads."""

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray
    fingerprints: np.ndarray
    timing: SampleTiming | None = None


class _Slots:
    """``SlotHandle`` over a ``SlotSampler`` bound to one actor."""

    def __init__(self, slot_sampler: SlotSampler, actor):
        self._s, self._actor = slot_sampler, actor
        self.num_slots = slot_sampler.rows
        self.counters = slot_sampler.counters

    def empty(self):
        return self._s.empty(self._actor)

    def insert(self, state, prompts: Sequence[Sequence[int]], slot_ids: Sequence[int], row_keys: np.ndarray):
        return self._s.insert(self._actor, state, prompts, slot_ids, row_keys)

    def decode(self, state, wait: bool = True):
        return self._s.decode_chunk(self._actor, state, wait)

    def steps_run(self, steps) -> int:
        return self._s.steps_run(steps)

    def done(self, state) -> np.ndarray:
        return np.array(jax.device_get(state.done), bool)  # a writable host copy

    def read(self, state, slot_ids: Sequence[int]) -> SampleOutput:
        return SampleOutput(*SlotSampler.read(state, slot_ids))


class Engine:
    """The engine contract over today's samplers: ``Engine(tokenizer, config, mesh=None)``.

    ``temperature`` per call: a ``Sampler`` per temperature other than ``config.temperature`` (built on
    first use; the real engine passes it as a traced argument instead).
    """

    def __init__(self, tokenizer, config: SamplerConfig, mesh=None):
        self._samplers = {config.temperature: Sampler(tokenizer, config, mesh=mesh)}
        base = self._samplers[config.temperature]
        self.config, self.tokenizer, self.mesh = config, tokenizer, mesh
        self.pad_id, self.eos_token_ids = base.pad_id, base.eos_token_ids

    def _at(self, temperature: float | None) -> Sampler:
        t = self.config.temperature if temperature is None else float(temperature)
        if t not in self._samplers:
            cfg = dataclasses.replace(self.config, temperature=t)
            self._samplers[t] = Sampler(self.tokenizer, cfg, mesh=self.mesh)
        return self._samplers[t]

    def generate(
        self,
        actor,
        prompts: Sequence[Sequence[int]],
        key,
        *,
        temperature: float | None = None,
        row_keys: np.ndarray | None = None,
        groups: Sequence[int] | None = None,
    ) -> SampleOutput:
        sampler = self._at(temperature)
        out = sampler.generate(actor, prompts, key, row_keys=row_keys, groups=groups)
        t = sampler.last_timing
        return SampleOutput(*out, timing=SampleTiming(float(t["prefill_s"]), float(t["decode_s"])))

    def slots(self, actor, num_slots: int, *, max_prompt: int, chunk: int, temperature: float | None = None) -> _Slots:
        return _Slots(SlotSampler(self._at(temperature), num_slots, max_prompt, chunk), actor)

    # what today's callers of a Sampler read besides the contract (launch.bench_rollout, tests)
    @property
    def sampler(self) -> Sampler:
        """The ``Sampler`` at ``config.temperature``."""
        return self._samplers[self.config.temperature]
