"""The ``Emulation``: one machine's memory, streams, events and cliques, and the fake modules."""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .basics import (INVALID_ARGUMENT, INVALID_USAGE, MEMCPY_DEFAULT, MEMCPY_DEVICE_TO_DEVICE,
                     MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE, MEMCPY_HOST_TO_HOST,
                     NCCL_CONSTANTS, NCCL_VERSION, REMOTE_ERROR, UNIQUE_ID_BYTES, CUDARuntimeError,
                     NcclError, _cuda_error, _index, _shape, _size_t)
from .arrays import _Capsule, ndarray
from .kernels import RawModule, forget_earlier_gpus
from .cuda_objects import Device, Event, Graph, Stream, _StreamState
from .communicator import _Clique, NcclCommunicator


class Emulation:
    """One emulated machine: its devices, memory, streams, events and NCCL communicators.

    Args:
        device_count: what ``cupy.cuda.runtime.getDeviceCount()`` reports.
        timeout: seconds any emulated wait (rendezvous, matching, synchronize) may take
            before it raises instead.
    """

    def __init__(self, device_count: int = 4, timeout: float = 5.0):
        self.device_count = device_count
        self.timeout = timeout
        # what nccl.get_version() reports; below 2.29.7 a one-rank float AVG drops its tail
        # (NVIDIA/nccl#1950, seen on a real GPU with NCCL 2.28.9)
        self.nccl_version = NCCL_VERSION
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self._local = threading.local()
        self._allocations: Dict[int, Tuple[int, int]] = {}  # base ptr -> (nbytes, device)
        self._streams: Dict[Any, _StreamState] = {}
        self._events: Dict[int, Event] = {}
        self._handles = itertools.count(0x7E5700000000, 0x200)
        self._cliques: Dict[bytes, _Clique] = {}
        self._issued_ids: set = set()
        self.calls: collections.Counter = collections.Counter()
        self.history: List[Tuple[Any, str, dict]] = []  # (nccl comm, call, arguments)
        self.errors: List[BaseException] = []
        # seconds check_async_error() takes (a test widens the window in which abort() or
        # destroy() on another thread would free the communicator under it)
        self.query_delay = 0.0
        # when set (a threading.Event), abort() waits for it first, as NCCL's abort may wait
        # for the other ranks of the node to abort too
        self.abort_hold: Optional[threading.Event] = None
        # when set (a threading.Event), every call into NCCL waits for it inside the call, as a
        # slow enqueue would (the tests of an abort racing a call on another thread)
        self.call_hold: Optional[threading.Event] = None
        self.kernel_launches = 0  # of the bucketing kernels (emulated_cuda/kernels.py)
        self.host_copies: List[Tuple[str, _StreamState]] = []  # ndarray.set / get: the stream
        self.cupy, self.nccl = self._build_modules()
        forget_earlier_gpus()

    # -------------------------------------------------------------- modules
    def _build_modules(self):
        emu = self
        bind = {"_emu": self}
        # CuPy's module name: gpucoll tells CuPy arrays by it (kernels, array_module)
        ndarray_t = type("ndarray", (ndarray,), dict(bind, __module__="cupy"))
        device_t = type("Device", (Device,), bind)
        stream_t = type("Stream", (Stream,), bind)
        event_t = type("Event", (Event,), bind)
        comm_t = type("NcclCommunicator", (NcclCommunicator,), bind)
        self._ndarray = ndarray_t

        runtime = types.ModuleType("cupy.cuda.runtime")
        runtime.CUDARuntimeError = CUDARuntimeError
        runtime.memcpyHostToHost, runtime.memcpyHostToDevice = MEMCPY_HOST_TO_HOST, \
            MEMCPY_HOST_TO_DEVICE
        runtime.memcpyDeviceToHost, runtime.memcpyDeviceToDevice = MEMCPY_DEVICE_TO_HOST, \
            MEMCPY_DEVICE_TO_DEVICE
        runtime.memcpyDefault = MEMCPY_DEFAULT
        runtime.cudaDevAttrClockRate = 13
        runtime.getDeviceCount = lambda: emu.device_count
        runtime.getDevice = emu.current_device
        runtime.setDevice = lambda device: device_t(device).use()
        # parameter names as CuPy's (tests/test_real_cupy.py holds them against the real ones)
        runtime.eventRecord = lambda event, stream: emu.event_record(event, stream)
        runtime.eventQuery = lambda event: emu.event_query(event)
        runtime.streamWaitEvent = lambda stream, event, flags=0: emu.stream_wait_event(stream,
                                                                                       event)
        runtime.memcpyAsync = emu.memcpy_async
        runtime.streamSynchronize = lambda stream: emu.synchronize_stream(stream)
        runtime.streamIsCapturing = lambda stream: emu.stream_is_capturing(stream)
        runtime.deviceSynchronize = lambda: emu.synchronize_device(emu.current_device())
        runtime.deviceGetAttribute = lambda attrib, device: emu.device_get_attribute(attrib,
                                                                                    device)

        nccl = types.ModuleType("cupy.cuda.nccl")
        for name, value in NCCL_CONSTANTS.items():
            setattr(nccl, name, value)
        nccl.available = True
        nccl.NcclError = NcclError
        nccl.NcclCommunicator = comm_t
        nccl.get_version = lambda: emu.nccl_version
        nccl.get_build_version = lambda: NCCL_VERSION
        nccl.get_unique_id = emu.get_unique_id
        nccl.groupStart = emu.group_start
        nccl.groupEnd = emu.group_end

        cuda = types.ModuleType("cupy.cuda")
        cuda.runtime = runtime
        cuda.nccl = nccl
        cuda.Device = device_t
        cuda.Stream = stream_t
        cuda.Event = event_t
        cuda.get_current_stream = emu.get_current_stream
        cuda.graph = types.ModuleType("cupy.cuda.graph")
        cuda.graph.Graph = Graph
        stream_t.null = stream_t(null=True)

        cupy = types.ModuleType("cupy")
        cupy.__version__ = "14.0.0 (emulated)"
        cupy.cuda = cuda
        cupy.ndarray = ndarray_t
        cupy.RawModule = type("RawModule", (RawModule,), bind)
        cupy.asarray = lambda a, dtype=None: emu.asarray(a, dtype)
        cupy.array = lambda obj, dtype=None, copy=True: emu.asarray(obj, dtype).copy() \
            if copy else emu.asarray(obj, dtype)
        cupy.asnumpy = lambda a: emu.asnumpy(a)
        cupy.from_dlpack = lambda array: emu.from_dlpack(array)
        cupy.empty = lambda shape, dtype=float: emu._alloc(shape, dtype)
        cupy.zeros = lambda shape, dtype=float: emu._filled(shape, dtype, 0)
        cupy.ones = lambda shape, dtype=float: emu._filled(shape, dtype, 1)
        cupy.full = lambda shape, fill_value, dtype=None: emu._filled(
            shape, np.asarray(fill_value).dtype if dtype is None else dtype, fill_value)
        cupy.empty_like = lambda prototype, dtype=None: emu._alloc(
            prototype.shape, prototype.dtype if dtype is None else dtype)
        cupy.zeros_like = lambda a, dtype=None: emu._filled(a.shape, a.dtype if dtype is None
                                                            else dtype, 0)
        cupy.ones_like = lambda a, dtype=None: emu._filled(a.shape, a.dtype if dtype is None
                                                           else dtype, 1)
        cupy.full_like = lambda a, fill_value, dtype=None: emu._filled(
            a.shape, a.dtype if dtype is None else dtype, fill_value)
        cupy.arange = lambda *args, dtype=None: emu._from_host(np.arange(*args, dtype=dtype))
        for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                     "float16", "float32", "float64", "complex64", "complex128"):
            setattr(cupy, name, getattr(np, name))
        cupy.bool_ = np.bool_
        for name in ("add", "multiply", "minimum", "maximum", "bitwise_and", "bitwise_or",
                     "bitwise_xor", "logical_and", "logical_or", "logical_xor"):
            setattr(cupy, name, self._ufunc(getattr(np, name)))
        return cupy, nccl

    def _ufunc(self, ufunc: np.ufunc) -> Callable[..., ndarray]:
        """CuPy's elementwise ufunc of two device arrays: into ``out`` as a kernel would, in
        order on the current stream (recorded in a capture, run at each launch); without
        ``out``, a new array at once."""
        emu = self

        def apply(x1, x2, out=None):
            if not isinstance(x1, ndarray) or not isinstance(x2, ndarray):
                raise TypeError(f"emulated CuPy: {ufunc.__name__} takes device arrays")
            if out is None:
                return emu._from_host(ufunc(x1._a, x2._a), x1._device_id)
            change = lambda: ufunc(x1._a, x2._a, out=out._a)  # noqa: E731
            state = emu._state(emu.get_current_stream().ptr)
            if not emu._captured(state, lambda target: emu._submit(target, change)):
                emu._submit(state, change)
            return out

        apply.__name__ = ufunc.__name__
        return apply

    # -------------------------------------------------------------- thread state
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def _stream_stack(self) -> list:
        stack = getattr(self._local, "streams", None)
        if stack is None:
            stack = self._local.streams = []
        return stack

    def get_current_stream(self):
        stack = self._stream_stack()
        return stack[-1] if stack else self.cupy.cuda.Stream.null

    def _group_depth(self) -> int:
        return getattr(self._local, "group_depth", 0)

    def _handle(self) -> int:
        with self.lock:
            return next(self._handles)

    # -------------------------------------------------------------- memory
    def _register(self, raw: np.ndarray, nbytes: int, device: int) -> None:
        base = raw.ctypes.data
        with self.lock:
            self._allocations[base] = (nbytes, device)
        weakref.finalize(raw, self._allocations.pop, base, None)

    def _alloc(self, shape, dtype, device: Optional[int] = None) -> ndarray:
        dtype, shape = np.dtype(dtype), _shape(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.empty(max(nbytes, 1), dtype=np.uint8)
        host = raw[:nbytes].view(dtype).reshape(shape)
        device = self.current_device() if device is None else device
        self._register(raw, nbytes, device)
        array = self._ndarray(host, device, raw, owndata=True)
        weakref.finalize(array, self._free, raw, self._state(self.get_current_stream().ptr,
                                                             device))
        return array

    def _free(self, raw: np.ndarray, state: _StreamState) -> None:
        """An array was freed. CuPy's pool gives its block back to the stream that was current
        when it was allocated, for later allocations there: the work already enqueued on that
        stream still reads and writes it. Its memory stays until that work has run."""
        with self.lock:
            if state.queue:
                state.queue.append(("free", raw, None))

    def _filled(self, shape, dtype, value) -> ndarray:
        array = self._alloc(shape, dtype)
        array._a[...] = value
        host = array._a  # a capture records the fill too (CuPy's memset or fill kernel)
        self._in_place(lambda: host.__setitem__(Ellipsis, value), now=False)
        return array

    def _in_place(self, change: Callable[[], None], now: bool = True) -> None:
        """An in-place change of device memory (setitem, fill, ``+=``): done now, as the rest of
        this emulation's array arithmetic; on a capturing current stream recorded into its
        graph instead, and done at each launch, as a captured kernel is (``now=False``: only
        recorded, and only in a capture)."""
        state = self._state(self.get_current_stream().ptr)
        if not self._captured(state, lambda target: self._submit(target, change)) and now:
            change()

    def _view(self, ptr: int, count: int, dtype: np.dtype, device: int) -> np.ndarray:
        """A kernel's view of ``count`` elements at ``ptr``: they must lie in one allocation
        of ``device`` that is still alive (else cudaErrorIllegalAddress, as on a GPU)."""
        nbytes = count * dtype.itemsize
        if nbytes == 0:
            return np.empty(0, dtype)
        found = self._find(ptr, nbytes)
        if found is None or found[2] != device:
            raise CUDARuntimeError(f"cudaErrorIllegalAddress: a kernel on GPU {device} read "
                                   f"[{ptr:#x}, +{nbytes} bytes), which is not allocated there")
        return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)

    def _from_host(self, host: np.ndarray, device: Optional[int] = None) -> ndarray:
        array = self._alloc(host.shape, host.dtype, device)
        array._a[...] = host
        return array

    def _find(self, ptr: int, nbytes: int) -> Optional[Tuple[int, int, int]]:
        """(base, size, device) of the allocation holding [ptr, ptr + nbytes), or None."""
        with self.lock:
            for base, (size, device) in self._allocations.items():
                if base <= ptr and ptr + nbytes <= base + size:
                    return base, size, device
        return None

    def _check_range(self, ptr: int, nbytes: int, device: int, what: str, error) -> None:
        found = self._find(ptr, nbytes)
        if found is None:
            raise error(INVALID_ARGUMENT, f"{what} [{ptr:#x}, +{nbytes} bytes) is not inside "
                                          f"one device allocation")
        if found[2] != device:
            raise error(INVALID_ARGUMENT, f"{what} {ptr:#x} is memory of GPU {found[2]}, "
                                          f"expected GPU {device}")

    def asarray(self, obj: Any, dtype=None) -> ndarray:
        if isinstance(obj, self._ndarray):
            return obj if dtype is None or np.dtype(dtype) == obj.dtype else obj.astype(dtype)
        interface = getattr(obj, "__cuda_array_interface__", None)
        if interface is not None:
            array = self._from_interface(interface, obj)
            return array if dtype is None or np.dtype(dtype) == array.dtype \
                else array.astype(dtype)
        # a copy from host memory on the current stream: not in a capture (CuPy stages it
        # through pinned memory it reuses, tied to an event; modelled as CUDA's refusal)
        self.refuse_in_capture(self._state(self.get_current_stream().ptr))
        return self._from_host(np.asarray(obj, dtype=dtype))

    def _from_interface(self, interface: dict, owner: Any) -> ndarray:
        """A view (no copy) of the device memory an ``__cuda_array_interface__`` describes."""
        ptr, _read_only = interface["data"]
        shape = _shape(interface["shape"])
        dtype = np.dtype(interface["typestr"])
        strides = interface.get("strides")
        count = int(np.prod(shape, dtype=np.int64))
        if strides is None:
            span = count * dtype.itemsize
        else:
            span = 0 if count == 0 else \
                sum((d - 1) * s for d, s in zip(shape, strides)) + dtype.itemsize
        if span == 0:
            return self._alloc(shape, dtype)
        found = self._find(ptr, span)
        if found is None:
            raise ValueError(f"__cuda_array_interface__ pointer {ptr:#x} (+{span} bytes) is not "
                             f"emulated device memory")
        flat = np.frombuffer((ctypes.c_char * span).from_address(ptr), dtype=np.uint8)
        host = np.ndarray(shape, dtype=dtype, buffer=flat, strides=strides)
        return self._ndarray(host, found[2], (flat, owner))

    def from_dlpack(self, obj: Any) -> ndarray:
        capsule = obj.__dlpack__() if hasattr(obj, "__dlpack__") else obj
        if not isinstance(capsule, _Capsule) or not isinstance(capsule.array, self._ndarray):
            raise TypeError(f"emulated from_dlpack: {type(obj).__name__} did not hand over a "
                            f"capsule of this emulation")
        array = capsule.array
        return self._ndarray(array._a, array._device_id, (array._owner, obj))

    def asnumpy(self, obj: Any) -> np.ndarray:
        if isinstance(obj, self._ndarray):
            return obj.get()
        return np.asarray(obj)

    # -------------------------------------------------------------- streams and events
    def _state(self, ptr: int, device: Optional[int] = None) -> _StreamState:
        ptr = _index(ptr, "stream")
        with self.lock:
            if ptr == 0:
                device = self.current_device() if device is None else device
                key = ("null", device)
                if key not in self._streams:
                    self._streams[key] = _StreamState(f"null stream of GPU {device}", device)
                return self._streams[key]
            state = self._streams.get(ptr)
        if state is None:
            raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: {ptr:#x} is not a stream")
        return state

    def _event(self, ptr: int) -> Event:
        with self.lock:
            event = self._events.get(_index(ptr, "event"))
        if event is None:
            raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: {ptr:#x} is not an event")
        return event

    def _submit(self, state: _StreamState, fn: Callable[[], None],
                on_error: Optional[Callable[[BaseException], None]] = None,
                kind: str = "call") -> None:
        """Run ``fn`` now when ``state`` is idle (its errors propagate), else queue it.

        ``kind`` "event" marks an event completion: other streams may wait for it, so every
        stream is pumped after it ran.
        """
        with self.lock:
            direct = not state.stalled and not state.running and not state.queue
            if direct:
                state.running = True
            else:
                state.queue.append((kind, fn, on_error))
        if not direct:
            return
        try:
            fn()
        finally:
            with self.cond:
                state.running = False
                self.cond.notify_all()
            if kind == "event":
                self._pump_all()
            else:
                self._pump(state)

    def _pump(self, state: _StreamState) -> None:
        """Run queued work of ``state`` until it is empty, stalled or waits for an event."""
        while True:
            with self.lock:
                if state.stalled or state.running or not state.queue:
                    return
                kind, payload, on_error = state.queue[0]
                if kind == "wait" and not payload():
                    return
                state.queue.popleft()
                state.running = True
            try:
                if kind not in ("wait", "free"):
                    payload()
            except BaseException as exc:  # held work: the error goes to its owner
                (on_error or self.errors.append)(exc)
            finally:
                with self.cond:
                    state.running = False
                    self.cond.notify_all()
            if kind == "event":
                self._pump_all()

    def _pump_all(self) -> None:
        with self.lock:
            states = list(self._streams.values())
        for state in states:
            self._pump(state)

    def event_record(self, event_ptr: int, stream_ptr: int) -> None:
        event, state = self._event(event_ptr), self._state(stream_ptr)
        if state.device != event.device_id:
            raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: event {event_ptr:#x} of GPU "
                                   f"{event.device_id} recorded on {state.name}")
        if self._captured(state, lambda target: self._record(event, target)):
            with self.lock:  # an event node: recorded again by each launch
                event._captured = True
            return
        self._record(event, state)

    def _record(self, event: Event, state: _StreamState) -> None:
        with self.lock:
            event._recorded += 1
            event._stream_state = state
            event._captured = False
            generation = event._recorded

        def complete() -> None:
            with self.cond:
                event._completed = max(event._completed, generation)
                self.cond.notify_all()

        self._submit(state, complete, kind="event")

    def stream_wait_event(self, stream_ptr: int, event_ptr: int) -> None:
        state, event = self._state(stream_ptr), self._event(event_ptr)
        if not self._captured(state, lambda target: self._wait_for(target, event)):
            self._wait_for(state, event)

    def _wait_for(self, state: _StreamState, event: Event) -> None:
        with self.lock:
            generation = event._recorded
            ready = lambda: event._completed >= generation  # noqa: E731
            if ready() and not state.queue:
                return
            state.queue.append(("wait", ready, None))

    def memcpy_async(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        size = _size_t(size, "size")
        kind = _index(kind, "kind")
        if kind != MEMCPY_DEVICE_TO_DEVICE:
            raise CUDARuntimeError(f"emulated memcpyAsync supports device-to-device only, got "
                                   f"kind {kind}")
        state = self._state(stream)
        dst, src = _index(dst, "dst"), _index(src, "src")
        if size:
            self._check_range(dst, size, state.device, "memcpyAsync dst", _cuda_error)
            self._check_range(src, size, state.device, "memcpyAsync src", _cuda_error)
        self.calls["memcpyAsync"] += 1
        copy = lambda: ctypes.memmove(dst, src, size) if size else None  # noqa: E731
        if not self._captured(state, lambda target: self._submit(target, copy)):
            self._submit(state, copy)

    def synchronize_stream(self, ptr: int) -> None:
        state = self._state(ptr)
        self.refuse_in_capture(state)
        self.wait_drained(state)

    def refuse_in_capture(self, state: _StreamState) -> None:
        """What CUDA does to a call a capture cannot hold (a synchronize, a copy the host waits
        for): cudaErrorStreamCaptureUnsupported (900), and the capture is invalidated, so that
        its ``end_capture`` fails too (cudaErrorStreamCaptureInvalidated, 901)."""
        with self.lock:
            graph = state.capture
            if graph is not None:
                graph.invalidated = True
        if graph is not None:
            raise CUDARuntimeError(900)

    def stream_is_capturing(self, ptr: int) -> bool:
        """``cudaStreamIsCapturing``, as CuPy's ``runtime.streamIsCapturing``: a bool."""
        return self._state(ptr).capture is not None

    def _captured(self, state: _StreamState, node: Callable[[_StreamState], None]) -> bool:
        """When ``state`` is capturing: ``node`` joins its graph, and each launch runs it on
        the launch's stream (True); else False and the caller runs the work now."""
        with self.lock:
            graph = state.capture
            if graph is not None:
                graph.nodes.append(node)
        return graph is not None

    def wait_drained(self, state: _StreamState) -> None:
        """Block (bounded) until everything enqueued on ``state`` has run."""
        with self.cond:
            if not self.cond.wait_for(lambda: not state.queue and not state.running,
                                      self.timeout):
                raise CUDARuntimeError(f"emulated: {state.name} did not drain within "
                                       f"{self.timeout:g} s (stalled?)")

    def synchronize_device(self, device: int) -> None:
        with self.lock:
            states = [s for s in self._streams.values() if s.device == device]
        for state in states:
            with self.cond:
                if not self.cond.wait_for(lambda: not state.queue and not state.running,
                                          self.timeout):
                    raise CUDARuntimeError(f"emulated: {state.name} did not drain")

    def device_get_attribute(self, attribute: int, device: int) -> int:
        return 1_000_000

    # -------------------------------------------------------------- NCCL module functions
    def get_unique_id(self) -> bytes:
        uid = os.urandom(UNIQUE_ID_BYTES)
        with self.lock:
            self._issued_ids.add(uid)
        return uid

    def group_start(self) -> None:
        depth = self._group_depth()
        if depth == 0:
            self._local.group = []
            self._local.group_failed = False
        self._local.group_depth = depth + 1

    def group_end(self) -> None:
        depth = self._group_depth()
        if depth == 0:
            raise NcclError(INVALID_USAGE, "groupEnd() without groupStart()")
        self._local.group_depth = depth - 1
        if depth > 1:
            return
        ops, failed = self._local.group, self._local.group_failed
        self._local.group = []
        if failed:
            raise NcclError(INVALID_ARGUMENT, "an operation of this group failed; the group was "
                                              "not launched")
        batches: Dict[int, Tuple[Any, _StreamState, list]] = {}
        for comm, state, op in ops:
            batch = batches.setdefault(id(comm), (comm, state, []))
            if batch[1] is not state:
                raise NcclError(INVALID_USAGE, "emulation: one stream per communicator in a "
                                               "group")
            batch[2].append(op)
        for comm, state, batch_ops in batches.values():
            comm._connect(batch_ops)
        for comm, state, batch_ops in batches.values():
            run = lambda target, c=comm, o=batch_ops: self._submit(  # noqa: E731
                target, lambda: c._run_p2p(o), on_error=c._set_async_error)
            if not self._captured(state, run):
                run(state)

    # -------------------------------------------------------------- test hooks
    def stall(self, stream: Any, device: Optional[int] = None) -> None:
        """Hold back everything enqueued on ``stream`` (a Stream or pointer) from now on.

        ``device`` says whose null stream pointer 0 means (default: the current device).
        """
        state = self._state(getattr(stream, "ptr", stream), device)
        with self.lock:
            state.stalled = True

    def release(self, stream: Any, device: Optional[int] = None) -> None:
        """Run what ``stream`` held back (in this thread) and stop holding work back.

        ``device`` says whose null stream pointer 0 means (default: the current device).
        """
        state = self._state(getattr(stream, "ptr", stream), device)
        with self.lock:
            state.stalled = False
        self._pump(state)
        self._pump_all()

    def release_all(self) -> None:
        with self.lock:
            states = list(self._streams.values())
            for state in states:
                state.stalled = False
        self._pump_all()

    def event_query(self, event_ptr: int) -> int:
        """``cudaEventQuery``: 0 when done, 600 (not ready) while the work before it runs, the
        error of a faulted stream (see :meth:`inject_fault`), or 907 for an event last recorded
        in a capture; never raises, as CuPy's."""
        event = self._event(event_ptr)
        if event._captured:
            return 907
        with self.lock:
            if event._completed >= event._recorded:
                return 0
            state = getattr(event, "_stream_state", None)
            return getattr(state, "fault", None) or 600

    def inject_fault(self, stream: Any, status: int = 700, device: Optional[int] = None) -> None:
        """Make the work held on ``stream`` fail with CUDA error ``status`` (700: illegal
        address): its events report that status from ``eventQuery`` instead of "not ready"."""
        state = self._state(getattr(stream, "ptr", stream), device)
        with self.lock:
            state.fault = int(status)

    def inject_async_error(self, comm: NcclCommunicator,
                           detail: str = "remote process exited or there was a network error"
                           ) -> None:
        """Make ``comm.check_async_error()`` raise, as after a failure NCCL noticed later."""
        comm._async_error = NcclError(REMOTE_ERROR, detail)

    def pending(self, stream: Any, device: Optional[int] = None) -> int:
        """How many items ``stream`` holds back (not counting memory freed behind them)."""
        state = self._state(getattr(stream, "ptr", stream), device)
        with self.lock:
            return sum(kind != "free" for kind, _, _ in state.queue)
