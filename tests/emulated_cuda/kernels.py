"""``cupy.RawModule`` for gpucoll's bucketing kernels (``kernels/bucket_*.cu``).

Nothing is compiled: ``get_function`` reads the kernel and its dtypes from the name expression
gpucoll asks for (``gpucoll_bucket_pack<float, gpucoll::bf16_t>``), and a launch is enqueued on
the current stream like any other work (recorded into the graph on a capturing stream, and run
again at each launch). When it runs, it reads its work table, the arrays and the bucket through
their device addresses, as the kernel does: memory freed since (an evicted work table the
graph still points at) is cudaErrorIllegalAddress, not stale data. The arithmetic is the
NumPy path of :mod:`gpucoll.kernels`, which the GPU kernels match bit for bit
(tests/test_kernels_nvrtc.py and the GPU tests hold them to it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from gpucoll import kernel_tables, kernels

if TYPE_CHECKING:
    from .emulation import Emulation

_DTYPES = {c_type: name for name, c_type in kernels._C_TYPES.items()}
_EXPRESSION = re.compile(r"^gpucoll_(bucket_pack|bucket_unpack)<(.+)>$")


def forget_earlier_gpus() -> None:
    """A new emulation is a new machine: gpucoll's caches of GPU objects (compiled kernels,
    work tables on the GPU, upload streams) from an earlier one must not be found there."""
    kernels._kernel.cache_clear()
    kernel_tables._TABLES.clear()
    kernel_tables._GRAPH_TABLES.clear()
    kernel_tables._UPLOAD_STREAMS.clear()


def _dtype(c_type: str) -> np.dtype:
    name = _DTYPES[c_type.strip()]
    return kernels.bfloat16 if name == "bfloat16" else np.dtype(name)


class RawModule:
    """``cupy.RawModule(code=, options=, name_expressions=)``: knows the bucketing kernels."""

    _emu: "Emulation"

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc",
                 translate_cucomplex=False, enable_cooperative_groups=False,
                 name_expressions=None, jitify=None):
        self.code, self.options = code, tuple(options)
        self._names = list(name_expressions or ())

    def get_function(self, name: str) -> "BucketKernel":
        match = _EXPRESSION.match(name)
        if name not in self._names or match is None:
            raise RuntimeError(f"emulated RawModule: no kernel {name!r} (name expressions: "
                               f"{self._names})")
        parts = match.group(2).split(",")
        if match.group(1) == "bucket_pack":
            return BucketKernel(self._emu, "pack", _dtype(parts[0]), _dtype(parts[1]), False)
        return BucketKernel(self._emu, "unpack", _dtype(parts[1]), _dtype(parts[0]),
                            parts[2].strip() == "true")


class BucketKernel:
    """One compiled variant: ``kernel(grid, block, args)`` with gpucoll's argument list
    (work table, arrays, tile, bucket, scale[, found_inf or a null pointer])."""

    def __init__(self, emu: "Emulation", kind: str, array_dtype: np.dtype,
                 bucket_dtype: np.dtype, check: bool):
        self._emu = emu
        self.kind, self.array_dtype, self.bucket_dtype, self.check = \
            kind, array_dtype, bucket_dtype, check

    def __call__(self, grid, block, args) -> None:
        emu = self._emu
        table, count, _tile, bucket, scale = args[:5]
        flag = args[5] if self.kind == "unpack" else None
        launch = (bucket._device_id, table.data.ptr, int(count), bucket.data.ptr, bucket.size,
                  float(scale), flag.data.ptr if self.check else 0)
        emu.kernel_launches += 1
        state = emu._state(emu.get_current_stream().ptr)
        run = lambda: self._run(*launch)  # noqa: E731
        if not emu._captured(state, lambda target: emu._submit(target, run)):
            emu._submit(state, run)

    def _run(self, device: int, table_ptr: int, count: int, bucket_ptr: int, length: int,
             scale: float, flag_ptr: int) -> None:
        emu = self._emu
        table = emu._view(table_ptr, 4 * count + 1, np.dtype(np.int64), device)
        pointers = table[:count].view(np.uint64)
        offsets, sizes = table[count:2 * count].tolist(), table[2 * count:3 * count].tolist()
        bucket = emu._view(bucket_ptr, length, self.bucket_dtype, device)
        arrays = [emu._view(int(ptr), size, self.array_dtype, device)
                  for ptr, size in zip(pointers, sizes)]
        compute = kernels._compute_dtype(self.array_dtype.name, self.bucket_dtype.name)
        with np.errstate(over="ignore", invalid="ignore"):
            if self.kind == "pack":
                kernels._pack_numpy(arrays, bucket, offsets, sizes, scale, compute,
                                    self.bucket_dtype == self.array_dtype)
            elif kernels._unpack_numpy(bucket, arrays, offsets, sizes, scale, compute,
                                       self.check):
                emu._view(flag_ptr, 1, np.dtype(np.int32), device)[0] = 1
