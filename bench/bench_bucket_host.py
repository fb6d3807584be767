"""The host side of ``kernels.pack`` / ``unpack`` on the GPU path, without a GPU.

On an H100, packing 1,000 float32 arrays (64 MiB) took 3.8 ms between CUDA events while one
64 MiB copy took 0.06 ms: the GPU waited for the host. This times what the host does before the
launch, on real CuPy arrays whose memory is host memory wrapped as device memory
(``cupy.cuda.UnownedMemory``), so it runs anywhere CuPy imports: the checks (``_validate``; of
a list not seen before, and of the same list again, which is remembered), reading the pointers, building the work tables and finding them on the GPU (``_device_table``,
with an upload that only counts; absent in older trees).

    python bench/bench_bucket_host.py --arrays 1000
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _arrays(n: int, total_bytes: int, seed: int = 0):
    import cupy
    from cupy.cuda import memory

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max(2, 2 * total_bytes // 4 // n), n)
    host = np.zeros(int(sizes.sum()) + 64, np.float32)

    def on(offset, count):
        owner = memory.UnownedMemory(host.ctypes.data + 4 * offset, 4 * count, host, device_id=0)
        return cupy.ndarray((count,), np.float32, memptr=memory.MemoryPointer(owner, 0))

    arrays, at = [], 0
    for size in sizes:
        arrays.append(on(at, int(size)))
        at += int(size)
    return arrays, on(0, host.size), host


class _Counting:
    """Stands for ``cupy`` in ``_device_table``: an upload that only counts."""

    uploads = 0

    def asarray(self, table):
        self.uploads += 1
        return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrays", type=int, default=1000)
    parser.add_argument("--mib", type=int, default=64, help="their total size (default 64)")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("bench_bucket_host: CuPy is not installed (pip install 'gpucoll[cu12]')",
              file=sys.stderr)
        return 2
    from gpucoll import kernels
    try:
        from gpucoll import kernel_tables as tables
    except ImportError:  # older trees kept the work tables in kernels
        tables = kernels

    arrays, bucket, _keep = _arrays(args.arrays, args.mib << 20)
    upload = _Counting()

    remembered = getattr(kernels, "_CHECKED", None)  # lists checked before (absent in older trees)

    def validate_new():
        if remembered is not None:
            remembered.clear()
        return kernels._validate(arrays, bucket, None, "pack")

    def validate():
        return kernels._validate(arrays, bucket, None, "pack")

    def host_path():
        checked = kernels._validate(arrays, bucket, None, "pack")
        offsets, sizes = checked[1], checked[2]
        pointers = checked[3] if len(checked) > 3 else [a.data.ptr for a in arrays]
        if hasattr(tables, "_planned"):  # launches remembered (absent in older trees)
            for _n, _grid, table, content in tables._planned(pointers, offsets, sizes):
                tables._device_table(upload, 0, 0, table, content)
            return
        for _n, _grid, table in tables.work_tables(pointers, offsets, sizes):
            if hasattr(tables, "_device_table"):
                tables._device_table(upload, 0, 0, table)

    print(f"# {args.arrays} CuPy float32 arrays ({args.mib} MiB over host memory), "
          f"python {platform.python_version()}, numpy {np.__version__}, {time.strftime('%Y-%m-%d')}")
    cases = [("checks (_validate)", validate), ("host path up to the launch", host_path)]
    if remembered is not None:
        cases.insert(0, ("checks, a list not seen before", validate_new))
    for name, fn in cases:
        number = 10
        best = min(timeit.repeat(fn, number=number, repeat=args.repeat)) / number
        print(f"  {name:30s} {best * 1e3:8.3f} ms  ({best * 1e6 / args.arrays:.2f} µs per array)")
    if hasattr(kernels, "_device_table"):
        print(f"  work-table uploads: {upload.uploads} (one per content, then reused)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
