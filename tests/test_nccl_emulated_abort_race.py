"""An abort racing a call into NCCL on another thread, over the CUDA emulation.

``ncclCommAbort`` frees the communicator, and CuPy does not lock its handle: a call another
thread is making into NCCL at that moment would go on using freed memory (the emulation records
that as an error, and the fixture fails on it). So the abort first lets a call that entered
NCCL before the failure return (an enqueue takes microseconds; a call stuck past its deadline
is what the abort ends), and a call that enters after the failure turns back without calling
NCCL. Both with the public ``abort()`` on another thread; ranks are threads
(tests/nccl_emulated_harness.py).
"""

import threading
import time

import pytest

from gpucoll.errors import CommAbortedError

from nccl_emulated_harness import _wait_until, emu, run  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def test_an_abort_waits_for_a_call_another_thread_is_making_into_nccl(run, emu):
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(4, dtype=cp.float32)
        comm.all_reduce(x)
        comm.synchronize()
        emu.call_hold = threading.Event()  # the next call into NCCL stays inside it for now
        issued = {}

        def issue():
            try:
                issued["work"] = comm.all_reduce(x, async_op=True)
            except Exception as exc:  # the failure came while it was inside NCCL
                issued["error"] = exc

        caller = threading.Thread(target=issue)
        caller.start()
        assert _wait_until(lambda: comm.nccl_comm._in_call == 1)
        aborter = threading.Thread(target=comm.abort)
        aborter.start()
        time.sleep(0.3)
        held = (aborter.is_alive(), emu.calls["abort"])  # the abort waits for the call
        emu.call_hold.set()
        caller.join(10)
        aborter.join(10)
        emu.call_hold = None
        error = issued["error"]
        assert isinstance(error, CommAbortedError) and "abort() called on rank 0" in str(error)
        return held, emu.calls["abort"], sorted(issued)

    assert run(1, fn) == [((True, 0), 1, ["error"])]


def test_a_call_after_the_failure_does_not_enter_nccl_while_it_aborts(run, emu, monkeypatch):
    """The failure comes between the call's own check and its entry into NCCL, while NCCL's
    abort is under way: the call turns back with the failure's error."""
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(4, dtype=cp.float32)
        comm.all_reduce(x)
        comm.synchronize()
        watchdog = comm._watchdog
        enter = watchdog.enter_host_call
        emu.abort_hold = threading.Event()  # NCCL's abort stays under way until this is set
        aborter = threading.Thread(target=comm.abort)

        def abort_first(pending):
            aborter.start()
            assert _wait_until(lambda: comm.nccl_comm._tearing_down)
            threading.Timer(0.3, emu.abort_hold.set).start()
            enter(pending)

        monkeypatch.setattr(watchdog, "enter_host_call", abort_first)
        calls = emu.calls["allReduce"]
        with pytest.raises(CommAbortedError, match="abort\\(\\) called on rank 0"):
            comm.all_reduce(x)
        aborter.join(10)
        return emu.calls["allReduce"] - calls, comm.nccl_comm._status

    assert run(1, fn) == [(0, "aborted")]
