"""Grouped-query attention: one function, a plain reference path, and CPU schedules behind it.

`attention(q, k, v, mask)` computes softmax(q k^T / sqrt(Hd)) v per (row, KV head) without
repeating K/V: the G = N // K query heads that share a KV head are stacked as G*T query rows and
contracted against that head's keys/values, batched over (B, K), with the S key slots as the minor
axis of the scores (so neither the scores nor the keys/values are transposed). Scores and softmax
are fp32; the unnormalised probabilities exp(score - max) are cast to q's dtype for the value
contraction and the result is divided by their fp32 sum afterwards (one division per output
element instead of one per score).

A `Schedule` says how the same values are computed:
  * `row_chunk`: rows per step of a `lax.map` over the batch (keeps a chunk's scores in cache); under
    a gradient each step is rematerialised (`jax.checkpoint`, `CPU_REMAT_ROW_CHUNKS`), so the
    backward recomputes a chunk's scores instead of stacking every chunk's fp32 scores in memory;
  * `causal_blocks`: causal self-attention in equal query blocks, block i against the keys up to
    its end only (skips the masked upper triangle).
`REFERENCE` (all rows, one block) is the plain path; `choose_schedule` is the one place that picks
a schedule, from the devices the computation runs on. Causal self-attention (the training forward
and the prefill) runs as fused kernels on accelerators, without fp32 [T, T] scores in memory: TPU's
Pallas splash-attention kernel (`splash_attention`, T a multiple of 128) and, on GPU,
`jax.nn.dot_product_attention` with cuDNN's flash kernel where jax can build it, XLA's otherwise
(`fused_attention`); both are tested equal to the reference. Why and how much each schedule saves:
docs/performance.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from bipace_jax import sharding

__all__ = [
    "NEG_INF",
    "Schedule",
    "REFERENCE",
    "CPU_SCORES_BYTES",
    "CPU_CAUSAL_BLOCK",
    "CPU_MAX_CAUSAL_BLOCKS",
    "CPU_REMAT_ROW_CHUNKS",
    "GPU_IMPLEMENTATION",
    "device_platform",
    "cpu_without_mesh",
    "row_chunk",
    "causal_blocks",
    "choose_schedule",
    "attention",
    "segments_of_mask",
    "splash_attention",
    "fused_attention",
]

Array = jax.Array
NEG_INF = -1e30  # finite, so fully masked (padding) query rows give a uniform softmax, not NaN

# CPU: the fp32 scores of one row chunk should stay cache-resident (a few MiB).
CPU_SCORES_BYTES = 2 * 1024 * 1024
# CPU causal query blocks: 32 columns each (64 was slower), at most 8 blocks.
CPU_CAUSAL_BLOCK = 32
CPU_MAX_CAUSAL_BLOCKS = 8
# CPU row chunks rematerialised in the backward: a `lax.map` saves each step's scores and
# probabilities for the backward in zero-filled stacked buffers (the whole batch's fp32 scores after
# all); recomputing a chunk's forward is cheaper (a 32 x 512 packed gradient micro-batch of the CPU
# default 1.80 -> 1.50 CPU s, launch.bench_update). Settable before tracing (the benchmark's baseline).
CPU_REMAT_ROW_CHUNKS = True
# GPU causal self-attention: `fused_attention`'s implementation (None: cuDNN where jax can build it, else
# XLA's; "xla" or "cudnn" to compare them, set before the program is traced).
GPU_IMPLEMENTATION: str | None = None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How `attention` walks its work; every schedule gives the reference path's values.

    Attributes:
      row_chunk: rows per `lax.map` step (must divide the batch); None or >= B: all rows at once.
      causal_blocks: equal query blocks of causal self-attention (must divide T); 1: one block.
    """

    row_chunk: int | None = None
    causal_blocks: int = 1


REFERENCE = Schedule()


def device_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices a computation traced now runs on: the
    current mesh's devices when one is set (`jax.set_mesh`), else the default device's
    (`jax.default_device` honoured), not merely `jax.default_backend()`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not getattr(mesh, "empty", True):
        device = getattr(mesh, "abstract_device", None)
        if device is not None:
            return device.platform
    default = jax.config.jax_default_device
    if isinstance(default, str):
        return jax.devices(default)[0].platform
    if default is not None:
        return default.platform
    return jax.devices()[0].platform


def cpu_without_mesh() -> bool:
    """Whether a computation traced now runs on CPU with no mesh set (`device_platform`): where
    `choose_schedule` picks CPU schedules and the model's projections take their CPU gradient
    (`layers.dense`); a mesh hands the layout to the partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    return (mesh is None or getattr(mesh, "empty", True)) and device_platform() == "cpu"


def row_chunk(batch: int, scores_bytes_per_row: int, budget: int | None = None) -> int:
    """Rows per chunk whose fp32 scores fit in `budget` (default `CPU_SCORES_BYTES`): `batch`
    when all fit, else the largest divisor of `batch` that fits (at least 1)."""
    budget = CPU_SCORES_BYTES if budget is None else budget
    if batch * scores_bytes_per_row <= budget:
        return batch
    fit = max(1, budget // max(scores_bytes_per_row, 1))
    return max(c for c in range(1, min(fit, batch) + 1) if batch % c == 0)


def causal_blocks(t: int, block: int | None = None, max_blocks: int | None = None) -> int:
    """Equal query blocks for causal self-attention over T columns: T / `block` (default
    `CPU_CAUSAL_BLOCK`) when T is a multiple of it, capped at `max_blocks` (default
    `CPU_MAX_CAUSAL_BLOCKS`) by the largest divisor of T below the cap; else 1."""
    block = CPU_CAUSAL_BLOCK if block is None else block
    max_blocks = CPU_MAX_CAUSAL_BLOCKS if max_blocks is None else max_blocks
    n = t // block if t % block == 0 else 1
    while n > max_blocks or (n > 1 and t % n):
        n -= 1
    return max(n, 1)


def choose_schedule(batch: int, queries: int, keys: int, query_heads: int, *, causal: bool) -> Schedule:
    """The schedule for q [B=batch, T=queries, N=query_heads, Hd] over S=keys slots.

    CPU without a mesh: row chunks (`row_chunk`) and, for causal self-attention, query blocks
    (`causal_blocks`). Accelerators fuse attention themselves and a mesh hands the batch to the
    partitioner: `REFERENCE` there.
    """
    if not cpu_without_mesh():
        return REFERENCE
    return Schedule(
        row_chunk=row_chunk(batch, queries * query_heads * keys * 4),
        causal_blocks=causal_blocks(queries) if causal else 1,
    )


def attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    *,
    cache_layout: bool = False,
    causal: bool = False,
    schedule: Schedule | None = None,
) -> Array:
    """Attention of q [B, T, N, Hd] over keys/values where mask bool [B, T, S] is True -> [B, T, N, Hd].

    Keys/values are [B, S, K, Hd] or, with `cache_layout`, one layer of a KV cache read as it
    lies: keys [B, K, Hd, S], values [B, K, S, Hd]. The result is in q's dtype.

    `causal` (static) promises that the mask is causal self-attention (S = T, column j attends no
    key after j; the mask may hide more, e.g. padding), which lets a schedule use query blocks.
    Blocks give the reference values at every column that attends at least one key; a fully
    masked padding column averages its block's values instead of all T (meaningless either way).

    `schedule`: None picks one (`choose_schedule`); pass `REFERENCE` for the plain path.

    Raises:
      ValueError: a schedule that does not fit (row_chunk not dividing B, causal blocks without
        `causal`, with `cache_layout`, or not dividing T).
    """
    b, t, n, _ = q.shape
    s = mask.shape[-1]
    if schedule is None and causal and not cache_layout:
        platform = device_platform()
        # A causal mask's first allowed key of each query column names its segment (the first real
        # token of a left-padded row, the start of a packed sequence): the splash kernel's segment ids.
        if platform == "tpu" and t % SPLASH_BLOCK == 0:
            return splash_attention(q, k, v, mask[:, -1, :], segment_ids=segments_of_mask(mask))
        if platform == "gpu":
            return fused_attention(q, k, v, mask, implementation=GPU_IMPLEMENTATION)
    if schedule is None:
        schedule = choose_schedule(b, t, s, n, causal=causal and not cache_layout)
    blocks = schedule.causal_blocks
    if blocks > 1 and (not causal or cache_layout or t % blocks or s != t):
        raise ValueError(
            f"attention: {blocks} causal blocks need causal self-attention with T={t} "
            f"divisible by them and S=T (got S={s}, cache_layout={cache_layout})"
        )
    chunk = b if schedule.row_chunk is None else min(schedule.row_chunk, b)
    if b % chunk:
        raise ValueError(f"attention: row_chunk {schedule.row_chunk} does not divide the batch {b}")
    if chunk == b:
        return _attend_blocks(q, k, v, mask, cache_layout, blocks)

    def split(a):
        return a.reshape((b // chunk, chunk) + a.shape[1:])

    def step(q, k, v, mask):
        return _attend_blocks(q, k, v, mask, cache_layout, blocks)

    step = jax.checkpoint(step) if CPU_REMAT_ROW_CHUNKS else step
    out = jax.lax.map(lambda xs: step(*xs), (split(q), split(k), split(v), split(mask)))
    return out.reshape((b,) + out.shape[2:])


def _attend_blocks(q: Array, k: Array, v: Array, mask: Array, cache_layout: bool, blocks: int) -> Array:
    """`_attend` with the T query columns in `blocks` equal blocks, block i against keys
    [0, (i + 1) T / blocks) only (causal self-attention; keys/values [B, T, K, Hd])."""
    if blocks == 1:
        return _attend(q, k, v, mask, cache_layout)
    tb = q.shape[1] // blocks
    outs = [
        _attend(
            q[:, i * tb : (i + 1) * tb],
            k[:, : (i + 1) * tb],
            v[:, : (i + 1) * tb],
            mask[:, i * tb : (i + 1) * tb, : (i + 1) * tb],
            cache_layout,
        )
        for i in range(blocks)
    ]
    return jnp.concatenate(outs, axis=1)


def _attend(q: Array, k: Array, v: Array, mask: Array, cache_layout: bool) -> Array:
    """The reference computation on all the rows and columns it is given: -> [B, T, N, Hd]."""
    b, t, n, hd = q.shape
    kh = k.shape[1] if cache_layout else k.shape[2]
    g = n // kh
    qg = q.reshape(b, t, kh, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, hd)
    batch = ((0, 1), (0, 1))
    if cache_layout:  # k [B, K, Hd, S]
        scores = jax.lax.dot_general(qg, k, (((3,), (2,)), batch), preferred_element_type=jnp.float32)
    else:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, S, Hd]
        scores = jax.lax.dot_general(qg, k, (((3,), (3,)), batch), preferred_element_type=jnp.float32)
    if t == 1:
        # Decode: mask the [B, K, G, S] scores as the dot laid them out (no relayout copy).
        scores = jnp.where(mask[:, :, None, :], scores * (hd**-0.5), NEG_INF)
    else:
        scores = scores.reshape(b, kh, g, t, -1) * (hd**-0.5)  # [B, K, G, T, S]
        scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    # the max only steadies the exponent (softmax ignores it): no gradient through it
    e = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    denom = jnp.sum(e, axis=-1).reshape(b, kh, g, t, 1)
    e = e.astype(q.dtype).reshape(b, kh, g * t, -1)
    out = jax.lax.dot_general(e, v, (((3,), (2,)), batch), preferred_element_type=jnp.float32)
    out = (out.reshape(b, kh, g, t, hd) / denom).astype(q.dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hd)


SPLASH_BLOCK = 128  # the splash kernel's smallest query/key block


def segments_of_mask(mask: Array) -> Array:
    """int32 [B, T]: the first key each query column of a causal self-attention mask bool [B, T, T]
    may attend (0 where it attends none). Columns attending the same keys' run share an id, so for a
    causal mask restricted to segments (padding, packed sequences) these are segment ids."""
    return jnp.argmax(mask, axis=-1).astype(jnp.int32)


def splash_attention(
    q: Array, k: Array, v: Array, key_mask: Array, *, segment_ids: Array | None = None, interpret: bool = False
) -> Array:
    """Causal self-attention of q [B, T, N, Hd] over k, v [B, T, K, Hd] with padding `key_mask`
    bool [B, T] (True = real token), by the Pallas TPU splash-attention kernel -> [B, T, N, Hd].

    `segment_ids` int32 [B, T] (e.g. `segments_of_mask`): a column attends only earlier columns of
    its own id (packed sequences); None: the ids are `key_mask` (real tokens one segment).

    Real query columns get the reference values; padding columns attend other padding columns only
    (meaningless either way). Under a mesh the kernel runs per device (`jax.shard_map`: rows over
    the batch axes, heads over "tensor"). `interpret` runs the kernel in Python (tests on CPU).

    Raises:
      ValueError: T is not a multiple of `SPLASH_BLOCK`.
    """
    b, t, n, hd = q.shape
    if t % SPLASH_BLOCK:
        raise ValueError(f"splash_attention: T={t} must be a multiple of {SPLASH_BLOCK}")

    def local(q, k, v, seg):
        kh = k.shape[2]
        g = q.shape[2] // kh
        block = next(x for x in (512, 256, SPLASH_BLOCK) if t % x == 0)
        sizes = sk.BlockSizes(
            block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
            block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
        )  # fmt: skip
        mask = sm.MultiHeadMask([sm.CausalMask((t, t))] * g)
        kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
        qg = (q * hd**-0.5).reshape(q.shape[0], t, kh, g, hd).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, Hd]
        kk, vv = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, Hd]

        def one(qh, kh_, vh, s):
            return kernel(qh, kh_, vh, segment_ids=sk.SegmentIds(q=s, kv=s))

        out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(qg, kk, vv, seg)  # [B, K, G, T, Hd]
        return out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype)

    seg = key_mask.astype(jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", True):
        return local(q, k, v, seg)
    qs = sharding.logical_to_spec(("batch", "seq", "heads", "head_dim"), q.shape, mesh)
    ks = sharding.logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), k.shape, mesh)
    if qs[2] != ks[2]:  # heads and KV heads must split alike, or a device lacks its group's keys
        qs = jax.sharding.PartitionSpec(qs[0], None, None, None)
        ks = jax.sharding.PartitionSpec(ks[0], None, None, None)
    ms = jax.sharding.PartitionSpec(qs[0], None)
    return jax.shard_map(local, in_specs=(qs, ks, ks, ms), out_specs=qs, check_vma=False)(q, k, v, seg)


def fused_attention(q: Array, k: Array, v: Array, mask: Array, *, implementation: str | None = None) -> Array:
    """Causal self-attention of q [B, T, N, Hd] over k, v [B, T, K, Hd] where mask bool [B, T, T] (causal
    and padding, or causal within packed segments) by `jax.nn.dot_product_attention` -> [B, T, N, Hd].
    Same values as the reference at every column that attends a key (a column attending none gets the
    mean of the values, as the reference's finite mask value gives).

    `implementation`: "cudnn" (cuDNN's fused flash-attention kernel on NVIDIA GPUs: grouped heads
    natively, the upper triangle skipped, no [T, T] scores in memory), "xla" (XLA's own), or None:
    cuDNN where jax can build its kernel for these shapes and dtypes (bf16/fp16, head dim <= 128, a
    GPU with cuDNN: jax raises at trace time otherwise), XLA's else. Padding and packed segments go in
    as jax's dense mask (cuDNN adds it as a [B, 1, T, T] bias), as jax's API takes no segment ids: no
    kernel skips other segments' blocks.

    Raises:
      RuntimeError, ValueError, NotImplementedError: from jax, when `implementation="cudnn"` is asked
        for and cannot be built.
    """
    m = mask[:, None]
    if implementation is None:
        try:
            out = jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True, implementation="cudnn")
            return out.astype(q.dtype)
        except (RuntimeError, ValueError, NotImplementedError, TypeError):
            implementation = "xla"
    return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True, implementation=implementation).astype(q.dtype)
