"""The sampler's typed pytrees: what the three programs take and return, and their placement on a mesh.

* ``StaticSettings``: the hashable compile-time settings (one per engine and vocabulary).
* ``DecodeConsts``: the stop-string table and EOS ids, device constants of every program.
* ``PromptBatch`` (with an optional ``HeadBatch`` of shared prompt heads): a prefill's input.
* ``DecodeState``: every row's decode over its KV cache. The lockstep prefill returns one (all rows
  inserted at once, the cache's write index shared); the slot state of the continuous scheduler is
  one (a write index per row, rows inserted and read one by one). ``programs.decode`` advances both.

Shape letters: B rows, T prompt tokens, M new tokens, V vocabulary, D hidden width, S stop strings,
Q stop-string states, E EOS ids, H head rows, Th head tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from bipace_jax import sharding
from bipace_jax.models.kv_cache import cache_shardings
from bipace_jax.models.layers import ACTIVATION_AXES

__all__ = [
    "DecodeConsts",
    "DecodeState",
    "HeadBatch",
    "PromptBatch",
    "StaticSettings",
    "batch_axes",
    "key_data",
    "pin",
    "state_shardings",
]


class StaticSettings(NamedTuple):
    """Hashable compile-time settings of the sampler programs (the temperature is traced, not here)."""

    greedy: bool
    top_k: int
    top_p: float
    max_new_tokens: int  # M, the columns of ``DecodeState.tokens``
    pad_id: int
    support: int  # ids below it can be drawn: the tokenizer's size (<= the logits' width V)

    @classmethod
    def of(cls, config, pad_id: int, support: int) -> StaticSettings:
        """The settings of a ``SamplerConfig``."""
        return cls(
            greedy=config.greedy,
            top_k=config.top_k,
            top_p=float(config.top_p),
            max_new_tokens=config.max_new_tokens,
            pad_id=pad_id,
            support=support,
        )

    def draw_options(self) -> dict:
        """The keyword options of ``filters.sample_tokens``."""
        return dict(greedy=self.greedy, top_k=self.top_k, top_p=self.top_p, support=self.support)


@flax.struct.dataclass
class DecodeConsts:
    """Device constants of every sampler program (replicated under a mesh).

    Attributes:
      table: int32[S, Q, V] the stop-string automaton over whole tokens (``stop_strings.stop_string_table``
        fitted to the model's vocabulary V).
      stop_lens: int32[S] each stop string's length in UTF-8 bytes.
      eos_ids: int32[E] the token ids that end a response (kept in it).
    """

    table: jax.Array
    stop_lens: jax.Array
    eos_ids: jax.Array


@flax.struct.dataclass
class HeadBatch:
    """Shared prompt heads of one prefill (``heads.plan_heads``): prefilled once, copied into their rows.

    Attributes:
      head_ids: int32[H, Th] the distinct heads, left-padded (a padding head holds one pad token).
      head_mask: int32[H, Th] 1 on real head tokens.
      row_head: int32[B] each row's head index.
    """

    head_ids: jax.Array
    head_mask: jax.Array
    row_head: jax.Array


@flax.struct.dataclass
class PromptBatch:
    """The prompts of one prefill, left-padded (padding rows hold one pad token).

    Attributes:
      input_ids: int32[B, T] the prompts (with ``heads``: each row's suffix after its head, T = Ts).
      attention_mask: int32[B, T] 1 on real tokens.
      row_keys: uint32[B, 2] each row's key data: row b draws token j from ``fold_in(row_keys[b], j)``.
      row_mask: bool[B] True on real rows (a padding row is done at once, its tokens the pad id).
      heads: None (a plain prefill) or the shared heads the rows continue (``HeadBatch``).
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    row_keys: jax.Array
    row_mask: jax.Array
    heads: HeadBatch | None = None


@flax.struct.dataclass
class DecodeState:
    """Every row's decode: its KV cache, the response so far and the sampler's per-row state (a pytree;
    donated to ``programs.insert`` and ``programs.decode``, which update it in place).

    Attributes:
      cache: the actor's KV cache of B rows and C columns (prompt bucket + M). ``cache.index`` is the
        next column written: int32[] shared by all rows after a lockstep prefill, int32[B] per row in
        the continuous scheduler's slot state (``programs.empty_state``).
      tokens: int32[B, M] the response so far; the pad id past ``pos``.
      logps: float32[B, M] each response token's log-probability (``filters.sample_tokens``); 0 past ``pos``.
      pos: int32[B] response tokens so far (the next position drawn); 0 for a padding or empty row.
      done: bool[B] the response ended (EOS, stop text, M tokens), or the row is padding or empty.
      last: int32[B] the last token drawn (the next decode step's input).
      stop_state: int32[B, S] the stop-string automata states (``stop_strings.advance``).
      keys: uint32[B, 2] each row's key data (token j is drawn from ``fold_in(keys[b], j)``).
      fingerprint: float32[B, D] each row's prompt fingerprint from its prefill.
    """

    cache: Any
    tokens: jax.Array
    logps: jax.Array
    pos: jax.Array
    done: jax.Array
    last: jax.Array
    stop_state: jax.Array
    keys: jax.Array
    fingerprint: jax.Array

    def row_arrays(self) -> dict[str, jax.Array]:
        """Every field but the cache, by name, in declaration order: arrays with the rows first."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cache"}


def key_data(key: jax.Array) -> jax.Array:
    """uint32[..., 2]: the raw data of ``key`` (typed ``jax.random.key`` or raw ``PRNGKey``, any batch shape)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key, jnp.uint32)


def batch_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a sampler batch is split over: ("data", "fsdp") where present, else all (none without a mesh)."""
    if mesh is None:
        return ()
    return tuple(a for a in ("data", "fsdp") if a in mesh.axis_names) or tuple(mesh.axis_names)


def _row_axes(x) -> tuple:
    """Logical axes of a per-row array: rows first (``"batch"``), its other dims whole."""
    return ("batch",) + (None,) * (x.ndim - 1)


def state_shardings(state: DecodeState, mesh: jax.sharding.Mesh) -> DecodeState:
    """``NamedSharding``s of a ``DecodeState`` (arrays or ShapeDtypeStructs) on ``mesh``: the cache as
    ``kv_cache.cache_shardings`` (rows over ``("data", "fsdp")``, KV heads over ``tensor``), a per-row
    ``index`` int32[B] split like the rows (a shared int32[] one replicated), every other array split
    over its row dim."""
    cache = cache_shardings(state.cache, mesh)
    if state.cache.index.ndim == 1:
        cache = cache.replace(index=sharding.logical_sharding(("batch",), state.cache.index.shape, mesh))
    rows = {k: sharding.logical_sharding(_row_axes(x), x.shape, mesh) for k, x in state.row_arrays().items()}
    return DecodeState(cache=cache, **rows)


def pin(state: DecodeState) -> DecodeState:
    """``state`` constrained to ``state_shardings`` under the current mesh (unchanged without one), so a
    program's output keeps its donated input's layout from call to call."""
    if sharding.current_mesh() is None:
        return state
    c = state.cache
    per_row = ACTIVATION_AXES["per_row"]
    c = c.replace(
        k=tuple(sharding.constrain(x, ACTIVATION_AXES["cache_k"]) for x in c.k),
        v=tuple(sharding.constrain(x, ACTIVATION_AXES["cache_v"]) for x in c.v),
        slot_mask=sharding.constrain(c.slot_mask, ACTIVATION_AXES["cache_mask"]),
        lengths=sharding.constrain(c.lengths, per_row),
        index=sharding.constrain(c.index, per_row if c.index.ndim == 1 else ()),
    )
    rows = {k: sharding.constrain(x, _row_axes(x)) for k, x in state.row_arrays().items()}
    return DecodeState(cache=c, **rows)
