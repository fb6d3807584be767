"""Threads for ``async_op`` work, reused instead of started per operation.

Starting a thread costs tens of microseconds on an idle machine and milliseconds on a busy
one, which an ``isend``/``irecv`` pair of a pipeline schedule pays twice per micro-batch. A
:class:`WorkerThreads` hands each job to an idle thread when there is one and starts a new
thread only when every thread is busy, so it never bounds how many jobs run at once: an
operation waiting for an earlier one (issue order) can never starve the one it waits for.
Idle threads end after ``IDLE_SECONDS``.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

__all__ = ["WorkerThreads", "IDLE_SECONDS"]

IDLE_SECONDS = 30.0


class WorkerThreads:
    """Run callables on reused daemon threads, each job at once (see the module doc)."""

    def __init__(self, name: str):
        self._name = name
        self._jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job and not yet claimed by submit()
        self._started = 0

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on an idle thread, or on a new one when none is idle."""
        with self._lock:
            claimed = self._idle > 0
            if claimed:
                self._idle -= 1
            else:
                self._started += 1
                number = self._started
        self._jobs.put(job)
        if not claimed:
            threading.Thread(target=self._serve, name=f"{self._name}-{number}",
                             daemon=True).start()

    def _serve(self) -> None:
        job = self._jobs.get()
        while True:
            job()  # jobs report their own errors (to their Work); one must never end the thread
            job = None  # a finished job holds its Work and arrays: not kept while idle
            with self._lock:
                self._idle += 1
            while True:
                try:
                    job = self._jobs.get(timeout=IDLE_SECONDS)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._idle > 0:  # nobody claimed this thread: retire it
                            self._idle -= 1
                            return
                    # claimed just as the wait ended: its job is on the way
