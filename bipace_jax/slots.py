"""Slot sampler (continuous batching): a fixed set of decode slots, each row at its own length.

The lockstep sampler (``sampling.Sampler.generate``) answers one batch of prompts and waits for its
longest response. Here a fixed number NS of slots (static shapes) share one dense KV cache of
S = T_max + M columns per slot, and two jitted programs update the slot state in place (donated):

* ``insert``: prefills I new prompts (left-padded to a prompt bucket T <= T_max) and writes them into
  the given free slots: their first token, its log-prob, the stop-string state and the fingerprint.
* ``decode_chunk``: runs up to ``chunk`` decode steps on every busy slot, leaving the loop as soon as a
  slot finishes, so the host can hand that response to its game while the others keep decoding.

Each slot keeps its own write index (``KVCache.index`` is int32[NS] here): the actor's
``decode_step`` takes the per-row index and writes row b at column ``index[b]`` (one scatter per
layer; a ``jax.vmap`` over one-row cache views made a step ~40% dearer at 16 slots on CPU). A slot draws token j from ``fold_in(row_key, j)``, the lockstep sampler's rule, so
with the same per-(game, turn) keys both schedulers draw the same tokens (up to float summation
order over masked cache columns).

Under a host sampler mesh (``Sampler(mesh=...)``) the slot state is sharded as the lockstep
sampler's batch: slots over the batch axes (``sampling.batch_axes``), the cache's KV heads over
``tensor`` (``kv_cache.cache_shardings``); every program pins its output slot state to those
shardings (``slot_shardings``), so the donated state keeps one layout from call to call and is
updated in place. Without a mesh nothing is constrained (default device).

Shape letters: NS slots, I inserted prompts, T prompt bucket, S cache columns, M new tokens,
D hidden width, Q stop-string states per stop string (SS stop strings).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax import sharding
from bipace_jax.models.kv_cache import cache_shardings
from bipace_jax.models.layers import ACTIVATION_AXES
from bipace_jax.programs import ProgramSpec, abstract
from bipace_jax.sampling import Sampler, StaticSettings, _advance_stop, _draw, batch_axes

__all__ = ["SlotState", "SlotSampler", "abstract_slots", "insert_spec", "decode_chunk_spec", "slot_shardings"]


class SlotState(NamedTuple):
    """The slots' device state (a pytree; donated to both programs).

    Attributes:
      cache: the actor's ``KVCache`` in per-layer form, B = NS rows, S = T_max + M columns, ``index``
        int32[NS] (each slot's next column).
      tokens: int32[NS, M] the response so far (pad id past ``pos``); logps: float32[NS, M].
      pos: int32[NS] response tokens so far (the next position drawn).
      done: bool[NS] the response ended (EOS, stop text, M tokens) or the slot is empty.
      last: int32[NS] the last token drawn (the next decode input).
      stop_state: int32[NS, SS] the stop-string automata states.
      keys: uint32[NS, 2] each slot's row key; fingerprint: float32[NS, D] its prompt's fingerprint.
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


def _row_axes(x) -> tuple:
    """Logical axes of a per-slot array: slots first (``"batch"``), its other dims whole."""
    return ("batch",) + (None,) * (x.ndim - 1)


def slot_shardings(slots: SlotState, mesh: jax.sharding.Mesh) -> SlotState:
    """``NamedSharding``s of a ``SlotState`` (arrays or ShapeDtypeStructs) on ``mesh``: the cache as
    ``kv_cache.cache_shardings`` (slots over ``("data", "fsdp")``, KV heads over ``tensor``) with the
    per-slot ``index`` int32[NS] split like the slots, every other array split over its slot dim."""
    cache = cache_shardings(slots.cache, mesh)
    cache = cache.replace(index=sharding.logical_sharding(("batch",), slots.cache.index.shape, mesh))
    rest = [sharding.logical_sharding(_row_axes(x), x.shape, mesh) for x in slots[1:]]
    return SlotState(cache, *rest)


def _pin(slots: SlotState) -> SlotState:
    """``slots`` constrained to ``slot_shardings`` under the current mesh (unchanged without one), so the
    programs' outputs keep their donated inputs' layout."""
    c = slots.cache
    c = c.replace(
        k=tuple(sharding.constrain(x, ACTIVATION_AXES["cache_k"]) for x in c.k),
        v=tuple(sharding.constrain(x, ACTIVATION_AXES["cache_v"]) for x in c.v),
        slot_mask=sharding.constrain(c.slot_mask, ACTIVATION_AXES["cache_mask"]),
        lengths=sharding.constrain(c.lengths, ACTIVATION_AXES["per_row"]),
        index=sharding.constrain(c.index, ACTIVATION_AXES["per_row"]),
    )
    return SlotState(c, *(sharding.constrain(x, _row_axes(x)) for x in slots[1:]))


def _empty_program(graphdef, static: StaticSettings, state, num_slots: int, num_stops: int):
    actor = nnx.merge(graphdef, state)
    cache = actor.init_cache(num_slots, static.cache_length)
    cache = cache.replace(index=jnp.zeros((num_slots,), jnp.int32))
    m = static.max_new_tokens
    d = actor.config.hidden_size
    state = SlotState(
        cache=cache,
        tokens=jnp.full((num_slots, m), static.pad_id, jnp.int32),
        logps=jnp.zeros((num_slots, m), jnp.float32),
        pos=jnp.zeros((num_slots,), jnp.int32),
        done=jnp.ones((num_slots,), bool),
        last=jnp.full((num_slots,), static.pad_id, jnp.int32),
        stop_state=jnp.zeros((num_slots, num_stops), jnp.int32),
        keys=jnp.zeros((num_slots, 2), jnp.uint32),
        fingerprint=jnp.zeros((num_slots, d), jnp.float32),
    )
    return _pin(state)


_empty = jax.jit(_empty_program, static_argnums=(0, 1, 3, 4))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _insert_program(
    graphdef, static: StaticSettings, state, slots: SlotState, input_ids, attention_mask, slot_ids, row_keys,
    temperature, table, stop_lens, eos_ids,
):  # fmt: skip
    """Prefills I prompts and writes them into slots ``slot_ids`` (an id >= NS is a padding row: dropped)."""
    actor = nnx.merge(graphdef, state)
    n, t = input_ids.shape
    cache = actor.init_cache(n, t)
    out, cache = actor.prefill(input_ids, attention_mask, cache)
    token, logp = _draw(static, out.logits, row_keys, 0, temperature)
    stop_state, hit = _advance_stop(table, stop_lens, jnp.zeros((n, table.shape[0]), jnp.int32), token)
    is_eos = jnp.any(token[:, None] == eos_ids[None, :], axis=-1)
    done = is_eos | hit | (static.max_new_tokens == 1)
    c = slots.cache
    s_cols = c.slot_mask.shape[1]

    def put(dst, src):
        return dst.at[slot_ids].set(src.astype(dst.dtype), mode="drop")

    # The whole slot: the prompt in columns [0, T), zeros after it. Masked columns still enter the
    # probabilities-times-values dot with weight 0, so stale non-finite values there would give NaN.
    wide = s_cols - t
    k = tuple(
        a.at[slot_ids].set(jnp.pad(b.astype(a.dtype), ((0, 0), (0, 0), (0, 0), (0, wide))), mode="drop")
        for a, b in zip(c.k, cache.k)
    )
    v = tuple(
        a.at[slot_ids].set(jnp.pad(b.astype(a.dtype), ((0, 0), (0, 0), (0, wide), (0, 0))), mode="drop")
        for a, b in zip(c.v, cache.v)
    )
    mask = jnp.zeros((n, s_cols), bool).at[:, :t].set(cache.slot_mask[:, :t])
    c = c.replace(
        k=k,
        v=v,
        slot_mask=put(c.slot_mask, mask),
        lengths=put(c.lengths, cache.lengths),
        index=put(c.index, jnp.full((n,), t, jnp.int32)),
    )
    m = static.max_new_tokens
    row_tokens = jnp.full((n, m), static.pad_id, jnp.int32).at[:, 0].set(token)
    row_logps = jnp.zeros((n, m), jnp.float32).at[:, 0].set(logp)
    new = SlotState(
        cache=c,
        tokens=put(slots.tokens, row_tokens),
        logps=put(slots.logps, row_logps),
        pos=put(slots.pos, jnp.ones((n,), jnp.int32)),
        done=put(slots.done, done),
        last=put(slots.last, token),
        stop_state=put(slots.stop_state, stop_state),
        keys=put(slots.keys, row_keys),
        fingerprint=put(slots.fingerprint, out.fingerprint.astype(jnp.float32)),
    )
    return _pin(new)


@functools.partial(jax.jit, static_argnums=(0, 1, 4), donate_argnums=(3,))
def _decode_chunk_program(
    graphdef, static: StaticSettings, state, slots: SlotState, chunk: int, temperature, table, stop_lens, eos_ids
):
    """Up to ``chunk`` decode steps of every busy slot; leaves after the step in which a slot finishes.

    Returns (slots, int32 [] steps run).
    """
    actor = nnx.merge(graphdef, state)
    m = static.max_new_tokens
    rows = jnp.arange(slots.pos.shape[0])

    def cond(carry):
        i, s, finished = carry
        return (i < chunk) & ~finished & ~jnp.all(s.done)

    def body(carry):
        i, s, _ = carry
        logits, cache = actor.decode_step(s.last, s.cache)  # index int32[NS]: each slot at its own column
        # A finished or empty slot's cache is not read again before an insert rewrites it; keep its
        # index in range anyway.
        # Positions too: an idle slot that kept counting past S would get NaN RoPE tables (positions
        # outside the table are NaN by design), write NaN K/V and poison its next game through 0 * NaN.
        cache = cache.replace(
            index=jnp.where(s.done, s.cache.index, cache.index),
            lengths=jnp.where(s.done, s.cache.lengths, cache.lengths),
        )
        token, logp = _draw(static, logits, s.keys, s.pos, temperature)
        live = ~s.done
        token = jnp.where(live, token, static.pad_id)
        col = jnp.minimum(s.pos, m - 1)
        tokens = s.tokens.at[rows, col].set(jnp.where(live, token, s.tokens[rows, col]))
        logps = s.logps.at[rows, col].set(jnp.where(live, logp, s.logps[rows, col]))
        new_state, hit = _advance_stop(table, stop_lens, s.stop_state, token)
        is_eos = jnp.any(token[:, None] == eos_ids[None, :], axis=-1)
        pos = s.pos + live.astype(jnp.int32)
        ends = live & (is_eos | hit | (pos >= m))
        s = s._replace(
            cache=cache,
            tokens=tokens,
            logps=logps,
            pos=pos,
            done=s.done | ends,
            last=jnp.where(live, token, s.last),
            stop_state=jnp.where(live[:, None], new_state, s.stop_state),
        )
        return i + 1, _pin(s), jnp.any(ends)

    steps, slots, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), slots, jnp.bool_(False)))
    return _pin(slots), steps


def _rows_sds(mesh, shape, dtype, rows: bool = True) -> jax.ShapeDtypeStruct:
    """An argument's abstract value: split over ``sampling.batch_axes(mesh)`` by its first dim (``rows``)
    or replicated; without a mesh, no sharding (default placement)."""
    if mesh is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    spec = P(batch_axes(mesh) or None, *[None] * (len(shape) - 1)) if rows else P()
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def abstract_slots(graphdef, state, static: StaticSettings, num_slots: int, num_stops: int, mesh=None) -> SlotState:
    """The ``SlotState`` of NS = ``num_slots`` empty slots as ShapeDtypeStructs (``slot_shardings`` on
    ``mesh``; none without one), without building it: what ``SlotSampler.empty`` returns, for
    ``insert_spec`` / ``decode_chunk_spec`` ahead of time (``launch.aot``)."""
    empty = functools.partial(_empty_program, graphdef, static, num_slots=num_slots, num_stops=num_stops)
    shapes = jax.eval_shape(empty, state)
    return shapes if mesh is None else abstract(shapes, slot_shardings(shapes, mesh))


def insert_spec(
    graphdef, state, static: StaticSettings, slots, *, batch: int, prompt_len: int, consts, mesh=None
) -> ProgramSpec:
    """The insert program ``(graphdef, static, state, slots, input_ids int32[I, T], attention_mask
    int32[I, T], slot_ids int32[I], row_keys uint32[I, 2], temperature, stop_table, stop_lens, eos_ids)
    -> slots``, the slots donated; ``batch`` = I, ``prompt_len`` = T (<= the slots' T_max).

    ``mesh``: the sampler's mesh (the I prompt rows split over its batch axes, as the lockstep prefill's;
    I a multiple of their size), or None; ``slots`` and ``consts`` keep their own shardings."""
    ids = _rows_sds(mesh, (batch, prompt_len), jnp.int32)
    args = (
        graphdef,
        static,
        abstract(state),
        abstract(slots),
        ids,
        ids,
        _rows_sds(mesh, (batch,), jnp.int32),
        _rows_sds(mesh, (batch, 2), jnp.uint32),
        _rows_sds(mesh, (), jnp.float32, rows=False),
        *abstract(tuple(consts)),
    )
    return ProgramSpec("insert", _insert_program, args, static_argnums=(0, 1), donate_argnums=(3,))


def decode_chunk_spec(graphdef, state, static: StaticSettings, slots, *, chunk: int, consts, mesh=None) -> ProgramSpec:
    """The chunk program ``(graphdef, static, state, slots, chunk, temperature, stop_table, stop_lens,
    eos_ids) -> (slots, steps int32[])``, the slots donated; ``chunk`` (static) caps the steps.
    ``mesh``: the sampler's mesh or None (only the temperature's placement; the rest keep their own)."""
    temp = _rows_sds(mesh, (), jnp.float32, rows=False)
    args = (graphdef, static, abstract(state), abstract(slots), chunk, temp)
    args = args + tuple(abstract(tuple(consts)))
    return ProgramSpec("decode_chunk", _decode_chunk_program, args, static_argnums=(0, 1, 4), donate_argnums=(3,))


class SlotSampler:
    """Host side of the slot programs, on top of a ``Sampler`` (its config, buckets, EOS, stop table, mesh).

    Args:
      sampler: a ``sampling.Sampler``; with a mesh (``Sampler(mesh=...)``) the slot state is sharded by
        ``slot_shardings`` (slots over the batch axes, KV heads over ``tensor``) and the programs run
        under ``jax.set_mesh``; without one on the default device.
      num_slots: NS (>= 1), the decode slots. Under a mesh the state holds NS rounded up to a multiple
        of the batch axes' size (``rows``); the rows past NS stay empty.
      max_prompt: the longest prompt in tokens; T_max = ``sampler.length_bucket(max_prompt)``.
      chunk: (>= 1) most decode steps per ``decode_chunk`` call.

    Raises:
      ValueError: ``num_slots`` or ``chunk`` below 1, ``max_prompt`` over the largest length bucket.
    """

    def __init__(self, sampler: Sampler, num_slots: int, max_prompt: int, chunk: int = 8):
        for name, v in (("num_slots", num_slots), ("chunk", chunk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SlotSampler: {name} must be an int >= 1, got {v!r}")
        self.sampler, self.num_slots, self.chunk = sampler, num_slots, chunk
        self.mesh = sampler.mesh
        dp = 1 if self.mesh is None else int(np.prod([self.mesh.shape[a] for a in batch_axes(self.mesh)]))
        self.dp = dp
        #: the slot state's rows: NS rounded up to the mesh's batch shards (NS without a mesh)
        self.rows = -(-num_slots // dp) * dp
        self.t_max = sampler.length_bucket(max_prompt)
        #: decode steps run and busy-slot steps (for slot use), summed over calls
        self.counters = dict(decode_steps=0, chunk_calls=0, insert_calls=0)
        self._bound: tuple | None = None  # (actor, graphdef, state, static, consts, temperature, vocab)

    def insert_rows(self, n: int) -> int:
        """The padded rows of an insert of ``n`` prompts: the power of two >= n, rounded up to the mesh's
        batch shards, at most ``rows`` (not the sampler's batch buckets: a game that frees one slot
        would otherwise pay a whole bucket's prefill, 8 rows in the paper configs)."""
        b = 1 << max(0, (n - 1).bit_length())
        return min(-(-b // self.dp) * self.dp, self.rows)

    def _placed(self):
        """The sampler's mesh as the current mesh (the models' sharding constraints read it), if any."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _static(self, vocab: int) -> StaticSettings:
        s = self.sampler
        return StaticSettings.of(s.config, self.t_max, s.pad_id, min(s.vocab_size, vocab))

    def _bind(self, actor) -> tuple:
        """(graphdef, state, static, consts, temperature) of ``actor``, split once per ``actor`` object.

        ``nnx.split`` walks the whole module graph (about 7 ms a call for the 4-layer bench model on
        CPU, more than a decode step), so it is not redone per insert / chunk: the slot programs read the
        weights ``actor`` had when this sampler first saw it (make a new ``SlotSampler`` after an update).
        """
        if self._bound is None or self._bound[0] is not actor:
            s = self.sampler
            vocab = s._actor_vocab(actor)
            graphdef, state = nnx.split(actor)
            temp = jnp.float32(s.config.temperature)
            self._bound = (actor, graphdef, state, self._static(vocab), tuple(s._consts(vocab)), temp, vocab)
        return self._bound[1:-1]

    def empty(self, actor) -> SlotState:
        """NS empty slots (all ``done``)."""
        graphdef, state, static, _, _ = self._bind(actor)
        with self._placed():
            return _empty(graphdef, static, state, self.rows, len(self.sampler.config.stop_strings))

    def insert(self, actor, slots: SlotState, prompts: Sequence[Sequence[int]], slot_ids: Sequence[int], row_keys):
        """Prefills ``prompts`` into the free slots ``slot_ids`` (one each); ``row_keys`` uint32[I, 2].

        Returns the new ``SlotState`` (``slots`` is donated: do not use it again).
        """
        s = self.sampler
        graphdef, state, static, consts, temp = self._bind(actor)
        arrays = s._validate(list(prompts), self._bound[-1])
        t = s.length_bucket(max(a.size for a in arrays))
        ids, mask, _ = s.prepare_batch(arrays, t, batch=self.insert_rows(len(arrays)))
        b = ids.shape[0]
        sid = np.full((b,), self.rows, np.int32)  # out of range: a padding row is dropped
        sid[: len(arrays)] = slot_ids
        keys = np.zeros((b, 2), np.uint32)
        keys[: len(arrays)] = row_keys
        self.counters["insert_calls"] += 1
        if self.mesh is not None:  # prompt rows split as the lockstep prefill's
            ids, mask, sid, keys = (
                s._put(x, P(s.batch_axes or None, *[None] * (x.ndim - 1))) for x in (ids, mask, sid, keys)
            )
        # the jitted program itself (``insert_spec`` describes it): building a spec per call costs ~2 ms
        with self._placed():
            return _insert_program(graphdef, static, state, slots, ids, mask, sid, keys, temp, *consts)

    def decode_chunk(self, actor, slots: SlotState, wait: bool = True) -> tuple[SlotState, Any]:
        """Up to ``chunk`` steps of every busy slot (leaving when one finishes).

        Returns (slots, steps run): an int with ``wait``; without, the program is only dispatched and
        steps is its int32[] device scalar, for ``steps_run`` to wait on (the host works meanwhile).
        """
        graphdef, state, static, consts, temp = self._bind(actor)
        with self._placed():
            slots, steps = _decode_chunk_program(graphdef, static, state, slots, self.chunk, temp, *consts)
        self.counters["chunk_calls"] += 1
        return (slots, self.steps_run(steps)) if wait else (slots, steps)

    def steps_run(self, steps) -> int:
        """Waits for a dispatched chunk (``decode_chunk(..., wait=False)``'s steps), counts and returns its steps."""
        steps = int(steps)
        self.counters["decode_steps"] += steps
        return steps

    @staticmethod
    def read(slots: SlotState, slot_ids: Sequence[int]):
        """(tokens int32[n, M], lengths int32[n], logprobs float32[n, M], fingerprints float32[n, D]) of
        the slots ``slot_ids``, as NumPy arrays (the rows of a ``SampleOutput``)."""
        idx = np.asarray(slot_ids, np.int32)
        tokens, pos, logps, fp = jax.device_get((slots.tokens, slots.pos, slots.logps, slots.fingerprint))
        return (
            np.asarray(tokens[idx], np.int32),
            np.asarray(pos[idx], np.int32),
            np.asarray(logps[idx], np.float32),
            np.asarray(fp[idx], np.float32),
        )
