"""The NCCL backend's one-pass ``all_reduce``, for the call a training step makes most.

``comm.all_reduce(x)`` or ``comm.all_reduce(x, op)``: in place, blocking, on the caller's
current stream, of a C-contiguous CuPy array on this communicator's GPU (a CuPy array is always
writable). The first call of each (dtype, op) pair runs the checks of
:meth:`Communicator.all_reduce` in full and remembers the pair's NCCL translation; from then on
they are known to pass, so this path reads the array's flags once, translates dtype and op with
one dictionary lookup and makes the NCCL call itself, instead of going through the flight
recorder's decorator, the argument checks, the translation and ``_enqueue`` one layer at a
time (about 40 % fewer host instructions per call). Its flight recorder record, watchdog entry,
sequence number, event and errors are the general path's.

The general path takes every other call: ``out=``, ``async_op``, an explicit stream, another
array type, a pair whose checks fail (the general path names the error), GPUCOLL_DEBUG,
another current device, a stream capturing a CUDA graph, and a communicator that failed,
closed or has not started its recorder (its first call).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Tuple, Union

from ..communicator import Communicator
from ..flight_recorder import NOT_STARTED, RECORD_PENDING, RECORD_WORK, record_failure
from ..types import ReduceOp, check_op_dtype
from .nccl_work import EnqueuedCall

__all__ = ["FastAllReduce"]

_now = time.time
_monotonic = time.monotonic


class FastAllReduce:
    """Mixin of :class:`~gpucoll.backends.nccl.NCCLCommunicator` (uses its ``_cupy``,
    ``device``, ``_runtime``, ``_debug``, ``_failure``, ``_closed``, ``_recorder``, ``_seq``,
    ``_events``, ``_watchdog``, ``_array``, ``_reduction``, ``_refused``, ``_track`` and
    ``nccl_comm``)."""

    _pairs: Optional[dict] = None  # (dtype, op as passed) -> (NCCL dtype, per element, NCCL op)

    def all_reduce(self, x: Any, op: Union[ReduceOp, str] = "sum", *, out: Any = None,
                   async_op: bool = False, stream: Any = None):
        # its docstring: Communicator.all_reduce's, set below
        if out is None and not async_op and stream is None and \
                isinstance(x, self._cupy.ndarray):
            try:
                translated = self._pairs[x.dtype, op]
            except (KeyError, TypeError):  # TypeError: no pairs yet, or an unhashable op
                translated = self._learn_pair(x, op)
            if translated is not None and x._c_contiguous and not self._debug:
                data = x.data
                if data.device_id == self.device and self._failure is None and \
                        not self._closed and self._recorder is not NOT_STARTED:
                    runtime = self._runtime
                    stream = self._cupy.cuda.get_current_stream().ptr
                    if runtime.getDevice() == self.device and \
                            not runtime.streamIsCapturing(stream):
                        return self._all_reduce_in_one_pass(x, data.ptr, translated, stream)
        return Communicator.all_reduce(self, x, op, out=out, async_op=async_op, stream=stream)

    def _learn_pair(self, x: Any, op: Any) -> Optional[Tuple[int, int, int]]:
        """The translation of (``x.dtype``, ``op``), remembered for later calls once the
        general path's checks pass; None when they do not (the general path then names the
        error), or when ``x`` is empty (its translation is not cached)."""
        try:
            parsed = ReduceOp.parse(op)
            if self._array(x, "x") is not x:
                return None
            check_op_dtype(parsed, x.dtype)
            self._reduction(x, parsed)
        except (TypeError, ValueError):
            return None
        translated = self._reductions.get((x.dtype, parsed))
        if translated is not None:
            try:
                pairs = self._pairs if self._pairs is not None else {}
                pairs[x.dtype, op] = translated
                self._pairs = pairs
            except TypeError:  # an unhashable op naming a valid one: the general path takes it
                return None
        return translated

    def _all_reduce_in_one_pass(self, x: Any, ptr: int, translated: Tuple[int, int, int],
                                stream: int):
        """What the general path does for this call, inline (``_enqueue``'s steps)."""
        recorder = self._recorder
        if recorder is not None:  # the flight recorder's record, as the decorator leaves it
            record = [next(recorder.numbers), "all_reduce",
                      (x.shape, x.dtype, None, None, None, None), _now(), None, RECORD_PENDING,
                      None]
            recorder.records.append(record)
        dtype, per_element, reduce_op = translated
        number = self._seq = self._seq + 1
        pending = EnqueuedCall("all_reduce", number, _monotonic() + self.timeout, None, None,
                               True, self._events, stream, self._event_done)
        pending.comm = self
        watchdog = self._watchdog
        watchdog.enter_host_call(pending)  # NCCL may block inside: held to the deadline
        try:
            self.nccl_comm.allReduce(ptr, ptr, per_element * x.size, dtype, reduce_op, stream)
        except BaseException as exc:
            watchdog.leave_host_call()
            error = self._refused("all_reduce", number, exc)
            if recorder is not None:
                record_failure(self, recorder, record, error)
            if error is exc:
                raise
            raise error from exc
        watchdog.leave_host_call()
        try:
            self._track(pending, stream)
        except BaseException as exc:
            if recorder is not None:
                record_failure(self, recorder, record, exc)
            raise
        if recorder is not None:
            record[RECORD_WORK] = pending  # pending until the GPU has finished it
        return x


if Communicator.all_reduce.__doc__:  # None under python -OO
    FastAllReduce.all_reduce.__doc__ = (
        f"{Communicator.all_reduce.__doc__.rstrip()}\n\n        On the NCCL backend, the call "
        f"a training step makes (in place, blocking, current stream,\n        a C-contiguous "
        f"CuPy array on this GPU) runs in one pass: see :mod:`{__name__}`.\n")
