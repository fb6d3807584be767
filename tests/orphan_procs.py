"""Helpers for the tests that SIGKILL a launcher and watch its job go (test_orphan_guard.py,
test_orphan_reaper.py): environments, pid files, liveness from ``/proc``, bounded waits."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from gpucoll.transports.shm import SHM_DIR, job_prefix

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
DEADLINE = 10.0  # seconds the processes of a SIGKILLed launcher's job may take to go

_OUTER = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE", "GPUCOLL_LAUNCHER_PID",
          "GPUCOLL_LAUNCHER_PID_NAMESPACE", "GPUCOLL_ORPHAN_GRACE"]


def env_for_job(**extra: str) -> Dict[str, str]:
    """This environment without an outer launcher's variables, with the tree importable."""
    env = {key: value for key, value in os.environ.items() if key not in _OUTER}
    env["PYTHONPATH"] = str(ROOT)
    env["ORPHAN_PYTHON"] = sys.executable
    env.update(extra)
    return env


def stat_fields(pid: int) -> Optional[List[str]]:
    """Fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def read_pids(piddir: Path) -> Dict[str, int]:
    return {path.name: int(path.read_text()) for path in piddir.glob("*.pid")}


def wait_for_pids(piddir: Path, count: int, launcher: subprocess.Popen,
                  timeout: float = 30) -> Dict[str, int]:
    """The pid files of ``piddir`` once ``count`` are there (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = read_pids(piddir)
        if len(pids) >= count:
            return pids
        if launcher.poll() is not None:
            raise AssertionError(f"the launcher ended early:\n{launcher.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"only {sorted(read_pids(piddir))} of {count} pid files appeared")


def seconds_until_gone(pids: Dict[str, int], timeout: float = DEADLINE) -> float:
    """Seconds until every pid is gone; fails naming the survivors after ``timeout``."""
    start = time.monotonic()
    while True:
        alive = {name: pid for name, pid in pids.items() if is_alive(pid)}
        elapsed = time.monotonic() - start
        if not alive:
            return elapsed
        if elapsed > timeout:
            raise AssertionError(f"still running {timeout:g} s after the launcher was killed: "
                                 f"{alive}")
        time.sleep(0.02)


def kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def shm_files(token: str) -> List[str]:
    prefix = job_prefix(token)
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix)) \
        if os.path.isdir(SHM_DIR) else []


def reaper_of(launcher: int) -> Optional[int]:
    """The pid of the orphan reaper the launcher ``launcher`` started, or None."""
    for name in os.listdir("/proc"):
        fields = stat_fields(int(name)) if name.isdigit() else None
        if fields is None or int(fields[1]) != launcher:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                if b"orphan_reaper.py" in handle.read():
                    return int(name)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return None


def kill_launcher_of(args: List[str], piddir: Path, ranks: int, extra_pids: int = 0,
                     reaper: bool = True, **env: str) -> Tuple[Dict[str, int], str]:
    """Start ``gpucoll run ARGS``, SIGKILL it once every rank (and ``extra_pids`` more) wrote
    its pid, and return the pids, its reaper's included, once they are all gone (the test fails
    if one outlives ``DEADLINE``), with what the launcher and its reaper wrote to stderr.

    ``reaper=False`` SIGKILLs the launcher's orphan reaper first, so that only the in-rank
    guard (gpucoll.orphan_guard) acts."""
    token = secrets.token_hex(8)
    launcher = subprocess.Popen([sys.executable, "-m", "gpucoll", "run", *args], cwd=ROOT,
                                env=env_for_job(GPUCOLL_AUTH_TOKEN=token, **env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    pids: Dict[str, int] = {}
    try:
        pids = wait_for_pids(piddir, ranks + extra_pids, launcher)
        reaper_pid = reaper_of(launcher.pid)
        assert reaper_pid is not None, "the launcher started no orphan reaper"
        pids["reaper"] = reaper_pid
        if not reaper:
            os.kill(reaper_pid, signal.SIGKILL)
            seconds_until_gone({"reaper": reaper_pid})
        launcher.kill()
        seconds_until_gone(pids)
        _, err = launcher.communicate(timeout=DEADLINE)  # the reaper held it open: it is gone
        assert shm_files(token) == []
        return pids, err
    finally:
        kill_pids([launcher.pid, *pids.values(), *read_pids(piddir).values()])
        launcher.wait(5)
        launcher.stderr.close()
