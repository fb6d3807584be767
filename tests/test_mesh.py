"""``gpucoll.Mesh``: ranks on named axes, a group per axis, checked in real processes.

The expected layout comes from NumPy alone (``np.arange(size).reshape(shape)``, the last axis
fastest); every group's membership and order is compared with it, and each group's all_reduce
of the world ranks with the sum over its members. Bad axes raise on every rank before any
split.
"""

from __future__ import annotations

import itertools
from typing import Dict

import numpy as np
import pytest

import gpucoll
from mp_harness import RankPool

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pools():
    """``pools(size)``: a :class:`RankPool` of ``size`` ranks, started on first use and shared
    by the module's tests (the meshes close every group they make)."""
    started: Dict[int, RankPool] = {}

    def pool_of(size: int) -> RankPool:
        if size not in started:
            started[size] = RankPool(size, timeout=90)
        return started[size]

    yield pool_of
    for pool in started.values():
        pool.close()


class NoSplitComm:
    """Rank and size only; any collective fails the test (errors must come before them)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def split(self, *args):
        raise AssertionError("split called before the arguments were checked")


def expected_members(shape, names, rank):
    """World ranks of ``rank``'s group along ``names`` (row-major over ``names`` as given)."""
    axes = list(shape)
    grid = np.arange(int(np.prod(list(shape.values())))).reshape(tuple(shape.values()))
    where = dict(zip(axes, np.argwhere(grid == rank)[0]))
    members = []
    for combo in itertools.product(*[range(shape[n]) for n in names]):
        coords = dict(where, **dict(zip(names, combo)))
        members.append(int(grid[tuple(coords[a] for a in axes)]))
    return members


def rank_mesh(comm, shape, extra):
    mesh = gpucoll.Mesh(comm, **shape)
    out = {"coords": mesh.coords, "shape": mesh.shape, "groups": {}}
    for names in [(name,) for name in mesh.names] + extra:
        group = mesh.group(*names)
        total = group.all_reduce(np.array([float(comm.rank)]))
        out["groups"][names] = (group.rank, group.size, list(group.ranks), mesh.ranks(*names),
                                float(total[0]))
    out["same"] = all(mesh[n] is mesh.group(n) for n in mesh.names)  # made once, then cached
    mesh.close()
    return out


@pytest.mark.parametrize("size,shape,extra", [
    (8, {"dp": 2, "pp": 2, "tp": 2}, [("dp", "tp"), ("tp", "dp"), ("pp", "dp", "tp")]),
    (6, {"dp": -1, "tp": 3}, [("tp", "dp")]),
    (4, {"pp": 1, "dp": 4, "tp": 1}, [("pp", "tp")]),
], ids=["2x2x2", "inferred-2x3", "1x4x1"])
def test_groups_match_the_row_major_layout(pools, size, shape, extra):
    results = pools(size).run(rank_mesh, shape, extra, timeout=90)
    final = dict(shape)
    if -1 in final.values():
        inferred = [n for n, e in final.items() if e == -1][0]
        final[inferred] = size // int(np.prod([e for e in final.values() if e != -1]))
    grid = np.arange(size).reshape(tuple(final.values()))
    for rank, out in enumerate(results):
        assert out["shape"] == final and out["same"]
        where = np.argwhere(grid == rank)[0]
        assert out["coords"] == {n: int(c) for n, c in zip(final, where)}
        for names in [(name,) for name in final] + extra:
            members = expected_members(final, names, rank)
            group_rank, group_size, world_ranks, local_ranks, total = out["groups"][names]
            assert world_ranks == local_ranks == members, (rank, names)
            assert (group_rank, group_size) == (members.index(rank), len(members))
            assert total == float(sum(members))


def rank_nested(comm):
    """A mesh over a group: the ranks it reports are the group's, its groups' the world's."""
    odd = comm.new_group([1, 3, 5, 7])
    evens = comm.new_group([0, 2, 4, 6])
    mine = odd if odd is not None else evens
    mesh = gpucoll.Mesh(mine, a=2, b=2)
    result = (mesh.ranks("a"), list(mesh["a"].ranks))
    mesh.close()
    mine.close()
    return result


def test_a_mesh_over_a_group(pools):
    results = pools(8).run(rank_nested, timeout=90)
    for rank, (local, world) in enumerate(results):
        members = [1, 3, 5, 7] if rank % 2 else [0, 2, 4, 6]
        me = members.index(rank)
        assert local == [me % 2, me % 2 + 2]                      # ranks of the group
        assert world == [members[i] for i in local]               # as world ranks


@pytest.mark.parametrize("axes,error,match", [
    ({}, ValueError, r"give at least one axis"),
    ({"dp": 3, "tp": 2}, ValueError, r"axes dp=3 x tp=2 hold 6 ranks, the communicator has 4"),
    ({"dp": -1, "tp": 3}, ValueError, r"4 ranks do not divide into axes dp=-1 x tp=3"),
    ({"dp": -1, "tp": -1}, ValueError, r"only one axis may be -1, got \['dp', 'tp'\]"),
    ({"dp": 0, "tp": 4}, ValueError, r"axis dp has size 0"),
    ({"dp": 2.0, "tp": 2}, TypeError, r"axis dp must have an int size, got 2.0"),
    ({"dp": True, "tp": 4}, TypeError, r"axis dp must have an int size, got True"),
])
def test_bad_axes_raise_before_any_split(axes, error, match):
    with pytest.raises(error, match=match):
        gpucoll.Mesh(NoSplitComm(0, 4), **axes)


def test_bad_names_raise_before_any_split():
    with pytest.raises(ValueError, match="axis name 'class' is not an identifier"):
        gpucoll.Mesh(NoSplitComm(0, 4), **{"class": 4})
    comm = NoSplitComm(0, 1)
    comm.split = lambda color, key: ("group", color, key)   # a one-rank world splits locally
    mesh = gpucoll.Mesh(comm, dp=1, tp=1)
    assert mesh["tp"] == ("group", 0, 0) and mesh.coords == {"dp": 0, "tp": 0}
    with pytest.raises(KeyError, match=r"Mesh has no axis 'pp'; its axes are \['dp', 'tp'\]"):
        mesh["pp"]
    with pytest.raises(ValueError, match=r"Mesh.group: no axis 'pp'"):
        mesh.group("dp", "pp")
    with pytest.raises(ValueError, match=r"Mesh.group: an axis is named twice in \['dp', 'dp'\]"):
        mesh.group("dp", "dp")
    with pytest.raises(ValueError, match=r"Mesh.ranks: name at least one axis"):
        mesh.ranks()
