"""Pure token filtering and drawing: the per-step sampling rule of every sampler program.

Per row, per step, in the order Hugging Face's logits processors apply them: ``logits / temperature``
-> keep the ``top_k`` largest -> keep the smallest set of most likely tokens whose probability mass
reaches ``top_p`` -> draw with the Gumbel-max trick from ``fold_in(row_key, step)``. When top-k and
top-p are off nothing is sorted or bisected: the Gumbel draw reads the scaled logits directly.

Shape letters: B rows, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bipace_jax.models.attention import device_platform

__all__ = ["filter_logits", "first_argmax", "sample_tokens"]


def filter_logits(
    logits: jax.Array, *, top_k: int = 0, top_p: float | jax.Array = 1.0, cpu: bool | None = None
) -> jax.Array:
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

      cpu: static; the schedule, same kept set either way. True (XLA's CPU backend, whose sort calls a
        comparator per comparison, docs/performance.md): both thresholds by a 32-step bisection loop.
        False (accelerators, where each loop step would be a kernel and a host sync): the top-k
        threshold by ``lax.top_k`` of the keys, the nucleus bisection unrolled. None: True on CPU
        (``attention.device_platform``).

    Each threshold is found over order-preserving int32 keys of the logits; the top-k set is exactly
    ``lax.top_k``'s. The nucleus is found by bisection (32 masked sums over V; unrolled off CPU, so
    no loop), the sorted rule's up to float summation order.
    """
    v = logits.shape[-1]
    apply_p = not (isinstance(top_p, (int, float)) and top_p >= 1.0)
    if top_k <= 0 and not apply_p:
        return logits
    cpu = device_platform() == "cpu" if cpu is None else cpu
    key = _order_key(logits)
    lo = jnp.min(key, axis=-1, keepdims=True)
    hi = jnp.max(key, axis=-1, keepdims=True)
    if 0 < top_k < v and not cpu:
        # The k-th largest key (with multiplicity) is the bisection's threshold exactly.
        t_k = jax.lax.top_k(key, top_k)[0][..., -1:]
        logits = jnp.where(key >= t_k, logits, -jnp.inf)
        key = jnp.where(key >= t_k, key, _order_key(jnp.float32(-jnp.inf)))
        lo = t_k
    elif 0 < top_k < v:
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

        _, t_p = jax.lax.fori_loop(0, 32, nucleus, (lo, hi), unroll=not cpu)
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
