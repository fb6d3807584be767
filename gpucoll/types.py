"""Reduction ops and the dtype table (NumPy / CuPy name <-> wire code <-> NCCL name)."""

from __future__ import annotations

import enum
import functools
from typing import Callable, Dict, Union

import numpy as np

__all__ = ["ReduceOp", "DTYPES", "wire_code", "dtype_from_code", "check_op_dtype", "combine_fn",
           "finish_avg"]


class ReduceOp(enum.Enum):
    """Reduction applied by all_reduce, reduce and reduce_scatter.

    Accepts the enum or its name in any case: ``"sum"``, ``"AVG"``...
    """

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons compared by identity; Enum's own __hash__ hashes the name in
    # Python, and (op, dtype) keys are looked up on every reduction (hot path).
    __hash__ = object.__hash__

    @classmethod
    def parse(cls, op: Union["ReduceOp", str]) -> "ReduceOp":
        try:
            return _PARSED[op]  # a member, or its exact or upper-case name (hot path)
        except (KeyError, TypeError):  # TypeError: unhashable, not an op; the error names it
            pass
        if isinstance(op, str):
            try:
                return cls(op.strip().lower())
            except ValueError:
                pass
        names = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown reduction op {op!r}; expected one of {names}")


_OP_NAMES = {member.value: member for member in ReduceOp}  # the exact lower-case names (hot path)
_PARSED = {**_OP_NAMES, **{name.upper(): member for name, member in _OP_NAMES.items()},
           **{member: member for member in ReduceOp}}

# name: (wire code, NCCL dtype name or None)
DTYPES: Dict[str, tuple] = {
    "int8": (1, "ncclInt8"), "uint8": (2, "ncclUint8"),
    "int16": (3, None), "uint16": (4, None),
    "int32": (5, "ncclInt32"), "uint32": (6, "ncclUint32"),
    "int64": (7, "ncclInt64"), "uint64": (8, "ncclUint64"),
    "float16": (9, "ncclFloat16"), "float32": (10, "ncclFloat32"), "float64": (11, "ncclFloat64"),
    "bfloat16": (12, "ncclBfloat16"),
    "complex64": (13, None), "complex128": (14, None),
    "bool": (15, None),
}
_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}
_CODE_OF: dict = {}


def wire_code(dtype) -> int:
    """Wire code of a NumPy-compatible dtype.

    Raises:
        TypeError: the dtype is not supported (object, strings, structured...).
    """
    try:
        return _CODE_OF[dtype]
    except (KeyError, TypeError):
        pass
    name = np.dtype(dtype).name
    try:
        code = DTYPES[name][0]
    except KeyError:
        supported = ", ".join(DTYPES)
        raise TypeError(f"dtype {name} is not supported; supported dtypes: {supported}") from None
    try:
        _CODE_OF[dtype] = code  # memoized per dtype object (hot path)
    except TypeError:
        pass
    return code


def dtype_from_code(code: int) -> str:
    return _BY_CODE[code]


_VALID_OP_DTYPE: set = set()  # (op, dtype) pairs already checked (hot path)
_SUM, _PROD = ReduceOp.SUM, ReduceOp.PROD


def check_op_dtype(op: ReduceOp, dtype) -> None:
    """Raise TypeError when ``op`` makes no sense for ``dtype``.

    BAND/BOR/BXOR need integers or bool; MIN/MAX are undefined for complex numbers;
    AVG is undefined for bool.
    """
    if (op is _SUM or op is _PROD) and isinstance(dtype, np.dtype):
        return  # defined for every dtype, and a np.dtype needs no conversion (hot path)
    try:
        if (op, dtype) in _VALID_OP_DTYPE:
            return
    except TypeError:  # an unhashable dtype-like: check it the long way
        pass
    _check_op_dtype(op, dtype)
    try:
        _VALID_OP_DTYPE.add((op, dtype))
    except TypeError:
        pass


def _check_op_dtype(op: ReduceOp, dtype) -> None:
    dt = np.dtype(dtype)
    kind = dt.kind  # b, i, u, f, c
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind not in "biu":
        raise TypeError(f"op {op.value} needs an integer or bool array, got dtype {dt.name}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise TypeError(f"op {op.value} is undefined for complex dtype {dt.name}")
    if op is ReduceOp.AVG and kind == "b":
        raise TypeError("op avg is undefined for dtype bool")


_UFUNCS = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor,
}


@functools.lru_cache(maxsize=None)
def combine_fn(op: ReduceOp, dtype) -> Callable[[np.ndarray, np.ndarray], None]:
    """In-place combiner ``f(dst, src)``: ``dst = dst (op) src`` elementwise, no allocation.

    AVG combines as SUM; :func:`finish_avg` divides at the end. On bool, SUM is logical or
    and PROD logical and (NumPy's rules).
    """
    ufunc = _UFUNCS[op]
    if np.dtype(dtype).kind == "b":
        ufunc = {np.add: np.logical_or, np.multiply: np.logical_and,
                 np.minimum: np.logical_and, np.maximum: np.logical_or}.get(ufunc, ufunc)

    def combine(dst: np.ndarray, src: np.ndarray) -> None:
        ufunc(dst, src, out=dst)

    combine.ufunc = ufunc  # for callers that combine two sources into a third array
    return combine


def finish_avg(result: np.ndarray, world_size: int) -> None:
    """Divide a SUM by the world size in place: true division for floating (bfloat16 included)
    and complex dtypes, truncation toward zero for integers (as C and NCCL do)."""
    if world_size == 1:
        return
    kind = result.dtype.kind
    if kind in "fc" or result.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 has kind "V"
        np.divide(result, world_size, out=result)
    elif kind == "u":
        np.floor_divide(result, world_size, out=result)
    else:
        inexact_negative = (result < 0) & (np.remainder(result, world_size) != 0)
        np.floor_divide(result, world_size, out=result)
        np.add(result, 1, out=result, where=inexact_negative, casting="unsafe")
