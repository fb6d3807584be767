"""``batch_isend_irecv``: many sends and receives issued as one operation (torch's
``dist.batch_isend_irecv``).

A halo exchange sends to and receives from every neighbour of a grid; a multi-peer exchange
does the same with any set of ranks. Written as separate blocking or stream-ordered sends and
receives it can deadlock: a large send completes only once its peer receives, and on NCCL
every operation of a stream waits for the one before it. ``batch_isend_irecv`` issues every
operation of the list at once, so none waits for another, whatever the message sizes.

On the NCCL backend the list is one ``groupStart`` / ``groupEnd`` of its ``ncclSend`` and
``ncclRecv`` calls (:mod:`gpucoll.backends.nccl_grouped`), one event on the stream; elsewhere
every receive is posted, then every send, through the backend's asynchronous receive and send,
waited as one :class:`BatchWork`. Either way the operations match any send or receive of the
peers; messages between two ranks keep their order, so several operations to one peer in a
list match the peer's operations in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence

from .errors import CommAbortedError
from .flight_recorder import describe_batch, traced
from .sendrecv import GroupWork, _cause, _extent, _extents_overlap
from .work import Work

__all__ = ["P2POp", "BatchP2P", "BatchWork", "BatchOpWork"]

_KINDS = {"send": "send", "recv": "recv", "isend": "send", "irecv": "recv"}


def _kind_of(op: Any):
    """("send" | "recv", the communicator a bound ``isend`` / ``irecv`` belongs to or None)."""
    if isinstance(op, str):
        if op in ("send", "recv"):
            return op, None
    elif callable(op) and getattr(op, "__name__", None) in ("isend", "irecv"):
        return _KINDS[op.__name__], getattr(op, "__self__", None)
    raise ValueError(f"P2POp: op must be 'send' or 'recv' (or comm.isend / comm.irecv), "
                     f"got {op!r}")


@dataclass(frozen=True, eq=False)
class P2POp:
    """One point-to-point operation of :meth:`BatchP2P.batch_isend_irecv`.

    Attributes:
        op: ``"send"`` or ``"recv"``; ``comm.isend`` / ``comm.irecv`` are accepted too (as
            torch's ``P2POp(dist.isend, ...)``) and stored as ``"send"`` / ``"recv"``.
        array: what to send, or where to receive (the shape and dtype the peer sends).
        peer: the other rank.
        tag: as for ``send`` / ``recv``: the receiver's must match the sender's.

    Raises:
        ValueError: an unknown ``op``.
    """

    op: str
    array: Any
    peer: int
    tag: int = 0

    def __post_init__(self) -> None:
        kind, owner = _kind_of(self.op)
        object.__setattr__(self, "op", kind)
        object.__setattr__(self, "_owner", owner)

    def __repr__(self) -> str:
        shape, dtype = getattr(self.array, "shape", None), getattr(self.array, "dtype", None)
        what = f"{dtype}{tuple(shape)}" if shape is not None else type(self.array).__name__
        return f"P2POp({self.op!r}, {what}, peer={self.peer!r}, tag={self.tag!r})"


class _Item(NamedTuple):
    """A checked operation: its index in the list, and the backend's view of its array."""
    index: int
    kind: str
    array: Any
    peer: int
    tag: int
    caller: Any  # the array as the caller passed it


class BatchWork(GroupWork):
    """The Works of a batch's operations waited as one (CPU and MPI backends): finished once
    all are; ``wait()`` is bounded, one limit for the batch, and raises the error of the
    operation that failed, not the abort it led to."""

    def __init__(self, op: str, parts: Sequence[Work], items: Sequence[_Item]):
        super().__init__(op, parts)
        self._items = tuple(items)  # the operation of each part, in posting order

    def _describe(self, index: int) -> str:
        item, part = self._items[index], self._parts[index]
        direction = "to" if item.kind == "send" else "from"
        return f"ops[{item.index}] ({part.op} #{part.seq} {direction} rank {item.peer})"


class BatchOpWork(Work):
    """The ``Work`` of one operation of a batch. The batch is issued as one operation, so
    every method answers for the whole batch: ``wait()`` (and ``synchronize()``) on any one of
    its Works waits for all of them and raises the batch's error; ``result()`` is this
    operation's receive buffer (None for a send)."""

    def __init__(self, batch: Work, item: _Item):
        super().__init__(batch.op, batch.seq, batch.rank, batch._default_timeout)
        self._batch, self.index, self.kind, self.peer = batch, item.index, item.kind, item.peer
        self._result = item.array if item.kind == "recv" else None

    def _trace_probe(self) -> Any:
        return self._batch._trace_probe()

    def is_completed(self) -> bool:
        """True once the whole batch has finished (successfully or not); never blocks."""
        return self._batch.is_completed()

    def exception(self) -> Optional[BaseException]:
        """The batch's error once it has finished, else None; never blocks."""
        return self._batch.exception()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the whole batch, as :mod:`gpucoll.work` says (on a GPU backend: order the
        current stream after it)."""
        return self._batch.wait(timeout)

    def synchronize(self, timeout: Optional[float] = None) -> bool:
        """Block the host until the whole batch has finished."""
        return self._batch.synchronize(timeout)

    def __repr__(self) -> str:
        error = self.exception()
        state = f"failed: {type(error).__name__}" if error is not None else \
            "done" if self.is_completed() else "pending"
        direction = "to" if self.kind == "send" else "from"
        return (f"<Work {self.op} #{self.seq} ops[{self.index}] {self.kind} {direction} "
                f"{self.peer} rank {self.rank} {state}>")


def batch_works(batch: Work, items: Sequence[_Item]) -> List[BatchOpWork]:
    """One Work per operation (``items`` in the list's order), over the batch's Work."""
    return [BatchOpWork(batch, item) for item in items]


class BatchP2P:
    """Mixin of :class:`gpucoll.Communicator`: :meth:`batch_isend_irecv` and its default
    backend hook (uses the Communicator's argument checks and its backend's ``_send`` /
    ``_recv``)."""

    rank: int
    size: int

    @traced(describe_batch, returns_works=True)
    def batch_isend_irecv(self, ops: Sequence[P2POp], *, stream: Any = None) -> List[Work]:
        """Start every send and receive of ``ops`` at once, as one operation.

        None of them waits for another, so a halo exchange (send to and receive from every
        neighbour) cannot deadlock, whatever the message sizes. They match any send or
        receive of the peers (``send``, ``irecv``, ``sendrecv``, their own batch). Several
        operations with one peer match that peer's operations in order.

        Args:
            ops: a non-empty list of :class:`P2POp`.
            stream: GPU backends: the CUDA stream to enqueue on, as for ``all_reduce``.

        Returns:
            One ``Work`` per operation, in the order of ``ops``. Each stands for the whole
            batch: ``wait()`` on any of them waits for every operation (on a GPU backend it
            orders the current stream after the batch; ``synchronize()`` blocks the host) and
            raises the error of the one that failed; ``result()`` is the receive buffer.

        Raises:
            ValueError: ``ops`` is empty; a peer out of range or this rank; a receive buffer
                that is read-only, not C-contiguous, or shares memory with another operation's
                buffer; a bad tag; an ``isend`` / ``irecv`` of another communicator. Named by
                index, before anything is sent.
            TypeError: ``ops`` not a list of P2POp, a peer that is not an int, an array not of
                a supported type and dtype; before anything is sent.
            CollectiveMismatchError: from ``wait()``: an arriving message's size or tag does
                not match its receive (CPU and MPI backends).

        Example (a periodic 1-D halo exchange, two ranks or more)::

            left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
            works = comm.batch_isend_irecv([
                gc.P2POp("recv", from_left, left), gc.P2POp("recv", from_right, right),
                gc.P2POp("send", right_edge, right), gc.P2POp("send", left_edge, left)])
            for work in works:
                work.wait()

        (Receiving from the left before the right, and sending right before left, matches
        the peers' operations in order also on two ranks, where left and right are one rank.)
        """
        items = self._batch_items(ops)
        works = self._batch_isend_irecv(items, stream)
        return [self._hand_back(work, item.array, item.caller)
                for work, item in zip(works, items)]

    def _batch_items(self, ops: Sequence[P2POp]) -> List[_Item]:
        """Check every operation (see ``batch_isend_irecv``) and return them normalized."""
        if isinstance(ops, P2POp) or isinstance(ops, (str, bytes)) or \
                not hasattr(ops, "__iter__"):
            raise TypeError(f"batch_isend_irecv: ops must be a list of gc.P2POp, got "
                            f"{type(ops).__name__}" +
                            (" (wrap the one operation in a list)" if isinstance(ops, P2POp)
                             else ""))
        ops = list(ops)
        if not ops:
            raise ValueError("batch_isend_irecv: ops is empty; pass at least one gc.P2POp")
        items = [self._batch_item(index, p2p_op) for index, p2p_op in enumerate(ops)]
        extents = [_extent(item.array) for item in items]
        for later in items:
            for earlier in items[:later.index]:
                if later.kind == earlier.kind == "send":
                    continue  # one array may be sent twice
                if later.array is earlier.array or later.caller is earlier.caller or \
                        _extents_overlap(extents[later.index], extents[earlier.index]):
                    raise ValueError(
                        f"batch_isend_irecv: ops[{later.index}] ({later.kind} with peer "
                        f"{later.peer}) shares memory with ops[{earlier.index}] ({earlier.kind} "
                        f"with peer {earlier.peer}); a receive buffer must not overlap any other "
                        f"operation's array")
        return items

    def _batch_item(self, index: int, p2p_op: Any) -> _Item:
        where = f"batch_isend_irecv: ops[{index}]"
        if not isinstance(p2p_op, P2POp):
            raise TypeError(f"{where} must be a gc.P2POp, got {type(p2p_op).__name__} "
                            f"({p2p_op!r:.80})")
        kind, _ = _kind_of(p2p_op.op)  # a P2POp built around its __init__ is checked too
        owner = getattr(p2p_op, "_owner", None)
        if owner is not None and owner is not self:
            raise ValueError(f"{where}: {p2p_op!r} was made with the i{kind} of another "
                             f"communicator ({owner!r}); every operation of a batch belongs to "
                             f"this one")
        try:
            peer = self._peer(p2p_op.peer, "peer")
            array = self._array(p2p_op.array, "array")
            if kind == "recv":
                self._writable(array, "array")
            tag = self._tag(p2p_op.tag)
            self._check_tag_limit(tag)
        except (TypeError, ValueError) as exc:
            error = TypeError if isinstance(exc, TypeError) else ValueError
            raise error(f"{where} ({kind} with peer {p2p_op.peer!r}): {exc}") from None
        return _Item(index, kind, array, peer, tag, p2p_op.array)

    def _check_tag_limit(self, tag: int) -> None:
        """Backend hook: raise ValueError for a tag this backend cannot carry."""

    def _batch_isend_irecv(self, items: List[_Item], stream: Any = None) -> List[Work]:
        """Backend hook. By default every receive, then every send, through the backend's
        asynchronous ``_recv`` / ``_send``, waited as one :class:`BatchWork`; a backend whose
        operations are stream-ordered (NCCL) overrides it with one launch."""
        order = [item for item in items if item.kind == "recv"] + \
                [item for item in items if item.kind == "send"]
        parts: List[Work] = []
        try:
            for item in order:
                post = self._recv if item.kind == "recv" else self._send
                parts.append(post(item.array, item.peer, item.tag, True, stream))
        except CommAbortedError as aborted:  # perhaps by an operation failed already: say why
            errors: List[BaseException] = []
            for part in parts:
                try:
                    part.wait()  # on an aborted communicator it ends at once
                except BaseException as failed:
                    errors.append(failed)
            raise _cause(errors + [aborted]) from None
        return batch_works(BatchWork("batch_isend_irecv", parts, order), items)
