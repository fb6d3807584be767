"""Uneven all-gather: the two ways ``comm.all_gather_v`` can build it from public collectives
(one padded all_gather; one broadcast per rank into slices of the result) and what it picks,
with a balanced ``all_gather`` of the same total bytes as the floor. CPU backend, same run,
same ranks.

    gpucoll run -n 4 bench/bench_gatherv.py [--total 1MiB,16MiB] [--repeat 5]

Row patterns per rank (the total is fixed): ``even``; ``ramp`` (1 : 2 : ... : n);
``one_large`` (the last rank holds 97 %). Rank 0 prints best-of-``repeat`` times and ratios to
the balanced floor; every result is checked against NumPy first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpucoll as gc  # noqa: E402
from gpucoll.perf.options import parse_size  # noqa: E402


def pattern_counts(name: str, total_rows: int, size: int):
    if name == "even":
        weights = [1.0] * size
    elif name == "ramp":
        weights = [float(r + 1) for r in range(size)]
    else:
        weights = [0.03 / max(size - 1, 1)] * (size - 1) + [0.97] if size > 1 else [1.0]
    counts = [int(total_rows * w / sum(weights)) for w in weights]
    counts[-1] += total_rows - sum(counts)
    return counts


def best_of(comm, fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        comm.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    slowest = comm.all_gather(np.array([min(times)]))  # a collective ends when its last rank does
    return float(slowest.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", default="1MiB,16MiB", help="total bytes gathered, comma list")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    comm = gc.init(backend="cpu")
    n = comm.size
    if comm.rank == 0:
        print(f"# all_gather_v, CPU backend, {n} ranks, float32, best of {args.repeat}")
        print(f"# {'total':>8} {'pattern':>10} {'floor us':>10} {'padded us':>10} "
              f"{'bcast us':>10} {'auto us':>10} {'padded/floor':>13} {'bcast/floor':>12} "
              f"{'auto/floor':>11}")
    for total_text in args.total.split(","):
        total_rows = parse_size(total_text) // 4
        for name in ("even", "ramp", "one_large"):
            counts = pattern_counts(name, total_rows, n)
            rng = np.random.default_rng([counts[comm.rank], comm.rank])
            x = rng.standard_normal(counts[comm.rank]).astype(np.float32)
            expected = np.concatenate([np.random.default_rng([c, r]).standard_normal(c)
                                       .astype(np.float32) for r, c in enumerate(counts)])
            padded = lambda: comm._all_gather_v_padded(x, counts)  # noqa: E731
            broadcasts = lambda: comm._all_gather_v_broadcasts(x, counts)  # noqa: E731
            auto = lambda: comm.all_gather_v(x, counts=counts)[0]  # noqa: E731
            for way in (padded, broadcasts, auto):
                assert np.array_equal(way(), expected), "all_gather_v: wrong result"
            even = np.ones(total_rows // n, np.float32)
            floor = best_of(comm, lambda: comm.all_gather(even), args.repeat)
            t_pad = best_of(comm, padded, args.repeat)
            t_bc = best_of(comm, broadcasts, args.repeat)
            t_auto = best_of(comm, auto, args.repeat)
            if comm.rank == 0:
                print(f"  {total_text:>8} {name:>10} {floor * 1e6:10.0f} {t_pad * 1e6:10.0f} "
                      f"{t_bc * 1e6:10.0f} {t_auto * 1e6:10.0f} {t_pad / floor:13.2f} "
                      f"{t_bc / floor:12.2f} {t_auto / floor:11.2f}")
    comm.close()


if __name__ == "__main__":
    main()
