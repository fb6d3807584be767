"""Rank program for tests/test_orphan_guard.py: initialise gpucoll, then all-reduce until stopped.

Usage: ``orphan_rank.py PIDDIR [--rounds N] [--ignore-term] [--no-pidfd] [--child]``

Writes its pid to ``PIDDIR/rank<R>.pid`` once ``gc.init()`` returned, then all-reduces a small
array in a loop: forever, or ``N`` rounds (checking every result against NumPy) and exit 0.
``--ignore-term`` ignores SIGTERM, so only SIGKILL stops it; ``--no-pidfd`` hides
``os.pidfd_open`` before gpucoll is imported, as on a kernel without pidfds; ``--child`` first
starts a ``sleep 1000`` child (as a data-loader worker would be), its pid in ``PIDDIR/child<R>.pid``.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np

piddir = sys.argv[1]
options = sys.argv[2:]
rounds = int(options[options.index("--rounds") + 1]) if "--rounds" in options else None
if "--ignore-term" in options:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "--no-pidfd" in options:
    del os.pidfd_open

import gpucoll as gc  # noqa: E402

comm = gc.init(backend="cpu", timeout=60)


def write_pid(name, pid):
    path = os.path.join(piddir, f"{name}{comm.rank}.pid")
    with open(path + ".tmp", "w") as handle:
        handle.write(str(pid))
    os.replace(path + ".tmp", path)


if "--child" in options:
    child = subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    write_pid("child", child.pid)
write_pid("rank", os.getpid())
done = 0
while rounds is None or done < rounds:
    x = np.full(5, comm.rank + 1.0)
    comm.all_reduce(x)
    expected = np.full(5, comm.size * (comm.size + 1) / 2)
    if not np.array_equal(x, expected):
        raise SystemExit(f"rank {comm.rank}: all_reduce gave {x}, expected {expected}")
    done += 1
    time.sleep(0.01)
comm.close()
print(f"rank {comm.rank} did {done} rounds", flush=True)
