"""comm.shrink() on the CPU backend: real processes, one of them SIGKILLed mid-loop; the
survivors catch the error, shrink, and every collective is right on the new communicator.

The NCCL backend's shrink is tested over the CUDA emulation in tests/test_nccl_emulated_shrink.py.
"""

import os
import signal
import time

import numpy as np
import pytest

from gpucoll.errors import CommAbortedError, CommTimeoutError, PeerError
from gpucoll.rendezvous import MemoryStore, PrefixStore
from gpucoll.rendezvous.survivors import agree_on_survivors, publish_death

from mp_harness import run_ranks
from reference import assert_equal_result, make_input, reduce_reference

pytestmark = pytest.mark.timeout(90)

FAILURES = (PeerError, CommTimeoutError, CommAbortedError)
SHORT = {"GPUCOLL_TIMEOUT": "3"}  # the survivors wait this long for the unrecorded dead rank


def check_every_collective(comm, seed=5, count=37):
    """Run every collective on ``comm`` and compare with NumPy; return what was checked."""
    n, r = comm.size, comm.rank
    inputs = np.stack([make_input(seed, k, (count,), "float64") for k in range(n)])
    mine = inputs[r].copy()
    for op in ("sum", "max", "avg"):
        assert_equal_result(comm.all_reduce(mine.copy(), op), reduce_reference(inputs, op),
                            f"all_reduce {op}", op)
    for root in range(n):
        x = mine.copy() if r == root else np.empty(count)
        assert_equal_result(comm.broadcast(x, root), inputs[root], f"broadcast root {root}")
        got = comm.reduce(mine.copy(), root)
        if r == root:
            assert_equal_result(got, reduce_reference(inputs, "sum"), f"reduce root {root}")
        got = comm.gather(mine, root)
        if r == root:
            assert_equal_result(got, inputs, f"gather root {root}")
        blocks = np.stack([make_input(seed + 1, k, (count,), "float64") for k in range(n)])
        got = comm.scatter(blocks if r == root else None, root, out=np.empty(count))
        assert_equal_result(got, blocks[r], f"scatter root {root}")
    assert_equal_result(comm.all_gather(mine), inputs, "all_gather")
    per_rank = np.stack([make_input(seed + 2, k, (n, count), "float64") for k in range(n)])
    assert_equal_result(comm.reduce_scatter(per_rank[r].copy()),
                        reduce_reference(per_rank, "sum")[r], "reduce_scatter")
    assert_equal_result(comm.all_to_all(per_rank[r]), per_rank[:, r], "all_to_all")
    if n > 1:
        peer = (r + 1) % n
        comm.send(mine, peer)
        assert_equal_result(comm.recv(np.empty(count), (r - 1) % n), inputs[(r - 1) % n],
                            "recv from the previous rank")
    comm.barrier()
    return ["all_reduce", "broadcast", "reduce", "gather", "scatter", "all_gather",
            "reduce_scatter", "all_to_all", "send/recv", "barrier"]


def _loop_until_killed(comm, victim, kill_at, delays=None):
    """All-reduce in a loop; ``victim`` SIGKILLs itself at iteration ``kill_at``. Survivors
    catch the failure, wait ``delays[rank]`` s (a slow survivor), shrink, check everything."""
    x = np.ones(1000)
    caught = None
    for step in range(50):
        if comm.rank == victim and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.all_reduce(x)
        except FAILURES as exc:
            caught = (step, type(exc).__name__)
            break
    assert caught is not None, "the loop finished without seeing the dead rank"
    old_rank, old_ranks = comm.rank, comm.ranks
    time.sleep((delays or {}).get(comm.rank, 0.0))
    new = comm.shrink()
    comm.close()
    try:
        checked = check_every_collective(new)
        # subgroups rebuild from the shrunk communicator, world ranks kept
        pair = new.split(new.rank % 2)
        group_sum = pair.all_reduce(np.array([float(new.ranks[new.rank])]))
        return dict(old=old_rank, old_ranks=old_ranks, rank=new.rank, size=new.size,
                    ranks=new.ranks, me=new.to_world(new.rank), lost=dict(new.lost),
                    checked=checked, split_ranks=pair.ranks, group_sum=float(group_sum[0]),
                    caught=caught)
    finally:
        new.close()


# (4, 2, {1: 1.5}): rank 1 is a slow survivor, calling shrink 1.5 s after the others; it is kept
@pytest.mark.parametrize("world,victim,delays", [(4, 2, {1: 1.5}), (3, 0, None)])
def test_survivors_shrink_and_every_collective_is_right(world, victim, delays):
    survivors = [r for r in range(world) if r != victim]
    results = run_ranks(_loop_until_killed, world, victim, 4, delays, env=SHORT, ranks=survivors,
                        timeout=60)
    for new_rank, result in enumerate(results):
        assert result["old"] == survivors[new_rank]
        assert result["size"] == world - 1 and result["rank"] == new_rank
        assert result["ranks"] == survivors and result["me"] == survivors[new_rank]
        assert list(result["lost"]) == [victim]
        assert "did not call shrink within 3 s" in result["lost"][victim]
        assert len(result["checked"]) == 10
        expected_split = [w for i, w in enumerate(survivors) if i % 2 == new_rank % 2]
        assert result["split_ranks"] == expected_split
        assert result["group_sum"] == float(sum(expected_split))


def _shrink_healthy(comm):
    before = comm.all_reduce(np.array([1.0]))
    new = comm.shrink()
    try:
        with pytest.raises(CommAbortedError, match="aborted"):
            comm.all_reduce(np.array([1.0]))
        with pytest.raises(CommAbortedError, match="closed communicator"):
            comm.close()
            comm.shrink()
        with pytest.raises(ValueError, match="timeout must be a positive"):
            new.shrink(timeout=0)
        return float(before[0]), new.ranks, float(new.all_reduce(np.array([2.0]))[0])
    finally:
        new.close()


def test_shrink_of_a_healthy_communicator_keeps_every_rank_and_aborts_the_old_one():
    results = run_ranks(_shrink_healthy, 3, env=SHORT, timeout=60)
    assert results == [(3.0, [0, 1, 2], 6.0)] * 3


# ---------------------------------------------------------------- the agreement alone
def test_agreement_skips_recorded_dead_ranks_and_refuses_a_latecomer():
    root = MemoryStore(timeout=5)
    store = PrefixStore("world1", root)
    publish_death(root, 3, "signal SIGKILL")
    results = {}
    import threading

    def survivor(rank):
        results[rank] = agree_on_survivors(store, root, rank, [0, 1, 2, 3], "shrink1", 30.0)

    threads = [threading.Thread(target=survivor, args=(r,)) for r in (0, 2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert all(t.is_alive() for t in threads), "decided without rank 1, which is neither dead nor late"
    survivor(1)
    for t in threads:
        t.join(10)
    assert time.monotonic() - started < 10  # the 30 s window was not waited out
    for rank in (0, 1, 2):
        assert results[rank].members == [0, 1, 2]
        assert results[rank].lost == {3: "signal SIGKILL"}
    # a rank registering after the decision is told it is out, not silently given a comm
    with pytest.raises(CommAbortedError, match=r"agreed on ranks \[0, 1, 2\] before this rank"):
        agree_on_survivors(store, root, 3, [0, 1, 2, 3], "shrink1", 30.0)
