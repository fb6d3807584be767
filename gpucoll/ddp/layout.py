"""One check that every rank registered the same parameter layout, before any sharding.

Sharded training (ZeRO-1, fully sharded parameters) cuts a flat parameter space into equal
slices by position; ranks that disagree on that space would exchange the wrong elements and
never know. One small all-gather of a few numbers per rank (counts, sizes, a checksum of the
shapes) turns that into an error that names the ranks and the numbers that differ.

With hybrid sharding (a replicate communicator beside the shard one) a second small
all-gather, over the replicate communicator, checks that the ranks averaging a slice hold the
same slice: the same shard rank of the same shard size, and the same layout. Both exchanges
run before anything raises, so every rank of both communicators raises alike.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence

import numpy as np

from ..hostarrays import array_module

__all__ = ["shapes_checksum", "check_same_layout"]


def shapes_checksum(shapes: Sequence[Any]) -> int:
    """A 31-bit checksum of a list of shapes (or any list whose repr is stable)."""
    return zlib.crc32(repr(list(shapes)).encode()) & 0x7FFFFFFF


def _all_gather_rows(comm, row: np.ndarray, like: Any) -> np.ndarray:
    table = comm.all_gather(array_module(like).asarray(row))
    return table.get() if hasattr(table, "get") else np.asarray(table)


def _differences(fields: Sequence[str], mine: np.ndarray, theirs: np.ndarray) -> str:
    return ", ".join(f"{name} {int(a)} vs {int(b)}" for name, a, b
                     in zip(fields, mine, theirs) if a != b)


def check_same_layout(comm, who: str, fields: Sequence[str], values: Sequence[int],
                      like: Any, hint: str, replicate: Optional[Any] = None) -> None:
    """All-gather ``values`` (named by ``fields``) and raise when any rank's differ.

    ``like`` is an array of the module the communicator should get (NumPy or CuPy). With a
    ``replicate`` communicator (hybrid sharding), its ranks must also agree on the shard
    size, the shard rank and ``values``: they average the same slice.

    Raises:
        ValueError: "<who>: rank a and rank b have different parameter layouts (<field> x vs
            y, ...); <hint>", or "<who>: replicate rank a and replicate rank b ..." naming the
            shard sizes and ranks that differ.
    """
    mine = np.array(values, dtype=np.int64)
    message = None
    if comm.size > 1:
        for rank, row in enumerate(_all_gather_rows(comm, mine, like)):
            if not np.array_equal(row, mine):
                message = (f"{who}: rank {comm.rank} and rank {rank} have different parameter "
                           f"layouts ({_differences(fields, mine, row)}); {hint}")
                break
    if replicate is not None and replicate.size > 1:
        header = np.array([message is not None, comm.size, comm.rank], dtype=np.int64)
        table = _all_gather_rows(replicate, np.concatenate([header, mine]), like)
        if message is None:
            names = ("failed", "shard size", "shard rank") + tuple(fields)
            for rank, row in enumerate(table):
                if row[0]:
                    message = (f"{who}: the shard group of replicate rank {rank} has different "
                               f"parameter layouts; {hint}")
                elif not np.array_equal(row[1:], table[replicate.rank][1:]):
                    diffs = _differences(names, table[replicate.rank], row)
                    message = (f"{who}: replicate rank {replicate.rank} and replicate rank "
                               f"{rank} hold different shards ({diffs}); the ranks of the "
                               f"replicate communicator must have the same shard rank of "
                               f"shard communicators of one size (Mesh(comm, replicate=R, "
                               f"shard=S) makes both) and the same parameters")
                if message is not None:
                    break
    if message is not None:
        raise ValueError(message)
