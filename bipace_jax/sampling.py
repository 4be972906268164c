"""Batched KV-cache sampler: one compiled prefill and one on-device decode loop per call.

Every turn of a rollout, every live game needs one response. ``Sampler.generate`` serves them all in
one call: the prompts are left-padded into a fixed bucket (batch size and prompt length rounded up to
a few configured sizes, so a whole run compiles a handful of programs), the actor's ``prefill`` fills
the KV cache and yields the first token and the prompt fingerprints, and a ``lax.while_loop`` on the
device runs ``decode_step`` until every row has stopped (EOS, a stop string, or ``max_new_tokens``).
Nothing inside the loop calls back to Python.

Shape letters: B batch (rows), T prompt tokens, M new tokens, V vocabulary,
D hidden width, S stop strings, Q stop-string states.

Sampling (per row, per step), in the order Hugging Face's logits processors apply them:
``logits / temperature`` -> keep the ``top_k`` largest -> keep the smallest set of most likely tokens
whose probability mass reaches ``top_p`` -> draw with the Gumbel-max trick. Each row draws from its
own key ``fold_in(row_key, step)``: ``row_key`` is the caller's per-prompt key (``generate(...,
row_keys=...)``; the rollout gives each (game, turn) its own) or by default ``fold_in(key, row)`` with
``row`` the prompt's index in the call, so a row's tokens do not depend on the bucket it landed in,
on the other rows, or on the device mesh.

Stop strings are matched on bytes of the decoded text, on the device: for each stop string a
Knuth-Morris-Pratt automaton is run over the byte text of every token id once, on the host, giving a
table ``next_state[S, Q, V]`` (the matched-prefix length after a token, ``len(stop)`` when the stop
text completes anywhere inside that token). The decode loop carries one state per row and stop
string, so a stop text spread over several tokens, or merged with other characters into one token,
is found exactly: the response ends with the token whose text completes the stop text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bipace_jax import prompt_heads
from bipace_jax.programs import ProgramSpec, abstract

__all__ = [
    "SamplerConfig",
    "SampleOutput",
    "Sampler",
    "StaticSettings",
    "decode_spec",
    "prefill_spec",
    "shared_prefill_spec",
    "key_data",
    "filter_logits",
    "sample_tokens",
    "first_argmax",
    "token_byte_texts",
    "stop_string_table",
    "truncate_at_stop",
]


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How responses are sampled.

    Attributes:
      max_new_tokens: M, the most tokens generated per response (EOS and stop text included).
      temperature: softmax temperature (> 0) used when ``greedy`` is False (one sampler per temperature).
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
        groups=...)``: the rollout's task groups) prefill once and share (``prompt_heads``); the
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


class SampleOutput(NamedTuple):
    """One ``Sampler.generate`` call's results, as NumPy arrays, one row per prompt (in order).

    Attributes:
      tokens: int32[B, M] response token ids; positions ``>= lengths[b]`` hold the pad id.
      lengths: int32[B] response lengths in tokens (1..M), EOS and stop-text tokens included.
      logprobs: float32[B, M] log-probability of each response token under the policy at the sampling
        temperature, before top-k/top-p truncation: ``log_softmax(logits / temperature)[token]``
        (temperature 1 when greedy); 0 past ``lengths``.
      fingerprints: float32[B, D] the actor's prompt fingerprints from the prefill (hidden state at the
        last prompt token, L2-normalised; docs/estimators.md).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray
    fingerprints: np.ndarray


# ---------------------------------------------------------------------------------------------------
# Pure pieces: filtering and drawing.


def filter_logits(logits: jax.Array, *, top_k: int = 0, top_p: float | jax.Array = 1.0) -> jax.Array:
    """Masks the logits outside the top-k / top-p (nucleus) set with ``-inf``.

    Args:
      logits: float32[..., V], already divided by the temperature.
      top_k: static; keep the ``top_k`` largest logits (ties with the k-th are kept too); 0 keeps all.
      top_p: keep the most likely tokens, in descending order, while the probability mass of the tokens
        before them is ``< top_p`` (so at least one token survives); renormalised over the top-k set
        first, as Hugging Face's ``TopKLogitsWarper`` then ``TopPLogitsWarper`` do. Ties with the
        last kept logit are kept. 1.0 keeps all.

    Returns:
      float32[..., V]: ``logits`` where kept, ``-inf`` elsewhere.

    Computed without a sort (XLA's CPU sort calls a comparator per comparison, docs/performance.md):
    each threshold is found by bisection over order-preserving int32 keys of the logits (32 masked
    counts / sums over V each); the top-k set is exactly ``lax.top_k``'s, the nucleus the sorted
    rule's up to float summation order.
    """
    v = logits.shape[-1]
    apply_p = not (isinstance(top_p, (int, float)) and top_p >= 1.0)
    if top_k <= 0 and not apply_p:
        return logits
    key = _order_key(logits)
    lo = jnp.min(key, axis=-1, keepdims=True)
    hi = jnp.max(key, axis=-1, keepdims=True)
    if 0 < top_k < v:
        # The k-th largest logit (counted with multiplicity): the largest key t with
        # #{key >= t} >= k. Counts are exact, so this is lax.top_k's k-th value.
        def kth(_, bounds):
            lo_, hi_ = bounds
            mid = _mid_key(lo_, hi_, up=True)
            ok = jnp.sum(key >= mid, axis=-1, keepdims=True) >= top_k
            return jnp.where(ok, mid, lo_), jnp.where(ok, hi_, mid - 1)

        t_k, _ = jax.lax.fori_loop(0, 32, kth, (lo, hi))
        logits = jnp.where(key >= t_k, logits, -jnp.inf)
        key = jnp.where(key >= t_k, key, _order_key(jnp.float32(-jnp.inf)))
        lo = t_k
    if apply_p:
        # The kept set is {key >= t} for the smallest key t whose strictly-larger mass is < top_p.
        probs = jax.nn.softmax(logits, axis=-1)

        def nucleus(_, bounds):
            lo_, hi_ = bounds
            mid = _mid_key(lo_, hi_, up=False)
            ok = jnp.sum(jnp.where(key > mid, probs, 0.0), axis=-1, keepdims=True) < top_p
            return jnp.where(ok, lo_, mid + 1), jnp.where(ok, mid, hi_)

        _, t_p = jax.lax.fori_loop(0, 32, nucleus, (lo, hi))
        logits = jnp.where(key >= t_p, logits, -jnp.inf)
    return logits


def _order_key(x: jax.Array) -> jax.Array:
    """int32 keys of float32 ``x`` in the same order (-inf lowest; -0.0 and +0.0 equal, as they compare)."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0.0), x), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _mid_key(lo: jax.Array, hi: jax.Array, *, up: bool) -> jax.Array:
    """The midpoint of int32 ``lo <= hi`` rounded up or down, without int32 overflow."""
    span = jax.lax.bitcast_convert_type(hi - lo, jnp.uint32)  # wraps to the true span in [0, 2^32)
    half = (span >> 1) + (span & 1) if up else span >> 1
    return lo + jax.lax.bitcast_convert_type(half, jnp.int32)


def first_argmax(x: jax.Array) -> jax.Array:
    """int32[...]: ``jnp.argmax(x, axis=-1)`` (first maximum; first NaN if any) for float ``x[..., V]``.

    Computed as the smallest index where ``x`` equals its maximum (or is NaN): two plain reductions,
    which XLA's CPU backend vectorises, instead of ``jnp.argmax``'s slower (value, index) pair
    reduction (docs/performance.md). Same result for every input.
    """
    v = x.shape[-1]
    peak = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row holds a NaN
    hit = (x == peak) | jnp.isnan(x)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, iota, v), axis=-1).astype(jnp.int32)


def sample_tokens(
    logits: jax.Array,
    row_keys: jax.Array,
    step: jax.Array | int,
    temperature: jax.Array | float,
    *,
    greedy: bool,
    top_k: int = 0,
    top_p: float = 1.0,
    support: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row from the first ``support`` ids (all V when None).

    Args:
      logits: float32[B, V] raw next-token logits.
      row_keys: [B] typed PRNG keys (or uint32[B, 2]), one per row.
      step: the response position being drawn (folded into each row's key): a scalar, or int32[B] one
        per row (the slot scheduler's rows are at different positions).
      temperature: scalar > 0 (ignored when ``greedy``).
      greedy / top_k / top_p: static, see ``SamplerConfig``.
      support: static; ids at or above it (embedding rows the tokenizer has no token for, as in
        Qwen2.5's padded 151,936-row vocabulary) are never drawn and are outside the softmax.

    Returns:
      (int32[B] tokens, float32[B] ``log_softmax(logits / temperature)`` of the drawn tokens; temperature
      1 when greedy).
    """
    logits = logits[..., :support].astype(jnp.float32)
    if greedy:
        scaled = logits
        tokens = first_argmax(logits)
    else:
        scaled = logits / jnp.asarray(temperature, jnp.float32)
        filtered = filter_logits(scaled, top_k=top_k, top_p=top_p)
        steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), (logits.shape[0],))
        step_keys = jax.vmap(jax.random.fold_in)(row_keys, steps)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(step_keys)
        tokens = first_argmax(filtered + gumbel)
    # log_softmax(scaled)[token] without materialising log_softmax over V: the same expression
    # (scaled - max) - log(sum(exp(scaled - max))), evaluated at the drawn token only.
    peak = jnp.max(scaled, axis=-1, keepdims=True)
    log_norm = jnp.log(jnp.sum(jnp.exp(scaled - peak), axis=-1))
    token_logp = (jnp.take_along_axis(scaled, tokens[:, None], axis=-1) - peak)[:, 0] - log_norm
    return tokens, token_logp


# ---------------------------------------------------------------------------------------------------
# Stop strings: byte texts of tokens and the per-token automaton table (host side, once per tokenizer).


def _byte_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2 / Qwen): printable unicode char -> byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in printable]  # shifted to chr(256 + k), in byte order
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


def token_byte_texts(tokenizer: Any) -> list[bytes]:
    """The text of every token id as UTF-8 bytes, as the tokenizer's decoder would emit it.

    Byte-level BPE tokenizers (Qwen2, GPT-2): the token's bytes exactly, so concatenating them gives the
    decoded text's bytes. Special tokens give ``b""`` (``decode(..., skip_special_tokens=True)``
    drops them). Other tokenizers: ``tokenizer.decode([id])`` encoded as UTF-8 (an approximation where
    the decoder adds or removes spaces between tokens).

    Returns:
      list of ``len(tokenizer)`` byte strings, indexed by token id.
    """
    n = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
    added = dict(getattr(tokenizer, "added_tokens_decoder", {}))
    out: list[bytes] = []
    if byte_level:
        inv = _byte_decoder()
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                out.append(b"")
            elif i in added:
                out.append(b"" if getattr(added[i], "special", False) else str(added[i].content).encode("utf-8"))
            else:
                try:
                    out.append(bytes(inv[c] for c in piece))
                except KeyError:  # not in the byte alphabet: take it as literal text
                    out.append(piece.encode("utf-8"))
    else:
        for i in range(n):
            out.append(b"" if i in special else tokenizer.decode([i], skip_special_tokens=True).encode("utf-8"))
    return out


def _kmp_dfa(pattern: bytes) -> np.ndarray:
    """int32[L + 1, 256]: the KMP automaton of ``pattern`` (state = length of the matched prefix)."""
    length = len(pattern)
    dfa = np.zeros((length + 1, 256), np.int32)
    dfa[0, pattern[0]] = 1
    restart = 0
    for q in range(1, length + 1):
        dfa[q] = dfa[restart]
        if q < length:
            dfa[q, pattern[q]] = q + 1
            restart = dfa[restart, pattern[q]]
    return dfa


def stop_string_table(token_texts: Sequence[bytes], stop_strings: Sequence[str]) -> np.ndarray:
    """The stop-string automaton over whole tokens.

    ``table[s, q, v]`` is the number of bytes of stop string ``s`` matched (as a suffix of the text so
    far) after the text of token ``v`` is appended to a text whose matched prefix length was ``q``;
    it equals ``len(stop_strings[s])`` (in UTF-8 bytes) when the stop text completes anywhere inside
    token ``v``'s text, which ends the response. Rows ``q >= len(stop_strings[s])`` are unused.

    Args:
      token_texts: V byte strings (``token_byte_texts``).
      stop_strings: S non-empty strings.

    Returns:
      int32[S, Q, V] with Q = the longest stop string's length in bytes (Q = 1, S = 0 when none).
    """
    patterns = [s.encode("utf-8") for s in stop_strings]
    v = len(token_texts)
    q_max = max([len(p) for p in patterns], default=1)
    table = np.zeros((len(patterns), q_max, v), np.int32)
    if not patterns:
        return table
    lens = np.array([len(t) for t in token_texts], np.int64)
    width = int(lens.max(initial=0))
    mat = np.zeros((v, max(width, 1)), np.uint8)
    for i, t in enumerate(token_texts):
        if t:
            mat[i, : len(t)] = np.frombuffer(t, np.uint8)
    for s, pat in enumerate(patterns):
        dfa = _kmp_dfa(pat)
        length = len(pat)
        for q in range(length):
            state = np.full(v, q, np.int32)
            for j in range(width):
                live = (j < lens) & (state < length)
                if not live.any():
                    break
                state = np.where(live, dfa[state, mat[:, j]], state)
            table[s, q] = state
    return table


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` cut right after the earliest-ending occurrence of any stop string (unchanged if none).

    The sampler stops at the token that completes a stop text; that token may carry characters after
    it (tokenizers merge characters), which this removes from the decoded text.
    """
    ends = [text.find(stop) + len(stop) for stop in stop_strings if stop in text]
    return text[: min(ends)] if ends else text


# ---------------------------------------------------------------------------------------------------
# Compiled programs.


class StaticSettings(NamedTuple):
    """Hashable compile-time settings of the prefill and decode programs (one pair per prompt bucket)."""

    greedy: bool
    top_k: int
    top_p: float
    max_new_tokens: int
    cache_length: int  # prompt bucket T + max_new_tokens
    pad_id: int
    support: int  # ids below it can be drawn: the tokenizer's size (<= the logits' width V)

    @classmethod
    def of(cls, config: SamplerConfig, prompt_len: int, pad_id: int, support: int) -> StaticSettings:
        """The settings of ``config`` for prompts padded to ``prompt_len`` tokens."""
        return cls(
            greedy=config.greedy,
            top_k=config.top_k,
            top_p=float(config.top_p),
            max_new_tokens=config.max_new_tokens,
            cache_length=prompt_len + config.max_new_tokens,
            pad_id=pad_id,
            support=support,
        )


def key_data(key: jax.Array) -> jax.Array:
    """uint32[..., 2]: the raw data of ``key`` (typed ``jax.random.key`` or raw ``PRNGKey``, any batch shape)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key, jnp.uint32)


def _padded_table(table: np.ndarray, vocab: int) -> np.ndarray:
    """The [S, Q, V_tok] table fitted to the model's vocabulary V: ids the tokenizer lacks have no text
    (the state stays); ids beyond V are dropped."""
    s, q, v_tok = table.shape
    if v_tok >= vocab:
        return table[:, :, :vocab]
    keep_state = np.broadcast_to(np.arange(q, dtype=np.int32)[None, :, None], (s, q, vocab - v_tok))
    return np.concatenate([table, keep_state], axis=-1)


def _advance_stop(table: jax.Array, stop_lens: jax.Array, state: jax.Array, token: jax.Array):
    """state int32[B, S], token int32[B] -> (new state int32[B, S], completed bool[B])."""
    if table.shape[0] == 0:
        return state, jnp.zeros(token.shape, bool)
    s_idx = jnp.arange(table.shape[0])[None, :]
    new = table[s_idx, jnp.minimum(state, table.shape[1] - 1), token[:, None]]
    hit = jnp.any(new >= stop_lens[None, :], axis=-1)
    return new, hit


def _draw(static: StaticSettings, logits, keys, step, temperature):
    """``sample_tokens`` with the sampler's static filters: the prefill and every decode step draw alike."""
    kw = dict(greedy=static.greedy, top_k=static.top_k, top_p=static.top_p, support=static.support)
    return sample_tokens(logits, keys, step, temperature, **kw)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prefill_program(
    graphdef,
    static: StaticSettings,
    state,
    input_ids,
    attention_mask,
    row_keys,
    row_mask,
    temperature,
    table,
    stop_lens,
    eos_ids,
):
    """Prefill + the first token (row b draws from ``fold_in(row_keys[b], 0)``). Returns the first-step carry and the filled KV cache."""
    actor = nnx.merge(graphdef, state)
    b = input_ids.shape[0]
    cache = actor.init_cache(b, static.cache_length)
    out, cache = actor.prefill(input_ids, attention_mask, cache)
    return (*_first_token(static, out, row_keys, row_mask, temperature, table, stop_lens, eos_ids), cache)


def _first_token(static: StaticSettings, out, row_keys, row_mask, temperature, table, stop_lens, eos_ids):
    """The first response token from the prefill's ``ActorOutput``: (token, logp, done, stop_state, fingerprint)."""
    b = row_keys.shape[0]
    token, logp = _draw(static, out.logits, row_keys, 0, temperature)
    stop_state, hit = _advance_stop(table, stop_lens, jnp.zeros((b, table.shape[0]), jnp.int32), token)
    is_eos = jnp.any(token[:, None] == eos_ids[None, :], axis=-1)
    token = jnp.where(row_mask, token, static.pad_id)
    logp = jnp.where(row_mask, logp, 0.0)
    done = is_eos | hit | ~row_mask
    return token, logp, done, stop_state, out.fingerprint.astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _shared_prefill_program(
    graphdef,
    static: StaticSettings,
    state,
    head_ids,
    head_mask,
    row_head,
    input_ids,
    attention_mask,
    row_keys,
    row_mask,
    temperature,
    table,
    stop_lens,
    eos_ids,
):
    """``_prefill_program`` with shared heads (``prompt_heads``): prefills the H heads [H, Th] once,
    copies head ``row_head[b]``'s KV into row b, then ``extend``s each row by its suffix [Bb, Ts]. The
    cache has the plain path's S = Th + Ts + M columns and index Th + Ts, so decoding is unchanged."""
    actor = nnx.merge(graphdef, state)
    th = head_ids.shape[1]
    _, heads = actor.prefill(head_ids, head_mask, actor.init_cache(head_ids.shape[0], th))
    wide = static.cache_length - th

    def rows(a, axis):  # head KV per row, widened to the S cache columns
        a = jnp.take(a, row_head, axis=0)
        return jnp.pad(a, [(0, wide) if d == axis else (0, 0) for d in range(a.ndim)])

    cache = heads.replace(
        k=tuple(rows(a, 3) for a in heads.k),
        v=tuple(rows(a, 2) for a in heads.v),
        slot_mask=rows(heads.slot_mask, 1),
        lengths=jnp.take(heads.lengths, row_head, axis=0),
    )
    out, cache = actor.extend(input_ids, attention_mask, cache)
    return (*_first_token(static, out, row_keys, row_mask, temperature, table, stop_lens, eos_ids), cache)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _decode_program(
    graphdef,
    static: StaticSettings,
    state,
    cache,
    first_token,
    first_logp,
    done,
    stop_state,
    row_keys,
    row_mask,
    temperature,
    table,
    stop_lens,
    eos_ids,
):
    """The decode loop (``lax.while_loop``) from the prefilled cache (donated: updated in place)."""
    actor = nnx.merge(graphdef, state)
    b = first_token.shape[0]
    m = static.max_new_tokens
    keys = row_keys
    tokens = jnp.full((b, m), static.pad_id, jnp.int32).at[:, 0].set(first_token)
    logps = jnp.zeros((b, m), jnp.float32).at[:, 0].set(first_logp)
    lengths = row_mask.astype(jnp.int32)

    def cond(carry):
        i, _, _, _, _, done, _, _ = carry
        return (i < m) & ~jnp.all(done)

    def body(carry):
        i, cache, tokens, logps, lengths, done, stop_state, last = carry
        logits, cache = actor.decode_step(last, cache)
        token, logp = _draw(static, logits, keys, i, temperature)
        token = jnp.where(done, static.pad_id, token)
        logp = jnp.where(done, 0.0, logp)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], i, axis=1)
        logps = jax.lax.dynamic_update_slice_in_dim(logps, logp[:, None], i, axis=1)
        lengths = lengths + (~done).astype(jnp.int32)
        new_state, hit = _advance_stop(table, stop_lens, stop_state, token)
        is_eos = jnp.any(token[:, None] == eos_ids[None, :], axis=-1)
        stop_state = jnp.where(done[:, None], stop_state, new_state)
        done = done | is_eos | hit
        return i + 1, cache, tokens, logps, lengths, done, stop_state, token

    carry = (jnp.int32(1), cache, tokens, logps, lengths, done, stop_state, first_token)
    _, cache, tokens, logps, lengths, _, _, _ = jax.lax.while_loop(cond, body, carry)
    return tokens, logps, lengths, cache


def batch_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a sampler batch is split over: ("data", "fsdp") where present, else all (none without a mesh)."""
    if mesh is None:
        return ()
    return tuple(a for a in ("data", "fsdp") if a in mesh.axis_names) or tuple(mesh.axis_names)


def prefill_spec(
    graphdef, state, static: StaticSettings, mesh, *, batch: int, stop_table_shape: tuple[int, int, int], num_eos: int
) -> ProgramSpec:
    """The prefill program ``(graphdef, static, state, input_ids, attention_mask, row_keys uint32[Bb, 2],
    row_mask, temperature, stop_table, stop_lens, eos_ids) -> (token, logp, done, stop_state, fingerprint,
    cache)``; row b draws from its own key ``row_keys[b]`` (raw key data).

    Args:
      graphdef, state: ``nnx.split(actor)`` (state: arrays or ``jax.ShapeDtypeStruct``s with shardings).
      static: the compile-time settings; the prompt bucket T is ``static.cache_length - max_new_tokens``.
      mesh: the sampler's mesh (rows split over ``batch_axes(mesh)``), or None (default placement).
      batch: the padded batch size Bb (a multiple of the batch axes' size).
      stop_table_shape: (S, Q, V) of the stop-string table; num_eos: the EOS ids' count.
    """
    t = static.cache_length - static.max_new_tokens
    ids = _sds(mesh, (batch, t), jnp.int32)
    args = (graphdef, static, abstract(state), ids, ids, *_row_args(mesh, batch, stop_table_shape, num_eos))
    return ProgramSpec("prefill", _prefill_program, args, static_argnums=(0, 1))


def shared_prefill_spec(
    graphdef,
    state,
    static: StaticSettings,
    mesh,
    *,
    batch: int,
    heads: int,
    head_width: int,
    stop_table_shape: tuple[int, int, int],
    num_eos: int,
) -> ProgramSpec:
    """The shared-head prefill ``(graphdef, static, state, head_ids int32[H, Th], head_mask, row_head
    int32[Bb], input_ids int32[Bb, Ts], attention_mask, row_keys, row_mask, temperature, stop_table,
    stop_lens, eos_ids)`` with ``prefill_spec``'s outputs; Ts = T - ``head_width`` (T the prompt
    bucket of ``static``), ``heads`` = H. Head arrays are replicated (the mesh's batch axes must be 1)."""
    t = static.cache_length - static.max_new_tokens
    head_ids = _sds(mesh, (heads, head_width), jnp.int32, rows=False)
    ids = _sds(mesh, (batch, t - head_width), jnp.int32)
    row_head = _sds(mesh, (batch,), jnp.int32)
    args = (graphdef, static, abstract(state), head_ids, head_ids, row_head, ids, ids)
    args += _row_args(mesh, batch, stop_table_shape, num_eos)
    return ProgramSpec("prefill", _shared_prefill_program, args, static_argnums=(0, 1))


def _sds(mesh, shape, dtype, rows=True):
    """An abstract argument: rows split over the mesh's batch axes (or replicated), none without a mesh."""
    if mesh is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    spec = P(batch_axes(mesh) or None, *[None] * (len(shape) - 1)) if rows else P()
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _row_args(mesh, batch: int, stop_table_shape, num_eos: int) -> tuple:
    """Both prefill programs' trailing arguments: row keys, row mask, temperature and the stop/EOS constants."""
    return (
        _sds(mesh, (batch, 2), jnp.uint32),
        _sds(mesh, (batch,), jnp.bool_),
        _sds(mesh, (), jnp.float32, rows=False),
        _sds(mesh, tuple(stop_table_shape), jnp.int32, rows=False),
        _sds(mesh, (stop_table_shape[0],), jnp.int32, rows=False),
        _sds(mesh, (num_eos,), jnp.int32, rows=False),
    )


def decode_spec(prefill: ProgramSpec, first) -> ProgramSpec:
    """The decode loop ``(graphdef, static, state, cache, first_token, first_logp, done, stop_state, row_keys,
    row_mask, temperature, stop_table, stop_lens, eos_ids) -> (tokens int32[Bb, M], logprobs
    float32[Bb, M], lengths int32[Bb], cache)``, the cache donated (updated in place).

    ``first``: the outputs of ``prefill`` (arrays, or ShapeDtypeStructs with the compiled prefill's
    output shardings); the other arguments are ``prefill``'s.
    """
    token, logp, done, stop_state, _, cache = abstract(first)
    g, st, state = prefill.args[:3]
    row_keys, row_mask, temp, table, stop_lens, eos = prefill.args[-6:]  # both prefill programs end so
    args = (g, st, state, cache, token, logp, done, stop_state, row_keys, row_mask, temp, table, stop_lens, eos)
    return ProgramSpec("decode", _decode_program, args, static_argnums=(0, 1), donate_argnums=(3,))


# ---------------------------------------------------------------------------------------------------
# The sampler.


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


class Sampler:
    """Samples responses for a batch of prompts from the actor's KV cache, compiled per bucket.

    Args:
      tokenizer: a ``transformers`` tokenizer (or any object with ``len()``, ``convert_ids_to_tokens``
        / ``decode``, ``eos_token_id``, ``pad_token_id``); used on the host only, once, for the EOS ids
        and the stop-string table.
      config: ``SamplerConfig``.
      mesh: optional ``jax.sharding.Mesh``; the batch is sharded over those of its axes ``("data",
        "fsdp")`` (else over all of them) and the padded batch is rounded up to a multiple of their
        total size. ``None``: default device placement.

    Raises:
      ValueError: no EOS id can be found (tokenizer without ``eos_token_id`` and none configured).
    """

    def __init__(self, tokenizer, config: SamplerConfig, mesh: jax.sharding.Mesh | None = None):
        if not isinstance(config, SamplerConfig):
            raise TypeError(f"Sampler config must be a SamplerConfig, got {type(config).__name__}")
        self.config = config
        self.tokenizer = tokenizer
        self.mesh = mesh
        eos = config.eos_token_ids if config.eos_token_ids is not None else _default_eos_ids(tokenizer)
        if not eos:
            raise ValueError(
                "Sampler: no EOS token id: the tokenizer has no eos_token_id; set SamplerConfig.eos_token_ids"
            )
        self.eos_token_ids = tuple(int(e) for e in eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else self.eos_token_ids[0]
        self.vocab_size = len(tokenizer)
        self._table = stop_string_table(token_byte_texts(tokenizer), config.stop_strings)
        self._stop_lens = np.array([len(s.encode("utf-8")) for s in config.stop_strings], np.int32)
        self.batch_axes = batch_axes(mesh)
        self._dp = int(np.prod([mesh.shape[a] for a in self.batch_axes])) if mesh is not None else 1
        self._device_consts: dict[int, tuple] = {}
        #: Seconds and token counts of the last ``generate`` call (prefill and decode timed apart).
        self.last_timing: dict[str, float] = {}

    # -- host helpers ---------------------------------------------------------------------------
    def batch_bucket(self, n: int) -> int:
        """The padded batch size for ``n`` prompts (n <= the largest bucket), a multiple of the mesh's
        batch size."""
        b = next((x for x in self.config.batch_buckets if x >= n), self.config.batch_buckets[-1])
        return -(-b // self._dp) * self._dp

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

    def _put(self, x, spec):
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def _consts(self, vocab: int):
        """Device copies of (stop table [S, Q, V], stop lengths [S], EOS ids), per model vocabulary V."""
        if vocab not in self._device_consts:
            rep = P()
            self._device_consts[vocab] = (
                self._put(_padded_table(self._table, vocab), rep),
                self._put(self._stop_lens, rep),
                self._put(np.asarray(self.eos_token_ids, np.int32), rep),
            )
        return self._device_consts[vocab]

    def _validate(self, prompts, vocab: int):
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

    # -- the call ---------------------------------------------------------------------------------
    def generate(
        self,
        actor: nnx.Module,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        row_keys: jax.Array | None = None,
        groups: Sequence[int] | None = None,
    ) -> SampleOutput:
        """Samples one response per prompt.

        Args:
          actor: the current policy (a ``Qwen2Actor`` or any module with ``init_cache``, ``prefill``,
            ``decode_step`` of the same contract); passed each call because its parameters change.
          prompts: B token-id lists (any lengths up to the largest length bucket).
          key: a ``jax.random`` key; without ``row_keys``, row b draws from ``fold_in(fold_in(key, b), step)``.
          row_keys: optional per-prompt keys, [B] typed keys or uint32[B, 2] key data; row b then draws
            from ``fold_in(row_keys[b], step)`` (``key`` unused), so its tokens depend on its own key
            and prompt only.
          groups: optional B ints; with ``config.shared_head_tokens`` > 0, rows of one group prefill
            their common prompt head once (``prompt_heads.plan_heads``; the rollout passes task groups).

        Returns:
          ``SampleOutput`` of NumPy arrays with B rows in prompt order.

        Raises:
          TypeError / ValueError: malformed prompts (empty, not 1-D, ids outside the vocabulary),
            a prompt longer than the largest length bucket, ``row_keys`` not of B keys, ``groups``
            not of B ints.
        """
        temp = self.config.temperature
        vocab = self._actor_vocab(actor)
        arrays = self._validate(prompts, vocab)
        keys = self.row_key_data(key, len(arrays), row_keys)
        t_bucket = self.length_bucket(max(a.size for a in arrays))
        chunk = self.config.batch_buckets[-1]
        graphdef, state = nnx.split(actor)
        if groups is not None and len(groups) != len(arrays):
            raise ValueError(f"groups must hold one int per prompt ({len(arrays)}), got {len(groups)}")
        tokens = float(sum(a.size for a in arrays))
        # prefill_tokens: real tokens prefilled (below prompt_tokens when heads are shared)
        self.last_timing = dict(prefill_s=0.0, decode_s=0.0, prompt_tokens=tokens, prefill_tokens=0.0, new_tokens=0.0)
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            parts = [
                self._generate_chunk(
                    graphdef,
                    state,
                    arrays[s : s + chunk],
                    keys[s : s + chunk],
                    t_bucket,
                    temp,
                    vocab,
                    None if groups is None else groups[s : s + chunk],
                )
                for s in range(0, len(arrays), chunk)
            ]
        return SampleOutput(*(np.concatenate(f, axis=0) for f in zip(*parts)))

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

    @staticmethod
    def _actor_vocab(actor) -> int:
        """V, the width of the actor's logits (``actor.config.vocab_size``)."""
        vocab = getattr(getattr(actor, "config", None), "vocab_size", None)
        if not isinstance(vocab, (int, np.integer)) or vocab < 1:
            raise ValueError(f"actor.config.vocab_size must be a positive int (the logits width), got {vocab!r}")
        return int(vocab)

    def _head_batch(self, plan, b_bucket: int) -> tuple[np.ndarray, np.ndarray]:
        """The plan's heads left-padded into (head_ids, head_mask) int32[H_bucket, Th]; H_bucket is the
        batch bucket of H (at most the rows' bucket); padding heads hold one pad token."""
        h = len(plan.heads)
        rows = min(self.batch_bucket(h), b_bucket)
        ids = np.full((rows, plan.head_width), self.pad_id, np.int32)
        mask = np.zeros((rows, plan.head_width), np.int32)
        for i, a in enumerate(plan.heads):
            ids[i, plan.head_width - a.size :] = a
            mask[i, plan.head_width - a.size :] = 1
        mask[h:, -1] = 1
        return ids, mask

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
        row_mask = np.arange(b_bucket) < n
        return ids, mask, row_mask

    def head_plan(self, arrays: Sequence[np.ndarray], groups: Sequence[int] | None, t_bucket: int):
        """The shared-head plan of one batch chunk (``prompt_heads.plan_heads``), or None for a plain prefill:
        sharing off, no groups, or a batch-sharded mesh (a head's rows would sit on other devices)."""
        if not self.config.shared_head_tokens or groups is None or self._dp != 1:
            return None
        b_bucket = self.batch_bucket(len(arrays))
        min_tokens = self.config.shared_head_tokens
        return prompt_heads.plan_heads(
            arrays, groups, t_bucket, b_bucket, min_tokens=min_tokens, head_bucket=self.batch_bucket
        )

    def _generate_chunk(self, graphdef, state, arrays, keys, t_bucket, temp, vocab, groups=None):
        cfg = self.config
        n = len(arrays)
        plan = self.head_plan(arrays, groups, t_bucket)
        if plan is None:
            ids, mask, row_mask = self.prepare_batch(arrays, t_bucket)
            self.last_timing["prefill_tokens"] += float(sum(a.size for a in arrays))
        else:
            suffixes = [a[h:] for a, h in zip(arrays, plan.split)]
            ids, mask, row_mask = self.prepare_batch(suffixes, plan.suffix_width)
            run = sum(a.size for a in suffixes) + sum(h.size for h in plan.heads)
            self.last_timing["prefill_tokens"] += float(run)
        b_bucket = ids.shape[0]
        row_keys = np.zeros((b_bucket, 2), np.uint32)
        row_keys[:n] = keys
        static = StaticSettings.of(cfg, t_bucket, self.pad_id, min(self.vocab_size, vocab))
        consts = self._consts(vocab)
        ids, mask, row_keys_d, row_mask_d = (
            self._put(x, P(self.batch_axes or None, *[None] * (x.ndim - 1))) for x in (ids, mask, row_keys, row_mask)
        )
        temp_d = jnp.float32(temp)
        kw = dict(batch=b_bucket, stop_table_shape=consts[0].shape, num_eos=len(consts[2]))
        if plan is None:
            pre = prefill_spec(graphdef, state, static, self.mesh, **kw)
            head_args = ()
        else:
            head_ids, head_mask = self._head_batch(plan, b_bucket)
            row_head = np.zeros((b_bucket,), np.int32)
            row_head[:n] = plan.row_head
            heads = head_ids.shape[0]
            pre = shared_prefill_spec(graphdef, state, static, self.mesh, heads=heads, head_width=plan.head_width, **kw)
            rows = P(self.batch_axes or None)
            head_args = (self._put(head_ids, P()), self._put(head_mask, P()), self._put(row_head, rows))
        t0 = time.perf_counter()
        first = pre(graphdef, static, state, *head_args, ids, mask, row_keys_d, row_mask_d, temp_d, *consts)
        token, logp, done, stop_state, fingerprint, cache = first
        token.block_until_ready()
        t1 = time.perf_counter()
        if cfg.max_new_tokens > 1:
            dec = decode_spec(pre, first)
            args = (token, logp, done, stop_state, row_keys_d, row_mask_d, temp_d, *consts)
            tokens, logps, lengths, cache = dec(graphdef, static, state, cache, *args)
        else:
            tokens, logps, lengths = token[:, None], logp[:, None], row_mask_d.astype(jnp.int32)
        del cache
        tokens, logps, lengths, fingerprint = jax.device_get((tokens, logps, lengths, fingerprint))
        t2 = time.perf_counter()
        self.last_timing["prefill_s"] += t1 - t0
        self.last_timing["decode_s"] += t2 - t1
        self.last_timing["new_tokens"] += float(lengths[:n].sum())
        return (
            np.asarray(tokens[:n], np.int32),
            np.asarray(lengths[:n], np.int32),
            np.asarray(logps[:n], np.float32),
            np.asarray(fingerprint[:n], np.float32),
        )
