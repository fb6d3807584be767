"""The test suite's reference: gpucoll's one generator of inputs and expected results.

Inputs are derived from (seed, rank, element index), so every rank can build every other rank's
input; expected results are plain NumPy reductions. Both live in :mod:`gpucoll.perf.reference`,
shared with ``gpucoll bench``'s result checks; this module re-exports them and adds the
suite's assertion.
"""

from __future__ import annotations

import numpy as np

from gpucoll.perf.reference import (ALL_DTYPES, COMPLEX_DTYPES, FLOAT_DTYPES,  # noqa: F401
                                    INT_DTYPES, OPS, make_input, op_valid, reduce_reference)


def assert_equal_result(got: np.ndarray, expected: np.ndarray, what: str, op: str = "sum") -> None:
    """Every element equal (avg on floating dtypes: within rounding), same shape and dtype."""
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    if op == "avg" and expected.dtype.kind in "fc":
        rtol = 1e-2 if expected.dtype == np.float16 else 1e-6
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)
