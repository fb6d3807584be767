"""gc.spawn: ranks started from Python, with an initialised communicator each; a failing rank
stops the others and its traceback comes back in one error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gpucoll as gc
from gpucoll.spawning import SpawnError

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(90)


def _sum_of_ranks(comm, scale):
    x = np.full(3, (comm.rank + 1) * scale)
    comm.all_reduce(x)
    return comm.rank, comm.size, x.tolist(), os.environ["OMP_NUM_THREADS"], os.environ.get("MINE")


def _rank_one_raises(comm):
    if comm.rank == 1:
        raise RuntimeError("boom")
    comm.all_reduce(np.ones(2))


def _rank_two_dies(comm):
    if comm.rank == 2:
        os._exit(7)
    comm.all_reduce(np.ones(2))


def test_results_come_back_in_rank_order():
    results = gc.spawn(_sum_of_ranks, 3, args=(2.0,), backend="cpu", timeout=30,
                       env={"MINE": "x"})
    expected = (np.arange(1, 4) * 2.0).sum(keepdims=True).repeat(3).tolist()
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    assert all(r[2] == pytest.approx(expected) for r in results)
    assert all(r[3] == "1" and r[4] == "x" for r in results)  # thread default, user env


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(SpawnError) as info:
        gc.spawn(_rank_one_raises, 3, backend="cpu", timeout=20)
    error = info.value
    assert error.rank == 1 and error.error_type == "RuntimeError", str(error)
    assert str(error).startswith("rank 1 failed: RuntimeError: boom")
    assert "in _rank_one_raises" in error.traceback_text
    assert error.traceback_text.rstrip().endswith("RuntimeError: boom")


def test_rank_dying_without_a_word_is_named():
    with pytest.raises(SpawnError, match=r"^rank 2 failed: exited with code 7 without a result"):
        gc.spawn(_rank_two_dies, 3, backend="cpu", timeout=20)


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"nprocs must be an int >= 1, got 0"):
        gc.spawn(_sum_of_ranks, 0)
    with pytest.raises(TypeError, match=r"args must be a tuple, got list"):
        gc.spawn(_sum_of_ranks, 2, args=[1.0])
    with pytest.raises(TypeError, match=r"fn cannot be sent to the new processes"):
        gc.spawn(lambda comm: None, 2)
    with pytest.raises(TypeError, match=r"env must map str to str"):
        gc.spawn(_sum_of_ranks, 2, args=(1.0,), env={"A": 1})


def test_from_a_script_and_a_notebook_like_session(tmp_path: Path):
    """A script guarded by ``__main__`` works; a function typed into an interactive session is
    refused with a TypeError that says to put it in a module."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import gpucoll as gc

        def work(comm):
            return float(comm.all_reduce(np.array([comm.rank + 1.0]))[0])

        if __name__ == "__main__":
            print("RESULTS", gc.spawn(work, 2, backend="cpu", timeout=30))
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "RESULTS [3.0, 3.0]" in done.stdout
    interactive = subprocess.run(
        [sys.executable, "-c", "import gpucoll as gc\ndef work(comm): return 1\n"
                               "gc.spawn(work, 2)"],
        capture_output=True, text=True, env=env, timeout=60)
    assert interactive.returncode == 1
    assert "defined in an interactive session or notebook" in interactive.stderr
