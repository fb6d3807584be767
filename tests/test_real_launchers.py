"""gpucoll under the real launchers people bring: torchrun (PyTorch) and Open MPI's mpirun.

The other launcher tests fake these launchers' variables; here the launchers themselves start
the ranks. torchrun's agent serves torch's own store on MASTER_PORT, so gpucoll must not try to
serve its store there. Each test skips with the reason when the launcher is not installed
(torch: ``pip install torch``; Open MPI and mpi4py: the ``mpi`` extra).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from clusters import mpirun_command, mpirun_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "launcher_allreduce.py")

pytestmark = pytest.mark.timeout(180)

# Variables of an outer launcher that would leak into the one under test.
_OUTER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE",
          "TORCHELASTIC_USE_AGENT_STORE", "GPUCOLL_BACKEND")


def _env(extra: Dict[str, str] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _OUTER}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def _torchrun() -> str:
    if shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("torchrun is not installed (pip install torch; the CPU wheel is enough)")
    return shutil.which("torchrun", path=os.path.dirname(sys.executable))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _results(stdout: str) -> List[dict]:
    found = [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines()
             if "RESULT " in line]
    return sorted(found, key=lambda r: r["rank"])


@pytest.mark.parametrize("options", [[], ["--standalone"]], ids=["default", "standalone"])
def test_init_under_real_torchrun(options: List[str]):
    """torchrun's defaults (its agent's store on MASTER_PORT) and --standalone."""
    torchrun = _torchrun()
    port = [] if options else ["--master-port", str(_free_port())]
    done = subprocess.run([torchrun, *options, *port, "--nproc-per-node", "2", SCRIPT],
                          env=_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    results = _results(done.stdout)
    assert [(r["rank"], r["size"], r["local_rank"], r["source"]) for r in results] == \
        [(0, 2, 0, "torchrun"), (1, 2, 1, "torchrun")], done.stdout
    assert all(r["values"] == [3.0] * 4 for r in results)


def test_bench_under_real_torchrun():
    torchrun = _torchrun()
    done = subprocess.run(
        [torchrun, "--master-port", str(_free_port()), "--nproc-per-node", "2", "-m", "gpucoll",
         "bench", "all_reduce", "--backend", "cpu", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1",
         "--json", "-"],
        env=_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    start = done.stdout.index("{")  # torchrun's own lines go to stderr; the JSON is rank 0's
    report = json.loads(done.stdout[start:])
    assert (report["nranks"], report["backend"]) == (2, "cpu")
    rows = report["rows"]
    assert [row["size"] for row in rows] == [1024], rows
    assert all(row[mode]["wrong"] == 0 for row in rows for mode in ("out", "in"))


@pytest.mark.parametrize("backend", ["cpu", "mpi"])
def test_init_under_real_mpirun(backend: str):
    """Open MPI's variables are detected; the CPU backend meets at MASTER_PORT, the MPI
    backend through MPI itself."""
    command, reason = mpirun_command(2)
    if command is None:
        pytest.skip(reason)
    done = subprocess.run([*command, sys.executable, SCRIPT, backend], capture_output=True,
                          text=True, timeout=150, stdin=subprocess.DEVNULL,
                          env=mpirun_env({**_env(), "MASTER_PORT": str(_free_port())}))
    assert done.returncode == 0, done.stderr[-3000:]
    results = _results(done.stdout)
    assert [(r["rank"], r["size"], r["local_rank"], r["source"], r["backend"])
            for r in results] == [(0, 2, 0, "openmpi", backend), (1, 2, 1, "openmpi", backend)]
    assert all(r["values"] == [3.0] * 4 for r in results)


def test_mpi_backend_timeout_holds_on_a_stuck_peer():
    command, reason = mpirun_command(2)
    if command is None:
        pytest.skip(reason)
    script = str(ROOT / "tests" / "scripts" / "mpi_stuck_peer.py")
    done = subprocess.run([*command, sys.executable, script, "4"], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, env=mpirun_env(_env()))
    line = next((l for l in done.stdout.splitlines() if "TIMEOUT" in l), done.stdout + done.stderr)
    assert line.startswith("TIMEOUT after "), line
    assert "all_reduce #1 did not complete within 4 s" in line, line
    assert float(line.split()[2]) < 15, line  # the 4 s limit held (rank 1 sleeps 20 s)


def test_mpi_blocking_mode_ends_the_job_at_the_timeout_on_a_stuck_peer():
    """GPUCOLL_MPI_BLOCKING=1: rank 0 blocks inside MPI's Allreduce; its watchdog names the
    call on stderr and exits with status 124 at the 4 s timeout, and mpirun ends the job
    (rank 1 would sleep 20 s)."""
    command, reason = mpirun_command(2)
    if command is None:
        pytest.skip(reason)
    from gpucoll.backends.mpi_blocking import EXIT_STATUS

    script = str(ROOT / "tests" / "scripts" / "mpi_stuck_peer.py")
    done = subprocess.run([*command, sys.executable, script, "4"], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=mpirun_env(_env({"GPUCOLL_MPI_BLOCKING": "1"})))
    assert done.returncode != 0 and "TIMEOUT" not in done.stdout, done.stdout + done.stderr
    assert ("gpucoll: CommTimeoutError: rank 0: all_reduce #1 did not complete within 4 s"
            in done.stderr), done.stderr
    assert f"exits with status {EXIT_STATUS}" in done.stderr, done.stderr
    # the job ended before rank 1 woke up (its sleep begins after init, so this holds however
    # long the ranks took to start)
    assert "AWAKE" not in done.stdout, done.stdout


def test_bench_on_the_mpi_backend_under_mpirun():
    command, reason = mpirun_command(2)
    if command is None:
        pytest.skip(reason)
    done = subprocess.run([*command, sys.executable, "-m", "gpucoll", "bench", "all_reduce",
                           "--backend", "mpi", "-b", "8", "-e", "1K", "-f", "128", "-n", "2",
                           "-w", "1", "--json", "-"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=mpirun_env(_env()))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert (report["nranks"], report["backend"]) == (2, "mpi")
    assert [row["size"] for row in report["rows"]] == [8, 1024]
    assert all(row[mode]["wrong"] == 0 for row in report["rows"] for mode in ("out", "in"))
