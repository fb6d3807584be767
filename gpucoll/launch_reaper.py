"""The launcher's end of the orphan reaper (:mod:`gpucoll.orphan_reaper`): start the watcher,
tell it of each rank's process group, end it at a normal end.

The lines it writes (``rank PID START``, ``ended PID``, ``done``) are described and parsed in
:mod:`gpucoll.orphan_reaper`. Starting the watcher costs the launcher one ``fork``/``exec``
(well under 3 ms); the watcher's interpreter starts alongside the ranks (bench/RESULTS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, Optional

from . import orphan_reaper
from .orphan_reaper import process_start_ticks

__all__ = ["ReaperLink"]


class ReaperLink:
    """The launcher's end of the pipe: start the watcher, register ranks, end it.

    Every call is cheap and never raises: when the watcher cannot be started or its pipe
    breaks, the link says so once through ``say`` and does nothing more (the in-rank guard
    still covers ranks that call ``gc.init()``).
    """

    def __init__(self, grace: float, say: Callable[[str], None]) -> None:
        self.say = say
        self.proc: Optional[subprocess.Popen] = None
        self.fd: Optional[int] = None
        if os.name != "posix":
            return
        if not sys.executable:  # an embedded interpreter: nothing to run the watcher with
            say("cannot start the orphan reaper (no sys.executable); processes the ranks "
                "start may outlive a killed launcher")
            return
        read_end, write_end = os.pipe()  # neither end is inherited by the ranks
        try:  # -I: not even gpucoll/ on sys.path (its types.py is no stdlib)
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(orphan_reaper.__file__),
                 str(os.getpid()), repr(float(grace))],
                stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            os.close(write_end)
            say(f"cannot start the orphan reaper ({exc}); processes the ranks start may "
                f"outlive a killed launcher")
            return
        finally:
            os.close(read_end)
        os.set_blocking(write_end, False)  # a stuck watcher must never block the launcher
        self.fd = write_end

    @property
    def pid(self) -> Optional[int]:
        return None if self.proc is None else self.proc.pid

    def _send(self, line: str) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, line.encode("ascii"))
        except OSError as exc:
            self.say(f"the orphan reaper (pid {self.pid}) stopped listening ({exc}); processes "
                     f"the ranks start may outlive a killed launcher")
            os.close(self.fd)
            self.fd = None

    def register(self, pid: int) -> None:
        """Call right after starting the rank ``pid``, before anything may reap it."""
        self._send(f"rank {pid} {process_start_ticks(pid)}\n")

    def ended(self, pid: int) -> None:
        """The rank ``pid`` exited 0: its group is left alone from now on."""
        self._send(f"ended {pid}\n")

    def close(self) -> None:
        """Normal end: ``done``, close the pipe, and reap the watcher. One still starting up
        (a job shorter than its ~15 ms start) is SIGKILLed rather than waited for: after
        ``done`` it has nothing left to do. It is this process's unreaped child, so its pid
        cannot be anyone else's."""
        self._send("done\n")
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
