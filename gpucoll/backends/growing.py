"""``grow()`` for backends whose communicators rendezvous through a store (CPU, NCCL).

The members agree through the store on who joins (``rendezvous.joiners``); when someone does,
each member makes the grown communicator with the backend's own constructor (``make``), the
newcomers do the same from ``init()``, and they meet in its set-up like any new communicator.
"""

from __future__ import annotations

from typing import Any, Callable

from ..rendezvous.joiners import agree_on_growth

__all__ = ["grow_communicator"]


def grow_communicator(comm: Any, timeout: float, min_size: int,
                      make: Callable[[str, int, int], Any]) -> Any:
    """The communicator of ``comm``'s members and every rank waiting to join, or ``comm``
    itself when none waits. ``make(comm_id, rank, size)`` builds the backend's communicator
    (not owning the store: the grown one takes over ``comm``'s ownership afterwards)."""
    if comm._subgroup:  # the newcomers wait to join the job, not one of its groups
        raise ValueError(
            f"rank {comm.rank}: grow() adds ranks to the job's communicator, not to a group "
            f"made by split / new_group / host_group: grow that one, then make the groups "
            f"again from the grown communicator")
    comm._grows = getattr(comm, "_grows", 0) + 1
    number = comm._grows
    growth = agree_on_growth(comm._store, comm._root_store, comm.rank, comm.ranks,
                             f"grow{number}", f"{comm.comm_id}/grow{number}", timeout, min_size)
    if growth is None:
        return comm
    child = make(growth.comm_id, growth.world_ranks.index(comm.to_world(comm.rank)),
                 len(growth.world_ranks))
    child._owns_store, comm._owns_store = comm._owns_store, False   # the grown one closes it
    child._world_ranks = growth.world_ranks
    child.joined = growth.joined
    return child
