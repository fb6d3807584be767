"""The MPI backend's short paths and blocking mode (``gpucoll.backends.mpi_short`` and
``mpi_blocking``) under a real mpirun, against NumPy.

The conformance suite (test_collectives.py) already runs every collective through the short
paths on the ``mpi`` clusters; here: the in-place all-reduce in pieces for every dtype and op
(with tiny pieces, so that small odd sizes take many, and once with the real sizes), the short
paths (scan and exscan too) with ``GPUCOLL_MPI_BLOCKING=1``, and that the short paths fail exactly as the
general path does (timeout, abort while waiting, GPUCOLL_DEBUG's mismatch check). The blocking
mode's timeout with a stuck peer is in test_real_launchers.py (it ends the process).
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from clusters import MPICluster
from gpucoll.backends.mpi_blocking import EXIT_STATUS, BlockingWatchdog
from gpucoll.perf.reference import bfloat16
from reference import (ALL_DTYPES, OPS, assert_equal_result, identity_reference, make_input,
                       op_valid, prefix_reference, reduce_reference)

pytestmark = pytest.mark.timeout(240)

_DTYPES = ALL_DTYPES + (["bfloat16"] if bfloat16 is not None else [])


@pytest.fixture(scope="module", params=[("0", 3), ("1", 2)],
                ids=["nonblocking-world3", "blocking-world2"])
def cluster(request):
    blocking, world_size = request.param
    started = MPICluster("mpi", world_size, env={"GPUCOLL_MPI_BLOCKING": blocking})
    started.blocking = blocking == "1"
    yield started
    started.close()


def _dtype(name):
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def _expected(seed, size, shape, dtype, op):
    return reduce_reference(np.stack([make_input(seed, r, shape, dtype, op)
                                      for r in range(size)]), op)


def _counting(comm, name):
    """Count calls of ``comm.<name>`` (the path a call took); returns the counter list."""
    calls, real = [], getattr(comm, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    setattr(comm, name, counted)
    return calls


# ---------------------------------------------------------------- rank-side functions
def rank_pieces(comm, arrays, cases, piece_bytes, above):
    from gpucoll.backends import mpi_short

    saved = mpi_short.PIECE_BYTES, mpi_short.PIECES_ABOVE
    if piece_bytes is not None:
        mpi_short.PIECE_BYTES, mpi_short.PIECES_ABOVE = piece_bytes, above
    pieces = _counting(comm, "_all_reduce_pieces")
    out = {}
    try:
        for seed, count, dtype, op in cases:
            x = make_input(seed, comm.rank, (count,), _dtype(dtype), op)
            before = len(pieces)
            assert comm.all_reduce(x, op=op) is x
            assert len(pieces) == before + 1, (dtype, count)  # the call went in pieces
            out[seed] = x
    finally:
        mpi_short.PIECE_BYTES, mpi_short.PIECES_ABOVE = saved
        del comm._all_reduce_pieces
    return out


def rank_short_paths(comm, arrays, dtypes):
    taken = {name: _counting(comm, f"_host_{name}")
             for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "scan")}
    out = {}
    try:
        for i, dtype in enumerate(dtypes):
            dt = _dtype(dtype)
            for op in ("sum", "max", "avg"):
                if op_valid(op, dtype):
                    x = make_input(i, comm.rank, (3, 5), dt, op)
                    out[("all_reduce", dtype, op)] = comm.all_reduce(x, op=op, out=np.empty_like(x))
                    x = make_input(i, comm.rank, (comm.size, 7), dt, op)
                    out[("reduce_scatter", dtype, op)] = comm.reduce_scatter(x, op=op)
                if op != "avg" and op_valid(op, dtype):
                    x = make_input(i, comm.rank, (3, 5), dt, op)
                    out[("scan", dtype, op)] = comm.scan(x.copy(), op=op)
                    out[("exscan", dtype, op)] = comm.exscan(x, op=op, out=np.empty_like(x))
            out[("all_gather", dtype)] = comm.all_gather(make_input(i, comm.rank, (13,), dt))
            for root in range(comm.size):
                x = make_input(i + root, comm.rank, (1, 13), dt)
                out[("broadcast", dtype, root)] = comm.broadcast(
                    x if comm.rank == root else np.zeros_like(x), root=root).copy()
    finally:
        for name in taken:
            delattr(comm, f"_host_{name}")
    return out, {name: len(calls) for name, calls in taken.items()}


def rank_failures(comm, arrays):
    """Rank 0 times out on two sub-communicators (short path, general path), then has a
    short-path call aborted while it waits; the others join those calls afterwards, so that
    no request is left pending."""
    subs = [comm.split(0) for _ in range(3)]
    x = np.ones(4, np.float32)
    errors = []
    if comm.rank == 0:
        for sub in subs:
            sub.timeout = 0.5
        for call in (lambda: subs[0].all_reduce(x),
                     lambda: subs[1].all_reduce(x, async_op=True).wait()):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the test compares what was raised
                errors.append((type(exc).__name__, str(exc)))
        threading.Timer(0.3, subs[2].abort).start()
        for _ in range(2):  # aborted while waiting, then refused up front
            try:
                subs[2].all_reduce(x)
            except Exception as exc:  # noqa: BLE001
                errors.append((type(exc).__name__, str(exc)))
        comm.barrier()
    else:
        comm.barrier()
        for sub in subs:
            sub.all_reduce(x)
    comm.barrier()
    return errors


def rank_debug_mismatch(comm, arrays):
    sub = comm.split(0)
    sub._debug = True  # as GPUCOLL_DEBUG=1 would at init
    try:
        sub.all_reduce(np.ones(3 if sub.rank == 0 else 4))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


# ---------------------------------------------------------------- tests
def test_in_place_all_reduce_in_pieces_every_dtype_and_op(cluster):
    """Pieces of 24 bytes from 32 bytes up: 37 and 101 elements of every dtype go in many
    pieces, the last one short."""
    cases, seed = [], 5000
    for dtype in _DTYPES:
        for op in OPS:
            if op_valid(op, dtype):
                for count in (37, 101):
                    seed += 1
                    cases.append((seed, count, dtype, op))
    results = cluster.run(rank_pieces, cases, 24, 32)
    for seed, count, dtype, op in cases:
        expected = _expected(seed, cluster.world_size, (count,), _dtype(dtype), op)
        for rank, got in enumerate(results):
            assert_equal_result(got[seed], expected, f"rank {rank} {dtype} {op} {count}", op)


def test_in_place_all_reduce_in_pieces_real_sizes(cluster):
    from gpucoll.backends.mpi_short import PIECE_BYTES, PIECES_ABOVE

    count = PIECES_ABOVE // 4 + PIECE_BYTES // 8 + 3  # 2.5 pieces past the threshold, odd
    cases = [(6001, count, "float32", "sum"), (6002, PIECES_ABOVE // 8 + 1, "float64", "avg")]
    results = cluster.run(rank_pieces, cases, None, None)
    for seed, count, dtype, op in cases:
        expected = _expected(seed, cluster.world_size, (count,), _dtype(dtype), op)
        for rank, got in enumerate(results):
            assert_equal_result(got[seed], expected, f"rank {rank} {dtype} {count}", op)


def test_short_paths_match_numpy(cluster):
    dtypes = ["float32", "int64", "float16", "bool", "complex128"] + \
             (["bfloat16"] if bfloat16 is not None else [])
    results = cluster.run(rank_short_paths, dtypes)
    size = cluster.world_size
    for rank, (out, taken) in enumerate(results):
        assert taken["all_gather"] == len(dtypes) and taken["broadcast"] == len(dtypes) * size
        assert taken["all_reduce"] == taken["reduce_scatter"] == sum(
            op_valid(op, d) for d in dtypes for op in ("sum", "max", "avg"))
        # scan and exscan: the dtypes MPI reduces itself (float16, bfloat16: recursive doubling)
        assert taken["scan"] == 2 * sum(op_valid(op, d) for d in dtypes for op in ("sum", "max")
                                        if d not in ("float16", "bfloat16"))
        for key, got in out.items():
            name, dtype, dt = key[0], key[1], _dtype(key[1])
            i = dtypes.index(dtype)
            if name == "all_reduce":
                expected = _expected(i, size, (3, 5), dt, key[2])
            elif name == "reduce_scatter":
                expected = _expected(i, size, (size, 7), dt, key[2])[rank]
            elif name == "all_gather":
                expected = np.stack([make_input(i, r, (13,), dt) for r in range(size)])
            elif name in ("scan", "exscan"):
                stacked = np.stack([make_input(i, r, (3, 5), dt, key[2]) for r in range(size)])
                prefix = prefix_reference(stacked, key[2])
                if name == "scan":
                    expected = prefix[rank]
                else:
                    expected = prefix[rank - 1] if rank else identity_reference(key[2], dt, (3, 5))
            else:
                expected = make_input(i + key[2], key[2], (1, 13), dt)
            assert_equal_result(got, expected, f"rank {rank} {key}", key[2] if
                                name in ("all_reduce", "reduce_scatter", "scan", "exscan")
                                else "sum")


def test_short_path_fails_as_the_general_path_does(cluster):
    if cluster.blocking:
        pytest.skip("blocking mode: a timeout ends the process (test_real_launchers.py)")
    errors = cluster.run(rank_failures)[0]
    assert [kind for kind, _ in errors] == ["CommTimeoutError", "CommTimeoutError",
                                            "CommAbortedError", "CommAbortedError"], errors
    short, general = (re.sub(r"within [0-9.]+ s", "within T s", text) for _, text in errors[:2])
    assert short == general, errors
    assert short.startswith("rank 0: all_reduce #1 did not complete within T s: MPI was still "
                            f"waiting for the other {cluster.world_size - 1} rank(s)"), short
    assert float(re.search(r"within ([0-9.]+) s", errors[0][1]).group(1)) >= 0.5
    assert errors[2][1] == ("rank 0: all_reduce #1 failed because the communicator was aborted "
                            "(abort() called on rank 0)"), errors
    assert errors[3][1].startswith("rank 0: communicator was aborted (abort() called on rank 0)")


def test_debug_mode_keeps_the_signature_check(cluster):
    results = cluster.run(rank_debug_mismatch)
    for result in results:
        assert result is not None and result[0] == "CollectiveMismatchError", result
        assert "all_reduce #1(dtype=float64, shape=(3,), op=sum)" in result[1], result
        assert "all_reduce #1(dtype=float64, shape=(4,), op=sum)" in result[1], result


def test_blocking_watchdog_fires_at_the_deadline_only():
    fired = []
    watchdog = BlockingWatchdog(3, 4, 0.2, check_interval=0.05, expire=fired.append)
    try:
        watchdog.arm("broadcast", 7)
        time.sleep(0.05)
        watchdog.disarm()  # returned in time
        time.sleep(0.4)
        assert fired == []
        started = time.monotonic()
        watchdog.arm("all_reduce", 8)
        while not fired and time.monotonic() - started < 5:
            time.sleep(0.01)
        assert 0.2 <= time.monotonic() - started < 2
    finally:
        watchdog.close()
    assert fired == [
        f"gpucoll: CommTimeoutError: rank 3: all_reduce #8 did not complete within 0.2 s: MPI "
        f"was still waiting for the other 3 rank(s) (dead, stuck, or calling another "
        f"operation). GPUCOLL_MPI_BLOCKING=1 calls MPI's blocking collectives, which cannot be "
        f"interrupted, so this process exits with status {EXIT_STATUS}"]
