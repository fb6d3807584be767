"""A TCP key-value store: one server (rank 0 or the launcher), one client per rank.

Every connection opens with the mutual HMAC handshake of :mod:`gpucoll.auth`
(``KIND_STORE``), so only processes that know the job's token can read or write keys.
After it, client and server speak a framed binary protocol, one request and one reply at a
time. Nothing on the wire is pickled. Integers are big-endian.

Field encodings::

    key      = length:u32  utf-8[length]         (length <= MAX_KEY_BYTES)
    keys     = count:u32   key * count           (count <= MAX_KEYS)
    value    = length:u64  bytes[length]         (any size, 0 B included)
    timeout  = milliseconds:u64                  (how long the server may wait)

Requests (``cmd:u8`` then the fields) and their replies::

    SET     1  key value          -> OK
    GET     2  timeout key        -> OK value           | TIMEOUT
    ADD     3  key amount:i64     -> OK new_value:i64   | ERROR message
    CHECK   4  keys               -> OK all_present:u8
    DELETE  5  key                -> OK existed:u8
    WAIT    6  timeout keys       -> OK                 | TIMEOUT keys (the missing ones)
    MISSING 7  keys               -> OK keys (the missing ones)

A reply is ``status:u8`` (0 OK, 1 TIMEOUT, 2 ERROR) followed by the payload shown; an
ERROR message is encoded like a key. GET and WAIT block on the server until the keys exist
or the request's timeout passes. ADD keeps values as ASCII decimal, so a GET of a counter
returns e.g. ``b"3"``. A malformed request, an unknown command or an oversized key makes
the server close that connection only; everyone else keeps being served.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import random
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .. import auth
from ..errors import AuthenticationError, CommTimeoutError, StoreError
from .store import AUTH_REFUSED_KEY, Store

__all__ = ["TCPStore", "TCPStoreServer", "MAX_KEY_BYTES", "MAX_KEYS", "format_address"]

logger = logging.getLogger("gpucoll.store")

CMD_SET, CMD_GET, CMD_ADD, CMD_CHECK, CMD_DELETE, CMD_WAIT, CMD_MISSING = range(1, 8)
_COMMAND_NAMES = {CMD_SET: "set", CMD_GET: "get", CMD_ADD: "add", CMD_CHECK: "check",
                  CMD_DELETE: "delete", CMD_WAIT: "wait", CMD_MISSING: "missing"}
STATUS_OK, STATUS_TIMEOUT, STATUS_ERROR = 0, 1, 2
MAX_KEY_BYTES = 64 << 10
MAX_KEYS = 1 << 20

_U8, _U32, _U64, _I64 = (struct.Struct(f) for f in ("!B", "!I", "!Q", "!q"))
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

# The client waits this long past a request's own timeout for the reply. The server answers
# at the timeout (TIMEOUT status) or before, so the margin only covers scheduling delays; kept
# short because it is also how long a rank waits on a store whose host was lost, on top of
# the timeout (the bound after any fault is the timeout + 2 s).
_REPLY_MARGIN = 1.0
_REQUEST_STALL_TIMEOUT = 60.0  # server drops a client silent this long in mid-request
_WAITER_POLL = 1.0             # how often a waiting server thread checks its client is alive
_MAX_SOCKET_TIMEOUT = 1e7      # larger timeouts are clamped before they reach the OS
_SMALL_VALUE = 64 << 10        # values up to this size travel in one segment with their header
_RECV_GROWTH_START = 1 << 20   # server buffers for big values grow from this as bytes arrive


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _encode_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__} {key!r}")
    data = key.encode("utf-8")
    if len(data) > MAX_KEY_BYTES:
        raise ValueError(f"store key of {len(data)} bytes (at most {MAX_KEY_BYTES}): {key[:64]!r}...")
    return _U32.pack(len(data)) + data


def _encode_keys(keys: Sequence[str]) -> bytes:
    if isinstance(keys, str):
        raise TypeError(f"expected a sequence of keys, got the single str {keys!r}")
    keys = list(keys)
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{len(keys)} keys in one request (at most {MAX_KEYS})")
    return _U32.pack(len(keys)) + b"".join(_encode_key(k) for k in keys)


def _timeout_ms(timeout: float) -> int:
    return _I64_MAX if math.isinf(timeout) else min(max(math.ceil(timeout * 1000.0), 0), _I64_MAX)


def _recv_exact(sock: socket.socket, nbytes: int, *, grow: bool = False) -> bytearray:
    """Read exactly ``nbytes`` (the socket's timeout already set); ConnectionError on EOF.

    With ``grow`` (a length sent by a client), memory grows only as the bytes arrive.
    """
    buf = bytearray(min(nbytes, _RECV_GROWTH_START) if grow else nbytes)
    got = 0
    while got < nbytes:
        if got == len(buf):
            buf += bytes(min(len(buf), nbytes - len(buf)))
        n = sock.recv_into(memoryview(buf)[got:])
        if n == 0:
            raise ConnectionError("connection closed by the other side")
        got += n
    return buf


def _send_parts(sock: socket.socket, head: bytes, value: Optional[bytes] = None) -> None:
    """Send ``head`` then ``value`` (one segment when the value is small)."""
    if value is None or len(value) <= _SMALL_VALUE:
        sock.sendall(head if value is None else head + bytes(value))
    else:
        sock.sendall(head)
        sock.sendall(value)


def _read_key(sock: socket.socket, limit: int = MAX_KEY_BYTES) -> str:
    (length,) = _U32.unpack(_recv_exact(sock, 4))
    if length > limit:
        raise _ProtocolError(f"key of {length} bytes (at most {limit})")
    try:
        return _recv_exact(sock, length).decode("utf-8")
    except UnicodeDecodeError:
        raise _ProtocolError("key is not valid utf-8") from None


def _read_keys(sock: socket.socket) -> List[str]:
    (count,) = _U32.unpack(_recv_exact(sock, 4))
    if count > MAX_KEYS:
        raise _ProtocolError(f"{count} keys in one request (at most {MAX_KEYS})")
    return [_read_key(sock) for _ in range(count)]


class _ProtocolError(Exception):
    """The peer sent something that does not follow the protocol (its connection is dropped)."""


class _ServerClosing(Exception):
    """The server is shutting down while a request waits."""


class TCPStoreServer:
    """Serves the store: an accept thread plus one daemon thread per connection.

    Args:
        host: address to bind ("0.0.0.0" or "::" for every interface).
        port: port to bind; 0 lets the OS choose, and :attr:`port` publishes the choice.
        token: shared secret clients must prove they know (``GPUCOLL_AUTH_TOKEN``).
        handshake_timeout: seconds a new connection gets to complete the handshake.

    Attributes:
        host: the address bound.
        port: the port bound (the real one when 0 was asked).

    Raises:
        StoreError: the address cannot be bound (e.g. the port is in use).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "", *,
                 handshake_timeout: float = auth.HANDSHAKE_TIMEOUT):
        self.token = token
        self.handshake_timeout = handshake_timeout
        self._data: Dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns_lock = threading.Lock()
        self._conns: Set[socket.socket] = set()
        self._threads: Set[threading.Thread] = set()
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]
            self._listener = socket.create_server((host, port), family=family,
                                                  backlog=socket.SOMAXCONN)
        except OSError as exc:
            raise StoreError(f"cannot serve the store at {format_address(host, port)}: {exc}") from None
        self.host = host
        self.port = self._listener.getsockname()[1]
        self.address = format_address(host, self.port)
        self._listener.settimeout(0.25)  # the accept loop looks at the closed flag this often
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"gpucoll-store-accept-{self.port}", daemon=True)
        self._accept_thread.start()

    def __repr__(self) -> str:
        return f"TCPStoreServer({self.address}, {'closed' if self._closed else 'serving'})"

    def __enter__(self) -> "TCPStoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, join_timeout: float = 2.0) -> None:
        """Stop accepting, close every connection and wake waiters; safe to call twice.

        Args:
            join_timeout: total seconds to wait for the server's threads to finish.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        with self._conns_lock:
            conns, threads = list(self._conns), list(self._threads)
        for sock in [self._listener] + conns:
            try:  # wakes the thread blocked on it; a connection's own thread closes it
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        deadline = time.monotonic() + join_timeout
        for thread in [self._accept_thread] + threads:
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # e.g. out of file descriptors: do not spin
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._conns_lock:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(target=self._serve_connection, args=(conn, peer),
                                          name=f"gpucoll-store-conn-{peer}", daemon=True)
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()

    def _serve_connection(self, conn: socket.socket, peer: Any) -> None:
        try:
            auth.server_handshake(conn, self.token, auth.KIND_STORE, self.handshake_timeout)
            while not self._closed:
                conn.settimeout(None)  # idle between requests for as long as the client likes
                first = conn.recv(1)
                if not first:
                    return
                conn.settimeout(_REQUEST_STALL_TIMEOUT)
                self._handle(conn, first[0])
        except auth.WrongTokenError:
            message = f"a process at {format_address(*peer[:2])} presented a different token"
            logger.warning("store %s: %s", self.address, message)
            with self._cond:  # ranks waiting to join see it (rendezvous.hosts.wait_for_join)
                self._data[AUTH_REFUSED_KEY] = message.encode()
                self._cond.notify_all()
        except (auth.HandshakeError, _ProtocolError) as exc:
            logger.warning("store %s: dropped the connection from %s: %s", self.address, peer, exc)
        except (OSError, _ServerClosing) as exc:
            logger.debug("store %s: connection from %s ended: %r", self.address, peer, exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _handle(self, conn: socket.socket, cmd: int) -> None:
        """Read the rest of one request, run it and send the reply."""
        status, payload, value = STATUS_OK, b"", None
        if cmd == CMD_SET:
            key = _read_key(conn)
            data = bytes(_recv_exact(conn, _U64.unpack(_recv_exact(conn, 8))[0], grow=True))
            with self._cond:
                self._data[key] = data
                self._cond.notify_all()
        elif cmd == CMD_GET:
            timeout = _U64.unpack(_recv_exact(conn, 8))[0] / 1000.0
            values = self._wait_for(conn, [_read_key(conn)], timeout)
            if values is None:
                status = STATUS_TIMEOUT
            else:
                value = values[0]
                payload = _U64.pack(len(value))
        elif cmd == CMD_ADD:
            key = _read_key(conn)
            status, payload = self._add(key, _I64.unpack(_recv_exact(conn, 8))[0])
        elif cmd in (CMD_CHECK, CMD_MISSING):
            keys = _read_keys(conn)
            with self._cond:
                missing = [k for k in keys if k not in self._data]
            payload = _U8.pack(not missing) if cmd == CMD_CHECK else _encode_keys(missing)
        elif cmd == CMD_DELETE:
            key = _read_key(conn)
            with self._cond:
                payload = _U8.pack(self._data.pop(key, None) is not None)
        elif cmd == CMD_WAIT:
            timeout = _U64.unpack(_recv_exact(conn, 8))[0] / 1000.0
            keys = _read_keys(conn)
            if self._wait_for(conn, keys, timeout) is None:
                with self._cond:
                    missing = [k for k in keys if k not in self._data]
                status, payload = STATUS_TIMEOUT, _encode_keys(missing)
        else:
            raise _ProtocolError(f"unknown command {cmd}")
        _send_parts(conn, _U8.pack(status) + payload, value)

    def _add(self, key: str, amount: int) -> Tuple[int, bytes]:
        with self._cond:
            old = self._data.get(key, b"0")
            try:
                new = int(old.decode("ascii")) + amount
            except (UnicodeDecodeError, ValueError):
                message = f"key {key!r} holds {old[:32]!r}, not an integer"
            else:
                if _I64_MIN <= new <= _I64_MAX:
                    self._data[key] = str(new).encode("ascii")
                    self._cond.notify_all()
                    return STATUS_OK, _I64.pack(new)
                message = f"adding {amount} to key {key!r} leaves the signed 64-bit range"
        return STATUS_ERROR, _encode_key(message)

    def _wait_for(self, conn: socket.socket, keys: List[str],
                  timeout: float) -> Optional[List[bytes]]:
        """Block until every key exists (their values) or ``timeout`` passes (None).

        Raises:
            _ServerClosing: the server is closing.
            ConnectionError: the client went away while we waited.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise _ServerClosing()
                if all(k in self._data for k in keys):
                    return [self._data[k] for k in keys]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if not self._cond.wait(min(remaining, _WAITER_POLL)) and _peer_gone(conn):
                    raise ConnectionError("client disconnected while waiting")


def _peer_gone(conn: socket.socket) -> bool:
    """True when the peer has closed its end (a lock-step client never sends while waiting)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class TCPStore(Store):
    """Client of a :class:`TCPStoreServer`; thread-safe (one socket behind a lock).

    Args:
        host: the server's address.
        port: the server's port.
        token: shared secret (``GPUCOLL_AUTH_TOKEN``).
        timeout: default seconds for blocking calls, and for connecting (the server may
            not be up yet: refused connections are retried with backoff until then).
        server: a server this client owns; :meth:`close` closes it too.

    Raises:
        CommTimeoutError: no server accepted a connection within ``timeout``.
        AuthenticationError: the server does not share our token.
        StoreError: the server broke off the handshake.

    Example:
        >>> server = TCPStoreServer("127.0.0.1", 0, token="s3cret")
        >>> store = TCPStore("127.0.0.1", server.port, token="s3cret", server=server)
        >>> store.set("a", b"1"); store.get("a")
        b'1'
        >>> store.close()
    """

    def __init__(self, host: str, port: int, *, token: str = "", timeout: float = 300.0,
                 server: Optional[TCPStoreServer] = None):
        self.host, self.port, self.token = host, int(port), token
        self.timeout = float(timeout)
        self.server = server
        self.address = format_address(host, self.port)
        self._lock = threading.Lock()
        self._closed = False
        self._broken: Optional[str] = None
        self._pid = os.getpid()
        try:
            self._sock: Optional[socket.socket] = self._connect()
        except BaseException:
            if server is not None:
                server.close()
            raise

    def __repr__(self) -> str:
        return f"TCPStore({self.address})"

    def _connect(self) -> socket.socket:
        what = f"store at {self.address}"
        deadline = time.monotonic() + self.timeout
        delay, attempts = 0.01, 0
        while True:
            attempts += 1
            try:
                remaining = deadline - time.monotonic()
                sock = socket.create_connection((self.host, self.port),
                                                timeout=min(max(remaining, 0.01), 30.0))
                break
            except OSError as exc:  # refused (server not up yet), unreachable, DNS not ready
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommTimeoutError(
                        f"could not connect to the {what} within {self.timeout:g} s "
                        f"({attempts} attempts; last error: {exc})") from None
                time.sleep(min(delay * random.uniform(0.5, 1.0), remaining))
                delay = min(delay * 2.0, 1.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.client_handshake(sock, self.token, auth.KIND_STORE,
                                  max(deadline, time.monotonic() + 1.0), what)
        except (AuthenticationError, CommTimeoutError):
            sock.close()
            raise
        except OSError as exc:  # PeerError included
            sock.close()
            raise StoreError(f"handshake with the {what} failed: {exc}") from None
        return sock

    def close(self) -> None:
        """Close the connection (and the server, when this client owns one); idempotent.

        A call blocked in another thread on this client is woken and raises ``StoreError``.
        """
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self.server is not None:
            self.server.close()

    def _request(self, cmd: int, head: bytes, wait: float,
                 decode: Callable[[socket.socket], Any],
                 value: Optional[memoryview] = None) -> Tuple[bool, Any]:
        """Send one request; return ``(True, decode(sock))`` or ``(False, missing_keys)``.

        Args:
            wait: seconds the server may legitimately take (the request's own timeout);
                the socket gives up ``_REPLY_MARGIN`` seconds later.
        """
        name = _COMMAND_NAMES[cmd]
        io_timeout = min(wait + _REPLY_MARGIN, _MAX_SOCKET_TIMEOUT)
        self._check_usable(name)
        if not self._lock.acquire(timeout=io_timeout):
            raise CommTimeoutError(f"store at {self.address}: {name} could not start within "
                                   f"{io_timeout:g} s; another thread kept this client busy")
        try:
            self._check_usable(name)
            sock = self._sock
            if sock is None:  # closed by another thread a moment ago
                raise StoreError(f"{name}: the client of the store at {self.address} is closed")
            if self._pid != os.getpid():  # a forked child gets its own connection
                sock.close()  # (only this process's copy; the parent's connection lives on)
                self._pid, self._sock = os.getpid(), self._connect()
                sock = self._sock
            try:
                sock.settimeout(io_timeout)
                _send_parts(sock, _U8.pack(cmd) + head, value)
                status = _recv_exact(sock, 1)[0]
                if status == STATUS_OK:
                    return True, decode(sock)
                if status == STATUS_TIMEOUT:
                    return False, (_read_keys(sock) if cmd == CMD_WAIT else None)
                if status == STATUS_ERROR:
                    message = f"store at {self.address}: {name}: {_read_key(sock)}"
                    raise (ValueError if cmd == CMD_ADD else StoreError)(message)
                self._drop(f"unknown reply status {status}")
                raise StoreError(f"store at {self.address} answered {name} with unknown "
                                 f"status {status}")
            except socket.timeout:
                self._drop(f"no reply to {name} within {io_timeout:g} s")
                raise CommTimeoutError(
                    f"store at {self.address}: no reply to {name} within {io_timeout:g} s; "
                    f"the store server looks hung, or its host is unreachable") from None
            except (OSError, _ProtocolError) as exc:
                if self._closed:
                    raise StoreError(f"the client of the store at {self.address} was closed "
                                     f"during {name}") from None
                self._drop(f"{name} failed: {exc}")
                raise StoreError(f"lost the connection to the store at {self.address} "
                                 f"during {name}: {exc}") from None
        finally:
            self._lock.release()

    def _check_usable(self, name: str) -> None:
        if self._closed:
            raise StoreError(f"{name}: the client of the store at {self.address} is closed")
        if self._broken is not None:
            raise StoreError(f"{name}: the connection to the store at {self.address} was lost "
                             f"earlier ({self._broken}); make a new client")

    def _drop(self, reason: str) -> None:
        """Forget a socket whose request/reply stream can no longer be trusted."""
        self._broken = reason
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _timeout_error(self, keys: Sequence[str], timeout: float) -> CommTimeoutError:
        shown = ", ".join(repr(k) for k in keys[:16])
        more = f" and {len(keys) - 16} more" if len(keys) > 16 else ""
        noun = "key" if len(keys) == 1 else "keys"
        return CommTimeoutError(f"store at {self.address}: timed out after {timeout:g} s waiting "
                                f"for {noun} {shown}{more}")

    def _resolve(self, timeout: Optional[float]) -> float:
        return self.timeout if timeout is None else max(float(timeout), 0.0)

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` (bytes-like, any size) under ``key`` and wake every waiter."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"store values are bytes, got {type(value).__name__}")
        view = memoryview(value).cast("B")
        head = _encode_key(key) + _U64.pack(view.nbytes)
        self._request(CMD_SET, head, self.timeout, lambda sock: None, view)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """Return the value of ``key``, waiting on the server until it is set.

        Raises:
            CommTimeoutError: the key was not set within ``timeout`` (names the key).
            StoreError: the connection to the server was lost.
        """
        wait = self._resolve(timeout)
        head = _U64.pack(_timeout_ms(wait)) + _encode_key(key)
        found, value = self._request(CMD_GET, head, wait, _decode_value)
        if not found:
            raise self._timeout_error([key], wait)
        return value

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (0 when unset).

        Raises:
            ValueError: the key holds something that is not an integer, or the result
                leaves the signed 64-bit range.
        """
        amount = operator.index(amount)
        if not _I64_MIN <= amount <= _I64_MAX:
            raise ValueError(f"add amount {amount} is outside the signed 64-bit range")
        head = _encode_key(key) + _I64.pack(amount)
        return self._request(CMD_ADD, head, self.timeout,
                             lambda sock: _I64.unpack(_recv_exact(sock, 8))[0])[1]

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key is set; never blocks on missing keys."""
        return self._request(CMD_CHECK, _encode_keys(keys), self.timeout, _decode_bool)[1]

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was set."""
        return self._request(CMD_DELETE, _encode_key(key), self.timeout, _decode_bool)[1]

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        """Block until every key is set (one round trip).

        Raises:
            CommTimeoutError: names the keys still missing when the timeout passed.
        """
        wait = self._resolve(timeout)
        head = _U64.pack(_timeout_ms(wait)) + _encode_keys(keys)
        done, missing = self._request(CMD_WAIT, head, wait, lambda sock: None)
        if not done:
            raise self._timeout_error(missing, wait)

    def missing(self, keys: Iterable[str]) -> List[str]:
        """The keys of ``keys`` that are not set (one round trip, never blocks)."""
        return self._request(CMD_MISSING, _encode_keys(list(keys)), self.timeout, _read_keys)[1]


def _decode_bool(sock: socket.socket) -> bool:
    return bool(_recv_exact(sock, 1)[0])


def _decode_value(sock: socket.socket) -> bytes:
    # The client trusts lengths from the server it authenticated: one exact allocation.
    return bytes(_recv_exact(sock, _U64.unpack(_recv_exact(sock, 8))[0]))
