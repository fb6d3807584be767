"""NCCL backend: device arrays reduced and moved by NCCL through CuPy.

Arrays
    CuPy arrays and anything with ``__cuda_array_interface__`` or DLPack (a torch CUDA tensor)
    are used in place; results gpucoll allocates come back in the caller's array type when its
    module has ``from_dlpack``. Host arrays are refused with a ``TypeError``.

Stream contract
    Every operation is enqueued on the caller's current CuPy stream, or on ``stream=``; gpucoll
    creates no streams of its own. A call returns once the work is enqueued: with
    ``async_op=False`` it returns the output array, which later work on the same stream may
    use; with ``async_op=True`` it returns a :class:`CudaWork` backed by a CUDA event, whose
    ``wait()`` makes the *current* stream wait for the operation (the host does not block)
    and whose ``synchronize()`` blocks the host, bounded by the timeout.

Which NCCL call
    all_reduce, broadcast, reduce, all_gather and reduce_scatter are NCCL's own collectives;
    gather, scatter, all_to_all, sendrecv and batch_isend_irecv are grouped ``ncclSend`` /
    ``ncclRecv`` (:mod:`.nccl_grouped`), send and recv a lone one; barrier is a waited
    one-element all-reduce; split is ``ncclCommSplit``; AVG is NCCL's own average. NCCL reduces
    (u)int8/32/64, float16, bfloat16, float32 and float64 (complex SUM/AVG as float pairs).
    Each operation's NCCL call and arguments are in :mod:`.nccl_collectives`; this module
    holds the communicator's creation, array import, enqueueing, failure handling and lifetime.

Errors
    Usage errors are raised before anything is enqueued. The watchdog follows each operation's
    CUDA event; on a timeout or an asynchronous NCCL error the communicator is aborted and the
    next call raises ``CommTimeoutError`` or ``CommAbortedError`` naming the op, its sequence
    number and the ranks that had not reached it. NCCL has no tags: ``tag`` is checked for
    range and otherwise ignored; messages between two ranks match in order.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from .. import cuda_env
from ..communicator import Communicator
from ..errors import (BackendUnavailableError, CommAbortedError, CommTimeoutError, GpucollError,
                      UnsupportedOperationError)
from ..flight_recorder import CAPTURED
from ..rendezvous import hosts
from ..rendezvous.best_effort import ABORT_BUDGET, best_effort
from ..rendezvous.store import PrefixStore, Store
from ..rendezvous.survivors import agree_on_survivors
from ..types import _CODE_OF as _ACCEPTED_DTYPES, ReduceOp  # dtypes wire_code() accepted
from . import nccl_runtime, signature
from .nccl_alltoallv import ExactAllToAllV
from .nccl_arrays import export_like, import_device_array, stream_pointer
from .nccl_collectives import NCCLCollectives
from .nccl_fast import OnePassCalls
from .nccl_graphs import GraphLaunches
from .growing import grow_communicator
from .nccl_grouped import GroupedPointToPoint
from .nccl_progress import ProgressReports
from .nccl_work import CudaWork, EnqueuedCall
from .watchdog import CudaFault, Pending, Watchdog, event_status

__all__ = ["NCCLCommunicator", "CudaWork"]


class NCCLCommunicator(OnePassCalls, NCCLCollectives, GraphLaunches, ProgressReports,
                       ExactAllToAllV, GroupedPointToPoint, Communicator):
    """Communicator over GPU arrays, one GPU per rank, NCCL underneath.

    Attributes (besides the Communicator ones):
        device: the CUDA device id this rank uses.
        nccl_comm: the ``cupy.cuda.nccl.NcclCommunicator`` (for direct NCCL calls).
        nccl_version: NCCL's runtime version, e.g. ``"2.32.3"``.
    """

    backend = "nccl"
    memory = "cuda"
    _converts_arrays = True

    def __init__(self, store: Store, rank: int, size: int, *, comm_id: str, token: str = "",
                 timeout: float = 300.0, debug: bool = False, owns_store: bool = True,
                 device: Optional[int] = None, watchdog_interval: float = 0.05,
                 _nccl_comm: Any = None, _local: Optional[Tuple[int, int]] = None, **_unused):
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is out of range for world_size={size}")
        self._cupy, self._nccl = cuda_env.load()
        cupy = self._cupy
        self._runtime = cupy.cuda.runtime
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        self.comm_id = comm_id
        self._root_store, self._owns_store = store, owns_store
        self._store = PrefixStore(comm_id, store)
        self._token, self._debug = token, debug
        self._watchdog_interval = watchdog_interval
        self._failure: Optional[Tuple[type, str]] = None
        self._unfinished: List[Any] = []  # events of ops cut short by the failure's abort
        self._closed = False
        self._seq = 0
        self._p2p_seq = 0
        self._splits = 0
        self._shrinks = 0
        self._host_groups = 0
        self._lock = threading.Lock()
        self._abort_done = threading.Event()  # set once the failing call's abort returned
        # held around the watchdog's async-error query and abort / destroy: ncclCommAbort and
        # ncclCommDestroy free the communicator a concurrent ncclCommGetAsyncError would read
        self._teardown = threading.Lock()
        self._publisher: Optional[threading.Thread] = None
        if _local is None:
            _local = self._local_rank()
        self.local_rank, self.local_size = _local
        count = cupy.cuda.runtime.getDeviceCount()
        if device is None:
            shared = nccl_runtime.shared_gpu_reason(self.local_size, count,
                                                   self._nccl.get_version())
            if shared is not None:  # NCCL would refuse it with an opaque "invalid usage"
                raise BackendUnavailableError(f"rank {rank}: {shared}; use backend='cpu' (CuPy "
                                              f"arrays staged through host memory) or more GPUs")
            device = self.local_rank % count
        if not 0 <= device < count:
            raise ValueError(f"rank {rank}: GPU {device} does not exist ({count} visible; "
                             f"GPUCOLL_DEVICE / CUDA_VISIBLE_DEVICES)")
        self.device = int(device)
        self._device = cupy.cuda.Device(self.device)
        self._device.use()
        self.nccl_comm = _nccl_comm if _nccl_comm is not None else \
            nccl_runtime.create_communicator(self._store, rank, size, self.device, self.timeout)
        try:
            self.nccl_version = cuda_env.decode_nccl_version(self._nccl.get_version())
            self._events: List[Any] = []
            self._reductions: dict = {}  # (dtype, op) -> (NCCL dtype, count factor, NCCL op)
            self._barrier_buffer = cupy.zeros(1, dtype=np.int32)
            self._bytes_type = self._nccl.NCCL_UINT8
            runtime = self._runtime
            self._event_done = functools.partial(
                event_status, runtime.eventQuery,
                describe=lambda status: str(runtime.CUDARuntimeError(status)))
            self._watchdog = Watchdog(
                rank, check_error=self._check_async_error, on_failure=self._on_watchdog,
                publish=self._publish_progress, interval=watchdog_interval,
                setup=self._device.use, name=f"gpucoll-watchdog-{comm_id}")
        except BaseException:
            self.nccl_comm.abort()  # do not leak the NCCL communicator
            raise

    def _local_rank(self) -> Tuple[int, int]:
        """(local rank, local size) from the host ids every rank publishes in the store."""
        return hosts.local_rank(hosts.exchange_host_ids(self._store, self.rank, self.size,
                                                        self.timeout), self.rank)

    # ------------------------------------------------------------------ arrays
    def _import_array(self, x: Any, name: str) -> Any:
        return import_device_array(self._cupy, x, name, self.device, self.rank)

    def _array(self, x: Any, name: str) -> Any:
        """``Communicator._array``; one pass for a C-contiguous CuPy array here of a known dtype."""
        if isinstance(x, self._cupy.ndarray) and x.device.id == self.device and \
                x.dtype in _ACCEPTED_DTYPES and x.flags.c_contiguous:
            return x
        return Communicator._array(self, x, name)

    def _empty(self, shape: Tuple[int, ...], dtype: Any) -> Any:
        """A new array on this communicator's GPU, whichever device is current."""
        with self._cupy.cuda.Device(self.device):
            return self._cupy.empty(shape, dtype=dtype)

    def _export(self, result: Any, like: Any) -> Any:
        return export_like(self._cupy, result, like)

    # ------------------------------------------------------------------ failure handling
    def _check_alive(self) -> None:
        # closed first: after close() every call says so, whatever failure came before
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: communicator is closed")
        if self._failure is not None:
            raise self._error()

    def _error(self) -> GpucollError:
        """The failure's error, once its (bounded) abort has returned: "aborted" is then so."""
        self._abort_done.wait(nccl_runtime.ABORT_WAIT + 1.0)
        kind, message = self._failure
        if kind is CommTimeoutError:
            return CommTimeoutError(message, rank=self.rank)
        return CommAbortedError(message)

    def _fail(self, kind: str, message: str, pending: Optional[Pending]) -> None:
        """Record the failure, tell the store, abort NCCL (stuck kernels exit). Idempotent: a
        second caller returns once the first one's (bounded) abort has."""
        with self._lock:
            first = self._failure is None
            if first:
                error_type = CommTimeoutError if kind == "timeout" else CommAbortedError
                if kind == "timeout":
                    message += "; GPUCOLL_TIMEOUT or init(timeout=) sets the limit"
                self._unfinished = self._unfinished_events()  # before the abort ends them
                self._failure = (error_type, message)
        if not first:
            self._abort_done.wait(nccl_runtime.ABORT_WAIT + 1.0)
            return
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:  # a call that entered NCCL before the failure returns first:
            watchdog.await_host_call(nccl_runtime.HOST_CALL_GRACE)  # the abort frees the comm
        try:
            nccl_runtime.abort_bounded(self.nccl_comm, self._teardown, self.device, self.rank)
        finally:
            self._abort_done.set()
        # the store may be unreachable now (its host lost): a short budget, never a timeout
        best_effort(lambda: self._store.set(f"abort/{self.rank}", message.encode()), ABORT_BUDGET)
        self._trace_dump(message)

    def _unfinished_events(self) -> List[Any]:
        """Events of the tracked operations that have not completed (a failed one counts)."""
        watchdog = getattr(self, "_watchdog", None)
        unfinished = []
        for pending in watchdog.outstanding() if watchdog is not None else ():
            if pending.event is None:
                continue
            try:
                if self._event_done(pending.event):
                    continue
            except CudaFault:
                pass
            unfinished.append(pending.event)
        return unfinished

    def _aborted_before_done(self, event: Any) -> bool:
        """Whether the operation before ``event`` was cut short by the communicator's failure
        (its event completes once the aborted kernels exit; its result is not valid)."""
        return self._failure is not None and any(e is event for e in self._unfinished)

    def _on_watchdog(self, kind: str, message: str, pending: Optional[Pending]) -> None:
        if kind == "timeout" and pending is not None:
            message = self._timeout_message(pending)
        elif pending is not None:
            message = f"rank {self.rank}: {pending.op} #{pending.seq}: {message}"
        else:
            message = f"rank {self.rank}: {message}"
        message += "; the communicator was aborted, create a new one"
        self._fail(kind, message, pending)

    def _work_done(self, op: str, seq: int, event: Any) -> bool:
        """Whether the GPU work before ``event`` finished; a CUDA fault fails the communicator
        and raises its error (never reported later as a timeout)."""
        try:
            return self._event_done(event)
        except CudaFault as fault:
            self._fail("error", f"rank {self.rank}: {op} #{seq}: the GPU reported {fault} (CUDA "
                                f"error {fault.status}); the communicator was aborted, create "
                                f"a new one", None)
            raise self._error() from None

    def _timed_out(self, op: str, seq: int, limit: float,
                   peer: Optional[int] = None) -> CommTimeoutError:
        """Fail the communicator after a host-side wait on ``op`` #``seq`` ran out; the error."""
        pending = Pending(op, seq, 0.0, None, peer, peer is None)
        message = self._timeout_message(pending, limit)
        self._fail("timeout", message + "; the communicator was aborted, create a new one", pending)
        return CommTimeoutError(self._failure[1], rank=self.rank, peer=peer, op=op, seq=seq)

    def _check_async_error(self) -> None:
        with self._teardown:  # never while abort() or destroy() frees the communicator
            if self._failure is None and not self._closed:
                self.nccl_comm.check_async_error()

    # ------------------------------------------------------------------ enqueueing
    def _new_event(self) -> Any:
        return self._cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)

    def _enqueue(self, name: str, launch: Callable[..., None], stream: Any, async_op: bool,
                 result: Any, *, seq: Optional[int] = None, peer: Optional[int] = None,
                 check: Optional[tuple] = None, args: tuple = (), _current: bool = False) -> Any:
        """On this communicator's GPU: the debug check (``check``, read with GPUCOLL_DEBUG only),
        ``launch(*args, stream_ptr)``, an event for the watchdog. ``seq``: None for p2p ops."""
        if self._failure is not None or self._closed:
            self._check_alive()  # raises
        if not _current and self._runtime.getDevice() != self.device:
            with self._cupy.cuda.Device(self.device):  # its GPU, whichever device is current
                return self._enqueue(name, launch, stream, async_op, result, seq=seq, peer=peer,
                                     check=check, args=args, _current=True)
        cupy = self._cupy
        ptr = cupy.cuda.get_current_stream().ptr if stream is None else stream_pointer(cupy, stream)
        capturing = self._runtime.streamIsCapturing(ptr)
        if capturing and async_op:
            raise UnsupportedOperationError(
                self.backend, f"{name} with async_op=True in a CUDA graph capture",
                "its Work would wait for an event that the capture never completes; capture "
                "the blocking call, which only enqueues")
        collective = seq is not None
        if collective:
            number = self._seq = seq  # taken only now: a usage error must not use up a number
        else:
            number = self._p2p_seq = self._p2p_seq + 1
        if check is not None and self._debug and self.size > 1:
            self._debug_check(name, seq, *check)
        pending = self._launch_watched(name, number, peer, collective,
                                       None if async_op else self._events, launch, args, ptr)
        if capturing:  # recorded into the graph, run by its launches: nothing to follow now
            if self._failure is not None:
                raise self._error()
            self._enqueued = CAPTURED
            return result
        self._track(pending, ptr)
        if async_op:
            return CudaWork(self, name, number, pending.event, result, peer, pending)
        self._enqueued = pending  # for the flight recorder's record
        return result

    def _next_seq(self) -> int:
        """The number of the next collective; ``_enqueue`` takes it once the call is valid."""
        return self._seq + 1

    def _launch_watched(self, name: str, number: int, peer: Optional[int], collective: bool,
                        pool: Optional[List[Any]], launch: Callable[..., None], args: tuple,
                        ptr: int) -> EnqueuedCall:
        """``launch(*args, ptr)`` under the watchdog, which holds the host call to the deadline
        (NCCL may block inside); the watchdog's entry, also the flight recorder's probe, whose
        event ``_track`` records. ``pool``: where its event goes back (None: a Work keeps it).
        Raises what :meth:`_refused` makes of an error of the call."""
        pending = EnqueuedCall(self, name, number, time.monotonic() + self.timeout, peer,
                               collective, pool, ptr)
        watchdog = self._watchdog
        watchdog.enter_host_call(pending)
        if self._failure is not None:  # failed since the caller looked: its abort may be
            watchdog.leave_host_call()  # freeing the NCCL communicator; never call into it
            raise self._error()
        try:
            launch(*args, ptr)
        except BaseException as exc:
            watchdog.leave_host_call()
            error = self._refused(name, number, exc)
            if error is exc:
                raise
            raise error from exc
        watchdog.leave_host_call()
        return pending

    def _refused(self, name: str, number: int, exc: BaseException) -> BaseException:
        """The error to raise for ``exc``, raised by the NCCL call of ``name`` #``number``: a
        gpucoll error or an interrupt as it is; else the failure the watchdog found first, or
        NCCL's refusal, which fails the communicator."""
        if isinstance(exc, GpucollError) or not isinstance(exc, Exception):
            return exc
        if self._failure is not None:  # the watchdog gave up on this very call first
            return self._error()
        message = f"rank {self.rank}: {name} #{number}: NCCL refused the call: {exc}"
        self._fail("error", message, None)
        return CommAbortedError(message)

    def _track(self, pending: EnqueuedCall, ptr: int) -> None:
        """After the NCCL call of ``pending`` returned: an event recorded on stream ``ptr``
        after it, which the watchdog follows (unless the watchdog gave up on the call while
        the host was inside it)."""
        if self._failure is not None:
            raise self._error()
        event = self._events.pop() if self._events else self._new_event()
        self._runtime.eventRecord(event.ptr, ptr)
        pending.event = event
        self._watchdog.track(pending)

    def _debug_check(self, name: str, seq: int, dtype, shape, op: Optional[ReduceOp] = None,
                     root: int = -1) -> None:
        """GPUCOLL_DEBUG: compare signatures through the store before enqueueing."""
        mine = signature.pack(name, seq, dtype, shape, op, root)
        self._store.set(f"debug/{seq}/{self.rank}", mine)
        keys = [f"debug/{seq}/{r}" for r in range(self.size)]
        try:
            self._store.wait(keys, self.timeout)
        except CommTimeoutError:
            missing = [r for r, key in enumerate(keys) if key in self._store.missing(keys)]
            message = (f"rank {self.rank}: GPUCOLL_DEBUG check of {name} #{seq}: ranks "
                       f"{', '.join(map(str, missing))} did not reach it within {self.timeout:g} s")
            self._fail("timeout", message, None)
            raise CommTimeoutError(message, rank=self.rank, op=name, seq=seq) from None
        signatures = {r: self._store.get(keys[r], self.timeout) for r in range(self.size)}
        if seq > 2:  # every rank has read the signatures of seq - 2
            self._store.delete(f"debug/{seq - 2}/{self.rank}")
        error = signature.mismatch_error(signatures, self.rank, name, seq)
        if error is not None:
            self._fail("error", str(error), None)  # as after any mismatch: aborted
            raise error

    # ------------------------------------------------------------------ groups and lifetime
    def _split(self, color: Optional[int], key: int) -> Optional["NCCLCommunicator"]:
        """``ncclCommSplit``, after a store round that checks every rank arrived (so the
        blocking NCCL call cannot wait forever) and computes the new ranks and local ranks."""
        self._check_alive()
        seq = self._seq = self._next_seq()
        self._splits += 1
        number = self._splits
        mine = f"{-1 if color is None else color},{key},{hosts.host_id()}"
        self._store.set(f"split/{number}/{self.rank}", mine.encode())
        keys = [f"split/{number}/{r}" for r in range(self.size)]
        try:
            self._store.wait(keys, self.timeout)
        except CommTimeoutError:
            missing = self._store.missing(keys)
            late = [r for r, k in enumerate(keys) if k in missing]
            message = (f"rank {self.rank}: split #{seq}: ranks {', '.join(map(str, late))} did "
                       f"not call split within {self.timeout:g} s")
            self._fail("timeout", message, None)  # as after any timeout: aborted
            raise CommTimeoutError(message, rank=self.rank, op="split", seq=seq,
                                   limit=self.timeout) from None
        table = []
        for r in range(self.size):
            c, k, host = self._store.get(keys[r], self.timeout).decode().split(",", 2)
            table.append((int(c), int(k), r, host))
        self._drain(self.timeout)
        try:
            new_comm = nccl_runtime.run_bounded(
                lambda: self.nccl_comm.commSplit(-1 if color is None else color, key),
                self.device, self.timeout, f"rank {self.rank}: split #{seq} (ncclCommSplit)",
                "split", self.rank)
        except CommTimeoutError as exc:
            self._fail("timeout", str(exc), None)
            raise
        except Exception as exc:  # NcclError: a GpucollError, as from every other NCCL call
            message = f"rank {self.rank}: split #{seq}: NCCL refused the call: {exc}"
            self._fail("error", message, None)
            raise CommAbortedError(message) from exc
        if color is None:
            return None
        members = sorted((k, r, host) for c, k, r, host in table if c == color)
        ranks = [r for _, r, _ in members]
        new_rank = ranks.index(self.rank)
        local = hosts.local_rank([host for _, _, host in members], new_rank)
        return self._child(NCCLCommunicator(
            self._root_store, new_rank, len(ranks),
            comm_id=f"{self.comm_id}/split{number}/color{color}", token=self._token,
            timeout=self.timeout, debug=self._debug, owns_store=False, device=self.device,
            watchdog_interval=self._watchdog_interval, _nccl_comm=new_comm, _local=local), ranks)

    def _host_group(self) -> Communicator:
        """A CPU-backend communicator of these ranks over this one's rendezvous store."""
        from .cpu_settings import cpu_communicator

        self._host_groups += 1
        host = cpu_communicator(
            self._root_store, self.rank, self.size,
            comm_id=f"{self.comm_id}/host{self._host_groups}", token=self._token,
            timeout=self.timeout, debug=self._debug, owns_store=False)
        return self._child(host, range(self.size))

    def _shrink(self, timeout: float) -> "NCCLCommunicator":
        """Abort NCCL here, agree on the survivors through the store, and make a new NCCL
        communicator among them (a new unique id under a fresh store prefix).

        NCCL 2.27 added ``ncclCommShrink``, which makes the smaller communicator from the
        aborted one without a new bootstrap; CuPy does not bind it, so the survivors go
        through ``ncclCommInitRank`` again, bounded like every creation.
        """
        self._shrinks += 1
        number = self._shrinks
        self._fail("abort", f"shrink() called on rank {self.rank}", None)
        self._watchdog.stop()
        agreed = agree_on_survivors(self._store, self._root_store, self.rank, self.ranks,
                                    f"shrink{number}", timeout)
        members = agreed.members
        child = NCCLCommunicator(
            self._root_store, members.index(self.rank), len(members),
            comm_id=f"{self.comm_id}/shrink{number}", token=self._token, timeout=self.timeout,
            debug=self._debug, owns_store=self._owns_store, device=self.device,
            watchdog_interval=self._watchdog_interval)
        self._owns_store = False  # the new communicator closes the store now
        child.lost = {self.to_world(r): why for r, why in agreed.lost.items()}
        return self._child(child, members)

    def _grow(self, timeout: float, min_size: int) -> "NCCLCommunicator":
        """Agree with the members on who joins; with newcomers, a new NCCL communicator (a
        new unique id under the grown communicator's store prefix, bounded like every
        creation). This one stays usable until closed."""
        self._check_alive()
        return grow_communicator(self, timeout, min_size, lambda comm_id, rank, size: NCCLCommunicator(
            self._root_store, rank, size, comm_id=comm_id, token=self._token, timeout=self.timeout,
            debug=self._debug, owns_store=False, device=self.device,
            watchdog_interval=self._watchdog_interval))

    def _drain(self, timeout: float) -> None:
        """Wait (host) until every tracked operation has completed, bounded by ``timeout``."""
        deadline = time.monotonic() + timeout
        for pending in self._watchdog.outstanding():
            while not self._work_done(pending.op, pending.seq, pending.event):
                if self._failure is not None:
                    raise self._error()
                if time.monotonic() > deadline:
                    raise self._timed_out(pending.op, pending.seq, timeout, pending.peer)
                time.sleep(1e-4)
        if self._failure is not None:  # some completed only because the abort ended them
            raise self._error()

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block the host until every operation enqueued so far has completed on the GPU."""
        self._check_alive()
        self._drain(self.timeout if timeout is None else timeout)

    def abort(self) -> None:
        """Abort at once: NCCL kernels in flight exit, later calls raise ``CommAbortedError``."""
        self._fail("abort", f"abort() called on rank {self.rank}", None)
        self._watchdog.stop()
        self._release_store()

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for outstanding work (bounded), then destroy the NCCL communicator.

        Idempotent; after an abort or a failure it only releases resources.
        """
        if self._closed:
            return
        try:
            if self._failure is None:
                self._drain(self.timeout if timeout is None else timeout)
        finally:
            self._closed = True
            self._watchdog.stop()
            if self._failure is None:  # after a failure the lock may be held by an abort
                with self._teardown:  # that hangs in NCCL: never wait for it here
                    if self._failure is None:  # the watchdog may outlive stop()'s join
                        try:
                            self.nccl_comm.destroy()
                        except Exception:
                            pass
            self._release_store()

    def __repr__(self) -> str:
        return (f"<NCCLCommunicator rank={self.rank} size={self.size} device={self.device} "
                f"nccl={self.nccl_version}>")

