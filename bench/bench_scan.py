"""``exscan`` against Open MPI's own ``Exscan``, in the same ranks.

Times, taking turns round by round (best of ``--rounds``), an in-place float32 sum exscan of
each size through: mpi4py's blocking ``Exscan`` (the peer); ``comm.exscan`` on gpucoll's MPI
backend (MPI's ``Iexscan``, polled against the timeout); gpucoll's recursive doubling over the
MPI backend's point-to-point calls (what float16 and bfloat16 take there); and ``comm.exscan``
on the CPU backend (recursive doubling over shared memory). Each timed loop starts after a
barrier; a row gives the slowest rank's µs per call and the ratios to ``Exscan``. Checks every
result against NumPy once per size. Run under mpirun::

    mpirun -n 4 python bench/bench_scan.py [--rounds 3] [--max-bytes 4M]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
from mpi4py import MPI

import gpucoll
from gpucoll.config import parse_bytes
from gpucoll.scan import recursive_doubling_scan
from gpucoll.types import ReduceOp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-bytes", type=parse_bytes, default=8)
    parser.add_argument("--max-bytes", type=parse_bytes, default=4 << 20)
    parser.add_argument("--iter-bytes", type=parse_bytes, default=64 << 20,
                        help="bytes per timed loop (iterations = this / size, 5..200)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD.Dup()
    rank, size = world.rank, world.size
    directory = world.bcast(tempfile.mkdtemp(prefix="bench_scan_") if rank == 0 else None)
    over_mpi = gpucoll.init(backend="mpi", timeout=60, set_default=False)
    on_cpu = gpucoll.init(backend="cpu", rank=rank, world_size=size,
                          url=f"file://{os.path.join(directory, 'store')}", timeout=60,
                          set_default=False)
    names = ["mpi4py Exscan", "gpucoll mpi backend", "gpucoll recursive doubling over mpi",
             "gpucoll cpu backend"]
    if rank == 0:
        print(f"{size} ranks, float32 sum, in place; µs per call (slowest rank)")
        print("| size (B) | " + " | ".join(names) + " | " +
              " | ".join(f"{name} / Exscan" for name in names[1:]) + " |")
        print("|---:|" + "---:|" * (2 * len(names) - 1))
    sizes, nbytes = [], args.min_bytes
    while nbytes <= args.max_bytes:
        sizes.append(nbytes)
        nbytes *= 8
    for nbytes in sizes:
        count = max(nbytes // 4, 1)
        mine = np.full(count, rank + 1, np.float32)
        expected = np.full(count, rank * (rank + 1) / 2, np.float32)
        x = mine.copy()
        variants = [
            lambda: world.Exscan(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM),
            lambda: over_mpi.exscan(x),
            lambda: recursive_doubling_scan(over_mpi, x, x, ReduceOp.SUM, True),
            lambda: on_cpu.exscan(x),
        ]
        for call in variants:
            np.copyto(x, mine)
            call()
            if rank > 0:  # MPI leaves rank 0 of Exscan undefined
                np.testing.assert_array_equal(x, expected)
        iters = max(5, min(200, args.iter_bytes // nbytes))
        best = [float("inf")] * len(variants)
        for _ in range(args.rounds):
            for i, call in enumerate(variants):
                call()
                world.Barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                elapsed = (time.perf_counter() - start) / iters * 1e6
                best[i] = min(best[i], world.allreduce(elapsed, op=MPI.MAX))
        if rank == 0:
            print(f"| {nbytes} | " + " | ".join(f"{t:.1f}" for t in best) + " | " +
                  " | ".join(f"{t / best[0]:.2f}" for t in best[1:]) + " |", flush=True)
    on_cpu.close()
    over_mpi.close()
    world.Barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
