"""Inputs derived from (seed, rank, shape, dtype, op) and NumPy reference results.

Every rank can build every other rank's input, so expected values need no communication.
Values are small integers (exact in every dtype, no overflow at world size <= 9), except
where an op needs otherwise (prod uses -1, 1, 2).
"""

from __future__ import annotations

import zlib

import numpy as np

INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
COMPLEX_DTYPES = ["complex64", "complex128"]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES + ["bool"]
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]


def op_valid(op: str, dtype: str) -> bool:
    kind = np.dtype(dtype).kind
    if op in ("band", "bor", "bxor"):
        return kind in "biu"
    if op in ("min", "max"):
        return kind != "c"
    if op == "avg":
        return kind != "b"
    return True


def make_input(seed: int, rank: int, shape, dtype: str, op: str = "sum") -> np.ndarray:
    dt = np.dtype(dtype)
    count = int(np.prod(shape)) if len(shape) else 1
    salt = zlib.crc32(f"{dtype}/{op}".encode())
    rng = np.random.default_rng([seed, rank, salt])
    if dt.kind == "b":
        values = rng.integers(0, 2, count).astype(bool)
    elif op == "prod":
        choices = [1, 2] if dt.kind == "u" else [-1, 1, 2]
        values = rng.choice(choices, count)
        if dt.kind == "c":
            values = values + 1j * rng.choice([0, 1], count)
    elif dt.kind == "u":
        values = rng.integers(0, 25, count)
    elif dt.kind == "c":
        values = rng.integers(-8, 9, count) + 1j * rng.integers(-8, 9, count)
    else:
        values = rng.integers(-12, 13, count)
    return np.ascontiguousarray(values.astype(dt).reshape(shape))


def reduce_reference(stacked: np.ndarray, op: str) -> np.ndarray:
    """Reduce axis 0 of ``stacked`` with plain NumPy, in the inputs' dtype."""
    dt = stacked.dtype
    n = stacked.shape[0]
    if dt.kind == "b":
        table = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
                 "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
                 "bxor": np.logical_xor}
        return table[op].reduce(stacked, axis=0)
    if op in ("sum", "avg"):
        total = np.add.reduce(stacked, axis=0, dtype=dt)
        if op == "sum":
            return total
        if dt.kind in "fc":
            return (total / n).astype(dt)
        exact = np.add.reduce(stacked.astype(np.float64), axis=0) / n
        return np.trunc(exact).astype(dt)
    table = {"prod": np.multiply, "min": np.minimum, "max": np.maximum,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
    return table[op].reduce(stacked, axis=0, dtype=dt)


def assert_equal_result(got: np.ndarray, expected: np.ndarray, what: str, op: str = "sum") -> None:
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    if op == "avg" and expected.dtype.kind in "fc":
        rtol = 1e-2 if expected.dtype == np.float16 else 1e-6
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)
