"""NCCL through CuPy: loading, the dtype and op tables, communicator creation through the store,
and the watchdog that keeps GPU work from hanging forever.

Nothing here imports CuPy at module import time: :func:`load` does, and says what to install
when it cannot.

The watchdog
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
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ..errors import BackendUnavailableError, CommTimeoutError
from ..types import ReduceOp

__all__ = ["load", "unavailable_reason", "device_count", "nccl_version_code", "nccl_dtype", "nccl_op",
           "create_communicator", "run_bounded", "publish_progress", "ranks_behind", "Pending", "Watchdog",
           "REDUCIBLE", "NCCL_DTYPES"]

log = logging.getLogger("gpucoll")

# NumPy dtype name -> attribute of cupy.cuda.nccl
NCCL_DTYPES: Dict[str, str] = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16",
}
# dtypes NCCL can reduce; others move as bytes (broadcast, gathers, send/recv). Complex SUM and
# AVG reduce as their real component type (two floats per element).
REDUCIBLE = frozenset(NCCL_DTYPES)
_NCCL_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.PROD: "NCCL_PROD", ReduceOp.MIN: "NCCL_MIN",
             ReduceOp.MAX: "NCCL_MAX", ReduceOp.AVG: "NCCL_AVG"}

_LOADED: Optional[Tuple[Any, Any]] = None


def load() -> Tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)``, imported once.

    Raises:
        BackendUnavailableError: CuPy or its NCCL binding cannot be loaded; the message gives
            the pip command that fixes it (and names clashing wheels).
    """
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    try:
        import cupy
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend 'nccl' needs CuPy, which is not importable ({type(exc).__name__}: {exc}). "
            f"Fix: {_fix_hint()}") from None
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend 'nccl': CuPy {cupy.__version__} cannot load NCCL ({type(exc).__name__}: "
            f"{exc}). Fix: {_fix_hint()}") from None
    if not getattr(nccl, "available", False):
        raise BackendUnavailableError(
            f"backend 'nccl': CuPy {cupy.__version__} was built without NCCL support. "
            f"Fix: {_fix_hint()}")
    _LOADED = (cupy, nccl)
    return _LOADED


def _fix_hint() -> str:
    try:
        from .. import doctor

        return doctor.nccl_fix_hint(doctor.installed_distributions())
    except Exception:  # the hint must never hide the real error
        return "pip install 'gpucoll[cu12]' (CUDA 12 drivers) or 'gpucoll[cu13]' (CUDA 13)"


def device_count() -> int:
    """Number of GPUs CuPy sees (0 when CuPy or the driver is missing)."""
    try:
        cupy, _ = load()
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def nccl_version_code() -> int:
    """NCCL's runtime version code (0 when NCCL cannot be loaded)."""
    try:
        return int(load()[1].get_version())
    except Exception:
        return 0


def unavailable_reason() -> Optional[str]:
    """None when CuPy, NCCL and a GPU are usable (``backend="auto"`` picks NCCL), else why not."""
    try:
        cupy, _ = load()
    except BackendUnavailableError as exc:
        return str(exc)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "CUDA reports no device"


def nccl_dtype(nccl: Any, dtype_name: str) -> int:
    return getattr(nccl, NCCL_DTYPES[dtype_name])


def nccl_op(nccl: Any, op: ReduceOp) -> int:
    try:
        return getattr(nccl, _NCCL_OPS[op])
    except KeyError:
        raise TypeError(f"op {op.value} is not supported by NCCL (sum, prod, min, max, avg); "
                        f"use the cpu backend for bitwise reductions") from None


def create_communicator(store, rank: int, size: int, device: int, timeout: float,
                        key: str = "nccl/unique_id") -> Any:
    """A ``cupy.cuda.nccl.NcclCommunicator`` for ``rank`` of ``size`` on GPU ``device``.

    Rank 0 makes the unique id and publishes it under ``key``; every rank then enters a store
    barrier (``CommTimeoutError`` naming how many arrived), so ``ncclCommInitRank``, which
    blocks until every rank has called it, starts only when all of them are there. The call
    itself runs on a helper thread and is bounded by ``timeout`` too.
    """
    _, nccl = load()
    if rank == 0:
        store.set(key, bytes(nccl.get_unique_id()))
    store.barrier(f"{key}/barrier", size, timeout)
    unique_id = store.get(key, timeout)
    try:
        return run_bounded(lambda: nccl.NcclCommunicator(size, unique_id, rank), device, timeout,
                           f"rank {rank}: ncclCommInitRank", "init", rank)
    except CommTimeoutError:
        raise
    except Exception as error:
        raise BackendUnavailableError(
            f"rank {rank}: ncclCommInitRank failed on GPU {device}: {error} (run with "
            f"NCCL_DEBUG=INFO for NCCL's own log; `gpucoll doctor` checks the installation)") \
            from error


def run_bounded(fn: Callable[[], Any], device: int, timeout: float, what: str, op: str,
                rank: int) -> Any:
    """``fn()`` on a helper thread with GPU ``device`` current, waited for at most ``timeout``.

    For NCCL calls that block until every rank has made them (communicator creation, split),
    so a rank that dies at the wrong moment cannot hang the others forever. Raises what
    ``fn`` raised, or ``CommTimeoutError`` (the thread is left behind, blocked in NCCL).
    """
    cupy, _ = load()
    result: Dict[str, Any] = {}

    def call() -> None:
        try:
            cupy.cuda.Device(device).use()
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            result["error"] = exc

    thread = threading.Thread(target=call, name=f"gpucoll-{op}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CommTimeoutError(
            f"{what} did not finish within {timeout:g} s (every rank had reached the store "
            f"barrier before it; run with NCCL_DEBUG=INFO to see where NCCL waits)",
            rank=rank, op=op)
    if "error" in result:
        raise result["error"]
    return result["value"]


def publish_progress(store, rank: int, issued: int) -> None:
    """Record in ``store`` that ``rank`` has issued collectives up to sequence number ``issued``."""
    store.set(f"progress/{rank}", str(int(issued)).encode())


def ranks_behind(store, size: int, rank: int, seq: int) -> Optional[List[int]]:
    """The ranks (other than ``rank``) whose published progress is below ``seq``: those that
    had not reached collective #``seq``. None when the store cannot be read."""
    try:
        keys = [f"progress/{r}" for r in range(size) if r != rank]
        missing = set(store.missing(keys))
        behind = []
        for r in range(size):
            key = f"progress/{r}"
            if r == rank:
                continue
            issued = 0 if key in missing else int(store.get(key, 1.0))
            if issued < seq:
                behind.append(r)
        return behind
    except Exception:
        return None


class Pending:
    """One enqueued operation the watchdog follows until its CUDA event completes.

    ``event`` needs only a ``done`` attribute (CuPy's ``Event.done``); once done, the event
    goes back to ``pool`` (a list) for reuse, unless ``pool`` is None (a ``Work`` keeps it).
    """

    __slots__ = ("op", "seq", "deadline", "event", "peer", "collective", "pool", "stream")

    def __init__(self, op: str, seq: int, deadline: float, event: Any,
                 peer: Optional[int] = None, collective: bool = True,
                 pool: Optional[List[Any]] = None, stream: Any = None):
        self.op, self.seq, self.deadline, self.event = op, seq, deadline, event
        self.peer, self.collective, self.pool, self.stream = peer, collective, pool, stream

    def done(self) -> bool:
        return bool(self.event.done)

    def release(self) -> None:
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
            for _ in range(self._completed_prefix(queue)):
                pending = queue.popleft()
                if pending.collective and pending.seq > self.completed:
                    self.completed = pending.seq
                pending.release()
            if queue:
                head = queue[0]
                if now > head.deadline and (overdue is None or head.deadline < overdue.deadline):
                    overdue = head
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
