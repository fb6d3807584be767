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
    "NotInitializedError",
    "timeout_hint",
]

_TIMEOUT_SETTERS = "GPUCOLL_TIMEOUT or init(timeout=) sets it"


def timeout_hint(limit: float) -> str:
    """What a timeout message ends with: the limit, and how to change it."""
    return f" (the limit is {limit:g} s; {_TIMEOUT_SETTERS})"


class GpucollError(RuntimeError):
    """Base class of every error gpucoll raises on purpose (usage errors are ValueError/TypeError)."""


class CommTimeoutError(GpucollError, TimeoutError):
    """A blocking call did not complete within its timeout.

    Attributes:
        rank: this rank (None for store calls made before a rank is known).
        peer: the peer being waited on, when one is known.
        op: the operation's name, e.g. ``"all_reduce"``.
        seq: the operation's sequence number on its communicator.
        limit: the timeout that ran out, in seconds, when known.
    """

    def __init__(self, message: str, *, rank: Optional[int] = None, peer: Optional[int] = None,
                 op: Optional[str] = None, seq: Optional[int] = None,
                 limit: Optional[float] = None):
        super().__init__(message)
        self.rank, self.peer, self.op, self.seq = rank, peer, op, seq
        self.limit = None
        if limit is not None:
            self.add_limit(limit)

    def add_limit(self, limit: float) -> "CommTimeoutError":
        """Say in the message what the limit was and how to change it (once); return self."""
        if self.limit is None and self.args and _TIMEOUT_SETTERS not in str(self.args[0]):
            self.args = (str(self.args[0]) + timeout_hint(limit),) + tuple(self.args[1:])
        self.limit = limit if self.limit is None else self.limit
        return self


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


class NotInitializedError(GpucollError):
    """No default communicator: ``gpucoll.init()`` was not called, or its communicator was
    closed or destroyed."""
