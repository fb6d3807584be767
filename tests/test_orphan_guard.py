"""Ranks do not outlive a SIGKILLed launcher (gpucoll/orphan_guard.py), with real processes.

The launcher (``python -m gpucoll run``) or a ``gc.spawn`` caller is SIGKILLed while its ranks
all-reduce; every rank must be gone within ``DEADLINE`` seconds. The decision table of
:func:`gpucoll.orphan_guard.guard_rank` (parent, further ancestor, gone, someone else, another
namespace) is checked in small subprocesses. Every process a test starts is killed in a
``finally`` block, and no job leaves a file in /dev/shm.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

from orphan_procs import (DEADLINE, ROOT, SCRIPTS, env_for_job, kill_launcher_of, kill_pids,
                          read_pids, seconds_until_gone, shm_files, wait_for_pids)

RANK_SCRIPT = str(SCRIPTS / "orphan_rank.py")
JOB_SCRIPT = str(SCRIPTS / "orphan_job.sh")

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]


# -- gpucoll run ------------------------------------------------------------------------------


# The launcher's orphan reaper (tests/test_orphan_reaper.py) is SIGKILLed first in these
# tests, so that what stops the ranks is the in-rank guard alone.


def test_python_ranks_die_with_their_sigkilled_launcher(tmp_path: Path):
    kill_launcher_of(["-n", "2", RANK_SCRIPT, str(tmp_path)], tmp_path, ranks=2, reaper=False)


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path):
    # The kernel's SIGTERM is ignored: the guard's thread sends SIGKILL after the grace.
    kill_launcher_of(["-n", "2", RANK_SCRIPT, str(tmp_path), "--ignore-term"], tmp_path,
                     ranks=2, reaper=False, GPUCOLL_ORPHAN_GRACE="0.5")


@pytest.mark.parametrize("options", [[], ["--no-pidfd"], ["--ignore-term"]],
                         ids=["pidfd", "polling", "ignores-sigterm"])
def test_ranks_under_a_shell_die_with_their_sigkilled_launcher(tmp_path: Path, options):
    pids, _ = kill_launcher_of(["-n", "2", JOB_SCRIPT, str(tmp_path), *options], tmp_path,
                               ranks=2, extra_pids=2, reaper=False, GPUCOLL_ORPHAN_GRACE="0.5")
    assert sorted(pids) == ["rank0.pid", "rank1.pid", "reaper", "shell0.pid", "shell1.pid"]
    guarded = []
    for rank in (0, 1):
        err = (tmp_path / f"rank{rank}.err").read_text()
        said = f"gpucoll: rank {rank} (pid {pids[f'rank{rank}.pid']}): the launcher (pid "
        if said not in err:  # its peer stopped first, and it failed of that
            assert re.search(r"^gpucoll\.errors\.(PeerError|CommAbortedError): ", err,
                             re.MULTILINE), err
            continue
        guarded.append(rank)
        assert "is gone, and the job's store and output with it; stopping this rank: SIGTERM " \
               "now, SIGKILL in 0.5 s (GPUCOLL_ORPHAN_GRACE)" in err, err
        assert ("still running 0.5 s after SIGTERM; SIGKILL" in err) == \
            ("--ignore-term" in options), err
    assert guarded, "no rank said why it stopped"


def test_a_normal_run_and_an_elastic_run_are_not_affected(tmp_path: Path):
    # Ranks that outlive the thread that started them by seconds would get a parent-death
    # SIGTERM if that thread were not the one that waits for them.
    for extra in ([], ["--elastic"]):
        token = secrets.token_hex(8)
        result = subprocess.run(
            [sys.executable, "-m", "gpucoll", "run", "-n", "2", *extra, RANK_SCRIPT,
             str(tmp_path), "--rounds", "150"], cwd=ROOT, env=env_for_job(GPUCOLL_AUTH_TOKEN=token),
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=45)
        assert result.returncode == 0, result.stderr
        assert sorted(result.stdout.splitlines()) == ["[rank 0] rank 0 did 150 rounds",
                                                      "[rank 1] rank 1 did 150 rounds"]
        assert "gpucoll: rank" not in result.stderr
        assert shm_files(token) == []


# -- gc.spawn ---------------------------------------------------------------------------------

SPAWN_CALLER = str(SCRIPTS / "orphan_spawn_caller.py")


def test_spawned_ranks_die_with_their_sigkilled_caller(tmp_path: Path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    caller = subprocess.Popen([sys.executable, SPAWN_CALLER, str(piddir)], cwd=tmp_path,
                              env=env_for_job(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    pids: Dict[str, int] = {}
    try:
        pids = wait_for_pids(piddir, 2, caller)
        caller.kill()
        caller.wait(5)
        seconds_until_gone(pids)
    finally:
        kill_pids([caller.pid, *pids.values(), *read_pids(piddir).values()])
        caller.wait(5)
        caller.stderr.close()


# -- the decision table, in small processes ---------------------------------------------------

_GUARD = "from gpucoll.orphan_guard import guard_rank; print(guard_rank(), flush=True)"


def _guard_in_child(launcher: Optional[int], *, namespace: Optional[str] = None,
                    via_shell: bool = False, code: str = _GUARD) -> subprocess.CompletedProcess:
    env = env_for_job(GPUCOLL_ORPHAN_GRACE="5")
    if launcher is not None:
        env["GPUCOLL_LAUNCHER_PID"] = str(launcher)
    if namespace is not None:
        env["GPUCOLL_LAUNCHER_PID_NAMESPACE"] = namespace
    command = [sys.executable, "-c", code]
    if via_shell:
        command = ["/bin/sh", "-c", '"$0" "$@"; exit $?', *command]
    return subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=30)


def test_guard_decisions():
    me = os.getpid()
    our_namespace = os.readlink("/proc/self/ns/pid")
    assert _guard_in_child(None).stdout == "None\n"  # torchrun, mpiexec, srun: nothing
    assert _guard_in_child(me).stdout == "parent-death signal\n"
    assert _guard_in_child(me, namespace=our_namespace).stdout == "parent-death signal\n"
    assert _guard_in_child(me, namespace="pid:[1]").stdout == "None\n"  # another namespace
    assert _guard_in_child(me, via_shell=True).stdout == "pidfd\n"
    no_pidfd = "import os; del os.pidfd_open; " + _GUARD
    assert _guard_in_child(me, via_shell=True, code=no_pidfd).stdout == "polling\n"
    twice = _GUARD + "; print(guard_rank())"
    assert _guard_in_child(me, code=twice).stdout == "parent-death signal\nNone\n"
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # alive, but not an ancestor: someone else's process, left alone
        assert _guard_in_child(stranger.pid).stdout == "None\n"
    finally:
        stranger.kill()
        stranger.wait(5)


# what the child prints to stderr just before the call under test: the time it took to stop is
# counted from there, not from the child's start (Python's start-up is slow on a loaded machine)
_BEGIN = "import sys; print(f'BEGIN {time.time():.3f}', file=sys.stderr, flush=True)"


def _seconds_since_begin(result: subprocess.CompletedProcess, ended: float) -> float:
    found = re.search(r"^BEGIN ([\d.]+)$", result.stderr, re.MULTILINE)
    assert found, result.stderr
    return ended - float(found.group(1))


def test_a_rank_whose_launcher_is_already_gone_stops_at_once():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)  # reaped: its pid is free (or, rarely, someone newer's)
    code = ("import os, time; os.environ['RANK'] = '3'; "
            "from gpucoll.orphan_guard import guard_rank; " + _BEGIN + "; "
            "print(guard_rank(), flush=True); time.sleep(20)")
    result = _guard_in_child(dead.pid, code=code)
    assert _seconds_since_begin(result, time.time()) < DEADLINE  # not the 20 s sleep
    assert result.returncode == -signal.SIGTERM, result.stderr
    # guard_rank() says "gone" while its thread already stops the rank: the SIGTERM may land
    # before, between or after print's writes
    assert result.stdout in ("", "gone", "gone\n"), result.stdout
    assert "gpucoll: rank 3 (pid " in result.stderr
    assert f"): the launcher (pid {dead.pid}) is gone" in result.stderr


def test_init_guards_a_rank_before_it_waits_on_the_store():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    code = ("import time, gpucoll as gc; " + _BEGIN + "; gc.init(backend='cpu', rank=1, "
            "world_size=2, url='tcp://127.0.0.1:9', timeout=30)")
    result = _guard_in_child(dead.pid, code=code)
    assert _seconds_since_begin(result, time.time()) < DEADLINE  # not the 30 s store timeout
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert f"the launcher (pid {dead.pid}) is gone" in result.stderr


def test_import_starts_no_thread():
    code = ("import threading, gpucoll, gpucoll.orphan_guard; "
            "print(sorted(t.name for t in threading.enumerate()))")
    result = _guard_in_child(os.getpid(), code=code)
    assert result.stdout == "['MainThread']\n", result.stderr


def test_a_nested_launcher_stops_its_ranks_when_the_outer_one_dies(tmp_path: Path):
    token = secrets.token_hex(8)
    outer = subprocess.Popen(
        [sys.executable, "-m", "gpucoll", "run", "-n", "1", "-m", "gpucoll", "run", "-n", "2",
         RANK_SCRIPT, str(tmp_path)], cwd=ROOT, env=env_for_job(GPUCOLL_AUTH_TOKEN=token),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids: Dict[str, int] = {}
    try:
        pids = wait_for_pids(tmp_path, 2, outer)
        with open(f"/proc/{pids['rank0.pid']}/stat") as handle:
            pids["inner launcher"] = int(handle.read().rsplit(")", 1)[1].split()[1])
        assert pids["inner launcher"] != outer.pid
        outer.kill()
        outer.wait(5)
        seconds_until_gone(pids)
    finally:
        kill_pids([outer.pid, *pids.values()])
        outer.wait(5)
        outer.stderr.close()
