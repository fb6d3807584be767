"""An in-process store, for a world of one: nobody else needs to find this rank.

``init()`` uses it when the world has one rank and no rendezvous address was given, so
``python script.py`` needs no URL, no port and no file. Waits are bounded like every other
store's (a key only this process could set and did not raises ``CommTimeoutError``).
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Optional, Sequence

from ..errors import CommTimeoutError
from .store import Store

__all__ = ["MemoryStore"]


class MemoryStore(Store):
    """A dict behind a condition variable; visible to this process only."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = float(timeout)
        self._data: Dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = bytes(value)
            self._changed.notify_all()

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        self.wait([key], timeout)
        with self._changed:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def check(self, keys: Sequence[str]) -> bool:
        with self._changed:
            return all(key in self._data for key in keys)

    def delete(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        limit = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        with self._changed:
            while True:
                missing = [key for key in keys if key not in self._data]
                remaining = deadline - time.monotonic()
                if not missing:
                    return
                if remaining <= 0:
                    raise CommTimeoutError(f"in-process store: timed out after {limit:g} s "
                                           f"waiting for keys {missing}", limit=limit)
                self._changed.wait(remaining)
