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
from .reference import as_dtype, bfloat16
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


# nccl-tests' type names; NumPy names are accepted too. bfloat16 comes from ml_dtypes.
_TYPE_NAMES = {"int8": "int8", "char": "int8", "uint8": "uint8", "int32": "int32", "int": "int32",
               "uint32": "uint32", "int64": "int64", "uint64": "uint64", "half": "float16",
               "float16": "float16", "float": "float32", "float32": "float32",
               "double": "float64", "float64": "float64", "bfloat16": "bfloat16",
               "bf16": "bfloat16"}
ALL_DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")
if bfloat16 is not None:
    ALL_DTYPES += ("bfloat16",)
ALL_OPS = ("sum", "prod", "max", "min", "avg")
_SHOWN_TYPE = {"float16": "half", "float32": "float", "float64": "double"}
# nccl-tests' -a: how the ranks' times of one size combine into the table's time
AVERAGES = {0: "rank 0", 1: "mean over ranks", 2: "fastest rank", 3: "slowest rank"}


def parse_dtypes(text: str) -> List[np.dtype]:
    names = ALL_DTYPES if text == "all" else [t.strip() for t in text.split(",")]
    out = []
    for name in names:
        if name not in _TYPE_NAMES:
            raise UsageError(f"unknown data type {name!r} for -d; choose from "
                             f"{', '.join(sorted(_TYPE_NAMES))} or all")
        try:
            out.append(as_dtype(_TYPE_NAMES[name]))
        except TypeError as exc:
            raise UsageError(f"-d {name}: {exc}") from None
    return out


def parse_transports(text: str) -> List[str]:
    """``unix,tcp`` -> ["unix", "tcp"]: each a value of GPUCOLL_TRANSPORT (checked by config)."""
    from .. import config

    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if not names:
        raise UsageError(f"--transport {text!r}: name one or more GPUCOLL_TRANSPORT values")
    for name in names:
        try:
            config.get("GPUCOLL_TRANSPORT", {"GPUCOLL_TRANSPORT": name})
        except ValueError as exc:
            raise UsageError(f"--transport {name!r}: {exc}") from None
    if len(set(names)) != len(names):
        raise UsageError(f"--transport {text!r} names a transport twice")
    return names


def parse_ops(text: str) -> List[ReduceOp]:
    names = ALL_OPS if text == "all" else [t.strip() for t in text.split(",")]
    try:
        return [ReduceOp.parse(name) for name in names]
    except ValueError as exc:
        raise UsageError(f"-o: {exc}") from None

# ---------------------------------------------------------------- options
@dataclass
class BenchOptions:
    """What one ``gpucoll bench`` run measures (the CLI fills it; see ``gpucoll bench -h``).

    Beyond nccl-tests' options: ``transports`` opens one CPU-backend communicator per
    GPUCOLL_TRANSPORT value and measures each (empty: the one ``gpucoll.init`` picks);
    ``rounds`` splits the timed iterations into rounds and keeps the best (the variants take
    turns round by round, so a burst of load elsewhere hits them alike); ``average`` is
    nccl-tests' ``-a`` (see :data:`AVERAGES`); ``iter_bytes`` > 0 times ``iter_bytes / size``
    iterations per size, within [``min_iters``, ``iters``]; ``modes`` ``"matched"`` measures
    only the mode torch.distributed's call has (in place for all_reduce, broadcast and reduce);
    ``ceiling_bytes`` > 0 first measures the raw two-way socket rate of each transport;
    ``table`` is the layout (``"nccl-tests"`` or ``"side-by-side"``).
    """

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
    transports: Sequence[str] = ()
    rounds: int = 1
    average: int = 1
    iter_bytes: int = 0
    min_iters: int = 1
    modes: str = "all"
    ceiling_bytes: int = 0
    table: str = "nccl-tests"
    sizes: List[int] = field(default_factory=list)

    def validate(self) -> None:
        if self.iters < 1 or self.warmup < 0:
            raise UsageError(f"-n must be >= 1 and -w >= 0, got -n {self.iters} -w {self.warmup}")
        if not self.timeout > 0:
            raise UsageError(f"-T must be positive, got {self.timeout}")
        if self.nranks is not None and self.nranks < 1:
            raise UsageError(f"-g must be at least 1, got {self.nranks}")
        if self.rounds < 1:
            raise UsageError(f"--rounds must be at least 1, got {self.rounds}")
        if self.average not in AVERAGES:
            raise UsageError(f"-a must be one of 0 (rank 0), 1 (mean), 2 (min), 3 (max), "
                             f"got {self.average}")
        if self.iter_bytes < 0 or not 1 <= self.min_iters <= self.iters:
            raise UsageError(f"--iter-bytes must be >= 0 and 1 <= --min-iters <= -n, got "
                             f"--iter-bytes {self.iter_bytes} --min-iters {self.min_iters} "
                             f"-n {self.iters}")
        if self.modes not in ("all", "matched"):
            raise UsageError(f"--modes must be all or matched, got {self.modes!r}")
        if self.table not in ("nccl-tests", "side-by-side"):
            raise UsageError(f"--table must be nccl-tests or side-by-side, got {self.table!r}")
        if self.ceiling_bytes < 0:
            raise UsageError(f"--ceiling must be a byte count >= 0, got {self.ceiling_bytes}")
        self.transports = list(self.transports)
        if self.transports:
            parse_transports(",".join(self.transports))
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

    def iterations(self, nbytes: int):
        """(timed, warm-up) iterations for one size: fixed (``-n``, ``-w``), or with
        ``iter_bytes`` ``iter_bytes / size`` within [``min_iters``, ``iters``] and a fifth of
        that warm-up (at least 1, at most ``-w``); the same on every rank."""
        if self.iter_bytes <= 0:
            return self.iters, self.warmup
        timed = max(self.min_iters, min(self.iters, self.iter_bytes // max(1, nbytes)))
        return timed, max(1, min(self.warmup, timed // 5))

    def modes_of(self, coll: Collective):
        """The modes (``"out"``, ``"in"``) measured for ``coll``."""
        return coll.modes if self.modes == "all" else (coll.gloo_mode,)

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
