"""Mutual HMAC challenge that opens every store and transport connection.

Both sides prove that they know the shared token (``GPUCOLL_AUTH_TOKEN``) without sending it::

    client -> server   MAGIC  kind:u8  version:u8  client_nonce[32]
    server -> client   MAGIC  server_nonce[32]  HMAC(token, "server"|kind|cn|sn)[32]
    client -> server   HMAC(token, "client"|kind|cn|sn)[32]
    server -> client   status:u8 (1 = accepted)

A connection that sends anything else (a stranger, a port scanner, garbage bytes) is closed
by the server after at most ``handshake_timeout`` seconds; the server goes on serving.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from typing import Optional

from .errors import AuthenticationError, CommTimeoutError, PeerError

MAGIC = b"GPCL"
VERSION = 1
KIND_STORE = 1
KIND_TRANSPORT = 2
NONCE_BYTES = 32
MAC_BYTES = 32
ACCEPTED = b"\x01"
HANDSHAKE_TIMEOUT = 10.0
TOKEN_DIFFERS = ("the authentication token differs from node 0's (the store's); give every "
                 "node the same GPUCOLL_AUTH_TOKEN")
"""What both sides of a token mismatch say (the store's server runs on node 0)."""


class HandshakeError(Exception):
    """Raised on the server side for a connection that failed the handshake (it is closed)."""


class WrongTokenError(HandshakeError):
    """The client spoke the protocol but proved a different token (not a stranger's bytes)."""


def _mac(token: str, role: bytes, kind: int, client_nonce: bytes, server_nonce: bytes) -> bytes:
    message = role + bytes([kind]) + client_nonce + server_nonce
    return hmac.new(token.encode("utf-8"), message, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """Read exactly ``nbytes`` from a blocking-mode socket before ``deadline`` (monotonic).

    Raises:
        socket.timeout: the deadline passed.
        ConnectionError: the peer closed the connection.
    """
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by the other side")
        got += n
    return bytes(buf)


def client_handshake(sock: socket.socket, token: str, kind: int, deadline: float, what: str) -> None:
    """Run the client side; ``what`` names the server in errors (e.g. "store at 10.0.0.1:29500").

    Raises:
        AuthenticationError: the server refused our token or could not prove its own.
        CommTimeoutError: no answer before the deadline.
        PeerError: the server closed the connection or spoke another protocol.
    """
    client_nonce = os.urandom(NONCE_BYTES)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(MAGIC + bytes([kind, VERSION]) + client_nonce)
        reply = recv_exact(sock, len(MAGIC) + NONCE_BYTES + MAC_BYTES, deadline)
        if reply[:4] != MAGIC:
            raise PeerError(f"{what} does not speak the gpucoll protocol (got {reply[:4]!r})")
        server_nonce = reply[4:4 + NONCE_BYTES]
        server_mac = reply[4 + NONCE_BYTES:]
        ours = _mac(token, b"client", kind, client_nonce, server_nonce)
        if not hmac.compare_digest(server_mac, _mac(token, b"server", kind, client_nonce, server_nonce)):
            try:  # our proof lets the server tell a token mismatch from a stranger's garbage
                sock.sendall(ours)
            except OSError:
                pass
            raise AuthenticationError(
                f"{what} could not prove it knows our GPUCOLL_AUTH_TOKEN: {TOKEN_DIFFERS}")
        sock.sendall(ours)
        status = recv_exact(sock, 1, deadline)
    except socket.timeout:
        raise CommTimeoutError(f"handshake with {what} timed out") from None
    except ConnectionError as exc:
        if isinstance(exc, (PeerError,)):
            raise
        raise AuthenticationError(
            f"{what} closed the connection during the handshake; most likely it refused our "
            f"GPUCOLL_AUTH_TOKEN ({exc})") from None
    if status != ACCEPTED:
        raise AuthenticationError(f"{what} refused our GPUCOLL_AUTH_TOKEN")


def server_handshake(sock: socket.socket, token: str, kind: int,
                     timeout: Optional[float] = None) -> None:
    """Run the server side on a freshly accepted socket.

    Raises:
        HandshakeError: bad magic, wrong kind or version, wrong token, silence or a closed
            connection; the caller closes the socket and goes on serving.
    """
    deadline = time.monotonic() + (HANDSHAKE_TIMEOUT if timeout is None else timeout)
    try:
        hello = recv_exact(sock, len(MAGIC) + 2 + NONCE_BYTES, deadline)
        if hello[:4] != MAGIC:
            raise HandshakeError(f"not a gpucoll client (first bytes {hello[:4]!r})")
        if hello[4] != kind:
            raise HandshakeError(f"wrong connection kind {hello[4]} (expected {kind})")
        if hello[5] != VERSION:
            raise HandshakeError(f"protocol version {hello[5]} (expected {VERSION})")
        client_nonce = hello[6:]
        server_nonce = os.urandom(NONCE_BYTES)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(MAGIC + server_nonce + _mac(token, b"server", kind, client_nonce, server_nonce))
        client_mac = recv_exact(sock, MAC_BYTES, deadline)
        if not hmac.compare_digest(client_mac, _mac(token, b"client", kind, client_nonce, server_nonce)):
            raise WrongTokenError("wrong authentication token")
        sock.sendall(ACCEPTED)
    except (socket.timeout, OSError) as exc:
        raise HandshakeError(f"handshake failed: {exc}") from None
