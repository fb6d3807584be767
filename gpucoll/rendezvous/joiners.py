"""Admitting new ranks into a running job through the store: the other half of survivors.py.

A rank started to take a lost rank's place (``gpucoll run --elastic --replace N`` sets
GPUCOLL_JOIN=1 for it) calls :func:`request_to_join`: it takes a ticket (``store.add`` on one
job-wide counter), writes its world rank under the ticket and waits for its admission. The
members of a communicator call ``grow()``, which calls :func:`agree_on_growth` on every member:
member 0 alone decides. It takes every ticket not taken before (a second job-wide counter
remembers how many were), refuses a world rank the communicator already holds, clears the death
record of each newcomer's world rank (so a later ``shrink()`` waits for it again), writes each
newcomer its admission and publishes the decision for the other members, who wait for it and
acknowledge; the last to read deletes it. With no ticket waiting the decision is "nobody", and
``grow()`` returns the communicator it was called on. A rank that gives up at its timeout
withdraws its ticket: one ``store.add`` per ticket decides between it and member 0, so a rank
that gave up is never admitted, and one that was admitted never gives up.

Store keys (unprefixed, one set per job): ``gpucoll/join/count``, ``gpucoll/join/taken``,
``gpucoll/join/ticket/<n>``, ``gpucoll/join/claim/<n>``, ``gpucoll/join/admit/<n>``; under the communicator's prefix,
``<epoch>/decision`` and ``<epoch>/read``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..errors import CommAbortedError, CommTimeoutError
from .store import Store
from .survivors import death_key

__all__ = ["Admission", "Growth", "admitted_key", "agree_on_growth", "request_to_join"]

_COUNT, _TAKEN = "gpucoll/join/count", "gpucoll/join/taken"
_TICKET_WAIT = 5.0  # seconds for a ticket's world rank, written right after the ticket is taken
_POLL = 0.01        # seconds between looks at the ticket counter while waiting for newcomers
_REFUSED = "refused:"


def _ticket_key(ticket: int) -> str:
    return f"gpucoll/join/ticket/{ticket}"


def _admit_key(ticket: int) -> str:
    return f"gpucoll/join/admit/{ticket}"


def admitted_key(join_id: str) -> str:
    """Set once the rank that asked to join with ``join_id`` was admitted (its launcher asks:
    a replacement nobody admitted can be stopped when the other ranks have finished)."""
    return f"gpucoll/join/admitted/{join_id}"


def _claim_key(ticket: int) -> str:
    """Whoever adds 1 here first decides the ticket: member 0 admitting (or refusing) it, or
    its rank withdrawing it at its timeout; so a rank that gave up is never admitted."""
    return f"gpucoll/join/claim/{ticket}"


@dataclass(frozen=True)
class Admission:
    """Where a newcomer was admitted: the new communicator's id, its rank there, and the
    world ranks of the new communicator (rank order) and of every newcomer admitted with it."""

    comm_id: str
    rank: int
    world_ranks: Tuple[int, ...]
    joined: Tuple[int, ...]


@dataclass(frozen=True)
class Growth:
    """What ``grow()``'s members agreed on: the new communicator's id, world ranks (rank
    order) and the world ranks that joined."""

    comm_id: str
    world_ranks: Tuple[int, ...]
    joined: Tuple[int, ...]


def _ints(text: str) -> Tuple[int, ...]:
    return tuple(int(word) for word in text.split(",") if word)


def request_to_join(root_store: Store, world_rank: int, timeout: float,
                    join_id: str = "") -> Admission:
    """Ask to join the job as ``world_rank``; wait (at most ``timeout``) until the members of
    a communicator call ``grow()`` and admit it; then record ``join_id`` as admitted.

    Raises:
        CommTimeoutError: no member called ``grow()`` within ``timeout``.
        CommAbortedError: the members refused it (its world rank is still a member).
    """
    ticket = root_store.add(_COUNT, 1)
    root_store.set(_ticket_key(ticket), str(int(world_rank)).encode())
    try:
        text = root_store.get(_admit_key(ticket), timeout).decode()
    except CommTimeoutError:
        if root_store.add(_claim_key(ticket), 1) == 1:   # withdrawn before any member took it
            raise CommTimeoutError(
                f"world rank {world_rank}: asked to join the job (ticket {ticket}) but no "
                f"communicator's members called grow() within {timeout:g} s", rank=world_rank,
                op="join", limit=timeout) from None
        text = root_store.get(_admit_key(ticket), _TICKET_WAIT).decode()  # taken just now
    root_store.delete(_admit_key(ticket))
    root_store.delete(_claim_key(ticket))
    if text.startswith(_REFUSED):
        raise CommAbortedError(f"world rank {world_rank}: not admitted: {text[len(_REFUSED):]}")
    if join_id:
        root_store.set(admitted_key(join_id), b"1")
    comm_id, rank, world_ranks, joined = text.split("|")
    return Admission(comm_id, int(rank), _ints(world_ranks), _ints(joined))


def _decide(root_store: Store, world_ranks: Sequence[int], comm_id: str, min_size: int,
            timeout: float) -> Optional[Growth]:
    """Member 0: admit every waiting newcomer, first waiting (at most ``timeout``) until there
    are tickets enough for ``min_size`` ranks; None when nobody waits."""
    deadline = time.monotonic() + timeout
    while True:
        count = root_store.add(_COUNT, 0)
        taken = root_store.add(_TAKEN, 0)
        if len(world_ranks) + count - taken >= min_size or time.monotonic() >= deadline:
            break
        time.sleep(_POLL)
    if count <= taken:
        return None
    root_store.add(_TAKEN, count - taken)
    members = set(int(w) for w in world_ranks)
    joiners: List[Tuple[int, int]] = []
    for ticket in range(taken + 1, count + 1):
        if root_store.add(_claim_key(ticket), 1) != 1:   # its rank withdrew it
            root_store.delete(_claim_key(ticket))
            root_store.delete(_ticket_key(ticket))
            continue
        try:
            world_rank = int(root_store.get(_ticket_key(ticket), _TICKET_WAIT).decode())
        except CommTimeoutError:  # it died between its two store calls: nobody to admit
            continue
        root_store.delete(_ticket_key(ticket))
        if world_rank in members:
            root_store.set(_admit_key(ticket), (
                f"{_REFUSED}world rank {world_rank} is already a member of the growing "
                f"communicator").encode())
            continue
        members.add(world_rank)
        joiners.append((ticket, world_rank))
    if not joiners:
        return None
    new_ranks = tuple(sorted(members))
    joined = tuple(sorted(w for _, w in joiners))
    growth = Growth(comm_id, new_ranks, joined)
    listed = ",".join(map(str, new_ranks)) + "|" + ",".join(map(str, joined))
    for ticket, world_rank in joiners:
        root_store.delete(death_key(world_rank))  # alive again: a later shrink waits for it
        root_store.set(_admit_key(ticket),
                       f"{comm_id}|{new_ranks.index(world_rank)}|{listed}".encode())
    return growth


def agree_on_growth(store: Store, root_store: Store, rank: int, world_ranks: Sequence[int],
                    epoch: str, comm_id: str, timeout: float,
                    min_size: int = 0) -> Optional[Growth]:
    """Every member of a communicator calls this; member 0 decides (see the module doc).

    Args:
        store: the communicator's (prefixed) store.
        root_store: the unprefixed store, where tickets live.
        rank: this member's rank; ``world_ranks``: the communicator's world ranks.
        epoch: a key prefix unique to this ``grow()`` of this communicator.
        comm_id: the id the grown communicator gets.
        timeout: how long member 0 waits for newcomers (with ``min_size``) and the others
            for its decision (that, plus a grace).
        min_size: member 0 first waits until enough newcomers asked to make the
            communicator this big (at most ``timeout``); 0: it takes who is waiting now.

    Returns:
        The growth, or None when nobody was waiting to join.

    Raises:
        CommTimeoutError: member 0 did not publish its decision within ``timeout``.
    """
    decision_key, read_key = f"{epoch}/decision", f"{epoch}/read"
    size = len(world_ranks)
    if rank == 0:
        growth = _decide(root_store, world_ranks, comm_id, min_size, timeout)
        if size > 1:
            text = "" if growth is None else (",".join(map(str, growth.world_ranks)) + "|"
                                              + ",".join(map(str, growth.joined)))
            store.set(decision_key, text.encode())
        return growth
    wait = timeout + (timeout + _TICKET_WAIT if min_size > size else 0.0)
    try:
        text = store.get(decision_key, wait).decode()
    except CommTimeoutError:
        raise CommTimeoutError(
            f"rank {rank}: grow: member 0 did not publish who joins within {wait:g} s "
            f"(it did not call grow(), or died)", rank=rank, op="grow", limit=wait) from None
    if store.add(read_key, 1) == size - 1:  # the last member to read cleans up
        store.delete(decision_key)
        store.delete(read_key)
    if not text:
        return None
    new_ranks, joined = text.split("|")
    return Growth(comm_id, _ints(new_ranks), _ints(joined))
