"""The CPU backend's eager ``isend``: a small message is written in the caller's thread when no
earlier operation holds the link, so its Work is done when ``isend`` returns (MPI's eager
protocol), and only what the socket does not take goes to a worker thread. Real processes
over real sockets; the messages checked against NumPy, in issue order.
"""

import time

import numpy as np
import pytest

from gpucoll.backends.cpu import EAGER_SEND_BYTES
from mp_harness import run_ranks

pytestmark = pytest.mark.timeout(120)

RECEIVER_NAP = 0.5  # the receiver reads only after this: a send done before wrote eagerly


def _message(index: int, nbytes: int) -> np.ndarray:
    return (np.arange(max(nbytes // 4, 1), dtype=np.int32) * 7 + index)


def rank_sizes(comm, sizes):
    """Rank 0 isends messages of ``sizes`` bytes (noting whether each Work was done on return
    and whether it was written eagerly); rank 1 receives them after a nap."""
    if comm.rank == 1:
        time.sleep(RECEIVER_NAP)
        got = []
        for index, nbytes in enumerate(sizes):
            out = np.empty_like(_message(index, nbytes))
            comm.recv(out, 0, tag=index)
            got.append(out)
        return got
    eager = []
    real = comm._transport.start_send

    def counting(peer, buf, frame):
        rest = real(peer, buf, frame)
        eager.append("all" if rest is None else "part")
        return rest

    comm._transport.start_send = counting
    works, done = [], []
    for index, nbytes in enumerate(sizes):
        works.append(comm.isend(_message(index, nbytes), 1, tag=index))
        done.append(works[-1].is_completed())
    for work in works:
        assert work.wait(timeout=30)
    return done, eager


def test_a_small_isend_is_done_on_return_and_a_large_one_goes_to_a_worker():
    sizes = [64, EAGER_SEND_BYTES, 32 << 20, 8]  # 32 MiB: more than the socket buffers hold
    (done, eager), got = run_ranks(rank_sizes, 2, sizes)
    for index, nbytes in enumerate(sizes):
        np.testing.assert_array_equal(got[index], _message(index, nbytes))
    # the first two are written while the receiver naps; the 32 MiB one goes to a worker whole,
    # and the last waits its turn behind it (issue order), so it is not eager either
    assert done[:2] == [True, True] and eager == ["all", "all"], (done, eager)
    assert done[2] is False


def test_what_the_socket_does_not_take_is_sent_by_a_worker_in_order():
    """With 4 KiB socket buffers a 60 KiB eager isend writes only part at once; the worker
    sends the rest, and the small isend issued after it waits its turn."""
    sizes = [60 << 10, 100, 60 << 10]
    (done, eager), got = run_ranks(rank_sizes, 2, sizes, env={"GPUCOLL_SOCKET_BUFFER": "4096"})
    for index, nbytes in enumerate(sizes):
        np.testing.assert_array_equal(got[index], _message(index, nbytes))
    assert eager == ["part"] and done == [False, False, False], (done, eager)


def rank_dead_peer(comm):
    """Rank 1 leaves at once; rank 0's eager isend then meets a closed socket."""
    if comm.rank == 1:
        comm.abort()
        return None
    errors = []
    deadline = time.monotonic() + 15
    # until rank 1's abort shows (it may take seconds on a loaded machine); the first writes
    # after it may still reach the socket buffer
    while not errors and time.monotonic() < deadline:
        time.sleep(0.05)
        work = comm.isend(np.ones(16, np.float32), 1)
        try:
            work.wait(timeout=10)
        except Exception as exc:  # the error comes from wait(), not from isend()
            errors.append(type(exc).__name__)
            break
    return errors


def test_a_lost_peer_is_reported_by_wait():
    errors, _ = run_ranks(rank_dead_peer, 2, env={"GPUCOLL_TIMEOUT": "5"})
    assert errors and errors[0] in ("PeerError", "CommAbortedError"), errors
