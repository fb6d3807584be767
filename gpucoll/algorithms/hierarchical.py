"""Node-aware all-reduce: shared memory inside each host, sockets between hosts.

With L ranks on each of H hosts: reduce inside the host into its first rank (the leader)
through shared memory, all-reduce among the H leaders over sockets (the algorithm
``algorithms.select`` picks for H ranks), then broadcast inside each host through shared
memory. Only one rank per host talks to the network, so inter-host bytes drop L-fold
compared with a flat ring over all ranks.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from ..transports.base import Frame, Transport
from ..transports.shm import SharedSegment
from ..transports.subset import SubsetTransport
from .shared import shared_broadcast, shared_reduce

__all__ = ["hierarchical_all_reduce"]


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
