"""The socket transport on its own: mesh set-up with strangers at the door, framing checks,
pipelined reduction, timeouts and closed peers. Ranks are threads of this process."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from gpucoll import auth
from gpucoll.errors import CollectiveMismatchError, CommTimeoutError, PeerError
from gpucoll.rendezvous import PrefixStore, TCPStore, TCPStoreServer
from gpucoll.transports.base import Frame, Recv
from gpucoll.transports.select import plan_links
from gpucoll.transports.socket import SocketTransport

pytestmark = pytest.mark.timeout(60)
TOKEN = "transport-test-token"


def _mesh(size, mode="auto", chunk_bytes=256 << 10, before=None, timeout=10.0):
    """Connect ``size`` transports in threads. With ``before(store)``, rank 0 starts first and
    the others only once ``before`` returns (strangers get to knock while rank 0 listens)."""
    server = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    clients = [TCPStore("127.0.0.1", server.port, token=TOKEN, timeout=timeout)
               for _ in range(size + 1)]
    stores = [PrefixStore("mesh", client) for client in clients]
    transports, errors = [None] * size, [None] * size

    def connect(rank):
        try:
            transports[rank] = SocketTransport.connect(
                stores[rank], rank, size, comm_id="mesh", token=TOKEN, timeout=timeout,
                links=plan_links(mode, rank, ["this-host"] * size), chunk_bytes=chunk_bytes)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=connect, args=(r,), daemon=True) for r in range(size)]
    threads[0].start()
    if before is not None:
        before(stores[size])
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    for client in clients:
        client.close()
    server.close()
    return transports, errors


def _run(transports, fn):
    results, errors = [None] * len(transports), [None] * len(transports)

    def body(rank):
        try:
            results[rank] = fn(transports[rank])
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(transports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, errors


def _ring_step(t):
    n = t.size
    mine = np.arange(10, dtype=np.int64) + 100 * t.rank
    got = np.zeros(10, np.int64)
    t.sendrecv((t.rank + 1) % n, memoryview(mine).cast("B"), (t.rank - 1) % n,
               memoryview(got).cast("B"), Frame("all_reduce", 1, 7), time.monotonic() + 5)
    return got


@pytest.mark.parametrize("mode", ["auto", "tcp", "unix"])
def test_mesh_links_and_exchange(mode):
    transports, errors = _mesh(3, mode)
    assert errors == [None] * 3
    try:
        expected_kind = "tcp" if mode == "tcp" else "unix"
        for t in transports:
            assert set(t.kinds) == {0, 1, 2} - {t.rank}
            assert set(t.kinds.values()) == {expected_kind}
        results, errs = _run(transports, _ring_step)
        assert errs == [None] * 3
        for rank, got in enumerate(results):
            np.testing.assert_array_equal(got, np.arange(10) + 100 * ((rank - 1) % 3))
    finally:
        for t in transports:
            t.close()


def _strangers(store):
    """Knock on rank 0's listeners with garbage, silence and a wrong token."""
    import json

    info = json.loads(store.get("addr/0", 10))
    targets = [(socket.AF_INET, tuple(info["tcp"])), (socket.AF_UNIX, "\0" + info["unix"])]
    for family, address in targets:
        garbage = socket.socket(family, socket.SOCK_STREAM)
        garbage.connect(address)
        garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
        wrong = socket.socket(family, socket.SOCK_STREAM)
        wrong.connect(address)
        with pytest.raises(Exception):
            auth.client_handshake(wrong, "wrong-token", auth.KIND_TRANSPORT,
                                  time.monotonic() + 5, "rank 0")
        garbage.close()
        wrong.close()


def test_strangers_are_refused_and_the_mesh_still_forms():
    transports, errors = _mesh(3, "auto", before=_strangers)
    assert errors == [None] * 3
    try:
        results, errs = _run(transports, _ring_step)
        assert errs == [None] * 3
        np.testing.assert_array_equal(results[0], np.arange(10) + 200)
    finally:
        for t in transports:
            t.close()


def test_a_silent_stranger_delays_nobody():
    """A connection that never says a word (a port scanner, a stuck client) must not hold up
    the peers behind it: handshakes run side by side, each bounded on its own."""
    import json

    silent = []

    def knock_and_stay_silent(store):
        info = json.loads(store.get("addr/0", 10))
        for family, address in ((socket.AF_INET, tuple(info["tcp"])),
                                (socket.AF_UNIX, "\0" + info["unix"])):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.connect(address)
            silent.append(sock)

    start = time.monotonic()
    transports, errors = _mesh(3, "auto", before=knock_and_stay_silent)
    took = time.monotonic() - start
    try:
        assert errors == [None] * 3
        assert took < auth.HANDSHAKE_TIMEOUT / 2, f"the mesh waited {took:.1f} s behind a stranger"
        results, errs = _run(transports, _ring_step)
        assert errs == [None] * 3
    finally:
        for sock in silent:
            sock.close()
        for t in transports:
            if t is not None:
                t.close()


def test_pipelined_reduce_in_small_chunks():
    transports, errors = _mesh(2, chunk_bytes=1003)  # cut at 1003 - 1003 % 8 = 1000 bytes
    assert errors == [None, None]
    count = 100_003
    calls = []

    def body(t):
        send = np.arange(count, dtype=np.float64) * (t.rank + 1)
        acc = np.ones(count, dtype=np.float64)
        target = memoryview(acc).cast("B")

        def reduce(offset, chunk):
            calls.append(len(chunk))
            piece = np.frombuffer(chunk, dtype=np.float64)
            acc[offset // 8: offset // 8 + len(piece)] += piece

        t.exchange([(1 - t.rank, memoryview(send).cast("B"))],
                   [Recv(1 - t.rank, target, reduce, 8)], Frame("all_reduce", 3, 11),
                   time.monotonic() + 10)
        return acc

    try:
        results, errs = _run(transports, body)
        assert errs == [None, None]
        np.testing.assert_array_equal(results[0], 1 + np.arange(count) * 2.0)
        np.testing.assert_array_equal(results[1], 1 + np.arange(count) * 1.0)
        assert all(size % 8 == 0 and size <= 1000 for size in calls), sorted(set(calls))
        assert max(calls) == 1000
        assert sum(calls) == 2 * count * 8
    finally:
        for t in transports:
            t.close()


def test_header_mismatch_timeout_and_closed_peer():
    transports, errors = _mesh(2)
    assert errors == [None, None]
    t0, t1 = transports
    try:
        # wrong seq: a CollectiveMismatchError naming both ops
        payload = np.zeros(4, np.float32)
        t1.send(0, memoryview(payload).cast("B"), Frame("broadcast", 9, 10), time.monotonic() + 5)
        with pytest.raises(CollectiveMismatchError, match=r"expected all_reduce #2 .* sent broadcast #9"):
            t0.recv(1, memoryview(payload).cast("B"), Frame("all_reduce", 2, 10), time.monotonic() + 5)
        # nobody sends: a timeout naming the op, seq and peer, on time
        start = time.monotonic()
        with pytest.raises(CommTimeoutError, match=r"rank 1: barrier #4 timed out waiting for peer\(s\) \[0\]") as info:
            t1.recv(0, memoryview(bytearray(0)), Frame("barrier", 4), time.monotonic() + 0.3)
        assert 0.25 < time.monotonic() - start < 2
        assert (info.value.peer, info.value.op, info.value.seq) == (0, "barrier", 4)
        # the peer goes away: PeerError, not a hang
        t0.close()
        with pytest.raises(PeerError, match="peer 0"):
            t1.recv(0, memoryview(bytearray(8)), Frame("all_reduce", 5), time.monotonic() + 5)
    finally:
        t0.close()
        t1.close()


def test_a_close_between_two_polls_ends_the_wait_at_once(monkeypatch):
    """abort() on another thread may close the sockets while a wait is between two polls:
    the next poll then reports the stale descriptor (POLLNVAL), which must end the wait as a
    closed transport, not spin until the deadline."""
    import select as real_select
    import types

    from gpucoll.transports import socket as socket_module

    transports, errors = _mesh(2)
    assert errors == [None, None]
    t0, t1 = transports

    class ClosingPoller:
        """The real poller, except that t1 is closed just before its first wait."""

        def __init__(self):
            self.inner, self.calls = real_select.poll(), 0

        def register(self, *args):
            self.inner.register(*args)

        def modify(self, *args):
            self.inner.modify(*args)

        def unregister(self, fd):
            self.inner.unregister(fd)

        def poll(self, timeout_ms):
            self.calls += 1
            if self.calls == 1:
                t1.close()
            return self.inner.poll(timeout_ms)

    fake = types.SimpleNamespace(**{name: getattr(real_select, name) for name in dir(real_select)
                                    if not name.startswith("_")})
    fake.poll = ClosingPoller
    monkeypatch.setattr(socket_module, "select", fake)
    try:
        start = time.monotonic()
        with pytest.raises(PeerError, match=r"rank 1: transport closed during all_reduce #3"):
            t1.recv(0, memoryview(bytearray(8)), Frame("all_reduce", 3), start + 3.0)
        assert time.monotonic() - start < 2.0   # not at the deadline
    finally:
        t0.close()
        t1.close()


def test_missing_rank_named_at_connect():
    server = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    store = TCPStore("127.0.0.1", server.port, token=TOKEN, timeout=5)
    try:
        with pytest.raises(CommTimeoutError, match=r"rank\(s\) \[1, 2\] of 3 did not join"):
            SocketTransport.connect(store, 0, 3, comm_id="x", token=TOKEN, timeout=0.5,
                                    links=plan_links("auto", 0, ["this-host"] * 3))
    finally:
        store.close()
        server.close()
