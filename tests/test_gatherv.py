"""Uneven gathers (all_gather_v, gather_v) of the CPU backend against NumPy, in real processes.

World sizes 1 to 4; per-rank row counts all zero, some zero, uneven and one large; trailing
shapes (), (3,) and (2, 3); several dtype families; counts given and exchanged; every root;
and every bad input, which raises before anything is sent (or, for ranks that disagree on
dtype or trailing shape, on every rank alike) and leaves the communicator usable.
"""

from __future__ import annotations

import numpy as np
import pytest

from mp_harness import error_text, rank_pools
from reference import make_input

pytestmark = pytest.mark.timeout(180)

PATTERNS = {
    "zeros": lambda r, n: 0,
    "some_zero": lambda r, n: 0 if r % 2 else r + 2,
    "uneven": lambda r, n: 3 * r + 1,
    "one_large": lambda r, n: 40_000 if r == n - 1 else 1,
    "skewed_big": lambda r, n: 600_000 if r == n - 1 else r,  # >= 4 MiB: per-rank broadcasts
}
TRAILING = [(), (3,), (2, 3)]
DTYPES = ["float32", "int64", "bool", "complex128", "uint8"]


def cases():
    for p_index, pattern in enumerate(PATTERNS):
        for t_index, trailing in enumerate(TRAILING):
            if pattern in ("one_large", "skewed_big") and trailing:
                continue  # one multi-chunk case each is enough
            dtype = DTYPES[(p_index + t_index) % len(DTYPES)] if pattern != "skewed_big" \
                else "float64"
            yield f"{pattern}/{trailing}/{dtype}", pattern, trailing, dtype


def rows_of(pattern, rank, size, trailing, dtype, seed):
    count = PATTERNS[pattern](rank, size)
    return make_input(seed, rank, (count,) + trailing, dtype)


def expected(pattern, size, trailing, dtype, seed):
    parts = [rows_of(pattern, r, size, trailing, dtype, seed) for r in range(size)]
    return np.concatenate(parts), [len(p) for p in parts]


pool = rank_pools([1, 2, 3, 4], ids=lambda n: f"world{n}", shared=True)


def rank_gathers(comm, all_cases):
    out = {}
    for seed, (case_id, pattern, trailing, dtype) in enumerate(all_cases):
        x = rows_of(pattern, comm.rank, comm.size, trailing, dtype, seed)
        keep = x.copy()
        counts = [PATTERNS[pattern](r, comm.size) for r in range(comm.size)]
        exchanged = comm.all_gather_v(x)
        given = comm.all_gather_v(x, counts=np.array(counts))
        rooted = [comm.gather_v(x, root=root, counts=counts if root % 2 else None)
                  for root in range(comm.size)]
        both = []  # each strategy of all_gather_v, whichever the sizes would choose
        if max(counts):
            both = [comm._all_gather_v_padded(x, counts), comm._all_gather_v_broadcasts(x, counts)]
        np.testing.assert_array_equal(x, keep)  # the input is never touched
        out[case_id] = (exchanged, given, rooted, both)
    return out


def test_uneven_gathers_match_numpy(pool):
    n = pool.world_size
    all_cases = list(cases())
    results = pool.run(rank_gathers, all_cases)
    for rank, got in enumerate(results):
        for seed, (case_id, pattern, trailing, dtype) in enumerate(all_cases):
            want, want_counts = expected(pattern, n, trailing, dtype, seed)
            exchanged, given, rooted, both = got[case_id]
            for strategy, array in zip(("padded", "broadcasts"), both):
                assert array.dtype == want.dtype and array.shape == want.shape, case_id
                np.testing.assert_array_equal(array, want, err_msg=f"{case_id} {strategy}")
            for what, (array, counts) in (("exchanged", exchanged), ("given", given)):
                assert counts == want_counts and all(type(c) is int for c in counts), case_id
                assert array.dtype == want.dtype and array.shape == want.shape, (case_id, what)
                np.testing.assert_array_equal(array, want, err_msg=f"{case_id} {what}")
            for root, (array, counts) in enumerate(rooted):
                assert counts == want_counts, case_id
                if rank == root:
                    assert array.dtype == want.dtype and array.shape == want.shape, case_id
                    np.testing.assert_array_equal(array, want, err_msg=f"{case_id} root {root}")
                else:
                    assert array is None, case_id


def rank_bad_gathers(comm):
    n, r = comm.size, comm.rank
    x = np.ones((2, 3), np.float32)
    negative = [2] * n
    negative[(r + 1) % n] = -1
    local = [
        error_text(lambda: comm.all_gather_v(np.float32(1.0))),
        error_text(lambda: comm.all_gather_v(np.array(1.0))),
        error_text(lambda: comm.all_gather_v(x, counts=[2] * (n + 1))),
        error_text(lambda: comm.gather_v(x, 0, counts=negative)),
        error_text(lambda: comm.all_gather_v(x, counts=[3] * n)),
        error_text(lambda: comm.all_gather_v(x, counts=[2.0] * n)),
        error_text(lambda: comm.all_gather_v(x, counts=[True] * n)),
        error_text(lambda: comm.all_gather_v(x, counts="22")),
        error_text(lambda: comm.all_gather_v(x, counts=5)),
        error_text(lambda: comm.all_gather_v(np.ones((4, 2))[:, :1])),
        error_text(lambda: comm.all_gather_v(np.array([["a"]]))),
        error_text(lambda: comm.gather_v(x, root=n)),
    ]
    # ranks that disagree: every rank raises the same error, nothing is left on the wire
    shape_error = error_text(lambda: comm.all_gather_v(np.zeros((r, 2 + (r == n - 1) * (n > 1)))))
    dtype_error = error_text(lambda: comm.gather_v(np.zeros(r, np.float32 if r else np.float64)))
    after = comm.all_gather_v(np.full(r, r, np.int16))
    return local, shape_error, dtype_error, after


def test_uneven_gather_usage_errors(pool):
    n = pool.world_size
    results = pool.run(rank_bad_gathers)
    for rank, (local, shape_error, dtype_error, after) in enumerate(results):
        assert local[0] == local[1] == ("ValueError: all_gather_v: x must have at least one "
                                        "dimension (rows are counted along the first axis), got "
                                        "a 0-d array")
        assert local[2] == (f"ValueError: all_gather_v: counts has {n + 1} entries, expected one "
                            f"per rank ({n}): {[2] * (n + 1)}")
        assert local[3] == f"ValueError: gather_v: counts[{(rank + 1) % n}]=-1 is negative"
        assert local[4] == (f"ValueError: all_gather_v: counts[{rank}]=3 but this rank's x has 2 "
                            f"rows (x.shape[0])")
        assert local[5] == "TypeError: all_gather_v: counts[0] must be an int, got 2.0"
        assert local[6] == "TypeError: all_gather_v: counts[0] must be an int, got True"
        assert local[7] == f"TypeError: all_gather_v: counts must be a sequence of {n} ints, got str"
        assert local[8] == f"TypeError: all_gather_v: counts must be a sequence of {n} ints, got int"
        assert local[9].startswith("ValueError: x must be C-contiguous"), local[9]
        assert local[10].startswith("TypeError: dtype str32 is not supported"), local[10]
        assert local[11] == f"ValueError: root={n} is out of range for a communicator of size {n}"
        if n == 1:
            assert shape_error == dtype_error == "no error"
        else:
            assert shape_error.startswith("ValueError: gather of uneven arrays: ranks disagree on "
                                          "dtype or trailing shape (rank 0: float64 (n, 2); ")
            assert f"rank {n - 1}: float64 (n, 3)); only the first axis may differ" in shape_error
            assert "rank 0: float64 (n,); rank 1: float32 (n,)" in dtype_error, dtype_error
        array, counts = after
        assert counts == list(range(n))
        np.testing.assert_array_equal(array, np.concatenate(
            [np.full(q, q, np.int16) for q in range(n)]))
