"""Issue-order queues: operations touch the wire in the order they were issued.

Each operation, when issued, takes a ticket in the queue of every channel it will use (one
channel per peer and direction); it may start only when it is first in all of them. See
``gpucoll.backends.cpu`` for why this keeps asynchronous point-to-point transfers deadlock-free.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Callable, Dict, List, Sequence, Tuple

__all__ = ["OpOrder", "Channel"]

Channel = Tuple[str, int]


class OpOrder:
    """Issue-order queues per channel (see module doc)."""

    def __init__(self, rank: int, size: int):
        self._cond = threading.Condition()
        self._queues: Dict[Channel, deque] = defaultdict(deque)
        self._next = 0
        self.all_channels: List[Channel] = [(d, p) for p in range(size) if p != rank
                                            for d in ("send", "recv")]

    def issue(self, channels: Sequence[Channel]) -> Tuple[int, Sequence[Channel]]:
        with self._cond:
            ticket = self._next
            self._next += 1
            for channel in channels:
                self._queues[channel].append(ticket)
            return ticket, channels

    def _ready(self, ticket: int, channels: Sequence[Channel]) -> bool:
        queues = self._queues
        return all(queues[c][0] == ticket for c in channels)

    def acquire(self, entry: Tuple[int, Sequence[Channel]], deadline: float,
                is_aborted: Callable[[], bool]) -> bool:
        ticket, channels = entry
        with self._cond:
            while not self._ready(ticket, channels):
                if is_aborted():
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.5))
            return True

    def try_acquire(self, entry: Tuple[int, Sequence[Channel]]) -> bool:
        """Whether the operation of ``entry`` may start now (first in all its queues)."""
        with self._cond:
            return self._ready(*entry)

    def release(self, entry: Tuple[int, Sequence[Channel]]) -> None:
        ticket, channels = entry
        with self._cond:
            for channel in channels:
                queue = self._queues[channel]
                if queue and queue[0] == ticket:
                    queue.popleft()
                else:  # released out of order after an abort
                    try:
                        queue.remove(ticket)
                    except ValueError:
                        pass
            self._cond.notify_all()

    def idle(self) -> bool:
        """True when no operation is queued or running (read without the lock: a stale
        answer only sends the caller down the general path)."""
        return not any(self._queues.values())

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
