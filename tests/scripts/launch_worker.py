"""Rank program for tests/test_launch.py: sleep, or misbehave on purpose.

Usage: ``launch_worker.py PIDDIR ACTOR ACTION [--ignore-term]``

Every rank writes its pid to ``PIDDIR/rank<R>.pid``. A sleeping rank also starts a child
process (``PIDDIR/rank<R>.child.pid``) and sleeps 60 s. Rank ACTOR instead waits until every
rank has written its pid file, then does ACTION:

- ``exit3``: print ``rank R is about to fail at TIME`` (wall clock), a traceback to stderr,
  and exit with code 3;
- ``sigkill``: kill itself with SIGKILL;
- ``exit0``: exit 0;
- ``sleep``: sleep like the others.

``--ignore-term`` makes the sleepers ignore SIGTERM (so only SIGKILL stops them).
"""

import os
import signal
import subprocess
import sys
import time
import traceback

piddir, actor, action = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ignore_term = "--ignore-term" in sys.argv[4:]
rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])


def write_pid(name, pid):
    path = os.path.join(piddir, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.replace(path + ".tmp", path)


def wait_for_all_ranks():
    deadline = time.monotonic() + 10
    names = [f"rank{peer}.pid" for peer in range(world_size)]
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(piddir, name)) for name in names):
            return
        time.sleep(0.02)
    raise SystemExit(f"rank {rank}: the other ranks never wrote their pid files")


if rank == actor and action != "sleep":
    write_pid(f"rank{rank}.pid", os.getpid())
    wait_for_all_ranks()
    if action == "exit3":
        print(f"rank {rank} is about to fail at {time.time():.3f}", flush=True)
        try:
            raise RuntimeError(f"rank {rank} broke on purpose")
        except RuntimeError:
            traceback.print_exc()
        sys.exit(3)
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "exit0":
        sys.exit(0)
    raise SystemExit(f"unknown action {action!r}")

if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
write_pid(f"rank{rank}.child.pid", child.pid)
write_pid(f"rank{rank}.pid", os.getpid())
print(f"rank {rank} sleeping", flush=True)
time.sleep(60)
