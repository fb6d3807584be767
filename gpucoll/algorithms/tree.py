"""Binomial-tree algorithms: ``ceil(log2 n)`` steps, the latency-optimal choice for small
messages of rooted collectives.

Ranks are renumbered relative to the root (``vrank = (rank - root) % n``). In the broadcast,
``vrank`` receives from ``vrank - lowbit(vrank)`` at the level of that bit, then sends to
``vrank + 2**k`` for every lower level ``k``. The reduce runs the same tree upwards: at level
``k`` a rank whose bit ``k`` is clear folds in the partial result of ``vrank + 2**k``; a rank
whose bit ``k`` is set sends its partial result to ``vrank - 2**k`` and is done. Messages of
level ``k`` carry tag ``k``.

The reduction order is fixed by the tree (lower ``vrank`` on the left of the op), so a
result does not depend on timing.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gpucoll.algorithms.direct import Combine, byte_view, copy_into, reducer_into
from gpucoll.transports.base import Frame, Recv, Transport

__all__ = ["binomial_broadcast", "binomial_reduce", "tree_all_reduce", "levels"]


def levels(size: int) -> int:
    """``ceil(log2 size)``: the depth of a binomial tree over ``size`` ranks (0 for 1 rank)."""
    return (size - 1).bit_length()


def _broadcast(t: Transport, buf: np.ndarray, root: int, frame: Frame, deadline: float,
               first_tag: int) -> None:
    rank, size = t.rank, t.size
    vrank = (rank - root) % size
    payload = byte_view(buf)
    level = levels(size)
    if vrank:
        level = (vrank & -vrank).bit_length() - 1  # lowest set bit: the level we receive at
        parent = (vrank - (1 << level) + root) % size
        t.exchange([], [Recv(parent, payload)], frame.with_tag(first_tag + level), deadline)
    for child_level in range(level - 1, -1, -1):
        child = vrank + (1 << child_level)
        if child < size:
            t.exchange([((child + root) % size, payload)], [],
                       frame.with_tag(first_tag + child_level), deadline)


def binomial_broadcast(t: Transport, buf: np.ndarray, root: int, frame: Frame,
                       deadline: float) -> None:
    """Broadcast in place down a binomial tree; each rank forwards to its larger subtrees first.

    Steps: ``ceil(log2 n)``. Bytes: ``ceil(log2 n) * N`` from the root, ``N`` per child
    from every inner rank, nothing from leaves.
    """
    if t.size > 1:
        _broadcast(t, buf, root, frame, deadline, first_tag=0)


def _reduce(t: Transport, send: np.ndarray, out: Optional[np.ndarray], root: int,
            combine: Combine, frame: Frame, deadline: float) -> None:
    rank, size = t.rank, t.size
    vrank = (rank - root) % size
    itemsize = send.dtype.itemsize
    partial = send  # what this rank sends up; a scratch copy once something is folded in
    writable = rank == root
    if writable:
        copy_into(out, send)
        partial = out
    for level in range(levels(size)):
        bit = 1 << level
        tag = frame.with_tag(level)
        if vrank & bit:
            t.exchange([((vrank - bit + root) % size, byte_view(partial))], [], tag, deadline)
            return
        child = vrank + bit
        if child < size:
            if not writable:
                partial, writable = send.copy(), True
            t.exchange([], [Recv((child + root) % size, byte_view(partial),
                                 reducer_into(partial, combine), itemsize)], tag, deadline)


def binomial_reduce(t: Transport, send: np.ndarray, out: Optional[np.ndarray], root: int,
                    combine: Combine, frame: Frame, deadline: float) -> None:
    """Reduce to ``root`` up a binomial tree; incoming partial results are folded in while
    they arrive. Non-roots with children accumulate in a scratch copy of ``send``; leaves send
    ``send`` itself.

    Steps: ``ceil(log2 n)``. Bytes: ``N`` from every non-root, nothing from the root (which
    receives ``ceil(log2 n) * N``). Scratch: ``N`` on inner non-root ranks.

    Args:
        send: the local contribution, not modified (unless ``out`` is ``send`` on the root).
        out: the result on the root (may be ``send``), None elsewhere.
    """
    if t.size == 1:
        copy_into(out, send)
        return
    _reduce(t, send, out, root, combine, frame, deadline)


def tree_all_reduce(t: Transport, buf: np.ndarray, combine: Combine, frame: Frame,
                    deadline: float) -> None:
    """All-reduce in place: binomial reduce to rank 0, then binomial broadcast from it.
    The result is computed once and copied, so every rank holds the same bits.

    Steps: ``2 ceil(log2 n)``. Bytes: up to ``2 ceil(log2 n) * N`` (rank 0's broadcast),
    ``N`` up and up to ``ceil(log2 n) * N`` down elsewhere. Scratch: ``N`` on inner ranks.
    """
    size = t.size
    if size == 1:
        return
    _reduce(t, buf, buf if t.rank == 0 else None, 0, combine, frame, deadline)
    _broadcast(t, buf, 0, frame, deadline, first_tag=levels(size))
