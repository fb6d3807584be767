"""Host-side cost of one eager data-parallel step on the NCCL backend, measurable without a GPU.

On an H200, ``bench_ddp_graph.py``'s eager step (200 float32 gradients, 8 MiB, 15 buckets of
256 KiB, bfloat16 on the wire, a loss scale) took 4.8 ms, nearly all of it the host issuing
work, against 0.11 ms for the same step captured in a CUDA graph. This runs that step,
``bucketer.reduce(grads, loss_scale=...)``, on the setup of ``bench_nccl_host.py``: the NCCL
backend over the test suite's emulation of CuPy and NCCL (``tests/emulated_cuda/``), as rank
0 of two, with the NCCL calls, CUDA events and the stream lookup replaced by no-ops, and here
also the kernel launches (``kernels._kernel`` returns a function that does nothing) and the
streams' waits on events. The gradients and the buckets are arrays whose ``data``, ``flags``,
``shape``, ``dtype``... are plain attributes, about what CuPy's cost; their
``__cuda_array_interface__`` is still built on each read, as CuPy's is. What is measured is
gpucoll's own Python per step: ``mark_ready`` for each gradient, and per bucket the pack's
host path, the all-reduce and its ``Work``, the unpack's host path. A proxy for tracking
regressions, not a GPU measurement.

Prints the median and best time per step over ``--rounds`` of ``--steps`` steps. With
``--instructions`` it counts instead: the script under ``valgrind --tool=cachegrind
--cache-sim=no`` with 20 and with 120 steps, the difference per step, which does not depend on
the machine's load.

    python bench/bench_ddp_host.py [--arrays 200] [--mib 8] [--bucket-kib 256] [--steps 200]
    python bench/bench_ddp_host.py --instructions
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_nccl_host  # noqa: E402  (puts the tree and tests/ on the path)
from bench_ddp_graph import LOSS_SCALE, gradient_sizes  # noqa: E402
from gpucoll import kernels  # noqa: E402
from gpucoll.ddp import Bucketer  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
_INSTRUCTION_STEPS = (20, 120)  # --instructions: two runs, their difference per step


def _no_kernel(*args, **kwargs):
    """Stands for a compiled pack / unpack kernel: a launch that does nothing."""
    return lambda grid, block, args: None


def setup(arrays: int, mib: int, bucket_kib: int):
    """A Bucketer over the no-op NCCL communicator and its gradients, after two warm-up steps
    (the buckets' buffers allocated, the checks and launch plans remembered)."""
    comm, cupy = bench_nccl_host.setup()
    kernels._kernel = _no_kernel
    cupy.cuda.runtime.streamWaitEvent = lambda stream, event, flags=0: None
    sizes = gradient_sizes(arrays, mib * MiB)
    bucketer = Bucketer(comm, [np.zeros(n, np.float32) for n in sizes],
                        bucket_cap_bytes=bucket_kib * KiB, first_bucket_cap_bytes=bucket_kib * KiB,
                        compression="bf16")
    grads = [bench_nccl_host.cached_attributes(cupy.zeros(n, dtype=cupy.float32))
             for n in sizes]
    bucketer.reduce(grads, loss_scale=LOSS_SCALE)   # allocates the buckets' buffers
    for bucket in bucketer._buckets:                # which then read as CuPy's would
        bucket.buffer = bench_nccl_host.cached_attributes(bucket.buffer)
    bucketer.reduce(grads, loss_scale=LOSS_SCALE)
    return comm, bucketer, grads


def run_steps(bucketer, grads, count: int) -> None:
    """``count`` eager steps; what the watchdog's polls would release is released every 10."""
    streams = bucketer.comm._watchdog._streams
    for i in range(count):
        bucketer.reduce(grads, loss_scale=LOSS_SCALE)
        if i % 10 == 9:
            for queue in streams.values():
                while queue:
                    queue.popleft().release()


def instructions(args) -> float:
    """Instructions per step: two runs under cachegrind, their difference."""
    counts = [bench_nccl_host.count_instructions(
        [os.path.abspath(__file__), "--loop", "--steps", str(steps), "--arrays", str(args.arrays),
         "--mib", str(args.mib), "--bucket-kib", str(args.bucket_kib)])
        for steps in _INSTRUCTION_STEPS]
    return (counts[1] - counts[0]) / (_INSTRUCTION_STEPS[1] - _INSTRUCTION_STEPS[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrays", type=int, default=200, help="gradients (default 200)")
    parser.add_argument("--mib", type=int, default=8, help="MiB of float32 gradients in all")
    parser.add_argument("--bucket-kib", type=int, default=256, help="bucket cap in KiB")
    parser.add_argument("--steps", type=int, default=200, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per step under valgrind instead of timing")
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)  # one run counted
    args = parser.parse_args(argv)
    if min(args.arrays, args.mib, args.bucket_kib, args.steps, args.rounds) <= 0:
        parser.error("--arrays, --mib, --bucket-kib, --steps and --rounds must be positive")
    if args.instructions:
        per_step = instructions(args)
        print(f"eager step, {args.arrays} arrays: {per_step:.0f} instructions/step, "
              f"{per_step / args.arrays:.0f} per array")
        return 0
    comm, bucketer, grads = setup(args.arrays, args.mib, args.bucket_kib)
    if args.loop:
        run_steps(bucketer, grads, args.steps)
        return 0
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        run_steps(bucketer, grads, args.steps)
        times.append((time.perf_counter() - start) / args.steps * 1e6)
    comm.close()
    print(f"eager step, {args.arrays} arrays in {len(bucketer.buckets)} buckets: median "
          f"{statistics.median(times):.0f} us/step, best {min(times):.0f} "
          f"({args.rounds} rounds x {args.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
