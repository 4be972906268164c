"""PPO on the learner core: the micro-batch pytree, the objective, old/reference log-probs, the update.

Shapes: N step rows, P prompt columns (left-padded, bucketed), M response columns (right-padded),
T = P + M, V vocabulary, B micro-batch rows.

An update is ``epochs`` passes over the iteration's rows, shuffled, split into mini-batches (one AdamW
step each) and fixed-shape micro-batches whose gradients are summed; the token mean of each
mini-batch is exact (its denominator is the mini-batch's real-token count over all hosts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bipace_jax import distributed, losses, sharding
from bipace_jax.learner import Learner, NonFiniteError, mesh_context, shard_rows
from bipace_jax.rollout import TokenBatch

__all__ = ["MicroBatch", "NonFiniteError", "PPOLearner", "PPOObjective"]

STAT_KEYS = ("pg_loss", "kl", "entropy", "clip_frac", "approx_kl_old", "sampler_gap")


@flax.struct.dataclass
class MicroBatch:
    """B rows of one gradient pass (fixed shape; padding rows have all-zero masks)."""

    input_ids: jax.Array  # int32[B, T]
    attention_mask: jax.Array  # int32[B, T]
    response_ids: jax.Array  # int32[B, M]
    response_mask: jax.Array  # bool[B, M]
    old_logprobs: jax.Array  # float32[B, M]
    ref_logprobs: jax.Array  # float32[B, M] (zeros when kl_coef == 0)
    advantages: jax.Array  # float32[B]


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
    """
    h, _ = model.forward_hidden(input_ids, attention_mask)  # [B, T, D]
    b, m = response_ids.shape
    h = h[:, input_ids.shape[1] - m - 1 : -1]  # the M positions that predict the response

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
    """The PPO loss of a micro-batch (``losses.ppo_loss``), a ``learner.LossFn``.

    ``fused_old``: the old log-probs are ``stop_gradient`` of the current ones inside the gradient pass
    (exact when the iteration makes one optimizer step: every micro-batch's gradient is taken at the
    behaviour policy's parameters); ``old_logprobs`` then carries the sampler's log-probs, used only for
    the ``sampler_gap`` statistic.
    """

    cfg: losses.PPOLossConfig
    fused_old: bool = False
    support: int | None = None
    chunk: int = 0

    def __call__(self, model, mb: MicroBatch, denom):
        cfg = self.cfg
        logp, ent = response_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            mb.response_ids,
            temperature=cfg.temperature,
            support=self.support,
            chunk=self.chunk,
        )
        old, gap = mb.old_logprobs, jnp.zeros((), jnp.float32)
        if self.fused_old:
            gap = losses.token_mean(jnp.abs(old - logp), mb.response_mask, denom)
            old = jax.lax.stop_gradient(logp)
        ref = mb.ref_logprobs if cfg.kl_coef > 0 else None
        loss, stats = losses.ppo_loss_from_logprobs(logp, ent, mb.response_mask, old, ref, mb.advantages, cfg, denom)
        return loss, dict(stats, sampler_gap=gap)


@functools.lru_cache(maxsize=16)
def _logprobs_program(graphdef, temperature: float, support: int | None, chunk: int = 0):
    @jax.jit
    def logprobs(params, rest, input_ids, attention_mask, response_ids):
        model = nnx.merge(graphdef, params, rest)
        kw = dict(temperature=temperature, support=support, chunk=chunk)
        return response_logprobs(model, input_ids, attention_mask, response_ids, **kw)[0]

    return logprobs


class PPOLearner(Learner):
    """A ``Learner`` that computes log-probs of rollout rows and takes PPO updates on them.

    Args:
      actor, mesh, tx, local_mesh: as ``Learner``.
      loss_cfg: PPO coefficients; ``kl_coef > 0`` keeps the frozen initial parameters as the reference.
      micro_batch_rows: B, rows per forward/backward on this process (fixed shape).
      mini_batch_rows: rows per optimizer step on this process (0: all rows, one step per epoch).
      epochs: passes over the rows per ``update``.
      fused_old_logprobs: take the old log-probs inside the gradient pass (``PPOObjective.fused_old``);
        requires one optimizer step per ``update`` (``epochs == 1``, ``mini_batch_rows == 0``);
        ``update``'s ``old_lp`` is then the sampler's log-probs, reported as ``loss/sampler_gap``.
      prompt_buckets: prompt lengths a micro-batch may be cut down to (the sampler's length buckets);
        () keeps every micro-batch at the iteration's ``TokenBatch.prompt_len``.
      support: ids below it form the policy's distribution (the tokenizer's size, as the sampler's);
        None: all of the logits' V columns.
      logprob_chunk: response positions per LM-head chunk (``response_logprobs``); 0: all at once.

    Raises:
      ValueError: ``fused_old_logprobs`` with more than one optimizer step per update.
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
    ):
        if fused_old_logprobs and (epochs != 1 or mini_batch_rows != 0):
            raise ValueError(
                f"fused_old_logprobs needs one optimizer step per update (epochs=1, mini_batch_rows=0), "
                f"got epochs={epochs}, mini_batch_rows={mini_batch_rows}"
            )
        super().__init__(actor, mesh, tx, local_mesh=local_mesh, keep_reference=loss_cfg.kl_coef > 0)
        self.objective = PPOObjective(loss_cfg, fused_old_logprobs, support, logprob_chunk)
        self.micro_batch_rows, self.mini_batch_rows, self.epochs = micro_batch_rows, mini_batch_rows, epochs
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))

    def logprobs(self, params_local, batch: TokenBatch) -> np.ndarray:
        """float32[N, M] log-probs of the responses under ``params_local`` (host-local, micro-batched).

        Runs under this host's mesh (``local_mesh``) with each micro-batch's rows split over its
        ("data", "fsdp") axes; the rows are padded to a multiple of data*fsdp (padding rows are dropped).
        """
        o = self.objective
        fn = _logprobs_program(self.graphdef, o.cfg.temperature, o.support, o.chunk)
        dp = math.prod(sharding.mesh_axis_sizes(self.local_mesh)[a] for a in ("data", "fsdp"))
        B = -(-self.micro_batch_rows // dp) * dp
        out = np.zeros(batch.response_ids.shape, np.float32)
        plen = batch.prompt_lengths()
        order = np.argsort(plen, kind="stable")  # similar lengths share a micro-batch
        for s in range(0, batch.rows, self.micro_batch_rows):
            r = order[s : s + self.micro_batch_rows]
            width = self._prompt_width(int(plen[r].max()), batch.prompt_len)
            ids, att = (
                _pad_rows(self._micro_rows(x, r, batch, width), B) for x in (batch.input_ids, batch.attention_mask)
            )
            att[:, -1] |= att.sum(1) == 0  # padding rows get one real token (no empty softmax)
            rows = [ids, att, _pad_rows(batch.response_ids[r], B)]
            with mesh_context(self.local_mesh):
                placed = [jax.device_put(x, sharding.batch_sharding(self.local_mesh, x.ndim)) for x in rows]
                lp = fn(params_local, self.rest, *placed)
            out[r] = np.asarray(lp)[: len(r)]
        return out

    def _prompt_width(self, need: int, widest: int) -> int:
        """Prompt columns for a micro-batch whose longest prompt has ``need`` tokens: the smallest of
        ``prompt_buckets`` that holds it, else ``widest``. Padding columns carry mask 0 and positions come
        from the mask, so the log-probs do not depend on it (one program per bucket)."""
        fit = [b for b in self.prompt_buckets if max(need, 1) <= b]
        return min(fit[0], widest) if fit else widest

    def _micro_rows(self, x: np.ndarray, rows: np.ndarray, batch: TokenBatch, width: int) -> np.ndarray:
        """``x[rows]`` ([n, P + M]) with its prompt part cut, or left-padded with zero columns, to
        ``width`` and its rows padded to the micro-batch size."""
        x, P_ = x[rows], batch.prompt_len
        if width <= P_:
            x = x[:, P_ - width :]
        else:
            x = np.concatenate([np.zeros((x.shape[0], width - P_), x.dtype), x], 1)
        return _pad_rows(x, self.micro_batch_rows)

    def _micro_batch(self, batch, r, width, old_lp, ref_lp, adv) -> MicroBatch:
        B = self.micro_batch_rows
        att = self._micro_rows(batch.attention_mask, r, batch, width)
        att[:, -1] |= att.sum(1) == 0
        ref = ref_lp[r] if ref_lp is not None else np.zeros_like(old_lp[r])
        mb = MicroBatch(
            input_ids=self._micro_rows(batch.input_ids, r, batch, width),
            attention_mask=att,
            response_ids=_pad_rows(batch.response_ids[r], B),
            response_mask=_pad_rows(batch.response_mask[r], B),
            old_logprobs=_pad_rows(old_lp[r], B),
            ref_logprobs=_pad_rows(ref, B),
            advantages=_pad_rows(adv[r], B),
        )
        return shard_rows(self.mesh, mb)

    def update(
        self,
        batch: TokenBatch,
        old_lp: np.ndarray,
        ref_lp: np.ndarray | None,
        adv: np.ndarray,
        key: jax.Array,
        where: str = "",
    ) -> dict[str, float]:
        """Mini-batch PPO with gradient accumulation over fixed-shape micro-batches.

        Every process calls it with its own N rows (``batch``); mini- and micro-batch counts are agreed
        over processes, a process short of rows contributes all-padding micro-batches. ``old_lp``,
        ``ref_lp``: float32[N, M] (ref may be None when kl_coef == 0); ``adv``: float32[N]; ``key``
        shuffles; ``where`` names the iteration in the error message.

        Returns:
          metrics ``loss/*`` averaged over the optimizer steps, ``loss/grad_norm`` (before clipping).

        Raises:
          NonFiniteError: NaN/Inf loss or gradient; that step is not applied.
        """
        B, n_local = self.micro_batch_rows, batch.rows
        counts = distributed.allgather(np.array([n_local], np.int64))[:, 0]
        mb_rows = self.mini_batch_rows or int(max(counts.max(), 1))
        n_mini = max(math.ceil(counts.max() / mb_rows), 1)
        totals = dict.fromkeys((*STAT_KEYS, "loss"), 0.0)
        gnorms = []
        plen = batch.prompt_lengths()
        # Every process's micro-batch must have the same shape: the widest prompt length of all.
        widest = int(distributed.allgather(np.array([batch.prompt_len], np.int64)).max())
        for epoch in range(self.epochs):
            perm = (
                np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), n_local))
                if n_local
                else np.zeros(0, int)
            )
            # Rows ordered by prompt length inside a mini-batch (the gradient sum ignores order), so
            # each micro-batch keeps only the prompt columns its longest prompt needs.
            minis = [perm[j * mb_rows : (j + 1) * mb_rows] for j in range(n_mini)]
            minis = [r[np.argsort(plen[r], kind="stable")] for r in minis]
            info = distributed.allgather(
                np.array([[len(r), int(batch.response_mask[r].sum())] for r in minis], np.int64)
            )
            k_micros = [max(math.ceil(info[:, j, 0].max() / B), 1) for j in range(n_mini)]
            need = [int(plen[r[m * B : (m + 1) * B]].max(initial=1)) for r, k in zip(minis, k_micros) for m in range(k)]
            needs = distributed.allgather(np.array(need, np.int64)).max(0)
            widths = iter([self._prompt_width(int(nd), widest) for nd in needs])
            for j, rows in enumerate(minis):
                micro = (
                    self._micro_batch(batch, rows[m * B : (m + 1) * B], next(widths), old_lp, ref_lp, adv)
                    for m in range(k_micros[j])
                )
                stats, gnorm = self.step(
                    self.objective,
                    micro,
                    float(max(info[:, j, 1].sum(), 1)),
                    STAT_KEYS,
                    where=f"PPO update ({where}epoch {epoch}, mini-batch {j})",
                )
                for k in totals:
                    totals[k] += stats[k]
                gnorms.append(gnorm)
        out = {f"loss/{k}": v / len(gnorms) for k, v in totals.items()}
        out["loss/grad_norm"] = float(np.mean(gnorms))
        out["loss/grad_norm_max"] = float(np.max(gnorms))
        out["loss/updates"] = len(gnorms)
        self.sync_local()
        return out


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    x = np.asarray(x)
    if x.shape[0] == rows:
        return x.copy()
    return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)], 0)
