"""comm.grow() on the NCCL backend over the CUDA emulation (tests/emulated_cuda/): two ranks
run, a third process-like thread asks to join through ``init()`` with GPUCOLL_JOIN, the
members grow with ``min_size=3``, and the new NCCL communicator (a fresh unique id among all
three) computes right results on every rank, the newcomer's GPU included.

Ranks are threads (tests/nccl_emulated_harness.py); the CPU backend's grow, the launcher's
replacements and the store protocol are in tests/test_grow.py.
"""

import threading

import numpy as np
import pytest

import gpucoll

from nccl_emulated_harness import _check, _expected, _host, emu, run  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def test_members_grow_to_a_new_nccl_communicator_with_a_newcomer(run, emu, tmp_path,
                                                                   monkeypatch):
    cp = emu.cupy
    joined = {}

    def newcomer():
        try:
            comm = gpucoll.init(backend="nccl", rank=2, world_size=3,
                                url=f"file://{tmp_path}/store0", timeout=10.0, set_default=False)
            joined["result"] = check(comm)
            comm.close()
        except BaseException as exc:   # reported by the assertion below
            joined["error"] = exc

    def check(comm):
        r, n = comm.rank, comm.size
        stacked = np.stack([_host(4, q, (3, 5), "float32") for q in range(n)])
        y = cp.asarray(stacked[r])
        comm.all_reduce(y)
        _check(y.get(), _expected(stacked, "sum"), "all_reduce after grow")
        gathered = comm.all_gather(cp.asarray(stacked[r]))
        _check(gathered.get(), stacked, "all_gather after grow")
        comm.synchronize()
        return r, n, comm.ranks, list(comm.joined), comm.device

    thread = threading.Thread(target=newcomer, name="newcomer", daemon=True)

    def member(comm):
        old_nccl = comm.nccl_comm
        assert comm.grow() is comm                   # nobody waits yet: the same communicator
        if comm.rank == 0:
            monkeypatch.setenv("GPUCOLL_JOIN", "emulated-newcomer")   # read by its init() only
            thread.start()
        bigger = comm.grow(min_size=3)                # waits for the newcomer's ticket
        assert bigger is not comm and bigger.nccl_comm is not old_nccl
        assert old_nccl._status != "aborted"          # the old one stays usable until closed
        result = check(bigger)
        bigger.close()
        return result

    results = run(2, member, timeout=10.0)
    thread.join(20)
    assert not thread.is_alive() and "error" not in joined, joined
    assert results == [(0, 3, [0, 1, 2], [2], 0), (1, 3, [0, 1, 2], [2], 1)]
    assert joined["result"] == (2, 3, [0, 1, 2], [2], 2)
