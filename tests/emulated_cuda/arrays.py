"""The device array (``cupy.ndarray``): a NumPy view of memory registered with an emulated GPU."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Tuple

import numpy as np

from .basics import _DLPACK_CUDA

if TYPE_CHECKING:
    from .emulation import Emulation


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
    _c_contiguous = property(lambda self: self._a.flags.c_contiguous)  # CuPy's own flag

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
        self._emu._in_place(lambda: self._a.__setitem__(key, value))

    def copy(self) -> "ndarray":
        return self._emu._from_host(self._a, self._device_id)

    def astype(self, dtype, *, copy=True) -> "ndarray":  # CuPy: (dtype, order, ..., copy)
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return self._emu._from_host(self._a.astype(dtype), self._device_id)

    def _copy_stream(self, stream: Any):
        """The stream a host copy runs on, as CuPy picks it: ``stream`` (a CuPy stream), else
        the calling thread's current stream (the null stream: this array's GPU's)."""
        emu = self._emu
        ptr = (emu.get_current_stream() if stream is None else stream).ptr
        return emu._state(ptr, self._device_id)

    def set(self, arr, stream=None) -> None:
        """Copy host data in (CuPy's ``ndarray.set``), with CuPy's checks: a NumPy array only
        (TypeError), the same dtype (TypeError) and shape (ValueError), a contiguous target;
        enqueued on ``stream`` (else the current stream) after the work already there."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self._a.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self._a.dtype} array")
        if arr.shape != self._a.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self._a.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        data = arr.copy()  # CuPy stages pageable host memory before set() returns
        state = self._copy_stream(stream)
        self._emu.refuse_in_capture(state)  # as asarray of host data
        self._emu.host_copies.append(("set", state))
        self._emu._submit(state, lambda: np.copyto(self._a, data))

    def get(self, stream=None) -> np.ndarray:
        """A host copy (CuPy's ``ndarray.get``), made on ``stream`` (else the current stream)
        after the work already there; returns once the copy is done. On a capturing stream,
        CuPy's wait for the copy is refused, and the capture invalidated, as CUDA does."""
        state = self._copy_stream(stream)
        self._emu.refuse_in_capture(state)
        out = np.empty_like(self._a)
        self._emu.host_copies.append(("get", state))
        self._emu._submit(state, lambda: np.copyto(out, self._a))
        self._emu.wait_drained(state)
        return out

    def fill(self, value) -> None:
        self._emu._in_place(lambda: self._a.fill(value))

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

    # in place, as CuPy's are (``total += grad`` must not rebind ``total`` to a new array)
    def _inplace(self, other, fn) -> "ndarray":
        if isinstance(other, ndarray):
            other = other._a
        elif isinstance(other, np.ndarray):
            raise TypeError("emulated CuPy: mixing device and host arrays")
        self._emu._in_place(lambda: fn(self._a, other, out=self._a, casting="same_kind"))
        return self

    def __iadd__(self, other):
        return self._inplace(other, np.add)

    def __isub__(self, other):
        return self._inplace(other, np.subtract)

    def __imul__(self, other):
        return self._inplace(other, np.multiply)

    def __itruediv__(self, other):
        return self._inplace(other, np.true_divide)

    # a one-element array converts to a Python number (CuPy copies it to the host)
    def _item(self):
        if self._a.size != 1:
            raise TypeError("only arrays of one element convert to Python scalars")
        self._emu.refuse_in_capture(self._copy_stream(None))  # a host copy, as get()
        return self._a.reshape(()).item()

    def __int__(self) -> int:
        return int(self._item())

    def __float__(self) -> float:
        return float(self._item())

    def __bool__(self) -> bool:
        if self._a.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous")
        return bool(self._item())
