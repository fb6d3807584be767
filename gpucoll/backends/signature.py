"""Operation signatures for ``GPUCOLL_DEBUG`` mismatch checks, shared by every backend.

Before a collective, each rank publishes a fixed-size signature (op, reduction, dtype, shape,
root, sequence number); if the ranks disagree, :func:`mismatch_error` names the odd ranks and
what each of them called, and the operation is refused before any data moves.
"""

from __future__ import annotations

import struct
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..errors import CollectiveMismatchError
from ..transports.base import OP_CODES, OP_NAMES
from ..types import ReduceOp, dtype_from_code, wire_code

__all__ = ["SIGNATURE", "pack", "describe", "mismatch_error"]

SIGNATURE = struct.Struct("<BBBBiQQ8Q")  # op, redop, dtype, ndim, root, seq, count, shape[8]
_REDOPS = {op: i for i, op in enumerate(ReduceOp, start=1)}
_REDOP_NAMES = {i: op.value for op, i in _REDOPS.items()}


def pack(name: str, seq: int, dtype, shape: Sequence[int], op: Optional[ReduceOp] = None,
         root: int = -1) -> bytes:
    """The signature of operation ``name`` #``seq`` on an array of ``dtype`` and ``shape``."""
    shape = tuple(int(d) for d in shape)
    dims = list(shape[:8]) + [0] * (8 - min(len(shape), 8))
    count = int(np.prod(shape)) if shape else 1
    return SIGNATURE.pack(OP_CODES[name], _REDOPS.get(op, 0),
                          wire_code(dtype) if dtype is not None else 0,
                          len(shape), root, seq, count, *dims)


def describe(signature: bytes) -> str:
    """``all_reduce #3(dtype=float32, shape=(4,), op=sum)`` for a packed signature."""
    op, redop, dtype, ndim, root, seq, count, *dims = SIGNATURE.unpack(signature)
    parts = [f"dtype={dtype_from_code(dtype) if dtype else '-'}", f"shape={tuple(dims[:ndim])}"]
    if redop:
        parts.append(f"op={_REDOP_NAMES[redop]}")
    if root >= 0:
        parts.append(f"root={root}")
    return f"{OP_NAMES.get(op, op)} #{seq}({', '.join(parts)})"


def mismatch_error(signatures: Dict[int, bytes], rank: int, name: str,
                   seq: int) -> Optional[CollectiveMismatchError]:
    """None when every rank's signature agrees, else the error naming who called what.

    The majority signature (ties: the lowest rank's) is taken as the reference.
    """
    if len(set(signatures.values())) <= 1:
        return None
    holders: Dict[bytes, List[int]] = {}
    for r in sorted(signatures):
        holders.setdefault(signatures[r], []).append(r)
    reference = max(holders, key=lambda sig: (len(holders[sig]), -holders[sig][0]))
    odd = sorted(r for r, sig in signatures.items() if sig != reference)
    ref_rank = holders[reference][0]
    lines = [f"rank {r} called {describe(signatures[r])}" for r in odd]
    others = len(holders[reference]) - 1
    who = f"rank {ref_rank}" + (f" (and {others} more)" if others else "")
    return CollectiveMismatchError(
        f"collective mismatch at op #{seq}: {who} called {describe(reference)}, but "
        + "; ".join(lines),
        rank=rank, peer=odd[0], op=name, seq=seq)
