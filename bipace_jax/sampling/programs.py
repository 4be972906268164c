"""The sampler's three compiled programs, each with its ``ProgramSpec`` builder beside it.

* ``prefill(graphdef, static, params, prompts, consts, temperature) -> DecodeState``: runs the
  prompts (a ``PromptBatch``; with ``heads`` the shared heads are prefilled once and each row
  continues its own, ``heads.py``), draws each row's first token and returns every row inserted into
  a fresh ``DecodeState`` whose cache has room for the M response tokens (write index shared).
* ``insert(graphdef, static, params, state, prompts, slot_ids, consts, temperature) -> DecodeState``:
  the same prefill, its rows written into rows ``slot_ids`` of a slot state (donated: updated in place).
* ``decode(graphdef, static, params, state, consts, temperature, max_steps, leave_on_finish) ->
  (DecodeState, steps)``: up to ``max_steps`` decode steps of every row not done (the state donated);
  the lockstep sampler runs it until every row is done, the continuous scheduler in chunks that
  leave as soon as a row finishes. Nothing inside calls back to Python.

``empty_state`` builds the slot state the inserts fill (all rows done). Row b draws response token
j from ``fold_in(keys[b], j)`` in both schedules, so with the same row keys they draw the same
tokens. Every program pins its output state to ``state.state_shardings`` under a mesh (rows over the
batch axes, KV heads over ``tensor``), so a donated state keeps one layout from call to call.

Shape letters: B rows, I inserted rows, T prompt tokens, C cache columns, M new tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax.programs import ProgramSpec, abstract
from bipace_jax.sampling import stop_strings
from bipace_jax.sampling.filters import sample_tokens
from bipace_jax.sampling.state import (
    DecodeConsts,
    DecodeState,
    HeadBatch,
    PromptBatch,
    StaticSettings,
    batch_axes,
    pin,
    state_shardings,
)

__all__ = [
    "abstract_consts",
    "abstract_empty",
    "abstract_prefilled",
    "abstract_prompts",
    "decode",
    "decode_spec",
    "empty_state",
    "insert",
    "insert_spec",
    "prefill",
    "prefill_spec",
]


# ---------------------------------------------------------------------------------------------------
# Traced pieces shared by the programs.


def _prefill_cache(actor, prompts: PromptBatch, extra_columns: int):
    """The actor's prefill of ``prompts`` into a cache of T (+ head width) + ``extra_columns`` columns:
    returns (ActorOutput at each row's last prompt token, the filled cache with index T)."""
    ids, mask = prompts.input_ids, prompts.attention_mask
    if prompts.heads is None:
        return actor.prefill(ids, mask, actor.init_cache(ids.shape[0], ids.shape[1] + extra_columns))
    # Shared heads: prefill the H heads [H, Th] once, copy head ``row_head[b]``'s KV into row b, then
    # ``extend`` each row by its suffix: the plain prefill's columns and index, so decoding is unchanged.
    h: HeadBatch = prompts.heads
    th = h.head_ids.shape[1]
    _, heads = actor.prefill(h.head_ids, h.head_mask, actor.init_cache(h.head_ids.shape[0], th))
    wide = ids.shape[1] + extra_columns

    def rows(a, axis):  # head KV per row, widened to the cache's columns
        a = jnp.take(a, h.row_head, axis=0)
        return jnp.pad(a, [(0, wide) if d == axis else (0, 0) for d in range(a.ndim)])

    cache = heads.replace(
        k=tuple(rows(a, 3) for a in heads.k),
        v=tuple(rows(a, 2) for a in heads.v),
        slot_mask=rows(heads.slot_mask, 1),
        lengths=jnp.take(heads.lengths, h.row_head, axis=0),
    )
    return actor.extend(ids, mask, cache)


def _prefilled_rows(actor, static: StaticSettings, prompts: PromptBatch, consts: DecodeConsts, temperature, extra):
    """``prompts`` prefilled (``extra`` free cache columns after them) with their first token drawn
    (row b from ``fold_in(row_keys[b], 0)``): a ``DecodeState`` of their rows, pos 1 (0 on padding rows)."""
    out, cache = _prefill_cache(actor, prompts, extra)
    b, m = prompts.row_keys.shape[0], static.max_new_tokens
    token, logp = sample_tokens(out.logits, prompts.row_keys, 0, temperature, **static.draw_options())
    zero = jnp.zeros((b, consts.table.shape[0]), jnp.int32)
    stop_state, hit = stop_strings.advance(consts.table, consts.stop_lens, zero, token)
    is_eos = jnp.any(token[:, None] == consts.eos_ids[None, :], axis=-1)
    real = prompts.row_mask
    token = jnp.where(real, token, static.pad_id)
    logp = jnp.where(real, logp, 0.0)
    return DecodeState(
        cache=cache,
        tokens=jnp.full((b, m), static.pad_id, jnp.int32).at[:, 0].set(token),
        logps=jnp.zeros((b, m), jnp.float32).at[:, 0].set(logp),
        pos=real.astype(jnp.int32),
        done=is_eos | hit | ~real | (m == 1),
        last=token,
        stop_state=stop_state,
        keys=prompts.row_keys,
        fingerprint=out.fingerprint.astype(jnp.float32),
    )


# ---------------------------------------------------------------------------------------------------
# The programs.


@functools.partial(jax.jit, static_argnums=(0, 1))
def prefill(graphdef, static: StaticSettings, params, prompts: PromptBatch, consts: DecodeConsts, temperature):
    """Every row of ``prompts`` prefilled into a fresh ``DecodeState`` with C = T (+ Th) + M columns."""
    actor = nnx.merge(graphdef, params)
    return pin(_prefilled_rows(actor, static, prompts, consts, temperature, static.max_new_tokens))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def insert(
    graphdef, static: StaticSettings, params, state: DecodeState, prompts: PromptBatch, slot_ids, consts, temperature
):
    """Prefills I prompts and writes them into rows ``slot_ids`` int32[I] of ``state`` (per-row write
    index; a slot id >= B is a padding row: dropped). The state is donated."""
    actor = nnx.merge(graphdef, params)
    new = _prefilled_rows(actor, static, prompts, consts, temperature, 0)
    n, t = new.cache.slot_mask.shape
    c, src = state.cache, new.cache

    def put(dst, value):
        return dst.at[slot_ids].set(value.astype(dst.dtype), mode="drop")

    # The whole row: the prompt in columns [0, T), zeros after it. Masked columns still enter the
    # probabilities-times-values dot with weight 0, so stale non-finite values there would give NaN.
    wide = c.slot_mask.shape[1] - t
    c = c.replace(
        k=tuple(put(a, jnp.pad(b, ((0, 0), (0, 0), (0, 0), (0, wide)))) for a, b in zip(c.k, src.k)),
        v=tuple(put(a, jnp.pad(b, ((0, 0), (0, 0), (0, wide), (0, 0)))) for a, b in zip(c.v, src.v)),
        slot_mask=put(c.slot_mask, jnp.pad(src.slot_mask, ((0, 0), (0, wide)))),
        lengths=put(c.lengths, src.lengths),
        index=put(c.index, jnp.full((n,), t, jnp.int32)),
    )
    fresh = new.row_arrays()
    rows = {k: put(x, fresh[k]) for k, x in state.row_arrays().items()}
    return pin(DecodeState(cache=c, **rows))


@functools.partial(jax.jit, static_argnums=(0, 1, 6, 7), donate_argnums=(3,))
def decode(
    graphdef,
    static: StaticSettings,
    params,
    state: DecodeState,
    consts: DecodeConsts,
    temperature,
    max_steps: int,
    leave_on_finish: bool,
):
    """Up to ``max_steps`` decode steps of every row not done; with ``leave_on_finish`` it leaves after
    the step in which a row finishes (the continuous scheduler's chunk). Returns (state, int32[] steps run)."""
    actor = nnx.merge(graphdef, params)
    m = static.max_new_tokens
    columns = jnp.arange(m)
    per_row = jnp.ndim(state.cache.index) == 1

    def cond(carry):
        i, s, finished = carry
        return (i < max_steps) & ~finished & ~jnp.all(s.done)

    def body(carry):
        i, s, _ = carry
        logits, cache = actor.decode_step(s.last, s.cache)
        if per_row:
            # A finished or empty slot's cache is not read again before an insert rewrites it; keep its
            # index in range anyway. Positions too: an idle slot that kept counting past C would get NaN
            # RoPE tables (positions outside the table are NaN by design), write NaN K/V and poison its
            # next game through 0 * NaN.
            cache = cache.replace(
                index=jnp.where(s.done, s.cache.index, cache.index),
                lengths=jnp.where(s.done, s.cache.lengths, cache.lengths),
            )
        token, logp = sample_tokens(logits, s.keys, s.pos, temperature, **static.draw_options())
        live = ~s.done
        token = jnp.where(live, token, static.pad_id)
        col = jnp.minimum(s.pos, m - 1)
        new_stop, hit = stop_strings.advance(consts.table, consts.stop_lens, s.stop_state, token)
        is_eos = jnp.any(token[:, None] == consts.eos_ids[None, :], axis=-1)
        pos = s.pos + live.astype(jnp.int32)
        ends = live & (is_eos | hit | (pos >= m))
        # Written by a select over [B, M] (one fused elementwise pass) rather than gather + scatter:
        # two kernels fewer per step on accelerators, the same values.
        here = live[:, None] & (columns[None, :] == col[:, None])
        s = DecodeState(
            cache=cache,
            tokens=jnp.where(here, token[:, None], s.tokens),
            logps=jnp.where(here, logp[:, None], s.logps),
            pos=pos,
            done=s.done | ends,
            last=jnp.where(live, token, s.last),
            stop_state=jnp.where(live[:, None], new_stop, s.stop_state),
            keys=s.keys,
            fingerprint=s.fingerprint,
        )
        return i + 1, pin(s), jnp.any(ends) & leave_on_finish

    steps, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.bool_(False)))
    return pin(state), steps


def _empty_state(graphdef, static: StaticSettings, params, rows: int, columns: int, num_stops: int) -> DecodeState:
    """A slot state of ``rows`` empty rows (all done) with C = ``columns`` cache columns and a per-row
    write index, for ``insert``."""
    actor = nnx.merge(graphdef, params)
    cache = actor.init_cache(rows, columns)
    cache = cache.replace(index=jnp.zeros((rows,), jnp.int32))
    m = static.max_new_tokens
    state = DecodeState(
        cache=cache,
        tokens=jnp.full((rows, m), static.pad_id, jnp.int32),
        logps=jnp.zeros((rows, m), jnp.float32),
        pos=jnp.zeros((rows,), jnp.int32),
        done=jnp.ones((rows,), bool),
        last=jnp.full((rows,), static.pad_id, jnp.int32),
        stop_state=jnp.zeros((rows, num_stops), jnp.int32),
        keys=jnp.zeros((rows, 2), jnp.uint32),
        fingerprint=jnp.zeros((rows, actor.config.hidden_size), jnp.float32),
    )
    return pin(state)


empty_state = jax.jit(_empty_state, static_argnums=(0, 1, 3, 4, 5))


# ---------------------------------------------------------------------------------------------------
# Abstract arguments and the specs.


def _sds(mesh, shape, dtype, rows: bool = True) -> jax.ShapeDtypeStruct:
    """An abstract argument: split over ``batch_axes(mesh)`` by its first dim (``rows``) or replicated;
    without a mesh, no sharding (default placement)."""
    if mesh is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    spec = P(batch_axes(mesh) or None, *[None] * (len(shape) - 1)) if rows else P()
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def abstract_prompts(mesh, *, batch: int, prompt_len: int, heads: tuple[int, int] | None = None) -> PromptBatch:
    """A ``PromptBatch`` of ShapeDtypeStructs: ``batch`` rows of ``prompt_len`` tokens (the suffix width
    with heads), ``heads`` = (H, Th) or None; rows split over the mesh's batch axes, heads replicated."""
    ids = _sds(mesh, (batch, prompt_len), jnp.int32)
    head = None
    if heads is not None:
        h_ids = _sds(mesh, tuple(heads), jnp.int32, rows=False)
        head = HeadBatch(head_ids=h_ids, head_mask=h_ids, row_head=_sds(mesh, (batch,), jnp.int32))
    return PromptBatch(
        input_ids=ids,
        attention_mask=ids,
        row_keys=_sds(mesh, (batch, 2), jnp.uint32),
        row_mask=_sds(mesh, (batch,), jnp.bool_),
        heads=head,
    )


def abstract_consts(mesh, *, table_shape: tuple[int, int, int], num_eos: int) -> DecodeConsts:
    """``DecodeConsts`` of ShapeDtypeStructs, replicated: table int32[S, Q, V], EOS ids int32[E]."""
    return DecodeConsts(
        table=_sds(mesh, tuple(table_shape), jnp.int32, rows=False),
        stop_lens=_sds(mesh, (table_shape[0],), jnp.int32, rows=False),
        eos_ids=_sds(mesh, (num_eos,), jnp.int32, rows=False),
    )


def _temperature(mesh) -> jax.ShapeDtypeStruct:
    return _sds(mesh, (), jnp.float32, rows=False)


def _placed(shapes: DecodeState, mesh) -> DecodeState:
    return shapes if mesh is None else abstract(shapes, state_shardings(shapes, mesh))


def prefill_spec(graphdef, params, static: StaticSettings, mesh, *, prompts: PromptBatch, consts) -> ProgramSpec:
    """The ``prefill`` program at the shapes of ``prompts`` (``abstract_prompts``) and ``consts``.

    Args:
      graphdef, params: ``nnx.split(actor)`` (params: arrays or ShapeDtypeStructs with shardings).
      static: the compile-time settings; mesh: the sampler's mesh or None (default placement).
    """
    args = (graphdef, static, abstract(params), abstract(prompts), abstract(consts), _temperature(mesh))
    return ProgramSpec("prefill", prefill, args, static_argnums=(0, 1))


def abstract_prefilled(spec: ProgramSpec, mesh) -> DecodeState:
    """The ``DecodeState`` a ``prefill_spec`` returns, as ShapeDtypeStructs with ``state_shardings``."""
    return _placed(jax.eval_shape(functools.partial(spec.fn, *spec.args[:2]), *spec.args[2:]), mesh)


def abstract_empty(graphdef, params, static: StaticSettings, mesh, *, rows: int, columns: int, num_stops: int):
    """The ``DecodeState`` ``empty_state`` returns, as ShapeDtypeStructs (``state_shardings`` on
    ``mesh``), without building it: for ``insert_spec`` / ``decode_spec`` ahead of time."""
    build = functools.partial(_empty_state, graphdef, static, rows=rows, columns=columns, num_stops=num_stops)
    return _placed(jax.eval_shape(build, abstract(params)), mesh)


def insert_spec(graphdef, params, static: StaticSettings, mesh, *, state, prompts: PromptBatch, consts) -> ProgramSpec:
    """The ``insert`` program of ``prompts`` (I rows of T <= C - M tokens) into slot ``state`` (donated),
    with slot ids int32[I] split like the prompt rows."""
    slot_ids = _sds(mesh, (prompts.row_keys.shape[0],), jnp.int32)
    args = (graphdef, static, abstract(params), abstract(state), abstract(prompts), slot_ids, abstract(consts))
    args += (_temperature(mesh),)
    return ProgramSpec("insert", insert, args, static_argnums=(0, 1), donate_argnums=(3,))


def decode_spec(
    graphdef, params, static: StaticSettings, mesh, *, state, consts, max_steps: int, leave_on_finish: bool
) -> ProgramSpec:
    """The ``decode`` program over ``state`` (donated): up to ``max_steps`` steps (static), leaving when
    a row finishes if ``leave_on_finish`` (static)."""
    args = (graphdef, static, abstract(params), abstract(state), abstract(consts), _temperature(mesh))
    args += (max_steps, leave_on_finish)
    return ProgramSpec("decode", decode, args, static_argnums=(0, 1, 6, 7), donate_argnums=(3,))
