"""PPO policy loss with a KL penalty to a reference policy and an entropy bonus.

Pure functions on per-token arrays ``[B, M]`` (B step-record rows, M response-token columns) with a
``mask`` (bool/int ``[B, M]``, True on real response tokens); row advantages (float32 ``[B]``, from
``bipace_jax.estimators.compute_advantages``) are broadcast over the row's tokens. Aggregation is
verl's *token mean*; an explicit denominator (the mini-batch's token count) makes the sum of
micro-batch losses the mini-batch token mean exactly. Defaults are verl-agent / GiGPO / BiPACE's
(``configs/_paper.py``): clip 0.2, dual clip 3.0, low-variance KL coefficient 0.01, entropy 0.001.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp


def token_mean(values: jax.Array, mask: jax.Array, denom: jax.Array | float | None = None) -> jax.Array:
    """float32 scalar ``sum(values * mask) / denom``, ``denom`` by default ``max(sum(mask), 1)``.

    ``values`` float ``[B, M]`` (masked-out positions are ignored, non-finite ones included); ``mask``
    bool/int ``[B, M]``; ``denom`` e.g. the whole mini-batch's real-token count under gradient accumulation.
    """
    m = mask.astype(jnp.float32)
    total = jnp.sum(jnp.where(m > 0, values.astype(jnp.float32), 0.0))
    if denom is None:
        denom = jnp.maximum(jnp.sum(m), 1.0)
    return total / denom


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """float32 ``[B, M]``: ``log softmax(logits)[targets]``.

    ``logits`` float ``[B, M, V]`` at the positions that predict ``targets`` (int32 ``[B, M]`` in
    ``[0, V)``), already divided by the policy's temperature.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """float32 ``[B, M]`` entropy in nats, ``-sum_v p_v log p_v``, of float ``[B, M, V]`` logits
    (computed stably as ``logsumexp(z) - sum_v softmax(z)_v z_v``)."""
    z = logits.astype(jnp.float32)
    p = jax.nn.softmax(z, axis=-1)
    return jax.nn.logsumexp(z, axis=-1) - jnp.sum(p * z, axis=-1)


def ppo_clip_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    clip_eps: float = 0.2,
    dual_clip: float | None = 3.0,
) -> tuple[jax.Array, jax.Array]:
    """Per-token PPO clipped surrogate with dual clipping (Schulman et al. 2017; Ye et al. 2020).

    With ratio ``r = exp(logp - logp_old)`` and advantage ``A``::

        L_clip = max(-A * r, -A * clip(r, 1 - clip_eps, 1 + clip_eps))
        L      = min(L_clip, -A * dual_clip)   if A < 0 (dual clip bounds the loss of a negative
                                                advantage when r is very large)
        L      = L_clip                         otherwise

    ``logprobs`` / ``old_logprobs``: float32 ``[B, M]`` of the taken tokens under the current / the
    collecting policy; ``advantages`` float32 broadcastable to ``[B, M]`` (e.g. ``[B, 1]``);
    ``clip_eps`` > 0; ``dual_clip`` c > 1, or None to disable.

    Returns ``(loss, clipped)``, float32 ``[B, M]`` each: the per-token loss and 1.0 where the clipped
    branch is active (``-A*clip(r) > -A*r``, or the dual clip bounds it).
    """
    ratio = jnp.exp(logprobs - old_logprobs)
    adv = jnp.broadcast_to(advantages, ratio.shape)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = jnp.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip is not None:
        dual = -adv * dual_clip
        dual_active = (adv < 0) & (dual < loss)
        loss = jnp.where(adv < 0, jnp.minimum(loss, dual), loss)
        is_clipped = is_clipped | dual_active
    return loss, is_clipped.astype(jnp.float32)


def low_var_kl(logprobs: jax.Array, ref_logprobs: jax.Array, bound: float = 10.0) -> jax.Array:
    """Low-variance KL estimator ("k3", Schulman 2020) of KL(pi || pi_ref) per token.

    With ``d = logp_ref - logp``::

        k3 = exp(d) - d - 1        (>= 0; unbiased for KL(pi || pi_ref) under samples of pi)

    clamped to ``[-bound, bound]`` as verl's ``low_var_kl`` is, so one token whose reference
    probability collapsed cannot dominate a batch (``bound=float('inf')``: the raw value).
    ``logprobs`` / ``ref_logprobs``: float32 ``[B, M]`` under the current / frozen reference policy;
    returns float32 ``[B, M]``.
    """
    d = ref_logprobs - logprobs
    kl = jnp.expm1(d) - d  # exp(d) - 1 - d without the cancellation that goes negative near d = 0
    return jnp.clip(kl, -bound, bound)


def truncated_is_weights(
    old_logprobs: jax.Array, sampler_logprobs: jax.Array, cap: float
) -> tuple[jax.Array, jax.Array]:
    """Token-level truncated importance weights of the learner's old policy over the sampler's (TIS:
    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's
    ``tis_imp_ratio_cap``, tunix's ``sampler_is="token"``)::

        w = exp(logp_old - logp_sampler)        w_tis = min(w, cap)

    computed as ``exp(min(logp_old - logp_sampler, log cap))``, so no ratio overflows (a log-ratio of
    +100 gives ``cap``, -100 gives 0). ``old_logprobs`` / ``sampler_logprobs``: float32 ``[B, M]`` of
    the taken tokens under the learner's old (recomputed) policy / the sampler; ``cap`` > 0.

    Returns ``(w_tis, truncated)``, float32 ``[B, M]`` each, both without gradient: the weight and 1.0
    where ``w > cap`` (a weight equal to ``cap`` is not truncated).
    """
    log_w = jax.lax.stop_gradient(old_logprobs - sampler_logprobs).astype(jnp.float32)
    log_cap = jnp.float32(math.log(cap))
    return jnp.exp(jnp.minimum(log_w, log_cap)), (log_w > log_cap).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class PPOLossConfig:
    """Coefficients of the PPO objective (defaults: verl-agent / BiPACE paper).

    Attributes:
      clip_eps: PPO clip range (0.2).
      dual_clip: dual-clip constant c > 1 (3.0), or None.
      kl_coef: weight of the low-variance KL to the reference (0.01); 0 disables the reference pass.
      entropy_coef: weight of the entropy bonus (0.001), subtracted from the loss.
      kl_bound: clamp bound of the k3 estimator (10.0, as verl).
      temperature: the T of the trained policy ``softmax(logits / T)`` (1.0); set it to the rollout's
        sampling temperature (as verl does) so that every log-prob, the entropy and the KL describe
        the policy that played.
      tis_cap: C of the truncated importance weights ``min(pi_old / pi_sampler, C)`` that multiply the
        policy-gradient term per token (``truncated_is_weights``); 0 = off (no sampler log-probs needed).
    """

    clip_eps: float = 0.2
    dual_clip: float | None = 3.0
    kl_coef: float = 0.01
    entropy_coef: float = 0.001
    kl_bound: float = 10.0
    temperature: float = 1.0
    tis_cap: float = 0.0

    def __post_init__(self):
        checks = (
            ("clip_eps", 0 < self.clip_eps < 1, "lie in (0, 1)"),
            ("dual_clip", self.dual_clip is None or self.dual_clip > 1.0, "be > 1 (None or, in a run config, 0 = off)"),
            ("kl_coef", self.kl_coef >= 0, "be >= 0"),
            ("entropy_coef", self.entropy_coef >= 0, "be >= 0"),
            ("kl_bound", self.kl_bound > 0, "be > 0"),
            ("temperature", self.temperature > 0, "be > 0 (the rollout's sampling temperature)"),
            ("tis_cap", 0 <= self.tis_cap < float("inf"), "be a finite number >= 0 (0 = off)"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"PPOLossConfig.{name} must {expected}, got {getattr(self, name)}")


def ppo_loss_from_logprobs(
    logprobs: jax.Array,
    entropy: jax.Array,
    mask: jax.Array,
    old_logprobs: jax.Array,
    ref_logprobs: jax.Array | None,
    advantages: jax.Array,
    cfg: PPOLossConfig,
    denom: jax.Array | float | None = None,
    sampler_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """Total PPO objective on one (micro-)batch, token-mean aggregated::

        loss = mean_tok(w_tis * L_ppo) + kl_coef * mean_tok(k3) - entropy_coef * mean_tok(H)

    with ``w_tis`` = 1 when ``cfg.tis_cap`` is 0, else the truncated importance weights of the old
    over the sampler's log-probs (``truncated_is_weights``). Only the policy-gradient term is weighted,
    as verl's TIS and tunix's ``sampler_is`` do: the KL and entropy terms are regularisers of the
    current policy, not estimates under the sampler's distribution, and weighting them would make their
    strength depend on the sampler/learner mismatch.

    Args:
      logprobs: float32 ``[B, M]`` current-policy log-probs (at ``cfg.temperature``) of the response
        tokens; entropy: float32 ``[B, M]`` the policy's entropy at each position, nats.
      mask: bool ``[B, M]`` real response tokens (elsewhere every input is ignored, values and
        gradients alike, however large or non-finite).
      old_logprobs, ref_logprobs: float32 ``[B, M]`` behaviour- and reference-policy log-probs
        (ref may be None: KL term 0, ``cfg.kl_coef`` must be 0).
      advantages: float32 ``[B]``, one per row; cfg: coefficients.
      denom: token count of the mean (default: this batch's real-token count, at least 1).
      sampler_logprobs: float32 ``[B, M]`` the sampler's log-probs of the taken tokens (needed only
        when ``cfg.tis_cap > 0``).

    Returns:
      ``(loss, metrics)``: the scalar loss and ``pg_loss``, ``kl``, ``entropy``, ``clip_frac``,
      ``approx_kl_old`` (token sums already divided by ``denom``, so micro-batch values add up); with
      ``cfg.tis_cap > 0`` also ``is_weight`` (mean of ``w_tis``) and ``is_truncated_frac`` (share of
      tokens with ``w > tis_cap``).

    Raises:
      ValueError: ``ref_logprobs`` is None while ``cfg.kl_coef > 0``, or ``sampler_logprobs`` is None
        while ``cfg.tis_cap > 0`` (at trace time).
    """
    if ref_logprobs is None and cfg.kl_coef > 0:
        raise ValueError(f"ref_logprobs is None but kl_coef={cfg.kl_coef} > 0")
    if sampler_logprobs is None and cfg.tis_cap > 0:
        raise ValueError(f"sampler_logprobs is None but tis_cap={cfg.tis_cap} > 0")
    # masked positions never reach an exponent: exp of a padding token's log-ratio can overflow to
    # inf, and the mask's zero times inf is a NaN gradient; there the log-probs are taken as equal
    live = mask.astype(bool)
    logprobs = jnp.where(live, logprobs, 0.0)
    old_logprobs = jnp.where(live, old_logprobs, 0.0)
    ref_logprobs = None if ref_logprobs is None else jnp.where(live, ref_logprobs, 0.0)
    pg, clipped = ppo_clip_loss(logprobs, old_logprobs, advantages[:, None], cfg.clip_eps, cfg.dual_clip)
    tis = {}
    if cfg.tis_cap > 0:
        w, truncated = truncated_is_weights(old_logprobs, jnp.where(live, sampler_logprobs, 0.0), cfg.tis_cap)
        pg = w * pg
        tis = {"is_weight": token_mean(w, mask, denom), "is_truncated_frac": token_mean(truncated, mask, denom)}
    pg_loss = token_mean(pg, mask, denom)
    entropy = token_mean(entropy, mask, denom)
    if ref_logprobs is not None:
        kl = token_mean(low_var_kl(logprobs, ref_logprobs, cfg.kl_bound), mask, denom)
    else:
        kl = jnp.zeros((), jnp.float32)
    loss = pg_loss + cfg.kl_coef * kl - cfg.entropy_coef * entropy
    metrics = {
        "pg_loss": pg_loss,
        "kl": kl,
        "entropy": entropy,
        "clip_frac": token_mean(clipped, mask, denom),
        "approx_kl_old": token_mean(0.5 * jnp.square(logprobs - old_logprobs), mask, denom),
        **tis,
    }
    return loss, metrics
