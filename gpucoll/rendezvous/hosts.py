"""Which ranks share a host: host ids, local ranks, and the address peers should dial.

A host id names a host *and* its network namespace (hostname, boot id, netns inode): ranks
with equal ids can use same-host links (Unix sockets, shared memory); test hosts made of
network namespaces on one machine count as different hosts, as they should.
"""

from __future__ import annotations

import os
import socket
from typing import List, Tuple

from .. import config
from ..errors import CommTimeoutError
from .store import Store

__all__ = ["host_id", "exchange_host_ids", "local_rank", "route_address"]


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
    try:
        store.wait(keys, timeout)
    except CommTimeoutError:
        missing = [int(key.rsplit("/", 1)[1]) for key in store.missing(keys)]
        raise CommTimeoutError(f"rank {rank}: rank(s) {missing} of {size} did not join within "
                               f"{timeout:g} s", rank=rank, op="init") from None
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
