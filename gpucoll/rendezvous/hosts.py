"""Which ranks share a host: host ids, local ranks, and the address peers should dial.

A host id names a host *and* its network namespace (hostname, boot id, netns inode): ranks
with equal ids can use same-host links (Unix sockets, shared memory); test hosts made of
network namespaces on one machine count as different hosts, as they should.
"""

from __future__ import annotations

import os
import socket
import time
from typing import List, Sequence, Tuple

from .. import config
from ..auth import TOKEN_DIFFERS
from ..errors import AuthenticationError, CommTimeoutError
from .best_effort import READ_BUDGET, best_effort, missing_ranks, ranks_text
from .store import AUTH_REFUSED_KEY, PrefixStore, Store

__all__ = ["host_id", "exchange_host_ids", "local_rank", "route_address", "wait_for_join"]

_JOIN_SLICE = 0.5  # seconds between looks for a refused token while ranks join


def host_id() -> str:
    """Identity of this host and network namespace (see module doc); GPUCOLL_HOST_ID
    overrides it (tests that pretend to be several hosts)."""
    override = config.get("GPUCOLL_HOST_ID")
    if override:
        return override
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        pass
    return "/".join(parts)


def exchange_host_ids(store: Store, rank: int, size: int, timeout: float,
                      prefix: str = "host") -> List[str]:
    """Every rank's host id, in rank order, through ``store`` (keys ``<prefix>/<rank>``).

    Raises:
        CommTimeoutError: a rank did not publish its id within ``timeout``.
    """
    mine = host_id()
    if size == 1:
        return [mine]
    store.set(f"{prefix}/{rank}", mine.encode())
    keys = [f"{prefix}/{r}" for r in range(size)]
    wait_for_join(store, keys, timeout, rank, size)
    return [mine if r == rank else store.get(keys[r], timeout).decode() for r in range(size)]


def local_rank(host_ids: List[str], rank: int) -> Tuple[int, int]:
    """(rank among the ranks on this host, number of ranks on this host)."""
    mine = host_ids[rank]
    return (sum(1 for r in range(rank) if host_ids[r] == mine),
            sum(1 for h in host_ids if h == mine))


def route_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (what TCP peers should connect to)."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, port or 9))
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def wait_for_join(store: Store, keys: Sequence[str], timeout: float, rank: int,
                  size: int) -> None:
    """Wait for the ranks' keys (``.../<rank>``); fail at once when the store's server turned
    away a client with a different token, since the rank it belongs to will never join.

    Raises:
        AuthenticationError: a process with another token tried to join (within a second).
        CommTimeoutError: ranks that did not join within ``timeout`` (named).
    """
    root = store
    while isinstance(root, PrefixStore):
        root = root.store
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            store.wait(keys, max(min(remaining, _JOIN_SLICE), 0.001))
            return
        except CommTimeoutError:
            # best effort: the store may be what was lost (its host gone, the link cut)
            answered, refused = best_effort(
                lambda: root.get(AUTH_REFUSED_KEY, 1.0) if root.check([AUTH_REFUSED_KEY])
                else None, READ_BUDGET)
            if not answered:  # the store itself stopped answering: waiting on cannot help
                raise CommTimeoutError(f"rank {rank}: {ranks_text(None)} of {size} did not join "
                                       f"within {timeout:g} s, and the store stopped answering",
                                       rank=rank, op="init") from None
            if refused is not None:
                raise AuthenticationError(
                    f"rank {rank}: {ranks_text(missing_ranks(store, keys))} of {size} cannot "
                    f"join: {refused.decode(errors='replace')}; {TOKEN_DIFFERS}") from None
            if remaining <= _JOIN_SLICE:
                raise CommTimeoutError(f"rank {rank}: {ranks_text(missing_ranks(store, keys))} "
                                       f"of {size} did not join within {timeout:g} s", rank=rank,
                                       op="init") from None
