"""Host staging for the CPU backend: NumPy arrays are used as they are; device arrays (anything
with ``__cuda_array_interface__``, e.g. CuPy) are copied to host memory and the result is copied
back into them, so several processes can share one GPU without NCCL."""

from __future__ import annotations

import numpy as np

__all__ = ["Staged"]


class Staged:
    """Host view of a caller's array: NumPy arrays as they are, device arrays copied to host."""

    __slots__ = ("host", "device")

    def __init__(self, array):
        if array is None:
            self.host, self.device = None, None
        elif isinstance(array, np.ndarray):
            self.host, self.device = array, None
        elif hasattr(array, "__cuda_array_interface__"):
            import cupy  # lazily: only when a device array is passed

            self.device = array
            self.host = cupy.asnumpy(array)
        else:
            self.host, self.device = np.asarray(array), None

    def write_back(self) -> None:
        if self.device is not None:
            self.device.set(self.host)

    @property
    def caller(self):
        return self.device if self.device is not None else self.host

    @classmethod
    def empty(cls, shape, dtype, like: "Staged") -> "Staged":
        """A new output buffer; on the device too when ``like`` came from the device."""
        staged = cls(np.empty(shape, dtype))
        if like is not None and like.device is not None:
            import cupy

            staged.device = cupy.empty(shape, dtype)
        return staged
