"""Host staging for the CPU backend: NumPy arrays are used as they are; device arrays (CuPy,
torch CUDA tensors, anything with ``__cuda_array_interface__`` or DLPack on a GPU) are copied
to host memory and the result is copied back into them, so several processes can share one
GPU without NCCL.

Copies run on ``stream`` when one is given (a CuPy stream), else on the stream that is current
for the array's GPU in the calling thread when the operation is issued (CuPy keeps one current
stream per thread and GPU: the copy back of an ``async_op`` runs on a worker thread, where
another stream is current); the copy to the host is waited for before the collective reads
it, and the copy back is waited for before the operation counts as done.
"""

from __future__ import annotations

import numpy as np

from .. import cuda_env
from ..cuda_env import as_cupy_stream
from ..graph_capture import HOST_STAGING, is_device_array, refusal, stream_is_capturing

__all__ = ["Staged", "as_cupy_stream", "is_device_array", "refuse_capture"]


def refuse_capture(stream, backend: str) -> None:
    """Raise before a device array is copied to the host on ``stream`` (a CuPy stream) while
    it captures a CUDA graph: CUDA would refuse the wait and invalidate the capture."""
    if stream_is_capturing(stream):
        raise refusal(backend, "a CUDA array", HOST_STAGING)


def _device_view(cupy, array):
    """A CuPy array over the caller's device memory (no copy): DLPack first (it knows
    bfloat16), else the CUDA array interface. A torch tensor has no ``set``; its view does."""
    if isinstance(array, cupy.ndarray):
        return array
    if hasattr(array, "__dlpack__") and is_device_array(array):
        try:
            return cupy.from_dlpack(array)
        except Exception:
            if not hasattr(array, "__cuda_array_interface__"):
                raise
    return cupy.asarray(array)


class Staged:
    """Host view of a caller's array: NumPy arrays as they are, device arrays copied to host."""

    __slots__ = ("host", "device", "view", "stream")

    def __init__(self, array, stream=None, backend: str = "cpu"):
        self.stream = None
        self.view = None
        if array is None:
            self.host, self.device = None, None
        elif isinstance(array, np.ndarray):
            self.host, self.device = array, None
        elif is_device_array(array):
            cupy = cuda_env.cupy_module()  # lazily: only when a device array is passed
            self.device = array
            self.view = _device_view(cupy, array)
            self.stream = as_cupy_stream(cupy, stream)
            if self.stream is None:  # the caller's, now: write_back may run on another thread
                with self.view.device:
                    self.stream = cupy.cuda.get_current_stream()
            refuse_capture(self.stream, backend)
            self.host = self.view.get(stream=self.stream)  # blocking: the copy is done
        else:
            self.host, self.device = np.asarray(array), None

    def write_back(self) -> None:
        if self.device is not None:
            self.view.set(self.host, stream=self.stream)
            self.stream.synchronize()

    @property
    def caller(self):
        return self.device if self.device is not None else self.host

    @classmethod
    def empty(cls, shape, dtype, like: "Staged", stream=None) -> "Staged":
        """A new output buffer; on the device too when ``like`` came from the device."""
        staged = cls(np.empty(shape, dtype))
        if like is not None and like.device is not None:
            cupy = cuda_env.cupy_module()
            with like.view.device:  # beside ``like``, whichever GPU is current
                staged.device = staged.view = cupy.empty(shape, dtype)
            staged.stream = like.stream
        return staged
