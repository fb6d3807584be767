"""One check that every rank registered the same parameter layout, before any sharding.

Sharded training (ZeRO-1, fully sharded parameters) cuts a flat parameter space into equal
slices by position; ranks that disagree on that space would exchange the wrong elements and
never know. One small all-gather of a few numbers per rank (counts, sizes, a checksum of the
shapes) turns that into an error that names the ranks and the numbers that differ.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

from ..hostarrays import array_module

__all__ = ["shapes_checksum", "check_same_layout"]


def shapes_checksum(shapes: Sequence[Any]) -> int:
    """A 31-bit checksum of a list of shapes (or any list whose repr is stable)."""
    return zlib.crc32(repr(list(shapes)).encode()) & 0x7FFFFFFF


def check_same_layout(comm, who: str, fields: Sequence[str], values: Sequence[int],
                      like: Any, hint: str) -> None:
    """All-gather ``values`` (named by ``fields``) and raise when any rank's differ.

    ``like`` is an array of the module the communicator should get (NumPy or CuPy).

    Raises:
        ValueError: "<who>: rank a and rank b have different parameter layouts (<field> x vs
            y, ...); <hint>".
    """
    if comm.size == 1:
        return
    mine = np.array(values, dtype=np.int64)
    table = comm.all_gather(array_module(like).asarray(mine))
    table = table.get() if hasattr(table, "get") else np.asarray(table)
    for rank, row in enumerate(table):
        if not np.array_equal(row, mine):
            diffs = ", ".join(f"{name} {int(a)} vs {int(b)}" for name, a, b
                              in zip(fields, mine, row) if a != b)
            raise ValueError(f"{who}: rank {comm.rank} and rank {rank} have different parameter "
                             f"layouts ({diffs}); {hint}")
