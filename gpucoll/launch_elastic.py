"""``gpucoll run --elastic``: tell the survivors, through the job's store, that a rank is gone,
and (``--replace``) ask it whether a replacement was admitted.

``comm.shrink()`` on the surviving ranks then need not wait its timeout for that rank. The
store may have gone with the rank's host, so every call is best effort with a short budget.
"""

from __future__ import annotations

from typing import Optional, Sequence, Set

PUBLISH_BUDGET = 2.0  # seconds the launcher may spend telling the store about one death


def publish_death_briefly(addr: str, port: int, token: str, rank: int, how: str) -> bool:
    """Record ``rank``'s death (``how``: "signal SIGKILL", "exit code 1") in the job's store.

    Returns:
        True when the record was written within ``PUBLISH_BUDGET`` seconds.
    """
    from .rendezvous.best_effort import best_effort
    from .rendezvous.survivors import publish_death
    from .rendezvous.tcp_store import TCPStore

    def publish() -> None:
        with TCPStore(addr, port, token=token, timeout=PUBLISH_BUDGET) as store:
            publish_death(store, rank, how)

    done, _ = best_effort(publish, PUBLISH_BUDGET)
    return bool(done)


def admitted_briefly(addr: str, port: int, token: str,
                     join_ids: Sequence[str]) -> Optional[Set[str]]:
    """Which of ``join_ids`` (GPUCOLL_JOIN values of replacements) the members admitted;
    None when the store did not answer within ``PUBLISH_BUDGET`` seconds."""
    from .rendezvous.best_effort import best_effort
    from .rendezvous.joiners import admitted_key
    from .rendezvous.tcp_store import TCPStore

    def read() -> Set[str]:
        with TCPStore(addr, port, token=token, timeout=PUBLISH_BUDGET) as store:
            return {join_id for join_id in join_ids if store.check([admitted_key(join_id)])}

    done, found = best_effort(read, PUBLISH_BUDGET)
    return found if done else None
