"""All-reduce demo: every rank reduces arrays from 8 B to 64 MiB, checks the result against
NumPy, and rank 0 prints time, algorithm bandwidth and bus bandwidth (nccl-tests definitions).

Run with::

    gpucoll run -n 4 -m gpucoll.examples.allreduce [--max-bytes 64MiB]

Uses NCCL on CuPy arrays when CuPy, NCCL and a GPU are usable (``backend="auto"``), else the
CPU backend on NumPy arrays. ``--arrays cupy`` with ``GPUCOLL_BACKEND=cpu`` reduces CuPy arrays
through the CPU backend (staged through host memory: several processes sharing one GPU).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import gpucoll


def _sizes(max_bytes: int):
    size = 8
    while size <= max_bytes:
        yield size
        size *= 8 if size < (1 << 20) else 4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", default="64MiB", help="largest message (e.g. 64MiB)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--arrays", choices=("auto", "numpy", "cupy"), default="auto",
                        help="array type (default auto: CuPy where the backend works on device "
                             "memory, else NumPy)")
    args = parser.parse_args(argv)
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = args.max_bytes.lower().replace("ib", "").replace("b", "")
    max_bytes = int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)

    if args.arrays == "cupy":
        from gpucoll.cuda_env import gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason:
            raise SystemExit(f"--arrays cupy needs CuPy and a GPU: {reason}")
    with gpucoll.init() as comm:
        n, rank = comm.size, comm.rank
        dtype = np.dtype(args.dtype)
        xp, sync = np, (lambda: None)
        if args.arrays == "numpy" and comm.memory == "cuda":
            raise SystemExit(f"--arrays numpy: backend {comm.backend} takes device arrays only")
        if args.arrays == "cupy" or (args.arrays == "auto" and comm.memory == "cuda"):
            import cupy as xp

            sync = xp.cuda.get_current_stream().synchronize
        if rank == 0:
            print(f"# gpucoll {gpucoll.__version__} all_reduce, backend {comm.backend}, "
                  f"{n} ranks, dtype {dtype.name}, {xp.__name__} arrays")
            print(f"# {'size (B)':>12} {'count':>11} {'time (us)':>11} {'algbw GB/s':>11} "
                  f"{'busbw GB/s':>11} {'#wrong':>7}")

        def across_ranks(value: float, op: str) -> float:
            box = xp.asarray(np.array([value], np.float64))
            comm.all_reduce(box, op=op)
            return float(box[0])

        total_wrong = 0
        for nbytes in _sizes(max_bytes):
            count = max(nbytes // dtype.itemsize, 1)
            base = (np.arange(count) % 13).astype(dtype)
            expected = base * sum(r + 1 for r in range(n))
            iters = 50 if nbytes < (1 << 20) else 5
            x = xp.asarray(base * (rank + 1))
            y = xp.empty_like(x)
            comm.all_reduce(x, out=y)  # warm-up, checked; out-of-place leaves x as it was
            wrong = int(np.count_nonzero(_host(y) != expected))
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(x, out=y)
            sync()
            seconds = across_ranks((time.perf_counter() - start) / iters, "max")
            wrong_total = int(across_ranks(wrong + int(np.count_nonzero(_host(y) != expected)),
                                           "sum"))
            total_wrong += wrong_total
            algbw = count * dtype.itemsize / seconds / 1e9
            if rank == 0:
                print(f"  {count * dtype.itemsize:>12} {count:>11} {seconds * 1e6:>11.1f} "
                      f"{algbw:>11.3f} {algbw * 2 * (n - 1) / n:>11.3f} {wrong_total:>7}")
        if rank == 0:
            print(f"# wrong results: {total_wrong}")
        return 1 if total_wrong else 0


def _host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array


if __name__ == "__main__":
    raise SystemExit(main())
