"""Reducing algorithms (all_reduce, reduce_scatter, reduce), one thread per rank.

World sizes 1-9, counts 0, 1, a prime and a multi-chunk size, every algorithm, every root, and
every (op, dtype) pair that makes sense, each element checked against a NumPy reference. Also:
inputs that must not change don't, and all-reduce results are bitwise identical on all ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpucoll.algorithms import ALGORITHMS, get
from gpucoll.transports.inproc import InprocTransport
from gpucoll.types import ReduceOp, combine_fn

from algorithm_harness import (BLOCK_COUNTS, CORE_CASES, COUNTS, REDUCE_CASES, SEED, Case, check,
                               deadline, frame, ids, make_input, reference, run_ranks, sweep)


# -- all_reduce ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALGORITHMS["all_reduce"]))
@pytest.mark.parametrize("size,count", sweep(COUNTS), ids=ids(sweep(COUNTS)))
def test_all_reduce(name: str, size: int, count: int) -> None:
    fn = get("all_reduce", name)
    inputs = [[make_input(index, rank, count, case.dtype, case.op) for rank in range(size)]
              for index, case in enumerate(REDUCE_CASES)]

    def body(rank: int, t: InprocTransport) -> list:
        results = []
        for seq, case in enumerate(REDUCE_CASES):
            buf = inputs[seq][rank].copy()
            fn(t, buf, combine_fn(case.op, buf.dtype), frame("all_reduce", seq, buf.dtype),
               deadline())
            results.append(buf)
        return results

    results = run_ranks(size, body)
    for index, case in enumerate(REDUCE_CASES):
        expected = reference(case, np.stack(inputs[index]))
        for rank in range(size):
            check(results[rank][index], expected, case, f"{name} {case} rank {rank}")
            assert results[rank][index].tobytes() == results[0][index].tobytes(), (
                f"{name} {case}: rank {rank} differs bitwise from rank 0")


@pytest.mark.parametrize("name", list(ALGORITHMS["all_reduce"]))
@pytest.mark.parametrize("size", [3, 5, 6, 8])
def test_all_reduce_bitwise_identical_with_rounding(name: str, size: int) -> None:
    """Values spanning many magnitudes make the float sum depend on the order of additions;
    every rank must still end with the same bits."""
    count = 997

    def data(rank: int, dtype: str, op: ReduceOp) -> np.ndarray:
        rng = np.random.default_rng((SEED, 99, rank))
        if op is ReduceOp.PROD:  # stays finite over 8 ranks, rounds at every step
            return (rng.uniform(0.5, 2.0, count) * rng.choice([-1.0, 1.0], count)).astype(dtype)
        return (rng.standard_normal(count) * 10.0 ** rng.integers(-8, 8, count)).astype(dtype)

    cases = [Case(ReduceOp.SUM, "float32"), Case(ReduceOp.SUM, "float64"),
             Case(ReduceOp.PROD, "float32"), Case(ReduceOp.SUM, "complex64"),
             Case(ReduceOp.PROD, "complex64")]

    def body(rank: int, t: InprocTransport) -> list:
        results = []
        for seq, case in enumerate(cases):
            buf = data(rank, case.dtype, case.op)
            if np.dtype(case.dtype).kind == "c":
                buf = (buf + 1j * data(rank + 100, "float32", case.op)).astype(case.dtype)
            get("all_reduce", name)(t, buf, combine_fn(case.op, buf.dtype),
                                    frame("all_reduce", seq, buf.dtype), deadline())
            results.append(buf.tobytes())
        return results

    results = run_ranks(size, body)
    for index, case in enumerate(cases):
        assert len({results[rank][index] for rank in range(size)}) == 1, f"{name} {case}"


# -- reduce_scatter -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALGORITHMS["reduce_scatter"]))
@pytest.mark.parametrize("size,m", sweep(BLOCK_COUNTS), ids=ids(sweep(BLOCK_COUNTS)))
def test_reduce_scatter(name: str, size: int, m: int) -> None:
    fn = get("reduce_scatter", name)
    inputs = [[make_input(index, rank, size * m, case.dtype, case.op) for rank in range(size)]
              for index, case in enumerate(REDUCE_CASES)]

    def body(rank: int, t: InprocTransport) -> list:
        results = []
        for seq, case in enumerate(REDUCE_CASES):
            send = inputs[seq][rank].copy()
            out = np.empty(m, dtype=case.dtype)
            fn(t, send, out, combine_fn(case.op, send.dtype),
               frame("reduce_scatter", seq, send.dtype), deadline())
            assert send.tobytes() == inputs[seq][rank].tobytes(), f"{case}: send was modified"
            results.append(out)
        return results

    results = run_ranks(size, body)
    for index, case in enumerate(REDUCE_CASES):
        full = reference(case, np.stack(inputs[index]))
        for rank in range(size):
            check(results[rank][index], full[rank * m:(rank + 1) * m], case,
                  f"{name} {case} rank {rank}")


# -- reduce -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALGORITHMS["reduce"]))
@pytest.mark.parametrize("size,count", sweep(COUNTS), ids=ids(sweep(COUNTS)))
def test_reduce(name: str, size: int, count: int) -> None:
    """Every root runs the core cases; the full case list is spread over the roots. The root's
    ``out`` alternates between a separate array and ``send`` itself."""
    fn = get("reduce", name)
    runs = [(root, case) for root in range(size) for case in CORE_CASES]
    runs += [(index % size, case) for index, case in enumerate(REDUCE_CASES)]
    inputs = [[make_input(seq, rank, count, case.dtype, case.op) for rank in range(size)]
              for seq, (_, case) in enumerate(runs)]

    def body(rank: int, t: InprocTransport) -> list:
        results = []
        for seq, (root, case) in enumerate(runs):
            send = inputs[seq][rank].copy()
            in_place = rank == root and seq % 2 == 0
            out = None if rank != root else (send if in_place else np.empty(count, case.dtype))
            fn(t, send, out, root, combine_fn(case.op, send.dtype),
               frame("reduce", seq, send.dtype), deadline())
            if not in_place:
                assert send.tobytes() == inputs[seq][rank].tobytes(), f"{case}: send modified"
            results.append(out)
        return results

    results = run_ranks(size, body)
    for seq, (root, case) in enumerate(runs):
        expected = reference(case, np.stack(inputs[seq]))
        check(results[root][seq], expected, case, f"{name} root {root} {case}")
