"""Node-aware all_reduce, broadcast, all_gather and reduce_scatter on (pretend) hosts:
results equal NumPy's for every layout of ranks on hosts, and only one rank per host (the
leader, or a broadcast's root) sends anything over sockets, never to a rank of its own host."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mp_harness import run_ranks
from reference import assert_equal_result, make_input, reduce_reference

pytestmark = pytest.mark.timeout(120)
COUNTS = [0, 1, 13, 100_003]  # empty, one step, and several 64 KiB steps
LAYOUTS = {"two-hosts": "aabb", "interleaved": "aba", "uneven": "aaab", "alone": "abcc"}


def rank_node_aware(rank, size, url, host_ids):
    import gpucoll

    os.environ["GPUCOLL_HOST_ID"] = host_ids[rank]
    os.environ["GPUCOLL_TRANSPORT"] = "auto"
    os.environ["GPUCOLL_SHM_BYTES"] = "64KiB"
    comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=30)
    sent = {}
    exchange = comm._transport.exchange

    def recording(sends, recvs, frame, deadline):
        sent.setdefault(frame.op, set()).update(peer for peer, _ in sends)
        return exchange(sends, recvs, frame, deadline)

    comm._transport.exchange = recording
    got = {}
    for count in COUNTS:
        for dtype, op in (("float64", "sum"), ("int32", "max"), ("float32", "avg")):
            x = make_input(7, rank, (count,), dtype, op)
            got[count, dtype, op, "all_reduce"] = comm.all_reduce(x.copy(), op=op)
            got[count, dtype, op, "all_gather"] = comm.all_gather(x)
            pieces = make_input(9, rank, (size, count), dtype, op)
            got[count, dtype, op, "reduce_scatter"] = comm.reduce_scatter(pieces, op=op)
        for root in range(size):
            b = make_input(11, root, (count,), "float32") if rank == root else np.zeros(
                count, np.float32)
            got[count, root, "broadcast"] = comm.broadcast(b, root=root)
    comm.close()
    return got, {op: sorted(peers) for op, peers in sent.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_node_aware_collectives_match_numpy_and_keep_host_traffic_local(layout):
    size = len(layout)
    results = run_ranks(rank_node_aware, size, list(layout), init=False, timeout=110)
    leaders = {layout.index(h) for h in layout}
    for count in COUNTS:
        for dtype, op in (("float64", "sum"), ("int32", "max"), ("float32", "avg")):
            inputs = np.stack([make_input(7, r, (count,), dtype, op) for r in range(size)])
            pieces = np.stack([make_input(9, r, (size, count), dtype, op) for r in range(size)])
            reduced, scattered = reduce_reference(inputs, op), reduce_reference(pieces, op)
            for rank, (got, _) in enumerate(results):
                what = f"rank {rank} of {layout}, {count} x {dtype} {op}"
                assert_equal_result(got[count, dtype, op, "all_reduce"], reduced, what, op)
                assert_equal_result(got[count, dtype, op, "all_gather"], inputs, what)
                assert_equal_result(got[count, dtype, op, "reduce_scatter"], scattered[rank],
                                    what, op)
        for root in range(size):
            expected = make_input(11, root, (count,), "float32")
            for rank, (got, _) in enumerate(results):
                assert_equal_result(got[count, root, "broadcast"], expected,
                                    f"broadcast from {root}, rank {rank} of {layout}")
    for rank, (_, sent) in enumerate(results):
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            peers = sent.get(op, [])
            assert not [p for p in peers if layout[p] == layout[rank]], (rank, op, peers)
            if op != "broadcast":  # a broadcast's root stands in for its host's leader
                assert rank in leaders or not peers, (rank, op, peers)


def rank_dies_during_node_aware(rank, size, url, host_ids, collective, victim):
    import time

    import gpucoll
    from gpucoll import GpucollError

    os.environ["GPUCOLL_HOST_ID"] = host_ids[rank]
    comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=10)
    x = np.ones(50_000, np.float32)
    calls = {"broadcast": lambda: comm.broadcast(x, root=0),
             "all_gather": lambda: comm.all_gather(x),
             "reduce_scatter": lambda: comm.reduce_scatter(np.ones((size, 50_000), np.float32))}
    calls[collective]()
    if rank == victim:
        os._exit(7)
    start = time.monotonic()
    try:
        for _ in range(5):
            calls[collective]()
        comm.barrier()  # a broadcast's root may finish its sends into socket buffers
    except GpucollError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None


@pytest.mark.parametrize("collective", ["broadcast", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("victim", [1, 2], ids=["non-leader", "leader"])
def test_a_rank_dying_in_a_node_aware_collective_is_named_on_every_survivor(collective, victim):
    layout = "aabb"
    survivors = [r for r in range(4) if r != victim]
    results = run_ranks(rank_dies_during_node_aware, 4, list(layout), collective, victim,
                        init=False, timeout=60, ranks=survivors)
    assert len(results) == len(survivors)
    for rank, result in zip(survivors, results):
        assert result is not None, f"rank {rank} finished without an error"
        kind, message, waited = result
        assert kind in ("PeerError", "CommAbortedError"), (rank, kind, message)
        assert waited < 9.0, (rank, waited, message)  # well before the 10 s timeout
        assert f"peer {victim}" in message or f"[{victim}]" in message or "aborted" in message, \
            (rank, message)
