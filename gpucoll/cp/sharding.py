"""How a sequence is split over the ranks of a context-parallel group.

``"contiguous"``: rank r holds tokens ``[r * S / p, (r + 1) * S / p)``. Simple, but with a
causal mask the last rank attends to every token before it and rank 0 to almost none, so a ring
step waits for the slowest rank: the work is 1 : 3 : ... : 2p - 1.

``"zigzag"``: the sequence is cut into ``2 p`` chunks and rank r holds chunks ``r`` and
``2 p - 1 - r`` (an early one and a late one), so every rank has the same causal work.

Each rank's tokens are a few runs of consecutive positions ("segments"); the attention code
classifies pairs of segments (fully visible, diagonal, or hidden under the causal mask) instead
of building masks over the whole sequence. Every rank computes every rank's segments from
``(total, size, sharding)``, so positions never travel.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from ..hostarrays import array_module

__all__ = ["SHARDINGS", "sequence_segments", "sequence_positions", "shard_sequence",
           "unshard_sequence"]

SHARDINGS = ("contiguous", "zigzag")

Segment = Tuple[int, int]  # (first global position, length)


def _check(total: int, size: int, sharding: str) -> int:
    """The length of one chunk; ValueError for a sharding that does not fit."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if isinstance(total, bool) or int(total) != total or total < 0:
        raise ValueError(f"the sequence length must be a non-negative int, got {total!r}")
    chunks = size * (2 if sharding == "zigzag" else 1)
    if total % chunks:
        raise ValueError(f"{sharding} sharding over {size} ranks needs a sequence length "
                         f"divisible by {chunks}, got {total}")
    return total // chunks


def sequence_segments(total: int, rank: int, size: int,
                      sharding: str = "contiguous") -> List[Segment]:
    """The runs of positions rank ``rank`` holds, in its local order: ``[(start, length)]``.

    Example::

        sequence_segments(16, 1, 4, "zigzag")      # [(2, 2), (12, 2)]
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is out of range for {size} ranks")
    chunk = _check(total, size, sharding)
    if sharding == "contiguous":
        return [(rank * chunk, chunk)]
    return [(rank * chunk, chunk), ((2 * size - 1 - rank) * chunk, chunk)]


def sequence_positions(total: int, rank: int, size: int,
                       sharding: str = "contiguous") -> np.ndarray:
    """The global position of each of rank ``rank``'s tokens (int64), e.g. for position
    embeddings."""
    runs = [np.arange(start, start + length, dtype=np.int64)
            for start, length in sequence_segments(total, rank, size, sharding)]
    return np.concatenate(runs) if runs else np.zeros(0, np.int64)


def shard_sequence(x: Any, rank: int, size: int, sharding: str = "contiguous", *,
                   axis: int = 1) -> Any:
    """Rank ``rank``'s tokens of the full sequence ``x`` (along ``axis``; default 1, the
    sequence axis of ``(batch, seq, heads, head_dim)``), as a new contiguous array."""
    total = int(x.shape[axis])
    parts = [_take(x, start, length, axis)
             for start, length in sequence_segments(total, rank, size, sharding)]
    xp = array_module(x)
    return xp.ascontiguousarray(parts[0] if len(parts) == 1 else xp.concatenate(parts, axis))


def unshard_sequence(parts: Sequence[Any], sharding: str = "contiguous", *,
                     axis: int = 1) -> Any:
    """The full sequence from every rank's tokens (``parts[r]`` from rank r): the inverse of
    :func:`shard_sequence`."""
    size = len(parts)
    if not size:
        raise ValueError("unshard_sequence needs every rank's part, got none")
    local = int(parts[0].shape[axis])
    total = local * size
    xp = array_module(parts[0])
    shape = list(parts[0].shape)
    shape[axis] = total
    full = xp.empty(shape, dtype=parts[0].dtype)
    for rank, part in enumerate(parts):
        if int(part.shape[axis]) != local:
            raise ValueError(f"rank {rank}'s part has {part.shape[axis]} tokens, rank 0's "
                             f"{local}")
        offset = 0
        for start, length in sequence_segments(total, rank, size, sharding):
            _put(full, start, _take(part, offset, length, axis), axis)
            offset += length
    return full


def _take(x: Any, start: int, length: int, axis: int) -> Any:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + length)
    return x[tuple(index)]


def _put(x: Any, start: int, values: Any, axis: int) -> None:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + int(values.shape[axis]))
    x[tuple(index)] = values
