"""``gpucoll run --elastic`` and ``--min-ranks``: a lost rank does not stop the others, its
death reaches the store, and the survivors shrink without waiting for it.

Real launcher processes, as in tests/test_launch.py (whose helpers are reused).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_launch import SCRIPTS, WORKER_SCRIPT, _pids, _rank_lines, _run, _wait_dead, piddir  # noqa: F401

pytestmark = pytest.mark.timeout(45)

ELASTIC_SCRIPT = str(SCRIPTS / "elastic_shrink.py")


def test_elastic_job_survives_a_sigkilled_rank_and_the_survivors_shrink():
    # the ranks' timeout is 60 s: within this test's 45 s, shrink can only have finished
    # because the launcher's death record told the survivors not to wait for rank 2
    result = _run(["run", "-n", "4", "--elastic", ELASTIC_SCRIPT, "2", "3", "1"], timeout=40)
    assert result.returncode == 0, result.stderr
    assert "gpucoll run: rank 2 lost (signal SIGKILL); 3 rank(s) go on (--elastic)" \
        in result.stderr, result.stderr
    assert ("gpucoll run: elastic job finished: 3 of 4 ranks exited 0; lost rank(s) 2 "
            "(signal SIGKILL)") in result.stderr, result.stderr
    reports = {rank: json.loads(rest) for rank, rest in _rank_lines(result.stdout, "SHRUNK").items()}
    assert sorted(reports) == [0, 1, 3]  # the slow rank 1 was kept
    for new_rank, world_rank in enumerate([0, 1, 3]):
        assert reports[world_rank] == {"rank": new_rank, "size": 3, "ranks": [0, 1, 3],
                                       "lost": {"2": "signal SIGKILL"}, "sum": 4.0}


def test_elastic_job_stops_below_min_ranks(piddir: Path):
    result = _run(["run", "-n", "3", "--elastic", "--min-ranks", "3", WORKER_SCRIPT, str(piddir),
                   "1", "exit3"])
    assert result.returncode == 3, result.stderr
    assert ("gpucoll run: rank 1 lost (exit code 3); 2 rank(s) left, fewer than --min-ranks 3: "
            "stopping the job") in result.stderr, result.stderr
    assert ("gpucoll run: root cause (first observed failure): rank 1 failed (exit code 3); "
            "stopped ranks 0, 2") in result.stderr, result.stderr
    assert _wait_dead(_pids(piddir)) == []


@pytest.mark.parametrize("args, message", [
    (["--min-ranks", "2"], "--min-ranks applies to elastic jobs only: add --elastic"),
    (["--elastic", "--min-ranks", "3"], "min_ranks=3 is more than the 2 ranks of this node"),
    (["--elastic", "--min-ranks", "0"], "min_ranks must be an integer >= 1, got 0"),
])
def test_elastic_usage_errors_exit_2(args, message):
    result = _run(["run", "-n", "2", *args, WORKER_SCRIPT, "x", "0", "exit0"])
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
