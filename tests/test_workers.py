"""The reused threads behind ``async_op`` work: every job runs, jobs that wait for each other
never starve (no bound on threads), idle threads are reused and retire."""

from __future__ import annotations

import threading
import time

import pytest

from gpucoll.backends import workers
from gpucoll.backends.workers import WorkerThreads

pytestmark = pytest.mark.timeout(30)


def test_idle_threads_are_reused():
    pool = WorkerThreads("test")
    names = []
    for _ in range(20):
        done = threading.Event()
        pool.submit(lambda: (names.append(threading.current_thread().name), done.set()))
        assert done.wait(5)
        time.sleep(0.002)  # let the thread go back to waiting
    assert len(set(names)) <= 2, set(names)


def test_jobs_that_wait_for_later_jobs_all_run():
    """50 jobs each wait for the next one's event: a bounded pool would deadlock."""
    pool = WorkerThreads("test")
    events = [threading.Event() for _ in range(51)]
    finished = []

    def job(i):
        assert events[i + 1].wait(10)
        finished.append(i)
        events[i].set()

    for i in range(50):
        pool.submit(lambda i=i: job(i))
    events[50].set()
    assert events[0].wait(10)
    assert sorted(finished) == list(range(50))


def test_idle_threads_retire(monkeypatch):
    monkeypatch.setattr(workers, "IDLE_SECONDS", 0.05)
    pool = WorkerThreads("retire-test")
    done = threading.Event()
    pool.submit(done.set)
    assert done.wait(5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
            t.name.startswith("retire-test") for t in threading.enumerate()):
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("retire-test")]
    again = threading.Event()
    pool.submit(again.set)  # a new thread when none is left
    assert again.wait(5)
