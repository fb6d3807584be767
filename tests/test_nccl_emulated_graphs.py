"""CUDA graphs on the NCCL backend over the CUDA emulation (gpucoll/backends/nccl_graphs.py):
collectives captured on a stream run at each launch and not before, the watchdog follows
nothing at capture and each ``launch_graph`` like a collective, and what cannot be captured
is refused before anything is enqueued. Results against NumPy.

Ranks are threads (see tests/nccl_emulated_harness.py); the emulation's graphs replay what was
enqueued on the capturing stream (tests/emulated_cuda/). Real NCCL in a real graph is tested
by tests/test_nccl_gpu.py.
"""

import threading
import time

import numpy as np
import pytest

from gpucoll.errors import CommTimeoutError, UnsupportedOperationError

from nccl_emulated_harness import _wait_until, emu, run  # noqa: F401

pytestmark = pytest.mark.timeout(60)

LAUNCHES = 3


def _states(comm):
    return [(e["op"], e["state"].split(":")[0]) for e in comm.trace()]


@pytest.mark.parametrize("n", [2, 3])
def test_captured_collectives_run_at_each_launch_and_not_before(run, emu, n, monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "64")
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        x = cp.full(4, r + 1.0, dtype=cp.float32)
        comm.all_reduce(x)  # twice outside: the one-pass path knows float32 / sum
        comm.all_reduce(x)
        comm.synchronize()
        x[...] = cp.full(4, r + 1.0, dtype=cp.float32)
        b = cp.asarray(np.arange(3.0) * 10 if r == 0 else np.zeros(3))
        chunk = cp.full(2, r + 1, dtype=cp.int32)
        gathered = cp.zeros((n, 2), dtype=cp.int32)
        rows = cp.asarray(np.arange(n * 2, dtype=np.float64).reshape(n, 2) + r)
        scattered = cp.zeros(2)
        message = cp.zeros(5, dtype=cp.int64)
        sent = cp.arange(5, dtype=cp.int64) * 7  # alive while the graph is: it holds pointers
        ring_out, ring_in = cp.full(3, 10 + r, dtype=cp.int16), cp.zeros(3, dtype=cp.int16)
        stream = cp.cuda.Stream(non_blocking=True)
        before = len(comm.trace())
        with stream:
            stream.begin_capture()
            comm.all_reduce(x)
            comm.broadcast(b, root=0)
            comm.all_gather(chunk, out=gathered)
            comm.reduce_scatter(rows, op="max", out=scattered)
            if r == 0:
                comm.send(sent, dst=n - 1)
            elif r == n - 1:
                comm.recv(message, src=0)
            comm.sendrecv(ring_out, (r + 1) % n, ring_in, (r - 1) % n)  # a grouped exchange
            graph = stream.end_capture()
        captured = _states(comm)[before:]
        nothing_ran = (x.get().tolist(), b.get().tolist(), gathered.get().tolist())
        time.sleep(0.4)  # beyond the 0.3 s timeout: nothing captured is followed
        snapshots = []
        for _ in range(LAUNCHES):
            comm.launch_graph(graph, stream=stream)
            stream.synchronize()
            snapshots.append(x.get().tolist())
        comm.synchronize()
        return (captured, nothing_ran, snapshots, b.get(), gathered.get(), scattered.get(),
                message.get(), _states(comm)[-LAUNCHES:], ring_in.get().tolist())

    results = run(n, fn, timeout=0.3)
    expected_x = np.arange(1.0, n + 1)  # what each rank's x held before the capture
    for r, (captured, nothing_ran, snapshots, b, gathered, scattered, message,
            launches, ring_in) in enumerate(results):
        ops = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"] + \
            (["send"] if r == 0 else ["recv"] if r == n - 1 else []) + ["sendrecv"]
        assert captured == [(op, "captured") for op in ops], captured
        assert nothing_ran == ([r + 1.0] * 4, (np.arange(3.0) * 10 if r == 0
                                               else np.zeros(3)).tolist(), [[0, 0]] * n)
        values = np.full(n, 0.0) + expected_x
        for launch, got in enumerate(snapshots):  # each launch sums the ranks' x once more
            values = np.full(n, values.sum())
            assert got == [values[r]] * 4, (launch, got)
        np.testing.assert_array_equal(b, np.arange(3.0) * 10)
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(1, n + 1), 2).reshape(n, 2))
        rows = np.stack([np.arange(n * 2.0).reshape(n, 2) + q for q in range(n)])
        np.testing.assert_array_equal(scattered, rows.max(axis=0)[r])
        if r == n - 1:
            np.testing.assert_array_equal(message, np.arange(5) * 7)
        assert ring_in == [10 + (r - 1) % n] * 3, ring_in
        assert launches == [("launch_graph", "done")] * LAUNCHES, launches


def test_a_launch_that_a_rank_never_makes_times_out_by_name(run, emu):
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        x = cp.ones(8, dtype=cp.float32)
        comm.all_reduce(x)  # #1 on both ranks
        comm.synchronize()
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            comm.all_reduce(x)  # #2, captured
            graph = stream.end_capture()
        if comm.rank == 1:
            assert finished.wait(10)  # never launches
            return None
        try:
            emu.stall(stream)  # the launched kernels wait for rank 1, as on a GPU
            started = time.monotonic()
            comm.launch_graph(graph, stream=stream)  # #3: returns once enqueued
            assert _wait_until(lambda: comm.nccl_comm._status == "aborted")
            waited = time.monotonic() - started
            with pytest.raises(CommTimeoutError) as info:
                comm.all_reduce(x)
            return str(info.value), waited, _states(comm)[-2:]
        finally:
            finished.set()

    (message, waited, states), _ = run(2, fn, timeout=0.5)
    assert "rank 0: launch_graph #3 did not complete on GPU 0 within 0.5 s" in message, message
    assert "ranks that had not reached it: 1 (of 2)" in message, message
    assert 0.4 <= waited < 4, waited
    assert states == [("launch_graph", "failed"), ("all_reduce", "failed")], states


def _two_groups_graph(comm, cp):
    """A second communicator of the same ranks and GPU (``split``), and a graph that captured
    an all_reduce of the first and an all_gather of the second: (group, graph, stream, x, out)."""
    group = comm.split(0)
    x = cp.full(4, comm.rank + 1.0, dtype=cp.float32)
    out = cp.zeros((comm.size, 4), dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        comm.all_reduce(x)
        group.all_gather(x, out=out)
        graph = stream.end_capture()
    return group, graph, stream, x, out


def test_a_graph_of_two_communicators_is_followed_by_both(run, emu):
    """``launch_graph(..., also=[group])``: each launch is one collective of both
    communicators (sequence numbers, records), and the results are NumPy's."""
    cp = emu.cupy

    def fn(comm):
        group, graph, stream, x, out = _two_groups_graph(comm, cp)
        seqs = (comm._seq, group._seq)
        results = []
        for _ in range(LAUNCHES):
            comm.launch_graph(graph, stream=stream, also=[group])
            stream.synchronize()
            results.append((x.get().tolist(), out.get().tolist()))
        comm.synchronize()
        group.synchronize()
        advanced = (comm._seq - seqs[0], group._seq - seqs[1])
        records = (_states(comm)[-LAUNCHES:], _states(group)[-LAUNCHES:])
        group.close()
        return results, advanced, records

    n = 2
    for results, advanced, records in run(n, fn):
        value = np.arange(1.0, n + 1)  # what each rank's x held before the launches
        for got_x, got_out in results:
            value = np.full(n, value.sum())  # all_reduce, then the same on every rank
            np.testing.assert_array_equal(got_x, np.full(4, value[0]))
            np.testing.assert_array_equal(got_out, np.full((n, 4), value[0]))
        assert advanced == (LAUNCHES, LAUNCHES)
        assert records == ([("launch_graph", "done")] * LAUNCHES,) * 2


def test_both_watchdogs_hold_a_launch_that_never_finishes(run, emu):
    """A launch of two communicators' graph that cannot finish (rank 1 never launches) fails
    both communicators by name, each at its own timeout."""
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        group, graph, stream, x, out = _two_groups_graph(comm, cp)
        if comm.rank == 1:
            assert finished.wait(10)  # never launches
            return None
        try:
            emu.stall(stream)  # the launched kernels wait for rank 1, as on a GPU
            comm.launch_graph(graph, stream=stream, also=[group])
            errors = []
            for each in (comm, group):
                with pytest.raises(CommTimeoutError) as info:
                    each.synchronize(timeout=5)
                errors.append(str(info.value))
            return errors, _states(group)[-1]
        finally:
            finished.set()

    (errors, last), _ = run(2, fn, timeout=0.5)
    for error in errors:
        assert "rank 0: launch_graph #" in error and "did not complete on GPU 0" in error, error
    assert last == ("launch_graph", "failed")


def test_the_communicators_a_launch_names_are_checked_before_it(run, emu):
    cp = emu.cupy

    def fn(comm):
        group, graph, stream, x, out = _two_groups_graph(comm, cp)
        seqs = (comm._seq, group._seq)
        cases = [("x", TypeError, "also must be a sequence of NCCL communicators, got str"),
                 ([object()], TypeError, r"also\[0\] must be an NCCL communicator, got object"),
                 ([comm], ValueError, r"also\[0\] is this communicator"),
                 ([group, group], ValueError, r"also\[1\] is given twice")]
        for also, error, message in cases:
            with pytest.raises(error, match=message):
                comm.launch_graph(graph, stream=stream, also=also)
        device, group.device = group.device, 3  # as a communicator of another GPU
        try:
            with pytest.raises(ValueError, match=r"also\[0\] is on GPU 3, this communicator "
                                                 r"on GPU \d: a graph runs on one GPU"):
                comm.launch_graph(graph, stream=stream, also=[group])
        finally:
            group.device = device
        assert (comm._seq, group._seq) == seqs and emu.pending(stream) == 0
        group.close()
        with pytest.raises(Exception, match="closed"):
            comm.launch_graph(graph, stream=stream, also=[group])
        assert comm._seq == seqs[0]
        return True

    assert run(2, fn) == [True, True]


def test_what_cannot_be_captured_is_refused_before_anything_is_enqueued(run, emu):
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(4, dtype=cp.float32)
        comm.all_reduce(x)
        seq, records = comm._seq, len(comm.trace())
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            with pytest.raises(UnsupportedOperationError,
                               match=r"backend 'nccl' does not support all_reduce with "
                                     r"async_op=True in a CUDA graph capture; .*capture the "
                                     r"blocking call"):
                comm.all_reduce(x, async_op=True)
            with pytest.raises(UnsupportedOperationError,
                               match="backend 'nccl' does not support barrier in a CUDA graph "
                                     "capture; it waits on the host"):
                comm.barrier()
            graph = stream.end_capture()
        assert graph.nodes == [] and comm._seq == seq and len(comm.trace()) == records
        with pytest.raises(TypeError, match="graph must be a cupy.cuda.graph.Graph"):
            comm.launch_graph(object())
        with pytest.raises(TypeError, match="stream must be a CuPy stream, got int"):
            comm.launch_graph(graph, stream=7)
        assert comm._seq == seq
        comm.launch_graph(graph)  # an empty graph on the current stream: a no-op collective
        comm.synchronize()
        return comm._seq - seq, _states(comm)[-1]

    assert run(2, fn) == [(1, ("launch_graph", "done"))] * 2


def test_the_emulations_capture_refuses_what_cuda_refuses(emu):
    """The model the tests above run on: an event recorded in a capture cannot be queried or
    waited for (cudaErrorCapturedEvent, 907) until recorded outside one, the legacy null stream
    cannot capture, and nothing captured runs until a launch (in-place changes of arrays
    included). A capturing stream cannot be synchronized nor copied to or from the host
    (cudaErrorStreamCaptureUnsupported, 900), and either invalidates the capture
    (cudaErrorStreamCaptureInvalidated, 901, at its end)."""
    cp, runtime = emu.cupy, emu.cupy.cuda.runtime
    with pytest.raises(RuntimeError, match="cannot capture on the default"):
        cp.cuda.Stream.null.begin_capture()
    stream, event = cp.cuda.Stream(non_blocking=True), cp.cuda.Event()
    src, dst = cp.arange(4, dtype=cp.float32), cp.zeros(4, dtype=cp.float32)
    stream.begin_capture()
    assert stream.is_capturing() and runtime.streamIsCapturing(stream.ptr)
    assert not runtime.streamIsCapturing(cp.cuda.Stream.null.ptr)
    runtime.memcpyAsync(dst.data.ptr, src.data.ptr, 16, runtime.memcpyDeviceToDevice,
                        stream.ptr)
    event.record(stream)
    assert runtime.eventQuery(event.ptr) == 907
    with pytest.raises(RuntimeError, match="cudaErrorCapturedEvent"):
        event.synchronize()
    graph = stream.end_capture()
    assert not stream.is_capturing() and dst.get().tolist() == [0.0] * 4
    graph.launch(stream)
    stream.synchronize()
    assert dst.get().tolist() == [0.0, 1.0, 2.0, 3.0] and runtime.eventQuery(event.ptr) == 0
    with stream:  # in-place changes are recorded and run by each launch, not at capture
        stream.begin_capture()
        dst[1:3] = 7.0
        dst += src
        graph = stream.end_capture()
    assert dst.get().tolist() == [0.0, 1.0, 2.0, 3.0]
    graph.launch(stream)
    stream.synchronize()
    assert dst.get().tolist() == [0.0, 8.0, 9.0, 6.0]
    for refused in (stream.synchronize, lambda: dst.get(stream=stream),
                    lambda: dst.get(),  # dst.get(): on the current stream, the capturing one
                    lambda: float(dst[0]), lambda: cp.asarray(np.ones(2)),
                    lambda: dst.set(np.ones(4, np.float32))):
        with stream:
            stream.begin_capture()
            with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnsupported"):
                refused()
            with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
                stream.end_capture()
        assert not stream.is_capturing()


COMPOSITES = {  # name: (its input, made before the capture; the call, made comparable)
    "broadcast_object": (lambda comm, cp: {"step": 3} if comm.rank == 0 else None,
                         lambda comm, x: comm.broadcast_object(x)),
    "all_gather_object": (lambda comm, cp: ("r", comm.rank),
                          lambda comm, x: comm.all_gather_object(x)),
    "gather_object": (lambda comm, cp: comm.rank * 10,
                      lambda comm, x: comm.gather_object(x, root=1)),
    "scatter_object": (lambda comm, cp: ["a", "b"] if comm.rank == 0 else None,
                       lambda comm, x: comm.scatter_object(x)),
    "send_object": (lambda comm, cp: [1, 2],
                    lambda comm, x: comm.send_object(x, 1) if comm.rank == 0
                    else comm.recv_object(0)),
    "all_gather_v": (lambda comm, cp: cp.arange(comm.rank + 1.0),
                     lambda comm, x: comm.all_gather_v(x, counts=[1, 2])[0].get().tolist()),
    "gather_v": (lambda comm, cp: cp.full(comm.rank + 1, comm.rank),
                 lambda comm, x: _host(comm.gather_v(x, root=0)[0])),
    "all_to_all_v": (lambda comm, cp: cp.arange(3.0) + 10 * comm.rank,
                     lambda comm, x: comm.all_to_all_v(x, counts=[[1, 2], [2, 1]])[0]
                     .get().tolist()),
    "scatter_v": (lambda comm, cp: cp.arange(3.0) if comm.rank == 0 else None,
                  lambda comm, x: comm.scatter_v(x, 0, [1, 2])[0].get().tolist()),
    "reduce_scatter_v": (lambda comm, cp: cp.arange(3.0) * (comm.rank + 1),
                         lambda comm, x: comm.reduce_scatter_v(x, [2, 1])[0].get().tolist()),
}
EXPECTED = {
    "broadcast_object": [{"step": 3}] * 2,
    "all_gather_object": [[("r", 0), ("r", 1)]] * 2,
    "gather_object": [None, [0, 10]],
    "scatter_object": ["a", "b"],
    "send_object": [None, [1, 2]],
    "all_gather_v": [[0.0, 0.0, 1.0]] * 2,
    "gather_v": [[0, 1, 1], None],
    "all_to_all_v": [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]],
    "scatter_v": [[0.0], [1.0, 2.0]],
    "reduce_scatter_v": [[0.0, 3.0], [6.0]],
}


def _host(array):
    return None if array is None else array.get().tolist()


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_the_composite_calls_are_refused_in_a_capture_before_anything_is_enqueued(run, emu,
                                                                                  name):
    """Objects, uneven gathers and scatters and all_to_all_v read counts or objects on the host (and pad
    through temporaries): in a capture CUDA would refuse the host copy and invalidate the
    whole capture after part of the call was recorded (the emulation does as CUDA does). They
    are refused first, even with counts given: nothing recorded, no sequence number used, the
    capture still valid, the same call fine after it."""
    cp = emu.cupy
    make, call = COMPOSITES[name]

    def fn(comm):
        comm.all_reduce(cp.ones(2, dtype=cp.float32))
        x = make(comm, cp)
        seq, p2p, records = comm._seq, comm._p2p_seq, len(comm.trace())
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            with pytest.raises(UnsupportedOperationError) as refused:
                call(comm, x)
            graph = stream.end_capture()  # still valid: CUDA was asked nothing it refuses
        assert graph.nodes == [] and (comm._seq, comm._p2p_seq) == (seq, p2p)
        assert len(comm.trace()) == records
        result = call(comm, x)  # outside the capture: the communicator is fine
        comm.synchronize()
        return str(refused.value), result

    results = run(2, fn)
    for rank, (message, result) in enumerate(results):
        refused_op = "recv_object" if (name == "send_object" and rank == 1) else name
        assert message.startswith(f"backend 'nccl' does not support {refused_op} in a CUDA "
                                  f"graph capture; it reads counts or objects on the host"), \
            message
        assert "capture all_gather / all_to_all on fixed-size buffers" in message
        assert result == EXPECTED[name][rank], (rank, result)


def test_scan_is_refused_in_a_capture_before_anything_is_enqueued(run, emu):
    """scan / exscan combine through temporaries that a graph would go on using after they
    are freed: refused on a capturing stream (the current one, or stream=) before anything is
    enqueued; the capture stays valid and the same calls work after it."""
    cp = emu.cupy

    def fn(comm):
        x = cp.full(3, comm.rank + 1, dtype=cp.int32)
        comm.all_reduce(cp.ones(2, dtype=cp.float32))
        seq, p2p, records = comm._seq, comm._p2p_seq, len(comm.trace())
        stream = cp.cuda.Stream(non_blocking=True)
        messages = []
        with stream:
            stream.begin_capture()
            for call in (comm.scan, comm.exscan):
                with pytest.raises(UnsupportedOperationError) as refused:
                    call(x)
                messages.append(str(refused.value))
            graph = stream.end_capture()
        stream.begin_capture()  # not current: stream= names it
        with pytest.raises(UnsupportedOperationError, match="scan of a CUDA array"):
            comm.scan(x, stream=stream)
        assert stream.end_capture().nodes == []
        assert graph.nodes == [] and (comm._seq, comm._p2p_seq) == (seq, p2p)
        assert len(comm.trace()) == records
        scanned = comm.scan(x, out=cp.zeros(3, dtype=cp.int32)).get().tolist()
        comm.exscan(x)
        comm.synchronize()
        return messages, scanned, x.get().tolist()

    for rank, (messages, scanned, exscanned) in enumerate(run(2, fn)):
        for name, message in zip(("scan", "exscan"), messages):
            assert message.startswith(f"backend 'nccl' does not support {name} of a CUDA array "
                                      f"in a CUDA graph capture; it combines through temporary "
                                      f"arrays"), message
        assert scanned == [[1] * 3, [3] * 3][rank]
        assert exscanned == [[0] * 3, [1] * 3][rank]
