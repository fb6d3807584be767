"""Every collective algorithm, run by one thread per rank over the in-process transport.

World sizes 1-9, counts 0, 1, a prime and a multi-chunk size (the transport hands reducers
``CHUNK_BYTES`` at a time), every algorithm of every collective, every root, and every
(op, dtype) pair that makes sense. Inputs are derived from (seed, rank, index), so the expected
answer is computed independently with NumPy and every element is checked. Also: inputs that
must not change don't, all-reduce results are bitwise identical on all ranks, and mismatched,
dead or missing ranks raise the documented errors.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import pytest

from gpucoll import algorithms
from gpucoll.algorithms import ALGORITHMS, get, parse_override, select
from gpucoll.algorithms.direct import segment_bounds
from gpucoll.errors import (CollectiveMismatchError, CommAbortedError, CommTimeoutError,
                            GpucollError, PeerError)
from gpucoll.transports.base import Frame, Recv
from gpucoll.transports.inproc import InprocGroup, InprocTransport
from gpucoll.types import ReduceOp, combine_fn, wire_code

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


# -- all_gather ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALGORITHMS["all_gather"]))
@pytest.mark.parametrize("size,m", sweep(BLOCK_COUNTS), ids=ids(sweep(BLOCK_COUNTS)))
def test_all_gather(name: str, size: int, m: int) -> None:
    fn = get("all_gather", name)
    inputs = {dtype: [make_input(index, rank, m, dtype) for rank in range(size)]
              for index, dtype in enumerate(DTYPES)}

    def body(rank: int, t: InprocTransport) -> list:
        results = []
        seq = 0
        for dtype in DTYPES:
            for in_place in (False, True):
                out = np.zeros(size * m, dtype=dtype)
                if in_place:
                    send = out[rank * m:(rank + 1) * m]
                    send[:] = inputs[dtype][rank]
                else:
                    send = inputs[dtype][rank].copy()
                fn(t, send, out, frame("all_gather", seq, dtype), deadline())
                if not in_place:
                    assert send.tobytes() == inputs[dtype][rank].tobytes(), "send was modified"
                results.append(out)
                seq += 1
        return results

    results = run_ranks(size, body)
    for index, dtype in enumerate(np.repeat(DTYPES, 2)):
        expected = np.concatenate(inputs[dtype])
        for rank in range(size):
            check(results[rank][index], expected, None, f"{name} {dtype} rank {rank}")


# -- broadcast ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALGORITHMS["broadcast"]))
@pytest.mark.parametrize("size,count", sweep(COUNTS), ids=ids(sweep(COUNTS)))
def test_broadcast(name: str, size: int, count: int) -> None:
    fn = get("broadcast", name)
    dtypes = DTYPES if count < 1000 else DTYPES[:3]
    runs = [(root, dtype) for root in range(size) for dtype in dtypes]

    def body(rank: int, t: InprocTransport) -> list:
        results = []
        for seq, (root, dtype) in enumerate(runs):
            buf = make_input(seq, root, count, dtype)
            if rank != root:
                buf = np.zeros(count, dtype=dtype)
            fn(t, buf, root, frame("broadcast", seq, dtype), deadline())
            results.append(buf)
        return results

    results = run_ranks(size, body)
    for seq, (root, dtype) in enumerate(runs):
        expected = make_input(seq, root, count, dtype)
        for rank in range(size):
            check(results[rank][seq], expected, None, f"{name} root {root} {dtype} rank {rank}")


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


# -- gather, scatter, all_to_all ----------------------------------------------------------------


@pytest.mark.parametrize("size,m", sweep(BLOCK_COUNTS), ids=ids(sweep(BLOCK_COUNTS)))
def test_gather_and_scatter(size: int, m: int) -> None:
    gather, scatter = get("gather", "direct"), get("scatter", "direct")
    dtypes = DTYPES if m < 1000 else DTYPES[:2]
    runs = [(root, dtype) for root in range(size) for dtype in dtypes]

    def body(rank: int, t: InprocTransport) -> list:
        results = []
        for seq, (root, dtype) in enumerate(runs):
            send = make_input(seq, rank, m, dtype)
            out = np.zeros(size * m, dtype) if rank == root else None
            gather(t, send, out, root, frame("gather", 2 * seq, dtype), deadline())
            assert send.tobytes() == make_input(seq, rank, m, dtype).tobytes()
            full = make_input(seq, root, size * m, dtype) if rank == root else None
            piece = np.zeros(m, dtype)
            scatter(t, full, piece, root, frame("scatter", 2 * seq + 1, dtype), deadline())
            if full is not None:
                assert full.tobytes() == make_input(seq, root, size * m, dtype).tobytes()
            results.append((out, piece))
        return results

    results = run_ranks(size, body)
    for seq, (root, dtype) in enumerate(runs):
        gathered = np.concatenate([make_input(seq, rank, m, dtype) for rank in range(size)])
        check(results[root][seq][0], gathered, None, f"gather root {root} {dtype}")
        scattered = make_input(seq, root, size * m, dtype)
        for rank in range(size):
            check(results[rank][seq][1], scattered[rank * m:(rank + 1) * m], None,
                  f"scatter root {root} {dtype} rank {rank}")


@pytest.mark.parametrize("size,m", sweep(BLOCK_COUNTS), ids=ids(sweep(BLOCK_COUNTS)))
def test_all_to_all(size: int, m: int) -> None:
    fn = get("all_to_all", "direct")

    def body(rank: int, t: InprocTransport) -> list:
        results = []
        for seq, dtype in enumerate(DTYPES):
            send = make_input(seq, rank, size * m, dtype)
            out = np.zeros(size * m, dtype)
            fn(t, send, out, frame("all_to_all", seq, dtype), deadline())
            assert send.tobytes() == make_input(seq, rank, size * m, dtype).tobytes()
            results.append(out)
        return results

    results = run_ranks(size, body)
    for seq, dtype in enumerate(DTYPES):
        sends = [make_input(seq, rank, size * m, dtype) for rank in range(size)]
        for rank in range(size):
            expected = np.concatenate([sends[peer][rank * m:(rank + 1) * m]
                                       for peer in range(size)])
            check(results[rank][seq], expected, None, f"all_to_all {dtype} rank {rank}")


# -- barrier ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_barrier_holds_everyone_until_all_arrive(size: int) -> None:
    rounds = 3
    arrived = [[threading.Event() for _ in range(size)] for _ in range(rounds)]

    def body(rank: int, t: InprocTransport) -> list:
        missing = []
        for seq in range(rounds):
            time.sleep(0.002 * ((rank * 7 + seq) % size))  # ranks arrive in varying order
            arrived[seq][rank].set()
            get("barrier", "dissemination")(t, Frame("barrier", seq), deadline())
            missing.append([peer for peer in range(size) if not arrived[seq][peer].is_set()])
        return missing

    for missing in run_ranks(size, body):
        assert missing == [[]] * rounds


# -- failures -----------------------------------------------------------------------------------


def _all_reduce_call(name: str, count: int, dtype: str = "float64", seq: int = 0,
                     op: str = "all_reduce"):
    def call(rank: int, t: InprocTransport) -> None:
        buf = np.ones(count, dtype)
        get("all_reduce", name)(t, buf, combine_fn(ReduceOp.SUM, dtype),
                                frame(op, seq, dtype), time.monotonic() + 2.0)
    return call


def _broadcast_call(rank: int, t: InprocTransport) -> None:
    get("broadcast", "binomial")(t, np.ones(13), 0, frame("broadcast", 0, "float64"),
                                 time.monotonic() + 2.0)


MISMATCHES = {
    # what rank 1 does differently from the others (ring all_reduce of 13 float64, seq 0)
    "other_collective": (2, _broadcast_call),
    "other_count": (3, _all_reduce_call("ring", 14)),
    "other_dtype": (2, _all_reduce_call("ring", 13, dtype="float32")),
    "other_seq": (2, _all_reduce_call("ring", 13, seq=1)),
    "other_algorithm": (4, _all_reduce_call("recursive_doubling", 13)),
    "other_op_name": (2, _all_reduce_call("ring", 13, op="reduce_scatter")),
}


@pytest.mark.parametrize("scenario", list(MISMATCHES))
def test_mismatched_rank_raises_collective_mismatch(scenario: str) -> None:
    size, odd_one = MISMATCHES[scenario]
    normal = _all_reduce_call("ring", 13)

    def body(rank: int, t: InprocTransport) -> None:
        (odd_one if rank == 1 else normal)(rank, t)

    started = time.monotonic()
    results, errors = launch(size, body)
    assert not results, f"ranks {sorted(results)} finished despite the mismatch"
    assert {rank for rank, _ in errors} == set(range(size))
    mismatches = [exc for _, exc in errors if isinstance(exc, CollectiveMismatchError)]
    assert mismatches, f"no CollectiveMismatchError among {errors}"
    first = mismatches[0]
    assert first.rank is not None and first.peer is not None and first.op and first.seq is not None
    assert f"rank {first.rank}" in str(first) and f"peer {first.peer}" in str(first)
    assert all(isinstance(exc, GpucollError) for _, exc in errors)
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("collective,name", [("all_reduce", "ring"),
                                             ("all_reduce", "recursive_doubling"),
                                             ("barrier", "dissemination")])
def test_killed_rank_gives_peer_error(collective: str, name: str) -> None:
    """Rank 2 of 3 dies while the others wait for it: they get PeerError (naming rank 2, or
    the survivor that already failed because of it)."""
    group = InprocGroup(3, chunk_bytes=CHUNK_BYTES)
    fn = get(collective, name)

    def body(rank: int, t: InprocTransport) -> None:
        if collective == "barrier":
            fn(t, Frame("barrier", 5), deadline())
        else:
            buf = np.ones(13)
            fn(t, buf, combine_fn(ReduceOp.SUM, buf.dtype), frame(collective, 5, buf.dtype),
               deadline())

    killer = threading.Timer(0.1, group.kill, args=(2,))
    killer.start()
    started = time.monotonic()
    # A survivor that fails is killed too (as a launcher would), so the other one is not left
    # waiting for its deadline.
    results, errors = launch(3, body, ranks=[0, 1], group=group)
    killer.join()
    assert time.monotonic() - started < STEP_TIMEOUT_S / 2
    assert not results
    by_rank = dict(errors)
    assert set(by_rank) == {0, 1}
    for rank, exc in by_rank.items():
        assert isinstance(exc, PeerError), exc
        assert exc.rank == rank and exc.op == collective and exc.seq == 5, exc
        assert f"peer {exc.peer}" in str(exc)
    assert any(exc.peer == 2 for exc in by_rank.values()), errors
    with pytest.raises(CommAbortedError):
        group.transport(2).recv(0, memoryview(bytearray(0)), Frame("barrier", 5), deadline())


@pytest.mark.parametrize("collective,name", [("all_reduce", "ring"), ("broadcast", "binomial"),
                                             ("barrier", "dissemination")])
def test_missing_rank_times_out(collective: str, name: str) -> None:
    fn = get(collective, name)
    timeout = 0.3

    def body(rank: int, t: InprocTransport) -> None:
        end = time.monotonic() + timeout
        if collective == "barrier":
            fn(t, Frame("barrier", 7), end)
        elif collective == "broadcast":
            fn(t, np.ones(4), 3, frame(collective, 7, "float64"), end)
        else:
            buf = np.ones(4)
            fn(t, buf, combine_fn(ReduceOp.SUM, buf.dtype), frame(collective, 7, "float64"), end)

    started = time.monotonic()
    results, errors = launch(4, body, ranks=[0, 1, 2], kill_on_failure=False)
    elapsed = time.monotonic() - started
    assert elapsed < timeout + 2.0, elapsed
    assert errors, f"no rank noticed that rank 3 is missing; results {results}"
    for rank, exc in errors:
        assert isinstance(exc, CommTimeoutError), exc
        assert exc.rank == rank and exc.op == collective and exc.seq == 7
        assert f"rank {rank}" in str(exc) and f"peer {exc.peer}" in str(exc)
    assert any(exc.peer == 3 for _, exc in errors)


# -- the in-process transport itself ------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes,itemsize", [(10, 4), (3, 4), (256, 8), (1, 1), (64, 16)])
def test_inproc_reducer_chunks_are_whole_elements(chunk_bytes: int, itemsize: int) -> None:
    group = InprocGroup(2, chunk_bytes=chunk_bytes)
    payload = bytes(range(256)) * 3
    nbytes = len(payload) // itemsize * itemsize
    chunks: List[Tuple[int, bytes]] = []
    f = Frame("send", 0)
    group.transport(0).send(1, memoryview(payload[:nbytes]), f, deadline())
    group.transport(1).recv(0, memoryview(bytearray(nbytes)), f, deadline(),
                            reduce=lambda offset, chunk: chunks.append((offset, bytes(chunk))),
                            itemsize=itemsize)
    step = max(itemsize, chunk_bytes // itemsize * itemsize)
    assert [offset for offset, _ in chunks] == list(range(0, nbytes, step))
    assert all(len(chunk) % itemsize == 0 and 0 < len(chunk) <= step for _, chunk in chunks)
    assert b"".join(chunk for _, chunk in chunks) == payload[:nbytes]


def test_inproc_header_checks_and_fifo_order() -> None:
    group = InprocGroup(2)
    a, b = group.transport(0), group.transport(1)
    a.send(1, memoryview(b"first"), Frame("send", 0, tag=1), deadline())
    a.send(1, memoryview(b"second"), Frame("send", 1, tag=1), deadline())
    target = bytearray(5)
    b.recv(0, memoryview(target), Frame("send", 0, tag=1), deadline())
    assert target == b"first"
    with pytest.raises(CollectiveMismatchError, match="6 bytes"):
        b.recv(0, memoryview(bytearray(5)), Frame("send", 1, tag=1), deadline())
    a.send(1, memoryview(b"x"), Frame("send", 2, tag=1), deadline())
    with pytest.raises(CollectiveMismatchError, match="tag"):
        b.recv(0, memoryview(bytearray(1)), Frame("send", 2, tag=2), deadline())
    with pytest.raises(ValueError, match="peer 2"):
        a.send(2, memoryview(b""), Frame("send", 3), deadline())
    with pytest.raises(ValueError, match="more than one"):
        a.exchange([], [Recv(1, memoryview(bytearray(0))), Recv(1, memoryview(bytearray(0)))],
                   Frame("send", 3), deadline())


def test_inproc_close_delivers_queued_messages_then_peer_error() -> None:
    group = InprocGroup(2)
    a, b = group.transport(0), group.transport(1)
    a.send(1, memoryview(b"bye"), Frame("send", 0), deadline())
    a.close()
    a.close()
    target = bytearray(3)
    b.recv(0, memoryview(target), Frame("send", 0), deadline())
    assert target == b"bye"
    with pytest.raises(PeerError, match="closed") as info:
        b.recv(0, memoryview(bytearray(3)), Frame("send", 1), deadline())
    assert (info.value.rank, info.value.peer) == (1, 0)
    with pytest.raises(CommAbortedError):
        a.send(1, memoryview(b""), Frame("send", 1), deadline())


def test_inproc_timeout_names_rank_peer_op_and_seq() -> None:
    t = InprocGroup(3).transport(1)
    started = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        t.recv(2, memoryview(bytearray(4)), Frame("gather", 42), time.monotonic() + 0.05)
    assert time.monotonic() - started < 1.0
    error = info.value
    assert (error.rank, error.peer, error.op, error.seq) == (1, 2, "gather", 42)
    assert "rank 1" in str(error) and "peer 2" in str(error) and "gather #42" in str(error)


# -- registry, selection, overrides -------------------------------------------------------------


def test_registry_names_and_docstrings() -> None:
    assert set(ALGORITHMS) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                               "reduce", "gather", "scatter", "all_to_all", "barrier"}
    for collective, table in ALGORITHMS.items():
        for name, fn in table.items():
            assert fn.__name__ == f"{name}_{collective}"
            assert get(collective, name) is fn
            assert "Steps" in fn.__doc__ and "Bytes" in fn.__doc__, fn.__name__


def test_get_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="all_reduce.*barrier"):
        get("allreduce", "ring")
    with pytest.raises(ValueError, match="ring, recursive_doubling, tree"):
        get("all_reduce", "bogus")


def test_select_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    threshold = 64 << 10  # per-rank share
    kw = dict(ring_threshold=threshold)
    assert select("all_reduce", 4 * threshold, 4, itemsize=4, **kw) == "ring"
    assert select("all_reduce", 4 * threshold - 1, 4, itemsize=4, **kw) == "recursive_doubling"
    assert select("all_reduce", 9 * 7, 9, itemsize=8, ring_threshold=7) == "recursive_doubling"
    assert select("all_reduce", 9 * 8, 9, itemsize=8, ring_threshold=8) == "ring"
    assert select("broadcast", 8 * 16 * threshold, 8, **kw) == "scatter_allgather"
    assert select("broadcast", 8 * 16 * threshold - 8, 8, **kw) == "binomial"
    assert select("broadcast", 1 << 30, 2, **kw) == "binomial"
    assert select("reduce", 8 * 64 * threshold, 8, **kw) == "ring"
    assert select("reduce", 8 * 64 * threshold - 8, 8, **kw) == "binomial"
    assert select("reduce", 1 << 30, 2, **kw) == "binomial"
    for collective in ("reduce_scatter", "all_gather"):
        assert select(collective, 1 << 30, 8, **kw) == "direct"
        assert select(collective, 9 * threshold, 9, **kw) == "ring"
        assert select(collective, 9 * threshold - 9, 9, **kw) == "direct"
    for collective in ("gather", "scatter", "all_to_all"):
        assert select(collective, 1 << 30, 8, **kw) == "direct"
    assert select("barrier", 0, 8, **kw) == "dissemination"
    # The default threshold comes from the configuration.
    monkeypatch.setenv("GPUCOLL_RING_THRESHOLD", "1KiB")
    assert select("all_reduce", 4096, 4) == "ring"
    assert select("all_reduce", 4095, 4) == "recursive_doubling"
    with pytest.raises(ValueError, match="unknown collective"):
        select("allgather", 10, 2)


def test_select_always_names_a_registered_algorithm() -> None:
    for collective, table in ALGORITHMS.items():
        for world_size in SIZES:
            for nbytes in (0, 1, 1000, 1 << 16, 1 << 24):
                assert select(collective, nbytes, world_size) in table


def test_select_override() -> None:
    override = parse_override("all_reduce=tree")
    assert select("all_reduce", 1 << 30, 8, override, itemsize=4) == "tree"
    assert select("broadcast", 1 << 30, 8, override, ring_threshold=1) == "scatter_allgather"
    with pytest.raises(ValueError, match="ring, recursive_doubling, tree"):
        select("all_reduce", 10, 2, {"all_reduce": "butterfly"})


def test_parse_override() -> None:
    assert parse_override("all_reduce=ring,broadcast=binomial") == {
        "all_reduce": "ring", "broadcast": "binomial"}
    assert parse_override(" ALL_REDUCE = Recursive_Doubling , ") == {
        "all_reduce": "recursive_doubling"}
    for nothing in ("", "auto", "  AUTO ", None):
        assert parse_override(nothing) == {}
    with pytest.raises(ValueError, match="unknown collective 'allreduce'.*all_reduce"):
        parse_override("allreduce=ring")
    with pytest.raises(ValueError, match="unknown broadcast algorithm 'ring'.*binomial, "
                                         "scatter_allgather"):
        parse_override("all_reduce=ring,broadcast=ring")
    with pytest.raises(ValueError, match="collective=algorithm"):
        parse_override("all_reduce")
    with pytest.raises(ValueError, match="twice"):
        parse_override("all_reduce=ring,all_reduce=tree")


def test_segment_bounds_cover_the_buffer() -> None:
    for count in (0, 1, 13, 10007):
        for parts in SIZES:
            bounds = segment_bounds(count, parts)
            assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == count
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1))


def test_algorithm_modules_are_small() -> None:
    import inspect

    from gpucoll.algorithms import direct, recursive_doubling, ring, tree
    from gpucoll.transports import inproc
    for module in (algorithms, direct, recursive_doubling, ring, tree, inproc):
        assert len(inspect.getsource(module).splitlines()) < 600, module.__name__
