"""Bounded failure with an unreachable store: a rank that hits a timeout or a dead peer raises
within the communicator's timeout + 2 s, even when the store (where it publishes why it
aborted, and reads why a peer did) no longer answers, as when the store's host is cut off.

The store here is a real in-memory store behind a switch: once stalled, every call blocks
(for far longer than the bound) as a TCP store behind a cut link would.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import numpy as np
import pytest

from gpucoll import CommAbortedError, CommTimeoutError, GpucollError, PeerError
from gpucoll.backends.cpu import CPUCommunicator
from gpucoll.rendezvous.best_effort import best_effort
from gpucoll.rendezvous.memory_store import MemoryStore
from gpucoll.rendezvous.store import Store

from nccl_emulated_harness import _wait_until, emu, run  # noqa: F401

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 1.5        # the communicators' timeout
SLACK = 2.0          # what the bound allows past it
STALL = 30.0         # how long a stalled store call blocks (released at teardown)


class StallableStore(Store):
    """A store (a MemoryStore unless given) whose every call blocks once :meth:`stall` was
    called."""

    def __init__(self, inner: Optional[Store] = None) -> None:
        self.inner = inner if inner is not None else MemoryStore(timeout=10.0)
        self.timeout = self.inner.timeout
        self.stalled = False
        self.released = threading.Event()
        self.blocked_calls = 0

    def stall(self) -> None:
        self.stalled = True

    def _gate(self) -> None:
        if self.stalled:
            self.blocked_calls += 1
            self.released.wait(STALL)
            raise ConnectionError("store unreachable")

    def set(self, key: str, value: bytes) -> None:
        self._gate()
        self.inner.set(key, value)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        self._gate()
        return self.inner.get(key, timeout)

    def add(self, key: str, amount: int) -> int:
        self._gate()
        return self.inner.add(key, amount)

    def check(self, keys: Sequence[str]) -> bool:
        self._gate()
        return self.inner.check(keys)

    def delete(self, key: str) -> bool:
        self._gate()
        return self.inner.delete(key)

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        self._gate()
        self.inner.wait(keys, timeout)


@pytest.fixture
def pair():
    """Two CPU communicators (threads of this process, TCP on loopback) over one store."""
    store = StallableStore()
    comms = [None, None]

    def make(rank: int) -> None:
        comms[rank] = CPUCommunicator(store, rank, 2, comm_id="bounded", token="t",
                                      timeout=TIMEOUT, transport="tcp")

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert all(c is not None for c in comms), "the communicators were not created"
    yield store, comms
    store.released.set()
    for comm in comms:
        comm.abort()


def _time_to_error(fn):
    started = time.monotonic()
    with pytest.raises(GpucollError) as info:
        fn()
    return time.monotonic() - started, info.value


def test_timeout_with_the_store_unreachable_is_still_bounded(pair):
    store, (rank0, rank1) = pair
    x = np.arange(1 << 16, dtype=np.float32)
    store.stall()  # rank 1 is alive but never joins; the store no longer answers
    elapsed, error = _time_to_error(lambda: rank0.all_reduce(x))
    assert isinstance(error, CommTimeoutError), repr(error)
    assert "all_reduce #1" in str(error)
    assert store.blocked_calls >= 1  # the abort was published (tried) through the stalled store
    assert elapsed < TIMEOUT + SLACK, f"raised {elapsed:.1f} s after the call"
    with pytest.raises(CommAbortedError):
        rank0.all_reduce(x)


def test_dead_peer_with_the_store_unreachable_is_named_at_once(pair):
    store, (rank0, rank1) = pair
    x = np.ones(1000, dtype=np.float64)
    store.stall()
    outcome = {}

    def survivor() -> None:
        outcome["elapsed"], outcome["error"] = _time_to_error(lambda: rank0.all_reduce(x))

    thread = threading.Thread(target=survivor, daemon=True)
    thread.start()
    time.sleep(0.2)
    rank1.abort()  # the peer goes away mid-collective; its abort cannot reach the store either
    thread.join(TIMEOUT + SLACK + 5)
    assert not thread.is_alive(), "rank 0 still blocked"
    assert isinstance(outcome["error"], (PeerError, CommAbortedError)), repr(outcome["error"])
    assert "peer 1" in str(outcome["error"]) or "rank 1" in str(outcome["error"])
    assert outcome["elapsed"] < TIMEOUT + SLACK


def test_best_effort_gives_up_after_its_budget_and_passes_values_through():
    release = threading.Event()
    started = time.monotonic()
    assert best_effort(lambda: release.wait(30), 0.2) == (False, None)
    assert time.monotonic() - started < 5
    release.set()
    assert best_effort(lambda: 42, 5.0) == (True, 42)
    assert best_effort(lambda: 1 / 0, 5.0) == (False, None)


def test_nccl_watchdog_timeout_with_the_store_unreachable_is_still_bounded(run, emu):
    """The watchdog publishes progress, reads who arrived and publishes the abort through
    the store; none of it may hold the abort back when the store stops answering."""
    cp = emu.cupy
    finished = threading.Event()
    limit = 1.0

    def fn(comm):
        x = cp.ones(16, dtype=cp.float32)
        comm.all_reduce(x)  # #1 on both ranks
        comm.synchronize(timeout=5)
        if comm.rank == 1:
            assert finished.wait(20)  # never issues #2
            return None
        stalled = StallableStore(comm._store.store)  # this rank's view of the store
        comm._store.store = stalled
        try:
            stalled.stall()
            stream = cp.cuda.Stream(non_blocking=True)
            emu.stall(stream)  # #2 cannot complete: rank 1 never issues it
            started = time.monotonic()
            comm.all_reduce(x, stream=stream)
            assert _wait_until(lambda: comm.nccl_comm._status == "aborted", limit + 10)
            elapsed = time.monotonic() - started
            with pytest.raises(CommTimeoutError) as info:
                comm.all_reduce(x)
            return elapsed, str(info.value), stalled.blocked_calls
        finally:
            finished.set()
            stalled.released.set()

    (elapsed, message, blocked), _ = run(2, fn, timeout=limit)
    assert "all_reduce #2 did not complete" in message, message
    assert "the store could not say which ranks arrived" in message, message
    assert blocked >= 1
    assert elapsed < limit + SLACK, f"aborted {elapsed:.1f} s after the call"


class _LostDuringWait(StallableStore):
    """A store lost while a rank waited: the wait times out, then every call stalls."""

    def wait(self, keys, timeout=None):
        self.stall()
        raise CommTimeoutError("store: no reply to wait (the store server looks hung)")


def test_rendezvous_timeout_with_the_store_lost_is_named_and_bounded():
    from gpucoll.rendezvous.hosts import exchange_host_ids

    store = _LostDuringWait()
    try:
        started = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            exchange_host_ids(store, 0, 3, TIMEOUT)
        assert time.monotonic() - started < SLACK
        assert "the store could not say which" in str(info.value), str(info.value)
        assert "of 3 did not join" in str(info.value)
    finally:
        store.released.set()
    # a store that answers names the ranks that are missing
    healthy = MemoryStore(timeout=10.0)
    healthy.set("host/1", b"h1")
    with pytest.raises(CommTimeoutError, match=r"rank\(s\) \[2\] of 3 did not join"):
        exchange_host_ids(healthy, 0, 3, 0.2)


def test_a_store_that_stops_answering_costs_at_most_the_timeout_and_the_reply_margin():
    """A store whose host was lost mid-request (the connection is up, no reply ever comes):
    the client gives up after the request's timeout + a short margin, well inside the bound."""
    import socket

    from gpucoll import auth
    from gpucoll.rendezvous.tcp_store import TCPStore

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    done = threading.Event()

    def silent_server() -> None:  # authenticates, reads the requests, never answers
        conn, _ = listener.accept()
        with conn:
            auth.server_handshake(conn, "t", auth.KIND_STORE, 5.0)
            conn.settimeout(0.2)
            while not done.is_set():
                try:
                    if not conn.recv(4096):
                        return
                except socket.timeout:
                    pass
                except OSError:
                    return

    server = threading.Thread(target=silent_server, daemon=True)
    server.start()
    store = TCPStore("127.0.0.1", listener.getsockname()[1], token="t", timeout=TIMEOUT)
    try:
        elapsed, error = _time_to_error(lambda: store.wait(["never"], TIMEOUT))
        assert isinstance(error, CommTimeoutError) and "no reply to wait" in str(error), error
        assert TIMEOUT <= elapsed < TIMEOUT + SLACK, f"gave up {elapsed:.1f} s after the call"
        elapsed, error = _time_to_error(lambda: store.set("k", b"v"))  # the client is now broken:
        assert elapsed < 1.0 and "was lost earlier" in str(error), error  # fails at once
    finally:
        done.set()
        store.close()
        listener.close()
        server.join(5)


def test_close_with_a_silent_peer_raises_within_its_timeout(pair):
    """A peer cut off while this rank closes: close() is a collective and reports the timeout
    (it used to return quietly, so the fault surfaced only a timeout later, at the next op)."""
    store, (rank0, rank1) = pair
    elapsed, error = _time_to_error(lambda: rank0.close(timeout=TIMEOUT))  # rank 1 never closes
    assert isinstance(error, CommTimeoutError), repr(error)
    assert "peer(s) [1]" in str(error) and error.op == "close", str(error)
    assert TIMEOUT <= elapsed + 0.05 < TIMEOUT + SLACK, elapsed
    assert rank0.closed


def test_close_with_a_peer_that_exited_is_quiet(pair):
    store, (rank0, rank1) = pair
    rank1.abort()  # as an exited peer: its connections are closed
    rank0.close(timeout=TIMEOUT)
    assert rank0.closed
