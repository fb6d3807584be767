"""Bucketing benchmark: fused pack / unpack, and end-to-end gradient averaging.

1. Pack and unpack 1,000 arrays of mixed sizes (1 KiB - 4 MiB, 64 MiB in all, float32), in
   the bucket layout of the DDP bucketer (``kernels.bucket_offsets``: each array on a 16-byte
   boundary); the GPU part also packs and unpacks them back to back (any alignment):
   * GPU (CuPy and a device present): the fused kernels (float32 buckets, and float32 ->
     bfloat16 / float16 buckets and back) against the device-to-device copy bandwidth measured
     in the same run (one 64 MiB ``cupy.copyto``) and per-array CuPy loops; ``--json`` keeps
     the times and the ratios the goals are judged by. Each case is timed twice: per call
     (CUDA events around the call, so the host's work before the launch counts: what a caller
     that waits sees) and on the GPU alone (the stream is held by a spin kernel while the host
     enqueues the call, so the events see only the GPU's work). The bandwidth goal is judged
     on the GPU time, the per-array-loop goal on the per-call time.
   * CPU: the NumPy path against ``np.concatenate`` and a per-array copy loop.
2. End to end on the CPU backend with 2 ranks: a simulated backward marks the 1,000 gradients
   ready (last first, compute time proportional to size); reported is the time from the last
   ``mark_ready`` to ``finish()`` returning (all gradients averaged), per bucket cap.

    python bench/bench_bucket.py [--skip-gpu] [--skip-cpu] [--skip-e2e] [--backward-ms 300] [--json F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpucoll import kernels  # noqa: E402

MiB = 1 << 20


def mixed_sizes(count=1000, total_bytes=64 * MiB, itemsize=4, seed=0):
    """``count`` element counts from 1 KiB to 4 MiB (both ends included), ``total_bytes`` in all:
    ``1 KiB * 4096 ** (u ** p)`` for uniform ``u``, with ``p`` found by bisection."""
    u = np.sort(np.random.default_rng(seed).uniform(0, 1, count))
    u[0], u[-1] = 0.0, 1.0
    lo, hi = 0.01, 100.0
    for _ in range(100):
        p = (lo * hi) ** 0.5
        nbytes = (1 << 10) * 4096.0 ** (u ** p)
        lo, hi = (p, hi) if nbytes.sum() > total_bytes else (lo, p)
    nbytes = nbytes.astype(np.int64) // itemsize * itemsize
    remainder = int(total_bytes - nbytes.sum())  # exact total, within bounds
    for i in np.argsort(nbytes)[::-1 if remainder < 0 else 1]:
        room = (4 * MiB - nbytes[i]) if remainder > 0 else ((1 << 10) - nbytes[i])
        step = int(np.clip(remainder, min(room, 0), max(room, 0))) // itemsize * itemsize
        nbytes[i] += step
        remainder -= step
        if remainder == 0:
            break
    np.random.default_rng(seed + 1).shuffle(nbytes)
    return [int(b) // itemsize for b in nbytes]


def best_of(fn, repeat=7):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def row(name, seconds, nbytes, gpu_seconds=None):
    gpu = "" if gpu_seconds is None else \
        f"   GPU alone {gpu_seconds * 1e3:8.3f} ms  {nbytes / gpu_seconds / 1e9:7.2f} GB/s"
    print(f"  {name:<44} {seconds * 1e3:9.2f} ms  {nbytes / seconds / 1e9:7.2f} GB/s{gpu}")


#: Holds a stream for ``cycles`` GPU clock cycles (one thread), so the host can enqueue work
#: behind it before any of it starts.
SPIN_SOURCE = r"""
extern "C" __global__ void gpucoll_bench_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def bench_cpu(sizes):
    arrays = [np.random.default_rng(i).standard_normal(n).astype(np.float32)
              for i, n in enumerate(sizes)]
    total = sum(sizes)
    nbytes = total * 4
    bucket = np.empty(total, np.float32)
    offsets = list(np.cumsum([0] + sizes[:-1]))
    print(f"# CPU (NumPy), {len(sizes)} arrays, {nbytes / MiB:.0f} MiB float32; "
          f"GB/s = bytes read / time")

    def loop_copy():
        for a, o, n in zip(arrays, offsets, sizes):
            bucket[o:o + n] = a

    def loop_unpack():
        for a, o, n in zip(arrays, offsets, sizes):
            np.multiply(bucket[o:o + n], np.float32(0.5), out=a)

    cases = [
        ("np.concatenate (allocates)", lambda: np.concatenate(arrays)),
        ("np.concatenate(out=bucket)", lambda: np.concatenate(arrays, out=bucket)),
        ("per-array copy loop", loop_copy),
        ("kernels.pack", lambda: kernels.pack(arrays, bucket, offsets=offsets)),
        ("kernels.pack scale=0.5", lambda: kernels.pack(arrays, bucket, offsets=offsets,
                                                         scale=0.5)),
        ("kernels.pack -> float16", lambda: kernels.pack(arrays, np.empty(total, np.float16))),
        ("per-array unpack loop (x 0.5)", loop_unpack),
        ("kernels.unpack scale=0.5", lambda: kernels.unpack(bucket, arrays, offsets=offsets,
                                                             scale=0.5)),
        ("kernels.unpack scale=0.5 + non-finite check",
         lambda: kernels.unpack(bucket, arrays, offsets=offsets, scale=0.5,
                                found_inf=np.zeros(1, np.int32))),
    ]
    if kernels.bfloat16 is not None:
        bf = np.empty(total, kernels.bfloat16)
        cases.insert(6, ("kernels.pack -> bfloat16", lambda: kernels.pack(arrays, bf)))
    for name, fn in cases:
        row(name, best_of(fn, 5)[0], nbytes)


def bench_gpu(sizes, json_path=None):
    """The fused kernels against one device-to-device copy and per-array loops; verdicts on the
    two goals (pack / unpack at >= 85 % of the copy's bandwidth, >= 10x the per-array loop)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no device")
    except Exception as exc:
        print(f"# GPU part skipped: {type(exc).__name__}: {exc}")
        return None
    total = sum(sizes)
    nbytes = total * 4
    arrays = [cupy.random.standard_normal(n, dtype=cupy.float32) for n in sizes]
    # the layout the DDP bucketer uses: each array on a 16-byte boundary (vector accesses)
    offsets, length = kernels.bucket_offsets(sizes, 4)
    bucket = cupy.empty(length, cupy.float32)
    # and back to back, where an array gets vector accesses only if its bucket position
    # happens to share its own 16-byte phase
    packed_offsets = [int(o) for o in np.cumsum([0] + sizes[:-1])]
    packed = cupy.empty(total, cupy.float32)
    flat = cupy.empty(total, cupy.float32)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    print(f"# GPU {name}, {len(sizes)} arrays, {nbytes / MiB:.0f} MiB float32, each on a 16-byte "
          f"boundary of the bucket unless said; GB/s = float32 bytes of the arrays / time "
          f"(events, median of 20; per call, and with the GPU alone)")

    def timed(fn, repeat=20):
        fn()
        cupy.cuda.Device().synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(repeat):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return statistics.median(times)

    spin = cupy.RawKernel(SPIN_SOURCE, "gpucoll_bench_spin")
    rate = []  # clock cycles per second, measured at the first use

    def timed_on_gpu(fn, repeat=20):
        """The GPU's time for ``fn``'s work alone: the events are recorded behind a spin
        that outlasts the host's enqueueing (checked: the spin must still be running when
        ``fn`` returns, else the spin is lengthened and the round repeated)."""
        start, stop, spun = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
        if not rate:
            spin((1,), (1,), (np.int64(1000),))  # compiled and loaded
            start.record()
            spin((1,), (1,), (np.int64(10 ** 7),))
            stop.record()
            stop.synchronize()
            rate.append(1e7 / (cupy.cuda.get_elapsed_time(start, stop) / 1e3))
        fn()
        cupy.cuda.Device().synchronize()
        hold, times = 0.02, []
        while len(times) < repeat:
            spin((1,), (1,), (np.int64(hold * rate[0]),))
            spun.record()
            start.record()
            fn()
            stop.record()
            late = spun.done  # the host was not done enqueueing when the GPU got there
            stop.synchronize()
            if late:
                hold *= 2
                if hold > 2.0:
                    raise RuntimeError("the host takes over 2 s to enqueue one call")
                continue
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return statistics.median(times)

    def loop_copy():
        for a, o, n in zip(arrays, offsets, sizes):
            bucket[o:o + n] = a

    def loop_unpack():
        for a, o, n in zip(arrays, offsets, sizes):
            cupy.multiply(bucket[o:o + n], 0.5, out=a)

    cases = [("copy", "device-to-device copy, one 64 MiB array",
              lambda: cupy.copyto(flat, bucket[:total])),
             ("loop_pack", "per-array CuPy copy loop", loop_copy),
             ("pack", "kernels.pack", lambda: kernels.pack(arrays, bucket, offsets=offsets)),
             ("loop_unpack", "per-array CuPy unpack loop (x 0.5)", loop_unpack),
             ("unpack", "kernels.unpack scale=0.5", lambda: kernels.unpack(bucket, arrays, offsets=offsets,
                                                                           scale=0.5)),
             ("unpack_check", "kernels.unpack scale=0.5 + non-finite check",
              lambda: kernels.unpack(bucket, arrays, offsets=offsets, scale=0.5,
                                     found_inf=cupy.zeros(1, cupy.int32))),
             ("pack_back_to_back", "kernels.pack, arrays back to back",
              lambda: kernels.pack(arrays, packed, offsets=packed_offsets)),
             ("unpack_back_to_back", "kernels.unpack scale=0.5, back to back",
              lambda: kernels.unpack(packed, arrays, offsets=packed_offsets, scale=0.5))]
    halves = [("float16", cupy.float16)]
    try:
        if kernels.bfloat16 is None:
            raise TypeError("ml_dtypes is not installed")
        cupy.empty(1, kernels.bfloat16)
        halves.append(("bfloat16", kernels.bfloat16))
    except Exception as exc:
        print(f"# bfloat16 cases skipped: {type(exc).__name__}: {exc}")
    half_offsets, half_length = kernels.bucket_offsets(sizes, 2)
    for label, dtype in halves:
        half = cupy.empty(half_length, dtype)
        cases.append((f"pack_{label}", f"kernels.pack -> {label}",
                      lambda half=half: kernels.pack(arrays, half, offsets=half_offsets)))
        cases.append((f"unpack_{label}", f"kernels.unpack {label} -> float32 x 0.5",
                      lambda half=half: kernels.unpack(half, arrays, offsets=half_offsets,
                                                       scale=0.5)))
    seconds, gpu_seconds = {}, {}
    for key, label, fn in cases:
        seconds[key] = timed(fn)
        try:
            gpu_seconds[key] = timed_on_gpu(fn)
        except Exception as exc:  # the per-call figure still stands; the verdict uses it
            print(f"# {label}: no GPU-alone time ({type(exc).__name__}: {exc})")
            gpu_seconds[key] = seconds[key]
        row(label, seconds[key], nbytes, gpu_seconds[key])
    copy = gpu_seconds["copy"]
    verdicts = {
        "pack_vs_copy": copy / gpu_seconds["pack"],
        "unpack_vs_copy": copy / gpu_seconds["unpack"],
        "pack_vs_loop": seconds["loop_pack"] / seconds["pack"],
        "unpack_vs_loop": seconds["loop_unpack"] / seconds["unpack"],
    }
    print(f"# GPU alone: pack {100 * verdicts['pack_vs_copy']:.0f} % and unpack "
          f"{100 * verdicts['unpack_vs_copy']:.0f} % of the copy's bandwidth (goal >= 85 %); "
          f"per call: {verdicts['pack_vs_loop']:.1f}x and {verdicts['unpack_vs_loop']:.1f}x the "
          f"per-array loops (goal >= 10x)")
    result = {"device": name, "cupy": cupy.__version__, "arrays": len(sizes), "bytes": nbytes,
              "date": time.strftime("%Y-%m-%d"),
              "seconds": seconds, "gpu_seconds": gpu_seconds, "ratios": verdicts,
              "goals_met": verdicts["pack_vs_copy"] >= 0.85 and verdicts["unpack_vs_copy"] >= 0.85
              and verdicts["pack_vs_loop"] >= 10 and verdicts["unpack_vs_loop"] >= 10}
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


def _e2e_rank(rank, url, sizes, caps, backward_s, repeat, results):
    import gpucoll
    from gpucoll.ddp import Bucketer

    with gpucoll.init(backend="cpu", rank=rank, world_size=2, url=url, timeout=120) as comm:
        grads = [np.full(n, rank + 1.0, np.float32) for n in sizes]
        total = sum(sizes)
        for cap in caps:
            bucketer = Bucketer(comm, grads, bucket_cap_bytes=cap,
                                first_bucket_cap_bytes=min(cap, 1 * MiB))
            tails = []
            for _ in range(repeat + 1):
                comm.barrier()
                for index in reversed(range(len(grads))):
                    time.sleep(backward_s * sizes[index] / total)  # simulated backward compute
                    bucketer.mark_ready(index, grads[index])
                start = time.perf_counter()
                bucketer.finish()
                tails.append(time.perf_counter() - start)
                for g in grads:
                    g.fill(rank + 1.0)
            if rank == 0:
                results.put((cap, len(bucketer.buckets), statistics.median(tails[1:])))


def bench_e2e(sizes, backward_ms, repeat=3):
    caps = [1 * MiB, 25 * MiB, 64 * MiB]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="gpucoll-bench-")
    url = f"file://{store}/store"
    procs = [ctx.Process(target=_e2e_rank, args=(r, url, sizes, caps, backward_ms / 1e3, repeat,
                                                  results)) for r in range(2)]
    for p in procs:
        p.start()
    print(f"# end to end, CPU backend, 2 ranks, {len(sizes)} float32 gradients "
          f"({sum(sizes) * 4 / MiB:.0f} MiB), simulated backward {backward_ms:g} ms; "
          f"median of {repeat}")
    print(f"  {'bucket cap':>10} {'buckets':>8} {'last ready -> all averaged':>28}")
    for _ in caps:
        cap, count, tail = results.get(timeout=600)
        print(f"  {cap // MiB:>6} MiB {count:>8} {tail * 1e3:>25.1f} ms")
    for p in procs:
        p.join(60)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-gpu", action="store_true")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--backward-ms", type=float, default=300.0)
    parser.add_argument("--json", metavar="PATH", help="write the GPU part's times and ratios as JSON")
    args = parser.parse_args(argv)
    sizes = mixed_sizes()
    if not args.skip_gpu:
        bench_gpu(sizes, args.json)
    if not args.skip_cpu:
        bench_cpu(sizes)
    if not args.skip_e2e:
        bench_e2e(sizes, args.backward_ms)


if __name__ == "__main__":
    main()
