"""Warm-start batching and loss: length-bucketed fixed-size batches (a few compiles only), the
response-token NLL as a ``learner.LossFn``, one update, and the abstract step for ``launch.aot``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from bipace_jax import losses
from bipace_jax.demo_stream import BucketStream
from bipace_jax.learner import Learner, shard_rows, step_specs
from bipace_jax.sft.examples import Example

# -------------------------------------------------------------------------------------------------
# Batching: fixed batch size and length buckets so the train step compiles a few times only.


@flax.struct.dataclass
class SFTBatch:
    """B right-padded rows: T tokens, R response targets (the columns that predict them)."""

    input_ids: jax.Array  # int32[B, T]
    attention_mask: jax.Array  # int32[B, T]
    positions: jax.Array  # int32[B, R], column t predicts token t + 1
    targets: jax.Array  # int32[B, R]
    target_mask: jax.Array  # float32[B, R], 1 on real response tokens


def make_batch(examples: Sequence[Example], length: int, pad_id: int, response_length: int) -> SFTBatch:
    """NumPy ``SFTBatch`` of the examples padded to ``length`` tokens and ``response_length`` targets.

    Raises:
      ValueError: an example longer than ``length`` or a response longer than ``response_length``.
    """
    b = len(examples)
    ids = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.int32)
    pos = np.zeros((b, response_length), np.int32)
    tgt = np.full((b, response_length), pad_id, np.int32)
    tmask = np.zeros((b, response_length), np.float32)
    for r, ex in enumerate(examples):
        seq = ex.prompt_ids + ex.response_ids
        n, p, m = len(seq), len(ex.prompt_ids), len(ex.response_ids)
        if n > length:
            raise ValueError(f"example of {n} tokens does not fit the length bucket {length}")
        if m > response_length:
            raise ValueError(f"response of {m} tokens exceeds config.data.response_length={response_length}")
        ids[r, :n], mask[r, :n] = seq, 1
        pos[r, :m] = np.arange(p - 1, n - 1)
        tgt[r, :m], tmask[r, :m] = ex.response_ids, 1.0
    return SFTBatch(ids, mask, pos, tgt, tmask)


def batches(
    examples: Sequence[Example], batch_size: int, buckets: Sequence[int], rng: np.random.Generator
) -> Iterator[tuple[int, list[Example]]]:
    """Endless (length bucket, examples) batches: a ``demo_stream.BucketStream`` over ``examples`` (this
    process's shard, a new shuffle every epoch seeded from ``rng``), ``batch_size`` of one bucket each."""
    seed = int(rng.integers(2**31))
    return BucketStream(
        list(examples),
        lambda e: e,
        lambda e: len(e.prompt_ids) + len(e.response_ids),
        batch_size,
        buckets,
        seed,
    )


# -------------------------------------------------------------------------------------------------
# The loss, a ``learner.LossFn``.


def token_nll(logits, targets, mask, denom=None):
    """(sum of the NLL of ``targets`` on ``mask`` / ``denom``, argmax accuracy on the same tokens / ``denom``).

    logits float32[B,R,V], targets int32[B,R], mask float32[B,R]; ``denom`` defaults to ``mask.sum()``
    (the token mean); a batch's real-token count makes micro-batch sums its exact token mean.
    """
    nll = -losses.token_logprobs(logits, targets)
    acc = jnp.argmax(logits, axis=-1) == targets
    return losses.token_mean(nll, mask, denom), losses.token_mean(acc, mask, denom)


@dataclasses.dataclass(frozen=True)
class ResponseNLL:
    """The behaviour-cloning loss of an ``SFTBatch``: the LM head runs at the response columns only."""

    def __call__(self, model, mb: SFTBatch, denom):
        h, _ = model.forward_hidden(mb.input_ids, mb.attention_mask)
        h = jnp.take_along_axis(h, mb.positions[..., None], axis=1)
        loss, acc = token_nll(model.lm_logits(h), mb.targets, mb.target_mask, denom)
        return loss, {"token_accuracy": acc}


def train_step(learner: Learner, batch: SFTBatch, micro_rows: int, where: str = "") -> dict[str, float]:
    """One optimizer step on a NumPy batch split into ``micro_rows``-row micro-batches (0: one)."""
    b = batch.input_ids.shape[0]
    micro_rows = micro_rows or b
    micros = (
        shard_rows(learner.mesh, jax.tree.map(lambda x, s=s: x[s : s + micro_rows], batch))
        for s in range(0, b, micro_rows)
    )
    denom = float(max(batch.target_mask.sum(), 1.0))
    stats, gnorm = learner.step(ResponseNLL(), micros, denom, ("token_accuracy",), where=where)
    return dict(stats, grad_norm=gnorm)


def abstract_sft_batch(mesh, rows: int, length: int, response_length: int) -> SFTBatch:
    """An ``SFTBatch`` of ``jax.ShapeDtypeStruct``s: ``rows`` rows of ``length`` tokens and
    ``response_length`` targets, rows split over the mesh's ("data", "fsdp") axes as ``shard_rows`` places them."""
    rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows_sharding)

    r = response_length
    i32 = jnp.int32
    return SFTBatch(
        sds((rows, length), i32),
        sds((rows, length), i32),
        sds((rows, r), i32),
        sds((rows, r), i32),
        sds((rows, r), jnp.float32),
    )


def sft_step_specs(graphdef, tx, mesh, params, rest, opt_state, rows: int, length: int, response_length: int):
    """The warm start's optimizer step as ``ProgramSpec``s (``learner.step_specs`` with ``ResponseNLL``):
    ``"accumulate"`` on one ``rows``-row micro-batch of ``length`` tokens (the longest length bucket) and
    ``response_length`` targets, and ``"apply"``; for ``launch.aot`` (params/rest/opt_state abstract,
    with their shardings, as for the RL step)."""
    mb = abstract_sft_batch(mesh, rows, length, response_length)
    return step_specs(graphdef, ResponseNLL(), tx, mesh, params, rest, opt_state, mb, ("token_accuracy",))
