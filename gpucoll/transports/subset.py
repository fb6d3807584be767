"""A transport restricted to some ranks, renumbered 0..k-1 (the hosts' leaders, say).

Node-aware algorithms run a socket algorithm among one rank per host; the algorithm sees a
dense group, this wrapper maps its ranks back to the underlying transport's.
"""

from __future__ import annotations

from typing import Sequence, Tuple

from .base import Frame, Recv, Transport

__all__ = ["SubsetTransport"]


class SubsetTransport(Transport):
    """``members[i]`` of ``inner`` appears as rank ``i``; this rank must be a member."""

    def __init__(self, inner: Transport, members: Sequence[int]):
        self.inner = inner
        self.members = list(members)
        if inner.rank not in self.members:
            raise ValueError(f"rank {inner.rank} is not in the subset {self.members}")
        self.rank, self.size = self.members.index(inner.rank), len(self.members)

    def exchange(self, sends: Sequence[Tuple[int, memoryview]], recvs: Sequence[Recv],
                 frame: Frame, deadline: float) -> None:
        members = self.members
        self.inner.exchange([(members[peer], buf) for peer, buf in sends],
                            [Recv(members[r.peer], r.buf, r.reduce, r.itemsize) for r in recvs],
                            frame, deadline)
