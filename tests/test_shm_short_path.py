"""The shared-memory short path: blocking all_reduce, broadcast, all_gather and reduce_scatter
of small NumPy arrays skip the general machinery. Same results as NumPy, same errors as the
general path, and it is really taken (or not) where it should be."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mp_harness import run_ranks
from gpucoll.perf.reference import as_dtype
from reference import assert_equal_result, make_input, op_valid, reduce_reference

pytestmark = pytest.mark.timeout(120)
SHM = {"GPUCOLL_TRANSPORT": "shm"}
# one element, odd counts, and both sides of the 64 KiB short-path limit (in float32 items)
COUNTS = [0, 1, 7, 16384 // 3, 16384 + 5]
CASES = [("float32", "sum"), ("float64", "avg"), ("int64", "max"), ("int32", "prod"),
         ("bool", "bor"), ("uint8", "bxor"), ("bfloat16", "sum"), ("complex64", "sum")]


def _count_general_calls(comm):
    """Wrap the general path so the rank can tell how often it ran."""
    calls = []
    general = comm._collective

    def counted(name, *args, **kwargs):
        calls.append(name)
        return general(name, *args, **kwargs)

    comm._collective = counted
    return calls


def rank_every_collective(comm, counts, cases):
    calls = _count_general_calls(comm)
    size, rank, got = comm.size, comm.rank, {}
    for count in counts:
        for dtype_name, op in cases:
            dtype = as_dtype(dtype_name)
            key = (count, dtype_name, op)
            mark = len(calls)
            x = make_input(3, rank, (count,), dtype, op)
            got[key + ("all_reduce",)] = comm.all_reduce(x.copy(), op=op)
            out = np.empty_like(x)
            comm.all_reduce(x, op=op, out=out)
            got[key + ("all_reduce out",)] = out
            b = x.copy() if rank == size - 1 else np.zeros_like(x)
            got[key + ("broadcast",)] = comm.broadcast(b, root=size - 1)
            got[key + ("all_gather",)] = comm.all_gather(x)
            gathered = np.empty((size, count), dtype)
            comm.all_gather(x, out=gathered)
            got[key + ("all_gather out",)] = gathered
            pieces = make_input(5, rank, (size, count), dtype, op)
            got[key + ("reduce_scatter",)] = comm.reduce_scatter(pieces, op=op)
            mine = np.empty(count, dtype)
            comm.reduce_scatter(pieces, op=op, out=mine)
            got[key + ("reduce_scatter out",)] = mine
            got[key + ("general",)] = calls[mark:]
    return got


def _check(results, counts, cases, size):
    for count in counts:
        for dtype_name, op in cases:
            dtype, key = as_dtype(dtype_name), (count, dtype_name, op)
            inputs = np.stack([make_input(3, r, (count,), dtype, op) for r in range(size)])
            pieces = np.stack([make_input(5, r, (size, count), dtype, op) for r in range(size)])
            reduced = reduce_reference(inputs, op)
            scattered = reduce_reference(pieces, op)
            for rank, got in enumerate(results):
                what = f"rank {rank}, {count} x {dtype_name}, {op}"
                for name in ("all_reduce", "all_reduce out"):
                    assert_equal_result(got[key + (name,)], reduced, f"{name} {what}", op)
                assert_equal_result(got[key + ("broadcast",)], inputs[size - 1], f"bcast {what}")
                for name in ("all_gather", "all_gather out"):
                    assert_equal_result(got[key + (name,)], inputs, f"{name} {what}")
                for name in ("reduce_scatter", "reduce_scatter out"):
                    assert_equal_result(got[key + (name,)], scattered[rank], f"{name} {what}", op)
                general = got[key + ("general",)]
                itemsize = dtype.itemsize
                short = {"all_reduce": count * itemsize, "broadcast": count * itemsize,
                         "all_gather": count * itemsize * size,
                         "reduce_scatter": count * itemsize * size}
                for name, nbytes in short.items():
                    expected = 0 if nbytes <= 64 << 10 else 2 - (name == "broadcast")
                    assert general.count(name) == expected, (what, name, general)


@pytest.mark.parametrize("size", [2, 3])
def test_short_path_matches_numpy_and_is_taken_only_for_small_messages(size):
    cases = [case for case in CASES if op_valid(case[1], as_dtype(case[0]))]
    results = run_ranks(rank_every_collective, size, COUNTS, cases, env=SHM, timeout=100)
    _check(results, COUNTS, cases, size)


def test_slots_smaller_than_the_short_path_limit_are_raised_to_it():
    """GPUCOLL_SHM_BYTES below 64 KiB used to break one-step messages above the slot."""
    counts, cases = [4096, 16384 - 1, 40000], [("float32", "sum"), ("int64", "max")]
    results = run_ranks(rank_every_collective, 2, counts, cases, timeout=100,
                        env=dict(SHM, GPUCOLL_SHM_BYTES="4096"))
    _check_values_only(results, counts, cases, 2)


def _check_values_only(results, counts, cases, size):
    for count in counts:
        for dtype_name, op in cases:
            dtype, key = as_dtype(dtype_name), (count, dtype_name, op)
            inputs = np.stack([make_input(3, r, (count,), dtype, op) for r in range(size)])
            for rank, got in enumerate(results):
                assert_equal_result(got[key + ("all_reduce",)], reduce_reference(inputs, op),
                                    f"rank {rank} {key}", op)
                assert_equal_result(got[key + ("all_gather",)], inputs, f"rank {rank} {key}")


def rank_mismatch(comm, kind):
    from gpucoll import CollectiveMismatchError, CommAbortedError

    x = np.arange(4, dtype=np.float32)
    try:
        if kind == "collective":
            if comm.rank == 0:
                comm.all_gather(x)
            else:
                comm.reduce_scatter(np.ones((comm.size, 2), np.float32))
        elif kind == "dtype":
            comm.broadcast(x if comm.rank == 0 else x.astype(np.float64), root=0)
        else:  # root
            comm.broadcast(x, root=comm.rank)
    except CollectiveMismatchError as exc:
        message = str(exc)
    else:
        return None
    try:
        comm.all_reduce(x)
    except CommAbortedError:
        return message, "aborted"
    return message, "still usable"


@pytest.mark.parametrize("kind", ["collective", "dtype", "root"])
def test_mismatch_on_the_short_path_is_named_on_every_rank(kind):
    results = run_ranks(rank_mismatch, 2, kind, env=SHM, timeout=60)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} saw no mismatch ({kind})"
        message, after = result
        assert "mismatch" in message and after == "aborted", (rank, message, after)
        if kind == "collective":
            assert "all_gather" in message and "reduce_scatter" in message, message
        if kind == "dtype":
            assert "float32" in message and "float64" in message, message
        if kind == "root":
            assert "root 0" in message and "root 1" in message, message


def rank_late_peer(comm, collective):
    from gpucoll import CommTimeoutError

    x = np.ones(8, np.float32)
    calls = {"broadcast": lambda: comm.broadcast(x, root=0),
             "all_gather": lambda: comm.all_gather(x),
             "reduce_scatter": lambda: comm.reduce_scatter(np.ones((comm.size, 8), np.float32)),
             "all_reduce": lambda: comm.all_reduce(x)}
    if comm.rank == 2:
        time.sleep(4.0)  # late: the others time out first
        return None
    start = time.monotonic()
    try:
        calls[collective]()
    except CommTimeoutError as exc:
        return str(exc), exc.peer, time.monotonic() - start
    return None


@pytest.mark.parametrize("collective", ["broadcast", "all_gather", "reduce_scatter"])
def test_late_peer_times_out_on_the_short_path_and_is_named(collective):
    env = dict(SHM, GPUCOLL_TIMEOUT="1")
    results = run_ranks(rank_late_peer, 3, collective, env=env, timeout=60, ranks=[0, 1])
    for rank, result in enumerate(results[:2]):
        assert result is not None, f"rank {rank}: no timeout"
        message, peer, waited = result
        assert peer == 2 and "[2]" in message and collective in message, message
        assert 0.9 < waited < 3.5, waited


def rank_async_then_small(comm):
    big = np.full(1 << 18, comm.rank + 1.0, np.float32)
    work = comm.all_reduce(big, async_op=True)
    small = np.full(3, comm.rank, np.int64)
    comm.broadcast(small, root=1)  # issued after the async op: must wait for it, not jump it
    work.wait()
    gathered = comm.all_gather(np.array([comm.rank], np.int32))
    return float(big[0]), float(big[-1]), small.tolist(), gathered.ravel().tolist()


def test_blocking_small_call_after_async_work_keeps_issue_order():
    results = run_ranks(rank_async_then_small, 2, env=SHM, timeout=60)
    for first, last, small, gathered in results:
        assert (first, last) == (3.0, 3.0) and small == [1, 1, 1] and gathered == [0, 1]
