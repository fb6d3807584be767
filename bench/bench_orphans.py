"""How long the ranks of a SIGKILLed launcher live on (gpucoll/orphan_guard.py).

Each trial starts a 2-rank job whose ranks initialise gpucoll and then all-reduce in a loop
(tests/scripts/orphan_rank.py), waits until both are in the loop, SIGKILLs the launcher, and
measures from just before the SIGKILL to the moment the last rank is gone (``/proc`` polled
every millisecond; a zombie counts as gone), capped at ``--cap`` seconds. Cases:

- ``gpucoll run`` with Python ranks (the kernel's parent-death signal);
- ``gpucoll run ./job.sh``, the rank a child of a shell (a pidfd on the launcher), and the
  same with ``os.pidfd_open`` hidden (polling the ancestry every 0.5 s);
- ``gc.spawn`` (the caller is SIGKILLed);
- the peers, with the same rank program (no gpucoll launcher variables there, so no guard:
  what the launcher itself does): ``torchrun --nproc-per-node 2`` and Open MPI's
  ``mpirun -n 2``, each when installed.

Usage::

    python bench/bench_orphans.py               # 5 trials per case
    python bench/bench_orphans.py --trials 3 --cap 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import socket
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from clusters import mpirun_command, mpirun_env  # noqa: E402

SCRIPTS = ROOT / "tests" / "scripts"
RANK_SCRIPT = str(SCRIPTS / "orphan_rank.py")
JOB_SCRIPT = str(SCRIPTS / "orphan_job.sh")
_OUTER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE", "GPUCOLL_LAUNCHER_PID",
          "GPUCOLL_LAUNCHER_PID_NAMESPACE")

SPAWN_CALLER = str(SCRIPTS / "orphan_spawn_caller.py")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(piddir: str) -> Dict[str, int]:
    return {name: int(Path(piddir, name).read_text()) for name in os.listdir(piddir)
            if name.endswith(".pid")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trial(command: List[str], ranks: int, cap: float,
          extra_env: Optional[Dict[str, str]] = None) -> Optional[float]:
    """Seconds from the launcher's SIGKILL to its last rank gone; None past ``cap``."""
    env = {key: value for key, value in (extra_env or os.environ).items() if key not in _OUTER}
    env.update(PYTHONPATH=str(ROOT), ORPHAN_PYTHON=sys.executable)
    with tempfile.TemporaryDirectory() as piddir:
        argv = [part.replace("PIDDIR", piddir) for part in command]
        launcher = subprocess.Popen(argv, cwd=piddir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rank_pids: List[int] = []
        try:
            deadline = time.monotonic() + 60
            while len(rank_pids) < ranks:
                if time.monotonic() > deadline or launcher.poll() is not None:
                    raise RuntimeError(f"the ranks of {argv} never started")
                time.sleep(0.05)
                rank_pids = [pid for name, pid in _pids(piddir).items() if name.startswith("rank")]
            time.sleep(0.3)  # in the all-reduce loop
            start = time.monotonic()
            launcher.send_signal(signal.SIGKILL)
            while any(_alive(pid) for pid in rank_pids):
                if time.monotonic() - start > cap:
                    return None
                time.sleep(0.001)
            return time.monotonic() - start
        finally:
            for pid in [launcher.pid, *_pids(piddir).values()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            launcher.wait(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--cap", type=float, default=10.0,
                        help="seconds after which a rank counts as orphaned for good")
    opts = parser.parse_args()
    run = [sys.executable, "-m", "gpucoll", "run", "-n", "2"]
    cases = {
        "gpucoll run, Python ranks (parent-death signal)": run + [RANK_SCRIPT, "PIDDIR"],
        "gpucoll run ./job.sh (pidfd)": run + [JOB_SCRIPT, "PIDDIR"],
        "gpucoll run ./job.sh, no pidfd (polling)": run + [JOB_SCRIPT, "PIDDIR", "--no-pidfd"],
        "gc.spawn (caller SIGKILLed)": [sys.executable, SPAWN_CALLER, "PIDDIR"],
    }
    envs: Dict[str, Dict[str, str]] = {}
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun:
        cases["peer: torchrun --nproc-per-node 2"] = [torchrun, "--nproc-per-node", "2",
                                                      RANK_SCRIPT, "PIDDIR"]
    mpirun, _ = mpirun_command(2)
    if mpirun:
        cases["peer: mpirun -n 2 (Open MPI)"] = [*mpirun, sys.executable, RANK_SCRIPT,
                                                 "PIDDIR"]
        envs["peer: mpirun -n 2 (Open MPI)"] = mpirun_env()
    print(f"{'case':<52} {'median ms':>10} {'max ms':>10}  trials (ms; '-' = alive after "
          f"{opts.cap:g} s)")
    for name, command in cases.items():
        times = []
        for _ in range(opts.trials):
            env = envs.get(name)
            if env is not None:
                env = {**env, "MASTER_PORT": str(_free_port())}
            times.append(trial(command, 2, opts.cap, env))
        done = [t for t in times if t is not None]
        median = f"{statistics.median(done) * 1e3:.1f}" if len(done) == len(times) else "-"
        worst = f"{max(done) * 1e3:.1f}" if len(done) == len(times) else "-"
        listed = " ".join("-" if t is None else f"{t * 1e3:.1f}" for t in times)
        print(f"{name:<52} {median:>10} {worst:>10}  {listed}", flush=True)


if __name__ == "__main__":
    main()
