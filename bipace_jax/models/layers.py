"""The Qwen2 decoder's building blocks in Flax NNX: RoPE, RMSNorm, attention, MLP, decoder layer.

Every parameter declares its logical axes where it is created (`nnx.Param(..., logical_axes=...)`,
read by `bipace_jax.sharding.param_shardings`) and every activation the actor pins under a mesh has
its logical axes in `ACTIVATION_AXES`. `bipace_jax.models.qwen2.Qwen2Actor` assembles the blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bipace_jax import sharding
from bipace_jax.models.attention import attention, cpu_without_mesh
from bipace_jax.models.config import Qwen2Config

Array = jax.Array

# Logical axes of the activations the actor constrains under a mesh (see `bipace_jax.sharding`).
ACTIVATION_AXES: dict[str, tuple[str | None, ...]] = {
    "hidden": ("batch", "seq", "act_embed"),  # [B, T, D]
    "q": ("batch", "seq", "heads", "head_dim"),  # [B, T, N, Hd]
    "kv": ("batch", "seq", "kv_heads", "head_dim"),  # [B, T, K, Hd]
    "mlp": ("batch", "seq", "mlp"),  # [B, T, F]
    "logits": ("batch", "seq", "vocab"),  # [B, T, V]
    "last_logits": ("batch", "vocab"),  # [B, V]
    "cache_k": ("batch", "kv_heads", "head_dim", "cache_seq"),  # one layer's keys [B, K, Hd, S]
    "cache_v": ("batch", "kv_heads", "cache_seq", "head_dim"),  # one layer's values [B, K, S, Hd]
    "cache_mask": ("batch", "cache_seq"),  # [B, S]
    "per_row": ("batch",),  # [B]
}


def constrain(x: Array, kind: str) -> Array:
    """Pins activation `x` to the logical axes `ACTIVATION_AXES[kind]` when a mesh is set."""
    return sharding.constrain(x, ACTIVATION_AXES[kind])


def param_value(param: nnx.Param, dtype: Any = None) -> Array:
    """A parameter's value (cast to `dtype`), FSDP-gathered at its point of use under a mesh."""
    w = param[...] if dtype is None else param[...].astype(dtype)
    return sharding.gather_param(w, sharding.logical_axes(param))


# CPU: the projections' weight gradients by `dense`'s own VJP (below). Settable before tracing (the
# benchmark's baseline, launch.bench_update).
CPU_DENSE_VJP = True


def dense(x: Array, w: Array, preferred_element_type: Any = None) -> Array:
    """x [..., K] @ w [K, N] -> [..., N] (`jnp.matmul`; `preferred_element_type` as `jnp.einsum`'s).

    On CPU without a mesh (`attention.cpu_without_mesh`, `CPU_DENSE_VJP`) the gradient is this
    function's own: the weight gradient x^T dy is a plain [K, T] x [T, N] product whose [K, T]
    operand (or dy's [N, T], whichever is narrower) is transposed once, on its own. Left to XLA's
    CPU layout assignment, the transpose of the wider operand is fused into the elementwise producer
    of dy (e.g. the SwiGLU backward), a strided write slower than the matmul itself (a 32 x 512 packed
    gradient micro-batch of the CPU default 2.29 -> 1.84 CPU s, launch.bench_update). Same values up
    to float summation order.
    """
    if cpu_dense_gradient():
        return _cpu_dense(x, w, preferred_element_type)
    return jnp.matmul(x, w, preferred_element_type=preferred_element_type)


def cpu_dense_gradient() -> bool:
    """Whether `dense` (and the projections written with it) take the CPU gradient now."""
    return CPU_DENSE_VJP and cpu_without_mesh()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cpu_dense(x: Array, w: Array, preferred_element_type: Any) -> Array:
    return jnp.matmul(x, w, preferred_element_type=preferred_element_type)


def _cpu_dense_fwd(x, w, preferred_element_type):
    return _cpu_dense(x, w, preferred_element_type), (x, w)


def _cpu_dense_bwd(preferred_element_type, res, dy):
    x, w = res
    f32 = jnp.float32
    dx = jnp.matmul(dy, w.T, preferred_element_type=f32).astype(x.dtype)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    # the barrier keeps the transpose a copy of its own (XLA would fold it back into the product)
    if x2.shape[1] <= dy2.shape[1]:
        dw = jnp.matmul(jax.lax.optimization_barrier(x2.T), dy2, preferred_element_type=f32)
    else:
        dw = jnp.matmul(jax.lax.optimization_barrier(dy2.T), x2, preferred_element_type=f32).T
    return dx, dw.astype(w.dtype)


_cpu_dense.defvjp(_cpu_dense_fwd, _cpu_dense_bwd)


def rope_cos_sin(
    positions: Array, head_dim: int, theta: float, num_positions: int | None = None
) -> tuple[Array, Array]:
    """RoPE tables for integer `positions` [B, T]: cos, sin float32 [B, T, Hd].

    Frequencies theta^(-2i/Hd), i < Hd/2, duplicated over both halves (HF's rotate-half layout).

    With `num_positions` (static; every position must lie in [0, num_positions): a position outside
    gets NaN tables, never a clamped one), cos and sin are evaluated once per position
    0..num_positions-1 and looked up by position: the same values, computed once instead of being
    fused into (and recomputed in) every q/k consumer (docs/performance.md).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if num_positions is None:
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    else:
        table = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv_freq  # [P, Hd/2]
        cos_t, sin_t = jnp.cos(table), jnp.sin(table)
        cos = jnp.take(cos_t, positions, axis=0, mode="fill", fill_value=jnp.nan)
        sin = jnp.take(sin_t, positions, axis=0, mode="fill", fill_value=jnp.nan)
        return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotates x [B, T, H, Hd] by the tables [B, T, Hd] (computed in fp32, returned in x.dtype)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def last_real_index(attention_mask: Array) -> Array:
    """int32 [B]: column of each row's last real (mask=1) token; T-1 for a row with none."""
    mask = attention_mask.astype(bool)
    t = mask.shape[1]
    return (t - 1 - jnp.argmax(mask[:, ::-1], axis=1)).astype(jnp.int32)


def positions_from_mask(attention_mask: Array) -> Array:
    """int32 [B, T]: number of real tokens before each column (padding columns get 0)."""
    mask = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0) * mask


def positions_in_segments(segment_ids: Array) -> Array:
    """int32 [B, T]: each column's offset from the start of its run of equal ``segment_ids`` (packed
    sequences: positions restart at 0 where the id changes)."""
    seg = jnp.asarray(segment_ids)
    idx = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
    start = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(start, idx, 0), axis=1)


def normal_init(stddev: float):
    return jax.nn.initializers.normal(stddev)


# --------------------------------------------------------------------------------------------------
class RMSNorm(nnx.Module):
    """RMSNorm: x / sqrt(mean(x^2) + eps) * scale, statistics in fp32 (HF `Qwen2RMSNorm`).

    Param `scale` [D] (init 1). Input any float dtype [..., D]; output in `dtype`.
    """

    def __init__(self, dim: int, eps: float, *, dtype: Any, param_dtype: Any):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        normed = (xf * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
        return self.scale[...].astype(self.dtype) * normed


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE and q/k/v bias (no o bias), without repeating K/V.

    Params: q_proj.kernel [D, N, Hd], q_proj.bias [N, Hd]; k_proj/v_proj.kernel [D, K, Hd],
    bias [K, Hd]; o_proj.kernel [N, Hd, D].
    """

    def __init__(self, cfg: Qwen2Config, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        d, n, k, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        init = normal_init(cfg.initializer_range)
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.q_proj = Proj(init(rngs.params(), (d, n, hd), param_dtype), q_axes, jnp.zeros((n, hd), param_dtype))
        self.k_proj = Proj(init(rngs.params(), (d, k, hd), param_dtype), kv_axes, jnp.zeros((k, hd), param_dtype))
        self.v_proj = Proj(init(rngs.params(), (d, k, hd), param_dtype), kv_axes, jnp.zeros((k, hd), param_dtype))
        self.o_proj = Proj(init(rngs.params(), (n, hd, d), param_dtype), ("heads", "head_dim", "embed"))
        self.dtype = dtype

    def qkv(self, h: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """h [B, T, D] -> q [B, T, N, Hd], k, v [B, T, K, Hd] (q and k rotated), in `dtype`."""
        dt = self.dtype
        wq = param_value(self.q_proj.kernel, dt)
        wk = param_value(self.k_proj.kernel, dt)
        wv = param_value(self.v_proj.kernel, dt)
        q = _project_heads(h, wq) + self.q_proj.bias[...].astype(dt)
        k = _project_heads(h, wk) + self.k_proj.bias[...].astype(dt)
        v = _project_heads(h, wv) + self.v_proj.bias[...].astype(dt)
        q = constrain(apply_rope(q, cos, sin), "q")
        k = constrain(apply_rope(k, cos, sin), "kv")
        v = constrain(v, "kv")
        return q, k, v

    def attend(
        self, q: Array, k: Array, v: Array, mask: Array, *, cache_layout: bool = False, causal: bool = False
    ) -> Array:
        """q [B, T, N, Hd] over keys/values where mask bool [B, T, S]; -> [B, T, D] through o_proj.

        Keys/values are [B, S, K, Hd] (the layer's own, from `qkv`) or, with `cache_layout`, one
        layer of the `KVCache` read as it lies (keys [B, K, Hd, S], values [B, K, S, Hd]).
        `causal` (static): the mask is causal self-attention. See `attention.attention`.
        """
        return self._project_out(attention(q, k, v, mask, cache_layout=cache_layout, causal=causal))

    def _project_out(self, out: Array) -> Array:
        """Attention output [B, T, N, Hd] -> [B, T, D] through o_proj."""
        out = constrain(out, "q")
        wo = param_value(self.o_proj.kernel, self.dtype)
        if not cpu_dense_gradient():
            return jnp.einsum("btnh,nhd->btd", out, wo)
        return dense(out.reshape(*out.shape[:-2], -1), wo.reshape(-1, wo.shape[-1]))


def _project_heads(h: Array, w: Array) -> Array:
    """h [B, T, D] through a head-shaped kernel w [D, H, Hd] -> [B, T, H, Hd] (`dense` on CPU)."""
    if not cpu_dense_gradient():
        return jnp.einsum("btd,dnh->btnh", h, w)
    return dense(h, w.reshape(w.shape[0], -1)).reshape(*h.shape[:-1], *w.shape[1:])


class Proj(nnx.Module):
    """A projection's parameters: `kernel` with its logical axes and an optional `bias` (its axes are
    the kernel's output axes; applied by the owner's einsum)."""

    def __init__(self, kernel: Array, kernel_axes: tuple[str | None, ...], bias: Array | None = None):
        self.kernel = nnx.Param(kernel, logical_axes=kernel_axes)
        if bias is not None:
            self.bias = nnx.Param(bias, logical_axes=kernel_axes[kernel.ndim - bias.ndim :])


class MLP(nnx.Module):
    """SwiGLU MLP without bias: down(silu(gate(h)) * up(h)).

    Params: gate_proj.kernel [D, F], up_proj.kernel [D, F], down_proj.kernel [F, D].
    """

    def __init__(self, cfg: Qwen2Config, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        init = normal_init(cfg.initializer_range)
        self.gate_proj = Proj(init(rngs.params(), (d, f), param_dtype), ("embed", "mlp"))
        self.up_proj = Proj(init(rngs.params(), (d, f), param_dtype), ("embed", "mlp"))
        self.down_proj = Proj(init(rngs.params(), (f, d), param_dtype), ("mlp", "embed"))
        self.dtype = dtype

    def __call__(self, h: Array) -> Array:
        dt = self.dtype
        gate = dense(h, param_value(self.gate_proj.kernel, dt))
        up = dense(h, param_value(self.up_proj.kernel, dt))
        act = constrain(jax.nn.silu(gate) * up, "mlp")
        return dense(act, param_value(self.down_proj.kernel, dt))


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x))."""

    def __init__(self, cfg: Qwen2Config, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, rngs=rngs, **kw)

    def __call__(
        self,
        x: Array,
        cos: Array,
        sin: Array,
        mask: Array,
        kv_update: Callable[[Array, Array], tuple[Array, Array]] | None = None,
        query_index: Array | None = None,
        causal: bool = False,
    ):
        """One layer over x [B, T, D]. Returns (x [B, T, D], k [B, T, K, Hd], v [B, T, K, Hd]).

        With `query_index` int32 [B] (the prefill's last layer), keys/values are computed for all
        T columns but only column `query_index[b]` of each row is attended from and run through
        the MLP: the returned x is [B, 1, D], the same values as that column of the full layer.
        An int32 [B, Q] `query_index` (the learner's last layer: the columns that predict the
        response) runs Q columns a row the same way: x is [B, Q, D].

        Without `kv_update` the layer attends over its own T keys (mask [B, T, T]). With it, the
        new (k, v) are handed to `kv_update`, which stores them and returns the keys/values to
        attend over in the cache layout (keys [B, K, Hd, S], values [B, K, S, Hd]; mask [B, T, S]): that is how `decode_step`
        reads the cache.

        `causal` (static): the mask is causal self-attention over the layer's own T keys (see
        `Attention.attend`); ignored with `query_index` or `kv_update`.
        """
        q, k, v = self.attn.qkv(self.input_norm(x), cos, sin)
        if query_index is not None:
            cols = query_index if query_index.ndim == 2 else query_index[:, None]  # [B, Q]

            def pick(a):
                return jnp.take_along_axis(a, cols.reshape(cols.shape + (1,) * (a.ndim - 2)), axis=1)

            q, x, mask = pick(q), pick(x), pick(mask)
        k_ctx, v_ctx = (k, v) if kv_update is None else kv_update(k, v)
        x = x + self.attn.attend(
            q,
            k_ctx.astype(q.dtype),
            v_ctx.astype(q.dtype),
            mask,
            cache_layout=kv_update is not None,
            causal=causal and query_index is None and kv_update is None,
        )
        x = constrain(x, "hidden")
        x = x + self.mlp(self.post_attn_norm(x))
        return constrain(x, "hidden"), k, v


class Embed(nnx.Module):
    """Token embedding table `embedding` [V, D]."""

    def __init__(self, table: Array):
        self.embedding = nnx.Param(table, logical_axes=("vocab", "embed"))
