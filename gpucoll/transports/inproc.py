"""An in-process transport: ranks are threads of one process, messages are copied through queues.

It implements the same :class:`~gpucoll.transports.base.Transport` interface as the socket
transport, header checks included, so algorithms can be tested at any world size without
sockets or processes. It is a test fixture, not something users configure::

    group = InprocGroup(4, chunk_bytes=256)
    transports = [group.transport(rank) for rank in range(4)]   # one per thread

Every send copies its header and payload into an unbounded FIFO per (source, destination)
pair, so a send never blocks. A receive takes the next message of its FIFO (waiting up to the
deadline), checks the header, then copies the payload into the target, or hands it to the
reducer in chunks of ``chunk_bytes`` cut at element boundaries, as the socket transport does
while bytes are still arriving.

:meth:`InprocGroup.kill` simulates a crashed rank: every peer's next receive from it raises
:class:`~gpucoll.errors.PeerError`, even if messages from it are still queued.
:meth:`InprocTransport.close` is an orderly close: queued messages are still delivered, then
receives from the closed rank raise ``PeerError``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Deque, Dict, List, Sequence, Tuple

from gpucoll.errors import CollectiveMismatchError, CommAbortedError, CommTimeoutError, PeerError
from gpucoll.transports.base import HEADER, HEADER_BYTES, KIND_CLOSE, Frame, Recv, Transport, check_header

__all__ = ["InprocGroup", "InprocTransport"]

DEFAULT_CHUNK_BYTES = 256 << 10


class _Channel:
    """Messages from one rank to another, oldest first."""

    __slots__ = ("messages",)

    def __init__(self) -> None:
        self.messages: Deque[bytes] = collections.deque()


class InprocGroup:
    """The shared state of ``size`` in-process ranks.

    Args:
        size: number of ranks (at least 1).
        chunk_bytes: the largest piece handed to a reducer at once (rounded down to a multiple
            of the element size, and at least one element). Small values exercise the
            chunked reduction paths of the algorithms.

    Raises:
        ValueError: ``size`` or ``chunk_bytes`` is smaller than 1.
    """

    def __init__(self, size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
        self.size = size
        self.chunk_bytes = chunk_bytes
        # Messages to ``dst`` are guarded by ``self._conds[dst]``: a send wakes only the
        # receiving rank; kill and close wake everyone.
        self._conds = [threading.Condition() for _ in range(size)]
        self._lock = threading.Lock()
        self._channels: Dict[Tuple[int, int], _Channel] = {
            (src, dst): _Channel() for src in range(size) for dst in range(size)}
        self._killed = [False] * size
        self._closed = [False] * size
        self._transports: Dict[int, InprocTransport] = {}

    def transport(self, rank: int) -> "InprocTransport":
        """The transport of ``rank`` (the same object on every call)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {rank}")
        with self._lock:
            if rank not in self._transports:
                self._transports[rank] = InprocTransport(self, rank)
            return self._transports[rank]

    def kill(self, rank: int) -> None:
        """Simulate the death of ``rank``: its peers' next receive from it raises PeerError,
        its own next call raises CommAbortedError, and queued messages from it are dropped."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {rank}")
        self._killed[rank] = True
        for dst, cond in enumerate(self._conds):
            with cond:
                self._channels[(rank, dst)].messages.clear()
                cond.notify_all()

    def _mark_closed(self, rank: int) -> None:
        self._closed[rank] = True
        for cond in self._conds:
            with cond:
                cond.notify_all()

    # -- used by InprocTransport --------------------------------------------------------------

    def _post(self, src: int, dst: int, message: bytes) -> None:
        cond = self._conds[dst]
        with cond:
            if not self._killed[src]:
                self._channels[(src, dst)].messages.append(message)
            cond.notify_all()

    def _take(self, rank: int, peer: int, frame: Frame, deadline: float) -> bytes:
        """The next message from ``peer`` to ``rank``, waiting until ``deadline``."""
        channel = self._channels[(peer, rank)]
        cond = self._conds[rank]
        with cond:
            while True:
                if self._killed[rank]:
                    raise CommAbortedError(f"rank {rank} was killed; {frame.op} #{frame.seq} "
                                           "cannot go on")
                if self._killed[peer]:
                    raise PeerError(f"rank {rank}: peer {peer} died during {frame.op} "
                                    f"#{frame.seq} (tag {frame.tag})",
                                    rank=rank, peer=peer, op=frame.op, seq=frame.seq)
                if channel.messages:
                    return channel.messages.popleft()
                if self._closed[peer]:
                    raise PeerError(f"rank {rank}: peer {peer} closed its connection during "
                                    f"{frame.op} #{frame.seq} (tag {frame.tag})",
                                    rank=rank, peer=peer, op=frame.op, seq=frame.seq)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommTimeoutError(
                        f"rank {rank} timed out waiting for peer {peer} in {frame.op} "
                        f"#{frame.seq} (tag {frame.tag})",
                        rank=rank, peer=peer, op=frame.op, seq=frame.seq)
                cond.wait(remaining)


class InprocTransport(Transport):
    """One rank's end of an :class:`InprocGroup` (see the module docstring)."""

    def __init__(self, group: InprocGroup, rank: int):
        self.group = group
        self.rank = rank
        self.size = group.size

    def exchange(self, sends: Sequence[Tuple[int, memoryview]], recvs: Sequence[Recv],
                 frame: Frame, deadline: float) -> None:
        group = self.group
        self._check_peers([peer for peer, _ in sends], "send", frame)
        self._check_peers([recv.peer for recv in recvs], "receive", frame)
        if group._killed[self.rank] or group._closed[self.rank]:
            state = "was killed" if group._killed[self.rank] else "is closed"
            raise CommAbortedError(f"rank {self.rank} {state}; {frame.op} #{frame.seq} "
                                   "cannot go on")
        for peer, buf in sends:
            if group._killed[peer]:
                raise PeerError(f"rank {self.rank}: peer {peer} died before {frame.op} "
                                f"#{frame.seq} (tag {frame.tag}) could send to it",
                                rank=self.rank, peer=peer, op=frame.op, seq=frame.seq)
            payload = memoryview(buf).cast("B")
            group._post(self.rank, peer, frame.pack(payload.nbytes) + payload.tobytes())
        for recv in recvs:
            self._receive(recv, frame, deadline)

    def _check_peers(self, peers: List[int], what: str, frame: Frame) -> None:
        for peer in peers:
            if not 0 <= peer < self.size:
                raise ValueError(f"rank {self.rank}: {frame.op} #{frame.seq} tried to {what} "
                                 f"peer {peer}, outside [0, {self.size})")
        if len(set(peers)) != len(peers):
            raise ValueError(f"rank {self.rank}: {frame.op} #{frame.seq} has more than one "
                             f"{what} per peer: {peers}")

    def _receive(self, recv: Recv, frame: Frame, deadline: float) -> None:
        target = recv.buf
        nbytes = target.nbytes
        message = self.group._take(self.rank, recv.peer, frame, deadline)
        header = HEADER.unpack_from(message)
        problem = check_header(header, frame, nbytes, self.rank, recv.peer)
        if problem is not None:
            error = PeerError if header[2] == KIND_CLOSE else CollectiveMismatchError
            raise error(problem, rank=self.rank, peer=recv.peer, op=frame.op, seq=frame.seq)
        payload = memoryview(message)[HEADER_BYTES:]
        if recv.reduce is None:
            if nbytes:
                target.cast("B")[:] = payload
            return
        itemsize = max(1, recv.itemsize)
        chunk = max(itemsize, self.group.chunk_bytes // itemsize * itemsize)
        for offset in range(0, nbytes, chunk):
            recv.reduce(offset, payload[offset:offset + chunk])

    def close(self) -> None:
        """Orderly close: peers still get what was sent, then PeerError (idempotent)."""
        self.group._mark_closed(self.rank)
