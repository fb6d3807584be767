"""Uneven reduce-scatter: the two ways ``comm.reduce_scatter_v`` can build it from public
collectives (one padded reduce_scatter; one reduce per rank onto it) and what it picks, with a
balanced ``reduce_scatter`` of the same total bytes as the floor and, when run under
``mpirun``, Open MPI's ``Reduce_scatter`` with the same receive counts (mpi4py) as the peer.
CPU backend, same run, same ranks.

    gpucoll run -n 4 bench/bench_reduce_scatterv.py [--total 1MiB,16MiB] [--repeat 5]
    mpirun -n 4 python bench/bench_reduce_scatterv.py          # adds the mpi4py column

Row patterns (the total is fixed): ``even``; ``ramp`` (1 : 2 : ... : n); ``one_large`` (the
last rank gets 97 %). Rank 0 prints best-of-``repeat`` times and ratios to the balanced floor;
every result is checked against NumPy first.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpucoll as gc  # noqa: E402
from bench_gatherv import best_of, pattern_counts  # noqa: E402
from gpucoll.perf.options import parse_size  # noqa: E402


def mpi_world(size: int):
    """mpi4py's COMM_WORLD when this job was started by mpirun with ``size`` ranks, else None."""
    if not any(name.startswith(("OMPI_COMM_WORLD", "PMI_RANK")) for name in os.environ):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() == size else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", default="1MiB,16MiB", help="total bytes reduced, comma list")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    comm = gc.init(backend="cpu")
    world = mpi_world(comm.size)
    n, op = comm.size, gc.ReduceOp.SUM
    if comm.rank == 0:
        print(f"# reduce_scatter_v, CPU backend, {n} ranks, float32, best of {args.repeat}"
              + ("; mpi: Open MPI Reduce_scatter (mpi4py)" if world is not None else ""))
        print(f"# {'total':>8} {'pattern':>10} {'floor us':>10} {'padded us':>10} "
              f"{'reduces us':>10} {'auto us':>10} {'mpi us':>10} {'auto/floor':>11} "
              f"{'auto/mpi':>9}")
    for total_text in args.total.split(","):
        total_rows = parse_size(total_text) // 4
        for name in ("even", "ramp", "one_large"):
            counts = pattern_counts(name, total_rows, n)
            x = np.random.default_rng([comm.rank, total_rows]).integers(
                -8, 8, total_rows).astype(np.float32)      # small integers: sums are exact
            every = [np.random.default_rng([r, total_rows]).integers(-8, 8, total_rows)
                     .astype(np.float32) for r in range(n)]
            start = sum(counts[:comm.rank])
            expected = np.sum(every, axis=0)[start:start + counts[comm.rank]]
            padded = lambda: comm._reduce_scatter_v_padded(x, counts, op)  # noqa: E731
            reduces = lambda: comm._reduce_scatter_v_reduces(x, counts, op)  # noqa: E731
            auto = lambda: comm.reduce_scatter_v(x, counts)[0]  # noqa: E731
            ways = [padded, reduces, auto]
            if world is not None:
                out = np.empty(counts[comm.rank], np.float32)

                def peer():
                    world.Reduce_scatter(x, out, recvcounts=counts)
                    return out
                ways.append(peer)
            for way in ways:
                assert np.array_equal(way(), expected), "reduce_scatter_v: wrong result"
            even = np.ones(total_rows // n * n, np.float32).reshape(n, -1)
            floor = best_of(comm, lambda: comm.reduce_scatter(even), args.repeat)
            t_pad, t_red, t_auto = (best_of(comm, way, args.repeat) for way in ways[:3])
            t_mpi = best_of(comm, ways[3], args.repeat) if world is not None else float("nan")
            if comm.rank == 0:
                print(f"  {total_text:>8} {name:>10} {floor * 1e6:10.0f} {t_pad * 1e6:10.0f} "
                      f"{t_red * 1e6:10.0f} {t_auto * 1e6:10.0f} {t_mpi * 1e6:10.0f} "
                      f"{t_auto / floor:11.2f} {t_auto / t_mpi:9.2f}")
    comm.close()


if __name__ == "__main__":
    main()
