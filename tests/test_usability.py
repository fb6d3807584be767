"""Small things a new user trips on: `python -m gpucoll.config` runs clean, an unknown
GPUCOLL_* variable draws a suggestion of the closest real name, and every timeout message says
what the limit was and that GPUCOLL_TIMEOUT / init(timeout=) sets it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from gpucoll import config
from gpucoll.errors import CommTimeoutError
from gpucoll.rendezvous import MemoryStore
from gpucoll.work import Work
from mp_harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)
HINT = "GPUCOLL_TIMEOUT or init(timeout=) sets it"


def test_config_module_runs_without_the_double_import_warning():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-W", "error", "-m", "gpucoll.config"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr  # -W error: any RuntimeWarning would fail it
    assert "found in sys.modules" not in proc.stderr
    assert proc.stdout == config.markdown_table() + "\n"


def test_import_gpucoll_does_not_import_config_or_cupy():
    code = ("import sys, gpucoll; assert 'gpucoll.config' not in sys.modules; "
            "assert 'cupy' not in sys.modules; gpucoll.init; assert 'gpucoll.config' in "
            "sys.modules; from gpucoll import init; print(init.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0 and proc.stdout == "gpucoll.api\n", proc.stderr


@pytest.mark.parametrize("typed,suggested", [
    ("GPUCOLL_TIMOUT", "GPUCOLL_TIMEOUT"), ("GPUCOLL_TIMEOUTS", "GPUCOLL_TIMEOUT"),
    ("GPUCOLL_timeout", "GPUCOLL_TIMEOUT"), ("GPUCOLL_BAKEND", "GPUCOLL_BACKEND"),
    ("GPUCOLL_QUITE", "GPUCOLL_QUIET"), ("GPUCOLL_RING_TRESHOLD", "GPUCOLL_RING_THRESHOLD"),
    ("GPUCOLL_TOKEN", "GPUCOLL_AUTH_TOKEN"), ("GPUCOLL_DEVICES", "GPUCOLL_DEVICE"),
    ("GPUCOLL_XYZ", None), ("GPUCOLL_FOO", None),
])
def test_unknown_variable_suggests_the_closest_name(typed, suggested):
    assert config.closest_name(typed) == suggested
    [message] = config.unknown_name_warnings({typed: "1", "GPUCOLL_TIMEOUT": "1", "PATH": "/"})
    assert message.startswith(f"unknown environment variable {typed} (not a gpucoll setting; ")
    if suggested:
        assert message.endswith(f"did you mean {suggested}?)")
    else:
        assert message.endswith("`python -m gpucoll.config` lists the settings)")


def test_timeout_error_states_its_limit_once():
    exc = CommTimeoutError("rank 0: x #1 timed out", rank=0, limit=2.5)
    assert str(exc) == f"rank 0: x #1 timed out (the limit is 2.5 s; {HINT})"
    assert exc.add_limit(9) is exc and str(exc).count(HINT) == 1 and exc.limit == 2.5
    later = CommTimeoutError("no limit yet")
    assert later.limit is None and str(later) == "no limit yet"
    later.add_limit(0.25)
    assert str(later) == f"no limit yet (the limit is 0.25 s; {HINT})"


def test_work_and_memory_store_timeouts_say_how_to_change_them():
    with pytest.raises(CommTimeoutError, match=r"timed out after 0.05 s \(wait\(timeout=\) sets "
                                               r"the limit; its default follows GPUCOLL_TIMEOUT"):
        Work("all_reduce", 3, 0, 0.05).wait()
    with pytest.raises(CommTimeoutError) as caught:
        Work("all_reduce", 3, 0, 10).wait(timeout=0.05)  # the caller chose this limit
    assert str(caught.value) == "rank 0: wait() on all_reduce #3 timed out after 0.05 s"
    with pytest.raises(CommTimeoutError, match=r"keys \['k'\] \(the limit is 0.05 s; "
                                               r"GPUCOLL_TIMEOUT or init\(timeout=\) sets it\)"):
        MemoryStore(timeout=5).get("k", timeout=0.05)


def rank_timeouts(comm):
    if comm.rank == 1:
        time.sleep(30)  # never joins rank 0's collectives in time (ended once rank 0 answered)
        return None
    out = []
    try:
        comm.all_reduce(np.ones(4))
    except CommTimeoutError as exc:
        out.append((str(exc), exc.limit))
    return out


def test_collective_timeout_says_the_limit_and_how_to_set_it():
    results = run_ranks(rank_timeouts, 2, env={"GPUCOLL_TIMEOUT": "1"}, timeout=60, ranks=[0])
    [(message, limit)] = results[0]
    assert message.startswith("rank 0: all_reduce #1 timed out waiting for peer(s) [1]")
    assert message.endswith(f"(the limit is 1 s; {HINT})") and limit == 1.0


def rank_barrier_timeout(comm):
    if comm.rank == 1:
        time.sleep(30)  # ended once rank 0 answered
        return None
    try:
        comm.barrier(timeout=0.5)
    except CommTimeoutError as exc:
        return str(exc), exc.limit


def test_barrier_timeout_names_its_own_limit():
    message, limit = run_ranks(rank_barrier_timeout, 2, timeout=60, ranks=[0])[0]
    assert message.endswith(f"(the limit is 0.5 s; {HINT})") and limit == 0.5


def _wait_for_files(folder: str, names, limit: float) -> None:
    """Until every one of ``names`` exists in ``folder``, for at most ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while (time.monotonic() < deadline
           and not all(os.path.exists(os.path.join(folder, name)) for name in names)):
        time.sleep(0.02)


def rank_late_for_barrier(comm, limits, folder):
    timed_out = [f"timed-out-{rank}" for rank in limits]
    if comm.rank == 2:  # late: away until every other rank has timed out
        _wait_for_files(folder, timed_out, 30)
        return None
    try:
        comm.barrier(timeout=limits[comm.rank])
    except CommTimeoutError as exc:
        # stay up until every on-time rank has timed out: a rank that timed out first and
        # exited would close its sockets, and a rank whose clock started later (load) would
        # see that loss, not its own timeout
        open(os.path.join(folder, f"timed-out-{comm.rank}"), "w").close()
        _wait_for_files(folder, timed_out, 30)
        return str(exc), exc.peer
    return "no timeout", None


# Over sockets the dissemination barrier has rank 1 wait on rank 3 (which waits on rank 2).
# A rank that times out aborts, and rank 1 would see rank 3's abort (a lost link) instead of
# its own timeout whenever rank 3's clock started first: rank 3 gets 3 s against rank 1's 1 s,
# so only a start skew of over 2 s could change which fault rank 1 sees.
BARRIER_LIMITS = {"socket": {0: 1, 1: 1, 3: 3}, "auto": {0: 1, 1: 1, 3: 1}}


@pytest.mark.parametrize("transport", ["socket", "auto"])
def test_barrier_timeout_names_the_late_rank_not_the_one_it_waited_on(transport, tmp_path):
    """4 ranks, rank 2 late. Over sockets the dissemination barrier has rank 1 wait on rank 3
    (which waits on rank 2), over shared memory every rank sees who did not arrive; either
    way every on-time rank names rank 2, and only rank 2."""
    limits = BARRIER_LIMITS[transport]
    results = run_ranks(rank_late_for_barrier, 4, limits, str(tmp_path), timeout=60,
                        env={"GPUCOLL_TRANSPORT": transport})
    for rank in (0, 1, 3):
        message, peer = results[rank]
        assert message.startswith(f"rank {rank}: barrier #1 timed out"), message
        named = re.findall(r"\[([\d, ]+)\]", message.partition(" (the limit")[0])
        assert named == ["2"] and peer == 2, message
        assert message.endswith(f"(the limit is {limits[rank]} s; {HINT})"), message


def rank_init_timeout(rank, size, url):
    import gpucoll

    if rank == 1:
        return None  # never calls init
    try:
        gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=1.5)
    except CommTimeoutError as exc:
        return str(exc), exc.limit
    return "joined?"


def test_init_timeout_says_the_limit_and_how_to_set_it():
    message, limit = run_ranks(rank_init_timeout, 2, init=False, timeout=60)[0]
    assert "rank(s) [1] of 2 did not join within 1.5 s" in message
    assert message.endswith(f"(the limit is 1.5 s; {HINT})") and limit == 1.5
