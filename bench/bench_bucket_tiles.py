"""Tile and unroll sweep of the bucket kernels on a GPU, against a device-to-device copy.

The fused pack / unpack kernels (``kernels/``) give each thread block one tile of one array and
have each thread load ``GPUCOLL_UNROLL`` 16-byte vectors before storing them, with or without
cache hints (``GPUCOLL_CACHE_HINTS``: loads that skip L1, streaming stores), each block
finding its array in the work table's block map or by a binary search (``GPUCOLL_BLOCK_MAP``).
This times the kernels alone (CUDA events around back-to-back launches of a prepared work
table, so the host is not what is measured) for every (unroll, hints, map, tile), on the 1,000 mixed-size float32 arrays
of ``bench_bucket.py`` (64 MiB), in two bucket layouts: the library's (``bucket_offsets``: each
array on a 16-byte boundary, as the DDP bucketer lays buckets out) and back to back (arrays at
any offset, where only arrays that happen to share the 16-byte phase of their bucket position
get vector accesses). Every result is checked against the arrays themselves.

    python bench/bench_bucket_tiles.py [--unrolls 1,2,4,8] [--hints 0,1] [--maps 0,1]
                                       [--tiles 2048,...] [--json F]

Prints, per kernel and layout, the bandwidth in float32 GB/s and as a fraction of the copy's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_bucket import mixed_sizes  # noqa: E402
from gpucoll import kernels  # noqa: E402

#: (label, kernel, array dtype, bucket dtype, scale)
CASES = [("pack f32", "bucket_pack", "float32", "float32", 1.0),
         ("unpack f32 x0.5", "bucket_unpack", "float32", "float32", 0.5),
         ("pack f32->bf16", "bucket_pack", "float32", "bfloat16", 1.0),
         ("unpack bf16->f32 x0.5", "bucket_unpack", "float32", "bfloat16", 0.5)]


def _ints(text: str):
    return [int(word) for word in text.split(",") if word.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unrolls", default="1,2,4,8", help="GPUCOLL_UNROLL values")
    parser.add_argument("--hints", default="0,1", help="GPUCOLL_CACHE_HINTS values (0, 1)")
    parser.add_argument("--maps", default="1", help="GPUCOLL_BLOCK_MAP values (0, 1)")
    parser.add_argument("--tiles", default="2048,4096,8192,16384,32768,65536",
                        help="elements per thread block (multiples of 16)")
    parser.add_argument("--launches", type=int, default=20, help="launches per timing")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    unrolls, tiles, hints = _ints(args.unrolls), _ints(args.tiles), _ints(args.hints)
    maps = _ints(args.maps)
    if not unrolls or min(unrolls) < 1 or not tiles or any(t <= 0 or t % 16 for t in tiles) \
            or not hints or set(hints) - {0, 1} or not maps or set(maps) - {0, 1}:
        parser.error("unrolls must be >= 1, tiles positive multiples of 16, hints and maps "
                     "0 or 1")
    import cupy

    sizes = mixed_sizes()
    total = sum(sizes)
    nbytes = total * 4
    arrays = [cupy.random.standard_normal(n, dtype=cupy.float32) for n in sizes]
    outs = [cupy.empty(n, cupy.float32) for n in sizes]
    flat = cupy.concatenate(arrays)
    layouts = {"aligned": kernels.bucket_offsets(sizes, 4),
               "back-to-back": ([int(o) for o in np.cumsum([0] + sizes[:-1])], total)}
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()

    def per_launch(fn) -> float:
        """GPU seconds per call: ``args.launches`` calls between two events, median of 5."""
        fn()
        cupy.cuda.Device().synchronize()
        times = []
        for _ in range(5):
            start.record()
            for _ in range(args.launches):
                fn()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / args.launches)
        return statistics.median(times)

    copy_dst = cupy.empty_like(flat)
    copy = per_launch(lambda: cupy.copyto(copy_dst, flat))
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    print(f"# {name}, {len(sizes)} float32 arrays, {nbytes / 2 ** 20:.0f} MiB; GPU time per "
          f"launch, median of 5 x {args.launches}; device copy {copy * 1e6:.1f} us "
          f"({nbytes / copy / 1e9:.0f} GB/s)")
    results = {"device": name, "cupy": cupy.__version__, "date": time.strftime("%Y-%m-%d"),
               "copy_seconds": copy, "bytes": nbytes, "rows": []}
    flat_host = cupy.asnumpy(flat)
    failures = 0
    for label, kernel_name, array_dtype, bucket_dtype, scale in CASES:
        dtype = kernels.bfloat16 if bucket_dtype == "bfloat16" else np.dtype(bucket_dtype)
        if dtype is None:
            print(f"# {label}: skipped (no bfloat16 dtype: ml_dtypes is missing)")
            continue
        bits = np.uint16 if dtype.itemsize == 2 else np.uint32  # compared bit for bit
        functions = {}
        for hint in hints:
            for unroll in unrolls:
                for block_map in maps:
                    source, options, expression = kernels.compile_request(
                        kernel_name, array_dtype, bucket_dtype)
                    module = cupy.RawModule(code=source, options=options + (
                        f"-DGPUCOLL_UNROLL={unroll}", f"-DGPUCOLL_CACHE_HINTS={hint}",
                        f"-DGPUCOLL_BLOCK_MAP={block_map}"), name_expressions=[expression])
                    functions[unroll, hint, block_map] = module.get_function(expression)
        pack = kernel_name == "bucket_pack"
        for layout, (offsets, length) in layouts.items():
            index = np.concatenate([np.arange(o, o + n) for o, n in zip(offsets, sizes)])
            in_bucket = np.zeros(length, dtype)
            in_bucket[index] = flat_host.astype(dtype)
            bucket = cupy.empty(length, dtype)
            if pack:
                expected = in_bucket[index].view(bits)
            else:  # the bucket holds the arrays, cast; the arrays get them back, scaled
                bucket.view(bits)[...] = cupy.asarray(in_bucket.view(bits))
                expected = (in_bucket[index].astype(np.float32) * np.float32(scale)).view(np.uint32)
            print(f"\n{label}, {layout}: GB/s (fraction of the copy's)")
            print(f"  {'unroll/hints/map':>16} " + " ".join(f"{t:>14}" for t in tiles))
            for (unroll, hint, block_map), fn in functions.items():
                cells = []
                for tile in tiles:
                    pointers = [a.data.ptr for a in (arrays if pack else outs)]
                    (_, grid, table), = kernels.work_tables(pointers, offsets, sizes, tile)
                    table = cupy.asarray(table)
                    launch_args = [table, np.int32(len(sizes)), np.int64(tile), bucket,
                                   np.float64(scale)]
                    if not pack:
                        launch_args.append(np.uint64(0))  # found_inf: not read by this variant
                    launch_args = tuple(launch_args)
                    if pack:
                        bucket.view(bits).fill(0)
                    else:
                        for out in outs:
                            out.fill(0)
                    seconds = per_launch(lambda: fn((grid,), (kernels.THREADS_PER_BLOCK,),
                                                    launch_args))
                    if pack:
                        got = cupy.asnumpy(bucket.view(bits))[index]
                    else:
                        got = cupy.asnumpy(cupy.concatenate(outs)).view(np.uint32)
                    ok = bool(np.array_equal(got, expected))
                    failures += not ok
                    cells.append(f"{nbytes / seconds / 1e9:6.0f} ({copy / seconds:4.2f})"
                                 + ("" if ok else " WRONG"))
                    results["rows"].append({"case": label, "layout": layout, "unroll": unroll,
                                            "hints": hint, "block_map": block_map,
                                            "tile": tile, "seconds": seconds,
                                            "ok": ok,
                                            "vs_copy": copy / seconds})
                print(f"  {f'{unroll}/{hint}/{block_map}':>16} "
                      + " ".join(f"{c:>14}" for c in cells),
                      flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    if failures:
        print(f"\n{failures} result(s) WRONG", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
