"""Which form of MPI all-reduce the MPI backend should call: raw mpi4py, no gpucoll.

Times, in the same ranks and taking turns round by round (best of ``--rounds``), an in-place
float32 sum through: the blocking ``Allreduce`` (whole, and in 1 MiB pieces); the
non-blocking ``Iallreduce`` waited with ``Wait``, with a spin on ``Test``, and with the
backend's wait (spin 200 µs, then yield the core between tests); the non-blocking form in
1 MiB pieces; and an out-of-place ``Iallreduce`` into a scratch buffer plus a copy back.
Prints one row per size, in µs per call, rank 0's view. Run under mpirun::

    mpirun -n 2 python bench/bench_mpi_forms.py [--rounds 3] [--max-bytes 64M]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from gpucoll.config import parse_bytes

PIECE = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-bytes", type=parse_bytes, default=8)
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    parser.add_argument("--iter-bytes", type=parse_bytes, default=128 << 20,
                        help="bytes per timed loop (iterations = this / size, 5..300)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    in_place, FLOAT, SUM = MPI.IN_PLACE, MPI.FLOAT, MPI.SUM

    def spin(request) -> None:
        while not request.Test():
            pass

    def backend_wait(request) -> None:  # what MPICommunicator._poll does before 50 ms
        start = time.monotonic()
        while not request.Test():
            if time.monotonic() - start > 200e-6:
                os.sched_yield()

    sizes, size = [], args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 8
    if sizes[-1] != args.max_bytes:
        sizes.append(args.max_bytes)
    if comm.rank == 0:
        names = ["Allreduce", "Allreduce 1M pieces", "Iallreduce+Wait", "Iallreduce+Test spin",
                 "Iallreduce+backend wait", "Iallreduce 1M pieces", "Iallreduce out+copy"]
        print("| size (B) | " + " | ".join(names) + " |")
        print("|---:|" + "---:|" * len(names))
    for nbytes in sizes:
        x = np.ones(max(nbytes // 4, 1), np.float32)
        scratch = np.empty_like(x)
        step = PIECE // 4
        iters = max(5, min(300, args.iter_bytes // max(nbytes, 1)))

        def pieces(call) -> None:
            for begin in range(0, x.size, step):
                call(x[begin:begin + step])

        variants = [
            lambda: comm.Allreduce(in_place, [x, FLOAT], SUM),
            lambda: pieces(lambda p: comm.Allreduce(in_place, [p, FLOAT], SUM)),
            lambda: comm.Iallreduce(in_place, [x, FLOAT], SUM).Wait(),
            lambda: spin(comm.Iallreduce(in_place, [x, FLOAT], SUM)),
            lambda: backend_wait(comm.Iallreduce(in_place, [x, FLOAT], SUM)),
            lambda: pieces(lambda p: backend_wait(comm.Iallreduce(in_place, [p, FLOAT], SUM))),
            lambda: (backend_wait(comm.Iallreduce([x, FLOAT], [scratch, FLOAT], SUM)),
                     np.copyto(x, scratch)),
        ]
        best = [float("inf")] * len(variants)
        for _ in range(args.rounds):
            for i, call in enumerate(variants):
                for _ in range(2):
                    call()
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                best[i] = min(best[i], (time.perf_counter() - start) / iters * 1e6)
        if comm.rank == 0:
            print(f"| {nbytes} | " + " | ".join(f"{t:.1f}" for t in best) + " |", flush=True)


if __name__ == "__main__":
    main()
