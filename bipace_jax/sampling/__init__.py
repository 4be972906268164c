"""The sampling engine: one ``Engine`` per run, three compiled programs over one ``DecodeState``.

Modules: ``config`` (``SamplerConfig``), ``outputs`` (``SampleOutput``, ``SampleTiming``), ``filters`` (top-k / top-p filtering and the draw, pure),
``stop_strings`` (the stop-string automaton), ``heads`` (shared prompt heads: the host-side plan),
``state`` (the typed pytrees), ``programs`` (prefill, insert, decode and their ``ProgramSpec``s),
``engine`` (``Engine.generate`` lockstep, ``Engine.slots`` continuous, ``abstract_programs`` for
``launch.aot``).
"""

from bipace_jax.sampling.config import SamplerConfig
from bipace_jax.sampling.engine import Engine, SlotHandle, abstract_programs
from bipace_jax.sampling.filters import filter_logits, first_argmax, sample_tokens
from bipace_jax.sampling.outputs import SampleOutput, SampleTiming
from bipace_jax.sampling.state import DecodeConsts, DecodeState, PromptBatch, StaticSettings, batch_axes, key_data
from bipace_jax.sampling.stop_strings import stop_string_table, token_byte_texts, truncate_at_stop

__all__ = [
    "DecodeConsts",
    "DecodeState",
    "Engine",
    "PromptBatch",
    "SampleOutput",
    "SampleTiming",
    "SamplerConfig",
    "SlotHandle",
    "StaticSettings",
    "abstract_programs",
    "batch_axes",
    "filter_logits",
    "first_argmax",
    "key_data",
    "sample_tokens",
    "stop_string_table",
    "token_byte_texts",
    "truncate_at_stop",
]
