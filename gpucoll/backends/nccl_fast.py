"""The NCCL backend's one-pass calls, for the calls a training step makes over and over.

``all_reduce(x[, op])`` and ``broadcast(x, root)`` in place, ``all_gather(x, out=)`` and
``reduce_scatter(x[, op], out=)``, blocking or with ``async_op=True`` (as a data-parallel step
issues its buckets); ``send(x, dst)``, ``recv(out, src)``, ``isend`` and ``irecv`` (as a
pipeline schedule passes its micro-batches): on the caller's current stream, of C-contiguous
CuPy arrays on this communicator's GPU (a CuPy array is always writable). The first call with
each dtype, (dtype, op) pair, root or peer runs the checks of :class:`~gpucoll.Communicator` in
full and remembers what passed; from then on this path reads each array's flags once, looks
the translation up once and makes the NCCL call itself, instead of going through the flight
recorder's decorator, the argument checks, the translation and ``_enqueue`` one layer at a time
(a quarter fewer host instructions per call). Its flight recorder record, watchdog entry,
sequence number, event, Work and errors are the general path's.

The general path takes every other call: an explicit stream, ``out=None`` where
the call would allocate, other array types, arguments whose checks fail (it names the error),
GPUCOLL_DEBUG, another current device, a stream capturing a CUDA graph, and a communicator
that failed, closed or has not started its recorder (its first call).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Optional, Tuple, Union

from ..communicator import Communicator
from ..flight_recorder import NOT_STARTED, RECORD_PENDING, RECORD_WORK, record_failure
from ..types import _CODE_OF as _ACCEPTED_DTYPES, ReduceOp, check_op_dtype
from .nccl_work import CudaWork, EnqueuedCall

__all__ = ["OnePassCalls"]

_now = time.time
_monotonic = time.monotonic
_TAGS = 2 ** 32
_GENERAL = object()  # what a one-pass helper returns for a call the general path must take


class OnePassCalls:
    """Mixin of :class:`~gpucoll.backends.nccl.NCCLCommunicator` (uses its ``_cupy``,
    ``device``, ``size``, ``_runtime``, ``_debug``, ``_failure``, ``_closed``, ``_recorder``,
    ``_seq``, ``_p2p_seq``, ``_events``, ``_bytes_type``, ``_root``, ``_peer``, ``_reduction``,
    ``_reductions``, ``_launch_watched``, ``_track`` and ``nccl_comm``)."""

    _pairs: Optional[dict] = None  # (dtype, op as passed) -> (NCCL dtype, per element, NCCL op)
    _ranks: Optional[dict] = None  # ("root" | "peer", value as passed) -> the checked int

    # ------------------------------------------------------------------ the calls
    def all_reduce(self, x: Any, op: Union[ReduceOp, str] = "sum", *, out: Any = None,
                   async_op: bool = False, stream: Any = None):
        # _one_pass_stream and _pair's lookup, inline: the hottest call (a cached pair's dtype
        # passed the dtype check when it was cached)
        if out is None and stream is None and isinstance(x, self._cupy.ndarray) and \
                x._c_contiguous and x.data.device_id == self.device and not self._debug and \
                self._failure is None and not self._closed and \
                self._recorder is not NOT_STARTED:
            try:
                translated = self._pairs[x.dtype, op]
            except (KeyError, TypeError):
                translated = self._pair(x, op) if x.dtype in _ACCEPTED_DTYPES else None
            if translated is not None:
                runtime = self._runtime
                current = self._cupy.cuda.get_current_stream().ptr
                if runtime.getDevice() == self.device and \
                        not runtime.streamIsCapturing(current):
                    dtype, per_element, reduce_op = translated
                    ptr = x.data.ptr
                    return self._one_pass(
                        "all_reduce", self.nccl_comm.allReduce,
                        (ptr, ptr, per_element * x.size, dtype, reduce_op), current, x,
                        (x.shape, x.dtype, None, None, None, None), None, async_op)
        return Communicator.all_reduce(self, x, op, out=out, async_op=async_op, stream=stream)

    def broadcast(self, x: Any, root: int = 0, *, async_op: bool = False, stream: Any = None):
        if stream is None:
            current = self._one_pass_stream(x)
            checked = None if current is None else self._rank_of("root", root)
            if checked is not None:
                ptr = x.data.ptr
                return self._one_pass(
                    "broadcast", self.nccl_comm.broadcast,
                    (ptr, ptr, x.nbytes, self._bytes_type, checked), current, x,
                    (x.shape, x.dtype, root, None, None, None), None, async_op)
        return Communicator.broadcast(self, x, root, async_op=async_op, stream=stream)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False,
                   stream: Any = None):
        if out is not None and stream is None:
            current = self._one_pass_stream(x, out)
            if current is not None and out.shape == (self.size,) + x.shape:
                return self._one_pass(
                    "all_gather", self.nccl_comm.allGather,
                    (x.data.ptr, out.data.ptr, x.nbytes, self._bytes_type), current, out,
                    (x.shape, x.dtype, None, None, None, None), None, async_op)
        return Communicator.all_gather(self, x, out=out, async_op=async_op, stream=stream)

    def reduce_scatter(self, x: Any, op: Union[ReduceOp, str] = "sum", *, out: Any = None,
                       async_op: bool = False, stream: Any = None):
        if out is not None and stream is None:
            current = self._one_pass_stream(x, out)
            shape = x.shape if current is not None else ()
            if shape and shape[0] == self.size and out.shape == shape[1:]:
                translated = self._pair(x, op)
                if translated is not None:
                    dtype, per_element, reduce_op = translated
                    return self._one_pass(
                        "reduce_scatter", self.nccl_comm.reduceScatter,
                        (x.data.ptr, out.data.ptr, per_element * x.size // self.size, dtype,
                         reduce_op), current, out, (shape, x.dtype, None, None, None, None),
                        None, async_op)
        return Communicator.reduce_scatter(self, x, op, out=out, async_op=async_op,
                                           stream=stream)

    def send(self, x: Any, dst: int, *, tag: int = 0, stream: Any = None) -> None:
        if stream is None and self._point_to_point(True, x, dst, tag, False) is not _GENERAL:
            return None
        return Communicator.send(self, x, dst, tag=tag, stream=stream)

    def recv(self, out: Any, src: int, *, tag: int = 0, stream: Any = None):
        if stream is None:
            result = self._point_to_point(False, out, src, tag, False)
            if result is not _GENERAL:
                return result
        return Communicator.recv(self, out, src, tag=tag, stream=stream)

    def isend(self, x: Any, dst: int, *, tag: int = 0, stream: Any = None):
        if stream is None:
            work = self._point_to_point(True, x, dst, tag, True)
            if work is not _GENERAL:
                return work
        return Communicator.isend(self, x, dst, tag=tag, stream=stream)

    def irecv(self, out: Any, src: int, *, tag: int = 0, stream: Any = None):
        if stream is None:
            work = self._point_to_point(False, out, src, tag, True)
            if work is not _GENERAL:
                return work
        return Communicator.irecv(self, out, src, tag=tag, stream=stream)

    def _point_to_point(self, sending: bool, array: Any, peer: Any, tag: Any,
                        async_op: bool) -> Any:
        """A send (``sending``) of ``array`` to ``peer`` or a receive into it, in one pass:
        None or ``array`` (blocking), a Work (``async_op``), or ``_GENERAL`` when the general
        path must take it."""
        if type(tag) is not int or not 0 <= tag < _TAGS:
            return _GENERAL
        current = self._one_pass_stream(array)
        checked = None if current is None else self._rank_of("peer", peer)
        if checked is None:
            return _GENERAL
        name = "send" if sending else "recv"
        return self._one_pass(name, self.nccl_comm.send if sending else self.nccl_comm.recv,
                              (array.data.ptr, array.nbytes, self._bytes_type, checked), current,
                              None if sending else array,
                              (array.shape, array.dtype, None, peer, tag, None), checked,
                              async_op, "i" + name if async_op else None)

    # ------------------------------------------------------------------ what may take it
    def _one_pass_stream(self, x: Any, out: Any = None) -> Optional[int]:
        """The current stream's pointer when ``x`` (and ``out``, of ``x``'s dtype) and this
        communicator's state allow the one-pass path (the general path's array checks would
        pass unchanged), else None."""
        ndarray = self._cupy.ndarray
        if not isinstance(x, ndarray) or not x._c_contiguous or \
                x.data.device_id != self.device or x.dtype not in _ACCEPTED_DTYPES or \
                self._debug or self._failure is not None or self._closed or \
                self._recorder is NOT_STARTED:
            return None
        if out is not None and (not isinstance(out, ndarray) or not out._c_contiguous or
                                out.data.device_id != self.device or out.dtype != x.dtype):
            return None
        runtime = self._runtime
        stream = self._cupy.cuda.get_current_stream().ptr
        if runtime.getDevice() != self.device or runtime.streamIsCapturing(stream):
            return None
        return stream

    def _pair(self, x: Any, op: Any) -> Optional[Tuple[int, int, int]]:
        """The NCCL translation of (``x.dtype``, ``op``), remembered once its checks passed;
        None when they do not (the general path then names the error), or when ``x`` is empty
        (its translation is not cached)."""
        try:
            return self._pairs[x.dtype, op]
        except (KeyError, TypeError):  # TypeError: no pairs yet, or an unhashable op
            pass
        try:
            parsed = ReduceOp.parse(op)
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

    def _rank_of(self, kind: str, value: Any) -> Optional[int]:
        """A root (``kind`` "root") or peer ("peer") as checked by the general path,
        remembered once it passed; None when it does not."""
        try:
            return self._ranks[kind, value]
        except (KeyError, TypeError):
            pass
        try:
            checked = self._root(value) if kind == "root" else self._peer(value, kind)
            ranks = self._ranks if self._ranks is not None else {}
            ranks[kind, value] = checked
            self._ranks = ranks
        except (TypeError, ValueError):
            return None
        return checked

    # ------------------------------------------------------------------ the call itself
    def _one_pass(self, name: str, launch: Callable[..., None], args: tuple, stream: int,
                  result: Any, fields: tuple, peer: Optional[int] = None,
                  async_op: bool = False, traced_as: Optional[str] = None) -> Any:
        """What the decorator and ``_enqueue`` do for a call, inline: the record, the sequence
        number (collective, or point-to-point when ``peer`` is given), then
        ``launch(*args, stream)`` under the watchdog and its event. Returns ``result``, or
        with ``async_op`` a :class:`~.nccl_work.CudaWork` of it, which keeps the event (a
        blocking call's goes back to the pool once the watchdog saw it complete). The record
        names the call ``traced_as`` when given (``isend`` of an NCCL ``send``).

        :meth:`_launch_watched`, :meth:`_track` and the watchdog's ``leave_host_call`` and
        ``track`` are inline here, in that order (the host call is entered before the failure
        is checked, so an abort on another thread either sees the call or the call sees its
        failure): four calls fewer on the calls a training step makes by the thousand. What
        fails takes their way out (:meth:`_refused`)."""
        recorder = self._recorder
        if recorder is not None:  # the flight recorder's record, as the decorator leaves it
            record = [next(recorder.numbers), traced_as or name, fields, _now(), None,
                      RECORD_PENDING, None]
            recorder.records.append(record)
        collective = peer is None
        if collective:
            number = self._seq = self._seq + 1
        else:
            number = self._p2p_seq = self._p2p_seq + 1
        watchdog = self._watchdog
        events = self._events
        pending = EnqueuedCall(self, name, number, _monotonic() + self.timeout, peer,
                               collective, None if async_op else events, stream)
        try:
            watchdog.enter_host_call(pending)
            if self._failure is not None:
                watchdog._host_call = None
                raise self._error()
            try:
                launch(*args, stream)
            except BaseException as exc:
                watchdog._host_call = None
                error = self._refused(name, number, exc)
                if error is exc:
                    raise
                raise error from exc
            watchdog._host_call = None        # leave_host_call
            if self._failure is not None:     # _track
                raise self._error()
            event = events.pop() if events else self._new_event()
            self._runtime.eventRecord(event.ptr, stream)
            pending.event = event
            queue = watchdog._streams.get(stream)   # the watchdog's track
            if queue is None:
                queue = watchdog._streams[stream] = deque()
            queue.append(pending)
        except BaseException as exc:
            if recorder is not None:
                record_failure(self, recorder, record, exc)
            raise
        if recorder is not None:
            record[RECORD_WORK] = pending  # pending until the GPU has finished it
        if async_op:
            return CudaWork(self, name, number, event, result, peer, pending)
        return result


_NOTE = ("\n\n        On the NCCL backend, the call a training step makes (current stream,"
         "\n        C-contiguous CuPy arrays on this GPU) runs in one pass: see "
         f":mod:`{__name__}`.\n")
for _name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv",
              "isend", "irecv"):
    _doc = getattr(Communicator, _name).__doc__
    if _doc:  # None under python -OO
        getattr(OnePassCalls, _name).__doc__ = _doc.rstrip() + _NOTE
