"""DistributedSampler: each rank iterates over its own disjoint shard of a dataset's indices."""

from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np

__all__ = ["DistributedSampler"]


class DistributedSampler:
    """Indices ``0 .. dataset_size - 1`` split across ranks, reshuffled every epoch.

    Every epoch all ranks draw the same permutation (``seed + epoch``), so the shards are
    disjoint and together cover every index once. When ``dataset_size`` is not a multiple of
    the world size, the permutation is either padded by repeating its first indices (default:
    every index is seen, a few twice) or cut (``drop_last=True``: every rank gets
    ``dataset_size // world_size`` indices, none repeated, a few left out this epoch).

    Args:
        dataset_size: number of samples.
        comm: communicator giving ``rank`` and ``size`` (or pass ``rank`` and ``world_size``).
        shuffle: permute the indices each epoch (else rank ``r`` gets ``r, r + n, ...``).
        seed: shuffling seed; must be the same on every rank.
        drop_last: cut instead of pad for uneven sizes.

    Example (two ranks)::

        sampler = DistributedSampler(len(data), comm)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in np.array_split(sampler.indices(), steps): ...
    """

    def __init__(self, dataset_size: int, comm=None, *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        if comm is not None:
            rank = comm.rank if rank is None else rank
            world_size = comm.size if world_size is None else world_size
        if rank is None or world_size is None:
            raise ValueError("pass a communicator or both rank and world_size")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for world size {world_size}")
        if dataset_size < 0:
            raise ValueError(f"dataset_size must be >= 0, got {dataset_size}")
        self.dataset_size = int(dataset_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = self.dataset_size // self.world_size
        else:
            self.num_samples = math.ceil(self.dataset_size / self.world_size)
        self.total_size = self.num_samples * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (call with the same value on every rank)."""
        self.epoch = int(epoch)

    def indices(self, start: int = 0) -> np.ndarray:
        """This rank's indices for the current epoch (int64 array of ``len(self)``).

        Args:
            start: skip the first ``start`` positions of the epoch's order: resume an epoch
                part-way, e.g. on fewer ranks after ``comm.shrink()`` (position ``start`` is
                where the previous ranks' steps had got to; the rest is re-sharded).
        """
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(self.dataset_size)
        else:
            order = np.arange(self.dataset_size)
        if self.total_size > len(order) and len(order) > 0:
            repeats = math.ceil(self.total_size / len(order))
            order = np.tile(order, repeats)
        order = order[:self.total_size][int(start):]
        return order[self.rank::self.world_size].astype(np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples
