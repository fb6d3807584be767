"""What one ``gpucoll bench`` run measures: sizes, data types, ops and :class:`BenchOptions`.

Parses the CLI's byte counts (``8``, ``1K``, ``64M``), builds the size sweep and validates each
collective's (dtype, op) pairs before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from ..cliutil import UsageError, parse_size  # noqa: F401  (re-exported)
from ..types import ReduceOp, check_op_dtype
from .specs import COLLECTIVES, Collective


# ---------------------------------------------------------------- sizes, dtypes, ops
def size_sweep(min_bytes: int, max_bytes: int, factor: int = 2, step: int = 0) -> List[int]:
    """Sizes from ``min_bytes`` to ``max_bytes``: times ``factor``, or plus ``step`` when given."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise UsageError(f"bad size range: -b {min_bytes} -e {max_bytes} (need 0 <= min <= max)")
    if step <= 0 and factor < 2:
        raise UsageError(f"-f must be at least 2, got {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        nxt = size + step if step > 0 else max(size * factor, 1)
        if nxt <= size:
            break
        size = nxt
    return sizes


# nccl-tests' type names; NumPy names are accepted too. bfloat16 has no NumPy dtype.
_TYPE_NAMES = {"int8": "int8", "char": "int8", "uint8": "uint8", "int32": "int32", "int": "int32",
               "uint32": "uint32", "int64": "int64", "uint64": "uint64", "half": "float16",
               "float16": "float16", "float": "float32", "float32": "float32",
               "double": "float64", "float64": "float64"}
ALL_DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")
ALL_OPS = ("sum", "prod", "max", "min", "avg")
_SHOWN_TYPE = {"float16": "half", "float32": "float", "float64": "double"}


def parse_dtypes(text: str) -> List[np.dtype]:
    names = ALL_DTYPES if text == "all" else [t.strip() for t in text.split(",")]
    out = []
    for name in names:
        if name not in _TYPE_NAMES:
            raise UsageError(f"unknown data type {name!r} for -d; choose from "
                             f"{', '.join(sorted(_TYPE_NAMES))} or all (bfloat16 has no NumPy dtype)")
        out.append(np.dtype(_TYPE_NAMES[name]))
    return out


def parse_ops(text: str) -> List[ReduceOp]:
    names = ALL_OPS if text == "all" else [t.strip() for t in text.split(",")]
    try:
        return [ReduceOp.parse(name) for name in names]
    except ValueError as exc:
        raise UsageError(f"-o: {exc}") from None

# ---------------------------------------------------------------- options
@dataclass
class BenchOptions:
    """What one ``gpucoll bench`` run measures (the CLI fills it; see ``gpucoll bench -h``)."""

    collectives: Sequence[str] = ("all_reduce",)
    nranks: Optional[int] = None
    min_bytes: int = 32 << 20
    max_bytes: int = 32 << 20
    factor: int = 2
    step_bytes: int = 0
    iters: int = 20
    warmup: int = 5
    check: bool = True
    dtypes: Sequence[np.dtype] = (np.dtype("float32"),)
    ops: Sequence[ReduceOp] = (ReduceOp.SUM,)
    root: int = 0
    timeout: float = 300.0
    backend: Optional[str] = None
    compare: Optional[str] = None
    seed: int = 0
    sizes: List[int] = field(default_factory=list)

    def validate(self) -> None:
        if self.iters < 1 or self.warmup < 0:
            raise UsageError(f"-n must be >= 1 and -w >= 0, got -n {self.iters} -w {self.warmup}")
        if not self.timeout > 0:
            raise UsageError(f"-T must be positive, got {self.timeout}")
        if self.nranks is not None and self.nranks < 1:
            raise UsageError(f"-g must be at least 1, got {self.nranks}")
        self.sizes = size_sweep(self.min_bytes, self.max_bytes, self.factor, self.step_bytes)
        explicit = len(self.ops) == 1
        for name in self.collectives:
            if COLLECTIVES[name].reduces:
                for dtype in self.dtypes:
                    for op in self.ops:
                        try:
                            check_op_dtype(op, dtype)
                        except TypeError as exc:
                            if explicit and len(self.dtypes) == 1:
                                raise UsageError(f"-o {op.value} -d {dtype.name}: {exc}") from None

    def cases(self, coll: Collective, nranks: int):
        """(dtype, op, root) triples measured for ``coll``."""
        for dtype in self.dtypes:
            for op in (self.ops if coll.reduces else [None]):
                if op is not None:
                    try:
                        check_op_dtype(op, dtype)
                    except TypeError:
                        continue
                yield dtype, op, (self.root if coll.rooted else -1)
