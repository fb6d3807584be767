"""Algorithms that move data without reducing it (all_gather, broadcast, gather, scatter,
all_to_all) and the barrier, one thread per rank.

World sizes 1-9, counts 0, 1, a prime and a multi-chunk size, every algorithm, every root, in
place and out of place; every element is checked against the inputs, which must not change.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gpucoll.algorithms import ALGORITHMS, get
from gpucoll.transports.base import Frame
from gpucoll.transports.inproc import InprocTransport

from algorithm_harness import (BLOCK_COUNTS, COUNTS, DTYPES, SIZES, check, deadline, frame, ids,
                               make_input, run_ranks, sweep)


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
