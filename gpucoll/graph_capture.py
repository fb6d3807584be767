"""CUDA graph capture, as the collectives see it.

Between ``stream.begin_capture()`` and ``end_capture()``, work issued on a capturing stream is
recorded into a graph, not run. A call that must see its result on the host now (a copy to
host memory it waits for, a size or an object it reads) cannot be recorded: CUDA refuses the
wait (cudaErrorStreamCaptureUnsupported) and invalidates the whole capture, after the part
already recorded consumed sequence numbers on this rank only. gpucoll asks first, with
:func:`stream_is_capturing`, and refuses such a call with :func:`refusal` before anything is
enqueued or sent: the capture stays valid and the communicator usable.

Nothing here imports CuPy: without it in use there is no capture to be in.
"""

from __future__ import annotations

import sys
from typing import Any

from . import cuda_env
from .errors import UnsupportedOperationError

__all__ = ["is_device_array", "stream_is_capturing", "device_array_in_capture", "refusal",
           "HOST_READS", "HOST_STAGING"]

_DLPACK_DEVICE_KINDS = (2, 13)  # kDLCUDA, kDLCUDAManaged

HOST_READS = ("it reads counts or objects on the host, which a capture cannot do (the graph "
              "runs nothing until launched), and pads through temporary arrays that a graph "
              "would go on using after they are freed; call it outside the capture, or "
              "capture all_gather / all_to_all on fixed-size buffers")
HOST_STAGING = ("this backend copies device arrays through host memory, which a capture "
                "cannot do (the graph runs nothing until launched); capture collectives on "
                "the nccl backend, or make the call outside the capture")


def is_device_array(array: Any) -> bool:
    """Whether ``array`` lives in GPU memory (CUDA array interface, or DLPack on a GPU)."""
    if cuda_env.is_cupy_array(array) or hasattr(array, "__cuda_array_interface__"):
        return True
    device = getattr(array, "__dlpack_device__", None)
    try:
        return device is not None and int(device()[0]) in _DLPACK_DEVICE_KINDS
    except Exception:
        return False


def _cupy_in_use() -> bool:
    return cuda_env._LOADED is not None or "cupy" in sys.modules


def stream_is_capturing(stream: Any = None) -> bool:
    """Whether ``stream`` (a CuPy stream; None: CuPy's current stream) is capturing a CUDA
    graph. False, without importing CuPy, while CuPy is not in use."""
    if not _cupy_in_use():
        return False
    cupy = cuda_env.cupy_module()
    ptr = (cupy.cuda.get_current_stream() if stream is None else stream).ptr
    return ptr != 0 and bool(cupy.cuda.runtime.streamIsCapturing(ptr))


def device_array_in_capture(array: Any, stream: Any = None) -> bool:
    """Whether ``array`` is a device array and ``stream`` (None: the current one) captures."""
    return array is not None and is_device_array(array) and stream_is_capturing(stream)


def refusal(backend: str, op: str, reason: str) -> UnsupportedOperationError:
    """The error for ``op``, which cannot be recorded into a graph, issued in a capture."""
    return UnsupportedOperationError(backend, f"{op} in a CUDA graph capture", reason)
