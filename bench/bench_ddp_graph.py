"""A data-parallel step on the GPU, issued eagerly against captured once into a CUDA graph.

A small model's step is host-bound: every bucket costs a pack launch, an NCCL call and an
unpack launch from Python, while the GPU work of each is a few microseconds. Captured into a
graph (see gpucoll.ddp.bucketer), the whole step is one ``comm.launch_graph``. Here: ``--arrays``
float32 gradients of mixed sizes (``--mib`` in all), a Bucketer with ``--bucket-kib`` buckets,
bfloat16 on the wire and a loss scale, on one stream:

* eager: ``bucketer.reduce(grads, loss_scale=...)``, then the stream is waited for;
* graph: ``comm.launch_graph(graph)`` of that same step captured once, then the wait.

Per variant: the median step time (host issue and GPU, wall clock) and the median time the
host takes to issue a step; the ratio eager / graph. Before timing, one step of each on the
same inputs must give the same gradients bit for bit. One rank by default; under
``gpucoll run -n 2`` with ``NCCL_MULTI_RANK_GPU_ENABLE=1``, two ranks on one GPU.

    python bench/bench_ddp_graph.py [--arrays 200] [--mib 8] [--bucket-kib 256] [--steps 50] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpucoll.ddp import Bucketer  # noqa: E402

LOSS_SCALE = 1024.0
KiB, MiB = 1 << 10, 1 << 20


def gradient_sizes(count: int, total_bytes: int, seed: int = 0):
    """``count`` float32 element counts, log-uniform from 1 KiB up, ``total_bytes`` in all."""
    weights = np.exp(np.random.default_rng(seed).uniform(0, np.log(256), count))
    sizes = np.maximum(weights / weights.sum() * (total_bytes // 4), 256).astype(np.int64)
    return [int(s) for s in sizes]


def _inputs(rank: int, sizes, step: int):
    rng = np.random.default_rng(1000 * step + rank)
    return [(rng.integers(-64, 64, n) / 8).astype(np.float32) for n in sizes]  # bf16-exact


def measure(comm, cupy, sizes, bucket_bytes: int, steps: int):
    """Time ``steps`` eager and ``steps`` graph steps on ``comm`` (after one checked step of
    each); a dict of medians in µs, the ratio and what was run."""
    bucketer = Bucketer(comm, [np.zeros(n, np.float32) for n in sizes],
                        bucket_cap_bytes=bucket_bytes, first_bucket_cap_bytes=bucket_bytes,
                        compression="bf16")
    grads = [cupy.zeros(n, dtype=cupy.float32) for n in sizes]
    stream = cupy.cuda.Stream(non_blocking=True)

    def load(step):
        for array, host in zip(grads, _inputs(comm.rank, sizes, step)):
            array.set(host, stream=stream)
        stream.synchronize()

    def eager():
        bucketer.reduce(grads, loss_scale=LOSS_SCALE)

    with stream:
        load(0)
        eager()  # compiles the kernels, uploads the work tables
        stream.synchronize()
        result = [array.get() for array in grads]
        stream.begin_capture()
        eager()
        graph = stream.end_capture()
        load(0)

        def launch():
            comm.launch_graph(graph, stream=stream)

        launch()
        stream.synchronize()
        equal = all(np.array_equal(a.get(), b) for a, b in zip(grads, result))
        timings = {}
        for name, step in (("eager", eager), ("graph", launch), ("eager2", eager),
                           ("graph2", launch)):  # twice each, interleaved: drift shows
            issue, total = [], []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                issued = time.perf_counter()
                stream.synchronize()
                total.append(time.perf_counter() - start)
                issue.append(issued - start)
            timings.setdefault(name.rstrip("2"), ([], []))
            timings[name.rstrip("2")][0].extend(issue)
            timings[name.rstrip("2")][1].extend(total)
    comm.synchronize()
    us = lambda values: statistics.median(values) * 1e6  # noqa: E731
    out = {"ranks": comm.size, "arrays": len(sizes), "bytes": 4 * sum(sizes),
           "buckets": len(bucketer.buckets), "steps": steps, "equal": equal}
    for name, (issue, total) in timings.items():
        out[f"{name}_issue_us"], out[f"{name}_step_us"] = us(issue), us(total)
    out["ratio"] = out["eager_step_us"] / out["graph_step_us"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arrays", type=int, default=200, help="gradients (default 200)")
    parser.add_argument("--mib", type=float, default=8.0, help="their MiB in all (default 8)")
    parser.add_argument("--bucket-kib", type=int, default=256, help="bucket cap (default 256)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per round (default 50)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)

    from bench_nccl import open_nccl

    opened = open_nccl("bench_ddp_graph")
    if opened is None:
        return 0
    comm, cupy, name = opened
    try:
        row = measure(comm, cupy, gradient_sizes(args.arrays, int(args.mib * MiB)),
                      args.bucket_kib * KiB, args.steps)
        row.update(device=name, nccl=comm.nccl_version, cupy=cupy.__version__,
                   python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
    finally:
        comm.close()
    if comm.rank == 0:
        print(f"# {row['device']}, {row['ranks']} rank(s), NCCL {row['nccl']}, CuPy "
              f"{row['cupy']}, {row['date']}: {row['arrays']} arrays, {row['bytes'] / MiB:g} MiB, "
              f"{row['buckets']} buckets, bf16 on the wire; same result both ways: {row['equal']}")
        print("| step | issue µs | step µs |\n|---|---:|---:|")
        for variant in ("eager", "graph"):
            print(f"| {variant} | {row[variant + '_issue_us']:.1f} | "
                  f"{row[variant + '_step_us']:.1f} |")
        print(f"\neager / graph step time: {row['ratio']:.2f}x")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(row, handle, indent=1)
    return 0 if row["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
