"""Uneven scatters (scatter_v, reduce_scatter_v) of the CPU backend against NumPy, in real
processes.

World sizes 1 to 4; per-rank row counts all zero, some zero, uneven, even and one large (past
the size at which reduce_scatter_v reduces per rank instead of padding); trailing shapes (),
(3,) and (2, 3); several dtypes (bfloat16 too) and ops; counts given and split evenly; every
root (scatter_v on the small cases); both ways of reduce_scatter_v whatever the sizes would choose; inputs never touched.
Bad input raises before anything is sent, on the root of scatter_v on every rank alike, and
the communicator stays usable.
"""

from __future__ import annotations

import numpy as np
import pytest

from clusters import cluster_pools
from mp_harness import error_text, rank_pools
from gpucoll.perf.reference import as_dtype
from reference import make_input, op_valid, reduce_reference

pytestmark = pytest.mark.timeout(180)

PATTERNS = {
    "zeros": lambda r, n: 0,
    "some_zero": lambda r, n: 0 if r % 2 else r + 2,
    "uneven": lambda r, n: 3 * r + 1,
    "even": lambda r, n: 5,
    "skewed_big": lambda r, n: 600_000 if r == n - 1 else r,  # >= 4 MiB: one reduce per rank
}
TRAILING = [(), (3,), (2, 3)]
DTYPES = ["float32", "int64", "bool", "complex128", "bfloat16", "uint8"]
OPS = ["sum", "max", "avg", "bor", "prod", "min"]


def cases():
    index = 0
    for pattern in PATTERNS:
        for trailing in TRAILING:
            if pattern == "skewed_big" and trailing:
                continue  # one multi-chunk case is enough
            dtype = DTYPES[index % len(DTYPES)] if pattern != "skewed_big" else "float64"
            op = next(o for o in OPS[index % len(OPS):] + OPS if op_valid(o, as_dtype(dtype)))
            index += 1
            yield f"{pattern}/{trailing}/{dtype}/{op}", pattern, trailing, dtype, op


def counts_of(pattern, size):
    return [PATTERNS[pattern](r, size) for r in range(size)]


def full_input(seed, rank, counts, trailing, dtype, op):
    return make_input(seed, rank, (sum(counts),) + trailing, as_dtype(dtype), op)


def reduced_rows(seed, size, rank, counts, trailing, dtype, op):
    """What reduce_scatter_v gives ``rank``: its rows of the NumPy reduction of every input."""
    stacked = np.stack([full_input(seed, r, counts, trailing, dtype, op) for r in range(size)])
    return reduce_reference(stacked, op)[sum(counts[:rank]):sum(counts[:rank + 1])]


pool = rank_pools([1, 2, 3, 4], ids=lambda n: f"world{n}", shared=True)


def rank_scatters(comm, all_cases):
    out = {}
    for seed, (case_id, pattern, trailing, dtype, op) in enumerate(all_cases):
        counts = counts_of(pattern, comm.size)
        x = full_input(seed, comm.rank, counts, trailing, dtype, op)
        keep = x.copy()
        reduced = comm.reduce_scatter_v(x, counts, op=op)
        both = []  # each way of reduce_scatter_v, whichever the sizes would choose
        if max(counts):
            both = [comm._reduce_scatter_v_padded(x, counts, comm_op(op)),
                    comm._reduce_scatter_v_reduces(x, counts, comm_op(op))]
        scattered = []
        for root in range(comm.size if pattern != "skewed_big" else 0):  # big: reductions only
            mine = full_input(seed, root, counts, trailing, dtype, op)
            given = comm.scatter_v(mine if comm.rank == root else None, root, counts)
            split = comm.scatter_v(mine if comm.rank == root else None, root)  # even split
            scattered.append((given, split))
        np.testing.assert_array_equal(x, keep)  # the input is never touched
        out[case_id] = (reduced, both, scattered)
    return out


def comm_op(name):
    import gpucoll
    return gpucoll.ReduceOp.parse(name)


def test_uneven_scatters_match_numpy(pool):
    n = pool.world_size
    all_cases = list(cases())
    results = pool.run(rank_scatters, all_cases)
    for rank, got in enumerate(results):
        for seed, (case_id, pattern, trailing, dtype, op) in enumerate(all_cases):
            counts = counts_of(pattern, n)
            start, stop = sum(counts[:rank]), sum(counts[:rank + 1])
            want = reduced_rows(seed, n, rank, counts, trailing, dtype, op)
            (array, used), both, scattered = got[case_id]
            assert used == counts and all(type(c) is int for c in used), case_id
            for what, result in [("reduce_scatter_v", array)] + list(zip(("padded", "reduces"),
                                                                         both)):
                assert result.dtype == want.dtype and result.shape == want.shape, (case_id, what)
                np.testing.assert_array_equal(result, want, err_msg=f"{case_id} {what}")
            assert len(scattered) == (0 if pattern == "skewed_big" else n), case_id
            for root, (given, split) in enumerate(scattered):
                source = full_input(seed, root, counts, trailing, dtype, op)
                even = np.array_split(np.arange(len(source)), n)[rank]
                for what, (rows, used), want_rows, want_counts in (
                        ("given", given, source[start:stop], counts),
                        ("split", split, source[even], [len(p) for p in np.array_split(
                            np.arange(len(source)), n)])):
                    assert used == want_counts, (case_id, root, what, used)
                    assert rows.dtype == source.dtype and rows.shape == want_rows.shape, \
                        (case_id, root, what, rows.shape)
                    np.testing.assert_array_equal(rows, want_rows,
                                                  err_msg=f"{case_id} root {root} {what}")


def rank_bad_scatters(comm):
    n, r = comm.size, comm.rank
    x = np.ones((2 * n, 3), np.float32)
    local = [
        error_text(lambda: comm.reduce_scatter_v(np.float32(1.0))),
        error_text(lambda: comm.reduce_scatter_v(x, counts=[2] * (n + 1))),
        error_text(lambda: comm.reduce_scatter_v(x, counts=[3] * n)),
        error_text(lambda: comm.reduce_scatter_v(x, counts=[2.0] * n)),
        error_text(lambda: comm.reduce_scatter_v(x, op="band")),
        error_text(lambda: comm.reduce_scatter_v(x, op="mean")),
        error_text(lambda: comm.reduce_scatter_v(np.ones((4, 2))[:, :1])),
        error_text(lambda: comm.scatter_v(x, root=n)),
    ]
    # the root refuses its input: every rank raises, and nothing is left on the wire
    refusals = [error_text(lambda: comm.scatter_v(x if r == 0 else None, 0, [1] * n)),
                error_text(lambda: comm.scatter_v(None, 0)),
                error_text(lambda: comm.scatter_v(np.ones(3) if r == 0 else None, 0, [-1] * n))]
    after = comm.scatter_v(np.arange(n * (n + 1) // 2, dtype=np.int16) if r == n - 1 else None,
                           n - 1, list(range(1, n + 1)))
    return local, refusals, after


def test_uneven_scatter_usage_errors(pool):
    n = pool.world_size
    results = pool.run(rank_bad_scatters)
    for rank, (local, refusals, after) in enumerate(results):
        assert local[0] == ("ValueError: reduce_scatter_v: x must have at least one dimension "
                            "(rows are counted along the first axis), got a 0-d array")
        assert local[1] == (f"ValueError: reduce_scatter_v: counts has {n + 1} entries, expected "
                            f"one per rank ({n}): {[2] * (n + 1)}")
        assert local[2] == (f"ValueError: reduce_scatter_v: counts {[3] * n} add up to {3 * n} "
                            f"rows but x has {2 * n} (x.shape[0])")
        assert local[3] == "TypeError: reduce_scatter_v: counts[0] must be an int, got 2.0"
        assert local[4].startswith("TypeError: op band") and "float32" in local[4], local[4]
        assert local[5].startswith("ValueError: unknown reduction op 'mean'"), local[5]
        assert local[6].startswith("ValueError: x must be C-contiguous"), local[6]
        assert local[7] == f"ValueError: root={n} is out of range for a communicator of size {n}"
        told = ("ValueError: scatter_v: root 0 refused its input (its own error says why); "
                "nothing was scattered")
        if rank == 0:
            assert refusals == [
                f"ValueError: scatter_v: counts {[1] * n} add up to {n} rows but x has {2 * n} "
                f"(x.shape[0])",
                "ValueError: scatter_v: x is required on the root rank",
                "ValueError: scatter_v: counts[0]=-1 is negative"]
        else:
            assert refusals == [told] * 3
        rows, counts = after
        assert counts == list(range(1, n + 1))
        first = rank * (rank + 1) // 2
        np.testing.assert_array_equal(rows, np.arange(first, first + rank + 1, dtype=np.int16))


# ------------------------------------------------------------------ the MPI backend
mpi_pool = cluster_pools([("mpi", 2), ("mpi", 3)])


def rank_mpi_reduce_scatters(comm, arr, all_cases):
    out = {}
    for seed, (case_id, pattern, trailing, dtype, op) in enumerate(all_cases):
        counts = counts_of(pattern, comm.size)
        x = full_input(seed, comm.rank, counts, trailing, dtype, op)
        keep = x.copy()
        before = len(comm.trace())
        reduced, used = comm.reduce_scatter_v(x, counts, op=op)
        calls = [entry["op"] for entry in comm.trace()[before:]]
        np.testing.assert_array_equal(x, keep)
        out[case_id] = (reduced, used, calls)
    return out


def test_the_mpi_backend_reduce_scatters_with_mpi_and_matches_numpy(mpi_pool):
    n = mpi_pool.world_size
    all_cases = list(cases())
    results = mpi_pool.run(rank_mpi_reduce_scatters, all_cases)
    for rank, got in enumerate(results):
        for seed, (case_id, pattern, trailing, dtype, op) in enumerate(all_cases):
            counts = counts_of(pattern, n)
            want = reduced_rows(seed, n, rank, counts, trailing, dtype, op)
            reduced, used, calls = got[case_id]
            assert used == counts, case_id
            assert calls == ["reduce_scatter_v"], (case_id, calls)   # MPI's own: nothing else
            assert reduced.dtype == want.dtype and reduced.shape == want.shape, case_id
            np.testing.assert_array_equal(reduced, want, err_msg=case_id)
