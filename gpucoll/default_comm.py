"""The default communicator: the one ``init()`` made, reachable without passing it around.

``gpucoll.init()`` records the communicator it returns here (unless ``set_default=False``), so
library code can ask ``gpucoll.get_rank()`` the way it asks torch.distributed's
``get_rank()`` or uses mpi4py's ``MPI.COMM_WORLD``. Closing that communicator (``close()``,
the end of its ``with`` block, or :func:`destroy`) clears it; a later ``init()`` replaces it.
"""

from __future__ import annotations

import threading
from typing import Optional

from .communicator import Communicator
from .errors import NotInitializedError

__all__ = ["default", "get_rank", "get_world_size", "is_initialized", "destroy", "set_default"]

_lock = threading.Lock()
_current: Optional[Communicator] = None


def set_default(comm: Optional[Communicator]) -> None:
    """Make ``comm`` the default communicator (None clears it). ``init()`` calls this."""
    global _current
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"set_default: expected a Communicator or None, got "
                        f"{type(comm).__name__}")
    with _lock:
        _current = comm


def _live() -> Optional[Communicator]:
    """The default communicator, forgetting it once it has been closed."""
    global _current
    with _lock:
        if _current is not None and _current.closed:
            _current = None
        return _current


def is_initialized() -> bool:
    """True when a default communicator exists (``init()`` ran and it was not closed)."""
    return _live() is not None


def default() -> Communicator:
    """The default communicator.

    Raises:
        NotInitializedError: ``init()`` was not called, or the communicator it made was
            closed or destroyed.
    """
    comm = _live()
    if comm is None:
        raise NotInitializedError(
            "no default communicator: call gpucoll.init() first (it was never called in this "
            "process, or the communicator it made was closed or destroyed)")
    return comm


def get_rank() -> int:
    """This process's rank in the default communicator (torch.distributed's ``get_rank()``)."""
    return default().rank


def get_world_size() -> int:
    """The size of the default communicator (torch.distributed's ``get_world_size()``)."""
    return default().size


def destroy() -> None:
    """Close the default communicator and forget it (torch's ``destroy_process_group()``).

    Collective, as ``close()`` is: every rank calls it. Does nothing when there is none.
    """
    global _current
    with _lock:
        comm, _current = _current, None
    if comm is not None:
        comm.close()
