"""What the flight recorder keeps of an async operation (``Work._trace_probe()``): the Work's
state, never blocking, without its result, and still right once the caller dropped the Work."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from gpucoll.errors import CommAbortedError, PeerError
from gpucoll.sendrecv import GroupWork
from gpucoll.work import LiveProbe, Work

pytestmark = pytest.mark.timeout(30)


def _work(op="all_reduce", seq=1):
    return Work(op, seq, 0, 5.0)


def test_a_host_works_probe_follows_it_and_outlives_it_without_its_result():
    work = _work()
    result = np.ones(4)
    result_ref = weakref.ref(result)
    probe = work._trace_probe()
    assert not probe.is_completed() and probe.exception() is None
    work._finish(result)
    assert probe.is_completed() and probe.exception() is None
    del work, result
    gc.collect()
    assert result_ref() is None  # the probe kept no array
    assert probe.is_completed() and probe.exception() is None


def test_a_failed_works_probe_keeps_its_error_after_the_work_is_gone():
    work = _work()
    error = PeerError("rank 1 is gone")
    work._finish(exception=error)
    probe = work._trace_probe()
    del work
    gc.collect()
    assert probe.is_completed() and probe.exception() is error


class _Polled(Work):
    """A Work that finishes when asked (as an MPI request tested by ``is_completed``)."""

    def __init__(self):
        super().__init__("isend", 1, 0, 5.0)
        self.asked = 0
        self.ready = False

    def is_completed(self) -> bool:
        self.asked += 1
        if self.ready and not self._done.is_set():
            self._finish(None)
        return self._done.is_set()

    def exception(self):
        self.is_completed()
        return super().exception()


def test_a_live_probe_asks_the_work_while_it_lives_then_its_outcome():
    work = _Polled()
    probe = LiveProbe(work)
    assert not probe.is_completed() and work.asked == 1
    work.ready = True
    assert probe.is_completed() and work.asked == 2  # reading the trace made the progress
    del work
    gc.collect()
    assert probe.is_completed() and probe.exception() is None


def test_a_live_probe_of_a_work_dropped_unfinished_stays_pending():
    work = _Polled()
    probe = LiveProbe(work)
    del work
    gc.collect()
    assert not probe.is_completed() and probe.exception() is None


def test_a_groups_probe_is_done_once_every_part_is_and_names_the_cause():
    first, second = _work("irecv", 1), _work("isend", 2)
    group = GroupWork("sendrecv", [first, second])
    probe = group._trace_probe()
    first._finish(exception=CommAbortedError("aborted after the send failed"))
    assert not probe.is_completed() and probe.exception() is None
    cause = PeerError("rank 2 closed the connection")
    second._finish(exception=cause)
    del group, first, second
    gc.collect()
    assert probe.is_completed() and probe.exception() is cause  # not the abort it led to
