"""``sendrecv``: send to one rank and receive from another at once (MPI's ``Sendrecv``).

A ring step (send to the next rank, receive from the previous one) is the exchange that ring
attention and ring algorithms are made of. Written as a blocking ``send`` then ``recv`` on
every rank it can deadlock: every rank sends first, and a large send completes only once its
peer receives. ``sendrecv`` issues both halves as one operation, so neither waits for the other.

On the NCCL backend it is one ``groupStart`` / ``groupEnd`` of one ``ncclSend`` and one
``ncclRecv`` (:mod:`gpucoll.backends.nccl_grouped`); elsewhere it is the backend's own
asynchronous receive and send, issued together and waited as one :class:`PairWork`. Either
way it matches plain ``send`` / ``recv`` calls on the peers, messages between two ranks keep
their order, and the receiving side checks that what arrives matches ``out`` and ``tag``.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from .errors import CommAbortedError, CommTimeoutError
from .flight_recorder import describe_sendrecv, traced
from .work import Work

__all__ = ["SendRecv", "PairWork", "GroupWork"]


def _extent(array: Any) -> Optional[Tuple[int, int]]:
    """(first byte, end) of a contiguous array's memory, when its interface says where."""
    face = getattr(array, "__cuda_array_interface__", None)
    if face is None:
        face = getattr(array, "__array_interface__", None)
    if not isinstance(face, dict) or not face.get("data"):
        return None
    start = int(face["data"][0])
    return start, start + int(array.nbytes)


def _extents_overlap(a: Optional[Tuple[int, int]], b: Optional[Tuple[int, int]]) -> bool:
    """Whether two extents (from ``_extent``) share a byte; unknown and empty ones do not."""
    if a is None or b is None or a[0] == a[1] or b[0] == b[1]:
        return False
    return a[0] < b[1] and b[0] < a[1]


def _overlap(x: Any, out: Any) -> bool:
    """Whether ``x`` and ``out`` share memory (as far as their interfaces tell)."""
    return _extents_overlap(_extent(x), _extent(out))


def _cause(errors: List[BaseException]) -> BaseException:
    """The error to report from a pair's errors: the first that is not only the abort that
    another one led to (a failed half aborts the communicator, failing the other half too)."""
    for error in errors:
        if not isinstance(error, CommAbortedError):
            return error
    return errors[0]


class GroupProbe:
    """The trace probe of a :class:`GroupWork`: its parts' probes, answered as the group
    answers (finished once all are; the error that failed the group)."""

    __slots__ = ("_parts",)

    def __init__(self, parts: Sequence[Any]):
        self._parts = tuple(parts)

    def is_completed(self) -> bool:
        return all(part.is_completed() for part in self._parts)

    def exception(self) -> Optional[BaseException]:
        if not self.is_completed():
            return None
        errors = [error for error in (part.exception() for part in self._parts)
                  if error is not None]
        return _cause(errors) if errors else None


class GroupWork(Work):
    """The ``Work`` of point-to-point operations issued together (``sendrecv``,
    ``batch_isend_irecv``): finished once all of them are, and as :mod:`gpucoll.work` says:
    ``wait()`` blocks until every part has finished (bounded, one limit for the group) and
    raises the error that failed the group, not the abort it led to; ``is_completed()`` and
    ``exception()`` never block.
    """

    def __init__(self, op: str, parts: Sequence[Work]):
        super().__init__(op, parts[0].seq, parts[0].rank,
                         max(part._default_timeout for part in parts))
        self._parts = tuple(parts)

    def _trace_probe(self) -> GroupProbe:
        return GroupProbe([part._trace_probe() for part in self._parts])

    def is_completed(self) -> bool:
        """True once every part has finished (successfully or not)."""
        return GroupProbe.is_completed(self)  # over the parts themselves

    def exception(self) -> Optional[BaseException]:
        """The group's error once every part has finished, else None; never blocks."""
        return GroupProbe.exception(self)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every part finishes, at most ``timeout`` seconds for all together
        (None: the communicator's timeout); return True.

        Raises:
            CommTimeoutError: not finished in time (the communicator is aborted).
            The error that failed the group (PeerError, CollectiveMismatchError...).
        """
        limit = self._default_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        errors: List[BaseException] = []
        for index, part in enumerate(self._parts):
            try:
                part.wait(max(deadline - time.monotonic(), 0.0))
            except CommTimeoutError as exc:  # the part's wait aborted the communicator
                errors.append(self._timed_out(index, limit, timeout is None, exc)
                              if time.monotonic() >= deadline else exc)
            except BaseException as exc:  # the other parts are still waited for, then reported
                errors.append(exc)
        if errors:
            raise _cause(errors)
        return True

    def _describe(self, index: int) -> str:
        """How a timeout names part ``index``."""
        part = self._parts[index]
        return f"{part.op} #{part.seq}"

    def _timed_out(self, index: int, limit: float, default: bool,
                   exc: CommTimeoutError) -> CommTimeoutError:
        """The group's own timeout error (the part's says how long that part was waited for)."""
        error = CommTimeoutError(
            f"rank {self.rank}: wait() on {self.op} #{self.seq} timed out after {limit:g} s: "
            f"its {self._describe(index)} had not finished" +
            (" (wait(timeout=) sets the limit; its default follows GPUCOLL_TIMEOUT or "
             "init(timeout=))" if default else ""),
            rank=self.rank, peer=exc.peer, op=self.op, seq=self.seq)
        error.__cause__ = exc
        return error

    def __repr__(self) -> str:
        error = self.exception()
        state = f"failed: {type(error).__name__}" if error is not None else \
            "done" if self.is_completed() else "pending"
        return f"<Work {self.op} #{self.seq} rank {self.rank} {state}>"


class PairWork(GroupWork):
    """The ``Work`` of ``sendrecv``: a receive and a send, waited as one :class:`GroupWork`;
    ``result()`` is the receive's output."""

    def __init__(self, op: str, receiving: Work, sending: Work):
        super().__init__(op, (receiving, sending))

    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait, then return the receive's output array (``out``, in the caller's type)."""
        self.wait(timeout)
        value = self._parts[0]._result
        return value if self._map is None else self._map(value)


class SendRecv:
    """Mixin of :class:`gpucoll.Communicator`: :meth:`sendrecv` and its default backend hook
    (uses the Communicator's argument checks and its backend's ``_send`` / ``_recv``)."""

    rank: int
    size: int

    @traced(describe_sendrecv)
    def sendrecv(self, x: Any, dst: int, out: Any, src: int, *, tag: int = 0,
                 recv_tag: Optional[int] = None, async_op: bool = False, stream: Any = None):
        """Send ``x`` to rank ``dst`` and receive into ``out`` from rank ``src``, at once.

        Neither half waits for the other, so a ring of ranks that all exchange with their
        neighbours cannot deadlock, whatever the message sizes. It matches any send or
        receive of the peers: ``dst`` may receive with ``recv`` or its own ``sendrecv``.

        Args:
            x: the array to send (any shape and dtype).
            dst: the rank to send to; not this rank.
            out: where to receive, with the shape and dtype of what ``src`` sends (it may
                differ from ``x``'s); must not be ``x`` or share memory with it.
            src: the rank to receive from; not this rank. May be ``dst`` (two ranks).
            tag: the send's tag (and the receive's, unless ``recv_tag`` is given); the
                receiver's must match, as for ``send`` / ``recv``.
            recv_tag: the tag the receive expects, when it differs from the send's (MPI's
                ``sendtag`` / ``recvtag``).
            async_op: return a ``Work`` instead of blocking.
            stream: GPU backends: the CUDA stream to enqueue on, as for ``all_reduce``.

        Returns:
            ``out`` (in the caller's array type), or a ``Work`` whose ``result()`` is ``out``
            (on a GPU backend it follows the stream contract: ``wait()`` orders the current
            stream after the exchange, ``synchronize()`` blocks the host).

        Raises:
            ValueError: ``dst`` / ``src`` is this rank or out of range (there is no other
                rank on a communicator of size 1), ``out`` is ``x`` or overlaps it, ``out``
                is read-only or not C-contiguous, or a bad tag; before anything is sent.
            TypeError: a rank that is not an int, or ``x`` / ``out`` not an array of a
                supported dtype; before anything is sent.
            CollectiveMismatchError: the arriving message's size or tag does not match
                ``out`` / ``tag`` (CPU and MPI backends; NCCL has no tags and no such check).

        Example (two ranks)::

            peer = 1 - comm.rank
            x = np.full(2, 10 * comm.rank)
            out = comm.sendrecv(x, peer, np.empty_like(x), peer)  # rank 0: [10, 10]; 1: [0, 0]

        A ring shift on any number of ranks sends to ``(rank + 1) % size`` and receives
        from ``(rank - 1) % size``.
        """
        if self.size == 1:
            raise ValueError(f"sendrecv needs another rank, but this communicator has size 1 "
                             f"(dst={dst!r}, src={src!r})")
        dst, src = self._peer(dst, "dst"), self._peer(src, "src")
        x_in, out_in = x, out
        x, out = self._array(x, "x"), self._array(out, "out")
        self._writable(out, "out")
        if out is x or out_in is x_in or _overlap(x, out):
            raise ValueError("sendrecv: out must not be x or share memory with it (no "
                             "in-place exchange); pass a separate receive buffer")
        tag = self._tag(tag)
        recv_tag = tag if recv_tag is None else self._tag(recv_tag)
        return self._hand_back(self._sendrecv(x, dst, out, src, tag, async_op, stream,
                                              recv_tag), out, out_in)

    def connect_peers(self, peers: Iterable[int]) -> None:
        """Set up the point-to-point connections with ``peers`` now, together with them: each
        rank listed calls ``connect_peers`` naming this rank too.

        NCCL connects two ranks lazily, inside the host call of their first send or receive,
        and that call waits for the peer's own first call in the other direction. When one
        rank's first receive from a peer is grouped with a send (``sendrecv``) while the
        peer sends only after that data arrived, both wait forever (NVIDIA/nccl#783): the
        GPipe schedule of a pipeline does exactly that. Connecting first, with everyone at
        once, removes the handshake from later calls. Peers connected before are skipped;
        on host backends, which need no handshake, it only checks its arguments.

        Raises:
            ValueError: a peer that is this rank or out of range; before anything is sent.
            TypeError: a peer that is not an int.
        """
        self._check_alive()
        wanted = sorted({self._peer(peer, "peer") for peer in peers})
        if wanted:
            self._connect_peers(wanted)

    def _connect_peers(self, peers: List[int]) -> None:
        """Backend hook: host backends connect on demand without a handshake."""

    def _sendrecv(self, x: Any, dst: int, out: Any, src: int, tag: int, async_op: bool,
                  stream: Any = None, recv_tag: Optional[int] = None):
        """Backend hook. By default the backend's asynchronous receive, then its asynchronous
        send, as one :class:`PairWork` (waited here unless ``async_op``); a backend whose
        operations are stream-ordered (NCCL) overrides it with one launch."""
        receiving = self._recv(out, src, tag if recv_tag is None else recv_tag, True, stream)
        try:
            sending = self._send(x, dst, tag, True, stream)
        except CommAbortedError as aborted:  # perhaps by the receive, failed already: say why
            try:
                receiving.wait()  # on an aborted communicator it ends at once
            except BaseException as failed:
                raise _cause([failed, aborted]) from None
            raise
        work = PairWork("sendrecv", receiving, sending)
        return work if async_op else work.result()
