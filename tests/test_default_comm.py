"""The default communicator, a world of one, and the world ranks of groups.

In this process: ``gc.init()`` with no launcher variables (rank 0 of 1, CPU backend, one line
on stderr unless GPUCOLL_QUIET), every collective at size 1, the default communicator's
lifetime. In real processes: the default communicator of each rank, ``set_default=False``,
``comm.ranks`` / ``to_world`` / ``from_world`` through split and new_group of groups, and
``python script.py`` with no launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import gpucoll as gc
from gpucoll import config, default_comm
from mp_harness import RankPool, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)

LAUNCHER_NAMES = [s.name for s in config.SETTINGS.values() if s.group != "gpucoll"]


@pytest.fixture
def no_launcher(monkeypatch):
    """An environment with no launcher variables; the default communicator reset after."""
    for name in LAUNCHER_NAMES + ["GPUCOLL_INIT_URL", "GPUCOLL_BACKEND", "GPUCOLL_QUIET",
                                  "GPUCOLL_LAUNCHER_STORE"]:
        monkeypatch.delenv(name, raising=False)
    default_comm.set_default(None)
    yield monkeypatch
    default_comm.set_default(None)


def test_no_default_communicator_is_a_clear_error(no_launcher):
    assert gc.is_initialized() is False
    for call in (gc.default, gc.get_rank, gc.get_world_size):
        with pytest.raises(gc.NotInitializedError, match=r"call gpucoll.init\(\) first"):
            call()
    gc.destroy()  # nothing to destroy: no error
    with pytest.raises(TypeError, match="expected a Communicator or None, got int"):
        default_comm.set_default(3)


def test_world_of_one_without_launcher(no_launcher, capfd):
    comm = gc.init(timeout=20)
    captured = capfd.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("gpucoll: no launcher found") and \
        "rank 0 of 1 on the cpu backend" in captured.err
    assert (comm.backend, comm.rank, comm.size, comm.ranks) == ("cpu", 0, 1, [0])
    assert gc.default() is comm and gc.is_initialized()
    assert (gc.get_rank(), gc.get_world_size()) == (0, 1)

    x = np.arange(6.0).reshape(2, 3)
    assert comm.all_reduce(x.copy(), op="avg").tolist() == x.tolist()
    assert comm.broadcast(x.copy()).tolist() == x.tolist()
    assert comm.reduce(x.copy(), op="max").tolist() == x.tolist()
    assert comm.all_gather(x).tolist() == [x.tolist()]
    assert comm.reduce_scatter(x[None].copy()).tolist() == x.tolist()
    assert comm.gather(x).tolist() == [x.tolist()]
    assert comm.scatter(x[None]).tolist() == x.tolist()
    assert comm.all_to_all(x[None]).tolist() == [x.tolist()]
    comm.barrier()
    assert comm.broadcast_object({"a": (1, 2)}) == {"a": (1, 2)}
    assert comm.all_gather_object([1]) == [[1]] and comm.gather_object("g") == ["g"]
    assert comm.scatter_object([None]) is None
    rows, counts = comm.all_gather_v(x)
    assert rows.tolist() == x.tolist() and counts == [2]
    rows, counts = comm.gather_v(x[:0])
    assert rows.shape == (0, 3) and counts == [0]
    sub = comm.split(0)
    assert sub.ranks == [0] and sub.to_world(0) == 0 and gc.default() is comm
    sub.close()
    assert comm.new_group([0]).from_world(0) == 0

    comm.close()
    assert not gc.is_initialized()
    with pytest.raises(gc.NotInitializedError):
        gc.get_rank()
    assert capfd.readouterr().err == ""  # the line is said once, at init


def test_quiet_world_of_one_and_explicit_size_one(no_launcher, capfd):
    no_launcher.setenv("GPUCOLL_QUIET", "1")
    with gc.init(timeout=20) as comm:
        assert comm.size == 1 and gc.default() is comm
    assert not gc.is_initialized()  # the with block closed it
    no_launcher.delenv("GPUCOLL_QUIET")
    with gc.init(backend="cpu", rank=0, world_size=1, timeout=20) as comm:  # no URL needed
        assert comm.size == 1
    with gc.init(world_size=1, timeout=20, set_default=False) as comm:
        assert comm.rank == 0 and not gc.is_initialized()
    assert "no launcher found" not in capfd.readouterr().err  # rank or size was given
    with pytest.raises(ValueError, match="rank and world_size are unknown"):
        gc.init(backend="cpu", world_size=2, url="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"init\(\): rank=1 is out of range for world_size=1"):
        gc.init(backend="cpu", rank=1, world_size=1)


def test_destroy_closes_and_init_replaces(no_launcher):
    no_launcher.setenv("GPUCOLL_QUIET", "1")
    first = gc.init(timeout=20)
    second = gc.init(timeout=20)
    assert gc.default() is second and not first.closed
    gc.destroy()
    assert second.closed and not gc.is_initialized()
    first.close()
    gc.destroy()


def test_world_of_one_with_a_launcher_address_uses_it(no_launcher, tmp_path):
    no_launcher.setenv("GPUCOLL_QUIET", "1")
    path = tmp_path / "store"
    with gc.init(backend="cpu", world_size=1, url=f"file://{path}", timeout=20) as comm:
        assert type(comm._root_store).__name__ == "FileStore"
        assert comm.all_gather_object(1) == [1]


# ---------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def pool4():
    pool = RankPool(4)
    yield pool
    pool.close()


def rank_default(comm):
    return (gc.default() is comm, gc.get_rank(), gc.get_world_size(), gc.is_initialized(),
            comm.ranks)


def test_each_rank_has_its_default(pool4):
    assert pool4.run(rank_default) == [(True, r, 4, True, [0, 1, 2, 3]) for r in range(4)]


def _errors(*calls):
    out = []
    for call in calls:
        try:
            call()
            out.append("no error")
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def rank_world_ranks(comm):
    r = comm.rank
    out = {}
    odd_first = comm.new_group([3, 1])  # on ranks 3 and 1
    if odd_first is not None:
        out["group"] = (odd_first.rank, odd_first.ranks, odd_first.to_world(0),
                        odd_first.from_world(1), odd_first.from_world(3))
        out["group_errors"] = _errors(lambda: odd_first.from_world(0),
                                      lambda: odd_first.to_world(2),
                                      lambda: odd_first.to_world("0"),
                                      lambda: odd_first.from_world(None))
        reversed_group = odd_first.split(0, key=-odd_first.rank)  # a split of a group
        out["reversed"] = (reversed_group.ranks, reversed_group.to_world(reversed_group.rank))
        alone = odd_first.new_group([1])  # group rank 1 is world rank 1
        out["alone"] = None if alone is None else alone.ranks
        # the collectives of a group still work, and agree with the ranks it names
        out["gathered"] = odd_first.all_gather_object(r)
        for c in (reversed_group, alone, odd_first):
            if c is not None:
                c.close()
    parity = comm.split(r % 2, key=-r)
    out["parity"] = (parity.ranks, parity.to_world(parity.rank), parity.from_world(r))
    out["parity_gathered"] = parity.all_gather_object(r)
    parity.close()
    out["world"] = (comm.to_world(r), comm.from_world(r), comm.ranks)
    out["world_errors"] = _errors(lambda: comm.from_world(4), lambda: comm.from_world(True))
    return out


def test_world_ranks_through_split_and_new_group(pool4):
    results = pool4.run(rank_world_ranks)
    for r, got in enumerate(results):
        assert got["world"] == (r, r, [0, 1, 2, 3])
        assert got["world_errors"] == [
            "ValueError: world rank 4 is not in this communicator (its world ranks: [0, 1, 2, 3])",
            "TypeError: world_rank must be an int, got bool"]
        members = [2, 0] if r % 2 == 0 else [3, 1]  # key=-rank: higher world rank first
        assert got["parity"] == (members, r, members.index(r))
        assert got["parity_gathered"] == members
        if r in (1, 3):
            assert got["group"] == ([3, 1].index(r), [3, 1], 3, 1, 0)
            assert got["group_errors"] == [
                "ValueError: world rank 0 is not in this communicator (its world ranks: [3, 1])",
                "ValueError: rank=2 is out of range for a communicator of size 2",
                "TypeError: rank must be an int, got str",
                "TypeError: world_rank must be an int, got NoneType"]
            assert got["reversed"] == ([1, 3], r)
            assert got["alone"] == ([1] if r == 1 else None)
            assert got["gathered"] == [3, 1]
        else:
            assert "group" not in got


def rank_set_default_false(rank, size, url):
    first = gc.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=20,
                    set_default=False)
    before = gc.is_initialized()
    first.close()
    second = gc.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=20)
    during = (gc.default() is second, gc.get_rank(), gc.get_world_size())
    gc.destroy()  # collective: closes it on every rank
    return before, during, second.closed, gc.is_initialized()


def test_set_default_false_and_destroy_across_ranks():
    results = run_ranks(rank_set_default_false, 2, init=False, timeout=60)
    assert results == [(False, (True, r, 2), True, False) for r in range(2)]


def test_python_script_without_launcher_is_a_world_of_one(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(
        "import numpy as np, gpucoll as gc\n"
        "comm = gc.init(timeout=20)\n"
        "x = np.ones(3); comm.all_reduce(x)\n"
        "print('ok', gc.get_rank(), gc.get_world_size(), comm.backend, x.tolist(),\n"
        "      comm.all_gather_object({'r': comm.rank}))\n"
        "gc.destroy()\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_NAMES and
           not k.startswith("GPUCOLL_")}
    env["PYTHONPATH"] = ROOT
    for quiet in ("", "1"):
        run_env = dict(env, GPUCOLL_QUIET=quiet) if quiet else env
        proc = subprocess.run([sys.executable, str(script)], env=run_env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "ok 0 1 cpu [1.0, 1.0, 1.0] [{'r': 0}]\n"
        said = [line for line in proc.stderr.splitlines() if line.startswith("gpucoll:")]
        assert said == ([] if quiet else [
            "gpucoll: no launcher found (no RANK/WORLD_SIZE, Slurm, Open MPI or PMI variables): "
            "running as rank 0 of 1 on the cpu backend (GPUCOLL_QUIET=1 hides this line)"])
