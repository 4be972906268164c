"""A roofline step-time model of an RL run: what each compiled program and one iteration cost on a slice.

Every number is analytic (counted per layer, then multiplied by layers, rows, tokens and loop trip
counts), not XLA's ``cost_analysis``: that counts a ``lax.scan`` / ``while_loop`` body once, so it is
~``num_hidden_layers`` times low for scanned programs and one token step for the decode loop.

A program's time on one chip is the roofline

    max(FLOPs / peak FLOP/s, HBM bytes / HBM bandwidth) + collective bytes / ICI bandwidth,

with collectives serialised after the compute (no overlap: an upper bound on their cost). FLOPs
count the matmuls (2 per multiply-add): the q/k/v/o and SwiGLU projections, attention scores and
values over the context a token sees, and the LM head where the program evaluates it. HBM bytes count
weight reads (bf16 compute copies, fp32 master weights and AdamW moments where the program touches
them) and KV-cache reads and writes; activations are not counted (they are small next to the weights
in decode, and prefill/training are compute-bound). Collectives: the FSDP all-gathers of the bf16
weights (forward, and again in the backward) and the reduce-scatter of fp32 gradients over ``fsdp``,
and the tensor-parallel all-reduces of the activations (two per layer per pass), each at the ring
volume ``(n - 1) / n`` (all-gather, reduce-scatter) or ``2 (n - 1) / n`` (all-reduce) of the array.

One iteration at the config's bounds: every game plays ``turns`` turns and every response is
``response_tokens`` long (the lockstep rollout waits for the longest row), so the rollout figure is a
ceiling of the work and the roofline a floor of its time; real runs land between (see README's table).
`rollout_model` prices the rollout with drawn response lengths instead, under the lockstep and the
continuous scheduler (`schedule_sim`), and `estimate` reports both beside the bound.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from bipace_jax import schedule_sim
from bipace_jax.buckets import Buckets

# Peak dense bf16 FLOP/s, HBM bandwidth (bytes/s) and capacity, bidirectional ICI (NVLink) bandwidth
# per chip, from the vendors' data sheets (the source of each row is its `source`).
GB = 1e9
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's peaks.

    Attributes:
      name: short name (``v5e``, ``h100``, ...).
      peak_flops: dense bf16 matmul FLOP/s.
      hbm_bandwidth: HBM bytes/s.
      hbm_bytes: HBM capacity in bytes.
      ici_bandwidth: bidirectional inter-chip bytes/s per chip (ICI on TPUs, NVLink on GPUs); the model
        uses half of it (one direction) for a collective; ``None`` when the vendor page gives none.
      source: the data sheet the numbers come from.
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: int
    ici_bandwidth: float | None
    source: str


CHIPS = {
    c.name: c
    for c in (
        Chip("v4", 275e12, 1200 * GB, 32 * GiB, None, "https://cloud.google.com/tpu/docs/v4"),
        Chip("v5e", 197e12, 819 * GB, 16 * GiB, 400 * GB, "https://cloud.google.com/tpu/docs/v5e"),
        Chip("v5p", 459e12, 2765 * GB, 95 * GiB, 1200 * GB, "https://cloud.google.com/tpu/docs/v5p"),
        Chip("v6e", 918e12, 1638 * GB, 32 * GB, 800 * GB, "https://cloud.google.com/tpu/docs/v6e"),
        Chip("h100", 989e12, 3350 * GB, 80 * GB, 900 * GB, "https://www.nvidia.com/en-us/data-center/h100/"),
        Chip("h200", 989e12, 4800 * GB, 141 * GB, 900 * GB, "https://www.nvidia.com/en-us/data-center/h200/"),
    )
}

# `device_kind` substrings -> chip (first match wins: "TPU v5 lite" is a v5e, "TPU v5" a v5p).
_KINDS = (
    ("v5 lite", "v5e"),
    ("v5e", "v5e"),
    ("v5p", "v5p"),
    ("v5", "v5p"),
    ("v6 lite", "v6e"),
    ("v6e", "v6e"),
    ("v4", "v4"),
    ("h100", "h100"),
    ("h200", "h200"),
)


def chip_for(device_kind: str) -> Chip:
    """The `Chip` of a JAX ``device.device_kind`` (``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``).

    Raises:
      ValueError: the kind is in no row of `CHIPS`.
    """
    kind = device_kind.lower()
    for key, name in _KINDS:
        if key in kind:
            return CHIPS[name]
    raise ValueError(f"no chip peaks for device kind {device_kind!r}; known: {sorted(CHIPS)}")


@dataclasses.dataclass(frozen=True)
class Cost:
    """Work of one program call on one chip: ``flops``, ``hbm_bytes`` and ``collective_bytes`` (sent)."""

    flops: float
    hbm_bytes: float
    collective_bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.flops + other.flops,
            self.hbm_bytes + other.hbm_bytes,
            self.collective_bytes + other.collective_bytes,
        )

    def __mul__(self, k: float) -> Cost:
        return Cost(self.flops * k, self.hbm_bytes * k, self.collective_bytes * k)

    def seconds(self, chip: Chip) -> dict[str, Any]:
        """Roofline seconds on ``chip``: compute, memory, collectives, their total and the bound."""
        compute, memory = self.flops / chip.peak_flops, self.hbm_bytes / chip.hbm_bandwidth
        link = None if chip.ici_bandwidth is None else chip.ici_bandwidth / 2
        collective = 0.0 if not self.collective_bytes else (math.nan if link is None else self.collective_bytes / link)
        return dict(
            compute_s=compute,
            memory_s=memory,
            collective_s=collective,
            seconds=max(compute, memory) + collective,
            bound="compute" if compute >= memory else "memory",
        )


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The decoder's sizes (a `Qwen2Config`'s fields of the same names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def of(cls, cfg: Any) -> ModelShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            cfg.vocab_size,
            cfg.tie_word_embeddings,
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights one token multiplies in a decoder layer: q, k, v, o and gate, up, down."""
        d, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return d * q + 2 * d * kv + q * d + 3 * d * self.intermediate_size

    @property
    def params(self) -> int:
        """All parameters: layers (+ biases and norms), embedding, head when untied, final norm."""
        d, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = self.layer_matmul_params + q + 2 * kv + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + d

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 keys and values of one token over all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2

    def forward_flops(self, rows: float, tokens: float, context: float, head_tokens: float) -> float:
        """Matmul FLOPs of a forward over ``rows`` x ``tokens`` new tokens that each attend to ``context``
        positions on average, with the LM head at ``head_tokens`` positions per row."""
        n = rows * tokens
        layers = 2 * n * self.layer_matmul_params
        attention = 4 * n * context * self.num_attention_heads * self.head_dim  # scores + weighted values
        head = 2 * rows * head_tokens * self.hidden_size * self.vocab_size
        return self.num_hidden_layers * (layers + attention) + head


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def _tensor_all_reduces(m: ModelShape, rows: float, tokens: float, tensor: int, passes: int) -> float:
    """Bytes a chip sends for the activation all-reduces of a tensor-parallel group (bf16, two per
    layer per pass: after attention and after the MLP)."""
    return passes * 2 * m.num_hidden_layers * rows * tokens * m.hidden_size * 2 * 2 * _ring(tensor)


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The sizes of one RL iteration on a slice (all row counts global unless they say per host).

    Attributes:
      chips, hosts: devices and processes of the slice.
      fsdp, tensor: the training mesh's FSDP and tensor axis sizes (data = chips / fsdp / tensor).
      sampler_tensor: the tensor axis of a host's sampler / log-prob mesh (its other devices split rows).
      prompt_tokens, response_tokens: the prompt bucket and ``sampler.max_new_tokens``.
      games_per_host: a host's sampler batch (games per sampler call).
      sampler_calls: sampler calls per turn (games beyond the largest batch bucket are served in
        further calls of that batch), so a host plays ``games_per_host * sampler_calls`` games.
      turns: turns per game (``env.max_steps``).
      micro_batch_rows: rows of one gradient micro-batch over the whole mesh.
      logprob_rows_per_host: rows of one log-prob micro-batch on a host.
      mini_batch_rows: rows of one optimizer step over the whole run (>= 1; `plan.RunPlan` decodes the
        config's 0, "all rows", to the rows of an iteration).
      logprob_passes: log-prob forwards per row before the update (old + reference: 2; 1 or 0 when the
        sampler's log-probs stand in for the old ones or there is no KL term).
      remat: ``model.remat`` (``full`` recomputes the forward in the backward).
      iterations: RL iterations of the run.
      val_games_per_host, val_sampler_calls, val_panels, val_every: the validation sampler batch and
        its calls per turn (as for the rollout), how many panels (seen goals, held-out goals) a validation plays one after the other,
        and every how many iterations it runs (0: never).
      checkpoint_every: iterations between checkpoints.
      sync_replica: the sampler copy comes by `distributed.local_copy`'s replica route (the host's
        sampler tensor size differs from training's): each chip receives the whole bf16 model.

    The scheduler model (`rollout_model`, `schedule_sim`; response lengths drawn, not at the bound):
      batch_buckets: ``sampler.batch_buckets`` (a lockstep call pads its rows to the first bucket that
        holds them, rounded up to the host's row shards).
      insert_buckets: row buckets of the continuous insert (empty: 1, 2, 4, ... up to the largest
        batch bucket, as ``SlotHandle.insert_rows`` pads).
      response_mean, response_sigma, response_cap, response_min: the lognormal response lengths
        (arithmetic mean tokens, log-space sigma, cap: 0 = ``response_tokens``, floor).
      rollout_prompt_tokens: tokens of each prefilled prompt (0: ``prompt_tokens``, the bound); the
        lockstep cache is that + ``response_tokens`` wide, the dense slot cache always
        ``prompt_tokens + response_tokens``.
      env_step_s: seconds of one env step (all of a host's envs in parallel).
      chunk_steps: ``rollout.chunk_steps`` (decode steps per continuous chunk).
      host_turn_s, host_chunk_s: host seconds per lockstep turn and per continuous chunk.
      sim_seeds: length draws the simulation averages (seeds 0 .. sim_seeds - 1).
      shared_head_tokens: tokens of the prompt head the games of one task group share (measured,
        ``launch.head_lengths``; 0: no shared-head prefill). Only the lockstep rollout prefill shares
        heads (``sampler.shared_head_tokens`` > 0), and only on a sampler mesh that does not split rows
        (``chips_per_host == sampler_tensor``); validation (one game per task) and the continuous insert
        do not.
      head_suffix_tokens: the longest per-row rest of a prompt after the shared head (what the suffix
        width must hold); 0: the prefilled prompt less the head (prompts fill their bucket).
      group_size: games of one task group (``rollout.group_size``); a host's lockstep call over n games
        has ``ceil(n / group_size)`` heads.
    """

    chips: int
    hosts: int
    fsdp: int
    tensor: int
    sampler_tensor: int
    prompt_tokens: int
    response_tokens: int
    games_per_host: int
    turns: int
    micro_batch_rows: int
    logprob_rows_per_host: int
    mini_batch_rows: int
    logprob_passes: int = 2
    sampler_calls: int = 1
    val_sampler_calls: int = 1
    sync_replica: bool = False
    remat: str = "full"
    iterations: int = 150
    val_games_per_host: int = 0
    val_panels: int = 1
    val_every: int = 0
    checkpoint_every: int = 1
    batch_buckets: tuple[int, ...] = (8, 16, 32, 64, 128)
    insert_buckets: tuple[int, ...] = ()
    response_mean: float = 150.0
    response_sigma: float = 0.8
    response_cap: int = 0
    response_min: int = 1
    rollout_prompt_tokens: int = 0
    env_step_s: float = 0.03
    chunk_steps: int = 8
    host_turn_s: float = 0.005
    host_chunk_s: float = 0.001
    sim_seeds: int = 3
    shared_head_tokens: int = 0
    head_suffix_tokens: int = 0
    group_size: int = 1

    def __post_init__(self):
        # the scheduler model's fields and the optimizer step: the others come from a run plan (`plan.RunPlan.run_shape`)
        for name in ("batch_buckets", "insert_buckets"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, int) and x >= 1 for x in v):
                raise ValueError(f"RunShape.{name} must be a tuple of ints >= 1, got {v!r}")
        if not self.batch_buckets:
            raise ValueError("RunShape.batch_buckets must not be empty")
        checks = (
            ("mini_batch_rows", self.mini_batch_rows >= 1, ">= 1 (rows of one optimizer step; `plan` decodes 0)"),
            ("response_mean", self.response_mean > 0, "> 0"),
            ("response_sigma", self.response_sigma >= 0, ">= 0"),
            ("response_cap", 0 <= self.response_cap, "0 (response_tokens) or >= 1"),
            (
                "response_min",
                1 <= self.response_min <= (self.response_cap or self.response_tokens),
                ">= 1 and <= the cap",
            ),
            ("rollout_prompt_tokens", 0 <= self.rollout_prompt_tokens <= self.prompt_tokens, "in [0, prompt_tokens]"),
            ("env_step_s", self.env_step_s >= 0, ">= 0 (seconds)"),
            ("chunk_steps", self.chunk_steps >= 1, ">= 1"),
            ("host_turn_s", self.host_turn_s >= 0, ">= 0 (seconds)"),
            ("host_chunk_s", self.host_chunk_s >= 0, ">= 0 (seconds)"),
            ("sim_seeds", self.sim_seeds >= 1, ">= 1"),
            ("group_size", self.group_size >= 1, ">= 1"),
            (
                "shared_head_tokens",
                0 <= self.shared_head_tokens < (self.rollout_prompt_tokens or self.prompt_tokens),
                "in [0, the prefilled prompt)",
            ),
            (
                "head_suffix_tokens",
                0 <= self.head_suffix_tokens
                and self.shared_head_tokens + self.head_suffix_tokens
                <= (self.rollout_prompt_tokens or self.prompt_tokens),
                ">= 0 with shared_head_tokens + head_suffix_tokens <= the prefilled prompt",
            ),
        )
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"RunShape.{name} must be {want}, got {getattr(self, name)!r}")

    @property
    def rows(self) -> int:
        """Step rows of one iteration (every game plays every turn)."""
        return self.games_per_host * self.sampler_calls * self.hosts * self.turns

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


# Bytes a host writes per second to its run folder (GCS from a TPU VM): an assumption, not a data sheet.
STORAGE_BYTES_PER_S = 1 * GB


def prefill_cost(m: ModelShape, r: RunShape, rows: int, tokens: int) -> Cost:
    """Per chip `Cost` of one sampler prefill of ``rows`` (padded) prompts of ``tokens`` tokens on a host."""
    local = r.chips_per_host
    dp_local = local // r.sampler_tensor
    return Cost(
        m.forward_flops(rows, tokens, tokens / 2, 1) / local,
        2 * m.params / r.sampler_tensor + rows * tokens * m.kv_bytes_per_token / local,
        _tensor_all_reduces(m, rows / dp_local, tokens, r.sampler_tensor, 1),
    )


# sampling.heads' plan rule (a layer above this module: its values restated; tests check head_split
# against plan_heads): the suffix widths (32, 128, 512, ...) and the largest cost fraction of a plan
HEAD_MIN_SUFFIX = 32
HEAD_SUFFIX_STEP = 4
HEAD_MAX_COST_FRACTION = 0.75


def _suffix_ladder(prompt: int) -> list[int]:
    out, ts = [], HEAD_MIN_SUFFIX
    while 2 * ts <= prompt:
        out.append(ts)
        ts *= HEAD_SUFFIX_STEP
    return out


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """The shared-head layout of one lockstep prefill (``sampling.heads.plan_heads`` on equal rows).

    Attributes:
      head_width, suffix_width: Th and Ts (tokens), ``Th + Ts`` = the prompt bucket P.
      head_rows: H_bucket, the heads padded to the sampler's batch bucket (at most the row bucket).
      rows: B_bucket, the padded rows.
      tokens, plain_tokens: padded tokens prefilled, ``H_bucket * Th + B_bucket * Ts``, and ``B_bucket * P``.
    """

    head_width: int
    suffix_width: int
    head_rows: int
    rows: int
    tokens: int
    plain_tokens: int


def head_split(prompt: int, head: int, suffix: int, rows: int, head_rows: int) -> HeadSplit | None:
    """The split ``plan_heads`` takes for ``rows`` (padded) prompts in a bucket of ``prompt`` tokens, every
    row holding a shared ``head`` and a ``suffix`` of its own (``head + suffix <= prompt``), the distinct
    heads padded to ``head_rows`` (the sampler's batch bucket of their count, at most ``rows``): the
    smallest suffix width Ts on ``sampling.heads.suffix_ladder(prompt)`` (32, 128, 512, ... up to P / 2)
    that holds the suffix (a head longer than Th = P - Ts is cut to Th, its rest
    joins the suffix), if it prefills at most ``sampling.heads.MAX_COST_FRACTION`` (0.75) of the plain
    tokens; else None (no width fits: the suffix is longer than P / 2, or the plan saves too little),
    and the call prefills plainly.

    Raises:
      ValueError: ``head`` < 1, ``suffix`` < 1, ``head + suffix > prompt``, ``head_rows`` not in [1, rows].
    """
    if head < 1 or suffix < 1 or head + suffix > prompt:
        raise ValueError(
            f"head_split: need head >= 1, suffix >= 1, head + suffix <= prompt={prompt}, got {head}, {suffix}"
        )
    if not 1 <= head_rows <= rows:
        raise ValueError(f"head_split: head_rows must be in [1, rows={rows}], got {head_rows}")
    for ts in _suffix_ladder(prompt):
        th = prompt - ts
        # the smallest fitting width is the cheapest: cost = H * P + (B - H) * Ts grows with Ts
        if suffix + max(head - th, 0) <= ts:
            cost = head_rows * th + rows * ts
            if cost > HEAD_MAX_COST_FRACTION * rows * prompt:
                return None
            return HeadSplit(th, ts, head_rows, rows, cost, rows * prompt)
    return None


def shared_prefill_cost(m: ModelShape, r: RunShape, split: HeadSplit) -> Cost:
    """Per chip `Cost` of one shared-head prefill (``sampling._shared_prefill_program``): the heads'
    prefill (``head_rows`` x Th), then every row's suffix (Ts tokens attending to Th + Ts / 2 columns
    on average) on top of its copied head KV; KV bytes: the heads' writes, the copy into every row, the
    suffix's reads of it and its own writes. Weights are read once per pass (two passes)."""
    local = r.chips_per_host
    dp_local = local // r.sampler_tensor
    th, ts, b = split.head_width, split.suffix_width, split.rows
    heads = prefill_cost(m, r, split.head_rows, th)
    suffix = Cost(
        m.forward_flops(b, ts, th + ts / 2, 1) / local,
        2 * m.params / r.sampler_tensor + b * (2 * th + ts) * m.kv_bytes_per_token / local,
        _tensor_all_reduces(m, b / dp_local, ts, r.sampler_tensor, 1),
    )
    return heads + suffix


def decode_cost(m: ModelShape, r: RunShape, rows: int, context: float) -> Cost:
    """Per chip `Cost` of one decode step of ``rows`` rows on a host, each reading ``context`` cache columns."""
    local = r.chips_per_host
    dp_local = local // r.sampler_tensor
    return Cost(
        m.forward_flops(rows, 1, context, 1) / local,
        2 * m.params / r.sampler_tensor + rows * context * m.kv_bytes_per_token / local,
        _tensor_all_reduces(m, rows / dp_local, 1, r.sampler_tensor, 1),
    )


def _powers_of_two(up_to: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= ``up_to``."""
    out = [1]
    while out[-1] < up_to:
        out.append(out[-1] * 2)
    return tuple(out)


def program_costs(m: ModelShape, r: RunShape) -> dict[str, Cost]:
    """Per chip `Cost` of one call of each program: ``prefill`` (a host's games, one prompt bucket),
    ``decode_step`` (one token of every game over the mean context), ``logprobs`` (one host micro-batch),
    ``ppo_grad`` (one global micro-batch: forward, backward, remat), ``ppo_apply`` (one AdamW step)."""
    w16 = m.params * 2  # bf16 compute copy
    local = r.chips_per_host
    dp_local = local // r.sampler_tensor  # a host's sampler splits its rows over its other devices
    b, t, resp = r.games_per_host, r.prompt_tokens, r.response_tokens
    width = t + resp

    prefill = prefill_cost(m, r, b, t)
    decode_step = decode_cost(m, r, b, t + resp / 2)
    lrows = r.logprob_rows_per_host
    logprobs = Cost(
        m.forward_flops(lrows, width, width / 2, resp) / local,
        w16 / r.sampler_tensor,
        _tensor_all_reduces(m, lrows / dp_local, width, r.sampler_tensor, 1),
    )
    # forward 1 + backward 2 (+ the recomputed forward under full remat)
    passes = 4 if r.remat == "full" else 3
    rows_per_group = r.micro_batch_rows / (r.chips // r.tensor)
    gathers = 2 if r.remat != "none" else 1  # weights gathered for the forward and again for the backward
    grad = Cost(
        passes * m.forward_flops(r.micro_batch_rows, width, width / 2, resp) / r.chips,
        gathers * w16 / r.tensor + 2 * 4 * m.params / r.chips,  # bf16 weight reads, fp32 accumulator r/w
        gathers * w16 / r.tensor * _ring(r.fsdp)
        + 4 * m.params / r.tensor * _ring(r.fsdp)
        + _tensor_all_reduces(m, rows_per_group, width, r.tensor, passes - 1),
    )
    # AdamW over fp32 shards: read params, grads, mu, nu; write params, mu, nu (28 bytes a parameter)
    apply = Cost(12 * m.params / r.chips, 28 * m.params / r.chips)
    # the sampler copy after the update: by the replica route every chip receives the whole bf16 model,
    # else its host's tensor shard (`distributed.local_copy`)
    received = w16 if r.sync_replica else w16 / r.sampler_tensor
    sync = Cost(m.params / r.chips, received, received)
    return dict(prefill=prefill, decode_step=decode_step, logprobs=logprobs, ppo_grad=grad, ppo_apply=apply, sync=sync)


def rollout_model(
    m: ModelShape, r: RunShape, chip: Chip, games_per_host: int, sampler_calls: int = 1, share_heads: bool = True
) -> dict:
    """One host's rollout of ``games_per_host * sampler_calls`` games under both schedulers
    (`schedule_sim.simulate`, the mean of ``r.sim_seeds`` length draws), at this roofline's unit costs.

    ``games_per_host`` is the sampler batch (a bucket); the continuous scheduler has that many slots
    (``rollout.num_slots = 0``: one per game, capped at the largest bucket). Every game plays
    ``r.turns`` turns; responses are lognormal (``r.response_*``). Lockstep: a call over ``rows`` live
    games costs ``ceil(rows / largest bucket)`` prefills and decode steps at the padded bucket (more
    games than the largest bucket are served in sequential calls; charging each call the longest
    response of all is an upper bound), the decode step over its dense cache of
    ``rollout_prompt_tokens + response_tokens`` columns. Continuous: an insert of n prompts is one
    prefill at ``n`` padded to its row bucket (``insert_buckets`` or powers of two), the decode
    step a fixed-shape step of every slot over the dense ``prompt_tokens + response_tokens`` columns.

    With ``share_heads`` and ``r.shared_head_tokens`` > 0 on a host whose sampler does not split rows,
    a lockstep prefill of n games is the shared-head prefill (`head_split`, `shared_prefill_cost`) with
    ``ceil(n / r.group_size)`` heads (padded to a batch bucket) when ``plan_heads`` would take it; the continuous insert never
    shares heads (``SlotHandle.insert`` prefills every row whole).

    Returns a JSON-ready dict: per scheduler the mean ``wall_s``, ``decode_steps``, ``slot_use``,
    ``prefill_calls`` and ``stages_s``; ``speedup_wall``, ``speedup_decode_steps`` (lockstep over
    continuous), the unit costs used (``unit_costs_s``) and ``shared_heads`` (whether the lockstep
    prefill of the full batch shares heads, why not, and its `HeadSplit`).
    """
    dp_local = r.chips_per_host // r.sampler_tensor
    rows_of = Buckets(r.batch_buckets, "sampler.batch_buckets")
    largest = rows_of.largest
    resp = r.response_tokens
    cap = r.response_cap or resp
    prompt = r.rollout_prompt_tokens or r.prompt_tokens
    sec = lambda c: c.seconds(chip)["seconds"]  # noqa: E731

    def split_of(rows, tokens):
        """(HeadSplit or None, why not) of one lockstep call over ``rows`` live games."""
        if not (share_heads and r.shared_head_tokens):
            return None, "off (shared_head_tokens 0)" if share_heads else "off (one game per task)"
        if dp_local > 1:
            return None, f"off (the host's sampler splits rows {dp_local} ways)"
        if r.group_size < 2:
            return None, "off (group_size 1)"
        per_call = min(rows, largest)
        head = min(r.shared_head_tokens, tokens - 1)
        padded = rows_of.fit(per_call, dp_local)
        # the sampler pads the heads to its batch bucket (`Engine._prompt_batch`): one group of 8 fills 8 rows
        head_rows = min(rows_of.fit(-(-per_call // r.group_size), dp_local), padded)
        split = head_split(tokens, head, r.head_suffix_tokens or tokens - head, padded, head_rows)
        if split is None:
            return None, "no plan (no suffix width up to P / 2 holds the suffix, or it saves < 25%)"
        return split, ""

    def lock_prefill(rows, tokens):
        calls = -(-rows // largest)
        split, _ = split_of(rows, tokens)
        if split is not None:
            return calls * sec(shared_prefill_cost(m, r, split))
        return calls * sec(prefill_cost(m, r, rows_of.fit(min(rows, largest), dp_local), tokens))

    def lock_decode(rows, context):
        calls = -(-rows // largest)
        return calls * sec(decode_cost(m, r, rows_of.fit(min(rows, largest), dp_local), context))

    inserts = Buckets(r.insert_buckets or _powers_of_two(largest), "insert_buckets")  # SlotHandle.insert_rows

    def insert(rows, tokens):
        return sec(prefill_cost(m, r, inserts.fit(rows, dp_local), tokens))

    slots = games_per_host
    slot_step = sec(decode_cost(m, r, slots, r.prompt_tokens + resp))
    runs = [
        schedule_sim.simulate(
            schedule_sim.SimConfig(
                games=games_per_host * sampler_calls,
                slots=slots,
                turns=r.turns,
                mean_tokens=r.response_mean,
                sigma=r.response_sigma,
                max_new_tokens=cap,
                min_tokens=r.response_min,
                prompt_tokens=prompt,
                max_prompt_tokens=max(prompt, r.prompt_tokens),
                env_step_s=r.env_step_s,
                decode_step_s=lock_decode,
                slot_step_s=slot_step,
                prefill_s=lock_prefill,
                insert_s=insert,
                chunk_steps=r.chunk_steps,
                host_turn_s=r.host_turn_s,
                host_chunk_s=r.host_chunk_s,
                seed=seed,
            )
        )
        for seed in range(r.sim_seeds)
    ]

    def mean(name: str, key: str, stage: str | None = None) -> float:
        return float(np.mean([x[name][key] if stage is None else x[name][key][stage] for x in runs]))

    out = {}
    for name in ("lockstep", "continuous"):
        out[name] = {k: mean(name, k) for k in ("wall_s", "decode_steps", "slot_use", "prefill_calls")}
        out[name]["stages_s"] = {k: mean(name, "stages_s", k) for k in runs[0][name]["stages_s"]}
    out["speedup_wall"] = out["lockstep"]["wall_s"] / out["continuous"]["wall_s"]
    out["speedup_decode_steps"] = out["lockstep"]["decode_steps"] / out["continuous"]["decode_steps"]
    split, why = split_of(games_per_host, prompt)
    out["shared_heads"] = dict(
        applies=split is not None, why_not=why, split=None if split is None else dataclasses.asdict(split)
    )
    out["unit_costs_s"] = dict(
        lockstep_decode_step=lock_decode(games_per_host, prompt + resp),
        lockstep_prefill=lock_prefill(games_per_host, prompt),
        slot_decode_step=slot_step,
        insert_one=insert(1, prompt),
        insert_all=insert(slots, prompt),
    )
    return out


def bound_stages(m: ModelShape, r: RunShape, chip: Chip, factors: dict[str, float] | None = None):
    """``(counts, stages_s)`` of one iteration at the config's bounds (see `estimate`), each program's
    roofline seconds times ``factors[program]`` (1 where absent; `Calibration.factors` gives the
    expected time, None the floor)."""
    f = factors or {}

    def seconds(shape: RunShape) -> dict[str, float]:
        return {k: c.seconds(chip)["seconds"] * f.get(k, 1.0) for k, c in program_costs(m, shape).items()}

    t = seconds(r)
    turn = r.sampler_calls * (t["prefill"] + r.response_tokens * t["decode_step"])
    rows_host = r.games_per_host * r.sampler_calls * r.turns
    counts = dict(
        turns=r.turns,
        decode_steps_per_turn=r.response_tokens,
        logprob_micro_batches=r.logprob_passes * math.ceil(rows_host / r.logprob_rows_per_host),
        grad_micro_batches=math.ceil(r.rows / r.micro_batch_rows),
        optimizer_steps=math.ceil(r.rows / r.mini_batch_rows),
    )
    stages = dict(
        rollout=r.turns * turn,
        logprobs=counts["logprob_micro_batches"] * t["logprobs"],
        ppo_grad=counts["grad_micro_batches"] * t["ppo_grad"],
        ppo_apply=counts["optimizer_steps"] * t["ppo_apply"],
        sync=t["sync"],
    )
    if r.val_every and r.val_games_per_host:
        # a validation panel is a rollout of its own at the validation batch (the weights are read per step)
        vt = seconds(dataclasses.replace(r, games_per_host=r.val_games_per_host))
        panel = r.turns * r.val_sampler_calls * (vt["prefill"] + r.response_tokens * vt["decode_step"])
        stages["validation"] = r.val_panels * panel / r.val_every
    return counts, stages


def estimate(m: ModelShape, r: RunShape, chip: Chip) -> dict[str, Any]:
    """The step-time model of a run (JSON-ready): per program seconds, per iteration stage seconds and
    counts, seconds per iteration, hours and chip-hours of the run.

    Stages: ``rollout`` = turns x (prefill + response_tokens decode steps); ``logprobs`` = passes x the
    host's log-prob micro-batches; ``ppo_grad`` = global micro-batches; ``ppo_apply`` = optimizer steps;
    ``sync`` = one sampler-copy refresh; ``validation`` = its rollout amortised over ``val_every``; ``checkpoint`` = a host's share of fp32
    params and AdamW moments at `STORAGE_BYTES_PER_S`, amortised over ``checkpoint_every`` (with async
    saves it overlaps the next iteration: listed, not added).

    Those stages are at the config's bounds (every response ``response_tokens`` long). With drawn
    lengths (`rollout_model`: lognormal ``r.response_*``, env latency, host costs) the rollout and
    validation of each scheduler give ``rollout_s_lockstep`` / ``rollout_s_continuous`` (s per
    iteration), ``validation_s_*``, ``iteration_s_*`` (the other stages unchanged), ``run_hours_*``,
    ``speedup_continuous_rollout`` and ``speedup_continuous_iteration`` (lockstep over continuous),
    and the simulations themselves under ``schedulers``. With ``r.shared_head_tokens`` > 0 the lockstep
    rollout's prefill shares task groups' heads where `rollout_model` says so (the bound's stages, the
    validation and the continuous insert prefill whole prompts).
    """
    costs = program_costs(m, r)
    sec = {k: c.seconds(chip) for k, c in costs.items()}
    counts, stages = bound_stages(m, r, chip)
    iteration = sum(stages.values())
    # the same rollout (and validation) with drawn response lengths, under each scheduler
    sched = dict(rollout=rollout_model(m, r, chip, r.games_per_host, r.sampler_calls))
    if "validation" in stages:
        sched["validation"] = rollout_model(m, r, chip, r.val_games_per_host, r.val_sampler_calls, share_heads=False)
    per = {}
    for name in ("lockstep", "continuous"):
        roll = sched["rollout"][name]["wall_s"]
        val = r.val_panels * sched["validation"][name]["wall_s"] / r.val_every if "validation" in sched else 0.0
        rest = iteration - stages["rollout"] - stages.get("validation", 0.0)
        per[name] = dict(rollout=roll, validation=val, iteration=rest + roll + val)
    checkpoint = 16 * m.params / r.hosts / STORAGE_BYTES_PER_S / max(r.checkpoint_every, 1)
    hours = r.iterations * iteration / 3600
    return dict(
        method="analytic: per-layer matmul FLOPs and weight/KV-cache bytes x layers x rows x trip counts",
        chip=dataclasses.asdict(chip),
        programs={
            k: dict(
                flops_per_chip=c.flops,
                hbm_bytes_per_chip=c.hbm_bytes,
                collective_bytes_per_chip=c.collective_bytes,
                **sec[k],
            )
            for k, c in costs.items()
        },
        counts=counts,
        stages_s=stages,
        checkpoint_s_per_iteration=checkpoint,
        iteration_s=iteration,
        run_hours=hours,
        chip_hours=hours * r.chips,
        iterations=r.iterations,
        schedulers=sched,
        rollout_s_lockstep=per["lockstep"]["rollout"],
        rollout_s_continuous=per["continuous"]["rollout"],
        speedup_continuous_rollout=per["lockstep"]["rollout"] / per["continuous"]["rollout"],
        validation_s_lockstep=per["lockstep"]["validation"],
        validation_s_continuous=per["continuous"]["validation"],
        iteration_s_lockstep=per["lockstep"]["iteration"],
        iteration_s_continuous=per["continuous"]["iteration"],
        run_hours_lockstep=r.iterations * per["lockstep"]["iteration"] / 3600,
        run_hours_continuous=r.iterations * per["continuous"]["iteration"] / 3600,
        speedup_continuous_iteration=per["lockstep"]["iteration"] / per["continuous"]["iteration"],
    )


# ------------------------------------------------------------------------------------------------
# Calibration: per-program efficiency factors measured on hardware (`launch.bench_step`).

# bench_step's programs -> this model's (the update's ratio covers its gradient and its AdamW step)
_CALIBRATED = {"logprobs": ("logprobs",), "update": ("ppo_grad", "ppo_apply"), "prefill": ("prefill",)}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured / modelled seconds per program on one device (``launch.bench_step``'s report).

    Attributes:
      factors: program name (`program_costs`' keys) -> measured seconds / roofline seconds, the median
        over the report's presets (and decode batches); an expected time is roofline x factor.
      device, date, commit: the report's provenance (the hardware and code that calibrated it).
    """

    factors: dict[str, float]
    device: str
    date: str
    commit: str

    @classmethod
    def from_report(cls, report: dict) -> Calibration:
        """The factors of a ``benchmarks/step_<device>.json`` dict (programs that failed are skipped).

        Raises:
          ValueError: the report has no provenance or no measured program.
        """
        prov = report.get("provenance")
        if not prov:
            raise ValueError("Calibration.from_report: the report has no provenance (not launch.bench_step's)")
        ratios: dict[str, list[float]] = {}
        for preset in report.get("presets", {}).values():
            progs = preset.get("programs", {})
            for name, targets in _CALIBRATED.items():
                r = progs.get("sampler" if name == "prefill" else name, {})
                if name == "prefill":
                    vals = [
                        b["prefill"]["measured_over_model"]
                        for b in r.values()
                        if isinstance(b, dict) and "prefill" in b
                    ]
                else:
                    vals = [r["measured_over_model"]] if "measured_over_model" in r else []
                for t in targets:
                    ratios.setdefault(t, []).extend(vals)
            dec = progs.get("sampler", {})
            ratios.setdefault("decode_step", []).extend(
                b["decode"]["measured_over_model"] for b in dec.values() if isinstance(b, dict) and "decode" in b
            )
        factors = {k: float(np.median(v)) for k, v in ratios.items() if v}
        if not factors:
            raise ValueError("Calibration.from_report: no program of the report was measured")
        return cls(factors, str(prov.get("device")), str(prov.get("date")), str(prov.get("commit")))

    def expected(self, programs: dict[str, float]) -> dict[str, float]:
        """Expected seconds of ``programs`` (name -> roofline seconds): each times its factor (1 where the
        report measured no such program)."""
        return {k: v * self.factors.get(k, 1.0) for k, v in programs.items()}


def expected(m: ModelShape, r: RunShape, chip: Chip, calibration: Calibration) -> dict[str, Any]:
    """The iteration at the config's bounds with every program's roofline seconds times its calibrated
    factor (`bound_stages`): ``stages_s``, ``iteration_s``, ``run_hours`` and the calibration's
    ``factors``, ``device``, ``date``, ``commit`` (JSON-ready).

    The factors were measured on ``calibration.device`` at one chip's shapes and are applied as they are
    on ``chip``: an expected time on another chip holds only as far as its efficiency matches."""
    _, stages = bound_stages(m, r, chip, calibration.factors)
    iteration = sum(stages.values())
    return dict(
        stages_s=stages,
        iteration_s=iteration,
        run_hours=r.iterations * iteration / 3600,
        factors=dict(calibration.factors),
        device=calibration.device,
        date=calibration.date,
        commit=calibration.commit,
    )


# ------------------------------------------------------------------------------------------------
# The asynchronous schedule: a sampler group and a learner group of hosts, overlapped (staleness k >= 1).

# Bytes a host sends per second over the data-center network between slices: an assumption (as
# `STORAGE_BYTES_PER_S`), used for a weight push that crosses slices.
DCN_BYTES_PER_S_PER_HOST = 25 * GB


def role_shapes(r: RunShape, sampler_hosts: int) -> tuple[RunShape, RunShape]:
    """The ``RunShape`` of each role when ``sampler_hosts`` of ``r``'s hosts sample and the others learn.

    Sampler group: ``sampler_hosts`` hosts play all of the iteration's games (``games_per_host *
    sampler_calls * hosts``) and validation's rows, split evenly, each host's batch fitted to
    ``batch_buckets`` (more than the largest bucket: further calls). Learner group: the other hosts,
    a training mesh of their chips (data 1, fsdp = chips / tensor), the same per-host gradient rows
    (``micro_batch_rows`` scales with the hosts), the iteration's rows split over them for the log-prob
    pass (a host's share rounded up). Both keep the chips per host and the sampler tensor size.

    Raises:
      ValueError: ``sampler_hosts`` not in [1, hosts - 1], or the games do not split evenly over it.
    """
    h, s = r.hosts, sampler_hosts
    if not 1 <= s < h:
        raise ValueError(f"role_shapes: sampler_hosts must be in [1, {h - 1}] (hosts {h}), got {s}")
    games = r.games_per_host * r.sampler_calls * h
    if games % s:
        raise ValueError(f"role_shapes: {games} games do not split evenly over {s} sampler hosts")
    cph, learn = r.chips_per_host, h - s
    buckets = Buckets(r.batch_buckets, "RunShape.batch_buckets")
    shards = cph // r.sampler_tensor

    def batch(rows: int) -> tuple[int, int]:
        return buckets.fit(min(rows, buckets.largest), shards), -(-rows // buckets.largest)

    per_host, calls = batch(games // s)
    val_rows = -(-r.val_games_per_host * r.val_sampler_calls * h // s) if r.val_games_per_host else 0
    val_batch, val_calls = batch(val_rows) if val_rows else (0, 1)
    per_process = r.micro_batch_rows // h  # `plan`: global micro-batch rows = per-process rows x processes
    sampler = dataclasses.replace(
        r,
        chips=s * cph,
        hosts=s,
        fsdp=s * cph // r.tensor,
        games_per_host=per_host,
        sampler_calls=calls,
        val_games_per_host=val_batch,
        val_sampler_calls=val_calls,
        micro_batch_rows=max(per_process * s, 1),
    )
    learner = dataclasses.replace(
        r,
        chips=learn * cph,
        hosts=learn,
        fsdp=learn * cph // r.tensor,
        games_per_host=-(-games // learn),
        sampler_calls=1,
        micro_batch_rows=per_process * learn,
        val_every=0,
        val_games_per_host=0,
    )
    return sampler, learner


def push_cost(m: ModelShape, r: RunShape, sampler_hosts: int, link_bytes_per_s: float) -> dict[str, float]:
    """The weight push after an update: the learner group's bf16 parameters to every sampler host.

    Each sampler chip receives its host's tensor shard, ``2 * params / sampler_tensor`` bytes; the
    learner chips (FSDP over the group) send all of it, ``sampler chips x that / learner chips`` bytes
    each. Seconds = the larger of the two / ``link_bytes_per_s`` (one chip's one-direction link: ICI
    within a slice, a host's DCN share across slices). Returns ``received_bytes_per_chip``,
    ``sent_bytes_per_chip``, ``seconds``.
    """
    cph = r.chips_per_host
    received = 2 * m.params / r.sampler_tensor
    sent = sampler_hosts * cph * received / ((r.hosts - sampler_hosts) * cph)
    return dict(
        received_bytes_per_chip=received, sent_bytes_per_chip=sent, seconds=max(received, sent) / link_bytes_per_s
    )


def role_memory(m: ModelShape, sampler: RunShape, learner: RunShape) -> dict[str, float]:
    """Long-lived bytes per chip of each role and phase (before a program's own activations).

    ``logprobs``: the learner's fp32 master weights and AdamW moments (12 bytes a parameter over its
    chips) and its host-local bf16 copies for the ``logprob_passes`` passes (old and reference);
    ``gradient``: the master, the moments and the fp32 gradient accumulator (16 bytes a parameter)
    and the reference copy when a log-prob pass is kept (the old copy is freed for the update);
    ``sampler``: the sampler's bf16 copy and its KV cache (``games_per_host`` rows x (prompt +
    response) columns over the host's chips).
    """
    copy = 2 * m.params / sampler.sampler_tensor
    kv = sampler.games_per_host * (sampler.prompt_tokens + sampler.response_tokens) * m.kv_bytes_per_token
    return dict(
        logprobs=12 * m.params / learner.chips + learner.logprob_passes * copy,
        gradient=16 * m.params / learner.chips + min(learner.logprob_passes, 1) * copy,
        sampler=copy + kv / sampler.chips_per_host,
    )


#: ``model.remat`` policies from the least recompute to the least memory (as ``aot.REMAT_ORDER``).
REMAT_POLICIES = ("none", "save_dots", "full")


def update_memory(
    m: ModelShape, r: RunShape, remat: str, *, reference: bool, logprob_chunk: int, compute_bytes: int = 2
) -> dict[str, float]:
    """Bytes per chip of the gradient program (``ppo_grad``: a micro-batch's forward, PPO loss and
    backward) under the ``remat`` policy, an estimate before any compile (``plan.resolve_remat``;
    ``launch.aot --remat_search`` measures it).

    Parts: ``state`` = fp32 master weights, the fp32 gradient accumulator and AdamW's two moments (16
    bytes a parameter over fsdp x tensor chips), plus the reference's bf16 host copy (``reference``;
    over the host's ``sampler_tensor`` chips); ``saved`` = what each decoder layer keeps for the
    backward, per token on the chip (micro_batch_rows / (chips / tensor) rows of prompt + response
    tokens): ``full`` the layer input only (H), ``save_dots`` the input and every projection's output
    (q, k, v, o, gate, up, down: 3H + Q + 2KV + 2I), ``none`` every activation (input, both norms, the
    projections, rotated q and k, attention output, both residuals, the MLP's four: 6H + 3Q + 3KV + 4I;
    the fused attention keeps no [T, T] scores), in the compute dtype, Q, KV and I split over
    ``tensor``; ``working`` = the layer being differentiated (twice its ``none`` activations: values
    and their gradients), one layer's gathered weights twice (FSDP prefetch) and the gathered LM head,
    and the fp32 logits of one ``logprob_chunk`` of tokens (0: all ``response_tokens`` at once, as
    ``ppo.logprob_chunk=0`` runs; three copies: logits, softmax, gradient).
    ``total`` sums them. Leaves out XLA's fusion buffers and layout padding, hence a margin where it is used.

    Raises:
      ValueError: ``remat`` is not one of `REMAT_POLICIES`.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"update_memory: remat must be one of {REMAT_POLICIES}, got {remat!r}")
    t, b = r.tensor, compute_bytes
    h, q = m.hidden_size, m.num_attention_heads * m.head_dim / t
    kv, inter = m.num_key_value_heads * m.head_dim / t, m.intermediate_size / t
    rows = r.micro_batch_rows * t / r.chips  # rows of a micro-batch on one chip (data x fsdp shards)
    tokens = rows * (r.prompt_tokens + r.response_tokens)
    every = 6 * h + 3 * q + 3 * kv + 4 * inter
    kept = dict(full=h, save_dots=3 * h + q + 2 * kv + 2 * inter, none=every)[remat]
    state = 16 * m.params / (r.fsdp * t) + (b * m.params / r.sampler_tensor if reference else 0)
    saved = m.num_hidden_layers * tokens * kept * b
    head = m.vocab_size * h * b / t
    head_positions = logprob_chunk or r.response_tokens  # 0: the LM head over every response position at once
    working = (
        2 * tokens * every * b + 2 * m.layer_matmul_params * b / t + head + 3 * rows * head_positions * m.vocab_size * 4
    )
    return dict(state=state, saved=saved, working=working, total=state + saved + working)


def async_iteration(
    m: ModelShape,
    r: RunShape,
    chip: Chip,
    sampler_hosts: int,
    factors: dict[str, float] | None = None,
    dcn_bytes_per_s_per_host: float | None = None,
) -> dict[str, Any]:
    """One iteration of the asynchronous schedule (staleness k >= 1, steady state) beside the
    synchronous one, at the config's bounds (`bound_stages`; ``factors``: `Calibration.factors` for
    the expected time, None for the floor).

    With the sampler group a version ahead, the iteration is ``max(sampler_s, learner_s) + push_s``:
    ``sampler_s`` = rollout + validation on the sampler hosts (`role_shapes`), ``learner_s`` = log-prob
    passes + gradient + AdamW + the learner hosts' log-prob copy refresh, ``push_s`` = `push_cost`
    over ICI (half ``chip.ici_bandwidth`` a chip), or over DCN at ``dcn_bytes_per_s_per_host`` / chips
    per host when given (roles on different slices). The synchronous iteration is the sum of
    `bound_stages` on all hosts. k = 0 would serialise the two roles (their sum plus the push).

    Returns a JSON-ready dict: ``sampler_hosts``, ``learner_hosts``, ``sampler_s``, ``learner_s``,
    ``push_s``, ``iteration_s``, ``synchronous_s``, ``speedup_async`` (synchronous / asynchronous),
    ``bound`` (the role that sets the pace), ``memory_bytes_per_chip`` (`role_memory`), ``push``.

    Raises:
      ValueError: as `role_shapes`; no ICI bandwidth for ``chip`` and no DCN figure.
    """
    sampler, learner = role_shapes(r, sampler_hosts)
    _, s = bound_stages(m, sampler, chip, factors)
    _, lr = bound_stages(m, learner, chip, factors)
    _, sync = bound_stages(m, r, chip, factors)
    if dcn_bytes_per_s_per_host is not None:
        link = dcn_bytes_per_s_per_host / r.chips_per_host
    elif chip.ici_bandwidth is not None:
        link = chip.ici_bandwidth / 2
    else:
        raise ValueError(f"async_iteration: chip {chip.name} has no ICI bandwidth; give dcn_bytes_per_s_per_host")
    push = push_cost(m, r, sampler_hosts, link)
    sampler_s = s["rollout"] + s.get("validation", 0.0)
    learner_s = lr["logprobs"] + lr["ppo_grad"] + lr["ppo_apply"] + lr["sync"]
    iteration = max(sampler_s, learner_s) + push["seconds"]
    synchronous = sum(sync.values())
    return dict(
        sampler_hosts=sampler_hosts,
        learner_hosts=r.hosts - sampler_hosts,
        sampler_games_per_host=sampler.games_per_host,
        sampler_calls=sampler.sampler_calls,
        sampler_s=sampler_s,
        learner_s=learner_s,
        push_s=push["seconds"],
        iteration_s=iteration,
        synchronous_s=synchronous,
        speedup_async=synchronous / iteration,
        bound="sampler" if sampler_s >= learner_s else "learner",
        memory_bytes_per_chip=role_memory(m, sampler, learner),
        push=push,
    )


def best_split(
    m: ModelShape,
    r: RunShape,
    chip: Chip,
    factors: dict[str, float] | None = None,
    dcn_bytes_per_s_per_host: float | None = None,
    budget: float = 0.9,
    headroom: dict[str, float] | None = None,
) -> dict[str, Any]:
    """`async_iteration` at every split of ``r``'s hosts the games divide evenly, and the fastest whose
    roles fit: the learner's FSDP size (its chips / ``tensor``) divides ``hidden_size`` (else the
    parameters stay whole on every learner chip), and each phase of `role_memory` plus ``headroom[phase]`` bytes (that program's own
    activations per chip, e.g. an AOT report's ``temp_bytes``) at most ``budget`` of ``chip.hbm_bytes`` (``launch.aot --roles`` checks a
    split by compiling it).

    Returns ``best`` (an `async_iteration` dict, None when no split fits) and ``candidates`` (every
    split's, each with ``fits``).
    """
    extra = headroom or {}
    games = r.games_per_host * r.sampler_calls * r.hosts
    out = []
    for s in range(1, r.hosts):
        if games % s:
            continue
        a = async_iteration(m, r, chip, s, factors, dcn_bytes_per_s_per_host)
        mem = a["memory_bytes_per_chip"]
        fsdp = (r.hosts - s) * r.chips_per_host // r.tensor
        # FSDP splits the hidden size (`sharding.LOGICAL_TO_MESH`): a size that does not divide it
        # leaves the weights, gradients and moments whole on every learner chip
        a["fsdp_divides_hidden"] = m.hidden_size % fsdp == 0
        a["fits"] = a["fsdp_divides_hidden"] and all(mem[k] + extra.get(k, 0.0) <= budget * chip.hbm_bytes for k in mem)
        out.append(a)
    fitting = [a for a in out if a["fits"]]
    return dict(best=min(fitting, key=lambda a: a["iteration_s"]) if fitting else None, candidates=out)
