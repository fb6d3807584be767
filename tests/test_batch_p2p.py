"""``Communicator.batch_isend_irecv`` on every backend, against NumPy: periodic 1-D halo
exchanges with large faces, a 2x2 grid with a shape and dtype per direction, several
operations with one peer kept in order, async Works, usage errors before anything is sent,
mismatches named, a bounded wait.

The conformance part runs on the clusters of ``clusters.py`` that test_sendrecv.py uses (CPU
backend over Unix and TCP sockets at 1-4 ranks, NCCL over the CUDA emulation and on a real GPU,
MPI under mpirun). NCCL's single group is checked in test_nccl_emulated_batch_p2p.py and
test_real_nccl_binding.py; two ranks on one real GPU in test_nccl_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from clusters import CLUSTERS
from mp_harness import error_text, run_ranks
from reference import assert_equal_result, make_input
from shared_clusters import shared_cluster_pools
from test_sendrecv import (check_mismatch_named, mismatched_pair, timed_out_then_aborted,
                           unanswered_peer)

pytestmark = pytest.mark.timeout(300)

SOCKET_CLUSTERS = [c for c in CLUSTERS if c[0] not in ("cpu-shm", "cpu-shmcopy")]
LARGE = 1_000_003  # float64: 8 MB each way, to both neighbours, on every rank at once
COUNTS = (0, 1, 13, LARGE)
# the 2x2 grid: direction -> (step in x, step in y, shape, dtype, tag) of what goes that way
GRID = {"east": (1, 0, (3, 5), "float64", 1), "west": (-1, 0, (7,), "int32", 2),
        "south": (0, 1, (2, 2), "complex64", 3), "north": (0, -1, (11,), "bool", 4)}

pool = shared_cluster_pools(SOCKET_CLUSTERS)


def _host_only(pool):
    if pool.kind != "numpy":
        pytest.skip(f"{pool.name}: NCCL has no tags or size check")


def _face(case_id: int, count: int, sender: int, direction: str) -> np.ndarray:
    """What ``sender`` sends ``direction`` ("left" / "right") in a 1-D case: the two
    directions differ in shape and dtype (except the large float64 case) and in values."""
    if count == LARGE:
        return make_input(case_id + (500 if direction == "left" else 0), sender, (count,),
                          "float64")
    if direction == "right":
        return make_input(case_id, sender, (count,), "float32")
    return make_input(case_id + 500, sender, (1, count + 2), "int16")


def _grid_neighbour(rank: int, direction: str) -> int:
    step_x, step_y = GRID[direction][:2]
    x, y = rank % 2, rank // 2
    return (y + step_y) % 2 * 2 + (x + step_x) % 2


def _opposite(direction: str) -> str:
    return {"east": "west", "west": "east", "south": "north", "north": "south"}[direction]


# ---------------------------------------------------------------- rank-side functions
def rank_halo(comm, arr, cases):
    import gpucoll as gc

    n, r = comm.size, comm.rank
    if n == 1:  # no neighbour
        x = arr.dev(np.ones(3))
        return error_text(lambda: comm.batch_isend_irecv([gc.P2POp("send", x, 0)]))
    left, right = (r - 1) % n, (r + 1) % n
    got = {}
    for case_id, count in cases:
        to_right = arr.dev(_face(case_id, count, r, "right"))
        to_left = arr.dev(_face(case_id, count, r, "left"))
        from_left = arr.zeros(to_right.shape, to_right.dtype)  # the left's rightward face
        from_right = arr.zeros(to_left.shape, to_left.dtype)
        # receive from the left before the right, send right before left: the peers' lists
        # match in order also on two ranks, where left and right are one rank
        works = comm.batch_isend_irecv([
            gc.P2POp("recv", from_left, left, tag=1), gc.P2POp("recv", from_right, right, tag=2),
            gc.P2POp("send", to_right, right, tag=1), gc.P2POp("send", to_left, left, tag=2)])
        assert len(works) == 4 and all(isinstance(w, gc.Work) for w in works)
        assert [w.wait() for w in works] == [True] * 4
        assert works[0].result() is from_left and works[2].result() is None
        got[case_id] = arr.host(from_left), arr.host(from_right)
        np.testing.assert_array_equal(arr.host(to_right), _face(case_id, count, r, "right"))
    return got


def rank_grid(comm, arr, seed):
    import gpucoll as gc

    if comm.size != 4:
        return None
    r, ops, outs = comm.rank, [], {}
    for direction, (_, _, shape, dtype, tag) in GRID.items():
        outs[direction] = arr.zeros(shape, dtype)  # what comes this way, from the opposite side
        sent = arr.dev(make_input(seed + tag, r, shape, dtype))
        ops += [gc.P2POp("send", sent, _grid_neighbour(r, direction), tag),
                gc.P2POp("recv", outs[direction], _grid_neighbour(r, _opposite(direction)), tag)]
    for work in comm.batch_isend_irecv(ops):
        work.synchronize()
    return {direction: arr.host(out) for direction, out in outs.items()}


def rank_same_peer_in_order(comm, arr):
    """Three messages of different sizes and dtypes, one tag, to the right; three from the
    left; receives and sends interleaved in the list."""
    import gpucoll as gc

    n, r = comm.size, comm.rank
    if n == 1:
        return None
    left, right = (r - 1) % n, (r + 1) % n
    specs = [((2,), "float32"), ((3, 1), "int64"), ((5,), "uint8")]
    mine = [arr.dev(make_input(9300 + i, r, shape, dtype)) for i, (shape, dtype) in
            enumerate(specs)]
    outs = [arr.zeros(shape, dtype) for shape, dtype in specs]
    ops = [gc.P2POp("recv", outs[0], left, 5), gc.P2POp("send", mine[0], right, 5),
           gc.P2POp("recv", outs[1], left, 5), gc.P2POp("send", mine[1], right, 5),
           gc.P2POp("send", mine[2], right, 5), gc.P2POp("recv", outs[2], left, 5)]
    works = comm.batch_isend_irecv(ops)
    works[-1].wait()
    return [arr.host(out) for out in outs]


def rank_matches_send_and_recv(comm, arr):
    """Rank 0's batch (two sends and a receive) against rank 1's blocking recv, recv, send."""
    import gpucoll as gc

    if comm.rank > 1:
        return None
    if comm.rank == 0:
        back = arr.zeros((4,), "int16")
        works = comm.batch_isend_irecv([
            gc.P2POp("send", arr.dev(np.arange(3.0)), 1), gc.P2POp("recv", back, 1),
            gc.P2POp("send", arr.dev(np.arange(5, dtype=np.int32)), 1)])
        works[1].synchronize()
        return arr.host(back).tolist()
    first, second = arr.zeros((3,), "float64"), arr.zeros((5,), "int32")
    comm.recv(first, 0)
    comm.recv(second, 0)
    comm.send(arr.dev(np.array([7, 8, 9, 10], np.int16)), 0)
    return arr.host(first).tolist(), arr.host(second).tolist()


def rank_async(comm, arr):
    import gpucoll as gc

    n, r = comm.size, comm.rank
    if n == 1:
        return None
    left, right = (r - 1) % n, (r + 1) % n
    out = arr.zeros((1000,), "float32")
    x = arr.dev(make_input(9400, r, (1000,), "float32"))
    works = comm.batch_isend_irecv([gc.P2POp("send", x, right), gc.P2POp("recv", out, left)])
    assert works[0].wait(timeout=30) is True  # any one of them waits for the whole batch
    works[0].synchronize()  # the host too (on a GPU, wait() only orders the stream)
    assert all(w.is_completed() and w.exception() is None for w in works)
    assert works[1].result() is out and works[0].result() is None
    # several batches in flight at once, then a blocking collective issued after them
    outs = [arr.zeros((4,), "int64") for _ in range(3)]
    batches = [comm.batch_isend_irecv([gc.P2POp("recv", outs[i], right),
                                       gc.P2POp("send", arr.dev(np.full(4, 10 * r + i)), left)])
               for i in range(3)]
    y = arr.dev(np.ones(2))
    comm.all_reduce(y)
    results = [works[0].result(timeout=30) for works in batches]
    assert all(result is target for result, target in zip(results, outs))
    return arr.host(out), [arr.host(o).tolist() for o in outs], arr.host(y).tolist(), \
        [repr(w) for w in batches[0]]


class _OtherCommunicator:
    def isend(self, *args):
        raise AssertionError("never called")


def rank_usage_errors(comm, arr):
    import gpucoll as gc

    n, r = comm.size, comm.rank
    if n == 1:
        return None
    peer, left = (r + 1) % n, (r - 1) % n
    x, out = arr.dev(np.arange(4, dtype=np.float32)), arr.zeros((4,), "float32")
    shared = arr.zeros((8,), "float32")
    send, recv = (lambda array, to=peer, tag=0: gc.P2POp("send", array, to, tag),
                  lambda array, source=peer, tag=0: gc.P2POp("recv", array, source, tag))

    def batch(*ops):
        return lambda: comm.batch_isend_irecv(list(ops))

    errors = {
        "empty": error_text(batch()),
        "single": error_text(lambda: comm.batch_isend_irecv(send(x))),
        "not_op": error_text(batch(send(x), ("recv", out, peer))),
        "unknown_op": error_text(lambda: gc.P2POp("sned", x, peer)),
        "other_comm": error_text(batch(recv(out), gc.P2POp(_OtherCommunicator().isend, x, peer))),
        "peer_self": error_text(batch(send(x), recv(out, r))),
        "peer_range": error_text(batch(send(x, n))),
        "peer_type": error_text(batch(recv(out, "1"))),
        "recv_strided": error_text(batch(recv(shared[::2]))),
        "send_strided": error_text(batch(send(shared[::2]))),
        "recvs_overlap": error_text(batch(recv(shared[:4]), send(x), recv(shared[2:6], left))),
        "recv_overlaps_send": error_text(batch(send(shared[:4]), recv(shared[3:7]))),
        "recv_is_send": error_text(batch(recv(x), send(x))),
        "tag_negative": error_text(batch(send(x, tag=-1))),
        "tag_large": error_text(batch(recv(out), send(x, tag=2 ** 32))),
        "tag_type": error_text(batch(send(x, tag=1.5))),
        "not_array": error_text(batch(send(x), recv([0.0] * 4))),
    }
    if arr.xp is np:
        readonly = np.zeros(4, np.float32)
        readonly.flags.writeable = False
        errors["recv_readonly"] = error_text(batch(recv(readonly)))
        errors["bad_dtype"] = error_text(batch(send(np.array(["a", "b"]))))
    else:
        errors["host_array"] = error_text(batch(send(np.zeros(4, np.float32))))
    if comm.backend == "mpi":
        errors["mpi_tag"] = error_text(batch(recv(out), send(x, tag=2 ** 32 - 1)))
    # nothing was sent: the next exchange gets exactly the neighbours' arrays (and one array
    # may be sent twice; comm.isend / comm.irecv stand for "send" / "recv")
    from_left, from_right = arr.zeros((4,), "float32"), arr.zeros((4,), "float32")
    y = x * (r + 1)
    for work in comm.batch_isend_irecv([
            gc.P2POp(comm.irecv, from_left, left), gc.P2POp(comm.irecv, from_right, peer),
            gc.P2POp(comm.isend, y, peer), gc.P2POp(comm.isend, y, left)]):
        work.synchronize()
    return errors, arr.host(from_left), arr.host(from_right)


def _batch_pair(pair, x, peer, out, tag):
    """The error comes from the send's Work (the receive's error), or at once."""
    import gpucoll as gc

    works = pair.batch_isend_irecv([gc.P2POp("send", x, peer, tag),
                                    gc.P2POp("recv", out, peer, tag)])
    works[0].wait()


def rank_mismatch(comm, arr, kind):
    return mismatched_pair(comm, kind, _batch_pair)


# ---------------------------------------------------------------- tests
def test_periodic_halo_exchange(pool):
    n = pool.world_size
    cases = [(9200 + i, count) for i, count in enumerate(COUNTS)]
    results = pool.run(rank_halo, cases, timeout=240)
    if n == 1:
        assert results == ["ValueError: batch_isend_irecv: ops[0] (send with peer 0): peer=0 is "
                           "this rank; send/recv need another rank"]
        return
    for r, got in enumerate(results):
        left, right = (r - 1) % n, (r + 1) % n
        for case_id, count in cases:
            from_left, from_right = got[case_id]
            assert_equal_result(from_left, _face(case_id, count, left, "right"),
                                f"rank {r} case {case_id} from the left")
            assert_equal_result(from_right, _face(case_id, count, right, "left"),
                                f"rank {r} case {case_id} from the right")


def test_grid_exchange_with_a_shape_and_dtype_per_direction(pool):
    if pool.world_size != 4:
        pytest.skip("a 2x2 grid needs four ranks")
    results = pool.run(rank_grid, 9500)
    for r, got in enumerate(results):
        for direction, (_, _, shape, dtype, tag) in GRID.items():
            sender = _grid_neighbour(r, _opposite(direction))
            assert_equal_result(got[direction], make_input(9500 + tag, sender, shape, dtype),
                                f"rank {r}: what goes {direction}, from rank {sender}")


def test_several_operations_with_one_peer_keep_their_order(pool):
    n = pool.world_size
    results = pool.run(rank_same_peer_in_order)
    if n == 1:
        return
    specs = [((2,), "float32"), ((3, 1), "int64"), ((5,), "uint8")]
    for r, outs in enumerate(results):
        for i, (shape, dtype) in enumerate(specs):
            assert_equal_result(outs[i], make_input(9300 + i, (r - 1) % n, shape, dtype),
                                f"rank {r} message {i}")


def test_matches_plain_send_and_recv(pool):
    if pool.world_size == 1:
        pytest.skip("needs two ranks")
    results = pool.run(rank_matches_send_and_recv)
    assert results[0] == [7, 8, 9, 10]
    assert results[1] == ([0.0, 1.0, 2.0], [0, 1, 2, 3, 4])
    assert all(result is None for result in results[2:])


def test_async_works(pool):
    n = pool.world_size
    results = pool.run(rank_async)
    if n == 1:
        return
    for r, (out, outs, y, reprs) in enumerate(results):
        left, right = (r - 1) % n, (r + 1) % n
        assert_equal_result(out, make_input(9400, left, (1000,), "float32"), f"rank {r}")
        assert outs == [[10 * right + i] * 4 for i in range(3)]
        assert y == [float(n)] * 2
        assert "batch_isend_irecv #" in reprs[0] and f"ops[0] recv from {right}" in reprs[0]
        assert f"ops[1] send to {left}" in reprs[1], reprs


def test_usage_errors_before_anything_is_sent(pool):
    n = pool.world_size
    results = pool.run(rank_usage_errors)
    if n == 1:
        return
    head = "batch_isend_irecv: "
    for r, (errors, from_left, from_right) in enumerate(results):
        left, right = (r - 1) % n, (r + 1) % n
        assert_equal_result(from_left, np.arange(4, dtype=np.float32) * (left + 1), f"rank {r}")
        assert_equal_result(from_right, np.arange(4, dtype=np.float32) * (right + 1), f"rank {r}")
        expected = {
            "empty": f"ValueError: {head}ops is empty; pass at least one gc.P2POp",
            "single": f"TypeError: {head}ops must be a list of gc.P2POp, got P2POp (wrap the one "
                      f"operation in a list)",
            "not_op": f"TypeError: {head}ops[1] must be a gc.P2POp, got tuple",
            "unknown_op": "ValueError: P2POp: op must be 'send' or 'recv' (or comm.isend / "
                          "comm.irecv), got 'sned'",
            "other_comm": f"ValueError: {head}ops[1]: P2POp('send', float32(4,), peer={right}, "
                          f"tag=0) was made with the isend of another communicator",
            "peer_self": f"ValueError: {head}ops[1] (recv with peer {r}): peer={r} is this rank; "
                         f"send/recv need another rank",
            "peer_range": f"ValueError: {head}ops[0] (send with peer {n}): peer={n} is out of "
                          f"range for a communicator of size {n}",
            "peer_type": f"TypeError: {head}ops[0] (recv with peer '1'): peer must be an int, "
                         f"got str",
            "recv_strided": f"ValueError: {head}ops[0] (recv with peer {right}): array must be "
                            f"C-contiguous",
            "send_strided": f"ValueError: {head}ops[0] (send with peer {right}): array must be "
                            f"C-contiguous",
            "recvs_overlap": f"ValueError: {head}ops[2] (recv with peer {left}) shares memory "
                             f"with ops[0] (recv with peer {right})",
            "recv_overlaps_send": f"ValueError: {head}ops[1] (recv with peer {right}) shares "
                                  f"memory with ops[0] (send with peer {right})",
            "recv_is_send": f"ValueError: {head}ops[1] (send with peer {right}) shares memory "
                            f"with ops[0] (recv with peer {right})",
            "tag_negative": f"ValueError: {head}ops[0] (send with peer {right}): tag must be an "
                            f"int in [0, 2**32), got -1",
            "tag_large": f"ValueError: {head}ops[1] (send with peer {right}): tag must be an int "
                         f"in [0, 2**32), got 4294967296",
            "tag_type": f"ValueError: {head}ops[0] (send with peer {right}): tag must be an int "
                        f"in [0, 2**32), got 1.5",
            "not_array": f"TypeError: {head}ops[1] (recv with peer {right}): array must be an "
                         f"array",
            "recv_readonly": f"ValueError: {head}ops[0] (recv with peer {right}): array is "
                             f"read-only",
            "bad_dtype": f"TypeError: {head}ops[0] (send with peer {right}): ",
            "host_array": f"TypeError: {head}ops[0] (send with peer {right}): ",
            "mpi_tag": f"ValueError: {head}ops[1] (send with peer {right}): tag=4294967295 "
                       f"exceeds this MPI library's largest tag",
        }
        for name, text in errors.items():
            assert text.startswith(expected[name]), (name, text)
        assert ("recv_readonly" in errors) == (pool.kind == "numpy")
        assert ("mpi_tag" in errors) == (pool.backend == "mpi")


@pytest.mark.parametrize("kind", ["tag", "size"])
def test_mismatch_is_named(pool, kind):
    _host_only(pool)
    if pool.world_size == 1:
        pytest.skip("needs two ranks")
    check_mismatch_named(pool.world_size, pool.run(rank_mismatch, kind), kind)


def rank_unanswered(comm):
    """Rank 0's batch gets nothing back: a wait(timeout) on its send's Work ends and names
    the receive; the communicator is aborted. Rank 1 takes rank 0's message, then waits."""
    import gpucoll as gc

    if comm.rank == 1:
        return unanswered_peer(comm)
    works = comm.batch_isend_irecv([gc.P2POp("send", np.arange(5.0), 1),
                                    gc.P2POp("recv", np.zeros(5), 1)])
    return timed_out_then_aborted(comm, works[0], works[1])


def test_wait_is_bounded_and_aborts():
    results = run_ranks(rank_unanswered, 2, env={"GPUCOLL_TIMEOUT": "20"}, timeout=90)
    (waited, after, finished), (got, peer_saw) = results
    assert finished == ("CommAbortedError", True, "CommAbortedError",
                        "<Work batch_isend_irecv #1 ops[1] recv from 1 rank 0 failed: "
                        "CommAbortedError>"), finished
    assert waited.startswith("rank 0: wait() on batch_isend_irecv #1 timed out after 1 s: its "
                             "ops[1] (recv #1 from rank 1) had not finished"), waited
    assert "communicator was aborted" in after, after
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert peer_saw in ("PeerError", "CommAbortedError"), peer_saw
