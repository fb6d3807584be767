"""Collective algorithms facing mismatched, dead or missing ranks raise the documented errors
(naming rank, peer, op and sequence number) promptly instead of hanging.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gpucoll.algorithms import get
from gpucoll.errors import (CollectiveMismatchError, CommAbortedError, CommTimeoutError,
                            GpucollError, PeerError)
from gpucoll.transports.base import Frame
from gpucoll.transports.inproc import InprocGroup, InprocTransport
from gpucoll.types import ReduceOp, combine_fn

from algorithm_harness import CHUNK_BYTES, STEP_TIMEOUT_S, deadline, frame, launch


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
