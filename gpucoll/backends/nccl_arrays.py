"""How the NCCL backend takes a caller's GPU array and gives results back, and reads streams.

CuPy arrays, DLPack objects on a CUDA device or in CUDA managed memory (a torch CUDA tensor,
for instance; tried first, as DLPack knows bfloat16) and anything exposing
``__cuda_array_interface__`` are used in place, without a copy. Arrays gpucoll
allocates are handed back in the caller's array type when its module has ``from_dlpack``.
Host arrays are refused with a ``TypeError`` that says what to do instead.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["import_device_array", "export_like", "stream_pointer"]

_DLPACK_DEVICE_KINDS = (2, 13)  # kDLCUDA, kDLCUDAManaged: CuPy imports both
_DLPACK_HOST_KINDS = {1: "host memory", 3: "pinned host memory"}


def _has_cuda_array_interface(x: Any, name: str) -> bool:
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception as exc:  # e.g. a torch tensor that requires grad
        raise TypeError(f"{name} cannot be shared with NCCL: {exc}") from None


def _on_device(x: Any, name: str, device: int, rank: int) -> Any:
    if x.device.id != device:
        raise ValueError(f"{name} is on GPU {x.device.id}, but rank {rank}'s "
                         f"communicator uses GPU {device}")
    return x


def import_device_array(cupy: Any, x: Any, name: str, device: int, rank: int) -> Any:
    """``x`` as a CuPy array on GPU ``device``, sharing its memory (no copy).

    Returns ``x`` unchanged when it is not an array at all (the caller says so).

    Raises:
        TypeError: a host array, or an object that cannot be imported without a copy.
        ValueError: the array lives on another GPU.
    """
    if isinstance(x, cupy.ndarray):
        return _on_device(x, name, device, rank)
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} is a NumPy array (host memory); backend 'nccl' needs GPU "
                        f"arrays: pass cupy.asarray({name}), or use backend='cpu'")
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        # DLPack first: it carries dtypes the CUDA array interface cannot (torch exports
        # bfloat16 there as "<V2", which CuPy reads as void); CuPy maps it to ml_dtypes.
        kind, _ = x.__dlpack_device__()
        if int(kind) not in _DLPACK_DEVICE_KINDS:
            where = _DLPACK_HOST_KINDS.get(int(kind), f"DLPack device type {int(kind)}")
            raise TypeError(f"{name} lives in {where}; backend 'nccl' needs GPU arrays")
        try:
            imported = cupy.from_dlpack(x)
        except Exception as exc:
            if not _has_cuda_array_interface(x, name):
                raise TypeError(f"{name} ({type(x).__name__}) cannot be imported through DLPack "
                                f"without a copy: {exc}") from None
        else:
            return _on_device(imported, name, device, rank)
    if _has_cuda_array_interface(x, name):
        return _on_device(cupy.asarray(x), name, device, rank)
    return x  # not an array: the base class raises TypeError


def export_like(cupy: Any, result: Any, like: Any) -> Any:
    """``result`` (a CuPy array) in the array type of ``like``, through DLPack when its module
    has ``from_dlpack``."""
    if like is None or isinstance(like, cupy.ndarray):
        return result
    module = sys.modules.get(type(like).__module__.split(".")[0])
    from_dlpack = getattr(module, "from_dlpack", None)
    return from_dlpack(result) if from_dlpack is not None else result


def stream_pointer(cupy: Any, stream: Any) -> int:
    """The raw CUDA stream of ``stream=``: None (the current CuPy stream), a CuPy stream, an
    object with ``ptr`` / ``cuda_stream`` / ``__cuda_stream__``, or a pointer.

    Raises:
        TypeError: anything else.
    """
    if stream is None:
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    if hasattr(stream, "__index__") and not isinstance(stream, bool):  # NumPy integers
        return int(stream.__index__())
    for attr in ("ptr", "cuda_stream"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    raise TypeError(f"stream must be a CuPy stream, an object with cuda_stream or "
                    f"__cuda_stream__, or a stream pointer; got {type(stream).__name__}")
