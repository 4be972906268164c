"""PPO on the learner core: the objective, old/reference log-probs, the update.

Shapes: N step rows, P prompt columns (left-padded, bucketed), M response columns (right-padded),
T = P + M, V vocabulary, B micro-batch rows.

An update is ``epochs`` passes over the iteration's rows of all hosts, each split into
ceil(N / ``mini_batch_rows``) mini-batches (one AdamW step each; ``mini_batches``) whose rows are cut
into fixed-shape micro-batches whose gradients are summed (``plan_micro_batches``, the same planner as
the log-prob pass); the token mean of each mini-batch is exact (its denominator is the mini-batch's
real-token count over all hosts). The split depends on the global rows only, so a run makes the same
optimizer steps on the same rows whatever the number of hosts holding them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bipace_jax import distributed, losses, sharding
from bipace_jax.batch import MicroBatch, PackedMicroBatch, TokenBatch, pack_lines
from bipace_jax.buckets import Buckets
from bipace_jax.config import LearnerConfig, OldLogprobs
from bipace_jax.learner import Learner, NonFiniteError, mesh_context, shard_rows
from bipace_jax.models import attention
from bipace_jax.programs import ProgramSpec, abstract

__all__ = [
    "MicroBatch",
    "NonFiniteError",
    "PPOLearner",
    "PPOObjective",
    "logprobs_spec",
    "mini_batches",
    "plan_micro_batches",
]

STAT_KEYS = ("pg_loss", "kl", "entropy", "clip_frac", "approx_kl_old", "sampler_gap")
#: the stats added by truncated importance weights (``PPOLossConfig.tis_cap`` > 0)
TIS_STAT_KEYS = ("is_weight", "is_truncated_frac")


def response_logprobs(
    model,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    response_ids: jax.Array,
    *,
    temperature: float = 1.0,
    support: int | None = None,
    chunk: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """(log-probs, entropy), float32[B, M] each, of the response tokens ``response_ids`` int32[B, M]
    under ``softmax(logits[..., :support] / temperature)``.

    ``chunk`` > 0: the LM head, softmax and entropy run over ``chunk`` response positions at a time
    (the last chunk zero-padded), rematerialised in the backward, so no fp32 [B, M, V] logits are ever
    live (at 512 x 152k that is 311 MB per row). Same values as ``chunk=0`` (all M at once).

    On CPU the last decoder layer runs only at the M columns that predict the response
    (``head_columns_only``); the values are the same up to float order.
    """
    t, m = input_ids.shape[1], response_ids.shape[1]
    if head_columns_only():
        cols = jnp.broadcast_to(jnp.arange(t - m - 1, t - 1, dtype=jnp.int32), response_ids.shape)
        h, _ = model.forward_hidden(input_ids, attention_mask, query_index=cols)  # [B, M, D]
    else:
        h, _ = model.forward_hidden(input_ids, attention_mask)  # [B, T, D]
        h = h[:, t - m - 1 : -1]  # the M positions that predict the response
    return head_logprobs(model, h, response_ids, temperature=temperature, support=support, chunk=chunk)


def packed_response_logprobs(
    model, mb: PackedMicroBatch, *, temperature: float = 1.0, support: int | None = None, chunk: int = 0
) -> tuple[jax.Array, jax.Array]:
    """(log-probs, entropy), float32[L, R] each, of a packed micro-batch's response slots
    (``PackedMicroBatch``): the forward over the packed lines, the hidden states at ``head_index``,
    then the LM head as in ``response_logprobs``. Empty slots hold meaningless finite values."""
    if head_columns_only():
        h = model.forward_packed(mb.input_ids, mb.segment_ids, query_index=mb.head_index)  # [L, R, D]
    else:
        h = model.forward_packed(mb.input_ids, mb.segment_ids)  # [L, C, D]
        h = jnp.take_along_axis(h, mb.head_index[..., None], axis=1)  # [L, R, D]
    return head_logprobs(model, h, mb.response_ids, temperature=temperature, support=support, chunk=chunk)


def head_columns_only() -> bool:
    """Whether the log-prob pass runs the last decoder layer only at the LM head's columns
    (``Qwen2Actor.forward_hidden(query_index=...)``): on CPU, where attention is dense anyway, it saves
    about 1/L of the forward and backward (``launch.bench_update``); accelerators keep the full last
    layer on their fused causal kernels rather than a dense [Q, T] score block."""
    return attention.device_platform() == "cpu"


def head_logprobs(
    model, h: jax.Array, response_ids: jax.Array, *, temperature: float, support: int | None, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """(log-probs, entropy) float32[B, M] of ``response_ids`` int32[B, M] from the hidden states h
    [B, M, D] that predict them, ``chunk`` positions at a time (see ``response_logprobs``)."""
    b, m = response_ids.shape

    def head(h_c, ids_c):
        logits = model.lm_logits(h_c)[..., :support] / temperature
        return losses.token_logprobs(logits, ids_c), losses.entropy_from_logits(logits)

    if not chunk or chunk >= m:
        return head(h, response_ids)
    n = -(-m // chunk)
    pad = n * chunk - m
    h_c = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1).swapaxes(0, 1)
    ids_c = jnp.pad(response_ids, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
    logp, ent = jax.lax.map(lambda xs: jax.checkpoint(head)(*xs), (h_c, ids_c))
    return logp.swapaxes(0, 1).reshape(b, -1)[:, :m], ent.swapaxes(0, 1).reshape(b, -1)[:, :m]


@dataclasses.dataclass(frozen=True)
class PPOObjective:
    """The PPO loss of a micro-batch (``losses.ppo_loss_from_logprobs``), a ``learner.LossFn``.

    ``fused_old``: the old log-probs are ``stop_gradient`` of the current ones inside the gradient pass
    (exact when the iteration makes one optimizer step: every micro-batch's gradient is taken at the
    behaviour policy's parameters); ``old_logprobs`` then carries the sampler's log-probs, used only for
    the ``sampler_gap`` statistic.

    ``cfg.tis_cap`` > 0: the micro-batch's ``sampler_logprobs`` weight the policy-gradient term
    (``losses.truncated_is_weights``), on packed and unpacked micro-batches alike.
    """

    cfg: losses.PPOLossConfig
    fused_old: bool = False
    support: int | None = None
    chunk: int = 0

    @property
    def stat_keys(self) -> tuple[str, ...]:
        """The names of the stats ``__call__`` returns (``STAT_KEYS``, then ``TIS_STAT_KEYS`` with TIS on)."""
        return STAT_KEYS + (TIS_STAT_KEYS if self.cfg.tis_cap > 0 else ())

    def __call__(self, model, mb: MicroBatch | PackedMicroBatch, denom):
        cfg = self.cfg
        kw = dict(temperature=cfg.temperature, support=self.support, chunk=self.chunk)
        old, ref, adv, mask = mb.old_logprobs, mb.ref_logprobs, mb.advantages, mb.response_mask
        sampler = mb.sampler_logprobs if cfg.tis_cap > 0 else None
        if isinstance(mb, PackedMicroBatch):
            logp, ent = packed_response_logprobs(model, mb, **kw)
            # every slot its own row of one token: the token sums (and so the token mean) are the rows'
            logp, ent, old, mask = (x.reshape(-1, 1) for x in (logp, ent, old, mask))
            ref = None if ref is None else ref.reshape(-1, 1)
            sampler = None if sampler is None else sampler.reshape(-1, 1)
            adv = adv.reshape(-1)
        else:
            logp, ent = response_logprobs(model, mb.input_ids, mb.attention_mask, mb.response_ids, **kw)
        gap = jnp.zeros((), jnp.float32)
        if self.fused_old:
            gap = losses.token_mean(jnp.abs(old - logp), mask, denom)
            old = jax.lax.stop_gradient(logp)
        ref = ref if cfg.kl_coef > 0 else None
        loss, stats = losses.ppo_loss_from_logprobs(logp, ent, mask, old, ref, adv, cfg, denom, sampler)
        return loss, dict(stats, sampler_gap=gap)


@functools.lru_cache(maxsize=16)
def _logprobs_program(graphdef, temperature: float, support: int | None, chunk: int = 0):
    @jax.jit
    def logprobs(params, rest, mb: MicroBatch | PackedMicroBatch):
        model = nnx.merge(graphdef, params, rest)
        kw = dict(temperature=temperature, support=support, chunk=chunk)
        if isinstance(mb, PackedMicroBatch):
            return packed_response_logprobs(model, mb, **kw)[0]
        return response_logprobs(model, mb.input_ids, mb.attention_mask, mb.response_ids, **kw)[0]

    return logprobs


def logprobs_spec(graphdef, objective: PPOObjective, params, rest, micro_batch: MicroBatch) -> ProgramSpec:
    """The log-prob pass ``(params, rest, micro_batch) -> float32[B, M]`` as a ``ProgramSpec``.

    ``params``, ``rest``, ``micro_batch``: arrays or ``jax.ShapeDtypeStruct``s carrying their shardings
    (the host-local copy's; a micro-batch without log-probs, e.g. ``batch.abstract_micro_batch(...,
    logprobs=False)``); the policy is ``objective``'s (temperature, support, LM-head chunk).
    """
    fn = _logprobs_program(graphdef, objective.cfg.temperature, objective.support, objective.chunk)
    return ProgramSpec("logprobs", fn, (abstract(params), abstract(rest), abstract(micro_batch)))


def mini_batches(counts: np.ndarray, process: int, mini_batch_rows: int, key: jax.Array) -> list[np.ndarray]:
    """This process's rows of each mini-batch of one epoch (int64 local row indices, one array per step).

    The N = ``counts.sum()`` rows of all processes are numbered globally, process p's after those of
    processes < p. There are K = ceil(N / ``mini_batch_rows``) mini-batches (K = 1 for 0); each run of K
    consecutive global rows sends one row to each mini-batch, in an order drawn from ``key``. So every
    mini-batch holds floor(N / K) or ceil(N / K) <= ``mini_batch_rows`` rows, each process about its
    share of every one, and the split depends on the global rows and ``key`` only, not on how many
    processes hold them.

    Args:
      counts: int[num_processes] rows per process; process: this process's index.
      mini_batch_rows: rows per optimizer step over all processes (0: all rows, one step).
      key: a ``jax.random`` key, the same on every process.
    """
    counts = np.asarray(counts, np.int64)
    n = int(counts.sum())
    k = max(math.ceil(n / mini_batch_rows), 1) if mini_batch_rows else 1
    draws = np.asarray(jax.random.uniform(key, (max(-(-n // k), 1), k)))
    mini_of = np.argsort(np.argsort(draws, axis=1), axis=1).reshape(-1)  # a permutation of 0..K-1 per run
    first = int(counts[:process].sum())
    own = mini_of[first : first + int(counts[process])]
    return [np.flatnonzero(own == j) for j in range(k)]


def plan_micro_batches(
    groups: Sequence[np.ndarray],
    prompt_lengths: np.ndarray,
    rows: int,
    width_of,
    *,
    across_processes: bool,
) -> list[list[tuple[np.ndarray, int]]]:
    """Micro-batches of each group of row indices (a mini-batch, or all rows): (rows, prompt width) pairs.

    A group's rows are ordered by prompt length (the gradient sum and the per-row log-probs ignore
    order) and cut into runs of ``rows``, so each micro-batch keeps only the prompt columns its longest
    prompt needs: ``width_of(need)`` columns. ``across_processes``: the micro-batch counts and widths
    are agreed over processes (the largest of each), every process then runs the same fixed-shape
    programs, a process short of rows with all-padding micro-batches. Every group gets at least one.
    """
    groups = [np.asarray(g)[np.argsort(prompt_lengths[g], kind="stable")] for g in groups]
    counts = np.array([[-(-len(g) // rows) for g in groups]], np.int64)
    if across_processes:
        counts = distributed.allgather(counts[0])
    k = np.maximum(counts.max(0), 1)
    cuts = [g[m * rows : (m + 1) * rows] for g, kk in zip(groups, k) for m in range(kk)]
    need = np.array([int(prompt_lengths[c].max(initial=1)) for c in cuts], np.int64)
    if across_processes:
        need = distributed.allgather(need).max(0)
    widths = [width_of(int(x)) for x in need]
    starts = np.concatenate([[0], np.cumsum(k)])
    return [list(zip(cuts[a:b], widths[a:b])) for a, b in zip(starts[:-1], starts[1:])]


class PPOLearner(Learner):
    """A ``Learner`` that computes log-probs of rollout rows and takes PPO updates on them.

    Args:
      actor, mesh, tx, local_mesh: as ``Learner``.
      loss_cfg: PPO coefficients; ``kl_coef > 0`` keeps the frozen initial parameters as the reference;
        ``tis_cap > 0`` weights the policy-gradient term by truncated importance weights, so every
        ``update`` batch needs ``sampler_logprobs``.
      micro_batch_rows: B, rows per forward/backward on each process (fixed shape): the gradient
        program's global batch is B times the process count, the log-prob pass runs B rows on a host.
      mini_batch_rows: rows per optimizer step over all processes (0: all rows, one step per epoch);
        see ``mini_batches``.
      epochs: passes over the rows per ``update``.
      fused_old_logprobs: take the old log-probs inside the gradient pass (``PPOObjective.fused_old``);
        requires one optimizer step per ``update`` (``epochs == 1``, ``mini_batch_rows == 0``); the
        batch's ``old_logprobs`` are then the sampler's, reported as ``loss/sampler_gap``.
      prompt_buckets: prompt lengths a micro-batch may be cut down to (the sampler's length buckets);
        () keeps every micro-batch at the iteration's ``TokenBatch.prompt_len``.
      support: ids below it form the policy's distribution (the tokenizer's size, as the sampler's);
        None: all of the logits' V columns.
      logprob_chunk: response positions per LM-head chunk (``response_logprobs``); 0: all at once.
      pack: packed, token-budget micro-batches (``pack_lines``, ``TokenBatch.take_packed``) in the
        log-prob pass and the update: each micro-batch is ``micro_batch_rows`` lines of ``pack_width``
        tokens, each line holding as many rows (their real tokens only) as fit; the same mini-batches,
        token-mean denominators and optimizer steps as unpacked, the same values up to float order.
      pack_width: C, tokens per packed line; 0: the batch's row width (widest prompt + M).
      pack_response_width: R, response tokens per packed line (the LM head runs on R slots a line);
        0: min(C, 2 M).

    Raises:
      ConfigError: ``fused_old_logprobs`` with more than one optimizer step per update
        (``LearnerConfig.check_old_logprobs``, naming ``ppo.old_logprobs``), or with ``tis_cap > 0``
        (``LearnerConfig.check_tis_cap``, naming ``ppo.tis_cap``).
    """

    def __init__(
        self,
        actor: nnx.Module,
        mesh,
        loss_cfg: losses.PPOLossConfig,
        tx: optax.GradientTransformation,
        *,
        micro_batch_rows: int,
        mini_batch_rows: int = 0,
        epochs: int = 1,
        local_mesh=None,
        fused_old_logprobs: bool = False,
        prompt_buckets: Sequence[int] = (),
        support: int | None = None,
        logprob_chunk: int = 0,
        pack: bool = False,
        pack_width: int = 0,
        pack_response_width: int = 0,
    ):
        mode = OldLogprobs.FUSED if fused_old_logprobs else OldLogprobs.RECOMPUTE
        LearnerConfig.check_old_logprobs(mode, epochs, mini_batch_rows)
        LearnerConfig.check_tis_cap(mode, loss_cfg.tis_cap)
        super().__init__(actor, mesh, tx, local_mesh=local_mesh, keep_reference=loss_cfg.kl_coef > 0)
        self.objective = PPOObjective(loss_cfg, fused_old_logprobs, support, logprob_chunk)
        self.micro_batch_rows, self.mini_batch_rows, self.epochs = micro_batch_rows, mini_batch_rows, epochs
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
        self._widths = Buckets(self.prompt_buckets, "sampler.length_buckets") if self.prompt_buckets else None
        self.pack, self.pack_width, self.pack_response_width = bool(pack), int(pack_width), int(pack_response_width)
        #: tokens of the last `logprobs` / `update` call: ``real`` (rows' real tokens, per pass) and
        #: ``processed`` (micro-batch columns run, padding included), summed over its micro-batches
        self.last_tokens: dict[str, dict[str, int]] = {}

    def logprobs(self, params_local, batch: TokenBatch) -> np.ndarray:
        """float32[N, M] log-probs of the responses under ``params_local`` (host-local, micro-batched).

        Runs under this host's mesh (``local_mesh``) with each micro-batch's rows split over its
        ("data", "fsdp") axes; the rows are padded to a multiple of data*fsdp (padding rows are dropped).
        """
        dp = math.prod(sharding.mesh_axis_sizes(self.local_mesh)[a] for a in ("data", "fsdp"))
        size = -(-self.micro_batch_rows // dp) * dp
        bare = batch.with_(old_logprobs=None, ref_logprobs=None, advantages=None, sampler_logprobs=None)
        if self.pack:
            return self._packed_logprobs(params_local, bare, size)
        (plan,) = plan_micro_batches(
            [np.arange(batch.rows)],
            batch.prompt_lengths(),
            self.micro_batch_rows,
            lambda need: self._prompt_width(need, batch.prompt_len),
            across_processes=False,
        )
        out = np.zeros(batch.response_ids.shape, np.float32)
        spec = None
        with mesh_context(self.local_mesh):
            for rows, width in plan:
                mb = jax.tree.map(
                    lambda x: jax.device_put(x, sharding.batch_sharding(self.local_mesh, x.ndim)),
                    bare.take(rows, width, size),
                )
                spec = spec or logprobs_spec(self.graphdef, self.objective, params_local, self.rest, mb)
                out[rows] = np.asarray(spec(params_local, self.rest, mb))[: len(rows)]
        processed = sum(size * (w + batch.response_ids.shape[1]) for _, w in plan)
        self.last_tokens["logprobs"] = dict(real=int(batch.real_tokens().sum()), processed=int(processed))
        return out

    def _pack_widths(self, batch: TokenBatch, widest: int) -> tuple[int, int]:
        """(C, R) of the packed lines for rows of ``widest`` prompt columns (``pack_width``, ...)."""
        m = batch.response_ids.shape[1]
        width = self.pack_width or widest + m
        return width, self.pack_response_width or min(width, 2 * m)

    def _packed_logprobs(self, params_local, batch: TokenBatch, lines: int) -> np.ndarray:
        """`logprobs` over packed micro-batches of ``lines`` lines (``pack``)."""
        width, rwidth = self._pack_widths(batch, batch.prompt_len)
        real = batch.real_tokens()
        packed = pack_lines(np.arange(batch.rows), real, batch.response_mask.sum(1), width, rwidth)
        out = np.zeros(batch.response_ids.shape, np.float32)
        spec, n = None, 0
        with mesh_context(self.local_mesh):
            for start in range(0, max(len(packed), 1), lines):
                mb, rows, cols = batch.take_packed(packed[start : start + lines], width, rwidth, lines)
                mb = jax.tree.map(lambda x: jax.device_put(x, sharding.batch_sharding(self.local_mesh, x.ndim)), mb)
                spec = spec or logprobs_spec(self.graphdef, self.objective, params_local, self.rest, mb)
                lp = np.asarray(spec(params_local, self.rest, mb))
                ok = rows >= 0
                out[rows[ok], cols[ok]] = lp[ok]
                n += 1
        self.last_tokens["logprobs"] = dict(real=int(real.sum()), processed=n * lines * width)
        return out

    def _prompt_width(self, need: int, widest: int) -> int:
        """Prompt columns for a micro-batch whose longest prompt has ``need`` tokens: the smallest of
        ``prompt_buckets`` that holds it, else ``widest``. Padding columns carry mask 0 and positions come
        from the mask, so the log-probs do not depend on it (one program per bucket)."""
        return self._widths.fit_within(need, widest) if self._widths else widest

    def update(self, batch: TokenBatch, key: jax.Array, where: str = "") -> dict[str, float]:
        """Mini-batch PPO with gradient accumulation over fixed-shape micro-batches.

        Every process calls it with its own N rows (``batch``, with ``old_logprobs`` float32[N, M],
        ``advantages`` float32[N], when ``kl_coef > 0`` ``ref_logprobs`` float32[N, M] and, when
        ``tis_cap > 0``, ``sampler_logprobs`` float32[N, M]; see ``TokenBatch.with_``); the
        mini-batches are split over the rows of all processes (``mini_batches``), the micro-batch
        counts and widths agreed over processes. ``key``: the shuffle, the same on every process;
        ``where`` names the iteration in the error message.

        Returns:
          metrics ``loss/*`` averaged over the optimizer steps (with ``tis_cap > 0`` also
          ``loss/is_weight`` and ``loss/is_truncated_frac``), ``loss/grad_norm`` (before clipping),
          ``loss/grad_norm_max``, ``loss/updates`` (optimizer steps).

        Raises:
          ValueError: a missing ``old_logprobs`` / ``advantages`` (or ``ref_logprobs`` with
            ``kl_coef > 0``, or ``sampler_logprobs`` with ``tis_cap > 0``), or ``key`` differs between
            processes.
          NonFiniteError: NaN/Inf loss or gradient; that step is not applied.
        """
        batch = self._checked(batch, key)
        self.release_local()  # the sampler copy's HBM goes to the gradient steps; rebuilt after them
        try:
            return self._update(batch, key, where)
        finally:
            self.sync_local()

    def _update(self, batch: TokenBatch, key: jax.Array, where: str) -> dict[str, float]:
        """`update`'s optimizer steps over ``batch`` (checked), without the host-copy refresh."""
        B, plen = self.micro_batch_rows, batch.prompt_lengths()
        counts = distributed.allgather(np.array(batch.rows, np.int64))
        # Every process's micro-batch must have the same shape: the widest prompt length of all.
        widest = int(distributed.allgather(np.array(batch.prompt_len, np.int64)).max())
        stat_keys = self.objective.stat_keys
        totals, gnorms = dict.fromkeys((*stat_keys, "loss"), 0.0), []
        real, processed = 0, 0
        for epoch in range(self.epochs):
            minis = mini_batches(counts, jax.process_index(), self.mini_batch_rows, jax.random.fold_in(key, epoch))
            tokens = distributed.host_sum([batch.response_mask[r].sum() for r in minis])
            real += int(sum(batch.real_tokens()[r].sum() for r in minis))
            if self.pack:
                plans = self._packed_plans(batch, minis, widest)
                processed += sum(B * w for plan in plans for _, w in plan)
            else:
                plans = plan_micro_batches(
                    minis, plen, B, lambda need: self._prompt_width(need, widest), across_processes=True
                )
                processed += sum(B * (w + batch.response_ids.shape[1]) for plan in plans for _, w in plan)
            for j, plan in enumerate(plans):
                if self.pack:
                    width, rwidth = self._pack_widths(batch, widest)
                    micro = (shard_rows(self.mesh, batch.take_packed(lines, width, rwidth, B)[0]) for lines, _ in plan)
                else:
                    micro = (shard_rows(self.mesh, batch.take(rows, width, B)) for rows, width in plan)
                stats, gnorm = self.step(
                    self.objective,
                    micro,
                    float(max(tokens[j], 1)),
                    stat_keys,
                    where=f"PPO update ({where}epoch {epoch}, mini-batch {j})",
                )
                totals = {k: v + stats[k] for k, v in totals.items()}
                gnorms.append(gnorm)
        self.last_tokens["update"] = dict(real=real, processed=processed)
        out = {f"loss/{k}": v / len(gnorms) for k, v in totals.items()}
        out["loss/grad_norm"] = float(np.mean(gnorms))
        out["loss/grad_norm_max"] = float(np.max(gnorms))
        out["loss/updates"] = len(gnorms)
        return out

    def _packed_plans(self, batch: TokenBatch, minis: list[np.ndarray], widest: int) -> list[list]:
        """Per mini-batch, its packed micro-batches as (lines, line width) pairs: the mini-batch's rows
        packed (``pack_lines``), ``micro_batch_rows`` lines a micro-batch; the micro-batch counts are
        agreed over processes (the largest), a process short of lines runs empty micro-batches."""
        width, rwidth = self._pack_widths(batch, widest)
        real, resp, B = batch.real_tokens(), batch.response_mask.sum(1), self.micro_batch_rows
        packed = [pack_lines(r, real, resp, width, rwidth) for r in minis]
        counts = distributed.allgather(np.array([-(-len(p) // B) for p in packed], np.int64)).max(0)
        return [[(p[m * B : (m + 1) * B], width) for m in range(max(int(k), 1))] for p, k in zip(packed, counts)]

    def _checked(self, batch: TokenBatch, key: jax.Array) -> TokenBatch:
        """``batch`` with the fields ``update`` needs (the reference dropped when ``kl_coef == 0``)."""
        kl = self.objective.cfg.kl_coef > 0
        tis = self.objective.cfg.tis_cap > 0
        why = {
            "ref_logprobs": f"; kl_coef={self.objective.cfg.kl_coef} > 0 needs the reference",
            "sampler_logprobs": f"; tis_cap={self.objective.cfg.tis_cap} > 0 needs the sampler's log-probs",
        }
        for name, needed in (
            ("old_logprobs", True),
            ("advantages", True),
            ("ref_logprobs", kl),
            ("sampler_logprobs", tis),
        ):
            if needed and getattr(batch, name) is None:
                raise ValueError(
                    f"PPOLearner.update: the batch has no {name} (TokenBatch.with_({name}=...))" + why.get(name, "")
                )
        raw = np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)
        if not (distributed.allgather(raw) == raw).all():
            raise ValueError("PPOLearner.update: key must be the same on every process (one global shuffle)")
        batch = batch if tis else batch.with_(sampler_logprobs=None)
        return batch if kl else batch.with_(ref_logprobs=None)
