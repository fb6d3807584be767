"""``Communicator.host_group()``: a communicator of the same ranks for host arrays, beside
the one it came from, on every backend (CPU over Unix and TCP sockets, NCCL emulated and on a
GPU, MPI under mpirun).

Its receives complete in any order (on NCCL the parent's do not), it has its own tag space,
it maps its ranks to the same world ranks (also for a group made by ``new_group``), closing it
leaves the parent working, and a closed or aborted parent refuses to make one.
"""

import time

import numpy as np
import pytest

from clusters import CLUSTERS
from shared_clusters import shared_cluster_pools

pytestmark = pytest.mark.timeout(300)

pool = shared_cluster_pools([c for c in CLUSTERS if c in (
    ("cpu-unix", 1), ("cpu-unix", 3), ("cpu-tcp", 2), ("nccl-emulated", 1),
    ("nccl-emulated", 3), ("nccl-gpu", 1), ("mpi", 3))])


def _out_of_order(host) -> bool:
    """Rank 0 posts a receive from rank 1, then one from rank 2; rank 1 sends only after rank
    0 saw rank 2's message arrive (so the later receive must finish first)."""
    r = host.rank
    if r == 0:
        first, second = np.zeros(4, np.int32), np.zeros(4, np.int32)
        from_1 = host.irecv(first, 1, tag=5)
        from_2 = host.irecv(second, 2, tag=5)
        deadline = time.monotonic() + 30
        while not from_2.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        overtook = from_2.is_completed() and not from_1.is_completed()
        host.send(np.ones(1, np.uint8), 1, tag=6)     # "go"
        from_1.wait(timeout=30)
        return overtook, first.tolist(), second.tolist()
    if r == 1:
        host.recv(np.zeros(1, np.uint8), 0, tag=6)
    if r in (1, 2):
        host.send(np.full(4, 10 * r, np.int32), 0, tag=5)
    return None


def rank_host_group(comm, arr):
    from gpucoll import CommAbortedError

    host = comm.host_group()
    found = {"memory": host.memory, "rank": host.rank, "size": host.size,
             "ranks": host.ranks == comm.ranks, "new object": host is not comm}
    found["sum"] = host.all_reduce(np.full(3, comm.rank + 1.0)).tolist()
    found["objects"] = host.all_gather_object({"rank": comm.rank})
    if comm.size >= 3:
        found["out of order"] = _out_of_order(host)
    if comm.memory == "host" and comm.size >= 2 and comm.rank < 2:
        # the same peer and tag on both communicators: each message stays on its own
        if comm.rank == 0:
            on_parent = comm.isend(np.arange(3.0), 1, tag=0)
            host.send(np.arange(3.0) + 100, 1, tag=0)
            on_parent.wait(timeout=30)
        else:
            via_host, via_parent = np.zeros(3), np.zeros(3)
            host.recv(via_host, 0, tag=0)
            comm.recv(via_parent, 0, tag=0)
            found["tag spaces"] = (via_host.tolist(), via_parent.tolist())
    if comm.size >= 2:
        pair = comm.new_group([comm.size - 1, 0])
        if pair is not None:
            pair_host = pair.host_group()
            found["pair ranks"] = pair_host.ranks
            found["pair sum"] = pair_host.all_reduce(np.full(2, comm.rank + 1)).tolist()
            pair_host.close()
            pair.close()
    host.close()
    try:
        host.all_reduce(np.ones(1))
        found["after close"] = "no error"
    except CommAbortedError:
        found["after close"] = "CommAbortedError"
    y = arr.dev(np.ones(2))
    comm.all_reduce(y)                       # the parent is untouched
    found["parent sum"] = arr.host(y).tolist()
    return found


def test_host_group(pool):
    n = pool.world_size
    results = pool.run(rank_host_group)
    total = float(sum(range(1, n + 1)))
    for r, found in enumerate(results):
        assert found["memory"] == "host" and found["new object"] and found["ranks"]
        assert (found["rank"], found["size"]) == (r, n)
        assert found["sum"] == [total] * 3
        assert found["objects"] == [{"rank": q} for q in range(n)]
        assert found["after close"] == "CommAbortedError"
        assert found["parent sum"] == [float(n)] * 2
        if n >= 2 and r in (0, n - 1):
            assert found["pair ranks"] == [n - 1, 0]
            assert found["pair sum"] == [n + 1] * 2
    if n >= 3:
        overtook, first, second = results[0]["out of order"]
        assert overtook, "the receive posted second did not finish first"
        assert (first, second) == ([10] * 4, [20] * 4)
    if n >= 2 and pool.backend == "cpu":
        assert results[1]["tag spaces"] == ([100.0, 101.0, 102.0], [0.0, 1.0, 2.0])


def test_refused_on_a_closed_or_aborted_communicator():
    import gpucoll
    from gpucoll import CommAbortedError

    for end in ("close", "abort"):
        comm = gpucoll.init(backend="cpu", rank=0, world_size=1, set_default=False)
        getattr(comm, end)()
        with pytest.raises(CommAbortedError):
            comm.host_group()
        comm.close()
