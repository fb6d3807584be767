"""Inputs derived from (seed, rank, element index) and their expected results, in plain NumPy.

The one reference of gpucoll: ``gpucoll bench`` checks every timed result with it (nccl-tests'
``#wrong``), and the test suite computes its expected values with it. Every rank can build every
other rank's input, so expected results need no communication, and any slice of an input can be
built on its own (``offset``), so a 1 GiB result is checked block by block.

Values are small integers, so every reduction order gives the same exact answer in every dtype
(no overflow up to 9 ranks in int8): -8..8 (0..16 unsigned) for sum, avg, min and max; {-1, 1, 2}
({1, 2, 3} unsigned) for prod; 0..16 for the bitwise ops. Element ``i`` of rank ``r`` is
``(7 i + 13 r + 31 seed + h(i // 17)) mod 17``, where ``h`` is an integer hash with ``h(0) = 0``:
the ``7 i`` term makes neighbours differ, the hash breaks the period of 17, so a block moved by
any distance is caught.

Expected results come from NumPy's own ufunc reductions (:func:`reduce_reference`), not from
gpucoll's reduction code. This module imports nothing from gpucoll.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

__all__ = ["pattern", "make_input", "reduce_reference", "expected_reduction", "count_wrong",
           "op_valid", "is_floating", "bfloat16", "INT_DTYPES", "FLOAT_DTYPES",
           "COMPLEX_DTYPES", "ALL_DTYPES", "OPS"]

try:  # NumPy has no bfloat16; ml_dtypes (a JAX dependency) provides one
    import ml_dtypes as _ml_dtypes

    bfloat16: Optional[np.dtype] = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
    _ml_dtypes = None
    bfloat16 = None

INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
COMPLEX_DTYPES = ["complex64", "complex128"]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES + ["bool"]
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
_BITWISE = ("band", "bor", "bxor")
_PERIOD = 17


def _op_name(op) -> Optional[str]:
    """``"sum"`` from ``ReduceOp.SUM``, ``"SUM"`` or ``"sum"``; None stays None."""
    if op is None:
        return None
    return str(getattr(op, "value", op)).strip().lower()


def is_floating(dtype) -> bool:
    """True for float16/32/64 and bfloat16 (whose NumPy kind is ``V``)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (bfloat16 is not None and dtype == bfloat16)


def _eps(dtype) -> float:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return float(np.finfo(dtype).eps)
    return float(_ml_dtypes.finfo(dtype).eps)


def _block_hash(block: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer of each block index, mod 17 (0 for block 0)."""
    mixed = block.astype(np.uint64)
    mixed ^= mixed >> np.uint64(33)
    mixed *= np.uint64(0xFF51AFD7ED558CCD)
    mixed ^= mixed >> np.uint64(33)
    mixed *= np.uint64(0xC4CEB9FE1A85EC53)
    mixed ^= mixed >> np.uint64(33)
    return (mixed % np.uint64(_PERIOD)).astype(np.int64)


def pattern(seed: int, rank: int, count: int, dtype, op=None, offset: int = 0) -> np.ndarray:
    """Input of ``rank``: element ``i`` depends only on (seed, rank, offset + i) and ``op``.

    Args:
        seed, rank: select the values; every rank can compute every other rank's input.
        count: elements returned; ``offset``: index of the first one.
        dtype: any NumPy dtype, bfloat16 (ml_dtypes), complex or bool.
        op: the reduction the input feeds (a ``ReduceOp`` or its name), or None.
    """
    dtype, op = np.dtype(dtype), _op_name(op)
    index = np.arange(offset, offset + count, dtype=np.int64)
    value = (index * 7 + rank * 13 + seed * 31 + _block_hash(index // _PERIOD)) % _PERIOD
    unsigned = dtype.kind == "u"
    if dtype.kind == "b":
        return (value % 2).astype(bool)
    if op == "prod":
        value = np.array([1, 2, 3] if unsigned else [-1, 1, 2], np.int64)[value % 3]
    elif op not in _BITWISE and not unsigned:
        value = value - 8
    if dtype.kind == "c":  # an imaginary part of its own: (value + 6) mod 17, shifted alike
        imag = (value + 6) % _PERIOD - 8 if op != "prod" else (value + 1) % 2
        return (value + 1j * imag).astype(dtype)
    return value.astype(dtype)


def make_input(seed: int, rank: int, shape, dtype, op="sum") -> np.ndarray:
    """:func:`pattern` shaped as ``shape`` (a C-contiguous array)."""
    shape = tuple(shape)
    count = int(np.prod(shape)) if shape else 1
    return np.ascontiguousarray(pattern(seed, rank, count, dtype, op).reshape(shape))


def op_valid(op, dtype) -> bool:
    """Whether ``op`` is defined for ``dtype`` (bitwise: integers and bool; min/max: not complex;
    avg: not bool)."""
    op, kind = _op_name(op), np.dtype(dtype).kind
    if op in _BITWISE:
        return kind in "biu"
    if op in ("min", "max"):
        return kind != "c"
    if op == "avg":
        return kind != "b"
    return True


def reduce_reference(stacked: np.ndarray, op) -> np.ndarray:
    """Reduce axis 0 of ``stacked`` (one row per rank) with plain NumPy, in the inputs' dtype.

    avg divides the sum by the number of rows: true division for floating and complex dtypes,
    truncation toward zero for integers (as C and NCCL do).
    """
    op, dt = _op_name(op), stacked.dtype
    nrows = stacked.shape[0]
    if dt.kind == "b":
        table = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
                 "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
                 "bxor": np.logical_xor}
        return table[op].reduce(stacked, axis=0)
    if op in ("sum", "avg"):
        total = np.add.reduce(stacked, axis=0, dtype=dt)
        if op == "sum":
            return total
        if dt.kind == "c" or is_floating(dt):
            return (total.astype(np.complex128 if dt.kind == "c" else np.float64) / nrows).astype(dt)
        exact = np.add.reduce(stacked.astype(np.float64), axis=0) / nrows
        return np.trunc(exact).astype(dt)
    table = {"prod": np.multiply, "min": np.minimum, "max": np.maximum,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
    return table[op].reduce(stacked, axis=0, dtype=dt)


def expected_reduction(op, seed: int, nranks: int, count: int, dtype,
                       offset: int = 0) -> np.ndarray:
    """:func:`reduce_reference` over ranks 0..nranks-1 of :func:`pattern`."""
    stacked = np.stack([pattern(seed, rank, count, dtype, op, offset) for rank in range(nranks)])
    return reduce_reference(stacked, op)


def count_wrong(got: np.ndarray, expected: np.ndarray, nranks: int = 1) -> int:
    """Elements of ``got`` that differ from ``expected``.

    Integers must match exactly; floats (bfloat16 included) within ``nranks`` ulps relative to
    the value (reduction order and avg's division may round differently on another backend);
    NaN is always wrong.
    """
    got, expected = np.asarray(got).reshape(-1), np.asarray(expected).reshape(-1)
    if got.shape != expected.shape:
        return max(got.size, expected.size)
    if not is_floating(got.dtype):
        return int(np.count_nonzero(got != expected))
    exp64, got64 = expected.astype(np.float64), got.astype(np.float64)
    tolerance = _eps(got.dtype) * max(nranks, 2) * np.maximum(np.abs(exp64), 1.0)
    both_inf = np.isinf(exp64) & (got64 == exp64)
    ok = both_inf | (np.abs(got64 - exp64) <= tolerance)
    return int(np.count_nonzero(~ok))


def as_dtype(name: Union[str, np.dtype]) -> np.dtype:
    """``np.dtype(name)``, also for ``"bfloat16"`` (TypeError when ml_dtypes is missing)."""
    if isinstance(name, str) and name == "bfloat16":
        if bfloat16 is None:
            raise TypeError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes")
        return bfloat16
    return np.dtype(name)
