"""Store calls made on the way out of a failure, each held to a short budget.

After a fault the store may be as unreachable as the failed peer (its host lost power, the
link to it was cut). A plain store call then waits for the store's own timeouts, so a rank
that should raise at once would first block for another full timeout. Publishing an abort
or reading which ranks arrived is informative, never essential: :func:`best_effort` runs
such a call on a helper thread and gives up after ``budget`` seconds (the thread is left to
finish or fail on its own; it holds nothing the caller needs).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["ABORT_BUDGET", "READ_BUDGET", "best_effort", "missing_ranks", "ranks_behind", "ranks_text"]

ABORT_BUDGET = 0.5   # seconds a rank waits to publish why it aborted
READ_BUDGET = 1.0    # seconds a rank waits to read what its peers published


def best_effort(call: Callable[[], Any], budget: float) -> Tuple[bool, Any]:
    """Run ``call()`` for at most ``budget`` seconds.

    Args:
        call: the store call (no arguments).
        budget: seconds to wait for it.

    Returns:
        ``(True, value)`` when it returned in time, else ``(False, None)`` (it raised, or it
        is still blocked: its thread runs on, as a daemon, until the store call's own limit).
    """
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException:  # best effort: the caller goes on without the answer
            outcome["failed"] = True

    thread = threading.Thread(target=run, name="gpucoll-best-effort", daemon=True)
    thread.start()
    thread.join(max(float(budget), 0.0))
    if thread.is_alive() or "failed" in outcome:
        return False, None
    return True, outcome.get("value")


def missing_ranks(store: Any, keys: Sequence[str]) -> Optional[List[int]]:
    """The ranks whose key (``.../<rank>``) is missing from ``store``, asked after a wait for
    ``keys`` timed out; None when the store cannot say within :data:`READ_BUDGET` (it may be
    the reason for the timeout)."""
    read, missing = best_effort(lambda: store.missing(keys), READ_BUDGET)
    if not read:
        return None
    return [int(key.rsplit("/", 1)[1]) for key in missing]


def ranks_text(ranks: Optional[List[int]]) -> str:
    """``"rank(s) [2, 3]"``, or what to say when the store could not tell (see above)."""
    return "some rank(s) (the store could not say which)" if ranks is None else f"rank(s) {ranks}"


def ranks_behind(store: Any, prefix: str, size: int, me: int, seq: int) -> Optional[List[int]]:
    """The ranks other than ``me`` whose counter ``prefix/<rank>`` is below ``seq`` or was
    never set (who did not reach step ``seq``); None when the store cannot say within
    :data:`READ_BUDGET`."""
    def behind() -> List[int]:
        late = []
        for rank in range(size):
            key = f"{prefix}/{rank}"
            if rank != me and (not store.check([key]) or int(store.get(key, READ_BUDGET)) < seq):
                late.append(rank)
        return late

    read, late = best_effort(behind, READ_BUDGET)
    return late if read else None
