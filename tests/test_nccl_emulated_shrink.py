"""comm.shrink() on the NCCL backend over the CUDA emulation (tests/emulated_cuda/): a rank
stops taking part, the survivors' watchdog times the collective out, they shrink, and the new
NCCL communicator (a fresh unique id among the survivors) computes right results.

Ranks are threads (tests/nccl_emulated_harness.py). Real NCCL: tests/test_nccl_gpu.py.
"""

import threading

import numpy as np
import pytest

from gpucoll.errors import CommAbortedError, CommTimeoutError, PeerError

from nccl_emulated_harness import _check, _expected, _host, emu, run  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def test_survivors_shrink_to_a_new_nccl_communicator(run, emu):
    cp = emu.cupy
    gone = threading.Event()  # the "dead" rank 1 waits here, taking part in nothing

    def fn(comm):
        if comm.rank == 1:
            assert gone.wait(20)
            return "dead"
        x = cp.ones(8, dtype=cp.float32)
        with pytest.raises((CommTimeoutError, CommAbortedError, PeerError)):
            comm.all_reduce(x)  # #1 never completes: rank 1 never issues it
            comm.synchronize()
        old_nccl = comm.nccl_comm
        new = comm.shrink()
        comm.close()
        assert old_nccl._status == "aborted"
        assert new.nccl_comm is not old_nccl
        r, n = new.rank, new.size
        host = _host(2, r, (3, 5), "float32")
        stacked = np.stack([_host(2, q, (3, 5), "float32") for q in range(n)])
        y = cp.asarray(host)
        new.all_reduce(y)
        _check(y.get(), _expected(stacked, "sum"), "all_reduce after shrink")
        gathered = new.all_gather(cp.asarray(host))
        _check(gathered.get(), stacked, "all_gather after shrink")
        z = cp.asarray(host) if r == n - 1 else cp.zeros((3, 5), dtype=cp.float32)
        new.broadcast(z, root=n - 1)
        _check(z.get(), stacked[n - 1], "broadcast after shrink")
        sub = new.split(0)  # subgroups rebuild from the shrunk communicator
        w = cp.asarray(host)
        sub.all_reduce(w)
        _check(w.get(), _expected(stacked, "sum"), "all_reduce on a split of it")
        new.synchronize()
        result = (new.rank, new.size, new.ranks, new.device, dict(new.lost), sub.ranks)
        sub.close()
        new.close()
        return result

    def survivors_then_release(comm):
        try:
            return fn(comm)
        finally:
            if comm.rank != 1:
                survivors_then_release.done.append(comm.rank)
                if len(survivors_then_release.done) == 2:
                    gone.set()

    survivors_then_release.done = []
    results = run(3, survivors_then_release, timeout=1.0)
    assert results[1] == "dead"
    lost = {1: "did not call shrink within 1 s"}
    assert results[0] == (0, 2, [0, 2], 0, lost, [0, 2])
    assert results[2] == (1, 2, [0, 2], 2, lost, [0, 2])
