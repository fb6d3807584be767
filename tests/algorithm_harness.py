"""Running collective algorithms in one thread per rank, their inputs and NumPy references.

Shared by the ``test_algorithms_*.py`` files. Ranks are threads over the in-process transport
(which hands reducers ``CHUNK_BYTES`` at a time); inputs are derived from (seed, rank, index),
so the expected answer is computed independently with NumPy and every element is checked.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import pytest

from gpucoll.transports.base import Frame
from gpucoll.transports.inproc import InprocGroup, InprocTransport
from gpucoll.types import ReduceOp, wire_code

SIZES = list(range(1, 10))
COUNTS = [0, 1, 13, 10007]          # elements of the buffer (all_reduce, broadcast, reduce)
BLOCK_COUNTS = [0, 1, 13, 1031]     # elements per rank block (block collectives)
CHUNK_BYTES = 256                   # 10007 float64 -> hundreds of reducer chunks per message
STEP_TIMEOUT_S = 10.0               # deadline of one collective call
JOIN_TIMEOUT_S = 60.0               # a whole rank body
SEED = 20240611


# -- running ranks ------------------------------------------------------------------------------


class RankFailure(AssertionError):
    """A rank raised; the original exception is chained."""


def launch(size: int, body: Callable[[int, InprocTransport], object], *,
           ranks: Optional[List[int]] = None, group: Optional[InprocGroup] = None,
           kill_on_failure: bool = True) -> Tuple[Dict[int, object], List[Tuple[int, BaseException]]]:
    """Run ``body(rank, transport)`` in one thread per rank; return (results, errors).

    ``errors`` lists (rank, exception) in the order they were raised. With
    ``kill_on_failure`` a failing rank is killed in the group, so its peers stop with PeerError
    instead of waiting for their deadline (as a launcher kills all ranks on the first failure).
    """
    group = group if group is not None else InprocGroup(size, chunk_bytes=CHUNK_BYTES)
    ranks = list(range(size)) if ranks is None else ranks
    results: Dict[int, object] = {}
    errors: List[Tuple[int, BaseException]] = []
    lock = threading.Lock()

    def main(rank: int) -> None:
        try:
            results[rank] = body(rank, group.transport(rank))
        except BaseException as exc:  # noqa: B902 - reported to the test thread
            with lock:
                errors.append((rank, exc))
            if kill_on_failure:
                group.kill(rank)

    threads = [threading.Thread(target=main, args=(rank,), name=f"rank-{rank}", daemon=True)
               for rank in ranks]
    for thread in threads:
        thread.start()
    end = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    hung = [rank for rank, thread in zip(ranks, threads) if thread.is_alive()]
    if hung:
        for rank in range(size):
            group.kill(rank)
        pytest.fail(f"ranks {hung} of {size} still running after {JOIN_TIMEOUT_S} s; "
                    f"errors so far: {errors}")
    return results, errors


def run_ranks(size: int, body: Callable[[int, InprocTransport], object], **kwargs) -> list:
    """Run ``body`` on every rank; re-raise the first failure, naming its rank."""
    results, errors = launch(size, body, **kwargs)
    if errors:
        rank, exc = errors[0]
        raise RankFailure(f"rank {rank} of {size} raised {type(exc).__name__}: {exc}") from exc
    return [results[rank] for rank in range(size)]


def deadline() -> float:
    return time.monotonic() + STEP_TIMEOUT_S


def frame(op: str, seq: int, dtype) -> Frame:
    return Frame(op, seq, wire_code(dtype))


# -- inputs and references ----------------------------------------------------------------------


class Case(NamedTuple):
    op: ReduceOp
    dtype: str

    def __str__(self) -> str:
        return f"{self.op.value}/{self.dtype}"


_FLOATS = ["float32", "float64", "complex64"]
_INTS = ["int32", "uint8", "bool"]
REDUCE_CASES = (
    [Case(ReduceOp.SUM, dt) for dt in _INTS + _FLOATS]
    + [Case(ReduceOp.PROD, dt) for dt in _INTS + _FLOATS]
    + [Case(op, dt) for op in (ReduceOp.MIN, ReduceOp.MAX) for dt in _INTS + _FLOATS[:2]]
    + [Case(op, dt) for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) for dt in _INTS]
)
# A few cases every root of a rooted reduce runs; the full list is spread over the roots.
CORE_CASES = [Case(ReduceOp.SUM, "float64"), Case(ReduceOp.PROD, "int32"),
              Case(ReduceOp.BXOR, "uint8"), Case(ReduceOp.MIN, "float32")]
DTYPES = ["int32", "float32", "float64", "uint8", "bool", "complex64"]


def make_input(seed: int, rank: int, count: int, dtype: str,
               op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """Rank ``rank``'s input: element ``i`` is the ``i``-th draw of a generator seeded with
    (SEED, seed, rank), in a range where ``op`` over 9 ranks stays meaningful."""
    rng = np.random.default_rng((SEED, seed, rank))
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(count) < (0.85 if op in (ReduceOp.PROD, ReduceOp.MIN, ReduceOp.BAND)
                                    else 0.3)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        if op is ReduceOp.PROD and dt.kind == "i":
            low, high = -3, 4
        elif op is ReduceOp.SUM and dt.kind == "i":
            low, high = -1000, 1001
        else:
            low, high = int(info.min), int(info.max) + 1
        return rng.integers(low, high, size=count).astype(dt)
    if op is ReduceOp.PROD:
        magnitude = rng.uniform(0.5, 1.5, size=count)
        if dt.kind == "c":
            return (magnitude * np.exp(1j * rng.uniform(0, 2 * np.pi, size=count))).astype(dt)
        return (magnitude * rng.choice([-1.0, 1.0], size=count)).astype(dt)
    if dt.kind == "c":
        return (rng.uniform(-1, 1, size=count) + 1j * rng.uniform(-1, 1, size=count)).astype(dt)
    return rng.uniform(-1, 1, size=count).astype(dt)


def reference(case: Case, stack: np.ndarray) -> np.ndarray:
    """``op`` over axis 0 of ``stack`` (one row per rank), computed with NumPy alone."""
    dt = np.dtype(case.dtype)
    op = case.op
    if dt.kind == "b":
        ufunc = {ReduceOp.SUM: np.logical_or, ReduceOp.MAX: np.logical_or,
                 ReduceOp.BOR: np.logical_or, ReduceOp.PROD: np.logical_and,
                 ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and,
                 ReduceOp.BXOR: np.logical_xor}[op]
        return ufunc.reduce(stack, axis=0)
    if dt.kind in "fc" and op in (ReduceOp.SUM, ReduceOp.PROD):
        wide = stack.astype(np.complex128 if dt.kind == "c" else np.float64)
        result = wide.sum(axis=0) if op is ReduceOp.SUM else wide.prod(axis=0)
        return result.astype(dt)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
             ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
             ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}[op]
    return ufunc.reduce(stack, axis=0, dtype=dt)


def check(got: np.ndarray, expected: np.ndarray, case: Optional[Case], what: str) -> None:
    """Every element: exact for integers, bool, min/max and copies; a tolerance for float
    sums and products (their rounding depends on the order of the reduction)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, (
        f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}")
    if (case is not None and got.dtype.kind in "fc"
            and case.op in (ReduceOp.SUM, ReduceOp.PROD)):
        tol = 1e-12 if got.dtype in (np.float64, np.complex128) else 1e-5
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)


def sweep(counts: List[int]) -> List[Tuple[int, int]]:
    return [(size, count) for size in SIZES for count in counts]


def ids(params: List[Tuple[int, int]]) -> List[str]:
    return [f"n{size}-c{count}" for size, count in params]
