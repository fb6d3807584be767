"""``CudaWork``: the ``Work`` of an operation enqueued on a CUDA stream by the NCCL backend."""

from __future__ import annotations

import time
from typing import Any, Optional

from ..errors import GpucollError
from ..work import Work
from .watchdog import Pending

__all__ = ["CudaWork", "EnqueuedCall"]

#: Stream handles at most this (0: the legacy default stream, 1 and 2: cudaStreamLegacy and
#: cudaStreamPerThread) name one stream per GPU: the same value on another GPU is another stream.
_PER_DEVICE_HANDLES = 2


class EnqueuedCall(Pending):
    """The watchdog's entry for one NCCL call (a :class:`~.watchdog.Pending`), which also tells
    the flight recorder whether a blocking call, which returns once enqueued, has finished on
    the GPU (``is_completed()`` and ``exception()``, as a Work's, never block).

    Finished once the watchdog has seen its event complete, or the event says so now (until the
    watchdog releases it the event is this call's alone); a communicator that failed first
    makes it failed with the failure's error. Its event is set once recorded.
    """

    __slots__ = ("comm",)

    def __init__(self, comm: Any, op: str, seq: int, deadline: float, peer: Optional[int],
                 collective: bool, pool: Optional[list], stream: Any):
        # built on every NCCL call: Pending's stores here, not through Pending.__init__ (a
        # second frame and its defaults: about 800 host instructions more per call)
        self.comm = comm
        self.op = op
        self.seq = seq
        self.deadline = deadline
        self.event = None
        self.peer = peer
        self.collective = collective
        self.pool = pool
        self.stream = stream
        self.query = comm._event_done
        self.finished = False

    def _done(self) -> bool:
        if self.finished:
            return True
        try:
            return self.done() and not self.comm._aborted_before_done(self.event)
        except Exception:  # a CUDA fault ended it: the communicator's failure says how
            return False

    def is_completed(self) -> bool:
        return self.comm._failure is not None or self._done()

    def exception(self) -> Optional[BaseException]:
        failure = self.comm._failure
        if failure is None or self._done():
            return None
        kind, message = failure
        return kind(message)


class CudaWork(Work):
    """``Work`` of an enqueued GPU operation, backed by a CUDA event (see module doc)."""

    _host_completion = False  # the CUDA event tells: no threading.Event per call

    def __init__(self, comm: Any, op: str, seq: int, event: Any, result: Any,
                 peer: Optional[int] = None, probe: Optional[EnqueuedCall] = None):
        super().__init__(op, seq, comm.rank, comm.timeout)
        self._comm, self._event, self._result, self._peer = comm, event, result, peer
        self._probe = probe  # the watchdog's entry of the call: what its trace record keeps

    def _trace_probe(self) -> Any:
        return self._probe if self._probe is not None else self

    def __del__(self) -> None:
        """Once nobody can wait on this operation any more, its event goes back to the
        communicator's pool, as a blocking call's does: now if the watchdog has released the
        call (its record then answers from its ``finished`` flag, never from the event), else
        when it does. Spares a new CUDA event per ``async_op`` call of a training step."""
        try:
            probe = self._probe
            if probe is None or self._event is None:
                return
            if probe.finished:
                self._comm._events.append(self._event)
            else:
                probe.pool = self._comm._events  # the watchdog's release appends it
        except Exception:  # a Work half made, or the interpreter shutting down
            pass

    def is_completed(self) -> bool:
        """True once the operation finished on the GPU, or the communicator failed."""
        try:
            return self._comm._failure is not None or self._gpu_done()
        except GpucollError:  # a CUDA fault: the work is over (exception() says how)
            return True

    def _gpu_done(self) -> bool:
        return self._comm._work_done(self.op, self.seq, self._event)

    def _cut_short(self) -> bool:
        """The communicator failed before this operation completed: NCCL's abort ended its
        kernels, so its event completes, but its result is not valid."""
        return self._comm._aborted_before_done(self._event)

    def exception(self) -> Optional[BaseException]:
        if self._cut_short():
            return self._comm._error()
        try:
            if self._gpu_done():
                return None
        except GpucollError as exc:
            return exc
        return self._comm._error() if self._comm._failure is not None else None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Make the caller's current stream wait for the operation; the host does not block.

        Raises:
            CommTimeoutError / CommAbortedError: the communicator failed before the operation
                completed.
        """
        if self._comm._failure is not None and (self._cut_short() or not self._gpu_done()):
            raise self._comm._error()
        cupy = self._comm._cupy
        current = cupy.cuda.get_current_stream().ptr
        probe = self._probe
        if probe is not None and current == probe.stream and (
                current > _PER_DEVICE_HANDLES or
                cupy.cuda.runtime.getDevice() == self._comm.device):
            return True  # its own stream: what is queued there next runs after it anyway
        cupy.cuda.runtime.streamWaitEvent(current, self._event.ptr)
        return True

    def synchronize(self, timeout: Optional[float] = None) -> bool:
        """Block the host until the operation finished on the GPU (at most ``timeout`` s)."""
        limit = self._default_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pause = 2e-5
        while not self._gpu_done():
            if self._comm._failure is not None:
                raise self._comm._error()
            if time.monotonic() > deadline:
                raise self._comm._timed_out(self.op, self.seq, limit, self._peer)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if self._cut_short():
            raise self._comm._error()
        return True

    def result(self, timeout: Optional[float] = None) -> Any:
        """``wait()``, then the output array (in the caller's array type)."""
        self.wait(timeout)
        return self._result if self._map is None else self._map(self._result)

    def __repr__(self) -> str:
        return f"<CudaWork {self.op} #{self.seq} rank {self.rank} " \
               f"{'done' if self.is_completed() else 'pending'}>"
