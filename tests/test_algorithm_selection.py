"""The algorithm registry, size-based selection, overrides, segment bounds and module sizes."""

from __future__ import annotations

import pytest

from gpucoll import algorithms
from gpucoll.algorithms import ALGORITHMS, get, parse_override, select
from gpucoll.algorithms.direct import segment_bounds

from algorithm_harness import SIZES


# -- registry, selection, overrides -------------------------------------------------------------


def test_registry_names_and_docstrings() -> None:
    assert set(ALGORITHMS) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                               "reduce", "gather", "scatter", "all_to_all", "barrier"}
    for collective, table in ALGORITHMS.items():
        for name, fn in table.items():
            assert fn.__name__ == f"{name}_{collective}"
            assert get(collective, name) is fn
            assert "Steps" in fn.__doc__ and "Bytes" in fn.__doc__, fn.__name__


def test_get_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="all_reduce.*barrier"):
        get("allreduce", "ring")
    with pytest.raises(ValueError, match="ring, recursive_doubling, tree"):
        get("all_reduce", "bogus")


def test_select_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    threshold = 64 << 10  # per-rank share
    kw = dict(ring_threshold=threshold)
    assert select("all_reduce", 4 * threshold, 4, itemsize=4, **kw) == "ring"
    assert select("all_reduce", 4 * threshold - 1, 4, itemsize=4, **kw) == "recursive_doubling"
    assert select("all_reduce", 9 * 7, 9, itemsize=8, ring_threshold=7) == "recursive_doubling"
    assert select("all_reduce", 9 * 8, 9, itemsize=8, ring_threshold=8) == "ring"
    assert select("broadcast", 8 * 16 * threshold, 8, **kw) == "scatter_allgather"
    assert select("broadcast", 8 * 16 * threshold - 8, 8, **kw) == "binomial"
    assert select("broadcast", 1 << 30, 2, **kw) == "binomial"
    assert select("reduce", 8 * 64 * threshold, 8, **kw) == "ring"
    assert select("reduce", 8 * 64 * threshold - 8, 8, **kw) == "binomial"
    assert select("reduce", 1 << 30, 2, **kw) == "binomial"
    for collective in ("reduce_scatter", "all_gather"):
        assert select(collective, 1 << 30, 8, **kw) == "direct"
        assert select(collective, 9 * threshold, 9, **kw) == "ring"
        assert select(collective, 9 * threshold - 9, 9, **kw) == "direct"
    for collective in ("gather", "scatter", "all_to_all"):
        assert select(collective, 1 << 30, 8, **kw) == "direct"
    assert select("barrier", 0, 8, **kw) == "dissemination"
    # The default threshold comes from the configuration.
    monkeypatch.setenv("GPUCOLL_RING_THRESHOLD", "1KiB")
    assert select("all_reduce", 4096, 4) == "ring"
    assert select("all_reduce", 4095, 4) == "recursive_doubling"
    with pytest.raises(ValueError, match="unknown collective"):
        select("allgather", 10, 2)


def test_select_always_names_a_registered_algorithm() -> None:
    for collective, table in ALGORITHMS.items():
        for world_size in SIZES:
            for nbytes in (0, 1, 1000, 1 << 16, 1 << 24):
                assert select(collective, nbytes, world_size) in table


def test_select_override() -> None:
    override = parse_override("all_reduce=tree")
    assert select("all_reduce", 1 << 30, 8, override, itemsize=4) == "tree"
    assert select("broadcast", 1 << 30, 8, override, ring_threshold=1) == "scatter_allgather"
    with pytest.raises(ValueError, match="ring, recursive_doubling, tree"):
        select("all_reduce", 10, 2, {"all_reduce": "butterfly"})


def test_parse_override() -> None:
    assert parse_override("all_reduce=ring,broadcast=binomial") == {
        "all_reduce": "ring", "broadcast": "binomial"}
    assert parse_override(" ALL_REDUCE = Recursive_Doubling , ") == {
        "all_reduce": "recursive_doubling"}
    for nothing in ("", "auto", "  AUTO ", None):
        assert parse_override(nothing) == {}
    with pytest.raises(ValueError, match="unknown collective 'allreduce'.*all_reduce"):
        parse_override("allreduce=ring")
    with pytest.raises(ValueError, match="unknown broadcast algorithm 'ring'.*binomial, "
                                         "scatter_allgather"):
        parse_override("all_reduce=ring,broadcast=ring")
    with pytest.raises(ValueError, match="collective=algorithm"):
        parse_override("all_reduce")
    with pytest.raises(ValueError, match="twice"):
        parse_override("all_reduce=ring,all_reduce=tree")


def test_segment_bounds_cover_the_buffer() -> None:
    for count in (0, 1, 13, 10007):
        for parts in SIZES:
            bounds = segment_bounds(count, parts)
            assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == count
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1))


def test_algorithm_modules_are_small() -> None:
    import inspect

    from gpucoll.algorithms import direct, recursive_doubling, ring, tree
    from gpucoll.transports import inproc
    for module in (algorithms, direct, recursive_doubling, ring, tree, inproc):
        assert len(inspect.getsource(module).splitlines()) < 600, module.__name__
