"""Build a ``CPUCommunicator`` with this process's GPUCOLL_* socket and algorithm settings.

Shared by the ``cpu`` backend's factory and by the host groups GPU communicators open beside
themselves (``Communicator.host_group()``), so both read the settings one way.
"""

from __future__ import annotations

from typing import Optional

from .. import algorithms, config
from ..rendezvous.hosts import route_address
from ..transports.select import check_mode
from .cpu import CPUCommunicator

__all__ = ["cpu_communicator"]


def cpu_communicator(store, rank: int, world_size: int, *, transport: Optional[str] = None,
                     **common) -> CPUCommunicator:
    """A ``CPUCommunicator`` over ``store``; ``common`` as ``init()`` passes it (comm_id,
    token, timeout, debug, owns_store)."""
    advertise = config.get("GPUCOLL_HOST")
    if not advertise:
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        advertise = route_address(host, int(port or 0)) if isinstance(host, str) else "127.0.0.1"
    text = config.get("GPUCOLL_ALGORITHM")
    override = {} if text in ("", "auto") else algorithms.parse_override(text)
    return CPUCommunicator(
        store, rank, world_size,
        transport=check_mode(config.get("GPUCOLL_TRANSPORT") if transport is None else transport),
        advertise_host=advertise, socket_buffer=config.get("GPUCOLL_SOCKET_BUFFER"),
        chunk_bytes=config.get("GPUCOLL_CHUNK_BYTES"),
        ring_threshold=config.get("GPUCOLL_RING_THRESHOLD"), algorithm_override=override,
        shm_bytes=config.get("GPUCOLL_SHM_BYTES"),
        shm_single_copy=config.get("GPUCOLL_SHM_SINGLE_COPY"), **common)
