"""``Engine``: one sampler per run over the three programs (``programs.py``), lockstep or in slots.

Every turn of a rollout, every live game needs one response. ``Engine.generate`` serves them all in
one call (lockstep): the prompts are left-padded into a fixed bucket (batch size and prompt length
rounded up to a few configured sizes, so a whole run compiles a handful of programs), ``prefill``
fills the KV cache, draws the first token and returns every row inserted into a fresh
``DecodeState``, and ``decode`` runs on the device until every row has stopped (EOS, a stop string,
or ``max_new_tokens``). ``Engine.slots`` hands out a ``SlotHandle`` (continuous batching): a fixed
number of rows whose finished responses are read and whose rows take the next prompts while the
others keep decoding, through ``insert`` and chunks of ``decode`` over the same state type.

Each row draws from its own key ``fold_in(row_key, step)``: ``row_key`` is the caller's per-prompt
key (``generate(..., row_keys=...)``; the rollout gives each (game, turn) its own) or by default
``fold_in(key, row)`` with ``row`` the prompt's index in the call, so a row's tokens do not depend
on the bucket it landed in, on the other rows, on the device mesh, or on the schedule.

Every program runs through its ``ProgramSpec`` (built once per shape and cached), the object
``launch.aot`` compiles from ``abstract_programs``: what is compiled ahead of time is what runs.

Shape letters: B batch (rows), T prompt tokens, M new tokens, V vocabulary, D hidden width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax.buckets import Buckets
from bipace_jax.programs import ProgramSpec
from bipace_jax.sampling import heads as heads_lib
from bipace_jax.sampling import programs
from bipace_jax.sampling.config import SamplerConfig
from bipace_jax.sampling.outputs import SampleOutput, SampleTiming
from bipace_jax.sampling.state import (
    DecodeConsts,
    DecodeState,
    HeadBatch,
    PromptBatch,
    StaticSettings,
    batch_axes,
    key_data,
)
from bipace_jax.sampling.stop_strings import fit_to_vocab, stop_string_table, token_byte_texts

__all__ = ["Engine", "SlotHandle", "abstract_programs", "actor_vocab", "table_shape"]


def _default_eos_ids(tokenizer) -> tuple[int, ...]:
    ids = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    elif isinstance(eos, (list, tuple)):
        ids.extend(int(e) for e in eos)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for name in ("<|im_end|>", "<|endoftext|>"):
        if name in vocab:
            ids.append(int(vocab[name]))
    return tuple(sorted(set(ids)))


def actor_vocab(actor) -> int:
    """V, the width of the actor's logits (``actor.config.vocab_size``).

    Raises:
      ValueError: ``actor.config.vocab_size`` is not a positive int.
    """
    vocab = getattr(getattr(actor, "config", None), "vocab_size", None)
    if not isinstance(vocab, (int, np.integer)) or vocab < 1:
        raise ValueError(f"actor.config.vocab_size must be a positive int (the logits width), got {vocab!r}")
    return int(vocab)


def table_shape(config: SamplerConfig, vocab: int) -> tuple[int, int, int]:
    """(S, Q, V) of the stop-string table: S stop strings, Q the longest one's UTF-8 bytes (1 when none)."""
    q = max([len(s.encode("utf-8")) for s in config.stop_strings], default=1)
    return len(config.stop_strings), q, vocab


def abstract_programs(
    config: SamplerConfig,
    graphdef,
    params,
    *,
    vocab: int,
    prompt_len: int,
    mesh=None,
    pad_id: int = 0,
    support: int | None = None,
    batch: int | None = None,
    slots: int | None = None,
    insert_rows: Sequence[int] = (),
    chunk: int | None = None,
) -> dict[str, ProgramSpec]:
    """The sampler's programs at one run's sizes, as ``ProgramSpec``s for ``launch.aot`` (nothing runs).

    Args:
      config: the ``SamplerConfig`` (``eos_token_ids`` set: their count shapes the programs).
      graphdef, params: ``nnx.split(actor)``, params as ShapeDtypeStructs with their shardings.
      vocab: V, the actor's logits width; support: ids that can be drawn (default V); pad_id: the pad id.
      prompt_len: T, the prompt bucket (lockstep) and the longest prompt bucket of a slot (T_max).
      mesh: the sampler's mesh or None. batch: the lockstep batch B (rows, a multiple of the mesh's
        batch shards); slots: the slot state's rows; insert_rows: the row counts of the inserts;
        chunk: the decode steps of one continuous chunk.

    Returns:
      ``{"prefill", "decode"}`` (lockstep: decode until done) when ``batch`` is given, and
      ``{"insert_<I>" for I in insert_rows, "decode_chunk"}`` (continuous, over a slot state of C = T + M
      columns) when ``slots`` is.

    Raises:
      ValueError: ``config.eos_token_ids`` is None, or ``slots`` without ``chunk``.
    """
    if config.eos_token_ids is None:
        raise ValueError("abstract_programs: SamplerConfig.eos_token_ids must be set (their count shapes the programs)")
    if slots is not None and chunk is None:
        raise ValueError("abstract_programs: slots needs chunk (the decode steps of one continuous chunk)")
    static = StaticSettings.of(config, pad_id, vocab if support is None else min(support, vocab))
    consts = programs.abstract_consts(mesh, table_shape=table_shape(config, vocab), num_eos=len(config.eos_token_ids))
    out: dict[str, ProgramSpec] = {}
    common = (graphdef, params, static, mesh)
    if batch is not None:
        prompts = programs.abstract_prompts(mesh, batch=batch, prompt_len=prompt_len)
        out["prefill"] = programs.prefill_spec(*common, prompts=prompts, consts=consts)
        state = programs.abstract_prefilled(out["prefill"], mesh)
        m = config.max_new_tokens
        out["decode"] = programs.decode_spec(*common, state=state, consts=consts, max_steps=m, leave_on_finish=False)
    if slots is not None:
        columns = prompt_len + config.max_new_tokens
        state = programs.abstract_empty(*common, rows=slots, columns=columns, num_stops=len(config.stop_strings))
        for n in insert_rows:
            prompts = programs.abstract_prompts(mesh, batch=n, prompt_len=prompt_len)
            out[f"insert_{n}"] = programs.insert_spec(*common, state=state, prompts=prompts, consts=consts)
        decode = programs.decode_spec(*common, state=state, consts=consts, max_steps=chunk, leave_on_finish=True)
        out["decode_chunk"] = dataclasses.replace(decode, name="decode_chunk")
    return out


class Engine:
    """Samples responses from the actor's KV cache: lockstep (``generate``) or in slots (``slots``).

    Args:
      tokenizer: a ``transformers`` tokenizer (or any object with ``len()``, ``convert_ids_to_tokens``
        / ``decode``, ``eos_token_id``, ``pad_token_id``); used on the host only, once, for the EOS ids
        and the stop-string table.
      config: ``SamplerConfig`` (its ``temperature`` is the default of the per-call one).
      mesh: optional ``jax.sharding.Mesh``; the batch is sharded over those of its axes ``("data",
        "fsdp")`` (else over all of them) and the padded batch is rounded up to a multiple of their
        total size. ``None``: default device placement.

    Raises:
      TypeError: ``config`` is not a ``SamplerConfig``.
      ValueError: no EOS id can be found (tokenizer without ``eos_token_id`` and none configured).
    """

    def __init__(self, tokenizer, config: SamplerConfig, mesh: jax.sharding.Mesh | None = None):
        if not isinstance(config, SamplerConfig):
            raise TypeError(f"Engine config must be a SamplerConfig, got {type(config).__name__}")
        self.config = config
        self.tokenizer = tokenizer
        self.mesh = mesh
        eos = config.eos_token_ids if config.eos_token_ids is not None else _default_eos_ids(tokenizer)
        if not eos:
            raise ValueError(
                "Engine: no EOS token id: the tokenizer has no eos_token_id; set SamplerConfig.eos_token_ids"
            )
        self.eos_token_ids = tuple(int(e) for e in eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else self.eos_token_ids[0]
        self.vocab_size = len(tokenizer)
        self._table = stop_string_table(token_byte_texts(tokenizer), config.stop_strings)
        self._stop_lens = np.array([len(s.encode("utf-8")) for s in config.stop_strings], np.int32)
        self.batch_axes = batch_axes(mesh)
        #: the mesh's batch shards: every padded batch is a multiple of it
        self.row_shards = int(np.prod([mesh.shape[a] for a in self.batch_axes])) if mesh is not None else 1
        self._batch_buckets = Buckets(config.batch_buckets, "SamplerConfig.batch_buckets")
        self._device_consts: dict[int, DecodeConsts] = {}
        #: the program specs built so far (each once), by (program, graphdef, static settings, shapes...)
        self.specs: dict[tuple, ProgramSpec] = {}

    # -- sizes ------------------------------------------------------------------------------------
    def batch_bucket(self, n: int) -> int:
        """The padded batch size for ``n`` prompts (n <= the largest bucket), a multiple of the mesh's
        batch shards."""
        return self._batch_buckets.fit(n, self.row_shards)

    def length_bucket(self, t: int) -> int:
        """The padded prompt length for a longest prompt of ``t`` tokens.

        Raises:
          ValueError: ``t`` exceeds the largest length bucket.
        """
        for x in self.config.length_buckets:
            if x >= t:
                return x
        raise ValueError(
            f"prompt length {t} exceeds the largest SamplerConfig.length_buckets entry {self.config.length_buckets[-1]}"
        )

    def static(self, vocab: int) -> StaticSettings:
        """The programs' compile-time settings for an actor of logits width ``vocab``."""
        return StaticSettings.of(self.config, self.pad_id, min(self.vocab_size, vocab))

    def abstract_programs(self, graphdef, params, *, vocab: int, **sizes) -> dict[str, ProgramSpec]:
        """``abstract_programs`` with this engine's config, EOS ids, pad id, support and mesh."""
        config = dataclasses.replace(self.config, eos_token_ids=self.eos_token_ids)
        kw = dict(mesh=self.mesh, pad_id=self.pad_id, support=self.vocab_size) | sizes
        return abstract_programs(config, graphdef, params, vocab=vocab, **kw)

    # -- host helpers -----------------------------------------------------------------------------
    def put_rows(self, x: np.ndarray) -> jax.Array:
        """``x`` on the device, split over the mesh's batch axes by its first dim (default placement without a mesh)."""
        return self._put(x, P(self.batch_axes or None, *[None] * (np.ndim(x) - 1)))

    def _put(self, x, spec):
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def consts(self, vocab: int) -> DecodeConsts:
        """Device copies of the stop table [S, Q, V], stop lengths [S] and EOS ids, per model vocabulary V."""
        if vocab not in self._device_consts:
            rep = P()
            self._device_consts[vocab] = DecodeConsts(
                table=self._put(fit_to_vocab(self._table, vocab), rep),
                stop_lens=self._put(self._stop_lens, rep),
                eos_ids=self._put(np.asarray(self.eos_token_ids, np.int32), rep),
            )
        return self._device_consts[vocab]

    def temperature(self, temperature: float | None) -> jax.Array:
        """The traced temperature of a call: ``config.temperature`` when None.

        Raises:
          ValueError: not finite and > 0 (a greedy engine ignores it).
        """
        t = self.config.temperature if temperature is None else temperature
        if not self.config.greedy and not (isinstance(t, (int, float)) and t > 0 and math.isfinite(t)):
            raise ValueError(f"temperature must be finite and > 0 (a greedy SamplerConfig for argmax), got {t!r}")
        return self._put(np.float32(1.0 if self.config.greedy else t), P())

    def validate(self, prompts, vocab: int) -> list[np.ndarray]:
        """``prompts`` as int32 arrays.

        Raises:
          TypeError / ValueError: not a list of non-empty 1-D integer lists with ids in [0, vocab).
        """
        if isinstance(prompts, np.ndarray) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts must hold at least one prompt, got an empty list")
        arrays = []
        for i, p in enumerate(prompts):
            a = np.asarray(p)
            if a.ndim != 1 or a.size == 0:
                raise ValueError(f"prompts[{i}] must be a non-empty 1-D list of token ids, got shape {a.shape}")
            if not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {a.dtype}")
            if a.min() < 0 or a.max() >= vocab:
                raise ValueError(
                    f"prompts[{i}] holds token id {int(a.min() if a.min() < 0 else a.max())} outside [0, {vocab})"
                )
            arrays.append(a.astype(np.int32))
        return arrays

    @staticmethod
    def row_key_data(key: jax.Array, n: int, row_keys: jax.Array | None = None) -> np.ndarray:
        """uint32[n, 2]: each row's key data, ``row_keys`` or by default ``fold_in(key, row)``.

        Raises:
          ValueError: ``row_keys`` is not n keys.
        """
        if row_keys is None:
            return np.asarray(key_data(jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(n, dtype=jnp.int32))))
        data = np.asarray(key_data(jnp.asarray(row_keys) if not hasattr(row_keys, "dtype") else row_keys))
        if data.shape != (n, 2):
            raise ValueError(
                f"row_keys must be {n} keys (uint32[{n}, 2] key data or [{n}] typed keys), got shape {data.shape}"
            )
        return data.astype(np.uint32)

    def prepare_batch(self, arrays: Sequence[np.ndarray], t_bucket: int, batch: int | None = None):
        """Left-pads prompts into the bucket: (input_ids int32[Bb, T], attention_mask int32[Bb, T],
        row_mask bool[Bb]), Bb = ``batch`` or ``batch_bucket(len(arrays))``. Padding rows hold one pad
        token so no attention row is empty."""
        n = len(arrays)
        b_bucket = self.batch_bucket(n) if batch is None else batch
        ids = np.full((b_bucket, t_bucket), self.pad_id, np.int32)
        mask = np.zeros((b_bucket, t_bucket), np.int32)
        for i, a in enumerate(arrays):
            ids[i, t_bucket - a.size :] = a
            mask[i, t_bucket - a.size :] = 1
        mask[n:, -1] = 1
        return ids, mask, np.arange(b_bucket) < n

    def head_plan(self, arrays: Sequence[np.ndarray], groups: Sequence[int] | None, t_bucket: int):
        """The shared-head plan of one batch chunk (``heads.plan_heads``), or None for a plain prefill:
        sharing off, no groups, or a batch-sharded mesh (a head's rows would sit on other devices)."""
        if not self.config.shared_head_tokens or groups is None or self.row_shards != 1:
            return None
        return heads_lib.plan_heads(
            arrays,
            groups,
            t_bucket,
            self.batch_bucket(len(arrays)),
            min_tokens=self.config.shared_head_tokens,
            head_bucket=self.batch_bucket,
        )

    def spec(self, key: tuple, build: Callable[[], ProgramSpec]) -> ProgramSpec:
        """The program spec cached under ``key`` (its program and shapes), built once by ``build``."""
        if key not in self.specs:
            self.specs[key] = build()
        return self.specs[key]

    def placed(self):
        """The engine's mesh as the current mesh (the models' sharding constraints read it), if any."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    # -- lockstep ---------------------------------------------------------------------------------
    def generate(
        self,
        actor: nnx.Module,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        *,
        temperature: float | None = None,
        row_keys: jax.Array | None = None,
        groups: Sequence[int] | None = None,
    ) -> SampleOutput:
        """Samples one response per prompt: prefill (shared heads when configured and ``groups`` given)
        into a fresh ``DecodeState``, then decode until every row is done.

        Args:
          actor: the current policy (a ``Qwen2Actor`` or any module with ``init_cache``, ``prefill``,
            ``decode_step`` of the same contract); passed each call because its parameters change.
          prompts: B token-id lists (any lengths up to the largest length bucket).
          key: a ``jax.random`` key; without ``row_keys``, row b draws from ``fold_in(fold_in(key, b), step)``.
          temperature: this call's softmax temperature (a traced argument: no recompile per value);
            None takes ``config.temperature``; ignored when greedy.
          row_keys: optional per-prompt keys, [B] typed keys or uint32[B, 2] key data; row b then draws
            from ``fold_in(row_keys[b], step)`` (``key`` unused), so its tokens depend on its own key
            and prompt only.
          groups: optional B ints; with ``config.shared_head_tokens`` > 0, rows of one group prefill
            their common prompt head once (``heads.plan_heads``; the rollout passes task groups).

        Returns:
          ``SampleOutput`` of NumPy arrays with B rows in prompt order and the call's ``SampleTiming``.

        Raises:
          TypeError / ValueError: malformed prompts (empty, not 1-D, ids outside the vocabulary),
            a prompt longer than the largest length bucket, ``row_keys`` not of B keys, ``groups``
            not of B ints, a temperature not finite and > 0.
        """
        temp = self.temperature(temperature)
        vocab = actor_vocab(actor)
        arrays = self.validate(prompts, vocab)
        keys = self.row_key_data(key, len(arrays), row_keys)
        t_bucket = self.length_bucket(max(a.size for a in arrays))
        chunk = self.config.batch_buckets[-1]
        graphdef, params = nnx.split(actor)
        if groups is not None and len(groups) != len(arrays):
            raise ValueError(f"groups must hold one int per prompt ({len(arrays)}), got {len(groups)}")
        parts, timing = [], SampleTiming(prompt_tokens=int(sum(a.size for a in arrays)))
        with self.placed():
            for s in range(0, len(arrays), chunk):
                g = None if groups is None else groups[s : s + chunk]
                rows, t = self._generate_chunk(
                    graphdef, params, arrays[s : s + chunk], keys[s : s + chunk], t_bucket, temp, vocab, g
                )
                parts.append(rows)
                timing = timing + t
        return SampleOutput(*(np.concatenate(f, axis=0) for f in zip(*parts)), timing=timing)

    def _prompt_batch(self, arrays, keys, t_bucket, groups) -> tuple[PromptBatch, int]:
        """One chunk's ``PromptBatch`` on the device, and its real tokens prefilled."""
        plan = self.head_plan(arrays, groups, t_bucket)
        if plan is None:
            ids, mask, row_mask = self.prepare_batch(arrays, t_bucket)
            prefilled, head = sum(a.size for a in arrays), None
        else:
            suffixes = [a[h:] for a, h in zip(arrays, plan.split)]
            ids, mask, row_mask = self.prepare_batch(suffixes, plan.suffix_width)
            prefilled = sum(a.size for a in suffixes) + sum(h.size for h in plan.heads)
            b = ids.shape[0]
            head_ids, head_mask = heads_lib.head_arrays(plan, min(self.batch_bucket(len(plan.heads)), b), self.pad_id)
            row_head = np.zeros((b,), np.int32)
            row_head[: len(arrays)] = plan.row_head
            head = HeadBatch(self._put(head_ids, P()), self._put(head_mask, P()), self.put_rows(row_head))
        row_keys = np.zeros((ids.shape[0], 2), np.uint32)
        row_keys[: len(arrays)] = keys
        ids, mask, row_keys, row_mask = (self.put_rows(x) for x in (ids, mask, row_keys, row_mask))
        return PromptBatch(ids, mask, row_keys, row_mask, head), int(prefilled)

    def _generate_chunk(self, graphdef, params, arrays, keys, t_bucket, temp, vocab, groups):
        n, m = len(arrays), self.config.max_new_tokens
        prompts, prefilled = self._prompt_batch(arrays, keys, t_bucket, groups)
        static, consts = self.static(vocab), self.consts(vocab)
        sizes = tuple(np.shape(x) for x in jax.tree.leaves(prompts))  # heads add leaves
        mesh = self.mesh
        pre = self.spec(
            ("prefill", graphdef, static, sizes),
            lambda: programs.prefill_spec(graphdef, params, static, mesh, prompts=prompts, consts=consts),
        )
        t0 = time.perf_counter()
        state = pre(graphdef, static, params, prompts, consts, temp)
        state.done.block_until_ready()
        t1 = time.perf_counter()
        if m > 1:
            dec = self.spec(
                ("decode", graphdef, static, sizes),
                lambda: programs.decode_spec(
                    graphdef, params, static, mesh, state=state, consts=consts, max_steps=m, leave_on_finish=False
                ),
            )
            state, _ = dec(graphdef, static, params, state, consts, temp, m, False)
        tokens, lengths, logps, fps = jax.device_get((state.tokens, state.pos, state.logps, state.fingerprint))
        t2 = time.perf_counter()
        rows = (
            np.asarray(tokens[:n], np.int32),
            np.asarray(lengths[:n], np.int32),
            np.asarray(logps[:n], np.float32),
            np.asarray(fps[:n], np.float32),
        )
        return rows, SampleTiming(t1 - t0, t2 - t1, 0, prefilled, int(rows[1].sum()))

    # -- continuous -------------------------------------------------------------------------------
    def slots(
        self, actor: nnx.Module, num_slots: int, *, max_prompt: int, chunk: int, temperature: float | None = None
    ) -> SlotHandle:
        """A ``SlotHandle``: ``num_slots`` decode rows over ``actor`` (its weights as of this call) for
        prompts of up to ``max_prompt`` tokens, decoded ``chunk`` steps per ``decode`` call at
        ``temperature`` (None: ``config.temperature``)."""
        return SlotHandle(self, actor, num_slots, max_prompt=max_prompt, chunk=chunk, temperature=temperature)


class SlotHandle:
    """Continuous batching over ``Engine``'s programs: NS rows of one ``DecodeState`` with a per-row write
    index; rows are inserted (``insert``), decoded in chunks (``decode``) and read (``read``) one by one.

    Each row keeps its own cache column (``KVCache.index`` int32[NS]): the actor's ``decode_step`` takes
    the per-row index and writes row b at column ``index[b]``. A row draws token j from
    ``fold_in(row_key, j)``, the lockstep rule, so with the same keys both schedules draw the same
    tokens (up to float summation order over masked cache columns). Under the engine's mesh the state
    is sharded as the lockstep batch (rows over the batch axes, KV heads over ``tensor``) and every
    program pins its output to those shardings, so the donated state is updated in place.

    The handle binds ``actor``'s weights once (``nnx.split`` walks the whole module graph, more than a
    decode step on CPU): take a new handle after an update.

    Attributes:
      num_slots: the state's rows: the requested NS rounded up to the mesh's batch shards (rows past
        the requested NS stay empty unless the caller fills them).
      max_prompt_bucket: T_max, the length bucket of the longest prompt; C = T_max + M cache columns.
      counters: ``decode_steps`` (steps run, summed over chunks), ``chunk_calls``, ``insert_calls``.

    Raises:
      ValueError: ``num_slots`` or ``chunk`` below 1, ``max_prompt`` over the largest length bucket,
        a temperature not finite and > 0.
    """

    def __init__(self, engine: Engine, actor, num_slots: int, *, max_prompt: int, chunk: int, temperature=None):
        for name, v in (("num_slots", num_slots), ("chunk", chunk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Engine.slots: {name} must be an int >= 1, got {v!r}")
        self.engine, self.chunk = engine, chunk
        self.num_slots = -(-num_slots // engine.row_shards) * engine.row_shards
        self.max_prompt_bucket = engine.length_bucket(max_prompt)
        self.counters = dict(decode_steps=0, chunk_calls=0, insert_calls=0)
        self._vocab = actor_vocab(actor)
        self._graphdef, self._params = nnx.split(actor)
        self._static = engine.static(self._vocab)
        self._consts = engine.consts(self._vocab)
        self._temp = engine.temperature(temperature)

    def insert_rows(self, n: int) -> int:
        """The padded rows of an insert of ``n`` prompts: the power of two >= n, rounded up to the mesh's
        batch shards, at most ``num_slots`` (not the batch buckets: a game that frees one slot would
        otherwise pay a whole bucket's prefill, 8 rows in the paper configs)."""
        b = 1 << max(0, (n - 1).bit_length())
        shards = self.engine.row_shards
        return min(-(-b // shards) * shards, self.num_slots)

    def empty(self) -> DecodeState:
        """``num_slots`` empty rows (all ``done``)."""
        columns = self.max_prompt_bucket + self.engine.config.max_new_tokens
        stops = len(self.engine.config.stop_strings)
        with self.engine.placed():
            return programs.empty_state(self._graphdef, self._static, self._params, self.num_slots, columns, stops)

    def insert(self, state: DecodeState, prompts, slot_ids: Sequence[int], row_keys: np.ndarray) -> DecodeState:
        """Prefills ``prompts`` into the free rows ``slot_ids`` (one each); ``row_keys`` uint32[I, 2].

        Returns the new ``DecodeState``, not waited for (``state`` is donated: do not use it again).

        Raises:
          TypeError / ValueError: malformed prompts, or one longer than the largest length bucket.
        """
        e = self.engine
        arrays = e.validate(list(prompts), self._vocab)
        t = e.length_bucket(max(a.size for a in arrays))
        ids, mask, row_mask = e.prepare_batch(arrays, t, batch=self.insert_rows(len(arrays)))
        b = ids.shape[0]
        sid = np.full((b,), self.num_slots, np.int32)  # out of range: a padding row is dropped
        sid[: len(arrays)] = slot_ids
        keys = np.zeros((b, 2), np.uint32)
        keys[: len(arrays)] = row_keys
        batch = PromptBatch(*(e.put_rows(x) for x in (ids, mask, keys, row_mask)))
        sid = e.put_rows(sid)
        g, static, params, consts = self._graphdef, self._static, self._params, self._consts
        spec = e.spec(
            ("insert", g, static, b, t, self.num_slots, self.max_prompt_bucket),
            lambda: programs.insert_spec(g, params, static, e.mesh, state=state, prompts=batch, consts=consts),
        )
        self.counters["insert_calls"] += 1
        with e.placed():
            return spec(g, static, params, state, batch, sid, consts, self._temp)

    def decode(self, state: DecodeState, wait: bool = True) -> tuple[DecodeState, Any]:
        """Up to ``chunk`` steps of every busy row (leaving when one finishes); ``state`` is donated.

        Returns (state, steps run): an int with ``wait``; without, the program is only dispatched and
        steps is its int32[] device scalar, for ``steps_run`` to wait on (the host works meanwhile).
        """
        e, g, static, params, consts = self.engine, self._graphdef, self._static, self._params, self._consts
        spec = e.spec(
            ("decode_chunk", g, static, self.num_slots, self.max_prompt_bucket, self.chunk),
            lambda: programs.decode_spec(
                g, params, static, e.mesh, state=state, consts=consts, max_steps=self.chunk, leave_on_finish=True
            ),
        )
        with e.placed():
            state, steps = spec(g, static, params, state, consts, self._temp, self.chunk, True)
        self.counters["chunk_calls"] += 1
        return (state, self.steps_run(steps)) if wait else (state, steps)

    def steps_run(self, steps) -> int:
        """Waits for a dispatched chunk (``decode(..., wait=False)``'s steps), counts and returns its steps."""
        steps = int(steps)
        self.counters["decode_steps"] += steps
        return steps

    @staticmethod
    def done(state: DecodeState) -> np.ndarray:
        """bool[num_slots]: which rows are done (finished or empty), a writable host copy."""
        return np.array(state.done)

    @staticmethod
    def read(state: DecodeState, slot_ids: Sequence[int]) -> SampleOutput:
        """The rows ``slot_ids`` as a ``SampleOutput`` of NumPy arrays (timing None)."""
        idx = np.asarray(slot_ids, np.int32)
        tokens, pos, logps, fp = jax.device_get((state.tokens, state.pos, state.logps, state.fingerprint))
        return SampleOutput(
            np.asarray(tokens[idx], np.int32),
            np.asarray(pos[idx], np.int32),
            np.asarray(logps[idx], np.float32),
            np.asarray(fp[idx], np.float32),
        )
