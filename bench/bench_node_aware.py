"""Node-aware collectives against flat socket collectives, on hosts pretended by host ids.

Each rank takes its host id from ``--hosts`` (one letter per rank: ``aabb`` is two hosts of
two ranks) and opens two CPU communicators: ``auto`` (shared memory inside a host, one rank
per host on sockets between hosts) and ``socket`` (every rank on sockets: Unix inside a host,
TCP between hosts). For each collective and size it checks the results against NumPy, then
reports the time per call (best of ``--repeat`` rounds, slowest rank) and the bytes that
crossed between hosts per call (summed over ranks, counted at the transport). On one machine
the "network" is loopback, so the bytes column is the portable result; the times show what
the shared-memory half buys.

    gpucoll run -n 4 bench/bench_node_aware.py --hosts aabb [--sizes 64KiB,1MiB,16MiB]

``--test-hosts RATE`` runs the same job on two real test hosts instead (Linux network
namespaces joined by a veth pair, addresses that exist only inside them; root and iproute2
needed; see tests/netns.py), two ranks each, with both directions of the link limited to
RATE by a tbf qdisc (e.g. ``1gbit``; ``none``: unlimited), and prints rank 0's table:

    python bench/bench_node_aware.py --test-hosts 1gbit
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gpucoll as gc  # noqa: E402
from gpucoll.perf.options import parse_size  # noqa: E402

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


def count_cross_host_bytes(comm, hosts: str) -> dict:
    """Wrap the communicator's transport so that bytes sent to other hosts are counted, per
    collective (the barriers and timing exchanges of the benchmark itself are not)."""
    counter: dict = {}
    exchange, me = comm._transport.exchange, hosts[comm.rank]

    def counting(sends, recvs, frame, deadline):
        crossed = sum(len(buf) for peer, buf in sends if hosts[peer] != me)
        counter[frame.op] = counter.get(frame.op, 0) + crossed
        return exchange(sends, recvs, frame, deadline)

    comm._transport.exchange = counting
    return counter


def call(comm, name: str, x: np.ndarray, pieces: np.ndarray):
    if name == "all_reduce":
        return comm.all_reduce(x.copy())
    if name == "broadcast":
        return comm.broadcast(x.copy() if comm.rank == 0 else np.zeros_like(x), root=0)
    if name == "all_gather":
        return comm.all_gather(x)
    return comm.reduce_scatter(pieces)


def expected(name: str, size: int, rank: int, count: int) -> np.ndarray:
    rows = np.stack([np.full(count, r + 1.0, np.float32) for r in range(size)])
    if name == "all_reduce":
        return rows.sum(axis=0)
    if name == "broadcast":
        return rows[0]
    if name == "all_gather":
        return rows
    return np.full(count, sum((r + 1.0) * (rank + 1) for r in range(size)), np.float32)


def best_of(comm, fn, repeat: int, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return float(comm.all_gather(np.array([best])).max())


def on_test_hosts(args) -> None:
    """Run the job on two namespace hosts, two ranks each, over a rate-limited link."""
    sys.path.insert(0, str(ROOT / "tests"))
    import netns

    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"test hosts unavailable here: {reason}")
    with netns.TestHosts(2) as hosts:
        if args.test_hosts != "none":
            for host in (0, 1):
                hosts.qdisc(host, "tbf", "rate", args.test_hosts, "burst", "256kb",
                            "latency", "100ms")
        env = dict(os.environ, PYTHONPATH=str(ROOT), GPUCOLL_AUTH_TOKEN="node-aware-bench")
        outputs = hosts.run_everywhere(
            lambda k: [sys.executable, "-m", "gpucoll", "run", "-n", "2", "--nnodes", "2",
                       "--node-rank", str(k), "--master-addr", hosts.addrs[0], "--master-port",
                       "29500", "--timeout", "1200", __file__, "--hosts", "aabb", "--sizes",
                       args.sizes, "--repeat", str(args.repeat)],
            env, timeout=1300, cwd=str(ROOT))
        print(f"# two test hosts, link limited to {args.test_hosts} each way")
        for line in outputs[0].splitlines():
            print(line.removeprefix("[rank 0] "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="aabb", help="a host letter per rank")
    parser.add_argument("--sizes", default="64KiB,1MiB,16MiB", help="bytes per rank's input")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--test-hosts", metavar="RATE",
                        help="run on two namespace test hosts over a link of RATE (or none)")
    args = parser.parse_args()
    if args.test_hosts:
        on_test_hosts(args)
        return
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if len(args.hosts) != size:
        raise SystemExit(f"--hosts {args.hosts!r} names {len(args.hosts)} ranks, the job has {size}")
    os.environ["GPUCOLL_HOST_ID"] = f"host-{args.hosts[rank]}"
    comms = {mode: gc.init(backend="cpu", transport=mode, set_default=False)
             for mode in ("auto", "socket")}
    counters = {mode: count_cross_host_bytes(comm, args.hosts) for mode, comm in comms.items()}
    if rank == 0:
        print(f"# {size} ranks on hosts {args.hosts}, float32, best of {args.repeat} "
              f"(time: slowest rank); cross-host bytes per call, all ranks")
        print("| collective | bytes/rank | node-aware ms | flat ms | flat/node-aware "
              "| cross-host MB node-aware | cross-host MB flat |")
        print("|---|---:|---:|---:|---:|---:|---:|")
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        count = nbytes // 4
        x = np.full(count, rank + 1.0, np.float32)
        pieces = np.stack([np.full(count // size, (rank + 1.0) * (q + 1), np.float32)
                           for q in range(size)])
        for name in COLLECTIVES:
            row = {}
            for mode, comm in comms.items():
                got = call(comm, name, x, pieces)
                want = expected(name, size, rank, count // size if name == "reduce_scatter"
                                else count)
                if not np.array_equal(got, want):
                    raise SystemExit(f"rank {rank}: {name} over {mode} gave a wrong result")
                calls = max(1, min(20, (64 << 20) // max(nbytes, 1)))
                before = counters[mode].get(name, 0)
                seconds = best_of(comm, lambda: call(comm, name, x, pieces), args.repeat, calls)
                per_call = (counters[mode].get(name, 0) - before) / (args.repeat * calls + 1)
                crossed = float(comm.all_reduce(np.array([per_call]))[0])
                row[mode] = (seconds, crossed)
            if rank == 0:
                (aware, aware_bytes), (flat, flat_bytes) = row["auto"], row["socket"]
                print(f"| {name} | {nbytes} | {aware * 1e3:.3f} | {flat * 1e3:.3f} | "
                      f"{flat / aware:.2f} | {aware_bytes / 1e6:.2f} | {flat_bytes / 1e6:.2f} |")
    for comm in comms.values():
        comm.close()


if __name__ == "__main__":
    main()
