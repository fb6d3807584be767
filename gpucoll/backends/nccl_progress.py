"""How the NCCL backend publishes its progress and names the ranks a timed-out collective waited
for: every rank's watchdog records the last collective it issued in the store; a rank whose
collective timed out reads the others' records and names those that had not reached it."""

from __future__ import annotations

import threading
import time
from typing import List, Optional

from ..rendezvous.best_effort import READ_BUDGET, best_effort
from . import nccl_runtime
from .watchdog import Pending

__all__ = ["ProgressReports"]


class ProgressReports:
    """Mixin of :class:`~gpucoll.backends.nccl.NCCLCommunicator` (uses its ``rank``, ``size``,
    ``device``, ``timeout``, ``_store``, ``_publisher`` and ``_watchdog_interval``)."""

    def _timeout_message(self, pending: Pending, limit: Optional[float] = None) -> str:
        text = (f"rank {self.rank}: {pending.op} #{pending.seq} did not complete on GPU "
                f"{self.device} within {self.timeout if limit is None else limit:g} s")
        if pending.peer is not None:
            return text + f" (peer rank {pending.peer})"
        if not pending.collective:
            return text
        late = self._ranks_behind(pending.seq)
        if late is None:
            return text + " (the store could not say which ranks arrived)"
        if late:
            return text + (f"; ranks that had not reached it: {', '.join(map(str, late))} "
                           f"(of {self.size})")
        return text + "; every rank had issued it, so NCCL itself stalled (NCCL_DEBUG=INFO)"

    def _ranks_behind(self, seq: int) -> Optional[List[int]]:
        time.sleep(min(2 * self._watchdog_interval, 0.5))  # let peers publish their progress
        read, late = best_effort(
            lambda: nccl_runtime.ranks_behind(self._store, self.size, self.rank, seq), READ_BUDGET)
        return late if read else None

    def _publish_progress(self, issued: int) -> None:
        """Publish progress on a helper thread: the watchdog never blocks on the store (an
        unreachable store would hold back the timeout it enforces); one publish at a time."""
        if self._publisher is not None and self._publisher.is_alive():
            raise RuntimeError("the previous progress update has not reached the store yet")
        self._publisher = threading.Thread(
            target=best_effort, name="gpucoll-progress", daemon=True,
            args=(lambda: nccl_runtime.publish_progress(self._store, self.rank, issued),
                  self.timeout))
        self._publisher.start()
