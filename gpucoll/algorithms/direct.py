"""Direct algorithms: every rank talks to every peer it needs in a single exchange.

One step each, so they are the latency-optimal choice for small messages and the only
choice for gather, scatter and all_to_all, whose data has a different destination per peer.
This module also holds the small helpers the other algorithm modules share (byte views,
segment bounds, the reducer adapter).

Conventions of every algorithm in this package:

- Arrays are 1-D, C-contiguous NumPy arrays; the caller has validated shapes and dtypes.
- ``t`` is a :class:`~gpucoll.transports.base.Transport`; ``frame`` names the op, its sequence
  number and dtype; each step is sent with ``frame.with_tag(step)`` so that ranks out of step
  surface as ``CollectiveMismatchError``; ``deadline`` is a ``time.monotonic()`` value.
- ``combine(dst, src)`` does ``dst = dst (op) src`` in place (:func:`gpucoll.types.combine_fn`).
- Message sizes depend only on the count and the world size, never on the rank's data, and
  empty messages are still exchanged, so every mismatch is detected.
- "Bytes" below is the payload one rank sends; ``N`` is the byte size of the buffer (for
  block collectives ``M`` is one block, ``n`` the world size).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np

from gpucoll.transports.base import Frame, Recv, Reducer, Transport

__all__ = ["direct_reduce_scatter", "direct_all_gather", "direct_gather", "direct_scatter",
           "direct_all_to_all", "byte_view", "segment_bounds", "reducer_into", "copy_into",
           "EMPTY"]

Combine = Callable[[np.ndarray, np.ndarray], None]

# A zero-length writable byte buffer, for messages that carry no payload (barrier).
EMPTY = memoryview(bytearray(0))


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a contiguous array (works for every count, 0 included, and for dtypes the
    buffer protocol cannot describe, such as ml_dtypes' bfloat16)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def segment_bounds(count: int, parts: int) -> List[Tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous segments whose sizes differ by at
    most one (the first ``count % parts`` are one longer). Identical on every rank."""
    base, extra = divmod(count, parts)
    bounds = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reducer_into(dst: np.ndarray, combine: Combine) -> Reducer:
    """A transport reducer that folds incoming bytes into ``dst``: ``dst = dst (op) incoming``."""
    dtype = dst.dtype
    itemsize = dtype.itemsize

    def reduce(offset: int, chunk: memoryview) -> None:
        incoming = np.frombuffer(chunk, dtype=dtype)
        start = offset // itemsize
        combine(dst[start:start + incoming.size], incoming)

    return reduce


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src``, skipped when both are the same memory."""
    if dst.size and not (dst.__array_interface__["data"][0] == src.__array_interface__["data"][0]
                         and dst.dtype == src.dtype):
        np.copyto(dst, src)


def _block(array: np.ndarray, index: int, size: int) -> np.ndarray:
    return array[index * size:(index + 1) * size]


def direct_reduce_scatter(t: Transport, send: np.ndarray, out: np.ndarray, combine: Combine,
                          frame: Frame, deadline: float) -> None:
    """Reduce-scatter in one exchange: block ``j`` of ``send`` goes straight to rank ``j``.

    Every rank receives the ``n - 1`` other contributions to its block into scratch space and
    folds them in rank order, so the result does not depend on arrival order.

    Steps: 1. Bytes: ``(n - 1) * M`` in ``n - 1`` messages. Scratch: ``(n - 1) * M``.

    Args:
        send: ``n * m`` elements, not modified.
        out: ``m`` elements; receives block ``rank`` of the reduction.
    """
    rank, size = t.rank, t.size
    m = out.size
    if size == 1:
        copy_into(out, send)
        return
    peers = [peer for peer in range(size) if peer != rank]
    scratch = np.empty(m * (size - 1), dtype=out.dtype)
    slots = {peer: _block(scratch, index, m) for index, peer in enumerate(peers)}
    t.exchange([(peer, byte_view(_block(send, peer, m))) for peer in peers],
               [Recv(peer, byte_view(slots[peer])) for peer in peers],
               frame.with_tag(0), deadline)
    copy_into(out, _block(send, rank, m))
    for peer in peers:
        combine(out, slots[peer])


def direct_all_gather(t: Transport, send: np.ndarray, out: np.ndarray, frame: Frame,
                      deadline: float) -> None:
    """All-gather in one exchange: every rank sends its block to every peer.

    Steps: 1. Bytes: ``(n - 1) * M`` in ``n - 1`` messages (the same block each time).

    Args:
        send: ``m`` elements; may be the view ``out[rank * m:(rank + 1) * m]``.
        out: ``n * m`` elements; block ``j`` receives rank ``j``'s ``send``.
    """
    rank, size = t.rank, t.size
    m = send.size
    copy_into(_block(out, rank, m), send)
    if size == 1:
        return
    peers = [peer for peer in range(size) if peer != rank]
    payload = byte_view(send)
    t.exchange([(peer, payload) for peer in peers],
               [Recv(peer, byte_view(_block(out, peer, m))) for peer in peers],
               frame.with_tag(0), deadline)


def direct_gather(t: Transport, send: np.ndarray, out: Optional[np.ndarray], root: int,
                  frame: Frame, deadline: float) -> None:
    """Gather to ``root`` in one exchange: every other rank sends its block to the root.

    Steps: 1. Bytes: ``M`` per non-root; the root receives ``(n - 1) * M``.

    Args:
        send: ``m`` elements.
        out: ``n * m`` elements on the root (block ``j`` gets rank ``j``'s ``send``), None
            elsewhere.
    """
    rank, size = t.rank, t.size
    m = send.size
    if rank != root:
        t.exchange([(root, byte_view(send))], [], frame.with_tag(0), deadline)
        return
    copy_into(_block(out, rank, m), send)
    if size == 1:
        return
    t.exchange([], [Recv(peer, byte_view(_block(out, peer, m)))
                    for peer in range(size) if peer != rank],
               frame.with_tag(0), deadline)


def direct_scatter(t: Transport, send: Optional[np.ndarray], out: np.ndarray, root: int,
                   frame: Frame, deadline: float) -> None:
    """Scatter from ``root`` in one exchange: the root sends block ``j`` to rank ``j``.

    Steps: 1. Bytes: ``(n - 1) * M`` from the root, nothing from the others.

    Args:
        send: ``n * m`` elements on the root, None elsewhere.
        out: ``m`` elements on every rank.
    """
    rank, size = t.rank, t.size
    m = out.size
    if rank != root:
        t.exchange([], [Recv(root, byte_view(out))], frame.with_tag(0), deadline)
        return
    if size > 1:
        t.exchange([(peer, byte_view(_block(send, peer, m)))
                    for peer in range(size) if peer != rank], [],
                   frame.with_tag(0), deadline)
    copy_into(out, _block(send, rank, m))


def direct_all_to_all(t: Transport, send: np.ndarray, out: np.ndarray, frame: Frame,
                      deadline: float) -> None:
    """All-to-all in one exchange with every peer.

    Steps: 1. Bytes: ``(n - 1) * M`` in ``n - 1`` messages.

    Args:
        send: ``n * m`` elements; block ``j`` goes to rank ``j``.
        out: ``n * m`` elements, not overlapping ``send``; block ``j`` receives rank ``j``'s
            block ``rank``.
    """
    rank, size = t.rank, t.size
    m = send.size // size
    copy_into(_block(out, rank, m), _block(send, rank, m))
    if size == 1:
        return
    peers = [peer for peer in range(size) if peer != rank]
    t.exchange([(peer, byte_view(_block(send, peer, m))) for peer in peers],
               [Recv(peer, byte_view(_block(out, peer, m))) for peer in peers],
               frame.with_tag(0), deadline)
