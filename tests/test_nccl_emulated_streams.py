"""The NCCL backend over the CUDA emulation (tests/emulated_cuda/): Work and streams, host
waits that time out, and CUDA faults named at once.

Ranks are threads (see tests/nccl_emulated_harness.py). Real NCCL on a real GPU is tested by
tests/test_nccl_gpu.py.
"""

import threading
import time

import numpy as np
import pytest

import gpucoll
from gpucoll.backends.nccl import CudaWork
from gpucoll.errors import CommAbortedError, CommTimeoutError

from nccl_emulated_harness import _wait_until, emu, run  # noqa: F401

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- Work and streams
class _TorchLikeStream:
    def __init__(self, ptr):
        self.cuda_stream = ptr


class _ProtocolStream:
    def __init__(self, ptr):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


def test_async_work_follows_its_stream(run, emu):
    cp = emu.cupy

    def fn(comm):
        producer = cp.cuda.Stream(non_blocking=True)
        consumer = cp.cuda.Stream(non_blocking=True)
        x = cp.arange(8, dtype=cp.float32)
        emu.stall(producer)
        work = comm.all_reduce(x, "max", async_op=True, stream=producer)
        assert isinstance(work, CudaWork) and isinstance(work, gpucoll.Work)
        assert (work.op, work.seq) == ("all_reduce", 1)
        assert not work.is_completed() and work.exception() is None
        assert "pending" in repr(work)
        assert emu.pending(producer) == 2  # the all-reduce and its event
        with consumer:
            assert work.wait()  # the consumer stream waits; the host does not
            after = cp.cuda.Event()
            after.record(consumer)
        assert not after.done  # held behind the producer's operation
        emu.release(producer)
        assert work.is_completed() and after.done and "done" in repr(work)
        assert work.synchronize() and work.exception() is None
        assert work.result() is x

        with producer:  # no stream=: the current stream
            emu.stall(producer)
            w2 = comm.all_reduce(cp.full(4, 3.0), async_op=True)
            assert not w2.is_completed() and emu.pending(producer) == 2
            emu.release(producer)
        assert w2.is_completed()
        for given in (producer.ptr, _TorchLikeStream(producer.ptr), _ProtocolStream(producer.ptr),
                      producer):
            emu.stall(producer)
            z = cp.ones(2)
            assert comm.all_reduce(z, stream=given) is z
            assert emu.pending(producer) == 2, given
            emu.release(producer)
        comm.synchronize(timeout=5)
        assert _wait_until(lambda: comm._watchdog.outstanding() == [])  # retired by the watchdog
        return True

    assert run(1, fn) == [True]


def test_wait_on_the_operations_own_stream_adds_no_stream_wait(run, emu, monkeypatch):
    """``wait()`` on the stream the operation was queued on asks nothing of CUDA (the stream's
    order already puts what comes next after it); on another stream, or on another GPU's
    default stream (handle 0 names one stream per GPU), the stream waits for its event."""
    cp = emu.cupy
    waits = []
    real = cp.cuda.runtime.streamWaitEvent
    monkeypatch.setattr(cp.cuda.runtime, "streamWaitEvent",
                        lambda stream, event, flags=0: waits.append(stream) or
                        real(stream, event, flags))

    def fn(comm):
        side = cp.cuda.Stream(non_blocking=True)
        x = cp.arange(4, dtype=cp.float32)
        work = comm.all_reduce(x, async_op=True)  # on the default stream (0)
        assert work.wait() and waits == []
        with side:
            assert work.wait() and waits == [side.ptr]
        with cp.cuda.Device((comm.device + 1) % emu.device_count):
            assert cp.cuda.get_current_stream().ptr == 0
            assert work.wait() and waits == [side.ptr, 0]
        emu.stall(side)
        with side:
            held = comm.all_reduce(cp.ones(3), async_op=True)
            assert held.wait() and waits == [side.ptr, 0]
            after = cp.cuda.Event()
            after.record(side)
        assert not after.done  # the same stream: still behind the held operation
        emu.release(side)
        assert after.done and held.synchronize()
        comm.synchronize(timeout=5)
        return cp.asnumpy(x).tolist()

    assert run(1, fn) == [[0.0, 1.0, 2.0, 3.0]]


def test_a_held_collective_runs_when_its_stream_goes_on(run, emu):
    cp = emu.cupy
    releasing = threading.Event()

    def fn(comm):
        x = cp.full(4, comm.rank + 1.0)
        if comm.rank == 0:
            stream = cp.cuda.Stream(non_blocking=True)
            emu.stall(stream)
            work = comm.all_reduce(x, async_op=True, stream=stream)
            time.sleep(0.1)
            assert not work.is_completed()
            np.testing.assert_array_equal(x.get(), np.full(4, 1.0))  # nothing ran yet
            releasing.set()
            emu.release(stream)  # runs here and meets rank 1
            assert work.synchronize(timeout=5)
        else:
            comm.all_reduce(x)  # waits in the emulated NCCL for rank 0
            assert releasing.is_set()
        np.testing.assert_array_equal(x.get(), np.full(4, 3.0))
        return True

    assert run(2, fn) == [True, True]


def test_synchronize_timeout_aborts_the_communicator(run, emu):
    cp = emu.cupy

    def fn(comm):
        stream = cp.cuda.Stream(non_blocking=True)
        x = cp.ones(4)
        emu.stall(stream)
        work = comm.all_reduce(x, async_op=True, stream=stream)
        started = time.monotonic()
        with pytest.raises(CommTimeoutError,
                           match=r"rank 0: all_reduce #1 did not complete on GPU 0 within 0.2 s"
                                 r"; every rank had issued it, so NCCL itself stalled.*"
                                 r"the communicator was aborted") as info:
            work.synchronize(timeout=0.2)
        assert 0.2 <= time.monotonic() - started < 3
        assert (info.value.op, info.value.seq, info.value.rank) == ("all_reduce", 1, 0)
        assert comm.nccl_comm._status == "aborted"
        assert work.is_completed() and isinstance(work.exception(), CommTimeoutError)
        with pytest.raises(CommTimeoutError, match="all_reduce #1 did not complete"):
            work.wait()
        with pytest.raises(CommTimeoutError, match="all_reduce #1 did not complete"):
            comm.all_reduce(x)
        with pytest.raises(CommTimeoutError):
            comm.barrier()
        emu.release(stream)  # the aborted operation is dropped; nothing hangs
        assert work.is_completed()
        # its event completes now (NCCL's aborted kernels exit), but its result is garbage:
        # the Work still reports the failure
        assert work._event.done
        assert isinstance(work.exception(), CommTimeoutError)
        with pytest.raises(CommTimeoutError, match="all_reduce #1 did not complete"):
            work.wait()
        with pytest.raises(CommTimeoutError, match="all_reduce #1 did not complete"):
            work.synchronize(timeout=1)
        with pytest.raises(CommTimeoutError, match="all_reduce #1 did not complete"):
            work.result()
        return True

    assert run(1, fn) == [True]
    assert emu.calls["abort"] == 1


def _faulted_all_reduce(comm, emu):
    """all_reduce #1 enqueued on a stalled stream that then faults (CUDA error 700)."""
    cp = emu.cupy
    stream = cp.cuda.Stream(non_blocking=True)
    x = cp.ones(4)
    emu.stall(stream)
    comm.all_reduce(x, stream=stream)
    emu.inject_fault(stream, 700)
    return stream, x


def test_a_cuda_fault_is_named_at_once_not_reported_as_a_timeout(run, emu):
    """cudaEventQuery returns an error status without raising; a failed event is not "still
    running": the watchdog and a host wait both name the CUDA error."""
    def fn(comm):
        stream, x = _faulted_all_reduce(comm, emu)
        started = time.monotonic()
        _wait_until(lambda: comm._failure is not None)
        assert time.monotonic() - started < 3  # the communicator's timeout is 10 s
        with pytest.raises(CommAbortedError, match=r"all_reduce #1: the GPU reported "
                                                   r"cudaErrorIllegalAddress.*CUDA error 700"):
            comm.all_reduce(x)
        assert comm.nccl_comm._status == "aborted"
        emu.release(stream)
        return True

    assert run(1, fn) == [True]


def test_an_error_raised_while_another_thread_aborts_waits_for_that_abort(run, emu):
    """The watchdog fails the communicator and aborts it on its own thread; a call on the
    user's thread that sees the failure meanwhile raises only once that abort has returned
    (bounded), so "the communicator was aborted" is true when the error is read."""
    emu.abort_hold = threading.Event()  # NCCL's abort waits until this is set

    def fn(comm):
        stream, x = _faulted_all_reduce(comm, emu)
        assert _wait_until(lambda: comm._failure is not None)
        release = threading.Timer(0.3, emu.abort_hold.set)
        release.start()
        try:
            started = time.monotonic()
            with pytest.raises(CommAbortedError, match="CUDA error 700"):
                comm.all_reduce(x)
            waited = time.monotonic() - started
            assert comm.nccl_comm._status == "aborted"
        finally:
            release.cancel()
            emu.abort_hold.set()
        emu.release(stream)
        return waited

    [waited] = run(1, fn)
    assert 0.1 < waited < 3, waited


def test_a_cuda_fault_ends_a_host_wait_with_its_name(run, emu, monkeypatch):
    cp = emu.cupy
    monkeypatch.setenv("GPUCOLL_WATCHDOG_INTERVAL", "30")  # the host wait sees it first

    def fn(comm):
        stream = cp.cuda.Stream(non_blocking=True)
        x = cp.ones(4)
        emu.stall(stream)
        work = comm.all_reduce(x, async_op=True, stream=stream)
        emu.inject_fault(stream, 719)
        with pytest.raises(CommAbortedError, match="cudaErrorLaunchFailure"):
            work.synchronize(timeout=5)
        assert work.is_completed() and isinstance(work.exception(), CommAbortedError)
        emu.release(stream)
        return True

    assert run(1, fn) == [True]


def test_scan_runs_in_the_order_of_its_stream(run, emu):
    """scan / exscan enqueue their sends, receives and combines on the call's stream (stream=,
    or the current one): all held while it is stalled, right once it goes on."""
    cp = emu.cupy

    def fn(comm):
        stream = cp.cuda.Stream(non_blocking=True)
        x = cp.asarray(np.arange(5.0) + 10 * comm.rank)
        y = cp.asarray(np.arange(5, dtype=np.int64) * (comm.rank + 2))
        emu.stall(stream)
        assert comm.scan(x, "min", stream=stream) is x
        with stream:
            out = cp.zeros(5, dtype=cp.int64)
            assert comm.exscan(y, "prod", out=out) is out
        held = emu.pending(stream) > 0
        before = x.get().tolist(), out.get().tolist()
        emu.release(stream)
        stream.synchronize()
        return held, before, x.get().tolist(), out.get().tolist()

    results = run(3, fn)
    for rank, (held, before, x, out) in enumerate(results):
        assert held
        assert before[0] == (np.arange(5.0) + 10 * rank).tolist()  # nothing ran yet
        if rank:  # (rank 0's identity is a fill, which the emulation does at once)
            assert before[1] == [0] * 5
        assert x == np.arange(5.0).tolist()  # min of ranks 0..r: rank 0's
        expected = np.ones(5, np.int64)
        for q in range(rank):
            expected *= np.arange(5) * (q + 2)
        assert out == expected.tolist()
