"""What a sampler call returns: ``SampleOutput`` (host arrays, one row per prompt) and its ``SampleTiming``."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

__all__ = ["SampleOutput", "SampleTiming"]


@dataclasses.dataclass(frozen=True)
class SampleTiming:
    """Host wall time and token counts of one ``Engine.generate`` call.

    Attributes:
      prefill_s: seconds from the prefill's dispatch until its first tokens are ready.
      decode_s: seconds of the decode loop and the copy of the results to the host.
      prompt_tokens: real prompt tokens of the call.
      prefill_tokens: real tokens prefilled (below ``prompt_tokens`` when prompt heads are shared).
      new_tokens: response tokens drawn (the sum of the lengths).
    """

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    new_tokens: int = 0

    def __add__(self, other: SampleTiming) -> SampleTiming:
        return SampleTiming(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


class SampleOutput(NamedTuple):
    """One call's results, as NumPy arrays, one row per prompt (in order).

    Attributes:
      tokens: int32[B, M] response token ids; positions ``>= lengths[b]`` hold the pad id.
      lengths: int32[B] response lengths in tokens (1..M), EOS and stop-text tokens included.
      logprobs: float32[B, M] log-probability of each response token under the policy at the sampling
        temperature, before top-k/top-p truncation: ``log_softmax(logits / temperature)[token]``
        (temperature 1 when greedy); 0 past ``lengths``.
      fingerprints: float32[B, D] the actor's prompt fingerprints from the prefill (hidden state at the
        last prompt token, L2-normalised; docs/estimators.md).
      timing: ``SampleTiming`` of a ``generate`` call; None for rows read from slots.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray
    fingerprints: np.ndarray
    timing: SampleTiming | None = None
