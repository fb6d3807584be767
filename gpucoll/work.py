"""Work: the handle of an asynchronous operation (``async_op=True``, ``isend``, ``irecv``).

What ``wait()`` guarantees:

* CPU backend: when ``wait()`` returns, the operation has finished: its output array holds the
  result and its input may be reused. It raises the operation's error, if any.
* GPU backends: ``wait()`` makes the caller's current stream wait for the operation (work
  queued on that stream afterwards sees the result); it does not block the host. Use
  ``synchronize()`` to block the host too.

Every wait is bounded: ``wait(timeout)`` raises ``CommTimeoutError`` after ``timeout`` seconds
(default: the communicator's timeout) and the communicator is aborted, as after any timeout.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

from .errors import CommTimeoutError

__all__ = ["Work", "WorkOutcome", "LiveProbe"]


class WorkOutcome:
    """How a Work that the host completes (``_finish``) ended, without its result: what the
    flight recorder keeps of it, so that a record never keeps the operation's arrays alive."""

    __slots__ = ("done", "error")

    def __init__(self):
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def exception(self) -> Optional[BaseException]:
        return self.error if self.done.is_set() else None


class LiveProbe:
    """The trace probe of a Work whose ``is_completed()`` makes progress (tests an MPI
    request): asks the Work while the caller still holds it, and its outcome once it is gone
    (a Work dropped unfinished stays pending: nobody completes it)."""

    __slots__ = ("_work", "_outcome")

    def __init__(self, work: "Work"):
        self._work = weakref.ref(work)
        self._outcome = work._outcome

    def is_completed(self) -> bool:
        work = self._work()
        return self._outcome.is_completed() if work is None else work.is_completed()

    def exception(self) -> Optional[BaseException]:
        work = self._work()
        return self._outcome.exception() if work is None else work.exception()


class Work:
    """Handle of one asynchronous operation.

    Attributes:
        op: the operation's name (``"all_reduce"``, ``"send"``...).
        seq: its sequence number on the communicator.
    """

    _host_completion = True  # completion is a threading.Event that _finish sets

    def __init__(self, op: str, seq: int, rank: int, default_timeout: float,
                 on_timeout: Optional[Callable[[str], None]] = None):
        self.op, self.seq, self.rank = op, seq, rank
        self._default_timeout = default_timeout
        self._on_timeout = on_timeout
        # set by _finish; None where a subclass tells completion otherwise (a CUDA event)
        self._outcome = WorkOutcome() if self._host_completion else None
        self._done = self._outcome.done if self._host_completion else None
        self._result: Any = None
        self._exception: Optional[BaseException] = None
        self._map: Optional[Callable[[Any], Any]] = None  # result -> what the caller passed

    # called by the backend -------------------------------------------------
    def _finish(self, result: Any = None, exception: Optional[BaseException] = None) -> None:
        self._result, self._exception = result, exception
        self._outcome.error = exception
        self._done.set()

    def _trace_probe(self) -> Any:
        """What the flight recorder keeps of this operation to tell its state when the trace
        is read: ``is_completed()`` and ``exception()``, never blocking, holding none of its
        arrays (a record outlives the call; the Work keeps its result for ``result()``). A
        subclass that completes otherwise gives its own; by default, the Work itself."""
        return self._outcome if self._outcome is not None else self

    # public ------------------------------------------------------------------
    def is_completed(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""
        return self._done.is_set()

    def exception(self) -> Optional[BaseException]:
        """The operation's error once it has finished, else None; never blocks."""
        return self._exception if self._done.is_set() else None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the operation finishes; return True.

        Args:
            timeout: seconds; None means the communicator's timeout.

        Raises:
            CommTimeoutError: not finished in time (the communicator is aborted).
            The operation's own error (PeerError, CollectiveMismatchError...) if it failed.
        """
        limit = self._default_timeout if timeout is None else timeout
        if not self._done.wait(limit):
            message = (f"rank {self.rank}: wait() on {self.op} #{self.seq} timed out after "
                       f"{limit:g} s" + ("" if timeout is not None else
                                         " (wait(timeout=) sets the limit; its default follows "
                                         "GPUCOLL_TIMEOUT or init(timeout=))"))
            if self._on_timeout is not None:
                self._on_timeout(message)
            raise CommTimeoutError(message, rank=self.rank, op=self.op, seq=self.seq)
        if self._exception is not None:
            raise self._exception
        return True

    def synchronize(self, timeout: Optional[float] = None) -> bool:
        """Block the host until the operation has finished (same as ``wait`` on the CPU)."""
        return self.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait, then return the operation's output array (None for sends)."""
        self.wait(timeout)
        return self._result if self._map is None else self._map(self._result)

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        if self._exception is not None:
            state = f"failed: {type(self._exception).__name__}"
        return f"<Work {self.op} #{self.seq} rank {self.rank} {state}>"
