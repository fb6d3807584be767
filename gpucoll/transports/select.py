"""The one place that decides how this rank reaches each peer.

The CPU backend asks :func:`connect` for its transport; :func:`plan_links` says, per peer,
which links to try in order, from the transport mode (``init(transport=...)`` or
``GPUCOLL_TRANSPORT``) and whether the peer is on this host (equal host ids, see
``gpucoll.rendezvous.hosts``):

============  =====================  =====================  ======================
mode          peer on this host      peer on another host   collectives on a host
============  =====================  =====================  ======================
``auto``      unix, then tcp         tcp                    shared memory if it can
                                                            be set up, else sockets
``shm``       unix, then tcp         tcp                    shared memory (else an
                                                            error)
``socket``    unix, then tcp         tcp                    sockets
``tcp``       tcp                    tcp                    sockets
``unix``      unix                   (refused: no link)     sockets
============  =====================  =====================  ======================

Sockets always connect every pair of ranks: point-to-point messages use them, and a rank
waiting in shared memory watches them to notice a peer that died. Shared memory
(``gpucoll.transports.shm``) carries the collectives among the ranks of one host; across
hosts the CPU backend reduces inside each host first (node-aware).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from ..rendezvous.store import Store
from .base import Transport
from .socket import SocketTransport

__all__ = ["TRANSPORT_MODES", "check_mode", "plan_links", "connect", "shared_memory_mode"]

TRANSPORT_MODES: Dict[str, str] = {
    "auto": "shared memory for collectives among ranks on one host (sockets if it cannot "
            "be set up), Unix sockets for their point-to-point, TCP across hosts",
    "shm": "like auto, but an error when shared memory cannot be set up",
    "socket": "sockets only: Unix domain sockets on one host, TCP across hosts",
    "tcp": "TCP to every peer, also on one host",
    "unix": "Unix domain sockets only (every rank on one host)",
}


def check_mode(mode: str) -> str:
    """``mode`` normalized, or ValueError naming the known modes."""
    value = str(mode).strip().lower()
    if value not in TRANSPORT_MODES:
        raise ValueError(f"unknown transport {mode!r}; expected one of "
                         f"{', '.join(TRANSPORT_MODES)}")
    return value


def shared_memory_mode(mode: str) -> str:
    """"preferred" (auto), "required" (shm) or "off" (the socket-only modes)."""
    return {"auto": "preferred", "shm": "required"}.get(check_mode(mode), "off")


def plan_links(mode: str, rank: int, host_ids: List[str]) -> Dict[int, Tuple[str, ...]]:
    """peer -> the link kinds to try, in order (see the module table).

    Raises:
        ValueError: a peer cannot be reached in this mode (``unix`` with a peer on another
            host), before anything is connected.
    """
    mode = check_mode(mode)
    links: Dict[int, Tuple[str, ...]] = {}
    for peer, peer_host in enumerate(host_ids):
        if peer == rank:
            continue
        same_host = peer_host == host_ids[rank]
        if mode == "tcp":
            links[peer] = ("tcp",)
        elif mode == "unix":
            if not same_host:
                raise ValueError(
                    f"rank {rank}: transport 'unix' cannot reach peer {peer} on another host; "
                    f"use transport='auto' or 'tcp' (GPUCOLL_TRANSPORT)")
            links[peer] = ("unix",)
        else:
            links[peer] = ("unix", "tcp") if same_host else ("tcp",)
    return links


def connect(store: Store, rank: int, size: int, *, host_ids: List[str], mode: str,
            comm_id: str, token: str, timeout: float, advertise_host: str = "127.0.0.1",
            buffer_bytes: int = 0, chunk_bytes: int = 256 << 10) -> Transport:
    """The transport of ``rank``: connected to every peer over its planned link.

    Raises:
        ValueError: no link reaches some peer in this mode.
        CommTimeoutError: ranks that did not join or connect in time are named.
    """
    links = plan_links(mode, rank, host_ids)
    return SocketTransport.connect(store, rank, size, comm_id=comm_id, token=token,
                                   timeout=timeout, links=links, advertise_host=advertise_host,
                                   buffer_bytes=buffer_bytes, chunk_bytes=chunk_bytes)
