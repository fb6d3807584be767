"""The NCCL backend's one-pass calls (gpucoll/backends/nccl_fast.py: all_reduce, broadcast,
all_gather, reduce_scatter, send, recv) over the CUDA emulation: they take a training step's
calls once their arguments are known good, and every call gets what the general path gives it:
the same result, flight recorder records, sequence numbers, NCCL calls and errors. Each case
runs twice, once with the one-pass path and once with it replaced by the general path, and the
two runs are compared; results also against NumPy.
"""

import collections
import threading
import time

import numpy as np
import pytest

from gpucoll.backends.nccl_fast import OnePassCalls
from gpucoll.communicator import Communicator
from gpucoll.errors import CommAbortedError, CommTimeoutError
from gpucoll.types import ReduceOp

from nccl_emulated_harness import _calls, _expected, _host, _wait_until, emu, run  # noqa: F401
from reference import reduce_reference

pytestmark = pytest.mark.timeout(60)

PATHS = ["one-pass", "general"]


ONE_PASS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv", "isend",
            "irecv")


def _paths(monkeypatch, run, n, fn, **options):
    """``run(n, fn)`` with each path: {path: (rank results, calls that took the one pass)}."""
    outcomes = {}
    for name in PATHS:
        taken = []
        with monkeypatch.context() as patch:
            if name == "general":
                for op in ONE_PASS:
                    patch.setattr(OnePassCalls, op, getattr(Communicator, op))
            else:
                one_pass = OnePassCalls._one_pass

                def counted(self, op, *args, one_pass=one_pass, taken=taken):
                    taken.append((self.rank, op))
                    return one_pass(self, op, *args)

                patch.setattr(OnePassCalls, "_one_pass", counted)
            outcomes[name] = run(n, lambda comm: fn(comm, taken), **options), taken
    return outcomes


def _records(comm):
    return [(e["number"], e["op"], e["state"], e["bytes"], e["dtype"], e["shape"], e["root"],
             e["peer"], e["tag"]) for e in comm.trace()]


def _nccl_calls(emu, comm):
    """The NCCL calls ``comm`` made, without their addresses (they differ between runs)."""
    return [(name, args.get("datatype"), args.get("count"), args.get("op"), args.get("root"),
             args.get("send") == args.get("recv")) for name, args in _calls(emu, comm)]


# (dtype, op as passed, shape): each pair twice or more, the op named as users name it
SEQUENCE = [("float32", "sum", (5,)), ("float32", "sum", (5,)), ("float32", "SUM", (2, 3)),
            ("float32", ReduceOp.SUM, (7,)), ("float32", "max", (4,)), ("float32", "max", (4,)),
            ("float16", "avg", (6,)), ("float16", "avg", (6,)), ("int32", "prod", (3,)),
            ("int32", ReduceOp.PROD, (3,)), ("float64", "min", (2, 2)),
            ("float64", "min", (2, 2)), ("complex64", "avg", (3,)), ("complex64", "avg", (3,)),
            ("float32", "sum", (0, 3)), ("float32", "sum", (5,))]


@pytest.mark.parametrize("n", [1, 2])
def test_the_one_pass_path_gives_what_the_general_path_gives(run, emu, n, monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "64")
    cp = emu.cupy

    def fn(comm, taken):
        got = []
        for i, (dtype, op, shape) in enumerate(SEQUENCE):
            x = cp.asarray(_host(i, comm.rank, shape, dtype, _name(op)))
            assert comm.all_reduce(x, op) is x
            got.append(x.get())
        comm.synchronize()
        return got, _records(comm), comm._seq, _nccl_calls(emu, comm)

    outcomes = _paths(monkeypatch, run, n, fn)
    for i, (dtype, op, shape) in enumerate(SEQUENCE):  # against NumPy
        stacked = np.stack([_host(i, r, shape, dtype, _name(op)) for r in range(n)])
        expected = _expected(stacked, _name(op))
        rtol = 2e-3 if dtype == "float16" else 1e-6
        for results, _ in outcomes.values():
            for r in range(n):
                np.testing.assert_allclose(results[r][0][i], expected, rtol=rtol,
                                           err_msg=f"call {i}, rank {r}")
    (results, taken), (general, untaken) = outcomes["one-pass"], outcomes["general"]
    # all but the first call of each dtype on each rank (the full checks run; the very first
    # also starts the flight recorder); a new op of a known dtype is checked, then taken
    # (the dtypes known are the process's: rank threads may have met one first)
    dtypes = {dtype for dtype, _, _ in SEQUENCE}
    for r in range(n):
        count = sum(1 for rank, _ in taken if rank == r)
        assert len(SEQUENCE) - len(dtypes) <= count <= len(SEQUENCE) - 1, taken
    assert untaken == []
    records, seq, calls = results[0][1:]
    assert seq == len(SEQUENCE) and len(calls) == len(SEQUENCE)
    assert [r[:3] for r in records] == [(i + 1, "all_reduce", "done")
                                        for i in range(len(SEQUENCE))]
    assert [r[5] for r in records] == [list(shape) for _, _, shape in SEQUENCE]
    # records (but their times), sequence numbers and NCCL calls: the general path's
    assert [result[1:] for result in results] == [result[1:] for result in general]


def _name(op):
    return op.value if isinstance(op, ReduceOp) else op.lower()


def test_calls_the_one_pass_path_leaves_to_the_general_path(run, emu, monkeypatch):
    """After float32 / sum is known: out=, an explicit stream, a strided array, an array on
    another GPU, another current device, GPUCOLL_DEBUG, a closed communicator."""
    cp = emu.cupy

    def outcome(call):
        try:
            value = call()
        except (TypeError, ValueError, CommAbortedError) as exc:
            return type(exc).__name__, str(exc)
        if hasattr(value, "wait"):
            value.wait()
            value = value.result()
        return value.get().tolist()

    def fn(comm, taken):
        x = cp.ones(4, dtype=cp.float32)
        comm.all_reduce(x)  # the pair is known from here on
        before = len(taken)
        other = (comm.device + 1) % emu.device_count
        with cp.cuda.Device(other):
            elsewhere = cp.ones(4, dtype=cp.float32)
        y = cp.full(4, 2.0, dtype=cp.float32)
        cases = [
            lambda: comm.all_reduce(cp.ones(4, dtype=cp.float32),
                                    out=cp.zeros(4, dtype=cp.float32)),
            lambda: comm.all_reduce(cp.ones(4, dtype=cp.float32), stream=cp.cuda.Stream()),
            lambda: comm.all_reduce(cp.ones((4, 4), dtype=cp.float32)[:, ::2]),
            lambda: comm.all_reduce(elsewhere),
        ]
        seen = [outcome(case) for case in cases]
        with cp.cuda.Device(other):  # runs on the communicator's GPU all the same
            seen.append(outcome(lambda: comm.all_reduce(y)))
        comm._debug = True  # GPUCOLL_DEBUG: the ranks' signatures are compared first
        seen.append(outcome(lambda: comm.all_reduce(cp.ones(4, dtype=cp.float32))))
        comm._debug = False
        comm.synchronize()
        left_alone = len(taken) - before
        records = _records(comm)
        comm.close()
        seen.append(outcome(lambda: comm.all_reduce(x)))
        return seen, records, left_alone

    outcomes = _paths(monkeypatch, run, 2, fn)
    for results, _ in outcomes.values():
        for rank, (seen, records, left_alone) in enumerate(results):
            assert left_alone == 0
            assert seen[:2] == [[2.0] * 4] * 2, seen
            assert seen[2] == [[2.0, 2.0]] * 4 or seen[2][0] == "ValueError", seen[2]
            assert seen[3][0] == "ValueError" and "is on GPU" in seen[3][1], seen[3]
            assert seen[4:6] == [[4.0] * 4, [2.0] * 4], seen
            assert seen[6] == ("CommAbortedError", f"rank {rank}: communicator is closed")
            assert all(r[1] == "all_reduce" and r[2] == "done" for r in records), records
    assert outcomes["one-pass"][0] == outcomes["general"][0]


@pytest.mark.parametrize("n", [1, 3])
def test_async_calls_take_the_one_pass_path_with_the_general_paths_works(run, emu, n,
                                                                           monkeypatch):
    """``async_op=True`` (how a data-parallel step issues its buckets) on all_reduce,
    broadcast, all_gather and reduce_scatter: each returns a CudaWork whose result is the
    caller's array; results against NumPy; records, sequence numbers and NCCL calls against
    the general path; each Work keeps its own event, which never goes back to the pool."""
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "64")
    cp = emu.cupy

    def fn(comm, taken):
        r = comm.rank
        comm.all_reduce(cp.ones(2, dtype=cp.float32))  # starts the recorder
        works, got = [], []
        for i in range(2):
            x = cp.asarray(np.arange(4.0, dtype=np.float32) * (r + 1) + i)
            b = cp.asarray(np.arange(3.0) + i if r == n - 1 else np.zeros(3))
            chunk, out = cp.full(2, r + i, dtype=cp.int32), cp.zeros((n, 2), dtype=cp.int32)
            rows, part = cp.asarray(np.ones((n, 2), np.float32) * (r + i)), \
                cp.zeros(2, dtype=cp.float32)
            calls = [(comm.all_reduce(x, "max", async_op=True), x),
                     (comm.broadcast(b, n - 1, async_op=True), b),
                     (comm.all_gather(chunk, out=out, async_op=True), out),
                     (comm.reduce_scatter(rows, out=part, async_op=True), part)]
            for work, array in calls:
                assert type(work).__name__ == "CudaWork"
                works.append(work)
                assert work.wait() is True and work.result() is array
                got.append(array.get())
        comm.synchronize()
        assert _wait_until(lambda: not comm._watchdog.outstanding())  # its polls released all
        assert all(work.is_completed() and work.exception() is None for work in works)
        pool = {id(event) for event in comm._events}
        kept = [id(work._event) in pool for work in works]
        return got, kept, _records(comm), comm._seq, _nccl_calls(emu, comm)

    outcomes = _paths(monkeypatch, run, n, fn)
    for results, _ in outcomes.values():  # against NumPy
        for got, kept, *_ in results:
            expected = []
            for i in range(2):
                expected += [np.arange(4.0) * n + i, np.arange(3.0) + i,
                             np.stack([np.full(2, q + i) for q in range(n)]),
                             np.full(2, sum(q + i for q in range(n)))]
            assert len(got) == len(expected)
            for value, want in zip(got, expected):
                np.testing.assert_allclose(value, want, rtol=1e-6)
            assert kept == [False] * 8, kept
    (results, taken), (general, untaken) = outcomes["one-pass"], outcomes["general"]
    assert untaken == []
    for r in range(n):  # each kind after its first call at least
        kinds = collections.Counter(op for rank, op in taken if rank == r)
        assert all(kinds[op] >= 1 for op in ("all_reduce", "broadcast", "all_gather",
                                             "reduce_scatter")), kinds
    assert [result[2:] for result in results] == [result[2:] for result in general]
    records = results[0][2]
    assert [record[1:3] for record in records] == [("all_reduce", "done")] + \
        [(op, "done") for _ in range(2)
         for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter")]


def test_an_async_calls_event_goes_back_to_the_pool_once_its_work_is_gone(run, emu,
                                                                          monkeypatch):
    """A training step drops each bucket's Work once waited for: its event is reused, as a
    blocking call's is (before or after the watchdog released the call), not made anew for
    every call; a Work still held keeps its own."""
    cp = emu.cupy

    def fn(comm, taken):
        x = cp.ones(4, dtype=cp.float32)
        comm.all_reduce(x)  # starts the recorder
        created = []
        make = comm._new_event
        comm._new_event = lambda: created.append(1) or make()
        for i in range(30):
            work = comm.all_reduce(x, async_op=True)
            work.wait()
            if i % 2:  # dropped after the watchdog released the call
                comm.synchronize()
                assert _wait_until(lambda: not comm._watchdog.outstanding())
            del work   # else dropped while the call may still be followed
        kept = comm.all_reduce(x, async_op=True)
        comm.synchronize()
        assert _wait_until(lambda: not comm._watchdog.outstanding())
        pooled = any(event is kept._event for event in comm._events)
        states = {entry["state"] for entry in comm.trace()}
        return len(created), pooled, states, cp.asnumpy(x).tolist()

    for name, (results, _) in _paths(monkeypatch, run, 1, fn).items():
        created, pooled, states, values = results[0]
        assert created <= 3 and not pooled, (name, created, pooled)
        assert states == {"done"} and values == [1.0] * 4, (name, states, values)


@pytest.mark.parametrize("n", [2, 3])
def test_isend_and_irecv_take_the_one_pass_path(run, emu, n, monkeypatch):
    """A ring of isend / irecv pairs, as a pipeline schedule passes micro-batches (peers and
    tags as users pass them): results against NumPy; the records name isend and irecv, and
    records, point-to-point sequence numbers and NCCL calls are the general path's."""
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "64")
    cp = emu.cupy

    def fn(comm, taken):
        r = comm.rank
        right, left = (r + 1) % n, (r - 1) % n
        comm.all_reduce(cp.ones(2, dtype=cp.float32))  # starts the recorder
        got = []
        for i in range(3):
            out = cp.zeros((2, 3), dtype=cp.float64)
            receiving = lambda: comm.irecv(out, np.int64(left), tag=i)  # noqa: E731
            sending = lambda: comm.isend(cp.full((2, 3), 10.0 * r + i), right, tag=i)  # noqa: E731
            if r % 2 == 0:  # a ring without a group call: one side first (NCCL connects lazily)
                sent, received = sending(), receiving()
            else:
                received, sent = receiving(), sending()
            assert [type(work).__name__ for work in (sent, received)] == ["CudaWork"] * 2
            assert received.result() is out and sent.result() is None
            got.append(out.get())
        comm.synchronize()
        return got, _records(comm), comm._seq, comm._p2p_seq, _nccl_calls(emu, comm)

    outcomes = _paths(monkeypatch, run, n, fn)
    for results, _ in outcomes.values():  # against NumPy
        for r, (got, *_) in enumerate(results):
            for i, value in enumerate(got):
                np.testing.assert_array_equal(value, np.full((2, 3), 10.0 * ((r - 1) % n) + i))
    (results, taken), (general, untaken) = outcomes["one-pass"], outcomes["general"]
    assert untaken == []
    for r in range(n):  # after the first with each peer, at least
        kinds = collections.Counter(op for rank, op in taken if rank == r)
        assert kinds["send"] >= 2 and kinds["recv"] >= 2, kinds
    assert [result[1:] for result in results] == [result[1:] for result in general]
    records = results[0][1]  # rank 0 sends first
    assert [record[1:3] for record in records[1:]] == [("isend", "done"), ("irecv", "done")] * 3
    assert results[0][3] == 6  # point-to-point numbers: one per isend and irecv


def test_nccl_refusing_a_one_pass_call_fails_it_and_its_record(run, emu, monkeypatch):
    monkeypatch.setenv("GPUCOLL_WATCHDOG_INTERVAL", "60")  # NCCL's refusal names the error
    cp = emu.cupy

    def fn(comm, taken):
        x = cp.ones(4, dtype=cp.float32)
        comm.all_reduce(x)  # #1
        comm.synchronize()
        comm.nccl_comm.abort()  # behind gpucoll's back: NCCL refuses what comes next
        with pytest.raises(CommAbortedError, match=r"rank 0: all_reduce #2: NCCL refused the "
                                                   r"call: NCCL_ERROR_INVALID_ARGUMENT"):
            comm.all_reduce(x)
        with pytest.raises(CommAbortedError, match="NCCL refused the call"):
            comm.all_reduce(x)  # the communicator failed: the general path says so
        return [(r[0], r[1], r[2].split(":")[0]) for r in _records(comm)], len(taken)

    outcomes = _paths(monkeypatch, run, 1, fn)
    for name, ([(records, count)], _) in outcomes.items():
        assert records == [(1, "all_reduce", "done"), (2, "all_reduce", "failed"),
                           (3, "all_reduce", "failed")], (name, records)
        assert count == (1 if name == "one-pass" else 0), name


def test_a_stalled_one_pass_call_times_out_by_name(run, emu, monkeypatch):
    """A call on a stalled current stream whose peer never comes: the watchdog names it, its
    record fails, and the next call raises the timeout."""
    cp = emu.cupy

    finished = collections.defaultdict(threading.Event)  # one per run: rank 0 is done

    def fn(comm, taken):
        x = cp.ones(8, dtype=cp.float32)
        comm.all_reduce(x)  # #1 on both ranks
        comm.synchronize()
        if comm.rank == 1:
            assert finished[id(taken)].wait(10)  # never issues #2
            return None
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            emu.stall(stream)
            with stream:
                comm.all_reduce(x)  # #2: enqueued, never completes
            assert _wait_until(lambda: comm.nccl_comm._status == "aborted")
            with pytest.raises(CommTimeoutError) as info:
                comm.all_reduce(x)
            return str(info.value), [r[2].split(":")[0] for r in _records(comm)], len(taken)
        finally:
            finished[id(taken)].set()

    outcomes = _paths(monkeypatch, run, 2, fn, timeout=0.5)
    for name, ([(message, states, count), _], _) in outcomes.items():
        assert "rank 0: all_reduce #2 did not complete on GPU 0 within 0.5 s" in message, \
            (name, message)
        assert states == ["done", "failed", "failed"], (name, states)
        assert count == (1 if name == "one-pass" else 0), name


def test_a_communicator_idle_past_its_timeout_after_one_pass_calls_has_not_failed(
        run, emu, monkeypatch):
    """Each call leaves the watchdog's "inside NCCL" mark once NCCL returned: a mark left
    behind would be held to the call's deadline and fail an idle communicator."""
    cp = emu.cupy

    def fn(comm, taken):
        x = cp.ones(8, dtype=cp.float32)
        comm.all_reduce(x)
        comm.broadcast(x, 0)
        comm.synchronize()
        idle = time.monotonic() + 0.9      # the timeout and several watchdog polls
        while time.monotonic() < idle:
            time.sleep(0.05)
        failure = comm._failure
        comm.all_reduce(x)
        return failure, cp.asnumpy(x).tolist(), [op for rank, op in taken if rank == comm.rank]

    outcomes = _paths(monkeypatch, run, 2, fn, timeout=0.4)
    for name, (results, _) in outcomes.items():
        for failure, values, one_pass in results:
            assert failure is None, (name, failure)
            assert values == [4.0] * 8, (name, values)    # (1 + 1) from the all-reduce, twice
            # the first call starts the recorder on the general path
            assert one_pass == (["broadcast", "all_reduce"] if name == "one-pass" else []), \
                (name, one_pass)


@pytest.mark.parametrize("n", [2, 3])
def test_every_one_pass_call_gives_what_the_general_path_gives(run, emu, n, monkeypatch):
    """broadcast, all_gather and reduce_scatter into out=, send and recv, each several times
    (roots, peers, tags and ops as users pass them): results against NumPy; records,
    collective and point-to-point sequence numbers and NCCL calls against the general path."""
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "128")
    cp = emu.cupy

    def fn(comm, taken):
        r = comm.rank
        got = []
        comm.all_reduce(cp.ones(2, dtype=cp.float32))  # starts the recorder
        for i in range(3):
            for root in (0, n - 1, np.int64(1)):
                b = cp.asarray(np.arange(4.0) + 10 * int(root) + i if r == int(root)
                               else np.zeros(4))
                assert comm.broadcast(b, root=root) is b
                got.append(("broadcast", b.get()))
            chunk = cp.asarray(np.full(3, r + i, dtype=np.int32))
            out = cp.zeros((n, 3), dtype=cp.int32)
            assert comm.all_gather(chunk, out=out) is out
            got.append(("all_gather", out.get()))
            for op in ("sum", "max", ReduceOp.SUM):
                rows = cp.asarray(np.arange(n * 2, dtype=np.float32).reshape(n, 2) * (r + 1) + i)
                part = cp.zeros(2, dtype=cp.float32)
                assert comm.reduce_scatter(rows, op, out=part) is part
                got.append(("reduce_scatter", part.get()))
            right, left = (r + 1) % n, (r - 1) % n
            message = cp.zeros(5, dtype=cp.int64)
            if r % 2 == 0:
                assert comm.send(cp.full(5, 100 * r + i, dtype=cp.int64), right, tag=i) is None
                assert comm.recv(message, left, tag=i) is message
            else:
                assert comm.recv(message, left, tag=i) is message
                assert comm.send(cp.full(5, 100 * r + i, dtype=cp.int64), right, tag=i) is None
            got.append(("recv", message.get()))
        comm.synchronize()
        return got, _records(comm), comm._seq, comm._p2p_seq, _nccl_calls(emu, comm)

    outcomes = _paths(monkeypatch, run, n, fn)
    for results, _ in outcomes.values():  # against NumPy
        for r, (got, *_) in enumerate(results):
            expected = []
            for i in range(3):
                for root in (0, n - 1, 1):
                    expected.append(np.arange(4.0) + 10 * root + i)
                expected.append(np.stack([np.full(3, q + i) for q in range(n)]))
                for op in ("sum", "max", "sum"):
                    stacked = np.stack([np.arange(n * 2.0).reshape(n, 2) * (q + 1) + i
                                        for q in range(n)])
                    expected.append(reduce_reference(stacked, op)[r])
                expected.append(np.full(5, 100 * ((r - 1) % n) + i))
            assert len(got) == len(expected)
            for (name, value), want in zip(got, expected):
                np.testing.assert_allclose(value, want, rtol=1e-6, err_msg=name)
    (results, taken), (general, untaken) = outcomes["one-pass"], outcomes["general"]
    assert untaken == []
    for r in range(n):  # every kind of call took the one pass, at least after its first
        kinds = collections.Counter(op for rank, op in taken if rank == r)
        assert kinds["broadcast"] >= 6 and kinds["all_gather"] >= 2, kinds
        assert kinds["reduce_scatter"] >= 6 and kinds["send"] >= 2 and kinds["recv"] >= 2, kinds
    assert [result[1:] for result in results] == [result[1:] for result in general]


def test_one_pass_calls_leave_bad_arguments_to_the_general_path(run, emu, monkeypatch):
    """After each call's arguments are known good, bad ones still get the general path's
    error, before anything is enqueued (the same errors on both paths)."""
    cp = emu.cupy

    def outcome(call):
        try:
            value = call()
        except (TypeError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return None if value is None else value.get().tolist()

    def fn(comm, taken):
        r, n = comm.rank, comm.size
        x, rows = cp.ones(4, dtype=cp.float32), cp.ones((n, 2), dtype=cp.float32)
        out, part = cp.zeros((n, 4), dtype=cp.float32), cp.zeros(2, dtype=cp.float32)
        for _ in range(2):  # known good from here on
            comm.all_reduce(x)
            comm.broadcast(x, root=0)
            comm.all_gather(x, out=out)
            comm.reduce_scatter(rows, out=part)
            if r == 0:
                comm.send(x, 1)
            else:
                comm.recv(x, 0)
        before, seq, p2p = len(taken), comm._seq, comm._p2p_seq
        seen = [outcome(call) for call in (
            lambda: comm.broadcast(x, root=n),
            lambda: comm.broadcast(x, root=True),
            lambda: comm.all_gather(x, out=cp.zeros((n, 3), dtype=cp.float32)),
            lambda: comm.all_gather(x, out=cp.zeros((n, 4), dtype=cp.float64)),
            lambda: comm.reduce_scatter(cp.ones((n + 1, 2), dtype=cp.float32), out=part),
            lambda: comm.reduce_scatter(rows, out=cp.zeros(3, dtype=cp.float32)),
            lambda: comm.reduce_scatter(rows, "band", out=part),
            lambda: comm.send(x, r),
            lambda: comm.send(x, 1 - r, tag=-1),
            lambda: comm.recv(cp.ones((4, 4), dtype=cp.float32)[:, ::2], 1 - r),
        )]
        assert len(taken) == before and (comm._seq, comm._p2p_seq) == (seq, p2p)
        comm.synchronize()
        return seen

    outcomes = _paths(monkeypatch, run, 2, fn)
    seen = outcomes["one-pass"][0]
    assert seen == outcomes["general"][0]
    for errors in seen:
        assert all(isinstance(e, tuple) and e[0] in ("TypeError", "ValueError")
                   for e in errors), errors
