"""The Qwen2 / Qwen2.5 decoder in Flax NNX: logits and BiPACE fingerprints from one forward pass.

Architecture (the HF `Qwen2ForCausalLM` computation):
  x_0 = E[ids]                                         token embedding                [B, T, D]
  for l in 1..L:   h = RMSNorm(x)                       (fp32 statistics)
                   x = x + Attn(h)                       GQA, RoPE, q/k/v bias, no o bias
                   x = x + W_down(silu(W_gate h) * W_up h)   SwiGLU, no bias
  logits = RMSNorm(x_L) @ E^T  (tied)  or  @ W_head    computed and returned in fp32  [B, T, V]

Attention (grouped-query, K/V never repeated) is `bipace_jax.models.attention.attention`; the KV
cache keeps keys as [B, K, Hd, S] (slots minor) and values as [B, K, S, Hd], so both decode
contractions read the cache as it lies. Parameters carry their logical axes as metadata where they
are created (`nnx.Param(..., logical_axes=...)`), which `bipace_jax.sharding.param_shardings` reads.

Prefill runs the last layer's attention output and MLP only at each row's last real token (its
keys/values still cover every column): the next-token logits and a final-layer fingerprint need
nothing else.

Positions come from the attention mask, as HF `generate()` computes them: a token's position is
the number of real tokens before it in its row, so left and right padding give the same result.

Hidden states follow HF's `output_hidden_states` convention: index 0 is the embedding output,
index i (1 <= i < L) the residual stream after layer i, index L (= -1) the final normed state.
The fingerprint (BiPACE) is hidden state `fingerprint_layer` at one column per row (default: the
row's last real token), L2-normalised in fp32.

Dtypes: parameters are stored in `param_dtype`, matmuls and the residual stream run in `dtype`
(bf16 on accelerators); RMSNorm statistics, attention softmax and the logits are fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bipace_jax.models.attention import device_platform
from bipace_jax.models.config import MatmulPrecision, Qwen2Config, Remat
from bipace_jax.models.kv_cache import KVCache, write_per_row
from bipace_jax.models.layers import (
    DecoderLayer,
    Embed,
    Proj,
    RMSNorm,
    constrain,
    cpu_dense_gradient,
    dense,
    last_real_index,
    normal_init,
    param_value,
    positions_from_mask,
    positions_in_segments,
    rope_cos_sin,
)

__all__ = ["ActorOutput", "KVCache", "Qwen2Actor"]

Array = jax.Array


def _remat(fn: Callable, policy: Remat) -> Callable:
    """``fn`` under the ``Remat`` policy (``jax.checkpoint``)."""
    if policy is Remat.NONE:
        return fn
    saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if policy is Remat.SAVE_DOTS else None
    return jax.checkpoint(fn, policy=saveable, prevent_cse=False)


def _with_precision(method):
    """Traces ``method`` under the actor's ``matmul_precision`` (every dot of the forward, decode and head)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if self.matmul_precision == MatmulPrecision.DEFAULT:
            return method(self, *args, **kwargs)
        with jax.default_matmul_precision(str(self.matmul_precision)):  # jax's option takes a plain str
            return method(self, *args, **kwargs)

    return wrapped


@flax.struct.dataclass
class ActorOutput:
    """Output of `Qwen2Actor`.

    Attributes:
      logits: float32 [B, T, V] from `__call__`; float32 [B, V] (at each row's last real prompt
        token) from `prefill`.
      fingerprint: float32 [B, D], hidden state `fingerprint_layer` at `fingerprint_index`,
        L2-normalised.
      hidden_states: only with `output_hidden_states=True`: tuple of L+1 float32 [B, T, D] in HF's
        convention (0 = embeddings, L = final normed state); None otherwise.
    """

    logits: Array
    fingerprint: Array
    hidden_states: tuple[Array, ...] | None = None


class Qwen2Actor(nnx.Module):
    """Qwen2 / Qwen2.5 causal LM that returns logits and a BiPACE fingerprint from one forward.

    Args:
      config: the `Qwen2Config`.
      fingerprint_layer: HF hidden-state index of the fingerprint, in [-(L+1), L] (0 = embeddings,
        -1 = final normed state; the paper uses -8 for 7B and -12 for 1.5B).
      dtype: activation/matmul dtype (jnp.bfloat16 on accelerators).
      param_dtype: parameter storage dtype.
      rngs: initialiser keys (weights ~ N(0, initializer_range), biases 0, norm scales 1).
      matmul_precision: precision of every matmul of the actor (a ``models.config.MatmulPrecision``), for all
        paths alike (sampling, log-probs, the loss): ``"default"`` is the backend's fast mode
        (bf16 passes on TPU, TF32 on NVIDIA GPUs, full fp32 on CPU), ``"high"`` (3 bf16 passes on
        TPU), ``"highest"`` (full fp32). Settable later, before the next trace.
      remat: what each decoder layer keeps for the backward pass of `__call__` / `forward_hidden`
        (a ``models.config.Remat``: "none", "full" = only the layer input, one extra forward; "save_dots" =
        the matmul outputs); True means "full", False "none". Outputs and gradients are unchanged.
        Settable later (`actor.remat = "full"`), before the next trace.
      scan_layers: run runs of identical decoder layers as one `lax.scan` over their stacked
        parameters in the full forward and the prefill (compile time flat in depth: one layer body
        instead of L; the parameters stay stored per layer). Same values. Settable later.

    Params: embed.embedding [V, D]; layers[i] (see `DecoderLayer`); final_norm.scale [D];
    lm_head.kernel [D, V] only when the head is untied.

    Raises:
      ValueError: fingerprint_layer out of range, config not a Qwen2Config, or an unknown
        matmul_precision or remat policy.
    """

    def __init__(
        self,
        config: Qwen2Config,
        *,
        fingerprint_layer: int = -1,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs | None = None,
        remat: bool | str = Remat.NONE,
        matmul_precision: str = MatmulPrecision.DEFAULT,
        scan_layers: bool = False,
    ):
        if not isinstance(config, Qwen2Config):
            raise ValueError(f"Qwen2Actor: config must be a Qwen2Config, got {type(config).__name__}")
        n_layers = config.num_hidden_layers
        if not isinstance(fingerprint_layer, (int, np.integer)) or not -(n_layers + 1) <= fingerprint_layer <= n_layers:
            raise ValueError(
                f"Qwen2Actor: fingerprint_layer must be an int in [{-(n_layers + 1)}, {n_layers}] "
                f"(HF hidden_states index, L={n_layers}), got {fingerprint_layer!r}"
            )
        self.remat = remat
        self.remat_policy  # noqa: B018 (validates remat)
        try:
            self.matmul_precision = MatmulPrecision(matmul_precision)
        except ValueError:
            choices = tuple(m.value for m in MatmulPrecision)
            raise ValueError(
                f"Qwen2Actor: matmul_precision must be one of {choices}, got {matmul_precision!r}"
            ) from None
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.scan_layers = bool(scan_layers)
        self.config = config
        self.fingerprint_layer = int(fingerprint_layer)
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.embed = Embed(
            normal_init(config.initializer_range)(
                rngs.params(), (config.vocab_size, config.hidden_size), self.param_dtype
            )
        )
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs, **kw) for _ in range(n_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        if not config.tie_word_embeddings:
            self.lm_head = Proj(
                normal_init(config.initializer_range)(
                    rngs.params(), (config.hidden_size, config.vocab_size), self.param_dtype
                ),
                ("embed", "vocab"),
            )

    # ----------------------------------------------------------------------------------------------
    @property
    def fingerprint_hidden_index(self) -> int:
        """The fingerprint's hidden-state index as a non-negative int in [0, L]."""
        n = self.config.num_hidden_layers
        return self.fingerprint_layer % (n + 1)

    def _embed(self, ids: Array) -> Array:
        # Out-of-range ids give NaN rows (mode="fill"), never a silently clamped token.
        table = param_value(self.embed.embedding)
        x = jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)
        return constrain(x.astype(self.dtype), "hidden")

    @_with_precision
    def lm_logits(self, h: Array) -> Array:
        """LM head: final normed hidden states h [..., D] (any float dtype) -> fp32 logits [..., V].

        Use with `forward_hidden` to compute logits (or log-probabilities) chunk by chunk over T
        when [B, T, V] in fp32 would not fit.
        """
        h = h.astype(self.dtype)
        f32 = jnp.float32
        if self.config.tie_word_embeddings:
            w = param_value(self.embed.embedding, self.dtype)
            if cpu_dense_gradient():
                return dense(h, w.T, preferred_element_type=f32)
            return jnp.einsum("...d,vd->...v", h, w, preferred_element_type=f32)
        w = param_value(self.lm_head.kernel, self.dtype)
        if cpu_dense_gradient():
            return dense(h, w, preferred_element_type=f32)
        return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=f32)

    def _check_tokens(self, input_ids: Any, attention_mask: Any, where: str):
        ids_shape = np.shape(input_ids)
        mask_shape = np.shape(attention_mask)
        if len(ids_shape) != 2:
            raise ValueError(f"{where}: input_ids must be int32[B, T], got shape {ids_shape}")
        if mask_shape != ids_shape:
            raise ValueError(f"{where}: attention_mask shape {mask_shape} must equal input_ids shape {ids_shape}")
        if not jnp.issubdtype(jnp.result_type(input_ids), jnp.integer):
            raise ValueError(f"{where}: input_ids must be an integer array, got {jnp.result_type(input_ids)}")
        mdt = jnp.result_type(attention_mask)
        if not (jnp.issubdtype(mdt, jnp.integer) or mdt == jnp.bool_):
            raise ValueError(f"{where}: attention_mask must be int or bool, got {mdt}")
        if isinstance(input_ids, np.ndarray) and isinstance(attention_mask, np.ndarray) and input_ids.size:
            real = input_ids[attention_mask.astype(bool)]
            if real.size and (real.min() < 0 or real.max() >= self.config.vocab_size):
                raise ValueError(
                    f"{where}: input_ids at real tokens must lie in [0, {self.config.vocab_size}), "
                    f"got [{real.min()}, {real.max()}]"
                )
        if isinstance(attention_mask, np.ndarray) and attention_mask.size:
            if not np.all(attention_mask.astype(bool).any(axis=1)):
                bad = int(np.flatnonzero(~attention_mask.astype(bool).any(axis=1))[0])
                raise ValueError(f"{where}: attention_mask row {bad} has no real token")

    def _fingerprint(self, h: Array, index: Array) -> Array:
        """h [B, T, D] at column index [B] -> L2-normalised fp32 [B, D]."""
        rows = jnp.take_along_axis(h, index[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        rows = rows.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(rows * rows, axis=-1, keepdims=True))
        return rows / jnp.maximum(norm, 1e-12)

    def _run(
        self,
        input_ids: Array,
        attention_mask: Array,
        fingerprint_index: Array,
        output_hidden_states: bool,
        last_query_only: bool = False,
        segment_ids: Array | None = None,
        query_index: Array | None = None,
    ):
        """Full causal forward over [B, T]; returns (final normed h, fingerprint, hidden, ks, vs).

        With `last_query_only` (prefill), the last layer runs its attention output and MLP only at
        column `fingerprint_index` of each row (every layer's keys/values still cover all T): h is
        [B, 1, D] and the fingerprint, if taken from the final state, is read there.

        With `segment_ids` int32 [B, T] (packed rows, `forward_packed`): a column attends the
        columns up to it with the same id, positions restart at 0 where the id changes, and
        `attention_mask` is ``segment_ids > 0``.

        With `query_index` int32 [B, Q] (the learner's head columns), the last layer runs its
        attention output and MLP only at those columns (keys/values still cover all T): h is
        [B, Q, D], the fingerprint None if it is read from the final state.
        """
        mask = attention_mask.astype(bool)
        t = input_ids.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        if segment_ids is None:
            positions = positions_from_mask(mask)
            attn_mask = causal[None] & mask[:, None, :]
        else:
            positions = positions_in_segments(segment_ids)
            # padding (id 0) attends padding: every query column keeps at least itself (no empty softmax)
            attn_mask = causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, num_positions=t)
        fp_at = self.fingerprint_hidden_index
        n_layers = self.config.num_hidden_layers
        # Padding columns may hold any id (e.g. -1): they are read as token 0 and masked out.
        x = self._embed(jnp.where(mask, input_ids, 0))
        hidden = [x] if output_hidden_states else None
        fingerprint = self._fingerprint(x, fingerprint_index) if fp_at == 0 else None
        ks, vs = [], []
        policy = self.remat_policy
        last_only = last_query_only or query_index is not None
        n_full = n_layers - 1 if last_only else n_layers  # layers run over every column
        if self.scan_layers and not output_hidden_states:
            # One scan per run of layers, cut at the fingerprint's layer so it is read between two.
            cuts = sorted({0, n_full} | ({fp_at} if 0 < fp_at < n_full else set()))
            for a, b in zip(cuts[:-1], cuts[1:]):
                x, k, v = self._scan_layers(a, b, x, cos, sin, attn_mask, policy, keep_kv=last_query_only)
                if last_query_only:
                    ks.extend(k[j] for j in range(b - a))
                    vs.extend(v[j] for j in range(b - a))
                if fp_at == b and b < n_layers:
                    fingerprint = self._fingerprint(x, fingerprint_index)
        else:
            for i, layer in enumerate(list(self.layers)[:n_full]):
                if policy is Remat.NONE:
                    x, k, v = layer(x, cos, sin, attn_mask, causal=True)
                else:
                    x, k, v = _layer_fn(nnx.graphdef(layer), policy, True)(nnx.state(layer), x, cos, sin, attn_mask)
                ks.append(k)
                vs.append(v)
                if i + 1 < n_layers:
                    if output_hidden_states:
                        hidden.append(x)
                    if fp_at == i + 1:
                        fingerprint = self._fingerprint(x, fingerprint_index)
        if last_query_only:
            x, k, v = self.layers[n_layers - 1](x, cos, sin, attn_mask, query_index=fingerprint_index)
            ks.append(k)
            vs.append(v)
        elif query_index is not None:
            last = self.layers[n_layers - 1]
            x = _query_layer_fn(nnx.graphdef(last), policy)(nnx.state(last), x, cos, sin, attn_mask, query_index)
        h = self.final_norm(x)
        if output_hidden_states:
            hidden.append(h)
        if fp_at == n_layers and query_index is None:
            fingerprint = self._fingerprint(
                h, jnp.zeros_like(fingerprint_index) if last_query_only else fingerprint_index
            )
        return h, fingerprint, hidden, ks, vs

    def _scan_layers(self, a, b, x, cos, sin, mask, policy, *, keep_kv):
        """Layers [a, b) over x [B, T, D] as one `lax.scan` over their stacked parameters; returns
        (x, k, v) with k, v [b - a, B, T, K, Hd] when `keep_kv`, else None."""
        layers = list(self.layers)[a:b]
        # Cast before stacking: the stacked copy is the compute-dtype weights each layer uses anyway.
        stacked = jax.tree.map(
            lambda *w: jnp.stack([u.astype(self.dtype) if jnp.issubdtype(u.dtype, jnp.floating) else u for u in w]),
            *[nnx.state(layer) for layer in layers],
        )
        fn = _layer_fn(nnx.graphdef(layers[0]), policy, keep_kv)

        def step(x, state):
            x, k, v = fn(state, x, cos, sin, mask)
            return x, (k, v)

        x, (k, v) = jax.lax.scan(step, x, stacked)
        return x, k, v

    @property
    def remat_policy(self) -> Remat:
        """`remat` as a ``models.config.Remat`` (True -> FULL, False -> NONE).

        Raises:
          ValueError: `remat` is not a bool or a ``Remat`` value.
        """
        r = self.remat
        try:
            return (Remat.FULL if r else Remat.NONE) if isinstance(r, (bool, np.bool_)) else Remat(r)
        except ValueError:
            choices = tuple(m.value for m in Remat)
            raise ValueError(f"Qwen2Actor: remat must be a bool or one of {choices}, got {r!r}") from None

    # ----------------------------------------------------------------------------------------------
    def _prepare(self, input_ids, attention_mask, fingerprint_index, where):
        self._check_tokens(input_ids, attention_mask, where)
        input_ids = jnp.asarray(input_ids, jnp.int32)
        attention_mask = jnp.asarray(attention_mask)
        if fingerprint_index is None:
            fingerprint_index = last_real_index(attention_mask)
        elif np.shape(fingerprint_index) != (input_ids.shape[0],):
            raise ValueError(
                f"{where}: fingerprint_index must be int32[B={input_ids.shape[0]}], "
                f"got shape {np.shape(fingerprint_index)}"
            )
        return input_ids, attention_mask, jnp.asarray(fingerprint_index, jnp.int32)

    @_with_precision
    def __call__(
        self,
        input_ids: Array,
        attention_mask: Array,
        fingerprint_index: Array | None = None,
        *,
        output_hidden_states: bool = False,
    ) -> ActorOutput:
        """Full causal forward: logits for every column and the fingerprint, from one pass.

        Args:
          input_ids: int32 [B, T], token ids in [0, V) at real tokens (padding columns may hold
            any id). An out-of-range id at a real token gives NaN outputs for its row under jit
            (never a silently clamped token); a concrete NumPy input is checked and raises.
          attention_mask: int32 or bool [B, T], 1 for real tokens; padding on either side.
          fingerprint_index: int32 [B], the column of each row's fingerprint; default each row's
            last real token.
          output_hidden_states: also return the L+1 hidden states (HF convention) in fp32.

        Returns:
          ActorOutput(logits float32 [B, T, V], fingerprint float32 [B, D], hidden_states).

        Raises:
          ValueError: wrong ranks/shapes/dtypes; for NumPy inputs also ids out of range or a row
            without real tokens.
        """
        input_ids, attention_mask, fingerprint_index = self._prepare(
            input_ids, attention_mask, fingerprint_index, "Qwen2Actor.__call__"
        )
        h, fingerprint, hidden, _, _ = self._run(input_ids, attention_mask, fingerprint_index, output_hidden_states)
        logits = constrain(self.lm_logits(h), "logits")
        if output_hidden_states:
            hidden = tuple(a.astype(jnp.float32) for a in hidden)
        return ActorOutput(logits=logits, fingerprint=fingerprint, hidden_states=hidden)

    @_with_precision
    def forward_hidden(
        self,
        input_ids: Array,
        attention_mask: Array,
        fingerprint_index: Array | None = None,
        *,
        query_index: Array | None = None,
    ) -> tuple[Array, Array | None]:
        """The forward without the LM head: (final normed hidden [B, T, D] in `dtype`, fingerprint [B, D]).

        `lm_logits(h)` gives the logits; same arguments and errors as `__call__`. With `query_index`
        int32 [B, Q] only those columns of each row leave the last layer (its attention output and MLP
        run there alone; about 1/L of the forward and backward saved when Q << T): h is [B, Q, D], the
        same values as those columns of the full h up to float summation order, and the fingerprint is
        None when `fingerprint_layer` is the last.
        """
        input_ids, attention_mask, fingerprint_index = self._prepare(
            input_ids, attention_mask, fingerprint_index, "Qwen2Actor.forward_hidden"
        )
        if query_index is not None and (np.ndim(query_index) != 2 or np.shape(query_index)[0] != input_ids.shape[0]):
            raise ValueError(
                f"Qwen2Actor.forward_hidden: query_index must be int32[B={input_ids.shape[0]}, Q], "
                f"got shape {np.shape(query_index)}"
            )
        qi = None if query_index is None else jnp.asarray(query_index, jnp.int32)
        h, fingerprint, _, _, _ = self._run(input_ids, attention_mask, fingerprint_index, False, query_index=qi)
        return h, fingerprint

    @_with_precision
    def forward_packed(self, input_ids: Array, segment_ids: Array, query_index: Array | None = None) -> Array:
        """The forward over packed lines, without the LM head: final normed hidden [B, T, D] in `dtype`
        ([B, Q, D] at the columns `query_index` int32 [B, Q] only, as in `forward_hidden`).

        Args:
          input_ids: int32 [B, T], several sequences per line, one after the other.
          segment_ids: int32 [B, T]: 1, 2, ... for the sequences of a line (each a contiguous run of
            columns), 0 for padding. A column attends only the columns before it in its own run, and
            its position (RoPE) counts from the run's start: every sequence gets the values it gets
            alone in a row (up to float summation order).

        Raises:
          ValueError: shapes differ or are not rank 2.
        """
        if np.ndim(input_ids) != 2 or np.shape(segment_ids) != np.shape(input_ids):
            raise ValueError(
                f"Qwen2Actor.forward_packed: input_ids and segment_ids must be int32[B, T] of one shape, "
                f"got {np.shape(input_ids)} and {np.shape(segment_ids)}"
            )
        seg = jnp.asarray(segment_ids, jnp.int32)
        b = seg.shape[0]
        qi = None if query_index is None else jnp.asarray(query_index, jnp.int32)
        h, _, _, _, _ = self._run(
            jnp.asarray(input_ids, jnp.int32),
            seg > 0,
            jnp.zeros((b,), jnp.int32),
            False,
            segment_ids=seg,
            query_index=qi,
        )
        return h

    # ----------------------------------------------------------------------------------------------
    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty `KVCache` with S = max_length slots for B = batch_size rows (k/v in `dtype`).

        k is a tuple of L arrays [B, K, Hd, S] and v of L arrays [B, K, S, Hd] (see `KVCache`).

        Raises:
          ValueError: batch_size or max_length not a positive int.
        """
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"Qwen2Actor.init_cache: {name} must be a positive int, got {value!r}")
        c = self.config
        shape = (batch_size, c.num_key_value_heads, max_length, c.head_dim)
        k_shape = (batch_size, c.num_key_value_heads, c.head_dim, max_length)
        k = tuple(constrain(jnp.zeros(k_shape, self.dtype), "cache_k") for _ in range(c.num_hidden_layers))
        v = tuple(constrain(jnp.zeros(shape, self.dtype), "cache_v") for _ in range(c.num_hidden_layers))
        return KVCache(
            k=k,
            v=v,
            slot_mask=jnp.zeros((batch_size, max_length), bool),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    @_with_precision
    def prefill(self, input_ids: Array, attention_mask: Array, cache: KVCache) -> tuple[ActorOutput, KVCache]:
        """Runs the prompt, fills cache slots [0, T) and returns the next-token logits.

        The cache is reset: prompt column j goes to slot j for every row, `slot_mask[:, :T]` =
        attention_mask, `lengths` = real tokens per row, `index` = T.

        Args:
          input_ids: int32 [B, T] prompt (padding on either side; left padding is what the
            sampler uses so that decoding appends at a shared slot).
          attention_mask: int32/bool [B, T].
          cache: a `KVCache` from `init_cache(B, S)` with S >= T.

        Returns:
          (ActorOutput(logits float32 [B, V] at each row's last real token, fingerprint float32
          [B, D] at the same token), the filled KVCache).

        Raises:
          ValueError: shape mismatch with the cache, or T > S.
        """
        self._check_tokens(input_ids, attention_mask, "Qwen2Actor.prefill")
        b, t = np.shape(input_ids)
        if cache.batch_size != b:
            raise ValueError(f"Qwen2Actor.prefill: cache batch {cache.batch_size} != input batch {b}")
        if t > cache.max_length:
            raise ValueError(f"Qwen2Actor.prefill: prompt length T={t} exceeds cache max_length S={cache.max_length}")
        input_ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.asarray(attention_mask).astype(bool)
        last = last_real_index(mask)
        # Only the last real token's logits are needed: the last layer runs its attention output
        # and MLP at that column alone, and the LM head sees [B, D], not [B, T, D].
        h, fingerprint, _, ks, vs = self._run(input_ids, mask, last, False, last_query_only=True)
        logits = constrain(self.lm_logits(h[:, 0]), "last_logits")
        # Each layer's [B, T, K, Hd] -> the cache layout (keys [B, K, Hd, T], values [B, K, T, Hd]),
        # zero-padded to S slots.
        pad = ((0, 0), (0, 0), (0, cache.max_length - t), (0, 0))
        k_pad = ((0, 0), (0, 0), (0, 0), (0, cache.max_length - t))
        dt = cache.k[0].dtype
        k = tuple(constrain(jnp.pad(jnp.transpose(x.astype(dt), (0, 2, 3, 1)), k_pad), "cache_k") for x in ks)
        v = tuple(constrain(jnp.pad(jnp.swapaxes(x.astype(dt), 1, 2), pad), "cache_v") for x in vs)
        slot_mask = jnp.zeros(cache.slot_mask.shape, bool).at[:, :t].set(mask)
        new_cache = KVCache(
            k=k,
            v=v,
            slot_mask=slot_mask,
            lengths=jnp.sum(mask, axis=1).astype(jnp.int32),
            index=jnp.asarray(t, jnp.int32),
        )
        return ActorOutput(logits=logits, fingerprint=fingerprint), new_cache

    @_with_precision
    def decode_step(self, token_ids: Array, cache: KVCache) -> tuple[Array, KVCache]:
        """Appends one token per row and returns the next-token logits.

        The token of row b gets position `cache.lengths[b]`, is written at slot `cache.index` (int32 []:
        the same slot for all rows; int32 [B]: row b at its own `cache.index[b]`, the continuous
        scheduler's slots) and attends to every slot with `slot_mask` True (including itself).

        Args:
          token_ids: int32 [B].
          cache: the `KVCache` from `prefill` or the previous `decode_step`; the caller keeps
            `cache.index < S` (a full cache cannot be checked inside jit: the write would clamp
            to the last slot).

        Returns:
          (logits float32 [B, V], KVCache with the slot written, lengths + 1, index + 1).

        Raises:
          ValueError: token_ids not of shape [B] matching the cache.
        """
        b = cache.batch_size
        if np.shape(token_ids) != (b,):
            raise ValueError(f"Qwen2Actor.decode_step: token_ids must be int32[B={b}], got shape {np.shape(token_ids)}")
        token_ids = jnp.asarray(token_ids, jnp.int32)
        index = cache.index
        per_row = jnp.ndim(index) == 1
        if per_row:
            slot_mask = cache.slot_mask | (jnp.arange(cache.max_length)[None, :] == index[:, None])
        else:
            slot_mask = jax.lax.dynamic_update_slice(cache.slot_mask, jnp.ones((b, 1), bool), (0, index))
        attn_mask = slot_mask[:, None, :]  # [B, 1, S]
        cos, sin = rope_cos_sin(
            cache.lengths[:, None], self.config.head_dim, self.config.rope_theta, num_positions=cache.max_length
        )
        x = self._embed(token_ids[:, None])
        k_all, v_all = list(cache.k), list(cache.v)
        scatter = device_platform() != "cpu"
        for i, layer in enumerate(self.layers):

            def kv_update(k, v, i=i):
                # Write the new token's k/v, [B, 1, K, Hd] -> k [B, K, Hd, 1], v [B, K, 1, Hd], at
                # (layer i, slot index) in place; attend over layer i's k [B, K, Hd, S], v [B, K, S, Hd].
                k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)
                if per_row:  # one slot per row: a loop of slice writes on CPU, a scatter on accelerators
                    k_all[i], v_all[i] = write_per_row(k_all[i], v_all[i], k, v, index, scatter=scatter)
                else:
                    k_all[i] = jax.lax.dynamic_update_slice(k_all[i], k.astype(k_all[i].dtype), (0, 0, 0, index))
                    v_all[i] = jax.lax.dynamic_update_slice(v_all[i], v.astype(v_all[i].dtype), (0, 0, index, 0))
                return k_all[i], v_all[i]

            x, _, _ = layer(x, cos, sin, attn_mask, kv_update=kv_update)
        h = self.final_norm(x)[:, 0]
        logits = constrain(self.lm_logits(h), "last_logits")
        k_new = tuple(constrain(a, "cache_k") for a in k_all)
        v_new = tuple(constrain(a, "cache_v") for a in v_all)
        new_cache = KVCache(k=k_new, v=v_new, slot_mask=slot_mask, lengths=cache.lengths + 1, index=index + 1)
        return logits, new_cache

    @_with_precision
    def extend(self, input_ids: Array, attention_mask: Array, cache: KVCache) -> tuple[ActorOutput, KVCache]:
        """Prefills T more prompt tokens per row on top of a filled cache (a shared prompt head).

        The chunk goes to slots [index, index + T) for all rows. Real token j of row b (mask 1) gets
        position `lengths[b]` + (real chunk tokens before it) and attends to the row's cached slots
        (`slot_mask`) and to the chunk's real tokens up to itself: the same attention sets and RoPE
        positions as a `prefill` of the row's whole prompt, so logits and fingerprint agree with it
        up to float summation order. Used by the sampler's shared-prefix prefill
        (docs/performance.md, "Shared prompt heads").

        Args:
          input_ids: int32 [B, T] the chunk (left padding keeps every row's last real token at
            column T - 1, where decoding continues from).
          attention_mask: int32/bool [B, T]; every row needs a real token.
          cache: a `KVCache` of B rows whose slots from `index` on are empty, with index + T <= S.

        Returns:
          (ActorOutput(logits float32 [B, V] and fingerprint float32 [B, D] at each row's last
          real chunk token), the KVCache with the chunk written, `lengths` + real chunk tokens,
          `index` + T).

        Raises:
          ValueError: shape mismatch with the cache, or T > S.
        """
        self._check_tokens(input_ids, attention_mask, "Qwen2Actor.extend")
        b, t = np.shape(input_ids)
        s = cache.max_length
        if cache.batch_size != b:
            raise ValueError(f"Qwen2Actor.extend: cache batch {cache.batch_size} != input batch {b}")
        if t > s:
            raise ValueError(f"Qwen2Actor.extend: chunk length T={t} exceeds cache max_length S={s}")
        input_ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.asarray(attention_mask).astype(bool)
        index = cache.index
        positions = cache.lengths[:, None] + positions_from_mask(mask)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, num_positions=s)
        slot_mask = jax.lax.dynamic_update_slice(cache.slot_mask, mask, (0, index))
        # Query j sees the cached slots before the chunk and the chunk's slots up to index + j.
        col = jnp.arange(s)[None, :]
        seen = (col < index) | (col <= index + jnp.arange(t)[:, None])  # [T, S]
        attn_mask = slot_mask[:, None, :] & seen[None]
        last = last_real_index(mask)
        fp_at = self.fingerprint_hidden_index
        n_layers = self.config.num_hidden_layers
        x = self._embed(jnp.where(mask, input_ids, 0))
        fingerprint = self._fingerprint(x, last) if fp_at == 0 else None
        k_all, v_all = list(cache.k), list(cache.v)
        for i, layer in enumerate(self.layers):

            def kv_update(k, v, i=i):
                # The chunk's [B, T, K, Hd] keys/values -> k [B, K, Hd, T], v [B, K, T, Hd] at slot index.
                k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)
                k_all[i] = jax.lax.dynamic_update_slice(k_all[i], k.astype(k_all[i].dtype), (0, 0, 0, index))
                v_all[i] = jax.lax.dynamic_update_slice(v_all[i], v.astype(v_all[i].dtype), (0, 0, index, 0))
                return k_all[i], v_all[i]

            # The last layer runs its attention output and MLP at the last real column only (as prefill).
            query_index = last if i == n_layers - 1 else None
            x, _, _ = layer(x, cos, sin, attn_mask, kv_update=kv_update, query_index=query_index)
            if 0 < i + 1 == fp_at < n_layers:
                fingerprint = self._fingerprint(x, last)
        h = self.final_norm(x)
        if fp_at == n_layers:
            fingerprint = self._fingerprint(h, jnp.zeros_like(last))
        logits = constrain(self.lm_logits(h[:, 0]), "last_logits")
        new_cache = KVCache(
            k=tuple(constrain(a, "cache_k") for a in k_all),
            v=tuple(constrain(a, "cache_v") for a in v_all),
            slot_mask=slot_mask,
            lengths=cache.lengths + jnp.sum(mask, axis=1).astype(jnp.int32),
            index=index + t,
        )
        return ActorOutput(logits=logits, fingerprint=fingerprint), new_cache


@functools.lru_cache(maxsize=64)
def _layer_fn(graphdef, policy: Remat, keep_kv: bool) -> Callable:
    """``fn(layer_state, x, cos, sin, mask) -> (x, k, v)``: one decoder layer of the full causal
    forward (`_run`'s mask is causal & padding) under the remat `policy`; k, v are None unless
    `keep_kv`."""

    def layer_fn(state, x, cos, sin, mask):
        x, k, v = nnx.merge(graphdef, state)(x, cos, sin, mask, causal=True)
        return (x, k, v) if keep_kv else (x, None, None)

    return _remat(layer_fn, policy)


@functools.lru_cache(maxsize=64)
def _query_layer_fn(graphdef, policy: Remat) -> Callable:
    """``fn(layer_state, x, cos, sin, mask, query_index) -> x [B, Q, D]``: the last decoder layer at
    the columns ``query_index`` int32 [B, Q] only (keys/values over all T), under the remat `policy`."""

    def layer_fn(state, x, cos, sin, mask, query_index):
        return nnx.merge(graphdef, state)(x, cos, sin, mask, query_index=query_index)[0]

    return _remat(layer_fn, policy)
