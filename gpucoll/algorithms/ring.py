"""Ring algorithms: each rank sends only to its right neighbour and receives only from its left.

Bandwidth-optimal for large messages: the data is cut into one segment per rank and every
segment travels the ring once, so each rank sends about ``(n - 1) / n`` of the buffer per
phase whatever the world size. Reductions are pipelined: an incoming segment is folded into
the local one chunk by chunk while the rest of it is still arriving (``Recv.reduce``).

Every segment is reduced along a fixed chain of ranks and then copied (never recomputed), so
all ranks end with bitwise-identical floating-point results.

Segments have uneven sizes when the count is not a multiple of the world size (see
:func:`~gpucoll.algorithms.direct.segment_bounds`); they may be empty, in which case empty
messages are still exchanged.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from gpucoll.algorithms.direct import (Combine, byte_view, copy_into, reducer_into,
                                       segment_bounds)
from gpucoll.transports.base import Frame, Recv, Transport

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "ring_reduce",
           "scatter_allgather_broadcast"]

Bounds = Sequence[Tuple[int, int]]


def _neighbours(rank: int, size: int) -> Tuple[int, int]:
    return (rank - 1) % size, (rank + 1) % size


def _reduce_scatter_phase(t: Transport, buf: np.ndarray, bounds: Bounds, combine: Combine,
                          frame: Frame, deadline: float, first_tag: int) -> None:
    """In place over ``buf``: after ``n - 1`` steps segment ``(rank + 1) % n`` of ``buf`` holds
    the reduction of that segment over all ranks (other segments hold partial results)."""
    rank, size = t.rank, t.size
    left, right = _neighbours(rank, size)
    segments = [buf[start:stop] for start, stop in bounds]
    itemsize = buf.dtype.itemsize
    for step in range(size - 1):
        outgoing = segments[(rank - step) % size]
        incoming = segments[(rank - step - 1) % size]
        t.exchange([(right, byte_view(outgoing))],
                   [Recv(left, byte_view(incoming), reducer_into(incoming, combine), itemsize)],
                   frame.with_tag(first_tag + step), deadline)


def _all_gather_phase(t: Transport, buf: np.ndarray, bounds: Bounds, owned: int, frame: Frame,
                      deadline: float, first_tag: int) -> None:
    """In place over ``buf``: each rank starts owning segment ``(rank + owned) % n`` and ends
    with all of them; receives land directly in ``buf``."""
    rank, size = t.rank, t.size
    left, right = _neighbours(rank, size)
    for step in range(size - 1):
        start, stop = bounds[(rank + owned - step) % size]
        rstart, rstop = bounds[(rank + owned - step - 1) % size]
        t.exchange([(right, byte_view(buf[start:stop]))],
                   [Recv(left, byte_view(buf[rstart:rstop]))],
                   frame.with_tag(first_tag + step), deadline)


def ring_all_reduce(t: Transport, buf: np.ndarray, combine: Combine, frame: Frame,
                    deadline: float) -> None:
    """All-reduce in place: ring reduce-scatter, then ring all-gather, over ``n`` segments.

    Step ``s`` of the reduce-scatter sends segment ``rank - s`` to the right and folds segment
    ``rank - s - 1`` from the left into ``buf`` while it arrives; after ``n - 1`` steps rank
    ``r`` holds the full reduction of segment ``r + 1``, which the all-gather passes around
    the ring, received straight into ``buf``.

    Steps: ``2 (n - 1)``. Bytes: ``2 (n - 1) / n * N`` (rounded up to whole segments).
    Scratch: none besides the transport's receive chunks.
    """
    size = t.size
    if size == 1:
        return
    bounds = segment_bounds(buf.size, size)
    _reduce_scatter_phase(t, buf, bounds, combine, frame, deadline, first_tag=0)
    _all_gather_phase(t, buf, bounds, 1, frame, deadline, first_tag=size - 1)


def _reduce_scatter_blocks(t: Transport, send: np.ndarray, bounds: Bounds, out: np.ndarray,
                           combine: Combine, frame: Frame, deadline: float,
                           first_tag: int = 0) -> None:
    """Ring reduce-scatter that leaves ``send`` unmodified: rank ``r`` ends with the reduction
    of block ``r`` (``send[bounds[r]]``) in ``out``.

    Step ``s`` forwards the partial result of block ``r - s - 1`` to the right while the left
    neighbour's partial result of block ``r - s - 2`` is folded into a copy of this rank's own
    contribution. Two scratch buffers alternate between the block being sent and the block being
    received; the last step receives into ``out``. At step 0 the block is sent straight from
    ``send``.
    """
    rank, size = t.rank, t.size
    left, right = _neighbours(rank, size)
    itemsize = send.dtype.itemsize
    largest = max(stop - start for start, stop in bounds)
    scratch: List[np.ndarray] = ([np.empty(largest, dtype=send.dtype) for _ in range(2)]
                                 if size > 2 else [])
    start, stop = bounds[(rank - 1) % size]
    outgoing = send[start:stop]
    for step in range(size - 1):
        block = (rank - step - 2) % size
        start, stop = bounds[block]
        if step == size - 2:
            target = out
        else:
            target = scratch[step % 2][:stop - start]
        copy_into(target, send[start:stop])
        t.exchange([(right, byte_view(outgoing))],
                   [Recv(left, byte_view(target), reducer_into(target, combine), itemsize)],
                   frame.with_tag(first_tag + step), deadline)
        outgoing = target


def ring_reduce_scatter(t: Transport, send: np.ndarray, out: np.ndarray, combine: Combine,
                        frame: Frame, deadline: float) -> None:
    """Reduce-scatter around the ring, double-buffered, ``send`` left unmodified.

    Each block's partial result travels ``n - 1`` hops; every hop folds in the next rank's
    contribution (pipelined with the receive). Only neighbour links are used.

    Steps: ``n - 1``. Bytes: ``(n - 1) * M``. Scratch: ``2 * M``.

    Args:
        send: ``n * m`` elements, not modified.
        out: ``m`` elements; receives block ``rank`` of the reduction.
    """
    size = t.size
    m = out.size
    if size == 1:
        copy_into(out, send)
        return
    bounds = [(index * m, (index + 1) * m) for index in range(size)]
    _reduce_scatter_blocks(t, send, bounds, out, combine, frame, deadline)


def ring_all_gather(t: Transport, send: np.ndarray, out: np.ndarray, frame: Frame,
                    deadline: float) -> None:
    """All-gather around the ring: step ``s`` forwards block ``rank - s`` to the right and
    receives block ``rank - s - 1`` from the left, straight into ``out``.

    Steps: ``n - 1``. Bytes: ``(n - 1) * M``.

    Args:
        send: ``m`` elements; may be the view ``out[rank * m:(rank + 1) * m]``.
        out: ``n * m`` elements; block ``j`` receives rank ``j``'s ``send``.
    """
    rank, size = t.rank, t.size
    m = send.size
    copy_into(out[rank * m:(rank + 1) * m], send)
    if size == 1:
        return
    bounds = [(index * m, (index + 1) * m) for index in range(size)]
    _all_gather_phase(t, out, bounds, 0, frame, deadline, first_tag=0)


def ring_reduce(t: Transport, send: np.ndarray, out: Optional[np.ndarray], root: int,
                combine: Combine, frame: Frame, deadline: float) -> None:
    """Reduce to ``root``: ring reduce-scatter over ``n`` segments, then every rank sends its
    reduced segment to the root (one exchange), which receives them straight into ``out``.

    Steps: ``n``. Bytes: about ``N`` per non-root (``(n - 1) / n * N`` around the ring plus
    its ``N / n`` segment to the root); the root sends ``(n - 1) / n * N``. Scratch: two
    segments (non-roots also one more for their result).

    Args:
        send: the local contribution, not modified (unless ``out`` is ``send`` on the root).
        out: the result on the root (may be ``send``), None elsewhere.
    """
    rank, size = t.rank, t.size
    if size == 1:
        copy_into(out, send)
        return
    bounds = segment_bounds(send.size, size)
    start, stop = bounds[rank]
    mine = out[start:stop] if rank == root else np.empty(stop - start, dtype=send.dtype)
    _reduce_scatter_blocks(t, send, bounds, mine, combine, frame, deadline)
    gather = frame.with_tag(size - 1)
    if rank != root:
        t.exchange([(root, byte_view(mine))], [], gather, deadline)
        return
    t.exchange([], [Recv(peer, byte_view(out[bounds[peer][0]:bounds[peer][1]]))
                    for peer in range(size) if peer != root], gather, deadline)


def scatter_allgather_broadcast(t: Transport, buf: np.ndarray, root: int, frame: Frame,
                                deadline: float) -> None:
    """Broadcast in place for large messages: the root scatters ``n - 1`` segments, one to each
    other rank, then the non-roots all-gather them around a ring that skips the root.

    The root sends every byte exactly once (instead of ``ceil(log2 n)`` times down a binomial
    tree) and each other rank forwards ``n - 2`` segments.

    Steps: ``n - 1`` (1 scatter + ``n - 2`` ring steps). Bytes: ``N`` from the root,
    ``(n - 2) / (n - 1) * N`` from every other rank.
    """
    rank, size = t.rank, t.size
    if size == 1:
        return
    ring_size = size - 1
    bounds = segment_bounds(buf.size, ring_size)
    # Position on the ring of non-roots: the rank right after the root is 0.
    position = (rank - root - 1) % size

    def rank_at(index: int) -> int:
        return (root + 1 + index % ring_size) % size

    def segment(index: int) -> memoryview:
        start, stop = bounds[index % ring_size]
        return byte_view(buf[start:stop])

    scatter = frame.with_tag(0)
    if rank == root:
        t.exchange([(rank_at(index), segment(index)) for index in range(ring_size)], [],
                   scatter, deadline)
        return
    t.exchange([], [Recv(root, segment(position))], scatter, deadline)
    left, right = rank_at(position - 1), rank_at(position + 1)
    for step in range(ring_size - 1):
        t.exchange([(right, segment(position - step))],
                   [Recv(left, segment(position - step - 1))],
                   frame.with_tag(1 + step), deadline)
