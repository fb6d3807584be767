"""The in-process transport the algorithm tests run over: reducer chunks of whole elements,
header checks, FIFO order, close and timeouts.
"""

from __future__ import annotations

import time
from typing import List, Tuple

import pytest

from gpucoll.errors import CollectiveMismatchError, CommAbortedError, CommTimeoutError, PeerError
from gpucoll.transports.base import Frame, Recv
from gpucoll.transports.inproc import InprocGroup

from algorithm_harness import deadline


# -- the in-process transport itself ------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes,itemsize", [(10, 4), (3, 4), (256, 8), (1, 1), (64, 16)])
def test_inproc_reducer_chunks_are_whole_elements(chunk_bytes: int, itemsize: int) -> None:
    group = InprocGroup(2, chunk_bytes=chunk_bytes)
    payload = bytes(range(256)) * 3
    nbytes = len(payload) // itemsize * itemsize
    chunks: List[Tuple[int, bytes]] = []
    f = Frame("send", 0)
    group.transport(0).send(1, memoryview(payload[:nbytes]), f, deadline())
    group.transport(1).recv(0, memoryview(bytearray(nbytes)), f, deadline(),
                            reduce=lambda offset, chunk: chunks.append((offset, bytes(chunk))),
                            itemsize=itemsize)
    step = max(itemsize, chunk_bytes // itemsize * itemsize)
    assert [offset for offset, _ in chunks] == list(range(0, nbytes, step))
    assert all(len(chunk) % itemsize == 0 and 0 < len(chunk) <= step for _, chunk in chunks)
    assert b"".join(chunk for _, chunk in chunks) == payload[:nbytes]


def test_inproc_header_checks_and_fifo_order() -> None:
    group = InprocGroup(2)
    a, b = group.transport(0), group.transport(1)
    a.send(1, memoryview(b"first"), Frame("send", 0, tag=1), deadline())
    a.send(1, memoryview(b"second"), Frame("send", 1, tag=1), deadline())
    target = bytearray(5)
    b.recv(0, memoryview(target), Frame("send", 0, tag=1), deadline())
    assert target == b"first"
    with pytest.raises(CollectiveMismatchError, match="6 bytes"):
        b.recv(0, memoryview(bytearray(5)), Frame("send", 1, tag=1), deadline())
    a.send(1, memoryview(b"x"), Frame("send", 2, tag=1), deadline())
    with pytest.raises(CollectiveMismatchError, match="tag"):
        b.recv(0, memoryview(bytearray(1)), Frame("send", 2, tag=2), deadline())
    with pytest.raises(ValueError, match="peer 2"):
        a.send(2, memoryview(b""), Frame("send", 3), deadline())
    with pytest.raises(ValueError, match="more than one"):
        a.exchange([], [Recv(1, memoryview(bytearray(0))), Recv(1, memoryview(bytearray(0)))],
                   Frame("send", 3), deadline())


def test_inproc_close_delivers_queued_messages_then_peer_error() -> None:
    group = InprocGroup(2)
    a, b = group.transport(0), group.transport(1)
    a.send(1, memoryview(b"bye"), Frame("send", 0), deadline())
    a.close()
    a.close()
    target = bytearray(3)
    b.recv(0, memoryview(target), Frame("send", 0), deadline())
    assert target == b"bye"
    with pytest.raises(PeerError, match="closed") as info:
        b.recv(0, memoryview(bytearray(3)), Frame("send", 1), deadline())
    assert (info.value.rank, info.value.peer) == (1, 0)
    with pytest.raises(CommAbortedError):
        a.send(1, memoryview(b""), Frame("send", 1), deadline())


def test_inproc_timeout_names_rank_peer_op_and_seq() -> None:
    t = InprocGroup(3).transport(1)
    started = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        t.recv(2, memoryview(bytearray(4)), Frame("gather", 42), time.monotonic() + 0.05)
    assert time.monotonic() - started < 1.0
    error = info.value
    assert (error.rank, error.peer, error.op, error.seq) == (1, 2, "gather", 42)
    assert "rank 1" in str(error) and "peer 2" in str(error) and "gather #42" in str(error)
