"""A resumable stream of fixed-shape, length-bucketed batches over random-access records (grain).

``BucketStream`` reads a random-access source (a ``tfds.data_source`` split, a list) through grain: this
process's shard of the record indices (``grain.sharding.ShardByJaxProcess`` or given ``ShardOptions``),
a seeded shuffle that changes every epoch, then per-length-bucket buffers that emit ``batch_size``
records of one bucket, so every batch of a bucket has the same padded shape. ``get_state`` /
``set_state`` capture the position exactly (grain's iterator state + the buffered indices): a stream
restored from a saved state yields the batches an uninterrupted one would, no record repeated or skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grain

from bipace_jax.buckets import Buckets


class BucketStream:
    """Endless batches ``(bucket, [item, ...])`` of ``batch_size`` items each from ``source``.

    Args:
      source: a random-access sequence of records (``len`` and ``[i]``), e.g. ``tfds.data_source``.
      encode: record -> item (e.g. token ids); applied when a record is read, and again on restore.
      length: item -> its length in tokens (the bucket is the smallest of ``buckets`` >= it).
      batch_size: items per batch (this process's rows).
      buckets: ascending lengths.
      seed: the shuffle's seed (every epoch a new order from it).
      shard: this process's share of the indices (default ``ShardByJaxProcess(drop_remainder=True)``).

    Raises:
      ValueError: ``batch_size`` < 1, an empty shard, or an item longer than the longest bucket.
    """

    def __init__(
        self,
        source: Sequence[Any],
        encode: Callable[[Any], Any],
        length: Callable[[Any], int],
        batch_size: int,
        buckets: Sequence[int],
        seed: int,
        shard: grain.sharding.ShardOptions | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        shard = shard or grain.sharding.ShardByJaxProcess(drop_remainder=True)
        n = len(source)
        per = n // shard.shard_count if shard.drop_remainder else None
        idx = grain.MapDataset.range(n)[shard.shard_index :: shard.shard_count]
        if per is not None:
            idx = idx[:per]
        if len(idx) == 0:
            raise ValueError(f"shard {shard.shard_index} of {shard.shard_count} of {n} records is empty")
        self.indices = idx  # this process's record indices (a grain MapDataset)
        self.source, self.encode, self.length = source, encode, length
        self.batch_size, self.buckets = batch_size, tuple(buckets)
        self._fit = Buckets(self.buckets, "config.data.length_buckets")
        self._it = iter(idx.shuffle(seed=seed).repeat(None).to_iter_dataset())
        self._buffers: dict[int, list[tuple[int, Any]]] = {b: [] for b in self.buckets}

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, list[Any]]:
        while True:
            i = int(next(self._it))
            item = self.encode(self.source[i])
            b = self._fit.fit_or_raise(self.length(item))
            buf = self._buffers[b]
            buf.append((i, item))
            if len(buf) == self.batch_size:
                self._buffers[b] = []
                return b, [x for _, x in buf]

    def get_state(self) -> dict[str, Any]:
        """JSON-able position: grain's iterator state and the record indices waiting in each bucket."""
        return {
            "iterator": self._it.get_state(),
            "buffers": {str(b): [i for i, _ in buf] for b, buf in self._buffers.items()},
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``get_state()``'s position (buffered records are read and encoded again).

        Raises:
          ValueError: the state's buckets are not this stream's.
        """
        if sorted(int(b) for b in state["buffers"]) != sorted(self.buckets):
            raise ValueError(f"stream state has buckets {sorted(state['buffers'])}, the stream {list(self.buckets)}")
        self._it.set_state(state["iterator"])
        self._buffers = {
            int(b): [(int(i), self.encode(self.source[int(i)])) for i in ids] for b, ids in state["buffers"].items()
        }
