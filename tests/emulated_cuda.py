"""An emulation of the small part of the CuPy and NCCL APIs that gpucoll's NCCL backend calls.

It runs on the CPU and exists to test gpucoll's own bookkeeping (argument translation, pointer
arithmetic, results handed back, events and streams, the watchdog, split, abort) on machines
without a GPU. It is neither CuPy nor NCCL and proves nothing about them: real NCCL is tested
by ``tests/test_nccl_gpu.py``.

Usage::

    emu = Emulation(device_count=4)
    monkeypatch.setattr(gpucoll.transports.nccl, "_LOADED", (emu.cupy, emu.nccl))

``emu.cupy`` stands for ``cupy`` and ``emu.nccl`` for ``cupy.cuda.nccl`` (the CuPy 14 API:
``get_unique_id()`` returns bytes, ``NcclCommunicator(ndev, commId: bytes, rank)``, and
``commSplit(color, key)``, which returns None for color -1).

The model
    Device memory is NumPy buffers. ``ndarray`` wraps a NumPy array; ``x.data.ptr`` is the
    real address of its memory, and every allocation is registered with its device, so a
    pointer that strays outside the buffers of the communicator's GPU is caught (``NcclError``).
    ``asarray`` of an object with ``__cuda_array_interface__`` makes a view of the same
    memory, never a copy.

    Ranks are threads of one process (addresses are valid in every thread). Communicators
    meet by unique id in a registry of the ``Emulation``; every wait is bounded by
    ``emu.timeout`` and raises ``NcclError`` instead of hanging.

    Work is run at enqueue time, in order per stream, in the thread that enqueues it; a
    collective blocks (bounded) until every rank of the communicator has issued it, then the
    result is computed with NumPy from the raw pointers. ``emu.stall(stream)`` holds back
    everything enqueued on a stream afterwards (events recorded there stay not done, streams
    that wait for those events wait too) until ``emu.release(stream)``, which runs the held
    work in the releasing thread. Work held on a stalled stream of an aborted communicator is
    dropped when it runs, as aborted kernels exit. An error of held work becomes the
    communicator's asynchronous error (``check_async_error``).

    Sends and receives issued between ``groupStart()`` and ``groupEnd()`` run together at
    ``groupEnd`` (sends are posted first, so a grouped exchange cannot deadlock); outside a
    group a send waits for the peer's matching receive and the other way round. Messages
    between two ranks match in order and must have the same size.

    Arguments are checked as NCCL would (datatype, op, counts, root and peer in range, buffers
    inside device memory of the communicator's GPU, known streams) and nonsense raises
    ``NcclError``; ranks that issue different collectives (name, count, datatype, op, root)
    at the same position get ``NcclError`` too, where real NCCL would hang or corrupt data.

Test hooks: ``emu.stall(stream)``, ``emu.release(stream)``, ``emu.release_all()``,
``emu.inject_async_error(nccl_comm, detail)``, ``emu.pending(stream)``, ``emu.calls`` (a Counter
of calls by name), ``emu.history`` (every NCCL operation issued: communicator, name,
arguments), ``emu.errors`` (errors of held work that no communicator owned).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import operator
import os
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

try:
    import ml_dtypes
except ImportError:  # bfloat16 is then not emulated
    ml_dtypes = None

__all__ = ["Emulation", "NcclError", "CUDARuntimeError"]

UNIQUE_ID_BYTES = 128
NCCL_VERSION = 23203

# ncclResult_t
SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, \
    REMOTE_ERROR = range(7)
_RESULT_NAMES = {
    0: "NCCL_ERROR_SUCCESS", 1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR",
    3: "NCCL_ERROR_INTERNAL_ERROR", 4: "NCCL_ERROR_INVALID_ARGUMENT",
    5: "NCCL_ERROR_INVALID_USAGE", 6: "NCCL_ERROR_REMOTE_ERROR",
}

# ncclDataType_t and ncclRedOp_t, values from nccl.h
NCCL_CONSTANTS = {
    "NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4,
    "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8,
    "NCCL_BFLOAT16": 9,
    "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4,
}
_DTYPES: Dict[int, Any] = {0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32),
                           3: np.dtype(np.uint32), 4: np.dtype(np.int64), 5: np.dtype(np.uint64),
                           6: np.dtype(np.float16), 7: np.dtype(np.float32),
                           8: np.dtype(np.float64)}
if ml_dtypes is not None:
    _DTYPES[9] = np.dtype(ml_dtypes.bfloat16)
_OP_NAMES = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}

_DLPACK_CUDA = 2
MEMCPY_HOST_TO_HOST, MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_DEVICE_TO_DEVICE, \
    MEMCPY_DEFAULT = range(5)


class NcclError(RuntimeError):
    """Raised as ``cupy.cuda.nccl.NcclError`` is: ``status`` is the ncclResult_t."""

    def __init__(self, status: int, detail: str = ""):
        self.status = status
        super().__init__(f"{_RESULT_NAMES.get(status, status)}: {detail}")

    def __reduce__(self):
        return (type(self), (self.status, str(self)))


class CUDARuntimeError(RuntimeError):
    """Stands for ``cupy.cuda.runtime.CUDARuntimeError``."""


def _index(value: Any, what: str) -> int:
    """An int argument as Cython converts it (TypeError for None, floats, objects)."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: an integer is required, got {type(value).__name__}") from None


def _size_t(value: Any, what: str) -> int:
    value = _index(value, what)
    if value < 0:
        raise OverflowError(f"{what}: can't convert negative value to size_t")
    return value


def _shape(shape: Any) -> Tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(int(d) for d in shape)


def _read(ptr: int, nbytes: int, dtype) -> np.ndarray:
    """A copy of ``nbytes`` at ``ptr`` as a flat array of ``dtype``."""
    if nbytes == 0:
        return np.empty(0, dtype=dtype)
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    return np.frombuffer(raw, dtype=np.uint8).copy().view(dtype)


def _write(ptr: int, data: np.ndarray) -> None:
    if data.nbytes:
        data = np.ascontiguousarray(data)
        ctypes.memmove(ptr, data.ctypes.data, data.nbytes)


def _reduce(arrays: List[np.ndarray], op: int, dtype) -> np.ndarray:
    """NCCL's reduction of same-length flat arrays (avg: floats divide, integers truncate)."""
    stacked = np.stack(arrays)
    n = len(arrays)
    half = dtype.itemsize == 2 and dtype.kind not in "iu"  # float16, bfloat16
    work = stacked.astype(np.float32) if half else stacked
    if op in (0, 4):
        result = np.add.reduce(work, axis=0, dtype=work.dtype)
        if op == 4:
            if dtype.kind in "iu":
                if dtype.kind == "u":
                    result = result // n
                else:
                    result = np.where(result < 0, -((-result) // n), result // n)
            else:
                result = result / n
    elif op == 1:
        result = np.multiply.reduce(work, axis=0, dtype=work.dtype)
    elif op == 2:
        result = np.maximum.reduce(work, axis=0)
    else:
        result = np.minimum.reduce(work, axis=0)
    return np.asarray(result).astype(dtype)


class _Flags:
    def __init__(self, host: np.ndarray, owndata: bool):
        self.c_contiguous = bool(host.flags.c_contiguous)
        self.f_contiguous = bool(host.flags.f_contiguous)
        self.owndata = owndata

    def __repr__(self) -> str:
        return (f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}\n"
                f"  OWNDATA : {self.owndata}")


class _MemoryPointer:
    def __init__(self, ptr: int, device_id: int):
        self.ptr = ptr
        self.device_id = device_id

    def __int__(self) -> int:
        return self.ptr


class _Capsule:
    """What ``ndarray.__dlpack__`` returns; only this emulation's ``from_dlpack`` opens it."""

    def __init__(self, array: "ndarray"):
        self.array = array


class _StreamState:
    """Work queued on one stream: ("call" or "event", fn, on_error) or ("wait", ready, None)."""

    def __init__(self, name: str, device: int):
        self.name = name
        self.device = device
        self.queue: collections.deque = collections.deque()
        self.stalled = False
        self.running = False


class _Round:
    """One collective (or split) of a clique: what each rank passed, then the outcome."""

    def __init__(self):
        self.parts: Dict[int, Tuple[str, dict]] = {}
        self.done = False
        self.results: Dict[int, Any] = {}
        self.error: Optional[NcclError] = None
        self.finished = 0


class _Message:
    def __init__(self, ptr: int, nbytes: int, src: int, dst: int):
        self.ptr, self.nbytes, self.src, self.dst = ptr, nbytes, src, dst
        self.consumed = False
        self.error: Optional[str] = None


class _Clique:
    """Every rank of one NCCL communicator."""

    def __init__(self, uid: bytes, size: int):
        self.uid, self.size = uid, size
        self.members: Dict[int, Any] = {}
        self.devices: Dict[int, int] = {}
        self.rounds: Dict[Any, _Round] = {}
        self.channels: Dict[Tuple[int, int], collections.deque] = \
            collections.defaultdict(collections.deque)
        self.aborted: Optional[str] = None


# ---------------------------------------------------------------------- the array type
class ndarray:  # noqa: N801 (CuPy's name)
    """A device array: a NumPy view of memory registered with an emulated device."""

    _emu: "Emulation"
    __array_priority__ = 100

    def __init__(self, host: np.ndarray, device: int, owner: Any, owndata: bool = False):
        self._a = host
        self._device_id = device
        self._owner = owner  # keeps the allocation alive
        self._owndata = owndata

    # attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a, self._owndata))

    @property
    def data(self) -> _MemoryPointer:
        return _MemoryPointer(self._a.ctypes.data if self._a.nbytes else 0, self._device_id)

    @property
    def device(self):
        return self._emu.cupy.cuda.Device(self._device_id)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr,
                "data": (self.data.ptr, False),
                "strides": None if self._a.flags.c_contiguous else self.strides, "version": 3}

    def __dlpack__(self, stream=None, **kwargs) -> _Capsule:
        return _Capsule(self)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (_DLPACK_CUDA, self._device_id)

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    # views and copies
    def _like(self, host: np.ndarray) -> "ndarray":
        """``host`` as a device array: a view when it shares this array's memory, else a copy."""
        if np.may_share_memory(host, self._owner if isinstance(self._owner, np.ndarray)
                               else self._a):
            return type(self)(host, self._device_id, self._owner)
        return self._emu._from_host(host, self._device_id)

    def reshape(self, *shape) -> "ndarray":
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        return self._like(self._a.reshape(shape))

    def ravel(self) -> "ndarray":
        return self._like(self._a.ravel())

    def view(self, dtype=None) -> "ndarray":
        return self._like(self._a.view(dtype) if dtype is not None else self._a.view())

    def __getitem__(self, key) -> "ndarray":
        keys = key if isinstance(key, tuple) else (key,)
        if not any(k is Ellipsis for k in keys):
            keys = keys + (Ellipsis,)
        return self._like(self._a[keys])

    def __setitem__(self, key, value) -> None:
        if isinstance(value, ndarray):
            value = value._a
        elif isinstance(value, np.ndarray):
            raise TypeError("emulated CuPy: assign a device array or a scalar")
        self._a[key] = value

    def copy(self) -> "ndarray":
        return self._emu._from_host(self._a, self._device_id)

    def astype(self, dtype, *, copy=True) -> "ndarray":  # CuPy: (dtype, order, ..., copy)
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return self._emu._from_host(self._a.astype(dtype), self._device_id)

    def get(self, stream=None) -> np.ndarray:
        return self._a.copy()

    def fill(self, value) -> None:
        self._a.fill(value)

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"emulated_cuda.ndarray({self._a!r}, device={self._device_id})"

    # arithmetic (results are new device arrays)
    def _binary(self, other, fn) -> "ndarray":
        if isinstance(other, ndarray):
            other = other._a
        elif isinstance(other, np.ndarray):
            raise TypeError("emulated CuPy: mixing device and host arrays")
        return self._emu._from_host(np.asarray(fn(self._a, other)), self._device_id)

    def __add__(self, other):
        return self._binary(other, operator.add)

    def __radd__(self, other):
        return self._binary(other, lambda a, b: b + a)

    def __sub__(self, other):
        return self._binary(other, operator.sub)

    def __rsub__(self, other):
        return self._binary(other, lambda a, b: b - a)

    def __mul__(self, other):
        return self._binary(other, operator.mul)

    def __rmul__(self, other):
        return self._binary(other, lambda a, b: b * a)

    def __truediv__(self, other):
        return self._binary(other, operator.truediv)

    def __floordiv__(self, other):
        return self._binary(other, operator.floordiv)

    def __neg__(self):
        return self._emu._from_host(-self._a, self._device_id)


# ---------------------------------------------------------------------- CUDA objects
class Device:
    """``cupy.cuda.Device``: makes a device current for the calling thread."""

    _emu: "Emulation"

    def __init__(self, device: Optional[int] = None):
        emu = self._emu
        self.id = emu.current_device() if device is None else _index(device, "device")
        if not 0 <= self.id < emu.device_count:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id} "
                                   f"({emu.device_count} devices)")
        self._previous: List[int] = []

    def use(self) -> None:
        self._emu._local.device = self.id

    def synchronize(self) -> None:
        self._emu.synchronize_device(self.id)

    def __enter__(self) -> "Device":
        self._previous.append(self._emu.current_device())
        self.use()
        return self

    def __exit__(self, *exc) -> None:
        self._emu._local.device = self._previous.pop()

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class Stream:
    """``cupy.cuda.Stream``; ``ptr`` 0 is the null stream of the current device."""

    _emu: "Emulation"
    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        emu = self._emu
        if null:
            self.ptr, self.device_id = 0, None
        else:
            self.ptr = emu._handle()
            self.device_id = emu.current_device()
            with emu.lock:
                emu._streams[self.ptr] = _StreamState(f"stream {self.ptr:#x}", self.device_id)

    @property
    def done(self) -> bool:
        state = self._emu._state(self.ptr)
        with self._emu.lock:
            return not state.queue and not state.running

    def synchronize(self) -> None:
        self._emu.synchronize_stream(self.ptr)

    def record(self, event=None):
        event = self._emu.cupy.cuda.Event() if event is None else event
        self._emu.event_record(event.ptr, self.ptr)
        return event

    def wait_event(self, event) -> None:
        self._emu.stream_wait_event(self.ptr, event.ptr)

    def use(self) -> "Stream":
        stack = self._emu._stream_stack()
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    def __enter__(self) -> "Stream":
        self._emu._stream_stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._emu._stream_stack().pop()

    def __repr__(self) -> str:
        return f"<emulated Stream {self.ptr:#x}>"


class Event:
    """``cupy.cuda.Event``: ``done`` once the work before its last record has run."""

    _emu: "Emulation"

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        emu = self._emu
        self.ptr = emu._handle()
        self.device_id = emu.current_device()
        self._recorded = 0
        self._completed = 0
        with emu.lock:
            emu._events[self.ptr] = self

    @property
    def done(self) -> bool:
        with self._emu.lock:
            return self._completed >= self._recorded

    def record(self, stream=None) -> None:
        emu = self._emu
        ptr = emu.get_current_stream().ptr if stream is None else stream.ptr
        emu.event_record(self.ptr, ptr)

    def synchronize(self) -> None:
        emu = self._emu
        with emu.cond:
            if not emu.cond.wait_for(lambda: self._completed >= self._recorded, emu.timeout):
                raise CUDARuntimeError(f"emulated: event {self.ptr:#x} not done within "
                                       f"{emu.timeout:g} s (is its stream stalled?)")


# ---------------------------------------------------------------------- NCCL communicator
class NcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator`` (CuPy 14 signatures)."""

    _emu: "Emulation"

    def __init__(self, ndev: int, commId: bytes, rank: int):
        emu = self._emu
        if not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(commId).__name__})")
        ndev, rank = _index(ndev, "ndev"), _index(rank, "rank")
        emu.calls["NcclCommunicator"] += 1
        if len(commId) != UNIQUE_ID_BYTES:
            raise NcclError(INVALID_ARGUMENT, f"unique id of {len(commId)} bytes, expected "
                                              f"{UNIQUE_ID_BYTES}")
        if ndev < 1 or not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT, f"rank {rank} is out of range for ndev={ndev}")
        device = emu.current_device()
        with emu.cond:
            if commId not in emu._issued_ids:
                raise NcclError(INVALID_ARGUMENT, f"rank {rank}: the unique id was not made by "
                                                  f"get_unique_id() (mangled on its way?)")
            clique = emu._cliques.get(commId)
            if clique is None:
                clique = emu._cliques[commId] = _Clique(commId, ndev)
            if clique.size != ndev:
                raise NcclError(INVALID_ARGUMENT, f"rank {rank} passed ndev={ndev}, but another "
                                                  f"rank passed ndev={clique.size} with this id")
            if rank in clique.members:
                raise NcclError(INVALID_ARGUMENT, f"rank {rank} joined this unique id twice")
            for other, other_device in clique.devices.items():
                if other_device == device:
                    raise NcclError(INVALID_USAGE, f"Duplicate GPU detected: rank {rank} and "
                                                   f"rank {other} both on CUDA device {device}")
            self._setup(clique, rank, device)
            emu.cond.notify_all()
            if not emu.cond.wait_for(lambda: len(clique.members) == ndev, emu.timeout):
                missing = sorted(set(range(ndev)) - set(clique.members))
                raise NcclError(SYSTEM_ERROR, f"ncclCommInitRank: ranks {missing} did not join "
                                              f"within {emu.timeout:g} s (did every rank pass "
                                              f"the same unique id?)")

    def _setup(self, clique: _Clique, rank: int, device: int) -> None:
        self._clique, self._rank, self._device = clique, rank, device
        self._ncoll = 0
        self._nsplit = 0
        self._status = "ok"  # "aborted", "destroyed"
        self._async_error: Optional[NcclError] = None
        clique.members[rank] = self
        clique.devices[rank] = device

    # -------------------------------------------------------------- checks
    def _usable(self) -> None:
        if self._status != "ok":
            raise NcclError(INVALID_ARGUMENT, f"the communicator was {self._status} (NULL comm)")

    def _dtype(self, datatype: Any):
        datatype = _index(datatype, "datatype")
        if datatype not in _DTYPES:
            raise NcclError(INVALID_ARGUMENT, f"invalid datatype {datatype}")
        return datatype, _DTYPES[datatype]

    def _op(self, op: Any) -> int:
        op = _index(op, "op")
        if op not in _OP_NAMES:
            raise NcclError(INVALID_ARGUMENT, f"invalid reduction op {op}")
        return op

    def _rank_arg(self, value: Any, what: str) -> int:
        value = _index(value, what)
        if not 0 <= value < self._clique.size:
            raise NcclError(INVALID_ARGUMENT, f"{what} {value} is out of range for "
                                              f"{self._clique.size} ranks")
        return value

    def _buffer(self, ptr: Any, nbytes: int, what: str) -> int:
        ptr = _index(ptr, what)
        if nbytes:
            self._emu._check_range(ptr, nbytes, self._device, what, NcclError)
        return ptr

    def _stream(self, stream: Any) -> _StreamState:
        stream = _index(stream, "stream")
        try:
            state = self._emu._state(stream, self._device)
        except CUDARuntimeError as exc:
            raise NcclError(UNHANDLED_CUDA_ERROR, str(exc)) from None
        if state.device != self._device:
            raise NcclError(UNHANDLED_CUDA_ERROR, f"{state.name} belongs to GPU {state.device}, "
                                                  f"the communicator to GPU {self._device}")
        return state

    # -------------------------------------------------------------- collectives
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        op, count = self._op(op), _size_t(count, "count")
        nbytes = count * dtype.itemsize
        self._collective("allReduce", self._stream(stream), datatype=datatype, count=count,
                         op=op, root=-1, send=self._buffer(sendbuf, nbytes, "sendbuff"),
                         recv=self._buffer(recvbuf, nbytes, "recvbuff"))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        op, count = self._op(op), _size_t(count, "count")
        root = self._rank_arg(root, "root")
        nbytes = count * dtype.itemsize
        send = self._buffer(sendbuf, nbytes, "sendbuff")
        recv = self._buffer(recvbuf, nbytes, "recvbuff") if self._rank == root \
            else _index(recvbuf, "recvbuff")
        self._collective("reduce", self._stream(stream), datatype=datatype, count=count, op=op,
                         root=root, send=send, recv=recv)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        count = _size_t(count, "count")
        root = self._rank_arg(root, "root")
        nbytes = count * dtype.itemsize
        send = self._buffer(sendbuff, nbytes, "sendbuff") if self._rank == root \
            else _index(sendbuff, "sendbuff")
        self._collective("broadcast", self._stream(stream), datatype=datatype, count=count,
                         op=-1, root=root, send=send,
                         recv=self._buffer(recvbuff, nbytes, "recvbuff"))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        count = _size_t(count, "count")
        nbytes = count * dtype.itemsize
        self._collective("allGather", self._stream(stream), datatype=datatype, count=count,
                         op=-1, root=-1, send=self._buffer(sendbuf, nbytes, "sendbuff"),
                         recv=self._buffer(recvbuf, nbytes * self._clique.size, "recvbuff"))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        op, count = self._op(op), _size_t(recvcount, "recvcount")
        nbytes = count * dtype.itemsize
        self._collective("reduceScatter", self._stream(stream), datatype=datatype, count=count,
                         op=op, root=-1,
                         send=self._buffer(sendbuf, nbytes * self._clique.size, "sendbuff"),
                         recv=self._buffer(recvbuf, nbytes, "recvbuff"))

    def _collective(self, name: str, state: _StreamState, **args) -> None:
        emu = self._emu
        if emu._group_depth() > 0:
            raise NcclError(INVALID_USAGE, f"emulation: {name} inside groupStart()/groupEnd() "
                                           f"is not emulated")
        number = self._ncoll
        self._ncoll += 1
        emu.calls[name] += 1
        emu.history.append((self, name, dict(args)))
        emu._submit(state, lambda: self._run_collective(number, name, args),
                    on_error=self._set_async_error)

    def _run_collective(self, number: int, name: str, args: dict) -> None:
        emu, clique = self._emu, self._clique
        with emu.cond:
            if self._status != "ok":
                return  # aborted: the kernel exits
            rnd = clique.rounds.setdefault(number, _Round())
            rnd.parts[self._rank] = (name, args)
            if len(rnd.parts) == clique.size:
                try:
                    rnd.results = _compute(number, rnd.parts, clique.size)
                except NcclError as exc:
                    rnd.error = exc
                rnd.done = True
                emu.cond.notify_all()
            emu.cond.wait_for(lambda: rnd.done or clique.aborted is not None
                              or self._status != "ok", emu.timeout)
            if not rnd.done:
                if self._status != "ok":
                    return
                if clique.aborted is not None:
                    raise NcclError(REMOTE_ERROR, f"{name} #{number} on rank {self._rank}: "
                                                  f"{clique.aborted}")
                missing = sorted(set(range(clique.size)) - set(rnd.parts))
                raise NcclError(SYSTEM_ERROR, f"emulated {name} #{number} on rank {self._rank}: "
                                              f"ranks {missing} did not issue it within "
                                              f"{emu.timeout:g} s")
            if rnd.error is not None:
                raise NcclError(rnd.error.status, f"rank {self._rank}: {rnd.error}")
            writes = rnd.results.get(self._rank, [])
            rnd.finished += 1
            if rnd.finished == clique.size:
                del clique.rounds[number]
        for ptr, data in writes:
            _write(ptr, data)

    # -------------------------------------------------------------- point to point
    def send(self, sendbuf, count, datatype, peer, stream) -> None:
        self._p2p("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf, count, datatype, peer, stream) -> None:
        self._p2p("recv", recvbuf, count, datatype, peer, stream)

    def _p2p(self, kind: str, buf, count, datatype, peer, stream) -> None:
        emu = self._emu
        try:
            self._usable()
            datatype, dtype = self._dtype(datatype)
            count = _size_t(count, "count")
            peer = self._rank_arg(peer, "peer")
            nbytes = count * dtype.itemsize
            ptr = self._buffer(buf, nbytes, "sendbuff" if kind == "send" else "recvbuff")
            state = self._stream(stream)
        except Exception:
            if emu._group_depth() > 0:
                emu._local.group_failed = True
            raise
        emu.calls[kind] += 1
        emu.history.append((self, kind, {"ptr": ptr, "nbytes": nbytes, "peer": peer,
                                         "datatype": datatype, "count": count}))
        op = (kind, ptr, nbytes, peer)
        if emu._group_depth() > 0:
            emu._local.group.append((self, state, op))
        else:
            emu._submit(state, lambda: self._run_p2p([op]), on_error=self._set_async_error)

    def _run_p2p(self, ops: List[tuple]) -> None:
        emu, clique, me = self._emu, self._clique, self._rank
        with emu.cond:
            if self._status != "ok":
                return
            posted = []
            for kind, ptr, nbytes, peer in ops:
                if kind == "send":
                    message = _Message(ptr, nbytes, me, peer)
                    clique.channels[(me, peer)].append(message)
                    posted.append(message)
            emu.cond.notify_all()
            for kind, ptr, nbytes, peer in ops:
                if kind != "recv":
                    continue
                channel = clique.channels[(peer, me)]
                self._wait(lambda: bool(channel), f"recv from rank {peer}")
                if self._status != "ok":
                    return
                message = channel.popleft()
                if message.nbytes != nbytes:
                    message.error = (f"rank {peer} sent {message.nbytes} bytes, rank {me} "
                                     f"receives {nbytes}")
                    emu.cond.notify_all()
                    raise NcclError(INVALID_USAGE, message.error)
                if nbytes:
                    ctypes.memmove(ptr, message.ptr, nbytes)
                message.consumed = True
                emu.cond.notify_all()
            for message in posted:
                self._wait(lambda: message.consumed or message.error is not None,
                           f"send to rank {message.dst}")
                if self._status != "ok":
                    return
                if message.error is not None:
                    raise NcclError(INVALID_USAGE, message.error)

    def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait (emulation lock held) for ``predicate``, an abort, or the timeout."""
        emu, clique = self._emu, self._clique
        emu.cond.wait_for(lambda: predicate() or clique.aborted is not None
                          or self._status != "ok", emu.timeout)
        if predicate() or self._status != "ok":
            return
        if clique.aborted is not None:
            raise NcclError(REMOTE_ERROR, f"{what} on rank {self._rank}: {clique.aborted}")
        raise NcclError(SYSTEM_ERROR, f"emulated {what} on rank {self._rank}: no match within "
                                      f"{emu.timeout:g} s")

    # -------------------------------------------------------------- split and lifetime
    def commSplit(self, color, key):
        emu, clique = self._emu, self._clique
        self._usable()
        color, key = _index(color, "color"), _index(key, "key")
        if color < -1:
            raise NcclError(INVALID_ARGUMENT, f"color {color} (use >= 0, or -1 for no color)")
        emu.calls["commSplit"] += 1
        number = ("split", self._nsplit)
        self._nsplit += 1
        with emu.cond:
            rnd = clique.rounds.setdefault(number, _Round())
            rnd.parts[self._rank] = ("commSplit", {"color": color, "key": key})
            if len(rnd.parts) == clique.size:
                groups: Dict[int, list] = collections.defaultdict(list)
                for r, (_, part) in rnd.parts.items():
                    if part["color"] != -1:
                        groups[part["color"]].append((part["key"], r))
                for members in groups.values():
                    members.sort()
                    uid = os.urandom(UNIQUE_ID_BYTES)
                    emu._issued_ids.add(uid)
                    new = _Clique(uid, len(members))
                    for new_rank, (_, r) in enumerate(members):
                        rnd.results[r] = (new, new_rank)
                rnd.done = True
                emu.cond.notify_all()
            self._wait(lambda: rnd.done, f"commSplit #{number[1]}")
            if not rnd.done:
                raise NcclError(INVALID_ARGUMENT, "the communicator was aborted during commSplit")
            result = rnd.results.get(self._rank)
            rnd.finished += 1
            if rnd.finished == clique.size:
                del clique.rounds[number]
            if result is None:
                return None
            new_clique, new_rank = result
            comm = type(self).__new__(type(self))
            comm._setup(new_clique, new_rank, self._device)
            return comm

    def abort(self) -> None:
        emu = self._emu
        emu.calls["abort"] += 1
        with emu.cond:
            if self._status != "ok":
                return
            self._status = "aborted"
            self._clique.aborted = f"rank {self._rank} aborted the communicator"
            emu.cond.notify_all()

    def destroy(self) -> None:
        emu = self._emu
        emu.calls["destroy"] += 1
        with emu.cond:
            if self._status == "ok":
                self._status = "destroyed"
                emu.cond.notify_all()

    def check_async_error(self) -> None:
        self._usable()
        error = self._async_error
        if error is not None:
            raise error

    def _set_async_error(self, exc: BaseException) -> None:
        if self._async_error is None:
            self._async_error = exc if isinstance(exc, NcclError) else \
                NcclError(INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")

    def rank_id(self) -> int:
        self._usable()
        return self._rank

    def size(self) -> int:
        self._usable()
        return self._clique.size

    def device_id(self) -> int:
        self._usable()
        return self._device


def _compute(number: int, parts: Dict[int, Tuple[str, dict]], size: int) -> Dict[int, list]:
    """Each rank's writes ``[(ptr, data)]`` for collective #``number`` (all ranks arrived)."""
    signatures = {r: (name, args["count"], args["datatype"], args["op"], args["root"])
                  for r, (name, args) in parts.items()}
    if len(set(signatures.values())) > 1:
        described = "; ".join(f"rank {r}: {s[0]}(count={s[1]}, datatype={s[2]}, op={s[3]}, "
                              f"root={s[4]})" for r, s in sorted(signatures.items()))
        raise NcclError(INVALID_USAGE, f"ranks issued different collectives as #{number}: "
                                       f"{described}")
    name, count, datatype, op, root = signatures[0]
    dtype = _DTYPES[datatype]
    nbytes = count * dtype.itemsize
    args = {r: a for r, (_, a) in parts.items()}
    ranks = range(size)
    if name in ("allReduce", "reduce"):
        result = _reduce([_read(args[r]["send"], nbytes, dtype) for r in ranks], op, dtype)
        targets = ranks if name == "allReduce" else [root]
        return {r: [(args[r]["recv"], result)] for r in targets}
    if name == "broadcast":
        data = _read(args[root]["send"], nbytes, dtype)
        return {r: [(args[r]["recv"], data)] for r in ranks}
    if name == "allGather":
        data = np.concatenate([_read(args[r]["send"], nbytes, dtype) for r in ranks])
        return {r: [(args[r]["recv"], data)] for r in ranks}
    if name == "reduceScatter":
        result = _reduce([_read(args[r]["send"], nbytes * size, dtype) for r in ranks], op,
                         dtype)
        return {r: [(args[r]["recv"], result[r * count:(r + 1) * count])] for r in ranks}
    raise NcclError(INTERNAL_ERROR, f"unknown collective {name}")


# ---------------------------------------------------------------------- the emulation
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
        self.cupy, self.nccl = self._build_modules()

    # -------------------------------------------------------------- modules
    def _build_modules(self):
        emu = self
        bind = {"_emu": self}
        ndarray_t = type("ndarray", (ndarray,), bind)
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
        runtime.streamWaitEvent = lambda stream, event, flags=0: emu.stream_wait_event(stream,
                                                                                       event)
        runtime.memcpyAsync = emu.memcpy_async
        runtime.streamSynchronize = lambda stream: emu.synchronize_stream(stream)
        runtime.deviceSynchronize = lambda: emu.synchronize_device(emu.current_device())
        runtime.deviceGetAttribute = lambda attrib, device: emu.device_get_attribute(attrib,
                                                                                    device)

        nccl = types.ModuleType("cupy.cuda.nccl")
        for name, value in NCCL_CONSTANTS.items():
            setattr(nccl, name, value)
        nccl.available = True
        nccl.NcclError = NcclError
        nccl.NcclCommunicator = comm_t
        nccl.get_version = lambda: NCCL_VERSION
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
        stream_t.null = stream_t(null=True)

        cupy = types.ModuleType("cupy")
        cupy.__version__ = "14.0.0 (emulated)"
        cupy.cuda = cuda
        cupy.ndarray = ndarray_t
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
        return cupy, nccl

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
        return self._ndarray(host, device, raw, owndata=True)

    def _filled(self, shape, dtype, value) -> ndarray:
        array = self._alloc(shape, dtype)
        array._a[...] = value
        return array

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
                if kind != "wait":
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
        with self.lock:
            event._recorded += 1
            generation = event._recorded

        def complete() -> None:
            with self.cond:
                event._completed = max(event._completed, generation)
                self.cond.notify_all()

        self._submit(state, complete, kind="event")

    def stream_wait_event(self, stream_ptr: int, event_ptr: int) -> None:
        state, event = self._state(stream_ptr), self._event(event_ptr)
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
        self._submit(state, lambda: ctypes.memmove(dst, src, size) if size else None)

    def synchronize_stream(self, ptr: int) -> None:
        state = self._state(ptr)
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
            self._submit(state, lambda c=comm, o=batch_ops: c._run_p2p(o),
                         on_error=comm._set_async_error)

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

    def inject_async_error(self, comm: NcclCommunicator,
                           detail: str = "remote process exited or there was a network error"
                           ) -> None:
        """Make ``comm.check_async_error()`` raise, as after a failure NCCL noticed later."""
        comm._async_error = NcclError(REMOTE_ERROR, detail)

    def pending(self, stream: Any, device: Optional[int] = None) -> int:
        """How many items ``stream`` holds back."""
        state = self._state(getattr(stream, "ptr", stream), device)
        with self.lock:
            return len(state.queue)


def _cuda_error(status: int, detail: str) -> CUDARuntimeError:
    return CUDARuntimeError(f"cudaErrorInvalidValue: {detail}")
