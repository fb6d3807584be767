"""init(): launcher detection (torchrun, Slurm, Open MPI, MPICH/PMI), URLs, and end to end
under `gpucoll run`."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from gpucoll import api
from mp_harness import _free_port, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("env,expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"},
     ("torchrun", 3, 8, 1, 2, "10.1.2.3", 29400)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
      "SLURM_NTASKS_PER_NODE": "4(x4)", "SLURM_JOB_NODELIST": "gpu[003-006,010],cpu1",
      "SLURM_JOB_ID": "123456"},
     ("slurm", 5, 16, 1, 4, "gpu003", 29956)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     ("openmpi", 2, 4, 2, 4, "127.0.0.1", 29500)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
      "MASTER_PORT": "31000"},
     ("pmi", 1, 2, 1, 2, "127.0.0.1", 31000)),
    # torchrun wins when a launcher runs inside a Slurm allocation
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "9",
      "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     ("torchrun", 0, 2, None, None, "h", 1)),
    ({}, ("none", None, None, None, None, None, None)),
])
def test_detect_environment(env, expected):
    got = api.detect_environment(env)
    assert (got.source, got.rank, got.world_size, got.local_rank, got.local_size,
            got.master_addr, got.master_port) == expected


def test_init_without_launcher_info_explains():
    with pytest.raises(ValueError, match="rank and world_size are unknown"):
        api.init(backend="cpu", world_size=2, url="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="rank=2 is out of range for world_size=2"):
        api.init(backend="cpu", rank=2, world_size=2, url="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="unknown backend 'gloo'"):
        api.init(backend="gloo", rank=0, world_size=1, url="tcp://127.0.0.1:1")


def test_nccl_backend_unavailable_is_explicit():
    from gpucoll import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="backend='cpu'"):
        api.init(backend="nccl", rank=0, world_size=1, url="tcp://127.0.0.1:1")


def test_unknown_variable_warns(monkeypatch):
    monkeypatch.setenv("GPUCOLL_TIMOUT", "5")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError):
            api.init(backend="cpu", world_size=2)
    assert any("GPUCOLL_TIMOUT" in str(w.message) and "did you mean GPUCOLL_TIMEOUT?"
               in str(w.message) for w in caught)


def _launcher_env(launcher, rank, port):
    """What Open MPI, Slurm or MPICH would set for ``rank`` of 3 ranks on this host."""
    if launcher == "openmpi":
        return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "3",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
                "MASTER_PORT": str(port)}
    if launcher == "slurm":
        return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "3", "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS_PER_NODE": "3", "SLURM_JOB_NODELIST": "localhost",
                "MASTER_PORT": str(port)}
    return {"PMI_RANK": str(rank), "PMI_SIZE": "3", "MPI_LOCALRANKID": str(rank),
            "MPI_LOCALNRANKS": "3", "MASTER_PORT": str(port)}


def _init_from_env(rank, size, url, launcher, port):
    """Set launcher variables as that launcher would, then call init() with no arguments."""
    import gpucoll

    os.environ.update(_launcher_env(launcher, rank, port))
    os.environ.pop("GPUCOLL_LAUNCHER_STORE", None)  # rank 0 serves the store, as under mpiexec
    comm = gpucoll.init()
    x = np.array([comm.rank + 1.0])
    comm.all_reduce(x)
    out = (comm.rank, comm.size, comm.local_rank, comm.local_size, float(x[0]))
    comm.close()
    return out


@pytest.mark.parametrize("launcher", ["openmpi", "slurm", "pmi"])
def test_init_unchanged_under_mpi_and_slurm(launcher):
    results = run_ranks(_init_from_env, 3, launcher, _free_port(), init=False, serve_store=False)
    assert results == [(r, 3, r, 3, 6.0) for r in range(3)]


def _init_file_store(rank, size, url, path):
    import gpucoll

    comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=f"file://{path}", timeout=20)
    x = np.arange(5, dtype=np.int64) * (rank + 1)
    comm.all_reduce(x)
    comm.close()
    return x.tolist()


def test_init_with_file_store(tmp_path):
    results = run_ranks(_init_file_store, 3, str(tmp_path / "store"), init=False)
    assert results == [[0, 6, 12, 18, 24]] * 3


def _gpucoll_run(args, timeout=90):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "gpucoll", "run"] + args, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_launcher_end_to_end(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np, gpucoll\n"
        "comm = gpucoll.init(timeout=20)\n"
        "x = np.full(3, float(comm.rank))\n"
        "comm.all_reduce(x)\n"
        "comm.abort()\n"
        "again = gpucoll.init(timeout=20)  # a new communicator after an abort\n"
        "y = np.full(2, 1.0); again.all_reduce(y)\n"
        "print('result', again.rank, again.local_rank, again.local_size, x.tolist(), y.tolist())\n"
        "again.close()\n")
    proc = _gpucoll_run(["-n", "3", str(script)])
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if "result" in line)
    assert lines == [f"[rank {r}] result {r} {r} 3 [3.0, 3.0, 3.0] [3.0, 3.0]" for r in range(3)]


def test_main_job_example_runs_and_checks():
    proc = _gpucoll_run(["-n", "2", "-m", "gpucoll.examples.allreduce", "--max-bytes", "1MiB"])
    assert proc.returncode == 0, proc.stderr
    assert "# wrong results: 0" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("[rank 0]   ")]
    assert len(rows) >= 6  # 8 B ... 1 MiB
