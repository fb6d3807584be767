"""Where ``gpucoll bench`` keeps its buffers: NumPy on the host, CuPy on the rank's GPU.

CuPy is imported only when a communicator's backend is ``nccl``.
"""

from __future__ import annotations

import numpy as np


class _Host:
    """NumPy buffers: the CPU backend (and Gloo's tensors)."""

    kind = "host"

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def put(self, dst, host: np.ndarray) -> None:
        np.copyto(dst, host.reshape(dst.shape))

    def get(self, src) -> np.ndarray:
        return src

    def sync(self) -> None:
        pass


class _Cuda:
    """CuPy buffers on this rank's current device (imported only for the nccl backend)."""

    kind = "cuda"

    def __init__(self):
        import cupy  # noqa: WPS433 (lazy: only GPU runs need it)

        self.cupy = cupy

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

    def put(self, dst, host: np.ndarray) -> None:
        dst.set(np.ascontiguousarray(host.reshape(dst.shape)))

    def get(self, src) -> np.ndarray:
        return self.cupy.asnumpy(src)

    def sync(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()


def _device_for(comm):
    return _Cuda() if comm.memory == "cuda" else _Host()
