"""Host staging for the CPU backend: NumPy arrays are used as they are; device arrays (anything
with ``__cuda_array_interface__``, e.g. CuPy) are copied to host memory and the result is copied
back into them, so several processes can share one GPU without NCCL.

Copies run on ``stream`` when one is given (a CuPy stream), else on CuPy's current stream; the
copy to the host is waited for before the collective reads it, and the copy back is waited
for before the operation counts as done.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Staged"]


def _cupy_stream(stream):
    """``stream`` as a CuPy stream (None: the current one)."""
    if stream is None:
        return None
    import cupy

    if isinstance(stream, cupy.cuda.Stream):
        return stream
    ptr = stream if isinstance(stream, int) else getattr(stream, "cuda_stream", None)
    if ptr is None and hasattr(stream, "ptr"):
        ptr = stream.ptr
    if ptr is None:
        raise TypeError(f"stream must be a CuPy stream, an object with cuda_stream, or a pointer; "
                        f"got {type(stream).__name__}")
    return cupy.cuda.ExternalStream(int(ptr))


class Staged:
    """Host view of a caller's array: NumPy arrays as they are, device arrays copied to host."""

    __slots__ = ("host", "device", "stream")

    def __init__(self, array, stream=None):
        self.stream = None
        if array is None:
            self.host, self.device = None, None
        elif isinstance(array, np.ndarray):
            self.host, self.device = array, None
        elif hasattr(array, "__cuda_array_interface__"):
            import cupy  # lazily: only when a device array is passed

            self.device = array
            self.stream = _cupy_stream(stream)
            self.host = cupy.asnumpy(array, stream=self.stream, blocking=True)
        else:
            self.host, self.device = np.asarray(array), None

    def write_back(self) -> None:
        if self.device is not None:
            self.device.set(self.host, stream=self.stream)
            if self.stream is not None:
                self.stream.synchronize()
            else:
                import cupy

                cupy.cuda.get_current_stream().synchronize()

    @property
    def caller(self):
        return self.device if self.device is not None else self.host

    @classmethod
    def empty(cls, shape, dtype, like: "Staged", stream=None) -> "Staged":
        """A new output buffer; on the device too when ``like`` came from the device."""
        staged = cls(np.empty(shape, dtype))
        if like is not None and like.device is not None:
            import cupy

            staged.device = cupy.empty(shape, dtype)
            staged.stream = like.stream
        return staged
