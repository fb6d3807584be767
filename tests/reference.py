"""The test suite's reference: gpucoll's one generator of inputs and expected results.

Inputs are derived from (seed, rank, element index), so every rank can build every other rank's
input; expected results are plain NumPy reductions (and prefix reductions, for ``scan``). Both live in :mod:`gpucoll.perf.reference`,
shared with ``gpucoll bench``'s result checks; this module re-exports them and adds the
suite's assertion.
"""

from __future__ import annotations

import numpy as np

from gpucoll.perf.reference import (ALL_DTYPES, COMPLEX_DTYPES, FLOAT_DTYPES,  # noqa: F401
                                    INT_DTYPES, OPS, bfloat16, make_input, op_valid,
                                    reduce_reference)


def assert_equal_result(got: np.ndarray, expected: np.ndarray, what: str, op: str = "sum") -> None:
    """Every element equal (avg on floating dtypes: within rounding), same shape and dtype."""
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    if op == "avg" and expected.dtype.kind in "fc":
        rtol = 1e-2 if expected.dtype == np.float16 else 1e-6
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)


def scan_input(seed: int, rank: int, shape, dtype: str, op="sum") -> np.ndarray:
    """:func:`make_input`, also for ``"bfloat16"`` (the float32 input, converted: small integers,
    exact in bfloat16)."""
    if dtype == "bfloat16":
        return make_input(seed, rank, shape, "float32", op).astype(bfloat16)
    return make_input(seed, rank, shape, dtype, op)


def prefix_reference(stacked: np.ndarray, op) -> np.ndarray:
    """Row r: the reduction of rows 0..r of ``stacked`` (one row per rank), with NumPy's own
    ``ufunc.accumulate`` in the inputs' dtype (bool: sum and max are "or", prod and min "and")."""
    op = str(getattr(op, "value", op)).lower()
    if stacked.dtype.kind == "b":
        table = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
                 "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
                 "bxor": np.logical_xor}
    else:
        table = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
                 "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
    return table[op].accumulate(stacked, axis=0, dtype=stacked.dtype)


def identity_reference(op, dtype, shape) -> np.ndarray:
    """What ``exscan`` gives rank 0, written out: the value ``op`` leaves every input unchanged."""
    op, dtype = str(getattr(op, "value", op)).lower(), np.dtype(dtype)
    if dtype.kind == "b":
        value = np.array(op in ("prod", "min", "band"))
    elif op in ("sum", "bor", "bxor"):
        value = np.array(0).astype(dtype)
    elif op == "prod":
        value = np.array(1).astype(dtype)
    elif op == "band":
        value = np.invert(np.zeros((), dtype))
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        value = np.array(info.max if op == "min" else info.min, dtype)
    else:
        value = np.array(float("inf") if op == "min" else float("-inf")).astype(dtype)
    return np.full(shape, value, dtype)
