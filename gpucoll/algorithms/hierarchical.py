"""Node-aware collectives: shared memory inside each host, sockets between hosts.

All-reduce, with L ranks on each of H hosts: reduce inside the host into its first rank
(the leader) through shared memory, all-reduce among the H leaders over sockets (the
algorithm ``algorithms.select`` picks for H ranks), then broadcast inside each host through
shared memory. Only one rank per host talks to the network, so inter-host bytes drop L-fold
compared with a flat ring over all ranks. Broadcast, all-gather and reduce-scatter follow the
same plan (see each function). Hosts may hold different numbers of ranks, in any order.

``hosts`` lists each host's global ranks in increasing order, hosts in the order of their
first rank; a host's first rank is its leader.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from ..transports.base import Frame, Recv, Transport
from ..transports.shm import SharedSegment
from ..transports.subset import SubsetTransport
from .shared import shared_broadcast, shared_gather, shared_reduce, shared_scatter

__all__ = ["hierarchical_all_reduce", "hierarchical_broadcast", "hierarchical_all_gather",
           "hierarchical_reduce_scatter"]

Hosts = Sequence[Sequence[int]]


def hierarchical_all_reduce(segment: Optional[SharedSegment], transport: Transport,
                            leaders: Sequence[int], buf: np.ndarray,
                            combine: Callable[[np.ndarray, np.ndarray], None],
                            leader_all_reduce: Callable[..., None], frame: Frame,
                            deadline: float) -> None:
    """All-reduce ``buf`` in place across hosts.

    Args:
        segment: this host's segment (None when this rank is alone on its host).
        transport: the sockets to every rank.
        leaders: the global rank of each host's leader (its first rank), in host order.
        leader_all_reduce: socket all-reduce ``f(t, buf, combine, frame, deadline)`` run
            among the leaders.

    Steps: shared reduce (each rank copies N in, combines (L-1)*N/L), the leaders'
    all-reduce (an H-rank socket all-reduce of N bytes; ring: 2(H-1)N/H on the wire per
    leader), shared broadcast (each rank copies N out).
    """
    if segment is not None:
        shared_reduce(segment, buf, buf, 0, combine, frame, deadline)
    if transport.rank in leaders and len(leaders) > 1:
        leader_all_reduce(SubsetTransport(transport, leaders), buf, combine, frame, deadline)
    if segment is not None:
        shared_broadcast(segment, buf, 0, frame, deadline)


def _my_host(hosts: Hosts, rank: int) -> Sequence[int]:
    return next(host for host in hosts if rank in host)


def hierarchical_broadcast(segment: Optional[SharedSegment], transport: Transport, hosts: Hosts,
                           buf: np.ndarray, root: int, leader_broadcast: Callable[..., None],
                           frame: Frame, deadline: float) -> None:
    """Broadcast ``buf`` from ``root`` across hosts: ``root`` stands in for its host's leader
    in a socket broadcast (``leader_broadcast(t, buf, root, frame, deadline)``) among one rank
    per host, then each host broadcasts through shared memory from that rank. N crosses the
    network once per other host (a flat tree sends it once per other rank)."""
    members = [root if root in host else host[0] for host in hosts]
    if transport.rank in members and len(members) > 1:
        leader_broadcast(SubsetTransport(transport, members), buf, members.index(root), frame,
                         deadline)
    if segment is not None:
        mine = _my_host(hosts, transport.rank)
        source = root if root in mine else mine[0]
        shared_broadcast(segment, buf, mine.index(source), frame, deadline)


def _leaders_swap(transport: Transport, hosts: Hosts, outgoing, incoming, frame: Frame,
                  deadline: float) -> None:
    """Among the leaders: send ``outgoing[h]`` to host h's leader and receive ``incoming[h]``
    from it, every pair at once (contiguous arrays; this host's entries are not used)."""
    me = next(h for h, host in enumerate(hosts) if host[0] == transport.rank)
    others = [h for h in range(len(hosts)) if h != me]
    transport.exchange(
        [(hosts[h][0], memoryview(outgoing[h].reshape(-1).view(np.uint8))) for h in others],
        [Recv(hosts[h][0], memoryview(incoming[h].reshape(-1).view(np.uint8))) for h in others],
        frame, deadline)


def hierarchical_all_gather(segment: Optional[SharedSegment], transport: Transport, hosts: Hosts,
                            send: np.ndarray, out: np.ndarray, frame: Frame,
                            deadline: float) -> None:
    """All-gather across hosts: gather each host's pieces into its leader through shared
    memory, the leaders swap their hosts' pieces over sockets (each sends its L*N bytes to
    every other leader), then each host broadcasts the whole result through shared memory.
    ``out`` is flat, ``len(hosts[...])`` pieces of ``send.nbytes`` in rank order."""
    piece, rank = send.nbytes, transport.rank
    raw = out.view(np.uint8).reshape(-1, piece) if piece else None
    mine = _my_host(hosts, rank)
    if rank == mine[0]:
        local = np.empty((len(mine), piece), np.uint8)
        if segment is not None:
            shared_gather(segment, send.view(np.uint8), local.reshape(-1), 0, frame, deadline)
        else:
            local[0] = send.view(np.uint8)
        if len(hosts) > 1:
            incoming = [None if host is mine else np.empty((len(host), piece), np.uint8)
                        for host in hosts]
            _leaders_swap(transport, hosts, [local] * len(hosts), incoming, frame, deadline)
            for host, blocks in zip(hosts, incoming):
                if blocks is not None and piece:
                    raw[list(host)] = blocks
        if piece:
            raw[list(mine)] = local
    elif segment is not None:
        shared_gather(segment, send.view(np.uint8), None, 0, frame, deadline)
    if segment is not None:
        shared_broadcast(segment, out.view(np.uint8), 0, frame, deadline)


def hierarchical_reduce_scatter(segment: Optional[SharedSegment], transport: Transport,
                                hosts: Hosts, send: np.ndarray, out: np.ndarray,
                                combine: Callable[[np.ndarray, np.ndarray], None], frame: Frame,
                                deadline: float) -> None:
    """Reduce-scatter across hosts: reduce each host's whole input into its leader through
    shared memory, each leader sends every other leader the partial results for that host's
    ranks' pieces and reduces what it receives into its own (in host order), then scatters its
    host's pieces through shared memory. ``send`` is flat, one piece of ``out.size`` items
    per rank."""
    rank, count, size = transport.rank, out.size, sum(len(host) for host in hosts)
    mine = _my_host(hosts, rank)
    if rank != mine[0]:
        shared_reduce(segment, send, None, 0, combine, frame, deadline)
        shared_scatter(segment, None, out, 0, frame, deadline)
        return
    partial = send.copy()
    if segment is not None:
        shared_reduce(segment, send, partial, 0, combine, frame, deadline)
    partial = partial.reshape(size, count)
    ours = np.ascontiguousarray(partial[list(mine)])
    if len(hosts) > 1:
        outgoing = [np.ascontiguousarray(partial[list(host)]) if host is not mine else None
                    for host in hosts]
        incoming = [np.empty((len(mine), count), send.dtype) if host is not mine else None
                    for host in hosts]
        _leaders_swap(transport, hosts, outgoing, incoming, frame, deadline)
        flat = ours.reshape(-1)
        for blocks in incoming:
            if blocks is not None:
                combine(flat, blocks.reshape(-1))
    if segment is not None:
        shared_scatter(segment, ours.reshape(-1), out, 0, frame, deadline)
    else:
        np.copyto(out, ours.reshape(-1))
