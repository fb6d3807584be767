"""Rendezvous: the key-value stores ranks use to find each other, and :func:`connect_store`.

``connect_store`` turns an init URL into a :class:`Store`:

- ``tcp://host:port``: a :class:`TCPStore` client; with ``serve=True`` (rank 0 when no
  launcher hosts the store) a :class:`TCPStoreServer` is started on that port first and
  the returned client owns it.
- ``file:///absolute/path``: a :class:`FileStore` over that file (ranks on one host).

``env://`` is resolved by the caller into ``tcp://MASTER_ADDR:MASTER_PORT``.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Optional

from .. import config
from .file_store import FileStore
from .memory_store import MemoryStore
from .store import PrefixStore, Store
from .tcp_store import TCPStore, TCPStoreServer

__all__ = ["Store", "PrefixStore", "TCPStore", "TCPStoreServer", "FileStore", "MemoryStore",
           "connect_store"]

_SCHEMES = "tcp://host:port or file:///absolute/path"


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_store(url: str, *, rank: int = 0, world_size: Optional[int] = None,
                  timeout: Optional[float] = None, token: Optional[str] = None,
                  serve: bool = False) -> Store:
    """Open the store an init URL names.

    Args:
        url: ``tcp://host:port`` or ``file:///absolute/path``.
        rank: this rank (named in errors).
        world_size: number of ranks; a file store deletes its file once that many
            instances have closed.
        timeout: default seconds for blocking store calls and for connecting
            (None: ``GPUCOLL_TIMEOUT``).
        token: shared secret for the TCP store (None: ``GPUCOLL_AUTH_TOKEN``).
        serve: for ``tcp://``, also serve the store on that port, bound to every interface
            ("0.0.0.0", or "::" for an IPv6 host) unless the host is a loopback address.
            Port 0 asks the OS for a free port (``store.server.port`` tells which).

    Returns:
        The store; closing it also stops the server it started, if any.

    Raises:
        ValueError: the URL has another scheme, no port, or a relative file path.
        StoreError: the server could not bind its port.
        CommTimeoutError: no store answered within ``timeout``.
        AuthenticationError: the store does not share our token.

    Example:
        >>> store = connect_store("tcp://127.0.0.1:0", rank=0, world_size=1, serve=True)
        >>> store.set("ready", b"1")
        >>> store.close()
    """
    if timeout is None:
        timeout = config.get("GPUCOLL_TIMEOUT")
    if token is None:
        token = config.get("GPUCOLL_AUTH_TOKEN")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "tcp":
        try:
            host, port = parsed.hostname, parsed.port
        except ValueError as exc:  # port not a number, or out of range
            raise ValueError(f"bad store URL {url!r}: {exc}; expected {_SCHEMES}") from None
        if not host or port is None or (port == 0 and not serve):
            raise ValueError(f"store URL {url!r} needs a host and a port: {_SCHEMES}")
        server = None
        if serve:
            bind = host if _is_loopback(host) else ("::" if ":" in host else "0.0.0.0")
            server = TCPStoreServer(bind, port, token)
            port = server.port
        return TCPStore(host, port, token=token, timeout=timeout, server=server)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ValueError(f"store URL {url!r} must name an absolute path on this host, "
                             f"like file:///tmp/job-1234.store")
        return FileStore(urllib.parse.unquote(parsed.path), timeout=timeout, world_size=world_size)
    raise ValueError(f"unsupported store URL {url!r} (rank {rank}): expected {_SCHEMES}")
