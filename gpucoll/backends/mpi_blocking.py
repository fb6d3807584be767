"""The MPI backend's blocking mode: MPI's blocking collectives, bounded by a watchdog thread.

With ``GPUCOLL_MPI_BLOCKING=1`` the MPI backend's short paths (blocking calls on host NumPy
arrays, see :mod:`.mpi_short`) call ``Allreduce``, ``Bcast``, ``Allgather`` and
``Reduce_scatter_block`` instead of their non-blocking forms, which Open MPI runs through a
slower component (two to three times slower from 4 KiB to a few MiB, measured in
bench/RESULTS.md). A blocking MPI call cannot be interrupted, so the communicator's timeout
cannot raise there: :class:`BlockingWatchdog` watches the call instead and, at its deadline,
writes the error (rank, op, sequence number, timeout) to stderr and ends the process with
status :data:`EXIT_STATUS` (``os._exit``); the MPI launcher then ends the job. This is the
trade the setting asks for: a stuck peer costs the job instead of raising
``CommTimeoutError`` in the surviving ranks.

Arming costs one attribute store per call; the thread wakes every ``check_interval`` seconds
(never per call) and sleeps until the armed call's deadline.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional, Tuple

__all__ = ["BlockingWatchdog", "EXIT_STATUS"]

EXIT_STATUS = 124  # as timeout(1): the call ran out of time

_Call = Tuple[float, str, int]  # (deadline, op name, sequence number)


class BlockingWatchdog:
    """Ends the process when a blocking MPI call outlives the communicator's timeout.

    Args:
        rank: this rank (named in the message).
        size: the communicator's size (the message names how many ranks MPI waits for).
        timeout: seconds a call may block.
        check_interval: seconds between checks while no call is near its deadline.
        expire: what to do at the deadline with the message (default: write it to stderr and
            ``os._exit(EXIT_STATUS)``); tests pass their own.
    """

    def __init__(self, rank: int, size: int, timeout: float, *, check_interval: float = 0.1,
                 expire: Optional[Callable[[str], None]] = None):
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        self._interval = max(min(check_interval, self.timeout / 4), 1e-3)
        self._expire = expire or _exit_with
        self._call: Optional[_Call] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name=f"gpucoll-mpi-blocking-watchdog-rank{rank}")
        self._thread.start()

    def arm(self, name: str, seq: int) -> None:
        """A blocking call ``name`` #``seq`` starts now (one per communicator at a time)."""
        self._call = (time.monotonic() + self.timeout, name, seq)

    def disarm(self) -> None:
        """The call returned."""
        self._call = None

    def close(self) -> None:
        """Stop the thread (the communicator is closed)."""
        self._stop.set()

    def message(self, name: str, seq: int) -> str:
        """The error written when ``name`` #``seq`` ran out of time."""
        return (f"gpucoll: CommTimeoutError: rank {self.rank}: {name} #{seq} did not complete "
                f"within {self.timeout:g} s: MPI was still waiting for the other "
                f"{self.size - 1} rank(s) (dead, stuck, or calling another operation). "
                f"GPUCOLL_MPI_BLOCKING=1 calls MPI's blocking collectives, which cannot be "
                f"interrupted, so this process exits with status {EXIT_STATUS}")

    def _watch(self) -> None:
        while not self._stop.is_set():
            call = self._call
            if call is None:
                self._stop.wait(self._interval)
                continue
            remaining = call[0] - time.monotonic()
            if remaining > 0:
                self._stop.wait(min(remaining, self._interval))
            elif self._call is call:
                self._expire(self.message(call[1], call[2]))
                return


def _exit_with(message: str) -> None:
    """Write ``message`` to stderr unbuffered and end the process at once (the main thread is
    inside MPI and cannot be woken; atexit handlers and MPI_Finalize would block too)."""
    try:
        os.write(2, (message + "\n").encode(errors="replace"))
    finally:
        os._exit(EXIT_STATUS)
