"""``Communicator.sendrecv`` on every backend, against NumPy: ring shifts both ways, async Work,
usage errors before anything is sent, mismatches named, a bounded wait.

The conformance part runs on the clusters of ``clusters.py`` (CPU backend over Unix and TCP
sockets at 1-4 ranks, the NCCL backend over the CUDA emulation and on a real GPU, the MPI
backend under mpirun). The shared-memory CPU clusters are left out: point-to-point goes over
a socket there too. NCCL's single group is checked in test_nccl_emulated_sendrecv.py and
test_real_nccl_binding.py; two ranks on one real GPU in test_nccl_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from clusters import CLUSTERS
from mp_harness import error_text, run_ranks
from reference import assert_equal_result, make_input
from shared_clusters import shared_cluster_pools

pytestmark = pytest.mark.timeout(300)

SOCKET_CLUSTERS = [c for c in CLUSTERS if c[0] not in ("cpu-shm", "cpu-shmcopy")]
DTYPES = ("float64", "int32", "float16", "uint8", "complex64", "bool")
LARGE = 1_000_003  # float64: 8 MB each way, sent by every rank at once
COUNTS = (0, 1, 13, LARGE)


pool = shared_cluster_pools(SOCKET_CLUSTERS)


def _host_only(pool):
    if pool.kind != "numpy":
        pytest.skip(f"{pool.name}: NCCL has no tags or size check, and the emulation runs a "
                    f"lone send or receive synchronously (test_nccl_emulated_sendrecv.py)")


def _message(case_id: int, count: int, sender: int) -> np.ndarray:
    """What ``sender`` sends in a case. Shape and dtype depend on the sender, so a rank's ``x``
    and ``out`` differ (they go to and come from different ranks)."""
    dtype = "float64" if count == LARGE else DTYPES[(case_id + sender) % len(DTYPES)]
    shape = (count + sender,) if sender % 2 == 0 else (1, count + sender)
    return make_input(case_id, sender, shape, dtype)


# ---------------------------------------------------------------- rank-side functions
def rank_ring(comm, arr, cases):
    n, r = comm.size, comm.rank
    if n == 1:  # no other rank to exchange with
        return error_text(lambda: comm.sendrecv(arr.dev(np.ones(3)), 0, arr.zeros(3, "float64"), 0))
    right, left = (r + 1) % n, (r - 1) % n
    got = {}
    for case_id, count in cases:
        x = arr.dev(_message(case_id, count, r))
        for direction, dst, src in (("right", right, left), ("left", left, right)):
            expected = _message(case_id, count, src)
            out = arr.zeros(expected.shape, expected.dtype)
            assert comm.sendrecv(x, dst, out, src, tag=case_id % 3) is out
            got[case_id, direction] = arr.host(out)
        np.testing.assert_array_equal(arr.host(x), _message(case_id, count, r))  # x untouched
    return got


def rank_async(comm, arr):
    import gpucoll

    n, r = comm.size, comm.rank
    if n == 1:
        return None
    right, left = (r + 1) % n, (r - 1) % n
    out = arr.zeros((1000,), "float32")
    work = comm.sendrecv(arr.dev(make_input(9100, r, (1000,), "float32")), right, out, left,
                         async_op=True)
    assert isinstance(work, gpucoll.Work)
    assert work.wait(timeout=30) is True
    work.synchronize()  # the host waits too (on a GPU, wait() only orders the stream)
    assert work.is_completed() and work.exception() is None
    assert work.result() is out
    # several in flight at once, then a blocking collective issued after them
    outs = [arr.zeros((4,), "int64") for _ in range(3)]
    works = [comm.sendrecv(arr.dev(np.full(4, 10 * r + i, np.int64)), left, outs[i], right,
                           async_op=True) for i in range(3)]
    y = arr.dev(np.ones(2))
    comm.all_reduce(y)
    results = [w.result(timeout=30) for w in works]
    assert all(result is target for result, target in zip(results, outs))
    return arr.host(out), [arr.host(o).tolist() for o in outs], arr.host(y).tolist(), \
        [repr(w) for w in works]


def rank_usage_errors(comm, arr):
    n, r = comm.size, comm.rank
    if n == 1:
        return None
    peer = (r + 1) % n
    x, out = arr.dev(np.arange(4, dtype=np.float32)), arr.zeros((4,), "float32")
    shared = arr.zeros((8,), "float32")
    errors = {
        "out_is_x": error_text(lambda: comm.sendrecv(x, peer, x, peer)),
        "out_overlaps_x": error_text(lambda: comm.sendrecv(shared[:4], peer, shared[2:6], peer)),
        "dst_self": error_text(lambda: comm.sendrecv(x, r, out, peer)),
        "src_self": error_text(lambda: comm.sendrecv(x, peer, out, r)),
        "dst_range": error_text(lambda: comm.sendrecv(x, n, out, peer)),
        "src_type": error_text(lambda: comm.sendrecv(x, peer, out, "1")),
        "tag_negative": error_text(lambda: comm.sendrecv(x, peer, out, peer, tag=-1)),
        "tag_large": error_text(lambda: comm.sendrecv(x, peer, out, peer, tag=2 ** 32)),
        "tag_type": error_text(lambda: comm.sendrecv(x, peer, out, peer, tag=1.5)),
        "out_not_array": error_text(lambda: comm.sendrecv(x, peer, [0.0] * 4, peer)),
        "out_strided": error_text(lambda: comm.sendrecv(x, peer, shared[::2], peer)),
        "connect_self": error_text(lambda: comm.connect_peers([peer, r])),
        "connect_range": error_text(lambda: comm.connect_peers([n])),
        "connect_type": error_text(lambda: comm.connect_peers(["1"])),
    }
    if arr.xp is np:
        readonly = np.zeros(4, np.float32)
        readonly.flags.writeable = False
        errors["out_readonly"] = error_text(lambda: comm.sendrecv(x, peer, readonly, peer))
    # nothing was sent: the next exchange gets exactly the neighbour's array (after every
    # rank connected with both neighbours, twice: the second time there is nothing to do)
    left = (r - 1) % n
    for _ in range(2):
        comm.connect_peers({left, peer})
    comm.sendrecv(x * (r + 1), peer, out, left)
    return errors, arr.host(out)


def rank_matches_send_and_recv(comm, arr):
    """Rank 0's sendrecv against rank 1's plain recv and send; rank 0's Work is still pending
    when rank 1 has received but not yet sent (rank 1 sends only after rank 0 looked)."""
    if comm.rank > 1:
        return None
    peer = 1 - comm.rank
    if comm.rank == 0:
        out = np.zeros(3, np.int16)
        work = comm.sendrecv(np.arange(5.0), 1, out, 1, async_op=True)
        pending = (work.is_completed(), work.exception())
        comm.send(np.ones(1, np.uint8), 1, tag=7)  # "go": after the sendrecv's message
        assert work.wait(timeout=30) and work.result() is out
        return pending, out.tolist()
    got = np.zeros(5)
    assert comm.recv(got, peer) is got
    comm.recv(np.zeros(1, np.uint8), peer, tag=7)
    comm.send(np.array([7, 8, 9], np.int16), peer)
    return got.tolist()


def rank_own_tags(comm, arr):
    """Each rank sends with its own tag and expects its left neighbour's (``recv_tag``)."""
    n, r = comm.size, comm.rank
    if n == 1:
        return None
    right, left = (r + 1) % n, (r - 1) % n
    out = arr.zeros((3,), "int64")
    comm.sendrecv(arr.dev(np.full(3, r, np.int64)), right, out, left, tag=100 + r,
                  recv_tag=100 + left)
    return arr.host(out).tolist()


def mismatched_pair(comm, kind, exchange):
    """Ranks 0 and 1 exchange with a tag or a size mismatch through
    ``exchange(pair, x, peer, out, tag)``; (its outcome on this rank, then the parent
    communicator's all-reduce, which still works)."""
    from gpucoll import GpucollError

    pair = comm.new_group([0, 1])
    outcome = None
    if pair is not None:
        pair.timeout = 10.0
        peer = 1 - pair.rank
        x = np.arange(5, dtype=np.float32)
        if kind == "tag":  # rank 0 sends tag 0, expects 0; rank 1 sends and expects tag 1
            out, tag = np.zeros(5, np.float32), pair.rank
        else:  # 20 bytes sent each way, received into 16 and 24 bytes
            out, tag = np.zeros(4 + 2 * pair.rank, np.float32), 0
        try:
            exchange(pair, x, peer, out, tag)
            outcome = ("no error", "")
        except GpucollError as exc:
            outcome = (type(exc).__name__, str(exc))
        pair.abort()
        pair.close()
    y = np.ones(2)
    comm.all_reduce(y)  # the parent communicator is untouched
    return outcome, y.tolist()


def _sendrecv_pair(pair, x, peer, out, tag):
    pair.sendrecv(x, peer, out, peer, tag=tag)


def rank_mismatch(comm, arr, kind):
    return mismatched_pair(comm, kind, _sendrecv_pair)


# ---------------------------------------------------------------- tests
def test_ring_shifts_both_ways(pool):
    n = pool.world_size
    cases = [(9000 + i, count) for i, count in enumerate(COUNTS)]
    results = pool.run(rank_ring, cases, timeout=240)
    if n == 1:
        assert results == ["ValueError: sendrecv needs another rank, but this communicator has "
                           "size 1 (dst=0, src=0)"]
        return
    for r, got in enumerate(results):
        right, left = (r + 1) % n, (r - 1) % n
        for case_id, count in cases:
            assert_equal_result(got[case_id, "right"], _message(case_id, count, left),
                                f"rank {r} case {case_id} from the left")
            assert_equal_result(got[case_id, "left"], _message(case_id, count, right),
                                f"rank {r} case {case_id} from the right")


def test_async_work(pool):
    n = pool.world_size
    results = pool.run(rank_async)
    if n == 1:
        return
    for r, (out, outs, y, reprs) in enumerate(results):
        left, right = (r - 1) % n, (r + 1) % n
        assert_equal_result(out, make_input(9100, left, (1000,), "float32"), f"rank {r}")
        assert outs == [[10 * right + i] * 4 for i in range(3)]
        assert y == [float(n)] * 2
        assert all(text.startswith("<") and "sendrecv #" in text for text in reprs), reprs


def test_usage_errors_before_anything_is_sent(pool):
    n = pool.world_size
    results = pool.run(rank_usage_errors)
    if n == 1:
        return
    for r, (errors, out) in enumerate(results):
        left = (r - 1) % n
        assert_equal_result(out, np.arange(4, dtype=np.float32) * (left + 1), f"rank {r}")
        for name in ("out_is_x", "out_overlaps_x"):
            assert errors[name].startswith("ValueError: sendrecv: out must not be x"), errors
        assert errors["dst_self"] == f"ValueError: dst={r} is this rank; send/recv need " \
                                     f"another rank", errors
        assert errors["src_self"].startswith(f"ValueError: src={r} is this rank"), errors
        assert errors["dst_range"].startswith(f"ValueError: dst={n} is out of range"), errors
        assert errors["src_type"] == "TypeError: src must be an int, got str", errors
        for name, shown in (("tag_negative", "-1"), ("tag_large", "4294967296"),
                            ("tag_type", "1.5")):
            assert errors[name] == f"ValueError: tag must be an int in [0, 2**32), got {shown}"
        assert errors["out_not_array"].startswith("TypeError: out must be an array"), errors
        assert "C-contiguous" in errors["out_strided"], errors
        assert errors["connect_self"] == f"ValueError: peer={r} is this rank; send/recv " \
                                         f"need another rank", errors
        assert errors["connect_range"].startswith(f"ValueError: peer={n} is out of range")
        assert errors["connect_type"] == "TypeError: peer must be an int, got str", errors
        if "out_readonly" in errors:
            assert errors["out_readonly"].startswith("ValueError: out is read-only"), errors


def test_matches_plain_send_and_recv(pool):
    _host_only(pool)
    if pool.world_size == 1:
        pytest.skip("needs two ranks")
    results = pool.run(rank_matches_send_and_recv)
    (pending, received), got = results[0], results[1]
    assert pending == (False, None)
    assert received == [7, 8, 9] and got == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(result is None for result in results[2:])


def test_send_and_receive_tags_may_differ(pool):
    results = pool.run(rank_own_tags)
    n = pool.world_size
    if n == 1:
        assert results == [None]
        return
    assert results == [[(r - 1) % n] * 3 for r in range(n)]


@pytest.mark.parametrize("kind", ["tag", "size"])
def test_mismatch_is_named(pool, kind):
    _host_only(pool)
    if pool.world_size == 1:
        pytest.skip("needs two ranks")
    check_mismatch_named(pool.world_size, pool.run(rank_mismatch, kind), kind)


def check_mismatch_named(world_size, results, kind):
    """The ranks of the pair fail, at least one naming the mismatch; the others are untouched
    and the parent communicator works after it."""
    assert all(y == [float(world_size)] * 2 for _, y in results), results
    pair = [outcome for outcome, _ in results[:2]]
    # each rank of the pair fails; at least one names the mismatch (the other may see the
    # pair aborted first)
    assert all(name in ("CollectiveMismatchError", "PeerError", "CommAbortedError")
               for name, _ in pair), pair
    named = [text for name, text in pair if name == "CollectiveMismatchError"]
    assert named, pair
    words = ("tag",) if kind == "tag" else ("bytes", "truncat")
    assert any(word in text for text in named for word in words), named
    assert all(outcome is None for outcome, _ in results[2:])


def unanswered_peer(comm):
    """Rank 1 of the unanswered tests: takes rank 0's message, then waits for one that never
    comes until rank 0 aborts; (what it got, the error that ended its wait)."""
    from gpucoll import CommAbortedError, CommTimeoutError, PeerError

    got = np.zeros(5)
    comm.recv(got, 0)
    try:
        comm.recv(np.zeros(1), 0)
    except (PeerError, CommAbortedError, CommTimeoutError) as exc:
        return got.tolist(), type(exc).__name__
    return got.tolist(), "no error"


def timed_out_then_aborted(comm, first, second):
    """Rank 0 of the unanswered tests: ``first.wait(timeout=1)`` times out and aborts the
    communicator; then the error of a collective, and of ``second.wait()`` (its receive, cut
    short by the abort, has failed by now)."""
    from gpucoll import CommAbortedError, CommTimeoutError

    try:
        first.wait(timeout=1.0)
        waited = "no error"
    except CommTimeoutError as exc:
        waited = str(exc)
    try:
        comm.all_reduce(np.ones(1))
        after = "no error"
    except CommAbortedError as exc:
        after = str(exc)
    try:
        second.wait(timeout=10)
        again = "no error"
    except CommAbortedError:
        again = "CommAbortedError"
    return waited, after, (again, first.is_completed(), type(first.exception()).__name__,
                           repr(second))


def rank_unanswered(comm):
    """Rank 0's sendrecv gets nothing back: its wait(timeout) ends, the communicator is
    aborted. Rank 1 takes rank 0's message, then waits until rank 0 aborts."""
    if comm.rank == 1:
        return unanswered_peer(comm)
    work = comm.sendrecv(np.arange(5.0), 1, np.zeros(5), 1, async_op=True)
    return timed_out_then_aborted(comm, work, work)


def test_wait_is_bounded_and_aborts():
    results = run_ranks(rank_unanswered, 2, env={"GPUCOLL_TIMEOUT": "20"}, timeout=90)
    (waited, after, finished), (got, peer_saw) = results
    assert finished == ("CommAbortedError", True, "CommAbortedError",
                        "<Work sendrecv #1 rank 0 failed: CommAbortedError>"), finished
    assert waited.startswith("rank 0: wait() on sendrecv #1 timed out after 1 s: its recv #1 "
                             "had not finished"), waited
    assert "communicator was aborted" in after, after
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert peer_saw in ("PeerError", "CommAbortedError"), peer_saw
