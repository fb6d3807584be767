"""What an algorithm may ask of a transport: framed, tagged, full-duplex exchanges with peers.

Every message on the wire is a 24-byte header followed by the payload::

    op:u8  dtype:u8  kind:u16  tag:u32  seq:u64  nbytes:u64      (little endian)

The receiver knows what it expects (``Frame`` + the byte count of its buffer) and checks the
header against it, so a rank that called another collective, another dtype, another size or is
one op ahead surfaces as ``CollectiveMismatchError`` instead of a silent wrong answer.

Algorithms call only :meth:`Transport.exchange` (and its wrappers ``send``, ``recv``,
``sendrecv``): all sends and receives of one exchange progress together, so a step in which a
rank sends to its right while receiving from its left never deadlocks, whatever the sizes.
"""

from __future__ import annotations

import abc
import struct
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from ..types import dtype_from_code

HEADER = struct.Struct("<BBHIQQ")
HEADER_BYTES = HEADER.size  # 24

KIND_DATA = 0
KIND_CLOSE = 1

# Op codes on the wire (one per public op, so a mismatch can name what the peer called).
OP_CODES = {
    "send": 1, "all_reduce": 2, "broadcast": 3, "reduce": 4, "all_gather": 5,
    "reduce_scatter": 6, "gather": 7, "scatter": 8, "all_to_all": 9, "barrier": 10,
    "split": 11, "debug_check": 12, "close": 13, "scan": 14, "exscan": 15, "reduce_scatter_v": 16,
}
OP_NAMES = {code: name for name, code in OP_CODES.items()}


@dataclass(frozen=True)
class Frame:
    """What a message belongs to; it is written into (and checked against) every header.

    Attributes:
        op: the public op's name (``"all_reduce"``); also used in error messages.
        seq: the op's sequence number on its communicator (p2p: the message's number on
            that channel).
        dtype: wire dtype code (``gpucoll.types``), 0 for raw bytes.
        tag: algorithm step, or the user's tag for send/recv.
    """

    op: str
    seq: int
    dtype: int = 0
    tag: int = 0

    def with_tag(self, tag: int) -> "Frame":
        return Frame(self.op, self.seq, self.dtype, tag)

    def pack(self, nbytes: int, kind: int = KIND_DATA) -> bytes:
        return HEADER.pack(OP_CODES[self.op], self.dtype, kind, self.tag & 0xFFFFFFFF,
                           self.seq, nbytes)


# A reducer combines ``nbytes`` just received (``src``, a byte memoryview) into the
# destination at byte offset ``offset`` of the receive target. Offsets and lengths are
# multiples of the element size.
Reducer = Callable[[int, memoryview], None]


@dataclass
class Recv:
    """One incoming message of an exchange.

    Attributes:
        peer: the sending rank.
        buf: writable, contiguous byte memoryview; its length is the expected byte count.
            With ``reduce`` set, ``buf`` is not written: bytes land in transport scratch
            space and ``reduce(offset, chunk)`` folds them in, chunk by chunk, while the
            rest is still arriving (pipelining).
        reduce: optional reducer, see :data:`Reducer`.
        itemsize: element size; reducer chunks are cut at multiples of it.
    """

    peer: int
    buf: memoryview
    reduce: Optional[Reducer] = None
    itemsize: int = 1


class Transport(abc.ABC):
    """Point-to-point message passing among ``size`` ranks.

    Attributes:
        rank: this rank.
        size: number of ranks.
    """

    rank: int
    size: int

    @abc.abstractmethod
    def exchange(self, sends: Sequence[Tuple[int, memoryview]], recvs: Sequence[Recv],
                 frame: Frame, deadline: float) -> None:
        """Send each ``(peer, bytes)`` and complete each ``Recv``, all progressing together.

        At most one send and one receive per peer in one exchange. ``deadline`` is a
        ``time.monotonic()`` value.

        Raises:
            CommTimeoutError: not done by the deadline (names the peers still pending).
            PeerError: a peer closed its connection or died.
            CollectiveMismatchError: a header did not match ``frame`` and the expected size.
        """

    def send(self, peer: int, buf: memoryview, frame: Frame, deadline: float) -> None:
        self.exchange([(peer, buf)], [], frame, deadline)

    def recv(self, peer: int, buf: memoryview, frame: Frame, deadline: float,
             reduce: Optional[Reducer] = None, itemsize: int = 1) -> None:
        self.exchange([], [Recv(peer, buf, reduce, itemsize)], frame, deadline)

    def sendrecv(self, send_peer: int, send_buf: memoryview, recv_peer: int, recv_buf: memoryview,
                 frame: Frame, deadline: float, reduce: Optional[Reducer] = None,
                 itemsize: int = 1) -> None:
        self.exchange([(send_peer, send_buf)], [Recv(recv_peer, recv_buf, reduce, itemsize)],
                      frame, deadline)

    def start_send(self, peer: int, buf: memoryview, frame: Frame
                   ) -> Optional[Callable[[float], None]]:
        """Begin sending ``buf`` to ``peer`` without waiting: None when the link took all of it
        (it is on its way; ``buf`` may be reused), else a function of a deadline that sends the
        rest. Until that returns nothing else may be written to ``peer``. Here nothing is sent
        at once; a transport that can write without blocking overrides it."""
        return lambda deadline: self.send(peer, buf, frame, deadline)

    def close(self) -> None:
        """Close every connection (idempotent)."""


def dtype_text(code: int) -> str:
    """The dtype's name for a wire code ("raw bytes" for 0), as the user wrote it."""
    if code == 0:
        return "raw bytes"
    try:
        return dtype_from_code(code)
    except KeyError:
        return f"unknown dtype code {code}"


def check_header(header: Tuple[int, int, int, int, int, int], frame: Frame, nbytes: int,
                 rank: int, peer: int) -> Optional[str]:
    """Compare a received header with what was expected; return a description of the mismatch."""
    op, dtype, kind, tag, seq, got_bytes = header
    expected_op = OP_CODES[frame.op]
    if kind == KIND_CLOSE:
        return (f"peer {peer} closed the communicator while rank {rank} was in "
                f"{frame.op} #{frame.seq}")
    if (op, seq, dtype, tag, got_bytes) == (expected_op, frame.seq, frame.dtype,
                                            frame.tag & 0xFFFFFFFF, nbytes):
        return None
    tags = tag != frame.tag & 0xFFFFFFFF  # a tag is worth naming only when it differs
    theirs = (f"{OP_NAMES.get(op, f'op {op}')} #{seq} ({dtype_text(dtype)}"
              f"{f', tag {tag}' if tags else ''}, {got_bytes} bytes)")
    ours = (f"{frame.op} #{frame.seq} ({dtype_text(frame.dtype)}"
            f"{f', tag {frame.tag}' if tags else ''}, {nbytes} bytes)")
    return f"rank {rank} expected {ours} from peer {peer} but peer {peer} sent {theirs}"

