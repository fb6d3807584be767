"""``exscan``: recursive doubling against the pipelined chain, and both against Open MPI's
own ``Exscan``, in the same ranks.

Times, taking turns round by round (best of ``--rounds``), an in-place float32 sum exscan of
each size. Under mpirun: mpi4py's blocking ``Exscan`` (the peer); ``comm.exscan`` on gpucoll's
MPI backend (MPI's ``Iexscan``, polled against the timeout); gpucoll's recursive doubling and
its chain (one column per ``--segments`` size) over the MPI backend's point-to-point calls
(what float16 and bfloat16 take there); and the same two over the CPU backend (shared
memory). Under ``gpucoll run`` (no MPI): the CPU backend's two. Each timed loop starts after a
barrier; a row gives the slowest rank's µs per call and the ratios to the first column.
Checks every result against NumPy once per size. Run with::

    mpirun -n 4 python bench/bench_scan.py [--rounds 3] [--max-bytes 4M] [--segments 64K,256K]
    gpucoll run -n 4 bench/bench_scan.py [--rounds 3] [--max-bytes 4M] [--segments 64K,256K]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from functools import partial

import numpy as np

import gpucoll
from gpucoll.config import parse_bytes
from gpucoll.scan import chain_scan, recursive_doubling_scan
from gpucoll.types import ReduceOp


def _label(nbytes: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _generic(comm, name: str, segments):
    """(name, call(x)) of recursive doubling and the chain per segment size over ``comm``."""
    variants = [(f"{name} doubling",
                 lambda x: recursive_doubling_scan(comm, x, x, ReduceOp.SUM, True))]
    for segment in segments:
        variants.append((f"{name} chain {_label(segment)}",
                         partial(lambda x, s: chain_scan(comm, x, x, ReduceOp.SUM, True,
                                                         segment_bytes=s), s=segment)))
    return variants


class _MPIWorld:
    """Barrier and slowest-rank time through mpi4py (under mpirun)."""

    def __init__(self):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.comm.rank, self.comm.size

    def barrier(self):
        self.comm.Barrier()

    def slowest(self, value: float) -> float:
        return self.comm.allreduce(value, op=self.MPI.MAX)

    def share(self, value):
        return self.comm.bcast(value)


class _GpucollWorld:
    """Barrier and slowest-rank time through the CPU backend (under ``gpucoll run``)."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size

    def barrier(self):
        self.comm.barrier()

    def slowest(self, value: float) -> float:
        return float(self.comm.all_reduce(np.array([value]), op="max")[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-bytes", type=parse_bytes, default=8)
    parser.add_argument("--max-bytes", type=parse_bytes, default=4 << 20)
    parser.add_argument("--factor", type=int, default=8, help="size step (default 8x)")
    parser.add_argument("--segments", default="256K",
                        help="the chain's segment sizes, comma-separated (a column each)")
    parser.add_argument("--iter-bytes", type=parse_bytes, default=64 << 20,
                        help="bytes per timed loop (iterations = this / size, 5..200)")
    args = parser.parse_args()
    segments = [parse_bytes(text) for text in args.segments.split(",")]
    under_mpirun = "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ
    closing, directory = [], None
    if under_mpirun:
        world = _MPIWorld()
        rank, size = world.rank, world.size
        directory = world.share(tempfile.mkdtemp(prefix="bench_scan_") if rank == 0 else None)
        over_mpi = gpucoll.init(backend="mpi", timeout=60, set_default=False)
        on_cpu = gpucoll.init(backend="cpu", rank=rank, world_size=size,
                              url=f"file://{os.path.join(directory, 'store')}", timeout=60,
                              set_default=False)
        closing = [on_cpu, over_mpi]
        MPI = world.MPI
        variants = [("mpi4py Exscan",
                     lambda x: world.comm.Exscan(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)),
                    ("mpi backend", over_mpi.exscan)]
        variants += _generic(over_mpi, "over mpi", segments)
        variants += _generic(on_cpu, "cpu", segments)
    else:
        on_cpu = gpucoll.init(backend="cpu", timeout=60, set_default=False)
        closing = [on_cpu]
        world = _GpucollWorld(on_cpu)
        rank, size = world.rank, world.size
        variants = _generic(on_cpu, "cpu", segments)
    names = [name for name, _ in variants]
    if rank == 0:
        print(f"{size} ranks, float32 sum exscan, in place; µs per call (slowest rank)")
        print("| size (B) | " + " | ".join(names) + " | " +
              " | ".join(f"{name} / {names[0]}" for name in names[1:]) + " |")
        print("|---:|" + "---:|" * (2 * len(names) - 1))
    sizes, nbytes = [], args.min_bytes
    while nbytes <= args.max_bytes:
        sizes.append(nbytes)
        nbytes *= args.factor
    for nbytes in sizes:
        count = max(nbytes // 4, 1)
        mine = np.full(count, rank + 1, np.float32)
        expected = np.full(count, rank * (rank + 1) / 2, np.float32)
        x = mine.copy()
        for _, call in variants:
            np.copyto(x, mine)
            call(x)
            if rank > 0:  # MPI leaves rank 0 of Exscan undefined
                np.testing.assert_array_equal(x, expected)
        iters = max(5, min(200, args.iter_bytes // nbytes))
        best = [float("inf")] * len(variants)
        for _ in range(args.rounds):
            for i, (_, call) in enumerate(variants):
                call(x)
                world.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    call(x)
                elapsed = (time.perf_counter() - start) / iters * 1e6
                best[i] = min(best[i], world.slowest(elapsed))
        if rank == 0:
            print(f"| {nbytes} | " + " | ".join(f"{t:.1f}" for t in best) + " | " +
                  " | ".join(f"{t / best[0]:.2f}" for t in best[1:]) + " |", flush=True)
    for comm in closing:
        comm.close()
    if under_mpirun:
        world.barrier()
    if rank == 0 and directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
