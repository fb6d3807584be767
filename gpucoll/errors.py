"""Error types. Messages name this rank, the peer, the op and its sequence number."""

from __future__ import annotations

from typing import Optional

__all__ = [
    "GpucollError",
    "CommTimeoutError",
    "PeerError",
    "CollectiveMismatchError",
    "CommAbortedError",
    "BackendUnavailableError",
    "AuthenticationError",
    "StoreError",
    "UnsupportedOperationError",
]


class GpucollError(RuntimeError):
    """Base class of every error gpucoll raises on purpose (usage errors are ValueError/TypeError)."""


class CommTimeoutError(GpucollError, TimeoutError):
    """A blocking call did not complete within its timeout.

    Attributes:
        rank: this rank (None for store calls made before a rank is known).
        peer: the peer being waited on, when one is known.
        op: the operation's name, e.g. ``"all_reduce"``.
        seq: the operation's sequence number on its communicator.
    """

    def __init__(self, message: str, *, rank: Optional[int] = None, peer: Optional[int] = None,
                 op: Optional[str] = None, seq: Optional[int] = None):
        super().__init__(message)
        self.rank, self.peer, self.op, self.seq = rank, peer, op, seq


class PeerError(GpucollError, ConnectionError):
    """A peer closed its connection, died or sent something that does not belong."""

    def __init__(self, message: str, *, rank: Optional[int] = None, peer: Optional[int] = None,
                 op: Optional[str] = None, seq: Optional[int] = None):
        super().__init__(message)
        self.rank, self.peer, self.op, self.seq = rank, peer, op, seq


class CollectiveMismatchError(GpucollError):
    """Ranks called different collectives (op, dtype, shape, root or sequence number)."""

    def __init__(self, message: str, *, rank: Optional[int] = None, peer: Optional[int] = None,
                 op: Optional[str] = None, seq: Optional[int] = None):
        super().__init__(message)
        self.rank, self.peer, self.op, self.seq = rank, peer, op, seq


class CommAbortedError(GpucollError):
    """The communicator was aborted (by ``abort()`` or after an earlier error); make a new one."""


class BackendUnavailableError(GpucollError):
    """The requested backend cannot run here; the message says what to install."""


class AuthenticationError(GpucollError):
    """A peer or store did not prove knowledge of the shared token (GPUCOLL_AUTH_TOKEN)."""


class StoreError(GpucollError):
    """The rendezvous store failed (connection lost, protocol error, bad reply)."""


class UnsupportedOperationError(GpucollError, NotImplementedError):
    """The backend does not implement this operation ("backend X does not support Y")."""

    def __init__(self, backend: str, op: str, hint: str = ""):
        super().__init__(f"backend {backend!r} does not support {op}" + (f"; {hint}" if hint else ""))
        self.backend, self.op = backend, op
