"""Agreeing through the store on which ranks of a failed communicator are still alive.

``Communicator.shrink()`` calls :func:`agree_on_survivors` on every surviving rank. Each one
registers under the shrink's own key prefix, then waits until every rank of the old
communicator has either registered too or is known dead, at most ``timeout`` seconds from its
own call. The first rank to stop waiting decides (``store.add`` on one counter: whoever reads 1)
and publishes the member list; every other rank adopts that list, so all survivors agree even
when they stopped waiting at different moments. A slow but live rank is kept as long as it
registers within the window of the first rank that decides; a dead one is never waited for
longer than that window.

A rank is known dead when its launcher published a death record (:func:`publish_death`, which
``gpucoll run --elastic`` does for every rank that exits non-zero or is killed). Without such a
record, only the timeout tells a dead rank from a slow one.

Store keys: ``gpucoll/dead/<world rank>`` (unprefixed, one per job) and, under the old
communicator's prefix, ``<epoch>/alive/<rank>``, ``<epoch>/decider``, ``<epoch>/members``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Sequence

from ..errors import CommAbortedError, CommTimeoutError
from .store import Store

__all__ = ["Survivors", "agree_on_survivors", "publish_death", "death_key"]

_POLL = 0.01        # seconds between looks at the store while waiting
_DECIDE_GRACE = 2.0  # seconds to wait for the decider's list once it has claimed the decision


def death_key(world_rank: int) -> str:
    """The store key of world rank ``world_rank``'s death record."""
    return f"gpucoll/dead/{int(world_rank)}"


def publish_death(store: Store, world_rank: int, how: str) -> None:
    """Record in ``store`` that world rank ``world_rank`` is gone (``how``: e.g. "signal
    SIGKILL"), so that a shrinking communicator does not wait for it."""
    store.set(death_key(world_rank), how.encode())


@dataclass(frozen=True)
class Survivors:
    """What the survivors agreed on.

    Attributes:
        members: the old ranks that form the new communicator, in old rank order.
        lost: old rank -> why it was left out ("signal SIGKILL" from a death record, or
            "did not call shrink within N s").
    """

    members: List[int]
    lost: Dict[int, str]


def agree_on_survivors(store: Store, root_store: Store, rank: int, world_ranks: Sequence[int],
                       epoch: str, timeout: float) -> Survivors:
    """Register ``rank`` as alive and return the member list every survivor agrees on.

    Args:
        store: the old communicator's (prefixed) store.
        root_store: the unprefixed store, where death records live.
        rank: this rank in the old communicator.
        world_ranks: the old communicator's world ranks (``world_ranks[r]`` for rank r).
        epoch: a key prefix unique to this shrink of this communicator (e.g. "shrink1").
        timeout: the longest this rank waits for ranks that neither registered nor are
            known dead.

    Raises:
        CommAbortedError: the survivors decided without this rank (it called too late).
        CommTimeoutError: the rank that claimed the decision did not publish it in time.
    """
    size = len(world_ranks)
    alive_keys = [f"{epoch}/alive/{r}" for r in range(size)]
    dead_keys = [death_key(world_ranks[r]) for r in range(size)]
    members_key = f"{epoch}/members"
    store.set(alive_keys[rank], b"1")
    deadline = time.monotonic() + timeout
    while not store.check([members_key]):
        unregistered = set(store.missing(alive_keys))
        waiting = [r for r in range(size) if alive_keys[r] in unregistered]
        if waiting:
            not_dead = set(root_store.missing([dead_keys[r] for r in waiting]))
            waiting = [r for r in waiting if dead_keys[r] in not_dead]
        if not waiting or time.monotonic() >= deadline:
            if store.add(f"{epoch}/decider", 1) == 1:
                unregistered = set(store.missing(alive_keys))  # as late as possible
                members = [r for r in range(size) if alive_keys[r] not in unregistered]
                store.set(members_key, ",".join(map(str, members)).encode())
            break
        time.sleep(_POLL)
    wait = max(deadline - time.monotonic(), 0.0) + _DECIDE_GRACE
    try:
        text = store.get(members_key, wait).decode()
    except CommTimeoutError:
        raise CommTimeoutError(
            f"rank {rank}: shrink: the rank that claimed the decision on the survivors did not "
            f"publish it within {wait:g} s (it died during shrink?); call shrink() again",
            rank=rank, op="shrink") from None
    members = [int(word) for word in text.split(",") if word]
    lost = {r: _why_lost(root_store, dead_keys[r], timeout) for r in range(size)
            if r not in members}
    if rank not in members:
        raise CommAbortedError(
            f"rank {rank}: shrink: the survivors agreed on ranks {members} before this rank "
            f"called shrink() (a rank must call it within {timeout:g} s of the first one); "
            f"this rank is not part of the new communicator")
    return Survivors(members, lost)


def _why_lost(root_store: Store, key: str, timeout: float) -> str:
    if root_store.check([key]):
        return root_store.get(key, 0.0).decode(errors="replace")
    return f"did not call shrink within {timeout:g} s"
