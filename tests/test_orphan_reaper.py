"""The launcher's orphan reaper (gpucoll/orphan_reaper.py) stops the process groups of a
SIGKILLed ``gpucoll run``'s ranks, with real processes.

Ranks that never call ``gc.init()`` (a shell script with a ``sleep`` child) and a Python rank's
own children must be gone within ``DEADLINE`` seconds of the launcher's SIGKILL, the reaper
too; at a normal end the reaper goes with the launcher and signals nothing. The reaper's input
is checked directly: what is not a registration of a rank of its launcher is refused, and
nothing unregistered is signalled. Every process a test starts is killed in a ``finally``.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from gpucoll.launch import LaunchConfig, UsageError, run_job
from gpucoll.launch_config import plan_launch

from orphan_procs import (DEADLINE, ROOT, SCRIPTS, env_for_job, is_alive, kill_launcher_of,
                          kill_pids, read_pids, reaper_of, seconds_until_gone, stat_fields,
                          wait_for_pids)

TREE_SCRIPT = str(SCRIPTS / "orphan_tree.sh")
RANK_SCRIPT = str(SCRIPTS / "orphan_rank.py")
REAPER = str(ROOT / "gpucoll" / "orphan_reaper.py")

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]


def _reaper_said(err: str, pids: Dict[str, int], names: List[str]) -> None:
    """Fails unless the reaper said it sent SIGTERM to the groups led by ``names``."""
    groups = ", ".join(str(pids[name]) for name in names)
    assert "gpucoll run (orphan reaper): the launcher (pid " in err, err
    assert f"is gone; SIGTERM to the process groups of its ranks ({groups})" in err, err


# -- gpucoll run, launcher SIGKILLed ----------------------------------------------------------


def test_a_shell_job_and_its_children_die_with_the_sigkilled_launcher(tmp_path: Path):
    pids, err = kill_launcher_of(["-n", "2", TREE_SCRIPT, str(tmp_path)], tmp_path, ranks=2,
                                 extra_pids=2)
    assert sorted(pids) == ["reaper", "shell0.pid", "shell1.pid", "sleep0.pid", "sleep1.pid"]
    _reaper_said(err, pids, ["shell0.pid", "shell1.pid"])
    assert "SIGKILL in 3 s (GPUCOLL_ORPHAN_GRACE)" in err, err
    assert "still running" not in err, err  # SIGTERM was enough


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path):
    pids, err = kill_launcher_of(["-n", "2", TREE_SCRIPT, str(tmp_path), "--ignore-term"],
                                 tmp_path, ranks=2, extra_pids=2, GPUCOLL_ORPHAN_GRACE="0.5")
    _reaper_said(err, pids, ["shell0.pid", "shell1.pid"])
    assert "SIGKILL in 0.5 s (GPUCOLL_ORPHAN_GRACE)" in err, err
    assert (f"process groups {pids['shell0.pid']}, {pids['shell1.pid']} still running 0.5 s "
            f"after SIGTERM; SIGKILL") in err, err


def test_the_children_of_python_ranks_die_with_the_sigkilled_launcher(tmp_path: Path):
    # The ranks stop themselves (gc.init()'s guard); their `sleep` children only by the reaper.
    pids, _ = kill_launcher_of(["-n", "2", RANK_SCRIPT, str(tmp_path), "--child"], tmp_path,
                               ranks=2, extra_pids=2)
    assert sorted(pids) == ["child0.pid", "child1.pid", "rank0.pid", "rank1.pid", "reaper"]


# -- gpucoll run, normal end ------------------------------------------------------------------


@pytest.mark.parametrize("code, reaper_killed", [(0, False), (3, False), (0, True)],
                         ids=["exit-0", "exit-3", "reaper-killed-first"])
def test_at_a_normal_end_the_reaper_goes_with_the_launcher(tmp_path: Path, code: int,
                                                           reaper_killed: bool):
    go = tmp_path / "go"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpucoll", "run", "-n", "2", TREE_SCRIPT, str(tmp_path),
         "--exit-when", str(go), str(code)], cwd=ROOT, env=env_for_job(),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids: Dict[str, int] = {}
    try:
        pids = wait_for_pids(tmp_path, 4, launcher)
        reaper = reaper_of(launcher.pid)
        assert reaper is not None, "the launcher started no orphan reaper"
        if reaper_killed:
            os.kill(reaper, signal.SIGKILL)
            seconds_until_gone({"reaper": reaper})
        go.touch()
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == code, err
        assert not is_alive(reaper), f"the reaper (pid {reaper}) outlived its launcher"
        assert "(orphan reaper)" not in err, err  # it signalled nothing, said nothing
        assert ("stopped listening" in err) == reaper_killed, err
        sleeps = [pids["sleep0.pid"], pids["sleep1.pid"]]
        if code == 0:  # ranks that ended well: what they left running is left alone
            assert all(is_alive(pid) for pid in sleeps), err
        else:  # failed ranks: the launcher itself stops their groups
            seconds_until_gone({"sleep0": sleeps[0], "sleep1": sleeps[1]})
    finally:
        kill_pids([launcher.pid, *pids.values(), *read_pids(tmp_path).values()])
        launcher.wait(5)
        launcher.stderr.close()


@pytest.mark.parametrize("grace", ["-1", "inf", "nan", "soon"])
def test_a_bad_grace_is_a_usage_error_before_anything_starts(grace):
    with pytest.raises(UsageError, match=f"GPUCOLL_ORPHAN_GRACE.*{grace}"):
        plan_launch(LaunchConfig("sh", ("-c", "exit 0"), nproc=2,
                                 env=env_for_job(GPUCOLL_ORPHAN_GRACE=grace)))


def test_a_launcher_that_cannot_start_its_reaper_says_so_and_runs_the_job(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "executable", str(ROOT / "no-such-python"))
    code = run_job(LaunchConfig("sh", ("-c", "exit 0"), nproc=2, env=env_for_job(),
                                stdout=io.StringIO(), stderr=err))
    assert code == 0, err.getvalue()
    assert "gpucoll run: cannot start the orphan reaper ([Errno 2] No such file or directory" \
        in err.getvalue(), err.getvalue()


# -- the reaper's input, directly -------------------------------------------------------------


def _start_ticks(pid: int) -> int:
    fields = stat_fields(pid)
    assert fields is not None
    return int(fields[19])


def _sleeper(**popen: object) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, **popen)


def test_the_reaper_refuses_what_is_not_a_rank_of_its_launcher_and_signals_only_ranks():
    # Registered: a running rank, and one that exited leaving a child in its group (found
    # through /proc). Refused: malformed lines, and pids that are not ranks of the launcher.
    # This test process plays the launcher: the reaper is its child, as are the "ranks".
    rank = _sleeper(start_new_session=True)  # registered: the only one to be signalled
    bystander = _sleeper(start_new_session=True)  # a rank's shape, but never registered
    same_group = _sleeper()  # in this test's own process group: never a rank
    adopted = subprocess.Popen(["sh", "-c", "setsid sleep 60 & echo $!; wait"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                               start_new_session=True)  # leads a session, but not our child
    # A registered rank that exited and was reaped, leaving a child in its group.
    leaderless = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
    reaper = None
    stranger = left_behind = None
    try:
        stranger = int(adopted.stdout.readline())
        left_behind = int(leaderless.stdout.readline())
        leaderless_start = _start_ticks(leaderless.pid)  # unreaped until the wait below
        assert leaderless.wait(DEADLINE) == 0
        lines = [
            b"hello",
            b"rank",
            b"rank x 5",
            b"rank 1 5",
            f"rank {os.getpid()} {_start_ticks(os.getpid())}".encode(),  # the launcher itself
            f"rank {same_group.pid} {_start_ticks(same_group.pid)}".encode(),
            f"rank {bystander.pid} {_start_ticks(bystander.pid) + 1}".encode(),  # wrong start
            f"rank {stranger} {_start_ticks(stranger)}".encode(),
            f"rank {bystander.pid} 0".encode(),
            f"ended {bystander.pid}".encode(),  # never registered
            b"done please",
            b"\xff\xfe" + b"x" * 400,  # cut at 256 bytes: two refusals
            f"rank {rank.pid} {_start_ticks(rank.pid)}".encode(),
            f"rank {leaderless.pid} {leaderless_start}".encode(),
        ]
        reaper = subprocess.Popen([sys.executable, "-I", "-S", REAPER, str(os.getpid()), "30"],
                                  stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True)
        # End of input without "done": as if the launcher died.
        _, err = reaper.communicate(b"\n".join(lines) + b"\n", timeout=DEADLINE)
        text = err.decode()
        assert reaper.returncode == 0, text
        assert rank.wait(DEADLINE) == -signal.SIGTERM
        seconds_until_gone({"left behind": left_behind})
        for process in (bystander, same_group, adopted):
            assert process.poll() is None, text
        assert is_alive(stranger), text
        refusals = [line for line in text.splitlines() if ": refused " in line]
        assert len(refusals) == len(lines) - 2 + 1, text  # all but the ranks; the long line twice
        for expected in ["expected 'rank PID START', 'ended PID' or 'done'",
                         "pid 1 cannot be a rank", f"pid {os.getpid()} cannot be a rank",
                         f"pid {same_group.pid} does not lead its own session and process group",
                         f"pid {bystander.pid} started at tick",
                         f"pid {stranger} is not a child of the launcher (pid {os.getpid()})",
                         "start time 0 is not a process's",
                         f"pid {bystander.pid} is not a registered rank"]:
            assert expected in text, (expected, text)
        assert f"SIGTERM to the process groups of its ranks ({rank.pid}, {leaderless.pid})" \
            in text, text
    finally:
        kill_pids([process.pid for process in (rank, bystander, same_group, adopted)]
                  + [pid for pid in (stranger, left_behind) if pid is not None])
        for process in (rank, bystander, same_group, adopted, leaderless):
            process.wait(5)
            if process.stdout is not None:
                process.stdout.close()
        if reaper is not None and reaper.poll() is None:
            reaper.kill()
            reaper.wait(5)


def test_the_reaper_ends_at_done_and_signals_nothing():
    rank = _sleeper(start_new_session=True)
    try:
        reaper = subprocess.run(
            [sys.executable, "-I", "-S", REAPER, str(os.getpid()), "30"],
            input=f"rank {rank.pid} {_start_ticks(rank.pid)}\ndone\n".encode(),
            capture_output=True, timeout=DEADLINE)
        assert reaper.returncode == 0 and reaper.stderr == b"", reaper.stderr
        with pytest.raises(subprocess.TimeoutExpired):  # no signal on its way
            rank.wait(0.3)
    finally:
        rank.kill()
        rank.wait(5)


@pytest.mark.parametrize("args", [[], ["1"], ["x", "1"], ["1", "1"], ["100", "-1"],
                                  ["100", "inf"], ["100", "nan"]])
def test_the_reaper_refuses_bad_arguments(args):
    result = subprocess.run([sys.executable, "-I", "-S", REAPER, *args], input=b"",
                            capture_output=True, timeout=DEADLINE)
    assert result.returncode == 2
    assert result.stderr.decode().startswith("gpucoll run (orphan reaper): bad arguments: "), \
        result.stderr
