"""Ranks do not outlive their launcher, even when the launcher is SIGKILLed: the in-rank guard.

``gpucoll run`` and ``gc.spawn`` host the job's store and read the ranks' output; when the
launcher is killed outright (``kill -9``, the OOM killer, a batch system that kills only the
top process) it cannot stop its ranks, and without this guard they would run on as orphans,
blocked in a collective or training with nobody reading their output.

There are two layers. This one acts from inside each rank that calls ``gc.init()``, whatever
started it (``gpucoll run``, ``gc.spawn``, ``gpucoll bench``, a nested ``gpucoll run``), and
stops that process. Under ``gpucoll run`` a second one, the launcher's orphan reaper
(:mod:`gpucoll.orphan_reaper`, a watcher process outside the launcher's process group),
signals each rank's whole process group when the launcher dies: ranks that never call
``gc.init()`` (a shell script, a binary) and the processes ranks start (data-loader workers,
``subprocess`` children). Either layer alone stops a Python rank; both act, and a rank may get
SIGTERM from each.

How it works. The launcher gives each rank :func:`launcher_variables`: its own pid
(``GPUCOLL_LAUNCHER_PID``) and pid namespace. :func:`guard_rank`, called by ``gc.init()`` in
the rank, then:

- when the rank's parent *is* the launcher (a Python rank of ``gpucoll run``, every rank of
  ``gc.spawn``), asks the kernel for SIGTERM when the parent dies (``prctl(PR_SET_PDEATHSIG)``).
  The kernel sends it even while the rank is stuck in C code or holds the GIL. The kernel ties
  this signal to the *thread* that forked the rank: both launchers start their ranks from the
  thread that called them (``run_job`` / ``spawn``), which returns only after every rank has been
  reaped, so no thread's exit can fire it while the rank is still wanted.
- when the launcher is a further ancestor (``gpucoll run -n 2 ./job.sh`` where the shell runs
  Python), opens a pidfd on the launcher (``os.pidfd_open``: exact, a pid that is reused later
  cannot fool it) after checking that the pid is one of the rank's ancestors, and a daemon
  thread waits on it. Where pidfds are unavailable (Linux before 5.3, some seccomp profiles) the
  thread checks the ancestry every :data:`POLL_INTERVAL` seconds instead. Without ``/proc``
  and ``prctl`` (macOS) only a rank whose parent is the launcher is guarded, by polling its
  parent's pid.
- when the launcher is already gone at ``init()`` (its pid is no ancestor and no live process
  that started before the rank), the rank stops at once, before it waits on a store that died
  with the launcher.

What the rank gets: SIGTERM first, so a SIGTERM handler can save a checkpoint (Python's default
disposition ends the rank at once), then SIGKILL ``GPUCOLL_ORPHAN_GRACE`` seconds later from the
guard's thread, so a rank whose handler does not exit still goes. Only the rank process itself is
signalled, never its process group (under ``gc.spawn`` that group is the caller's shell job).
Before the signal the thread writes one line to the rank's stderr; a rank killed by the kernel's
SIGTERM with the default disposition dies before the line, which nobody could read anyway: its
stderr was a pipe to the dead launcher. A rank whose stderr goes elsewhere (a redirect in a
shell script, ``gc.spawn``'s inherited stderr when the rank handles SIGTERM) shows it.

What it does not touch: processes with no ``GPUCOLL_LAUNCHER_PID`` (torchrun, mpiexec, srun,
hand-started ranks), ranks in another pid namespace than their launcher (a container with its
own pids: the pid means nothing there), and a process whose launcher is alive but no ancestor of
it. A program that never calls ``gc.init()`` (a binary, a script that does not use gpucoll),
and the children of a rank, cannot be guarded this way: under ``gpucoll run`` the orphan reaper
stops them; under ``gc.spawn`` (its ranks share the caller's process group, so there is no
group of theirs to signal) they outlive a SIGKILLed caller. Importing this module starts
nothing; :func:`guard_rank` starts at most one thread per process.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from typing import Dict, List, Optional

from . import config

__all__ = ["launcher_variables", "guard_rank", "POLL_INTERVAL", "PR_SET_PDEATHSIG"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_INTERVAL = 0.5
"""Seconds between checks of the launcher where no pidfd can be opened."""
_MAX_ANCESTORS = 256  # bound on the walk up the process tree

_guarded_pid: Optional[int] = None  # the process the guard runs in (a forked child is not it)
_lock = threading.Lock()


def _pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]``), or "" where it cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def launcher_variables() -> Dict[str, str]:
    """The variables a launcher gives each rank so that ``gc.init()`` can guard it.

    Returns:
        ``GPUCOLL_LAUNCHER_PID`` (this process's pid) and ``GPUCOLL_LAUNCHER_PID_NAMESPACE``.
    """
    return {"GPUCOLL_LAUNCHER_PID": str(os.getpid()),
            "GPUCOLL_LAUNCHER_PID_NAMESPACE": _pid_namespace()}


def _stat(pid: int) -> Optional[List[str]]:
    """Fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _ancestors() -> List[int]:
    """This process's ancestors, parent first, as far as ``/proc`` shows them."""
    found: List[int] = []
    pid = os.getppid()
    while pid > 0 and len(found) < _MAX_ANCESTORS:
        found.append(pid)
        fields = _stat(pid)
        if fields is None:
            break
        pid = int(fields[1])
    return found


def _launcher_gone(launcher: int) -> bool:
    """True when no live process can be the launcher: its pid is free, a zombie, or taken by a
    process that started after this one (the launcher started before any of its ranks)."""
    fields = _stat(launcher)
    if fields is None:
        return os.path.isdir("/proc/self")  # no /proc at all proves nothing
    if fields[0] in ("Z", "X"):
        return True
    mine = _stat(os.getpid())
    return mine is not None and int(fields[19]) > int(mine[19])  # field 22: start time


def _set_parent_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)``; False where it is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _open_pidfd(pid: int) -> Optional[int]:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError as exc:
        if exc.errno not in (errno.ESRCH, errno.ENOSYS, errno.EPERM, errno.EINVAL):
            raise
        return None


def _say(message: str) -> None:
    """One line to stderr, lock-free (the main thread may hold ``sys.stderr``'s lock)."""
    try:
        os.write(2, f"gpucoll: {message}\n".encode("utf-8", "replace"))
    except OSError:  # the launcher's pipe has no reader any more
        pass


class _Watch:
    """What the guard thread waits on, and what it does when the launcher is gone."""

    def __init__(self, launcher: int, direct: bool, pidfd: Optional[int], sent_by_kernel: bool,
                 grace: float):
        self.launcher = launcher
        self.direct = direct  # the launcher is this process's parent
        self.pidfd = pidfd
        self.sent_by_kernel = sent_by_kernel  # PR_SET_PDEATHSIG delivers the SIGTERM
        self.grace = grace

    def gone(self) -> bool:
        if self.direct:
            return os.getppid() != self.launcher
        return self.launcher not in _ancestors()

    def wait(self) -> None:
        """Block until the launcher has exited (or was found gone)."""
        if self.pidfd is not None:
            import select

            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            while not poller.poll():
                pass
            return
        while not self.gone():
            time.sleep(POLL_INTERVAL)

    def run(self) -> None:
        self.wait()
        rank = config.get_raw("RANK") or "?"
        _say(f"rank {rank} (pid {os.getpid()}): the launcher (pid {self.launcher}) is gone, and "
             f"the job's store and output with it; stopping this rank: SIGTERM now, SIGKILL in "
             f"{self.grace:g} s (GPUCOLL_ORPHAN_GRACE)")
        if not self.sent_by_kernel:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.grace)
        _say(f"rank {rank} (pid {os.getpid()}): still running {self.grace:g} s after SIGTERM; "
             f"SIGKILL")
        os.kill(os.getpid(), signal.SIGKILL)


def guard_rank() -> Optional[str]:
    """Make this rank stop when its launcher dies (see the module doc); at most once a process.

    Returns:
        How it is guarded: ``"parent-death signal"`` (the launcher is the parent; the kernel
        signals), ``"pidfd"`` or ``"polling"`` (the launcher is a further ancestor), ``"gone"``
        (the launcher was already gone: the rank is being stopped), or None when there is
        nothing to guard (no ``GPUCOLL_LAUNCHER_PID``, another pid namespace, a launcher that
        is no ancestor, already guarded).

    Raises:
        ValueError: ``GPUCOLL_LAUNCHER_PID`` or ``GPUCOLL_ORPHAN_GRACE`` does not parse.
    """
    global _guarded_pid
    launcher = config.get("GPUCOLL_LAUNCHER_PID")
    if launcher is None or launcher <= 0 or os.name != "posix":
        return None
    grace = config.get("GPUCOLL_ORPHAN_GRACE")
    if not grace >= 0:
        raise ValueError(f"environment variable GPUCOLL_ORPHAN_GRACE={grace!r}: must be >= 0")
    namespace = config.get("GPUCOLL_LAUNCHER_PID_NAMESPACE")
    if namespace and namespace != _pid_namespace():
        return None
    with _lock:
        if _guarded_pid == os.getpid():
            return None
        if os.getppid() == launcher:
            # Set first, then look again: a launcher that died in between is seen below.
            by_kernel = _set_parent_death_signal(signal.SIGTERM)
            watch = _Watch(launcher, True, _open_pidfd(launcher), by_kernel, grace)
            how = "parent-death signal" if by_kernel else "polling"
            if watch.gone():  # the kernel may not have signalled: the thread does
                if watch.pidfd is not None:
                    os.close(watch.pidfd)
                watch.pidfd, watch.sent_by_kernel, how = None, False, "gone"
            elif not by_kernel and watch.pidfd is not None:
                how = "pidfd"
        else:
            pidfd = _open_pidfd(launcher)  # opened before the ancestry check: pins the process
            if launcher in _ancestors():
                watch = _Watch(launcher, False, pidfd, False, grace)
                how = "pidfd" if pidfd is not None else "polling"
            elif _launcher_gone(launcher):
                if pidfd is not None:
                    os.close(pidfd)
                watch = _Watch(launcher, False, None, False, grace)
                how = "gone"
            else:
                if pidfd is not None:
                    os.close(pidfd)
                return None
        _guarded_pid = os.getpid()
    threading.Thread(target=watch.run, name="gpucoll-orphan-guard", daemon=True).start()
    return how
