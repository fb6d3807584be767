"""PowerSGD against exact gradient averaging, in the same ranks and the same run.

    gpucoll run -n 2 bench/bench_powersgd.py [--width 2048] [--layers 4] [--ranks 1,4,16]
        [--repeat 5]

The gradients of ``--layers`` square float32 layers (``width`` x ``width`` weights and their
biases) are averaged per step by gpucoll's ``PowerSGD.reduce`` at each rank in ``--ranks``,
by the ``Bucketer`` (exact: fused buckets, one all-reduce each) and, with torch installed, by
one Gloo ``all_reduce`` of the same bytes. Times are per step, the slowest rank's, best of
``--repeat`` after a warm-up step (PowerSGD's first steps are exact: ``start_step=0`` here so
every timed step compresses). ``rel. error`` is ``|approx - mean| / |mean|`` of the first
compressed step on fresh random gradients (what error feedback then carries over); random
gradients have no low-rank structure, so this is the worst case, not a training gradient's.

On one machine the ranks share memory and cores, and PowerSGD's matrix products cost about as
much as the exact all-reduce they replace. ``--test-hosts RATE`` runs the same job on two real
test hosts instead (Linux network namespaces joined by a veth pair with addresses that exist
only inside them; root and iproute2 needed; see tests/netns.py), one rank each, both
directions of the link limited to RATE by a tbf qdisc (e.g. ``1gbit``), and prints rank 0's
table:

    python bench/bench_powersgd.py --test-hosts 1gbit [--width 2048] [--layers 2]

``--overlap`` times whole training steps instead: backward is simulated, last layer first, by
a fixed NumPy matmul per layer (``--batch`` x width times width x width, the cost of a layer's
weight gradient) after which the layer's gradients are marked ready. Per step: the plain
``Bucketer`` (exact, buckets sent during backward), ``PowerSGD.reduce`` after backward, and the
``Bucketer`` with PowerSGD as its comm hook (each bucket's P sent during backward), beside the
compute alone. The methods take turns, step by step; the median step of each (slowest rank),
and the ratios of those medians, measured in the same run:

    OPENBLAS_NUM_THREADS=1 gpucoll run -n 2 bench/bench_powersgd.py --overlap [--batch 256]
    python bench/bench_powersgd.py --test-hosts 1gbit --overlap --layers 2
"""

from __future__ import annotations

import argparse
import os
import sys
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gpucoll as gc  # noqa: E402
from gpucoll.ddp import Bucketer, PowerSGD  # noqa: E402


def gradients(width: int, layers: int, rank: int, step: int):
    rng = np.random.default_rng([rank, step])
    out = []
    for _ in range(layers):
        out.append(rng.standard_normal((width, width), dtype=np.float32))
        out.append(rng.standard_normal(width, dtype=np.float32))
    return out


def best_time(comm, call, repeat: int, prepare=lambda attempt: None) -> float:
    """Best of ``repeat`` timed ``call(prepare(attempt))`` (preparing is not timed)."""
    best = float("inf")
    for attempt in range(repeat + 1):
        given = prepare(attempt)
        comm.barrier()
        start = time.perf_counter()
        call(given)
        mine = time.perf_counter() - start
        if attempt:                                   # the first is the warm-up
            best = min(best, max(comm.all_gather_object(mine)))
    return best


def simulated_backward(activations, weights, scratch, grads, mark_ready=None) -> None:
    """Backward's compute, last layer first: one matmul per layer (into ``scratch``), then
    that layer's gradients are ready (bias, then weight, as backward produces them)."""
    for layer in reversed(range(len(weights))):
        np.matmul(activations, weights[layer], out=scratch)
        if mark_ready is not None:
            mark_ready(2 * layer + 1, grads[2 * layer + 1])
            mark_ready(2 * layer, grads[2 * layer])


def overlap_steps(comm, args) -> None:
    """The ``--overlap`` table: whole steps with simulated backward compute (module doc)."""
    n = comm.size
    shapes = [g.shape for g in gradients(args.width, args.layers, 0, 0)]
    params = [np.zeros(s, np.float32) for s in shapes]
    rng = np.random.default_rng(comm.rank)
    activations = rng.standard_normal((args.batch, args.width), dtype=np.float32)
    weights = [rng.standard_normal((args.width, args.width), dtype=np.float32) * 0.01
               for _ in range(args.layers)]
    scratch = np.empty_like(activations)
    fresh = [gradients(args.width, args.layers, comm.rank, s) for s in range(args.repeat + 1)]
    caps = dict(bucket_cap_bytes=int(args.bucket_cap_mib * 2**20),
                first_bucket_cap_bytes=min(1 << 20, int(args.bucket_cap_mib * 2**20)))
    bucketer = Bucketer(comm, params, **caps)
    methods = {"compute only": lambda g: simulated_backward(activations, weights, scratch, g),
               "bucketer exact": lambda g: (
                   simulated_backward(activations, weights, scratch, g, bucketer.mark_ready),
                   bucketer.finish())}
    for rank in (int(r) for r in args.ranks.split(",")):
        compressor = PowerSGD(comm, params, rank=rank, start_step=0)
        hooked = Bucketer(comm, params, **caps,
                          comm_hook=PowerSGD(comm, params, rank=rank, start_step=0))
        methods[f"psgd {rank} after bwd"] = lambda g, c=compressor: (
            simulated_backward(activations, weights, scratch, g), c.reduce(g))
        methods[f"psgd {rank} bucketed"] = lambda g, b=hooked: (
            simulated_backward(activations, weights, scratch, g, b.mark_ready), b.finish())
    times = {name: [] for name in methods}
    for attempt in range(args.repeat + 1):            # the first round is the warm-up
        for name, step in methods.items():
            given = [g.copy() for g in fresh[attempt]]
            comm.barrier()
            start = time.perf_counter()
            step(given)
            slowest = max(comm.all_gather_object(time.perf_counter() - start))
            if attempt:
                times[name].append(slowest)
    if comm.rank == 0:
        median = {name: statistics.median(t) for name, t in times.items()}
        print(f"# whole steps, {n} ranks (CPU backend), {args.layers} layers of "
              f"{args.width}x{args.width} float32 + biases, backward simulated by a "
              f"{args.batch}x{args.width} @ {args.width}x{args.width} matmul per layer; "
              f"{len(bucketer.buckets)} bucket(s); median of {args.repeat} steps, slowest rank")
        print(f"# {'method':>20} {'ms/step':>8} {'min':>7} {'max':>7} {'vs exact':>9} "
              f"{'comm. beyond compute':>21}")
        for name, seconds in median.items():
            beyond = seconds - median["compute only"]
            print(f"  {name:>20} {seconds * 1e3:>8.1f} {min(times[name]) * 1e3:>7.1f} "
                  f"{max(times[name]) * 1e3:>7.1f} {median['bucketer exact'] / seconds:>8.2f}x "
                  f"{beyond * 1e3:>18.1f} ms", flush=True)


def on_test_hosts(args) -> None:
    """The job on two namespace hosts, one rank each, over a rate-limited link."""
    sys.path.insert(0, str(ROOT / "tests"))
    import netns

    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"test hosts unavailable here: {reason}")
    with netns.TestHosts(2) as hosts:
        for host in (0, 1):
            hosts.qdisc(host, "tbf", "rate", args.test_hosts, "burst", "256kb",
                        "latency", "100ms")
        env = dict(os.environ, PYTHONPATH=str(ROOT), GPUCOLL_AUTH_TOKEN="powersgd-bench")
        outputs = hosts.run_everywhere(
            lambda k: ["env", f"GLOO_SOCKET_IFNAME={hosts.devices[k]}", sys.executable, "-m",
                       "gpucoll", "run", "-n", "1", "--nnodes", "2", "--node-rank", str(k),
                       "--master-addr", hosts.addrs[0], "--master-port", "29500", "--timeout",
                       "1200", __file__, "--width", str(args.width), "--layers",
                       str(args.layers), "--ranks", args.ranks, "--repeat", str(args.repeat),
                       *(["--overlap", "--batch", str(args.batch), "--bucket-cap-mib",
                           str(args.bucket_cap_mib)] if args.overlap else [])],
            env, timeout=1300, cwd=str(ROOT))
        print(f"# two test hosts, one rank each, link limited to {args.test_hosts} each way")
        for line in outputs[0].splitlines():
            print(line.removeprefix("[rank 0] "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", default="1,4,16", help="PowerSGD ranks, comma list")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--test-hosts", metavar="RATE",
                        help="run on two namespace test hosts over a link of RATE")
    parser.add_argument("--overlap", action="store_true",
                        help="time whole steps with simulated backward compute (module doc)")
    parser.add_argument("--batch", type=int, default=256,
                        help="--overlap: rows of each layer's simulated backward matmul")
    parser.add_argument("--bucket-cap-mib", type=float, default=25.0,
                        help="--overlap: the Bucketers' bucket cap (first bucket: 1 MiB)")
    args = parser.parse_args()
    if args.test_hosts:
        on_test_hosts(args)
        return
    comm = gc.init(backend="cpu")
    if args.overlap:
        overlap_steps(comm, args)
        comm.close()
        return
    n = comm.size
    shapes = [g.shape for g in gradients(args.width, args.layers, 0, 0)]
    params = [np.zeros(s, np.float32) for s in shapes]
    total = sum(int(np.prod(s)) for s in shapes)
    try:
        import torch
        import torch.distributed as dist
        from gpucoll.perf.devices import _Host
        from gpucoll.perf.gloo import GlooSide

        GlooSide(comm, _Host(), timeout=120.0)
    except ImportError:
        torch = None
    if comm.rank == 0:
        print(f"# gradient averaging, {n} ranks (CPU backend), {args.layers} layers of "
              f"{args.width}x{args.width} float32 + biases = {total * 4 / 2**20:.0f} MiB; "
              f"best of {args.repeat}, slowest rank")
        print(f"# {'method':>18} {'MiB sent':>9} {'ms/step':>8} {'vs exact':>9} "
              f"{'rel. error':>11}")
    fresh = [gradients(args.width, args.layers, comm.rank, s) for s in range(args.repeat + 1)]
    mean = [sum(gradients(args.width, args.layers, r, 0)[i] for r in range(n)) / n
            for i in range(len(shapes))]

    def copies(step):
        return [g.copy() for g in fresh[step]]

    bucketer = Bucketer(comm, params)
    exact = best_time(comm, bucketer.reduce, args.repeat, copies)
    rows = [("gpucoll exact", total, exact, None)]
    if torch is not None:
        flat = torch.from_numpy(np.concatenate([g.ravel() for g in fresh[0]]))
        gloo = best_time(comm, dist.all_reduce, args.repeat, lambda s: flat.clone())
        rows.append(("gloo all_reduce", total, gloo, None))
    for rank in (int(r) for r in args.ranks.split(",")):
        compressor = PowerSGD(comm, params, rank=rank, start_step=0)
        first = compressor.reduce(copies(0))
        error = np.sqrt(sum(float(((a - m) ** 2).sum()) for a, m in zip(first, mean))
                        / sum(float((m ** 2).sum()) for m in mean))
        took = best_time(comm, compressor.reduce, args.repeat, copies)
        rows.append((f"powersgd rank {rank}", compressor.wire_elements(), took, error))
    if comm.rank == 0:
        for name, elements, seconds, error in rows:
            err = f"{error:>11.3f}" if error is not None else f"{'-':>11}"
            print(f"  {name:>18} {elements * 4 / 2**20:>9.2f} {seconds * 1e3:>8.1f} "
                  f"{exact / seconds:>8.2f}x {err}", flush=True)
    if torch is not None:
        dist.destroy_process_group()
    comm.close()


if __name__ == "__main__":
    main()
