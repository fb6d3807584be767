"""How a launched rank ended, and the stop signals the launcher traps while a job runs."""

from __future__ import annotations

import os
import signal
import threading
from typing import Dict, List

STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def exit_code_of(returncode: int) -> int:
    """Shell-style exit code of a child: itself, or 128 + N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"`` for a ``Popen.returncode``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"signal {name}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group led by ``pid``; a vanished group is fine."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass



class SignalTrap:
    """Records SIGINT/SIGTERM/SIGHUP while the job runs (main thread only; elsewhere inert)."""

    def __init__(self) -> None:
        self.received: List[int] = []
        self._previous: Dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __enter__(self) -> "SignalTrap":
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                signum = getattr(signal, name, None)
                if signum is not None:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
