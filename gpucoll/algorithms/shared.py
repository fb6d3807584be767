"""Collectives over one host's shared-memory segment (:class:`~gpucoll.transports.shm.SharedSegment`).

Every local rank can read every other rank's slot, so these are not pipes: a rank copies its
input into its slot once, every rank synchronizes, and then each reads (or reduces) what it
needs straight from the others' slots. Messages larger than a slot go in slot-sized steps
(``S`` = slot bytes, ``L`` local ranks, ``N`` the message); each step alternates between the
segment's two buffer sets, so one sync per step keeps writers and readers apart.

Functions take ``(segment, *buffers, [root], [combine], frame, deadline)`` with flat NumPy
arrays, in the order of the socket algorithms of the same collective; ranks are local indices
(on a single-host communicator they equal the communicator's ranks). "Bytes copied" counts
memory traffic per rank instead of bytes on a wire.

Single copy: where every local rank may read the others' memory (``segment.single_copy``,
Linux ``process_vm_readv``), large messages skip the segment: each rank lends its array's
address, syncs, reads what it needs straight from the peers' arrays, and syncs again
before anyone reuses its array.
"""

from __future__ import annotations

from typing import Callable, Optional

import math

import numpy as np

from ..transports.base import Frame
from ..transports.shm import MIN_SLOT_BYTES, SharedSegment

__all__ = ["shared_all_reduce", "shared_reduce", "shared_broadcast", "shared_all_gather",
           "shared_reduce_scatter", "shared_gather", "shared_scatter", "shared_all_to_all",
           "shared_barrier", "SMALL_BYTES"]

Combine = Callable[[np.ndarray, np.ndarray], None]

# Up to this size a collective is one step and one sync, and all_reduce has every rank reduce
# the whole message itself; above it each rank reduces a 1/L slice and everyone copies the
# slices out (two syncs, 1/L of the arithmetic). Every slot holds at least this much.
SMALL_BYTES = MIN_SLOT_BYTES
# Pipelining: a sync costs about as much as copying this many bytes (5 us at 15 GB/s).
PIPELINE_BYTES = 75_000
MIN_STEP_BYTES = 64 << 10
# From this size on, broadcast, all-gather, reduce-scatter and all-reduce read the peers'
# arrays directly when the segment allows it (``segment.single_copy``): one copy, 2-3 syncs.
SINGLE_COPY_BYTES = 256 << 10
SCRATCH_BYTES = 256 << 10  # reduce chunk: the peer's bytes land here, then are combined
# all_to_all reads straight from the peers' arrays from this many bytes per rank on (measured,
# 2 ranks: 1.5x slower than two copies at 256 KiB, 1.8x faster at 1 MiB; bench/RESULTS.md)
ALL_TO_ALL_SINGLE_COPY_BYTES = 1 << 20


def _raw(array: Optional[np.ndarray]) -> Optional[np.ndarray]:
    return None if array is None else array.view(np.uint8)


def _step_bytes(segment: SharedSegment, itemsize: int, parts: int = 1, message: int = 0) -> int:
    """Bytes per step and part: ``parts`` of them fit a slot, each a whole number of items.

    Steps pipeline (a writer fills one buffer set while readers empty the other), so a
    ``message`` of N bytes goes in steps of about sqrt(N * PIPELINE_BYTES) (the size that
    balances the steps' sync cost against the first step's unoverlapped copy), at least
    MIN_STEP_BYTES and at most what fits.
    """
    fits = max(segment.slot_bytes // (parts * itemsize) * itemsize, itemsize)
    if not message:
        return fits
    want = max(math.isqrt(message * PIPELINE_BYTES), MIN_STEP_BYTES) // parts
    return max(min(fits, want // itemsize * itemsize), itemsize)


def _steps(total: int, step: int):
    """(offset, bytes) of each step; at least one step, so an empty message still syncs."""
    if total == 0:
        yield 0, 0
        return
    for offset in range(0, total, step):
        yield offset, min(step, total - offset)


def _reduce_into(dst: np.ndarray, sources, combine: Combine) -> None:
    """``dst = sources[0] (op) sources[1] (op) ...`` in that order (same on every rank)."""
    np.copyto(dst, sources[0])
    for source in sources[1:]:
        combine(dst, source)


def _reduce_views(dst: np.ndarray, views, combine: Combine) -> None:
    """:func:`_reduce_into` over two or more slot views, the first two straight into ``dst``
    (no copy) where ``combine`` is a plain ufunc."""
    ufunc = getattr(combine, "ufunc", None)
    if ufunc is None:
        _reduce_into(dst, views, combine)
        return
    ufunc(views[0], views[1], out=dst)
    for view in views[2:]:
        combine(dst, view)


def _reduce_from_peers(segment: SharedSegment, target: np.ndarray, offset: int,
                       combine: Combine, frame: Frame) -> None:
    """``target (op)=`` the bytes at ``offset`` of every peer's lent array, chunk by chunk
    through a cache-sized scratch buffer."""
    raw, dtype = _raw(target), target.dtype
    chunk = max(SCRATCH_BYTES // target.itemsize, 1) * target.itemsize
    scratch = segment.scratch(chunk)
    for start in range(0, target.nbytes, chunk):
        stop = min(start + chunk, target.nbytes)
        part = raw[start:stop].view(dtype)
        for q in range(segment.size):
            if q != segment.index:
                landed = scratch[:stop - start]
                segment.read_from(q, landed, offset + start, frame)
                combine(part, landed.view(dtype))


def _single_copy_all_reduce(segment: SharedSegment, buf: np.ndarray, combine: Combine,
                            frame: Frame, deadline: float) -> None:
    size, me, item = segment.size, segment.index, buf.itemsize
    raw, count = _raw(buf), buf.size
    bounds = [part * count // size * item for part in range(size + 1)]
    segment.lend(buf)
    segment.sync(frame, deadline)
    lo, hi = bounds[me], bounds[me + 1]
    _reduce_from_peers(segment, buf[lo // item:hi // item], lo, combine, frame)
    segment.sync(frame, deadline)
    for q in range(size):
        if q != me:
            segment.read_from(q, raw[bounds[q]:bounds[q + 1]], bounds[q], frame)
    segment.sync(frame, deadline)


def shared_all_reduce(segment: SharedSegment, buf: np.ndarray, combine: Combine, frame: Frame,
                      deadline: float) -> None:
    """All-reduce ``buf`` in place through shared memory.

    Small (``N <= SMALL_BYTES``): copy in, 1 sync, every rank reduces all L slots into
    ``buf``: copies N in, reads L*N. Large, per step of up to S bytes: copy in the slices
    the others reduce, sync, reduce the others' copies of my slice into ``buf`` where it
    lies, publish it, sync, copy the others' reduced slices out: copies 2N (L-1)/L + N/L,
    combines (L-1)*N/L, 2 syncs per step. Single copy (``N >= SINGLE_COPY_BYTES``): sync,
    reduce my slice in ``buf`` from the peers' arrays, sync, read their reduced slices,
    sync: reads 2N (L-1)/L, combines (L-1)*N/L, 3 syncs in all.
    """
    size, me, dtype, total = segment.size, segment.index, buf.dtype, buf.nbytes
    if total <= SMALL_BYTES:
        views = segment.views(total, dtype)
        np.copyto(views[me], buf)
        segment.sync(frame, deadline)
        _reduce_views(buf, views, combine)
        segment.next_step()
        return
    if segment.single_copy and total >= SINGLE_COPY_BYTES:
        _single_copy_all_reduce(segment, buf, combine, frame, deadline)
        return
    raw, item = _raw(buf), buf.itemsize
    for offset, nbytes in _steps(total, _step_bytes(segment, item * size, 1, total)):
        count = nbytes // item
        bounds = [part * count // size * item for part in range(size + 1)]
        lo, hi = bounds[me], bounds[me + 1]
        slot = segment.slot(me)
        np.copyto(slot[:lo], raw[offset:offset + lo])  # the others' slices of my input
        np.copyto(slot[hi:nbytes], raw[offset + hi:offset + nbytes])
        segment.sync(frame, deadline)
        mine = raw[offset + lo:offset + hi].view(dtype)  # my slice, reduced where it lies
        for q in range(size):
            if q != me:
                combine(mine, segment.slot(q)[lo:hi].view(dtype))
        np.copyto(slot[lo:hi], raw[offset + lo:offset + hi])
        segment.sync(frame, deadline)
        for q in range(size):
            if q != me:
                np.copyto(raw[offset + bounds[q]:offset + bounds[q + 1]],
                          segment.slot(q)[bounds[q]:bounds[q + 1]])
        segment.next_step()


def shared_reduce(segment: SharedSegment, send: np.ndarray, out: Optional[np.ndarray], root: int,
                  combine: Combine, frame: Frame, deadline: float) -> None:
    """Reduce into ``out`` on ``root`` through shared memory (``out`` may be ``send``).

    Small: copy in, 1 sync, the root reduces all L slots (reads L*N). Large, per step: copy
    in, sync, each rank reduces its 1/L slice into its slot, sync, the root copies the L
    slices out: each rank copies N in and combines (L-1)*N/L; the root also copies N out.
    """
    size, me, item, dtype = segment.size, segment.index, send.itemsize, send.dtype
    raw, total = _raw(send), send.nbytes
    if total <= SMALL_BYTES:
        np.copyto(segment.slot(me)[:total], raw)
        segment.sync(frame, deadline)
        if me == root:
            _reduce_into(out, [segment.slot(q)[:total].view(dtype) for q in range(size)],
                         combine)
        segment.next_step()
        return
    result = _raw(out)
    for offset, nbytes in _steps(total, _step_bytes(segment, item * size, 1, total)):
        np.copyto(segment.slot(me)[:nbytes], raw[offset:offset + nbytes])
        segment.sync(frame, deadline)
        count = nbytes // item
        bounds = [part * count // size * item for part in range(size + 1)]
        lo, hi = bounds[me], bounds[me + 1]
        mine = segment.slot(me)[lo:hi].view(dtype)
        for q in range(size):
            if q != me:
                combine(mine, segment.slot(q)[lo:hi].view(dtype))
        segment.sync(frame, deadline)
        if me == root:
            for q in range(size):
                lo, hi = bounds[q], bounds[q + 1]
                np.copyto(result[offset + lo:offset + hi], segment.slot(q)[lo:hi])
        segment.next_step()


def shared_broadcast(segment: SharedSegment, buf: np.ndarray, root: int, frame: Frame,
                     deadline: float) -> None:
    """Broadcast ``buf`` from ``root``: per step the root copies in, 1 sync, the others copy
    out in parallel. The root copies N, every other rank N (small messages: one step).
    Single copy: sync, the others read the root's array in parallel, sync (the root copies
    nothing)."""
    me, raw = segment.index, _raw(buf)
    if buf.nbytes <= SMALL_BYTES:
        view = segment.views(buf.nbytes, np.uint8)[root]
        if me == root:
            np.copyto(view, raw)
        segment.sync(frame, deadline)
        if me != root:
            np.copyto(raw, view)
        segment.next_step()
        return
    if segment.single_copy and buf.nbytes >= SINGLE_COPY_BYTES:
        if me == root:
            segment.lend(buf)
        segment.sync(frame, deadline)
        if me != root:
            segment.read_from(root, raw, 0, frame)
        segment.sync(frame, deadline)
        return
    for offset, nbytes in _steps(buf.nbytes, _step_bytes(segment, buf.itemsize, 1, buf.nbytes)):
        if me == root:
            np.copyto(segment.slot(root)[:nbytes], raw[offset:offset + nbytes])
        segment.sync(frame, deadline)
        if me != root:
            np.copyto(raw[offset:offset + nbytes], segment.slot(root)[:nbytes])
        segment.next_step()


def _gather_into(segment: SharedSegment, send: np.ndarray, out: Optional[np.ndarray],
                 frame: Frame, deadline: float) -> None:
    size, me, raw, piece = segment.size, segment.index, _raw(send), send.nbytes
    result = _raw(out)
    for offset, nbytes in _steps(piece, _step_bytes(segment, send.itemsize, 1, piece * size)):
        np.copyto(segment.slot(me)[:nbytes], raw[offset:offset + nbytes])
        segment.sync(frame, deadline)
        if result is not None:
            for q in range(size):
                start = q * piece + offset
                np.copyto(result[start:start + nbytes], segment.slot(q)[:nbytes])
        segment.next_step()


def shared_all_gather(segment: SharedSegment, send: np.ndarray, out: np.ndarray, frame: Frame,
                      deadline: float) -> None:
    """All-gather: per step each rank copies its piece in, 1 sync, each copies all L pieces
    out (small messages: one step, the L pieces out in one strided copy). Copies N in and L*N
    out per rank (N = one rank's piece). Single copy (L*N >=
    SINGLE_COPY_BYTES): sync, read the L-1 other pieces from the peers' arrays, sync."""
    piece = send.nbytes
    if piece * segment.size <= SMALL_BYTES:  # one step: every piece in, sync, all out at once
        np.copyto(segment.views(piece, np.uint8)[segment.index], _raw(send))
        segment.sync(frame, deadline)
        np.copyto(_raw(out).reshape(segment.size, piece), segment.block(piece))
        segment.next_step()
        return
    if segment.single_copy and piece * segment.size >= SINGLE_COPY_BYTES:
        result = _raw(out)
        segment.lend(send)
        segment.sync(frame, deadline)
        for q in range(segment.size):
            block = result[q * piece:(q + 1) * piece]
            if q == segment.index:
                np.copyto(block, _raw(send))
            else:
                segment.read_from(q, block, 0, frame)
        segment.sync(frame, deadline)
        return
    _gather_into(segment, send, out, frame, deadline)


def shared_gather(segment: SharedSegment, send: np.ndarray, out: Optional[np.ndarray], root: int,
                  frame: Frame, deadline: float) -> None:
    """Gather to ``root``: each rank copies its piece in, 1 sync per step, the root copies
    the L pieces out (L*N); the others copy N."""
    _gather_into(segment, send, out if segment.index == root else None, frame, deadline)


def _exchange_pieces(segment: SharedSegment, send: Optional[np.ndarray], out: np.ndarray,
                     frame: Frame, deadline: float, writers, reduce: Optional[Combine]) -> None:
    """Each writer copies all L pieces of ``send`` in (piece q at q*step), sync, and each
    rank takes piece ``index`` from every writer's slot into ``out`` (reducing them when
    ``reduce`` is given, else writer w's piece goes to ``out`` block w, or the only block)."""
    size, me, dtype = segment.size, segment.index, out.dtype
    piece = out.nbytes if reduce is not None or len(writers) == 1 else out.nbytes // size
    raw, result = _raw(send), _raw(out)
    step = _step_bytes(segment, out.itemsize, size, piece * size)
    for offset, nbytes in _steps(piece, step):
        if me in writers:
            slot = segment.slot(me)
            for q in range(size):
                np.copyto(slot[q * step:q * step + nbytes],
                          raw[q * piece + offset:q * piece + offset + nbytes])
        segment.sync(frame, deadline)
        mine = slice(me * step, me * step + nbytes)
        if reduce is not None:
            target = result[offset:offset + nbytes].view(dtype)
            _reduce_into(target, [segment.slot(q)[mine].view(dtype) for q in writers], reduce)
        else:
            for block, writer in enumerate(writers):
                start = block * piece + offset
                np.copyto(result[start:start + nbytes], segment.slot(writer)[mine])
        segment.next_step()


def shared_reduce_scatter(segment: SharedSegment, send: np.ndarray, out: np.ndarray,
                          combine: Combine, frame: Frame, deadline: float) -> None:
    """Reduce-scatter: each rank copies its L pieces in, 1 sync per step, each reduces its
    own piece from every slot straight into ``out`` (small messages: one step): copies L*N
    in, reads L*N (N = piece).
    Single copy (L*N >= SINGLE_COPY_BYTES): sync, reduce my piece from the peers' arrays
    into ``out`` (reads (L-1)*N), sync."""
    piece, me = out.nbytes, segment.index
    if send.nbytes <= SMALL_BYTES:  # one step: all L pieces in, sync, reduce mine out
        np.copyto(segment.views(send.nbytes, np.uint8)[me], _raw(send))
        segment.sync(frame, deadline)
        _reduce_views(out, segment.views(piece, out.dtype, me * piece), combine)
        segment.next_step()
        return
    if segment.single_copy and piece * segment.size >= SINGLE_COPY_BYTES:
        segment.lend(send)
        segment.sync(frame, deadline)
        np.copyto(_raw(out), _raw(send)[me * piece:(me + 1) * piece])
        _reduce_from_peers(segment, out, me * piece, combine, frame)
        segment.sync(frame, deadline)
        return
    _exchange_pieces(segment, send, out, frame, deadline, range(segment.size), combine)


def shared_scatter(segment: SharedSegment, send: Optional[np.ndarray], out: np.ndarray,
                   root: int, frame: Frame, deadline: float) -> None:
    """Scatter from ``root``: the root copies the L pieces in, 1 sync per step, each rank
    copies its piece out (the root copies L*N, each rank N)."""
    _exchange_pieces(segment, send, out, frame, deadline, [root], None)


def shared_all_to_all(segment: SharedSegment, send: np.ndarray, out: np.ndarray, frame: Frame,
                      deadline: float) -> None:
    """All-to-all: each rank copies its L pieces in, 1 sync per step, and copies piece
    ``me`` of every slot out: L*N in and L*N out per rank (N = one piece). Single copy (L*N >=
    ALL_TO_ALL_SINGLE_COPY_BYTES): sync, read piece ``me`` of each peer's array straight into
    ``out``, sync: L*N per rank, once."""
    if segment.single_copy and send.nbytes >= ALL_TO_ALL_SINGLE_COPY_BYTES:
        piece, me = out.nbytes // segment.size, segment.index
        raw, result = _raw(send), _raw(out)
        segment.lend(send)
        segment.sync(frame, deadline)
        for q in range(segment.size):
            block = result[q * piece:(q + 1) * piece]
            if q == me:
                np.copyto(block, raw[me * piece:(me + 1) * piece])
            else:
                segment.read_from(q, block, me * piece, frame)
        segment.sync(frame, deadline)
        return
    _exchange_pieces(segment, send, out, frame, deadline, range(segment.size), None)


def shared_barrier(segment: SharedSegment, frame: Frame, deadline: float) -> None:
    """Barrier: one sync (every rank stores its counter and polls the others'); no data."""
    segment.sync(frame, deadline)
