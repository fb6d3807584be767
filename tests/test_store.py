"""Rendezvous stores: TCPStore (with its server) and FileStore, same behaviour for both."""

from __future__ import annotations

import multiprocessing
import os
import socket
import struct
import threading
import time

import pytest

from gpucoll import auth
from gpucoll.errors import AuthenticationError, CommTimeoutError, StoreError
from gpucoll.rendezvous import (FileStore, PrefixStore, Store, TCPStore, TCPStoreServer,
                                connect_store)

TOKEN = "test-token"
KINDS = ["tcp", "file"]


# -- helpers -------------------------------------------------------------------------------

def open_store(spec, timeout=10.0) -> Store:
    """A client for ``spec``: ("tcp", host, port, token) or ("file", path)."""
    if spec[0] == "tcp":
        return TCPStore(spec[1], spec[2], token=spec[3], timeout=timeout)
    return FileStore(spec[1], timeout=timeout)


@pytest.fixture
def store_spec(request, tmp_path):
    """A store description that other clients and processes can open; yields (spec, server)."""
    if request.param == "tcp":
        server = TCPStoreServer("127.0.0.1", 0, TOKEN)
        try:
            yield ("tcp", "127.0.0.1", server.port, TOKEN), server
        finally:
            server.close()
    else:
        yield ("file", str(tmp_path / "store")), None


@pytest.fixture
def store(store_spec):
    client = open_store(store_spec[0])
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def server():
    srv = TCPStoreServer("127.0.0.1", 0, TOKEN, handshake_timeout=0.3)
    try:
        yield srv
    finally:
        srv.close()


def run_processes(target, args_per_process, join_timeout=30.0):
    """Run ``target(*args)`` in spawned processes; return their exit codes (all killed at the end)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=args, daemon=True) for args in args_per_process]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + join_timeout
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
        return [proc.exitcode for proc in procs]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def handshaken_socket(port: int, token: str = TOKEN) -> socket.socket:
    """A raw socket past the store handshake, to send hand-made requests."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    auth.client_handshake(sock, token, auth.KIND_STORE, time.monotonic() + 5, "test store")
    sock.settimeout(5)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closed this connection (EOF or reset) within the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def assert_store_works(port: int, key: str) -> None:
    """A fresh, good client can write and read on the server at ``port``."""
    with TCPStore("127.0.0.1", port, token=TOKEN, timeout=5) as client:
        client.set(key, key.encode() * 3)
        assert client.get(key, timeout=1) == key.encode() * 3
        assert client.add(f"{key}/n", 5) == 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- process bodies (module level, so the spawn context can import them) -------------------

def _barrier_rank(spec, rank, world_size):
    store = open_store(spec, timeout=20)
    time.sleep(0.15 * rank)  # arrive at different times
    store.set(f"arrived/{rank}", b"1")
    store.barrier("b0", world_size, timeout=20)
    everyone = store.check([f"arrived/{r}" for r in range(world_size)])
    store.set(f"ok/{rank}", b"1" if everyone else b"0")
    store.close()


def _add_rank(spec, rank, count):
    store = open_store(spec, timeout=20)
    seen = [store.add("counter", 1) for _ in range(count)]
    store.set(f"seen/{rank}", ",".join(map(str, seen)).encode())
    store.close()


# -- behaviour shared by both stores -------------------------------------------------------

@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(30)
def test_set_get_check_delete_missing(store):
    store.set("a", b"alpha")
    store.set("b", bytearray(b"beta"))
    assert store.get("a") == b"alpha"
    assert store.get("b") == b"beta"
    store.set("a", b"again")  # the latest value wins
    assert store.get("a") == b"again"
    assert store.check(["a", "b"]) is True
    assert store.check(["a", "nope"]) is False
    assert store.check([]) is True
    assert store.missing(["a", "nope", "b", "zip"]) == ["nope", "zip"]
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert store.check(["a"]) is False
    assert store.missing(["a", "b"]) == ["a"]
    store.set("ключ/🙂", b"\x00\xff")  # utf-8 keys, binary values
    assert store.get("ключ/🙂") == b"\x00\xff"
    with pytest.raises(TypeError):
        store.set("c", "text is not bytes")


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(30)
def test_add_counts_in_ascii_decimal(store):
    assert store.add("n", 1) == 1
    assert store.add("n", 41) == 42
    assert store.add("n", -50) == -8
    assert store.add("n", 0) == -8
    assert store.get("n") == b"-8"
    store.set("m", b"7")
    assert store.add("m", 3) == 10
    store.set("text", b"seven")
    with pytest.raises(ValueError, match="text"):
        store.add("text", 1)
    assert store.get("text") == b"seven"
    assert store.add("n", 1) == -7  # the store is still usable after the refused add


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(60)
def test_values_of_zero_bytes_and_64_mib_round_trip(store_spec, store):
    store.set("empty", b"")
    assert store.get("empty") == b""
    assert store.check(["empty"]) is True  # an empty value is still a set key
    big = os.urandom(1 << 20) * 64  # 64 MiB, random blocks so a misplaced chunk shows
    big = big[:-1] + b"\x7e"
    store.set("big", big)
    other = open_store(store_spec[0])  # read through another client
    try:
        got = other.get("big")
        assert len(got) == len(big) and got == big
    finally:
        other.close()
    assert store.get("empty") == b""


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(30)
def test_get_waits_for_a_later_set(store_spec, store):
    def later():
        time.sleep(0.2)
        writer = open_store(store_spec[0])
        writer.set("late", b"here")
        writer.set("late2", b"too")
        writer.close()

    thread = threading.Thread(target=later)
    thread.start()
    start = time.monotonic()
    assert store.get("late", timeout=10) == b"here"
    store.wait(["late", "late2"], timeout=10)
    assert store.get("late2", timeout=0) == b"too"
    assert 0.15 < time.monotonic() - start < 5
    thread.join(5)


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(30)
def test_get_and_wait_time_out_naming_the_missing_keys(store):
    store.set("present-key", b"1")
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        store.get("absent-key", timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.19 < elapsed < 2.0
    assert "'absent-key'" in str(info.value)

    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        store.wait(["present-key", "absent-one", "absent-two"], timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.19 < elapsed < 2.0
    message = str(info.value)
    assert "'absent-one'" in message and "'absent-two'" in message
    assert "'present-key'" not in message
    store.wait(["present-key"], timeout=0.2)  # and still works afterwards
    assert store.get("present-key", timeout=0.2) == b"1"


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(30)
def test_barrier_times_out_naming_how_many_arrived(store):
    with pytest.raises(CommTimeoutError, match="1 of 3 ranks arrived"):
        store.barrier("lonely", 3, timeout=0.2)


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(30)
def test_prefix_store_isolates_keys(store):
    left, right = PrefixStore("left", store), PrefixStore("right/", store)
    left.set("k", b"L")
    right.set("k", b"R")
    assert left.get("k") == b"L" and right.get("k") == b"R"
    assert store.get("left/k") == b"L" and store.get("right/k") == b"R"
    assert left.add("n", 2) == 2 and right.add("n", 5) == 5
    assert left.missing(["k", "n", "x"]) == ["x"]


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(60)
def test_barrier_across_three_processes(store_spec, store):
    world_size = 3
    codes = run_processes(_barrier_rank, [(store_spec[0], r, world_size) for r in range(world_size)])
    assert codes == [0] * world_size
    assert [store.get(f"ok/{r}", timeout=1) for r in range(world_size)] == [b"1"] * world_size
    assert store.get("b0/arrived", timeout=1) == b"3"


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(60)
def test_add_is_atomic_across_processes(store_spec, store):
    nprocs, count = 4, 200
    codes = run_processes(_add_rank, [(store_spec[0], r, count) for r in range(nprocs)])
    assert codes == [0] * nprocs
    assert store.get("counter", timeout=1) == str(nprocs * count).encode()
    seen = []
    for rank in range(nprocs):
        values = [int(v) for v in store.get(f"seen/{rank}", timeout=1).split(b",")]
        assert values == sorted(values)  # each process sees its own adds in order
        seen += values
    assert sorted(seen) == list(range(1, nprocs * count + 1))  # every new value exactly once


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
@pytest.mark.timeout(30)
def test_one_client_shared_by_threads(store):
    def worker():
        for _ in range(100):
            store.add("threads", 1)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert store.get("threads") == b"400"


# -- TCP store specifics -------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_port_zero_publishes_the_real_port():
    with TCPStoreServer("127.0.0.1", 0, TOKEN) as srv:
        assert srv.port > 0 and srv.host == "127.0.0.1"
        assert srv.address == f"127.0.0.1:{srv.port}"
        with TCPStore("127.0.0.1", srv.port, token=TOKEN, timeout=5) as client:
            client.set("x", b"y")
            assert client.get("x") == b"y"
            assert client.address == srv.address


@pytest.mark.timeout(30)
def test_busy_port_raises_store_error_naming_it(server):
    with pytest.raises(StoreError, match=str(server.port)):
        TCPStoreServer("127.0.0.1", server.port, TOKEN)
    assert_store_works(server.port, "still")


@pytest.mark.timeout(30)
def test_client_retries_until_the_server_comes_up():
    port = free_port()
    started = {}

    def start_server_later():
        time.sleep(0.4)
        started["server"] = TCPStoreServer("127.0.0.1", port, TOKEN)

    thread = threading.Thread(target=start_server_later)
    thread.start()
    try:
        with TCPStore("127.0.0.1", port, token=TOKEN, timeout=10) as client:
            client.set("k", b"v")
            assert client.get("k") == b"v"
    finally:
        thread.join(5)
        if "server" in started:
            started["server"].close()


@pytest.mark.timeout(30)
def test_connect_times_out_when_nobody_serves():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=f"127.0.0.1:{port}"):
        TCPStore("127.0.0.1", port, token=TOKEN, timeout=0.3)
    assert time.monotonic() - start < 3


@pytest.mark.timeout(30)
def test_wrong_token_is_refused_and_the_server_keeps_serving(server):
    with pytest.raises(AuthenticationError):
        TCPStore("127.0.0.1", server.port, token="not-the-token", timeout=5)
    assert_store_works(server.port, "after-bad-token")


@pytest.mark.timeout(30)
def test_garbage_bytes_are_dropped(server):
    with TCPStore("127.0.0.1", server.port, token=TOKEN, timeout=5) as good:
        good.set("before", b"1")
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as stranger:
            stranger.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(200))
            assert closed_by_server(stranger)
        assert good.get("before") == b"1"
        assert good.add("n", 2) == 2
    assert_store_works(server.port, "after-garbage")


@pytest.mark.timeout(30)
def test_silent_connection_is_dropped_after_the_handshake_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as silent:
        # While the stranger stays silent, others are served (the accept loop is not blocked).
        assert_store_works(server.port, "during-silence")
        start = time.monotonic()
        assert closed_by_server(silent)
        assert time.monotonic() - start < 3  # handshake_timeout is 0.3 s
    assert_store_works(server.port, "after-silence")


@pytest.mark.timeout(30)
def test_client_that_disconnects_mid_request(server):
    with TCPStore("127.0.0.1", server.port, token=TOKEN, timeout=5) as good:
        good.set("k", b"v")
        raw = handshaken_socket(server.port)
        key = b"half-written"
        # SET with a 1000-byte value of which only 10 bytes are sent
        raw.sendall(b"\x01" + struct.pack("!I", len(key)) + key + struct.pack("!Q", 1000) + b"x" * 10)
        raw.close()
        time.sleep(0.1)
        assert good.check(["half-written"]) is False
        assert good.get("k") == b"v"
    assert_store_works(server.port, "after-disconnect")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("request_bytes", [
    b"\x63",  # unknown command 99
    b"\x02" + struct.pack("!Q", 0) + struct.pack("!I", (1 << 16) + 1),  # GET with an oversized key
    b"\x01" + struct.pack("!I", 2) + b"\xff\xfe" + struct.pack("!Q", 0),  # key not utf-8
], ids=["unknown-command", "oversized-key", "bad-utf8"])
def test_malformed_request_closes_only_that_connection(server, request_bytes):
    with TCPStore("127.0.0.1", server.port, token=TOKEN, timeout=5) as good:
        good.set("k", b"v")
        raw = handshaken_socket(server.port)
        raw.sendall(request_bytes)
        assert closed_by_server(raw)
        raw.close()
        assert good.get("k") == b"v"
    assert_store_works(server.port, "after-malformed")


@pytest.mark.timeout(30)
def test_server_close_wakes_a_waiting_client_promptly():
    srv = TCPStoreServer("127.0.0.1", 0, TOKEN)
    client = TCPStore("127.0.0.1", srv.port, token=TOKEN, timeout=60)
    outcome = {}

    def waiter():
        start = time.monotonic()
        try:
            client.get("never-set", timeout=30)
        except Exception as exc:  # noqa: BLE001 - the type is asserted below
            outcome["error"] = exc
        outcome["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    close_start = time.monotonic()
    srv.close()
    assert time.monotonic() - close_start < 3
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(outcome["error"], StoreError)
    assert srv.address in str(outcome["error"])
    assert outcome["elapsed"] < 3
    with pytest.raises(StoreError, match="lost"):  # later calls fail at once, too
        client.set("k", b"v")
    client.close()
    srv.close()  # idempotent


@pytest.mark.timeout(30)
def test_client_close_also_closes_an_owned_server():
    srv = TCPStoreServer("127.0.0.1", 0, TOKEN)
    client = TCPStore("127.0.0.1", srv.port, token=TOKEN, timeout=5, server=srv)
    client.set("k", b"v")
    client.close()
    client.close()
    with pytest.raises(CommTimeoutError):
        TCPStore("127.0.0.1", srv.port, token=TOKEN, timeout=0.3)
    with pytest.raises(StoreError, match="closed"):
        client.get("k")


# -- FileStore specifics -------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_file_store_last_instance_out_deletes_the_file(tmp_path):
    path = tmp_path / "job.store"
    first = FileStore(path, world_size=2, timeout=5)
    second = FileStore(path, world_size=2, timeout=5)
    first.set("k", b"v")
    assert second.get("k") == b"v"
    first.close()
    assert path.exists()  # one instance still open
    assert second.get("k") == b"v"
    second.close()
    assert not path.exists()
    with pytest.raises(StoreError, match="closed"):
        second.get("k")


@pytest.mark.timeout(30)
def test_file_store_without_world_size_keeps_the_file(tmp_path):
    path = tmp_path / "kept.store"
    with FileStore(path, timeout=5) as store:
        store.set("k", b"v")
    assert path.exists()
    with FileStore(path, timeout=5) as again:  # a new instance reads the log back
        assert again.get("k", timeout=0) == b"v"


# -- connect_store -------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_connect_store_tcp_serves_and_connects():
    with connect_store("tcp://127.0.0.1:0", rank=0, world_size=2, timeout=5, token=TOKEN,
                       serve=True) as host_store:
        assert isinstance(host_store, TCPStore)
        port = host_store.server.port
        assert port > 0 and host_store.server.host == "127.0.0.1"  # loopback stays loopback
        host_store.set("hello", b"world")
        with connect_store(f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=5,
                           token=TOKEN) as peer:
            assert isinstance(peer, TCPStore) and peer.server is None
            assert peer.get("hello") == b"world"


@pytest.mark.timeout(30)
def test_connect_store_binds_every_interface_for_a_non_loopback_host():
    with connect_store("tcp://localhost:0", timeout=5, token=TOKEN, serve=True) as store:
        assert store.server.host == "localhost"
    hostname = socket.gethostname()
    try:
        socket.getaddrinfo(hostname, 0)
    except OSError:
        pytest.skip("this host's name does not resolve")
    with connect_store(f"tcp://{hostname}:0", timeout=5, token=TOKEN, serve=True) as store:
        assert store.server.host == "0.0.0.0"
        store.set("k", b"v")
        assert store.get("k") == b"v"


@pytest.mark.timeout(30)
def test_connect_store_file(tmp_path):
    path = tmp_path / "via-url.store"
    with connect_store(f"file://{path}", rank=0, world_size=1, timeout=5) as store:
        assert isinstance(store, FileStore) and store.path == str(path)
        store.set("k", b"v")
        assert store.get("k") == b"v"
    assert not path.exists()  # world_size=1: the only instance deleted it


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url, pattern", [
    ("redis://127.0.0.1:6379", "tcp://host:port or file:///absolute/path"),
    ("127.0.0.1:29500", "tcp://host:port or file:///absolute/path"),
    ("env://", "tcp://host:port or file:///absolute/path"),
    ("tcp://127.0.0.1", "needs a host and a port"),
    ("tcp://127.0.0.1:0", "needs a host and a port"),  # port 0 only when serving
    ("tcp://127.0.0.1:http", "bad store URL"),
    ("file://relative/path", "absolute path"),
])
def test_connect_store_rejects_bad_urls(url, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        connect_store(url, rank=0, world_size=1, timeout=1, token=TOKEN)
    assert repr(url) in str(info.value)
