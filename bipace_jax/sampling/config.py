"""``SamplerConfig``: how responses are sampled (one per run; the temperature is also a per-call argument)."""

from __future__ import annotations

import dataclasses
import math

__all__ = ["SamplerConfig"]


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How responses are sampled.

    Attributes:
      max_new_tokens: M, the most tokens generated per response (EOS and stop text included).
      temperature: the default softmax temperature (> 0) used when ``greedy`` is False; ``Engine.generate`` /
        ``Engine.slots`` take another per call (a traced argument: no recompile per value).
      top_p: nucleus mass in (0, 1]; 1.0 disables the filter.
      top_k: keep the k most likely tokens; 0 disables the filter.
      greedy: take the argmax (ties: lowest token id); temperature, top-k, top-p are then ignored.
      stop_strings: texts that end a response right after the token that completes them.
      batch_buckets: allowed padded batch sizes, ascending. A call with more prompts than the largest
        bucket is served in chunks of the largest bucket.
      length_buckets: allowed padded prompt lengths T, ascending. A prompt longer than the largest
        bucket is an error.
      eos_token_ids: token ids that end a response (the EOS token is kept in the response); ``None``
        takes the tokenizer's ``eos_token_id`` plus ``<|im_end|>`` and ``<|endoftext|>`` when the
        tokenizer has them.
      shared_head_tokens: 0 (off) or the shortest prompt head that rows of one group (``generate(...,
        groups=...)``: the rollout's task groups) prefill once and share (``sampling.heads``); the
        tokens equal the plain prefill's up to float summation order. Not with a batch-sharded mesh.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_strings: tuple[str, ...] = ("</action>",)
    batch_buckets: tuple[int, ...] = (8, 16, 32, 64, 128)
    length_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    eos_token_ids: tuple[int, ...] | None = None
    shared_head_tokens: int = 0

    def __post_init__(self):
        # Accept lists from ml_collections configs; store tuples so the config stays hashable.
        for name in ("stop_strings", "batch_buckets", "length_buckets", "eos_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        for name, lo in (("max_new_tokens", 1), ("top_k", 0), ("shared_head_tokens", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, int) and v >= lo):
                raise ValueError(f"SamplerConfig.{name} must be an int >= {lo}, got {v!r}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"SamplerConfig.temperature must be finite and > 0 (use greedy=True for argmax), "
                f"got {self.temperature!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplerConfig.top_p must lie in (0, 1], got {self.top_p!r}")
        for name in ("batch_buckets", "length_buckets"):
            b = getattr(self, name)
            if not b or any((not isinstance(x, int)) or x < 1 for x in b) or list(b) != sorted(set(b)):
                raise ValueError(
                    f"SamplerConfig.{name} must be a non-empty strictly ascending tuple of ints >= 1, got {b!r}"
                )
        if any((not isinstance(s, str)) or not s for s in self.stop_strings):
            raise ValueError(f"SamplerConfig.stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.eos_token_ids is not None and any((not isinstance(t, int)) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"SamplerConfig.eos_token_ids must be ints >= 0, got {self.eos_token_ids!r}")
