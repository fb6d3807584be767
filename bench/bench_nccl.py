"""gpucoll's NCCL all_reduce against a direct ``cupy.cuda.nccl`` call on the same communicator.

For each size (8 B to 1 GiB of float32 by default) both variants run ``--iters`` back-to-back
in-place all-reduces on the same stream, the host waits for the stream, and the time per call
is the wall time divided by the count; rounds alternate between the variants and the median
round counts. This includes the host's enqueue cost, which is what bounds small messages. The
target: gpucoll's overhead at most 5 % or 5 us per call, whichever is larger.

Run on one GPU (one rank), or with several ranks (one GPU each, or two ranks on one GPU with
NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1)::

    python bench/bench_nccl.py --json nccl_overhead.json [--parts]
    gpucoll run -n 2 bench/bench_nccl.py

Without a GPU it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpucoll  # noqa: E402
from gpucoll.perf.options import parse_size  # noqa: E402


def _sizes(lo: int, hi: int, factor: int):
    size = lo
    while size <= hi:
        yield size
        size *= factor


def _time_calls(call, stream, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        call()
    stream.synchronize()
    return (time.perf_counter() - start) / iters


def _enqueue_time(call, stream, iters: int) -> float:
    """Host time per call without waiting for the GPU (the enqueue cost alone)."""
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    elapsed = (time.perf_counter() - start) / iters
    stream.synchronize()
    return elapsed


def measure(comm, nbytes: int, iters: int, rounds: int, warmup: int) -> dict:
    import cupy
    from cupy.cuda import nccl

    count = max(nbytes // 4, 1)
    x = cupy.ones(count, dtype=cupy.float32)
    stream = cupy.cuda.get_current_stream()
    raw, ptr, s = comm.nccl_comm, x.data.ptr, stream.ptr

    def direct():
        raw.allReduce(ptr, ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)

    def ours():
        comm.all_reduce(x)

    n = iters if nbytes <= (64 << 20) else max(iters // 10, 5)
    for _ in range(warmup):
        direct()
        ours()
    stream.synchronize()
    times = {"direct": [], "gpucoll": []}
    for r in range(rounds):
        order = (("direct", direct), ("gpucoll", ours)) if r % 2 == 0 else \
            (("gpucoll", ours), ("direct", direct))
        for name, fn in order:
            times[name].append(_time_calls(fn, stream, n))
    enqueue = {"direct": _enqueue_time(direct, stream, n), "gpucoll": _enqueue_time(ours, stream, n)}
    direct_t, ours_t = statistics.median(times["direct"]), statistics.median(times["gpucoll"])
    overhead = ours_t - direct_t
    allowed = max(5e-6, 0.05 * direct_t)
    return {
        "bytes": count * 4, "iters": n, "direct_us": direct_t * 1e6, "gpucoll_us": ours_t * 1e6,
        "overhead_us": overhead * 1e6, "overhead_pct": 100 * overhead / direct_t,
        "allowed_us": allowed * 1e6, "ok": overhead <= allowed,
        "enqueue_direct_us": enqueue["direct"] * 1e6, "enqueue_gpucoll_us": enqueue["gpucoll"] * 1e6,
        "rounds_direct_us": [t * 1e6 for t in times["direct"]],
        "rounds_gpucoll_us": [t * 1e6 for t in times["gpucoll"]],
    }


def parts(comm, iters: int = 20000, rounds: int = 5) -> list:
    """Host time per call of each CUDA / CuPy call the one-pass all-reduce makes, beside the
    direct NCCL call and gpucoll's whole call (8 B, in place): where the overhead goes on
    this host. ``[(name, median µs per call)]``; each line includes the loop's own cost (the
    ``empty loop`` line)."""
    import cupy
    from cupy.cuda import nccl

    x = cupy.ones(2, dtype=cupy.float32)
    runtime = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream()
    raw, ptr, s = comm.nccl_comm, x.data.ptr, stream.ptr
    event = cupy.cuda.Event(block=False, disable_timing=True)
    lines = [
        ("empty loop", lambda: None),
        ("direct allReduce", lambda: raw.allReduce(ptr, ptr, 2, nccl.NCCL_FLOAT32,
                                                   nccl.NCCL_SUM, s)),
        ("get_current_stream().ptr", lambda: cupy.cuda.get_current_stream().ptr),
        ("runtime.getDevice()", runtime.getDevice),
        ("runtime.streamIsCapturing(s)", lambda: runtime.streamIsCapturing(s)),
        ("runtime.eventRecord(e, s)", lambda: runtime.eventRecord(event.ptr, s)),
        ("runtime.eventQuery(e)", lambda: runtime.eventQuery(event.ptr)),
        ("gpucoll all_reduce", lambda: comm.all_reduce(x)),
    ]
    times = {name: [] for name, _ in lines}
    for _ in range(rounds):
        for name, fn in lines:
            stream.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            stream.synchronize()
            times[name].append((time.perf_counter() - start) / iters)
    return [(name, statistics.median(times[name]) * 1e6) for name, _ in lines]


def _init():
    if "WORLD_SIZE" in os.environ:
        return gpucoll.init(backend="nccl")
    tmp = tempfile.mkdtemp(prefix="gpucoll-bench-")
    return gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{tmp}/store")


def open_nccl(script: str):
    """``(comm, cupy, GPU name)`` for a GPU benchmark: one rank, or the ranks of ``gpucoll
    run``; None (after saying why) where there is no NCCL backend to measure."""
    from gpucoll.cuda_env import nccl_unavailable_reason

    reason = nccl_unavailable_reason()
    if reason is not None:
        print(f"{script}: no NCCL backend here ({reason}); nothing to measure")
        return None
    import cupy

    comm = _init()
    props = cupy.cuda.runtime.getDeviceProperties(comm.device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return comm, cupy, name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", default="1G", help="largest size (default 1G)")
    parser.add_argument("-f", "--stepfactor", type=int, default=4, help="size factor (default 4)")
    parser.add_argument("--iters", type=int, default=200, help="calls per round (default 200)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per variant (default 7)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--parts", action="store_true",
                        help="also time each CUDA call of gpucoll's path on its own (one rank)")
    args = parser.parse_args(argv)

    opened = open_nccl("bench_nccl")
    if opened is None:
        return 0
    comm, cupy, name = opened
    try:
        header = {
            "device": name, "ranks": comm.size, "nccl": comm.nccl_version,
            "cupy": cupy.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
            "multi_rank_gpu": os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", ""),
        }
        rows = [measure(comm, nbytes, args.iters, args.rounds, args.warmup)
                for nbytes in _sizes(parse_size(args.minbytes), parse_size(args.maxbytes),
                                     args.stepfactor)]
        breakdown = parts(comm) if args.parts and comm.size == 1 else []
    finally:
        comm.close()
    if comm.rank == 0:
        print(f"# {header['device']}, {header['ranks']} rank(s), NCCL {header['nccl']}, "
              f"CuPy {header['cupy']}, {header['date']}")
        print("| bytes | direct µs/call | gpucoll µs/call | overhead µs | overhead % | "
              "allowed µs | ok | enqueue direct µs | enqueue gpucoll µs |")
        print("|---:|---:|---:|---:|---:|---:|:-:|---:|---:|")
        for r in rows:
            print(f"| {r['bytes']} | {r['direct_us']:.2f} | {r['gpucoll_us']:.2f} | "
                  f"{r['overhead_us']:+.2f} | {r['overhead_pct']:+.1f} | {r['allowed_us']:.2f} | "
                  f"{'yes' if r['ok'] else 'NO'} | {r['enqueue_direct_us']:.2f} | "
                  f"{r['enqueue_gpucoll_us']:.2f} |")
        worst = max(rows, key=lambda r: r["overhead_us"] - r["allowed_us"])
        print(f"\nall within target: {all(r['ok'] for r in rows)}; worst margin at "
              f"{worst['bytes']} B: {worst['overhead_us']:+.2f} µs vs {worst['allowed_us']:.2f} "
              f"allowed")
        if breakdown:
            print("\n| host call, 8 B | µs/call |\n|---|---:|")
            for line, micros in breakdown:
                print(f"| {line} | {micros:.3f} |")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"header": header, "rows": rows, "parts": breakdown}, handle,
                          indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
