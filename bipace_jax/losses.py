"""PPO policy loss with a KL penalty to a reference policy and an entropy bonus.

Each term is a short pure function on per-token arrays of one (micro-)batch of response tokens:
``[B, M]`` with B rows (one row per step record) and M response-token columns, plus a ``mask``
(bool/int ``[B, M]``, True on real response tokens). Row advantages (float32 ``[B]``, one per step
record, from ``bipace_jax.estimators.compute_advantages``) are broadcast over the row's tokens.

Aggregation is the *token mean* (verl's ``token-mean``): the sum over every real response token of
the batch divided by the number of real tokens. For gradient accumulation the denominator can be
given explicitly (the token count of the whole mini-batch), so the sum of micro-batch losses equals
the mini-batch token mean exactly.

Defaults are the verl-agent / GiGPO / BiPACE ones (their training scripts, as ``configs/_paper.py`` sets them): clip 0.2, dual clip 3.0,
low-variance KL coefficient 0.01, entropy coefficient 0.001.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def token_mean(values: jax.Array, mask: jax.Array, denom: jax.Array | float | None = None) -> jax.Array:
    """Token mean ``sum(values * mask) / denom`` with ``denom = max(sum(mask), 1)`` by default.

    Args:
      values: float ``[B, M]`` per-token values (any finite values at masked-out positions are
        ignored; non-finite ones too, they are replaced by 0 before the sum).
      mask: bool/int ``[B, M]``, True (1) on real response tokens.
      denom: optional scalar denominator (e.g. the real-token count of the whole mini-batch when
        accumulating gradients over micro-batches). ``None``: this batch's own token count, at least 1.

    Returns:
      float32 scalar.
    """
    m = mask.astype(jnp.float32)
    total = jnp.sum(jnp.where(m > 0, values.astype(jnp.float32), 0.0))
    if denom is None:
        denom = jnp.maximum(jnp.sum(m), 1.0)
    return total / denom


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Log-probability of each target token: ``log softmax(logits / temperature)[targets]``.

    Args:
      logits: float ``[B, M, V]`` (the actor's logits at the positions that predict ``targets``).
      targets: int32 ``[B, M]`` token ids in ``[0, V)``.
      temperature: the sampling temperature the policy is defined at (1.0 for training).

    Returns:
      float32 ``[B, M]``.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of the categorical distribution at every position: ``H = -sum_v p_v log p_v``.

    Computed stably as ``logsumexp(z) - sum_v softmax(z)_v z_v``.

    Args:
      logits: float ``[B, M, V]``.

    Returns:
      float32 ``[B, M]`` in nats.
    """
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

    Args:
      logprobs: float32 ``[B, M]`` log-probabilities of the taken tokens under the current policy.
      old_logprobs: float32 ``[B, M]`` the same under the policy that collected the data.
      advantages: float32 ``[B, M]`` (or broadcastable, e.g. ``[B, 1]``).
      clip_eps: PPO clip range epsilon (> 0).
      dual_clip: the dual-clip constant c (> 1), or None to disable.

    Returns:
      ``(loss, clipped)``: float32 ``[B, M]`` per-token loss and float32 ``[B, M]`` indicator (1.0
      where the clipped branch is active: ``-A*clip(r) > -A*r``, or the dual clip bounds it).
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

    and, as verl's ``low_var_kl`` does, bounded to ``[-bound, bound]`` so a single token whose
    reference probability collapsed cannot dominate a batch (the bound is part of the estimator,
    not a silent fix: pass ``bound=float('inf')`` for the raw value).

    Args:
      logprobs: float32 ``[B, M]`` under the current policy.
      ref_logprobs: float32 ``[B, M]`` under the frozen reference policy.
      bound: clamp bound (> 0).

    Returns:
      float32 ``[B, M]``.
    """
    d = ref_logprobs - logprobs
    kl = jnp.expm1(d) - d  # exp(d) - 1 - d without the cancellation that goes negative near d = 0
    return jnp.clip(kl, -bound, bound)


@dataclasses.dataclass(frozen=True)
class PPOLossConfig:
    """Coefficients of the PPO objective (defaults: verl-agent / BiPACE paper).

    Attributes:
      clip_eps: PPO clip range (0.2).
      dual_clip: dual-clip constant c > 1 (3.0), or None.
      kl_coef: weight of the low-variance KL to the reference (0.01); 0 disables the reference pass.
      entropy_coef: weight of the entropy bonus (0.001), subtracted from the loss.
      kl_bound: clamp bound of the k3 estimator (10.0, as verl).
      temperature: the temperature the trained policy is defined at, ``softmax(logits / T)`` (1.0).
        Set it to the rollout's sampling temperature (as verl does), so that the behaviour,
        current and reference log-probabilities, the entropy and the KL all describe the policy
        that actually played.
    """

    clip_eps: float = 0.2
    dual_clip: float | None = 3.0
    kl_coef: float = 0.01
    entropy_coef: float = 0.001
    kl_bound: float = 10.0
    temperature: float = 1.0

    def __post_init__(self):
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"PPOLossConfig.clip_eps must lie in (0, 1), got {self.clip_eps}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(
                f"PPOLossConfig.dual_clip must be > 1 (None or, in a run config, 0 = off), got {self.dual_clip}"
            )
        if not self.kl_coef >= 0:
            raise ValueError(f"PPOLossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"PPOLossConfig.entropy_coef must be >= 0, got {self.entropy_coef}")
        if not self.kl_bound > 0:
            raise ValueError(f"PPOLossConfig.kl_bound must be > 0, got {self.kl_bound}")
        if not self.temperature > 0:
            raise ValueError(
                f"PPOLossConfig.temperature must be > 0 (the rollout's sampling temperature), got {self.temperature}"
            )


def ppo_loss(
    logits: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    old_logprobs: jax.Array,
    ref_logprobs: jax.Array | None,
    advantages: jax.Array,
    cfg: PPOLossConfig,
    denom: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """Total PPO objective on one (micro-)batch, token-mean aggregated::

        loss = mean_tok(L_ppo) + kl_coef * mean_tok(k3) - entropy_coef * mean_tok(H)

    Args:
      logits: float ``[B, M, V]`` current-policy logits at the positions predicting ``targets``
        (raw: divided by ``cfg.temperature`` here).
      targets: int32 ``[B, M]`` the response tokens.
      mask: bool ``[B, M]`` real response tokens.
      old_logprobs: float32 ``[B, M]`` behaviour-policy log-probabilities.
      ref_logprobs: float32 ``[B, M]`` reference-policy log-probabilities, or None (KL term 0;
        then ``cfg.kl_coef`` must be 0).
      advantages: float32 ``[B]`` one advantage per row (step record).
      cfg: coefficients.
      denom: token count used for the mean (default: this batch's real-token count, at least 1).

    Returns:
      ``(loss, metrics)``: the scalar loss and token-sums-over-denom metrics ``pg_loss``, ``kl``,
      ``entropy``, ``clip_frac`` (each already divided by ``denom``, so micro-batch values add up).

    Raises:
      ValueError: ``ref_logprobs`` is None while ``cfg.kl_coef > 0`` (at trace time).
    """
    if ref_logprobs is None and cfg.kl_coef > 0:
        raise ValueError(f"ref_logprobs is None but kl_coef={cfg.kl_coef} > 0")
    if cfg.temperature != 1.0:
        logits = logits.astype(jnp.float32) / cfg.temperature
    logprobs = token_logprobs(logits, targets)
    pg, clipped = ppo_clip_loss(logprobs, old_logprobs, advantages[:, None], cfg.clip_eps, cfg.dual_clip)
    ent = entropy_from_logits(logits)
    if denom is None:
        denom = jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
    pg_loss = token_mean(pg, mask, denom)
    entropy = token_mean(ent, mask, denom)
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
    }
    return loss, metrics
