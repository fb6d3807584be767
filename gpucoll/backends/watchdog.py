"""The NCCL backend's watchdog: GPU work that never finishes is noticed, not waited on forever.

NCCL calls only *enqueue* work on a CUDA stream; a peer that never arrives leaves a kernel
spinning on the GPU and any later ``stream.synchronize()`` blocked. The backend records a
CUDA event after every operation and hands it to :class:`Watchdog`, a thread that polls the
oldest outstanding events. When one is still pending past its deadline, or NCCL reports an
asynchronous error (``ncclCommGetAsyncError``), the watchdog calls the backend's failure
handler, which aborts the NCCL communicator (stuck kernels exit, streams drain) and makes
the next call raise. The thread also publishes this rank's progress (the last collective
sequence number it issued) to the store, so a rank that times out can name the ranks that
never reached the stalled operation.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional

__all__ = ["Pending", "Watchdog", "CudaFault", "EVENT_NOT_READY"]

EVENT_NOT_READY = 600  # cudaErrorNotReady: the work before the event is still running
HOST_CALL_POLL = 0.0002  # seconds between looks at a call into NCCL an abort waits for


class CudaFault(RuntimeError):
    """An event query returned a CUDA error (not "done", not "not ready"): the GPU work before
    it failed, e.g. an illegal address. ``status`` is the CUDA error code."""

    def __init__(self, status: int, name: str):
        super().__init__(name)
        self.status = status


def event_status(query: Callable[[int], int], event: Any, describe: Callable[[int], str]) -> bool:
    """True when the work before ``event`` completed, False while it runs.

    ``query`` is ``cudaEventQuery`` (CuPy's ``runtime.eventQuery``), which returns the raw
    status without raising: 0 is done, 600 is not ready, anything else is an error.

    Raises:
        CudaFault: the status is an error; ``describe(status)`` names it.
    """
    status = int(query(event.ptr))
    if status == 0:
        return True
    if status == EVENT_NOT_READY:
        return False
    raise CudaFault(status, describe(status))

log = logging.getLogger("gpucoll")


class Pending:
    """One enqueued operation the watchdog follows until its CUDA event completes.

    With ``query`` (``(event) -> bool``, e.g. :func:`event_status` bound to the runtime), a
    failed event raises :class:`CudaFault`; without it ``event`` needs only a ``done``
    attribute. Once done, the event goes back to ``pool`` (a list) for reuse, unless ``pool``
    is None (a ``Work`` keeps it).
    """

    __slots__ = ("op", "seq", "deadline", "event", "peer", "collective", "pool", "stream",
                 "query", "finished")

    def __init__(self, op: str, seq: int, deadline: float, event: Any,
                 peer: Optional[int] = None, collective: bool = True,
                 pool: Optional[List[Any]] = None, stream: Any = None,
                 query: Optional[Callable[[Any], bool]] = None):
        self.op = op  # one store per line: no tuple built and unpacked (hot path)
        self.seq = seq
        self.deadline = deadline
        self.event = event
        self.peer = peer
        self.collective = collective
        self.pool = pool
        self.stream = stream
        self.query = query
        self.finished = False  # seen complete and released (its event may serve another op)

    def done(self) -> bool:
        if self.query is not None:
            return self.query(self.event)
        return bool(self.event.done)

    def release(self) -> None:
        self.finished = True
        if self.pool is not None:
            self.pool.append(self.event)

    def __repr__(self) -> str:
        return f"<Pending {self.op} #{self.seq}>"


class Watchdog:
    """Follows enqueued GPU work; calls ``on_failure(kind, message, pending)`` at most once.

    Work is kept per stream, in issue order. Operations on one stream complete in order, so
    each poll finds the completed prefix of a stream with a binary search over its events
    (a few event queries however many operations completed since the last poll) and retires
    it; the oldest operation still running on each stream is checked against its deadline.

    Args:
        rank: this rank, for messages.
        check_error: raises when NCCL reports an asynchronous error (``check_async_error``).
        on_failure: called from the watchdog thread with kind ``"timeout"`` or ``"error"``.
        publish: ``publish(issued_seq)`` stores this rank's progress; called from the thread
            when the issued sequence number changed, at most once per ``interval``.
        interval: seconds between polls.
        setup: run once on the thread before polling (e.g. make the right GPU current).
    """

    def __init__(self, rank: int, *, check_error: Callable[[], None],
                 on_failure: Callable[[str, str, Optional[Pending]], None],
                 publish: Optional[Callable[[int], None]] = None, interval: float = 0.05,
                 setup: Optional[Callable[[], None]] = None, name: str = "gpucoll-watchdog"):
        self.rank = rank
        self._check_error = check_error
        self._on_failure = on_failure
        self._publish = publish
        self._interval = interval
        self._setup = setup
        self._streams: Dict[Any, Deque[Pending]] = {}
        self._stop = threading.Event()
        self._failed = False
        self.issued = 0  # last collective sequence number handed to track()
        self._published = 0
        self.completed = 0  # last collective sequence number seen complete
        self._host_call: Optional[Pending] = None  # an NCCL call the host is inside of
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def track(self, pending: Pending) -> None:
        """Follow ``pending``, called right after the operation was enqueued, from the thread
        that issues operations (``deque.append`` needs no lock against ``popleft``)."""
        queue = self._streams.get(pending.stream)
        if queue is None:
            queue = self._streams[pending.stream] = collections.deque()
        queue.append(pending)
        if pending.collective and pending.seq > self.issued:
            self.issued = pending.seq

    def enter_host_call(self, pending: Pending) -> None:
        """The issuing thread is about to call into NCCL for ``pending``. NCCL connects peers
        lazily inside such calls and can block there on a missing peer; until
        :meth:`leave_host_call`, the watchdog holds the call to ``pending.deadline`` too."""
        if pending.collective and pending.seq > self.issued:
            self.issued = pending.seq  # this rank reached it, even if NCCL blocks inside
        self._host_call = pending

    def leave_host_call(self) -> None:
        self._host_call = None

    def await_host_call(self, grace: float) -> None:
        """Wait (at most ``grace`` seconds) until the issuing thread has left its call into
        NCCL, unless that call is stuck past its deadline. Before an abort frees the NCCL
        communicator, which a call still inside it would go on using; a stuck call is the
        one the abort is there to end."""
        give_up = time.monotonic() + grace
        while True:
            call = self._host_call
            now = time.monotonic()
            if call is None or now >= call.deadline or now >= give_up:
                return
            time.sleep(HOST_CALL_POLL)

    def outstanding(self) -> List[Pending]:
        """Operations not yet seen complete, oldest first."""
        for _ in range(100):
            try:
                entries = [p for queue in list(self._streams.values()) for p in list(queue)]
                return sorted(entries, key=lambda p: p.deadline)
            except RuntimeError:  # a queue changed while it was copied: copy again
                continue
        return []

    def stop(self, join: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(join)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        if self._setup is not None:
            try:
                self._setup()
            except Exception as exc:
                self._fail("error", f"watchdog could not start: {exc}", None)
                return
        while not self._stop.wait(self._interval):
            try:
                self.poll(time.monotonic())
            except Exception as exc:  # never let the thread die silently
                log.exception("gpucoll watchdog: %s", exc)
                self._fail("error", f"watchdog error: {type(exc).__name__}: {exc}", None)
            if self._failed:
                return

    @staticmethod
    def _completed_prefix(queue: Deque[Pending]) -> int:
        """How many operations at the front of ``queue`` have completed (binary search)."""
        n = len(queue)
        if n == 0 or not queue[0].done():
            return 0
        if queue[n - 1].done():
            return n
        lo, hi = 0, n - 1  # queue[lo] done, queue[hi] not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if queue[mid].done():
                lo = mid
            else:
                hi = mid
        return hi

    def poll(self, now: float) -> None:
        """One round: retire completed work, check for NCCL errors and overdue work, publish."""
        overdue: Optional[Pending] = None
        for queue in list(self._streams.values()):
            try:
                completed = self._completed_prefix(queue)
            except CudaFault as fault:  # the GPU work failed: say so, not "timed out" later
                self._fail("error", f"the GPU reported {fault} (CUDA error {fault.status})",
                           queue[0] if queue else None)
                return
            for _ in range(completed):
                pending = queue.popleft()
                if pending.collective and pending.seq > self.completed:
                    self.completed = pending.seq
                pending.release()
            if queue:
                head = queue[0]
                if now > head.deadline and (overdue is None or head.deadline < overdue.deadline):
                    overdue = head
        stuck = self._host_call
        if stuck is not None and now > stuck.deadline and (
                overdue is None or stuck.deadline < overdue.deadline):
            overdue = stuck
        try:  # after retiring: an error is not blamed on an operation that completed
            self._check_error()
        except Exception as exc:
            head = self.outstanding()[:1]
            self._fail("error", f"NCCL reported an asynchronous error: {exc}",
                       head[0] if head else None)
            return
        if self._publish is not None and self.issued != self._published:
            issued = self.issued
            try:
                self._publish(issued)
                self._published = issued
            except Exception as exc:  # the store may be gone; progress is best effort
                log.debug("gpucoll watchdog: cannot publish progress: %s", exc)
        if overdue is not None:
            self._fail("timeout", "", overdue)

    def _fail(self, kind: str, message: str, pending: Optional[Pending]) -> None:
        if self._failed:
            return
        self._failed = True
        self._on_failure(kind, message, pending)
