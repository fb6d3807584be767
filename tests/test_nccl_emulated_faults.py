"""The NCCL backend over the CUDA emulation (tests/emulated_cuda/): the watchdog,
GPUCOLL_DEBUG, split, lifetime, timeouts, and the emulation's own checks.

Ranks are threads (see tests/nccl_emulated_harness.py). Real NCCL on a real GPU is tested by
tests/test_nccl_gpu.py.
"""

import threading
import time

import numpy as np
import pytest

import gpucoll
from gpucoll.errors import CollectiveMismatchError, CommAbortedError, CommTimeoutError

from emulated_cuda import NcclError
from nccl_emulated_harness import _calls, _Foreign, _wait_until, emu, run  # noqa: F401

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- watchdog
def _second_all_reduce_stalls(run, emu, rank_0, timeout):
    """Two ranks run all_reduce #1; rank 1 never issues #2, rank 0 runs ``rank_0(comm, x,
    stream)`` with ``stream`` stalled (so its #2 cannot complete). Rank 0's result."""
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        x = cp.ones(16, dtype=cp.float32)
        comm.all_reduce(x)  # #1 on both ranks
        if comm.rank == 1:
            assert finished.wait(10)  # never issues #2
            return "skipped"
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            emu.stall(stream)
            return rank_0(comm, x, stream)
        finally:
            finished.set()

    result, skipped = run(2, fn, timeout=timeout)
    assert skipped == "skipped"
    return result


def test_watchdog_names_the_rank_that_never_arrived(run, emu):
    def rank_0(comm, x, stream):
        started = time.monotonic()
        comm.all_reduce(x, stream=stream)
        assert _wait_until(lambda: comm.nccl_comm._status == "aborted")
        assert 0.5 <= time.monotonic() - started < 4
        with pytest.raises(CommTimeoutError) as info:
            comm.all_reduce(x)
        with pytest.raises(CommTimeoutError):
            comm.synchronize()
        comm.close()  # after close() a call says so, not the earlier timeout (as on a GPU)
        with pytest.raises(CommAbortedError, match="rank 0: communicator is closed"):
            comm.all_reduce(x)
        return str(info.value)

    message = _second_all_reduce_stalls(run, emu, rank_0, timeout=0.5)
    assert "rank 0: all_reduce #2 did not complete on GPU 0 within 0.5 s" in message, message
    assert "ranks that had not reached it: 1 (of 2)" in message, message
    assert "the communicator was aborted, create a new one" in message, message


def test_barrier_timeout_names_the_missing_rank(run, emu):
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        comm.barrier()  # #1
        if comm.rank == 1:
            assert finished.wait(10)
            return None
        try:
            stream = cp.cuda.Stream()
            with stream:
                emu.stall(stream)  # the barrier's all-reduce waits for rank 1, which never comes
                with pytest.raises(CommTimeoutError) as info:
                    comm.barrier(timeout=0.3)
            return str(info.value)
        finally:
            finished.set()

    message, _ = run(2, fn)
    assert "rank 0: barrier #2 did not complete on GPU 0 within 0.3 s; ranks that had not " \
           "reached it: 1 (of 2)" in message, message


def test_asynchronous_nccl_error_aborts(run, emu):
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(4)
        comm.all_reduce(x)  # completed: the error is not blamed on it
        emu.inject_async_error(comm.nccl_comm, "peer 1 vanished")
        assert _wait_until(lambda: comm.nccl_comm._status == "aborted")
        with pytest.raises(CommAbortedError,
                           match=r"rank 0: NCCL reported an asynchronous error: "
                                 r"NCCL_ERROR_REMOTE_ERROR: peer 1 vanished; the communicator "
                                 r"was aborted, create a new one"):
            comm.all_reduce(x)
        assert comm.nccl_comm._status == "aborted"
        return True

    assert run(1, fn) == [True]


def test_nccl_refusing_a_call_aborts(run, emu, monkeypatch):
    monkeypatch.setenv("GPUCOLL_WATCHDOG_INTERVAL", "60")  # see the split case below
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(4)
        comm.nccl_comm.abort()  # behind gpucoll's back: NCCL refuses what comes next
        with pytest.raises(CommAbortedError, match=r"rank 0: all_reduce #1: NCCL refused the "
                                                   r"call: NCCL_ERROR_INVALID_ARGUMENT"):
            comm.all_reduce(x)
        with pytest.raises(CommAbortedError, match="NCCL refused the call"):
            comm.all_reduce(x)
        return True

    assert run(1, fn) == [True]


# ---------------------------------------------------------------- GPUCOLL_DEBUG
def test_debug_mismatch_is_reported_on_every_rank_before_anything_runs(run, emu, monkeypatch):
    monkeypatch.setenv("GPUCOLL_DEBUG", "1")
    cp = emu.cupy

    def fn(comm):
        assert comm._debug
        x = cp.ones(4, dtype=cp.float32)
        comm.all_reduce(x)  # #1 agrees
        comm.broadcast(x, root=1)  # #2 agrees
        issued = len(_calls(emu, comm))
        y = cp.ones(4 if comm.rank == 0 else 5, dtype=cp.float32)
        with pytest.raises(CollectiveMismatchError) as info:
            comm.all_reduce(y)
        assert len(_calls(emu, comm)) == issued  # nothing enqueued
        np.testing.assert_array_equal(y.get(), np.ones(y.size))
        with pytest.raises(CommAbortedError):  # a mismatch aborts, as on the CPU backend
            comm.all_reduce(x)
        return str(info.value), info.value.peer

    for message, peer in run(2, fn):
        assert peer == 1
        assert "collective mismatch at op #3: rank 0 called all_reduce " \
               "#3(dtype=float32, shape=(4,), op=sum), but rank 1 called all_reduce " \
               "#3(dtype=float32, shape=(5,), op=sum)" in message, message


def test_debug_names_the_rank_with_another_root(run, emu, monkeypatch):
    monkeypatch.setenv("GPUCOLL_DEBUG", "1")
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(3, dtype=cp.int64)
        for _ in range(4):  # the signatures of old collectives are cleaned up as it goes
            comm.all_reduce(x)
        with pytest.raises(CollectiveMismatchError) as info:
            comm.broadcast(x, root=2 if comm.rank == 2 else 0)
        return str(info.value)

    for message in run(3, fn):
        assert "rank 0 (and 1 more) called broadcast #5(dtype=int64, shape=(3,), root=0), " \
               "but rank 2 called broadcast #5(dtype=int64, shape=(3,), root=2)" in message


# ---------------------------------------------------------------- split and groups
def test_split_and_new_group(run, emu):
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        sub = comm.split([0, 0, 1][r])
        assert (sub.rank, sub.size) == ([0, 1, 0][r], [2, 2, 1][r])
        assert (sub.backend, sub.device, sub.local_rank, sub.local_size) == \
            ("nccl", comm.device, sub.rank, sub.size)
        assert (sub.nccl_comm.rank_id(), sub.nccl_comm.size()) == (sub.rank, sub.size)
        x = cp.full(3, r + 1.0)
        assert sub.all_reduce(x) is x
        np.testing.assert_array_equal(x.get(), np.full(3, [3.0, 3.0, 3.0][r]))
        reverse = comm.split(0, key=-r)
        assert reverse.rank == 2 - r
        gathered = reverse.all_gather(cp.full(1, r, dtype=cp.int32))
        np.testing.assert_array_equal(gathered.get(), [[2], [1], [0]])
        partial = comm.split(None if r == 1 else 5)
        assert (partial is None) if r == 1 else (partial.size == 2)
        assert comm.split(-3) is None
        group = comm.new_group([2, 0])
        if r == 1:
            assert group is None
        else:
            assert group.rank == {2: 0, 0: 1}[r]
            y = cp.full(2, 10.0 * r)
            group.broadcast(y, root=0)  # from parent rank 2
            np.testing.assert_array_equal(y.get(), [20.0, 20.0])
            assert group.barrier() is None
        z = cp.ones(2)
        comm.all_reduce(z)  # the parent still works; splits used numbers 1 to 5
        assert comm._seq == 6
        for c in (sub, reverse, partial, group):
            if c is not None:
                c.close()
        return True

    assert run(3, fn) == [True] * 3
    assert emu.calls["commSplit"] == 3 * 5


# ---------------------------------------------------------------- lifetime
def test_barrier_close_and_abort(run, emu):
    cp = emu.cupy
    aborted = threading.Event()

    def fn(comm):
        x = cp.ones(3)
        comm.barrier()
        comm.barrier(timeout=5)
        comm.all_reduce(x)
        comm.synchronize(timeout=5)
        _, args = _calls(emu, comm, "allReduce")[0]  # the barrier: one int32, summed
        assert (args["count"], args["datatype"], args["op"]) == \
            (1, emu.nccl.NCCL_INT32, emu.nccl.NCCL_SUM)
        if comm.rank == 0:
            comm.close()
            comm.close()  # idempotent
            assert comm.nccl_comm._status == "destroyed"
            with pytest.raises(CommAbortedError, match="rank 0: communicator is closed"):
                comm.all_reduce(x)
            with pytest.raises(CommAbortedError, match="closed"):
                comm.barrier()
            with pytest.raises(CommAbortedError, match="closed"):
                comm.split(0)
        else:
            comm.abort()
            comm.abort()
            aborted.set()
            assert comm.nccl_comm._status == "aborted"
            with pytest.raises(CommAbortedError, match="abort\\(\\) called on rank 1"):
                comm.all_reduce(x)
            with pytest.raises(CommAbortedError, match="abort"):
                comm.isend(x, 0)
        return True

    assert run(2, fn) == [True, True]
    assert emu.calls["destroy"] == 1  # an aborted communicator is not destroyed


def test_context_manager_closes(run, emu, tmp_path):
    with gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{tmp_path}/cm",
                      timeout=10) as comm:
        comm.all_reduce(emu.cupy.ones(2))
    assert comm.nccl_comm._status == "destroyed" and not comm._watchdog.alive
    with pytest.raises(CommAbortedError):
        comm.all_reduce(emu.cupy.ones(2))



def test_abort_never_frees_the_communicator_under_the_watchdogs_error_query(emu, tmp_path,
                                                                           monkeypatch):
    """ncclCommAbort frees the communicator and CuPy does not lock: an abort() on the user's
    thread waits for the watchdog's check_async_error in flight instead of freeing the
    communicator under it (the emulation records such an overlap as an error)."""
    monkeypatch.setenv("GPUCOLL_WATCHDOG_INTERVAL", "0.001")
    emu.query_delay = 0.02  # the watchdog spends most of its time inside the query
    for attempt in range(3):
        comm = gpucoll.init(backend="nccl", rank=0, world_size=1,
                            url=f"file://{tmp_path}/abort{attempt}", timeout=10)
        assert _wait_until(lambda: comm.nccl_comm._queries > 0)  # a query is in flight now
        comm.abort()
        assert comm.nccl_comm._status == "aborted"
        assert not emu.errors, emu.errors[0]
    assert emu.calls["abort"] == 3


def test_an_abort_that_waits_in_nccl_does_not_hold_up_the_failing_call(run, emu, monkeypatch):
    """Within a node NCCL's abort may wait until the node's other ranks abort too: the call
    whose failure aborts the communicator still raises after at most ABORT_WAIT, and the
    abort completes on its own thread once NCCL lets it."""
    from gpucoll.backends import nccl_runtime

    monkeypatch.setattr(nccl_runtime, "ABORT_WAIT", 0.3)
    emu.abort_hold = threading.Event()  # NCCL's abort waits until this is set

    def rank_0(comm, x, stream):
        try:
            comm.all_reduce(x, stream=stream)  # #2 cannot complete
            started = time.monotonic()
            with pytest.raises(CommTimeoutError, match=r"all_reduce #2 did not complete"):
                comm.synchronize(timeout=0.3)  # its failure aborts, on this thread
            took = time.monotonic() - started
            assert comm.nccl_comm._status == "ok"  # the abort still waits in NCCL
            with pytest.raises(CommTimeoutError):
                comm.all_reduce(x)
            emu.abort_hold.set()
            assert _wait_until(lambda: comm.nccl_comm._status == "aborted")
            return took
        finally:
            emu.abort_hold.set()

    took = _second_all_reduce_stalls(run, emu, rank_0, timeout=10)
    assert took < 2.5, took  # 0.3 s to the timeout, 0.3 s for the abort; not the 30 s hold
    assert not emu.errors, emu.errors[0]


# ---------------------------------------------------------------- the emulation itself
def test_the_emulation_refuses_what_nccl_would(emu):
    """The emulation must catch wrong bookkeeping, or the tests above would prove little."""
    cp, nccl = emu.cupy, emu.nccl
    uid = nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(TypeError, match="expected bytes"):
        nccl.NcclCommunicator(1, tuple(uid), 0)
    with pytest.raises(NcclError, match="out of range"):
        nccl.NcclCommunicator(1, uid, 1)
    with pytest.raises(NcclError, match="not made by get_unique_id"):
        nccl.NcclCommunicator(1, bytes(128), 0)
    comm = nccl.NcclCommunicator(1, uid, 0)
    x = cp.arange(4, dtype=cp.float32)
    s = cp.cuda.get_current_stream().ptr
    comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    for call, pattern in [
        (lambda: comm.allReduce(x.data.ptr, x.data.ptr, 5, nccl.NCCL_FLOAT32, 0, s),
         "not inside one device allocation"),
        (lambda: comm.allReduce(x.data.ptr + 4, x.data.ptr, 4, nccl.NCCL_FLOAT32, 0, s),
         "not inside one device allocation"),
        (lambda: comm.allReduce(x.data.ptr, x.data.ptr, 4, 42, 0, s), "invalid datatype"),
        (lambda: comm.allReduce(x.data.ptr, x.data.ptr, 4, 7, 9, s), "invalid reduction op"),
        (lambda: comm.broadcast(x.data.ptr, x.data.ptr, 4, 7, 1, s), "root 1 is out of range"),
        (lambda: comm.send(x.data.ptr, 4, 7, 2, s), "peer 2 is out of range"),
        (lambda: comm.allReduce(x.data.ptr, x.data.ptr, 4, 7, 0, 12345), "not a stream"),
        (lambda: comm.allGather(x.data.ptr, x.data.ptr, 17, nccl.NCCL_UINT8, s),
         "not inside one device allocation"),
        (lambda: comm.reduceScatter(x.data.ptr, x.data.ptr, 5, nccl.NCCL_FLOAT32, 0, s),
         "not inside one device allocation"),
    ]:
        with pytest.raises(NcclError, match=pattern):
            call()
    with cp.cuda.Device(1):
        other = cp.ones(4, dtype=cp.float32)
    with pytest.raises(NcclError, match="memory of GPU 1"):
        comm.allReduce(other.data.ptr, other.data.ptr, 4, 7, 0, s)
    with pytest.raises(OverflowError):
        comm.allReduce(x.data.ptr, x.data.ptr, -1, 7, 0, s)
    # a view made from __cuda_array_interface__ is the same memory
    view = cp.asarray(_Foreign(x))
    assert view.data.ptr == x.data.ptr
    view[0] = 42
    assert x.get()[0] == 42
    assert cp.from_dlpack(x).data.ptr == x.data.ptr
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    comm.abort()
    with pytest.raises(NcclError, match="aborted"):
        comm.check_async_error()


def test_the_emulation_matches_sends_in_order_and_by_size(emu):
    cp, nccl = emu.cupy, emu.nccl
    uid = nccl.get_unique_id()
    comms = [None, None]
    errors = []

    def rank(r):
        try:
            cp.cuda.Device(r).use()
            comms[r] = nccl.NcclCommunicator(2, uid, r)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and all(comms)
    # connected already: one thread plays both ranks here, and the lazy connection's host
    # handshake would need two (it is tested by test_lazy_connection_*)
    comms[0]._clique.links.update({(0, 1), (1, 0)})
    with cp.cuda.Device(0):
        a, b = cp.arange(3, dtype=cp.int64), cp.arange(3, 7, dtype=cp.int64)
        s0 = cp.cuda.Stream()
    with cp.cuda.Device(1):
        into = cp.zeros(7, dtype=cp.int64)
        s1 = cp.cuda.Stream()
    def exchange(sends, recvs):
        """Rank 0's grouped sends and rank 1's grouped receives, each held on its stream and
        then released from a thread of its own (one thread cannot be both ranks)."""
        emu.stall(s0)
        emu.stall(s1)
        nccl.groupStart()
        for buf, count in sends:
            comms[0].send(buf.data.ptr, count, nccl.NCCL_INT64, 1, s0.ptr)
        nccl.groupEnd()
        nccl.groupStart()
        for ptr, count in recvs:
            comms[1].recv(ptr, count, nccl.NCCL_INT64, 0, s1.ptr)
        nccl.groupEnd()
        assert emu.pending(s0) == 1 and emu.pending(s1) == 1
        helper = threading.Thread(target=emu.release, args=(s0,))
        helper.start()
        emu.release(s1)
        helper.join(10)
        assert not helper.is_alive()

    exchange([(a, 3), (b, 4)], [(into.data.ptr, 3), (into.data.ptr + 24, 4)])
    np.testing.assert_array_equal(into.get(), np.arange(7))  # matched in order
    for c in comms:
        c.check_async_error()
    exchange([(a, 2)], [(into.data.ptr, 3)])
    for c in comms:  # held work that failed: an asynchronous error
        with pytest.raises(NcclError, match="rank 0 sent 16 bytes, rank 1 receives 24"):
            c.check_async_error()
    with pytest.raises(NcclError, match="groupEnd"):
        nccl.groupEnd()


def test_calls_made_while_another_gpu_is_current(run, emu):
    """Arrays gpucoll allocates, its events and the default stream belong to the
    communicator's GPU even when the calling thread has another device current."""
    cp = emu.cupy

    def fn(comm):
        x = cp.full((2, 2), comm.rank + 1.0)
        elsewhere = (comm.device + 1) % emu.device_count
        stream = cp.cuda.Stream()
        with cp.cuda.Device(elsewhere):
            gathered = comm.all_gather(x)
            assert gathered.device.id == comm.device
            assert comm.reduce_scatter(cp.asarray(x)).device.id == comm.device
            assert comm.all_to_all(x).device.id == comm.device
            g = comm.gather(x[0], root=0)
            assert g is None or g.device.id == comm.device
            assert comm.scatter(x, root=1).device.id == comm.device
            emu.stall(stream)
            work = comm.all_reduce(x, async_op=True, stream=stream)
            assert not work.is_completed()  # its event follows the operation
            emu.release(stream)
            assert work.synchronize(timeout=5)
            emu.stall(0, device=comm.device)  # the null stream of the communicator's GPU
            work = comm.all_reduce(x, async_op=True)
            assert not work.is_completed() and emu.pending(0, device=comm.device) == 2
            emu.release(0, device=comm.device)
            assert work.synchronize(timeout=5)
        np.testing.assert_array_equal(gathered.get()[:, 0, 0], [1.0, 2.0])
        np.testing.assert_array_equal(x.get(), np.full((2, 2), 6.0))
        return True

    assert run(2, fn) == [True, True]


def test_split_timeout_names_the_missing_rank_and_aborts(run, emu):
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            assert finished.wait(10)  # never calls split
            return None
        try:
            with pytest.raises(CommTimeoutError,
                               match=r"rank 0: split #1: ranks 1 did not call split within "
                                     r"0.5 s") as info:
                comm.split(0)
            assert (info.value.op, info.value.seq) == ("split", 1)
            with pytest.raises(CommTimeoutError, match="did not call split"):
                comm.all_reduce(cp.ones(2))  # aborted: no NCCL call that could hang
            assert comm.nccl_comm._status == "aborted"
            return True
        finally:
            finished.set()

    assert run(2, fn, timeout=0.5) == [True, None]
    assert emu.calls["commSplit"] == 0


def test_nccl_refusing_a_split_aborts(run, emu, monkeypatch):
    # the NCCL communicator is aborted behind gpucoll's back: a watchdog poll would find that
    # first (as an asynchronous error) whenever it ran before the split; it waits 60 s here
    monkeypatch.setenv("GPUCOLL_WATCHDOG_INTERVAL", "60")

    def fn(comm):
        comm.nccl_comm.abort()
        with pytest.raises(CommAbortedError, match=r"rank 0: split #1: NCCL refused the call"):
            comm.split(0)
        with pytest.raises(CommAbortedError, match="NCCL refused"):
            comm.barrier()
        return True

    assert run(1, fn) == [True]


def test_debug_check_timeout_names_the_missing_rank(run, emu, monkeypatch):
    monkeypatch.setenv("GPUCOLL_DEBUG", "1")
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            assert finished.wait(10)
            return None
        try:
            with pytest.raises(CommTimeoutError,
                               match=r"rank 0: GPUCOLL_DEBUG check of all_gather #1: ranks 1 did "
                                     r"not reach it within 0.5 s"):
                comm.all_gather(cp.ones(3))
            assert _calls(emu, comm) == []
            with pytest.raises(CommTimeoutError, match="GPUCOLL_DEBUG check"):
                comm.all_reduce(cp.ones(2))
            return True
        finally:
            finished.set()

    assert run(2, fn, timeout=0.5) == [True, None]


def test_init_without_the_other_ranks_times_out(emu, tmp_path):
    started = time.monotonic()
    with pytest.raises(CommTimeoutError):
        gpucoll.init(backend="nccl", rank=0, world_size=2, url=f"file://{tmp_path}/alone",
                     timeout=0.3)
    assert time.monotonic() - started < 3
    assert emu.calls["NcclCommunicator"] == 0


def test_point_to_point_timeout_names_the_peer(run, emu):
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        comm.connect_peers([1 - comm.rank])  # so the send's host call returns (lazy connection)
        if comm.rank == 1:
            assert finished.wait(10)  # never receives
            return None
        try:
            stream = cp.cuda.Stream()
            emu.stall(stream)
            work = comm.isend(cp.ones(3), 1, stream=stream)
            with pytest.raises(CommTimeoutError,
                               match=r"rank 0: send #2 did not complete on GPU 0 within 0.2 s "
                                     r"\(peer rank 1\)") as info:  # #1: connect_peers
                work.synchronize(timeout=0.2)
            assert (info.value.peer, info.value.op) == (1, "send")
            return True
        finally:
            finished.set()

    assert run(2, fn) == [True, None]


def test_a_host_call_that_blocks_in_nccl_is_bounded_by_the_watchdog(run, emu):
    """NCCL can block the host inside a call (lazy connection to a missing peer; here the
    emulation's lone send waits for its receive): the watchdog holds that call to the
    communicator's timeout too, and names the op and the peer."""
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            assert finished.wait(10)  # never receives
            return None
        try:
            started = time.monotonic()
            with pytest.raises(CommTimeoutError, match=r"rank 0: send #1 did not complete on GPU "
                                                       r"0 within 0.5 s \(peer rank 1\)"):
                comm.send(cp.ones(3), 1)  # blocks inside the call; emu.timeout is 5 s
            assert time.monotonic() - started < 3
            return True
        finally:
            finished.set()

    assert run(2, fn, timeout=0.5) == [True, None]


def test_peers_are_connected_at_creation_unless_the_user_says_otherwise(run, emu, monkeypatch):
    import os

    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    run(1, lambda comm: True)
    assert os.environ["NCCL_RUNTIME_CONNECT"] == "0"
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "1")
    run(1, lambda comm: True)
    assert os.environ["NCCL_RUNTIME_CONNECT"] == "1"
