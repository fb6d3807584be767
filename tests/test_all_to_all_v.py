"""Uneven all-to-all (``all_to_all_v``) of the CPU backend against NumPy, in real processes.

World sizes 1 to 4; count matrices all zero, uniform, random with zeros, and one large block;
trailing shapes (), (3,) and (2, 3); several dtype families; the input left as it was; and every
bad input, which raises before anything is sent (or, for ranks that disagree on dtype or
trailing shape, on every rank alike) and leaves the communicator usable. CuPy arrays (staged
through the host) when a GPU is there.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import gpucoll
from mp_harness import RankPool, error_text, rank_pools, run_ranks
from reference import make_input

pytestmark = pytest.mark.timeout(180)

TRAILING = [(), (3,), (2, 3), (4,)]
DTYPES = ["float32", "int64", "bool", "complex128", "uint8", "float16"]


def count_matrix(pattern, n, seed):
    """``matrix[s, d]``: rows rank s sends to rank d (the same on every rank, from the seed)."""
    if pattern == "zeros":
        return np.zeros((n, n), np.int64)
    if pattern == "uniform":
        return np.full((n, n), 3, np.int64)
    if pattern == "one_large":
        matrix = np.ones((n, n), np.int64)
        matrix[n - 1, 0] = 30_000
        return matrix
    if pattern == "large":  # MiBs: the exact single-copy exchange where the backend has one
        return np.random.default_rng(seed).integers(0, 40_000, (n, n))
    return np.random.default_rng(seed).integers(0, 5, (n, n)) * \
        np.random.default_rng(seed + 1).integers(0, 2, (n, n))  # random, many zeros


def cases():
    index = 0
    for pattern in ("zeros", "uniform", "random", "one_large", "large"):
        for trailing in TRAILING:
            if pattern in ("one_large", "large") and trailing != ((4,) if pattern == "large" else ()):
                continue
            yield f"{pattern}/{trailing}/{DTYPES[index % len(DTYPES)]}", pattern, trailing, \
                DTYPES[index % len(DTYPES)]
            index += 1


def rows_of(rank, matrix, trailing, dtype, seed):
    return make_input(seed, rank, (int(matrix[rank].sum()),) + trailing, dtype)


def expected(rank, matrix, trailing, dtype, seed):
    """What ``rank`` receives: from each sender s, the block of s's rows addressed to it."""
    parts = []
    for sender in range(len(matrix)):
        rows = rows_of(sender, matrix, trailing, dtype, seed)
        start = int(matrix[sender, :rank].sum())
        parts.append(rows[start:start + int(matrix[sender, rank])])
    return np.concatenate(parts), [int(c) for c in matrix[:, rank]]


pool = rank_pools([1, 2, 3, 4], ids=lambda n: f"world{n}", shared=True)


def rank_exchanges(comm, all_cases):
    exact = []  # the results of the backend's exact exchange (None: too small, padded instead)
    original = comm._exact_all_to_all_v
    comm._exact_all_to_all_v = lambda *args: exact.append(original(*args)) or exact[-1]
    out = {}
    try:
        for seed, (case_id, pattern, trailing, dtype) in enumerate(all_cases):
            matrix = count_matrix(pattern, comm.size, seed)
            x = rows_of(comm.rank, matrix, trailing, dtype, seed)
            keep = x.copy()
            del exact[:]
            result, recv = comm.all_to_all_v(x, list(matrix[comm.rank]))
            exchanged = [e is not None for e in exact]
            del exact[:]   # again with the whole count matrix known: nothing exchanged first
            known = comm.all_to_all_v(x, counts=matrix if seed % 2 else matrix.tolist())
            np.testing.assert_array_equal(x, keep)  # the input is never touched
            out[case_id] = [(result, recv, exchanged), known + ([e is not None for e in exact],)]
    finally:
        del comm._exact_all_to_all_v
    shared = comm._shared is not None and comm._shared.single_copy and comm._all_shared
    return out, shared


def test_all_to_all_v_matches_numpy(pool):
    all_cases = list(cases())
    results = pool.run(rank_exchanges, all_cases)
    for rank, (got, single_copy) in enumerate(results):
        for seed, (case_id, pattern, trailing, dtype) in enumerate(all_cases):
            matrix = count_matrix(pattern, pool.world_size, seed)
            want, want_counts = expected(rank, matrix, trailing, dtype, seed)
            for how, (result, recv, exact) in zip(("exchanged", "known"), got[case_id]):
                # asked only when every rank can (shared memory with single-copy reads) and
                # there are rows; it runs (not None) only for the large exchanges
                asked = single_copy and pattern != "zeros"
                assert exact == ([pattern == "large"] if asked else []), (case_id, how)
                assert recv == want_counts and all(type(c) is int for c in recv), (case_id, how)
                assert result.dtype == want.dtype and result.shape == want.shape, (case_id, how)
                np.testing.assert_array_equal(result, want, err_msg=f"rank {rank} {case_id} {how}")


def rank_large_all_to_all(comm, count):
    x = make_input(77, comm.rank, (comm.size, count), "float32")
    return comm.all_to_all(x), comm._all_shared and comm._shared.single_copy


def test_large_all_to_all_reads_straight_from_the_peers(pool):
    """From 1 MiB per rank, shared memory reads each block from its sender's array."""
    n, count = pool.world_size, 300_000  # 1.2 MB per block
    for rank, (result, single_copy) in enumerate(pool.run(rank_large_all_to_all, count)):
        assert bool(single_copy) == (n > 1)  # so the single-copy path ran wherever there are peers
        want = np.stack([make_input(77, s, (n, count), "float32")[rank] for s in range(n)])
        np.testing.assert_array_equal(result, want)


def rank_bad_exchanges(comm):
    n, r = comm.size, comm.rank
    x = np.ones((2 * n, 3), np.float32)
    negative = [2] * n
    negative[(r + 1) % n] = -1
    local = [
        error_text(lambda: comm.all_to_all_v(np.array(1.0), [0] * n)),
        error_text(lambda: comm.all_to_all_v(x, [2] * (n + 1))),
        error_text(lambda: comm.all_to_all_v(x, negative)),
        error_text(lambda: comm.all_to_all_v(x, [3] * n)),
        error_text(lambda: comm.all_to_all_v(x, [2.0] * n)),
        error_text(lambda: comm.all_to_all_v(x, [True] * n)),
        error_text(lambda: comm.all_to_all_v(x, 2)),
        error_text(lambda: comm.all_to_all_v(np.array([["a"]] * n), [1] * n)),
        # the whole count matrix given instead
        error_text(lambda: comm.all_to_all_v(x)),
        error_text(lambda: comm.all_to_all_v(x, counts=[[2] * n] * (n + 1))),
        error_text(lambda: comm.all_to_all_v(x, counts=[[2] * n] * (n - 1) + [[2] * (n + 1)])),
        error_text(lambda: comm.all_to_all_v(x, counts=np.full((n, n), 2.0))),
        error_text(lambda: comm.all_to_all_v(x, counts=np.full((n, n), 3))),
        error_text(lambda: comm.all_to_all_v(x, [1] * n, counts=np.full((n, n), 2))),
        error_text(lambda: comm.all_to_all_v(x, counts=5)),
    ]
    # ranks that disagree: every rank raises the same error, nothing is left on the wire
    dtype_error = error_text(lambda: comm.all_to_all_v(np.zeros(n, np.float64 if r else np.float32),
                                                   [1] * n))
    shape_error = error_text(lambda: comm.all_to_all_v(np.zeros((n, 2 + (r == n - 1) * (n > 1))),
                                                   [1] * n))
    after = comm.all_to_all_v(np.arange(n, dtype=np.int16) + 10 * r, [1] * n)
    return local, dtype_error, shape_error, after


def test_all_to_all_v_usage_errors(pool):
    n = pool.world_size
    for rank, (local, dtype_error, shape_error, after) in enumerate(pool.run(rank_bad_exchanges)):
        assert local[0] == ("ValueError: all_to_all_v: x must have at least one dimension (rows "
                            "are counted along the first axis), got a 0-d array")
        assert local[1] == (f"ValueError: all_to_all_v: send_counts has {n + 1} entries, "
                            f"expected one per rank ({n}): {[2] * (n + 1)}")
        assert local[2] == f"ValueError: all_to_all_v: send_counts[{(rank + 1) % n}]=-1 is negative"
        assert local[3] == (f"ValueError: all_to_all_v: send_counts sum to {3 * n} but x has "
                            f"{2 * n} rows (x.shape[0])")
        assert local[4] == "TypeError: all_to_all_v: send_counts[0] must be an int, got 2.0"
        assert local[5] == "TypeError: all_to_all_v: send_counts[0] must be an int, got True"
        assert local[6] == (f"TypeError: all_to_all_v: send_counts must be a sequence of {n} "
                            f"ints, got int")
        assert local[7].startswith("TypeError: dtype str32 is not supported"), local[7]
        assert local[8] == ("TypeError: all_to_all_v: give send_counts (or counts, the whole "
                            "count matrix)")
        assert local[9] == (f"ValueError: all_to_all_v: counts has {n + 1} rows, expected one "
                            f"per rank ({n})")
        assert local[10] == (f"ValueError: all_to_all_v: counts[{n - 1}] has {n + 1} entries, "
                             f"expected one per rank ({n}): {[2] * (n + 1)}")
        assert local[11].startswith("TypeError: all_to_all_v: counts[0][0] must be an int, got "
                                    "np.float64(2.0)"), local[11]
        assert local[12] == (f"ValueError: all_to_all_v: counts[{rank}] sums to {3 * n} but x "
                             f"has {2 * n} rows (x.shape[0])")
        assert local[13] == (f"ValueError: all_to_all_v: send_counts {[1] * n} is not "
                             f"counts[{rank}] {[2] * n}")
        assert local[14] == (f"TypeError: all_to_all_v: counts must be a {n} x {n} matrix of "
                             f"ints, got int")
        if n > 1:
            assert dtype_error.startswith("ValueError: all_to_all_v: ranks disagree on dtype or "
                                          "trailing shape (rank 0: float32 (n,); rank 1: float64")
            assert shape_error.startswith("ValueError: all_to_all_v: ranks disagree") and \
                f"rank {n - 1}: float64 (n, 3)" in shape_error, shape_error
        else:
            assert dtype_error == shape_error == "no error"
        result, recv = after
        assert recv == [1] * n
        np.testing.assert_array_equal(result, np.array([rank + 10 * s for s in range(n)], np.int16))


def rank_disagreeing_matrices(comm, how):
    n, r = comm.size, comm.rank
    matrix = np.full((n, n), 2 if r else 1)  # each rank's own row is right; the rest differ
    if how == "paths":  # the same matrix, but one rank cannot take the exact exchange
        matrix = np.full((n, n), 40_000)
        if r == 1:
            comm._exact_all_to_all_v_ready = lambda x: False
    x = np.ones((int(matrix[r].sum()), 4), np.float32)
    start = time.monotonic()
    try:
        comm.all_to_all_v(x, counts=matrix)
        return "no error", None
    except gpucoll.GpucollError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    finally:
        comm.abort()


@pytest.mark.parametrize("how", ["matrices", "paths"])
def test_ranks_that_disagree_on_known_counts_fail_at_once(how):
    """Ranks passing different matrices, or taking different paths with the same one
    (shared memory's exact exchange on one rank, padding on another), fail on every rank
    with a named mismatch or a peer's error, well before the timeout; never a hang."""
    results = run_ranks(rank_disagreeing_matrices, 2, how, timeout=60,
                        env={"GPUCOLL_TIMEOUT": "20"})
    names = [message.split(":")[0] for message, _ in results]
    assert "CollectiveMismatchError" in names, results
    assert set(names) <= {"CollectiveMismatchError", "PeerError", "CommAbortedError"}, results
    assert all(elapsed < 20 for _, elapsed in results), results


def rank_checked_matrices(comm):
    r = comm.rank
    theirs = [[1, 2], [3, 0]]           # what rank 1 really sends: its own row
    mine = [[1, 2], [0, 3]] if r == 0 else theirs   # rank 0 is wrong about rank 1's row
    x = np.arange(3, dtype=np.float32) + 10 * r
    error = error_text(lambda: comm.all_to_all_v(x, counts=mine))
    return error, comm.all_to_all_v(x, counts=theirs)   # still usable


def test_debug_mode_names_ranks_given_different_matrices():
    """With GPUCOLL_DEBUG=1 the matrices are compared first: a ValueError on every rank (even
    where the totals agree and the exchange itself could not tell), and nothing is lost."""
    results = run_ranks(rank_checked_matrices, 2, timeout=60, env={"GPUCOLL_DEBUG": "1"})
    rows = [np.arange(3, dtype=np.float32) + 10 * s for s in range(2)]
    wanted = [(np.concatenate([rows[0][:1], rows[1]]), [1, 3]), (rows[0][1:], [2, 0])]
    for (error, (result, recv)), (want, want_counts) in zip(results, wanted):
        assert error == ("ValueError: all_to_all_v: ranks passed different count matrices (the "
                         "same within each of the groups [[0], [1]])")
        assert recv == want_counts
        np.testing.assert_array_equal(result, want)


def rank_cupy_exchange(comm):
    import cupy

    n, r = comm.size, comm.rank
    matrix = count_matrix("random", n, 5) + 1
    x = cupy.asarray(rows_of(r, matrix, (3,), "float32", 5))
    result, recv = comm.all_to_all_v(x, list(matrix[r]))
    return type(result).__module__.split(".")[0], cupy.asnumpy(result), recv


@pytest.mark.gpu
def test_all_to_all_v_on_cupy_arrays_through_the_cpu_backend():
    ranks = RankPool(2)
    try:
        results = ranks.run(rank_cupy_exchange)
    finally:
        ranks.close()
    matrix = count_matrix("random", 2, 5) + 1
    for rank, (module, result, recv) in enumerate(results):
        want, want_counts = expected(rank, matrix, (3,), "float32", 5)
        assert module == "cupy" and recv == want_counts
        np.testing.assert_array_equal(result, want)
