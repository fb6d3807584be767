"""The launcher's orphan reaper: stops the ranks' process groups when ``gpucoll run`` dies.

``gpucoll run`` starts each rank in its own session, so each rank leads a process group that
also holds everything the rank starts (a shell script's ``sleep``, a binary, a Python rank's
data-loader workers or ``subprocess`` children). A launcher killed outright (``kill -9``, the OOM
killer, a batch system that kills only the top process) cannot stop those groups, and the
in-rank guard (:mod:`gpucoll.orphan_guard`) only helps a process that calls ``gc.init()``, and
only stops that process. So the launcher starts this small watcher first:

- it runs as ``python -I -S orphan_reaper.py LAUNCHER_PID GRACE`` (this file by path, no
  ``import gpucoll`` and no module beyond what the interpreter loads anyway, so it starts in
  about 10 ms, and the launcher does not wait for it to start), in a session of its own, so a
  signal to the launcher's process group (a terminal's Ctrl-C, ``kill -9 -- -PGID``) does not
  reach it;
- its stdin is a pipe from the launcher, which writes one line per rank it starts
  (``rank PID START``: the rank's pid, which is also its process group and session id, and its
  start time in clock ticks, read while the launcher still holds it unreaped), ``ended PID``
  when a rank exits 0 (its group is then left alone, as the launcher itself does when it stops
  a job), and ``done`` at a normal end, after which it closes the pipe;
- end of input without ``done`` means the launcher died, however it died (only the launcher
  holds the pipe's write end: ranks do not inherit it). The watcher then sends SIGTERM to the
  process group of every registered rank that is still there, waits up to ``GRACE`` seconds
  (``GPUCOLL_ORPHAN_GRACE``, the same grace the in-rank guard uses) for the groups to empty,
  SIGKILLs the groups still there, and exits. It outlives the launcher by at most the grace
  plus a fraction of a second, and at a normal end it exits at once.

It never signals anything but a registered group. A registration is refused (with a line on
stderr) unless the pid leads its own session and process group, was started at the time
given, and is a child of the launcher (or the launcher is already gone). Pid reuse: the
watcher opens a pidfd on each rank (``os.pidfd_open``) at registration; before it signals
group ``G`` it checks that the rank it registered still leads it (the pidfd has not fired),
or, when that rank has exited but its children live on, that pid ``G`` is free or still that
rank's zombie (a pid is not reused while a group of that number has members) and that the
group has live members in session ``G`` that started after the rank. What would still pass:
the group emptied, pid ``G`` went to a new process (a wrap-around of the pid counter), which
made a session of its own, started children and exited, all before the launcher died. Without
pidfds (Linux before 5.3, some seccomp profiles) the same checks use the start time in
``/proc`` alone. Without ``/proc`` (macOS) a group is signalled when it exists, relying on the
launcher's ``ended`` lines: a pid reused between a failed rank's end and the launcher's death
could then be hit. A rank (or its child) that moves to a new session (``setsid``) leaves the
group and is not followed.

The launcher's end of the pipe is :class:`gpucoll.launch_reaper.ReaperLink`.
"""

from __future__ import annotations

import os
import select
import sys
import time

# No other import: the watcher starts with the interpreter's own modules only (``signal``,
# ``subprocess`` and ``typing`` would take several times its ~10 ms start). Annotations are
# never evaluated here (``from __future__ import annotations``).

__all__ = ["process_start_ticks", "main", "SIGTERM", "SIGKILL", "POLL_INTERVAL", "MAX_LINE"]

SIGTERM, SIGKILL = 15, 9  # the same on every POSIX system (XSI); not from ``signal`` (see above)

POLL_INTERVAL = 0.02
"""Seconds between checks, during the grace, of whether the signalled groups are empty."""
MAX_LINE = 256
"""Longest input line read at once; a longer one is cut and refused in pieces."""
PREFIX = "gpucoll run (orphan reaper)"


# After the command name: 0 state, 1 ppid, 2 pgrp, 3 session, ... 19 starttime (field 22).
_STATE, _PPID, _PGRP, _SESSION, _START = 0, 1, 2, 3, 19


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode("ascii", "replace")
        fields = text.rsplit(")", 1)[1].split()
        int(fields[_START])
    except (OSError, ValueError, IndexError):  # gone, or read while it went
        return None
    return fields


def process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22); 0 where
    it cannot be read (no ``/proc``)."""
    fields = _stat(pid)
    return int(fields[_START]) if fields is not None else 0


def _have_proc() -> bool:
    return os.path.isdir("/proc/self")


def _say(message: str) -> None:
    try:
        os.write(2, f"{PREFIX}: {message}\n".encode("utf-8", "replace"))
    except OSError:  # stderr went with the launcher
        pass


def _open_pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:  # gone, no pidfds here (ENOSYS, a seccomp EPERM), out of descriptors
        return None


class _Group:
    """A registered rank: the leader of process group and session ``pgid``."""

    def __init__(self, pgid: int, start: int, pidfd: int | None):
        self.pgid = pgid
        self.start = start
        self.pidfd = pidfd

    def leader_alive(self) -> bool | None:
        """Whether the registered leader still runs, by its pidfd; None without one."""
        if self.pidfd is None:
            return None
        return not select.select([self.pidfd], [], [], 0)[0]

    def members(self) -> list[int]:
        """Live (not zombie) processes of group ``pgid`` in session ``pgid`` that started no
        earlier than the leader, from ``/proc``."""
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            fields = _stat(int(name))
            if (fields is not None and fields[_STATE] not in ("Z", "X")
                    and int(fields[_PGRP]) == self.pgid and int(fields[_SESSION]) == self.pgid
                    and int(fields[_START]) >= self.start):
                found.append(int(name))
        return found

    def is_ours(self) -> bool:
        """True when group ``pgid`` is still the registered rank's group and has a live member
        (see the module doc); False when it is empty or its number now belongs to another."""
        if self.leader_alive():
            return True
        try:  # cheap first: a group with no process at all (zombies count) is done
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # there, but not ours to signal (another user's)
            pass
        if not _have_proc():
            return True
        leader = _stat(self.pgid)
        if leader is not None and int(leader[_START]) != self.start:
            return False  # the pid was reused: the rank's group is empty
        if leader is not None and leader[_STATE] not in ("Z", "X"):
            return True
        return bool(self.members())


class Reaper:
    """The watcher's state: the launcher, the grace and the registered groups."""

    def __init__(self, launcher: int, grace: float):
        self.launcher = launcher
        self.grace = grace
        self.groups: dict[int, _Group] = {}
        self.have_proc = _have_proc()

    def launcher_gone(self) -> bool:
        return os.getppid() != self.launcher

    def handle(self, line: bytes) -> bool:
        """Act on one input line; True when it was ``done``."""
        words = line.split()
        if words == [b"done"]:
            return True
        try:
            if len(words) == 3 and words[0] == b"rank":
                self.register(int(words[1]), int(words[2]))
                return False
            if len(words) == 2 and words[0] == b"ended":
                self.forget(int(words[1]))
                return False
        except ValueError as exc:
            _say(f"refused {line[:80]!r}: {exc}")
            return False
        _say(f"refused {line[:80]!r}: expected 'rank PID START', 'ended PID' or 'done'")
        return False

    def register(self, pid: int, start: int) -> None:
        if pid <= 1 or pid in (os.getpid(), self.launcher):
            raise ValueError(f"pid {pid} cannot be a rank")
        if start < 0 or (start == 0 and self.have_proc):
            raise ValueError(f"start time {start} is not a process's")
        pidfd = _open_pidfd(pid)  # first: it pins the process the checks below look at
        fields = _stat(pid) if self.have_proc else None
        problem = None
        if fields is None:
            if pidfd is not None:  # no /proc entry but a pidfd: it is gone already
                os.close(pidfd)
                pidfd = None
        elif int(fields[_START]) != start:
            problem = f"pid {pid} started at tick {fields[_START]}, not {start}"
        elif int(fields[_PGRP]) != pid or int(fields[_SESSION]) != pid:
            problem = f"pid {pid} does not lead its own session and process group"
        elif int(fields[_PPID]) != self.launcher and not self.launcher_gone():
            problem = f"pid {pid} is not a child of the launcher (pid {self.launcher})"
        if problem is not None:
            if pidfd is not None:
                os.close(pidfd)
            raise ValueError(problem)
        old = self.groups.pop(pid, None)
        if old is not None and old.pidfd is not None:
            os.close(old.pidfd)
        self.groups[pid] = _Group(pid, start, pidfd)

    def forget(self, pid: int) -> None:
        group = self.groups.pop(pid, None)
        if group is None:
            raise ValueError(f"pid {pid} is not a registered rank")
        if group.pidfd is not None:
            os.close(group.pidfd)

    def _signal(self, groups: list[_Group], signum: int) -> list[_Group]:
        sent = []
        for group in groups:
            try:
                os.killpg(group.pgid, signum)
                sent.append(group)
            except (ProcessLookupError, PermissionError):
                pass
        return sent

    def stop_groups(self) -> None:
        """SIGTERM every registered group still there, SIGKILL those left after the grace."""
        targets = self._signal([g for g in self.groups.values() if g.is_ours()], SIGTERM)
        if not targets:
            return
        pgids = ", ".join(str(group.pgid) for group in targets)
        _say(f"the launcher (pid {self.launcher}) is gone; SIGTERM to the process groups of its "
             f"ranks ({pgids}), SIGKILL in {self.grace:g} s (GPUCOLL_ORPHAN_GRACE)")
        deadline = time.monotonic() + self.grace
        while True:
            targets = [group for group in targets if group.is_ours()]
            remaining = deadline - time.monotonic()
            if not targets or remaining <= 0:
                break
            time.sleep(min(POLL_INTERVAL, remaining))
        killed = self._signal(targets, SIGKILL)
        if killed:
            _say(f"process groups {', '.join(str(g.pgid) for g in killed)} still running "
                 f"{self.grace:g} s after SIGTERM; SIGKILL")

    def serve(self, stream) -> int:
        """Read the launcher's lines until ``done`` (exit 0) or the end of input (the launcher
        died: stop the groups, exit 0)."""
        while True:
            line = stream.readline(MAX_LINE)
            if not line:
                self.stop_groups()
                return 0
            try:
                if self.handle(line):
                    return 0
            except Exception as exc:  # noqa: BLE001  (the watcher must outlive any one line)
                _say(f"refused {line[:80]!r}: {type(exc).__name__}: {exc}")


def main(argv: list[str]) -> int:
    """``orphan_reaper.py LAUNCHER_PID GRACE``: serve stdin (see the module doc).

    Returns:
        0 after ``done`` or after stopping the groups; 2 for bad arguments.
    """
    try:
        if len(argv) != 2:
            raise ValueError(f"expected LAUNCHER_PID GRACE, got {argv!r}")
        launcher, grace = int(argv[0]), float(argv[1])
        if launcher <= 1:
            raise ValueError(f"launcher pid {launcher} is not a launcher's")
        if not 0 <= grace < float("inf"):
            raise ValueError(f"grace {grace!r} must be a finite number of seconds >= 0")
    except ValueError as exc:
        _say(f"bad arguments: {exc}")
        return 2
    # In a session of its own, with no controlling terminal: no terminal's SIGINT or SIGHUP.
    return Reaper(launcher, grace).serve(sys.stdin.buffer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
