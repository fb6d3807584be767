"""Rank program for tests/test_multihost.py, run by ``gpucoll run`` on test hosts.

Usage: ``multihost_worker.py collectives TIMEOUT [LARGEST]`` or ``... loop TIMEOUT [OP]``

- ``collectives``: every collective, send/recv, split and new_group across the hosts, each
  checked against NumPy (every rank computes every rank's input, see tests/reference.py),
  at 5 elements and ``LARGEST`` (default 70000: the ring algorithms);
  prints ``LINKS <json>`` (peer -> link kind) and ``CHECKED <n>``.
- ``loop``: prints ``INIT <rank> <time>`` before ``init``, then all_reduces 256 KiB (float32) in a loop (OP ``split``: split the ranks in two
  halves across the hosts, all_reduce on the half, close it); prints ``READY <rank> <time>`` after
  the first ones, then, when a fault stops the loop, ``FAULT <rank> <class> <time> <message>``
  (wall-clock time, comparable across test hosts of one machine) and exits 0 if the error is
  a gpucoll error, 3 otherwise. Stops with ``NOFAULT`` (exit 4) after 60 s without one.

Every rank inits with ``timeout=TIMEOUT``; a rank that fails in ``init`` prints ``FAULT`` too.
"""

import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpucoll  # noqa: E402
from gpucoll.errors import GpucollError  # noqa: E402
from reference import assert_equal_result, make_input, reduce_reference  # noqa: E402

MODE, TIMEOUT = sys.argv[1], float(sys.argv[2])
ARG = sys.argv[3] if len(sys.argv) > 3 else None
RANK = int(os.environ["RANK"])


def fault(exc: BaseException) -> None:
    message = " ".join(str(exc).split())
    print(f"FAULT {RANK} {type(exc).__name__} {time.time():.3f} {message}", flush=True)
    if not isinstance(exc, GpucollError):
        traceback.print_exc()
        sys.exit(3)
    sys.exit(0)


def inputs(seed, size, shape, dtype, op="sum"):
    return np.stack([make_input(seed, r, shape, dtype, op) for r in range(size)])


def check_collectives(comm) -> int:
    """Every collective of ``comm`` against NumPy; the number of results checked."""
    n, r, checked = comm.size, comm.rank, 0
    for count in (5, int(ARG or 70_000)):  # small (tree / recursive doubling) and large (ring) messages
        for dtype in ("float32", "int64"):
            for seed, op in enumerate(("sum", "prod", "min", "max", "avg")):
                every = inputs(seed, n, (count,), dtype, op)
                got = comm.all_reduce(every[r].copy(), op=op)
                assert_equal_result(got, reduce_reference(every, op), f"all_reduce {op} {dtype}", op)
                checked += 1
        every = inputs(count, n, (count,), "float64")
        for root in range(n):
            x = every[r].copy()
            comm.broadcast(x, root=root)
            assert_equal_result(x, every[root], f"broadcast root {root}")
            got = comm.reduce(every[r].copy(), root=root, op="max")
            if r == root:
                assert_equal_result(got, reduce_reference(every, "max"), "reduce", "max")
            got = comm.gather(every[r].copy(), root=root)
            if r == root:
                assert_equal_result(got, every, f"gather root {root}")
            chunks = inputs(count + root, n, (n, count), "int32")
            got = comm.scatter(chunks[root] if r == root else None, root=root,
                               out=np.empty(count, np.int32))
            assert_equal_result(got, chunks[root][r], f"scatter root {root}")
            checked += 4
        assert_equal_result(comm.all_gather(every[r].copy()), every, "all_gather")
        table = inputs(count + 7, n, (n, count), "float32")
        got = comm.reduce_scatter(table[r].copy(), op="sum")
        assert_equal_result(got, reduce_reference(table, "sum")[r], "reduce_scatter")
        got = comm.all_to_all(table[r].copy())
        assert_equal_result(got, table[:, r], "all_to_all")
        checked += 3
    # point to point: every rank sends to the next (across the hosts) and receives from the previous
    every = inputs(11, n, (4096,), "int64")
    right, left = (r + 1) % n, (r - 1) % n
    work = comm.isend(every[r], right)
    got = comm.recv(np.empty(4096, np.int64), left)
    work.wait()
    assert_equal_result(got, every[left], f"recv from {left}")
    comm.barrier()
    checked += 1
    return checked


def collectives() -> None:
    comm = gpucoll.init(backend="cpu", timeout=TIMEOUT)
    print("LINKS " + json.dumps({str(k): v for k, v in comm.transport_kinds.items()}), flush=True)
    checked = check_collectives(comm)
    # split across the hosts: even and odd world ranks (2 per host -> one on each host)
    half = comm.split(comm.rank % 2, key=-comm.rank)
    assert half.size == comm.size // 2, half.size
    assert half.rank == (comm.size // 2 - 1) - comm.rank // 2, (comm.rank, half.rank)
    checked += check_collectives(half)
    # new_group of every rank but 0: one rank on host 0, the others on host 1 (and on)
    group = comm.new_group(list(range(1, comm.size)))
    if comm.rank == 0:
        assert group is None
    else:
        assert group.rank == comm.rank - 1 and group.size == comm.size - 1
        checked += check_collectives(group)
        group.close()
    half.close()
    comm.close()
    print(f"CHECKED {checked}", flush=True)


def loop() -> None:
    print(f"INIT {RANK} {time.time():.3f}", flush=True)
    try:
        comm = gpucoll.init(backend="cpu", timeout=TIMEOUT)
    except BaseException as exc:
        fault(exc)
    x = np.ones(64 << 10, dtype=np.float32)  # 256 KiB
    started = time.monotonic()
    i = 0
    try:
        while time.monotonic() - started < 60:
            x.fill(1.0)
            if ARG == "split":
                half = comm.split(comm.rank % 2)
                half.all_reduce(x[:16])
                half.close()
                expected = half.size
            else:
                comm.all_reduce(x)
                expected = comm.size
            if x[0] != expected:
                raise AssertionError(f"loop #{i}: got {x[0]}, expected {expected}")
            i += 1
            if i == 5:
                print(f"READY {RANK} {time.time():.3f}", flush=True)
    except BaseException as exc:
        fault(exc)
    print(f"NOFAULT {RANK}", flush=True)
    sys.exit(4)


if __name__ == "__main__":
    {"collectives": collectives, "loop": loop}[MODE]()
