"""The Store interface: a small key-value service every rank of a job can reach.

Keys are str, values are bytes of any size. Every call that can block takes a timeout
(seconds; None means the store's default timeout) and raises ``CommTimeoutError`` when it
passes, naming the keys still missing.
"""

from __future__ import annotations

import abc
from typing import Iterable, List, Optional, Sequence

__all__ = ["Store", "PrefixStore"]


class Store(abc.ABC):
    """Abstract key-value store used for rendezvous.

    Attributes:
        timeout: default timeout in seconds for blocking calls.
    """

    timeout: float = 300.0

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any earlier value, and wake waiters."""

    @abc.abstractmethod
    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """Return the value of ``key``, waiting until some rank sets it.

        Raises:
            CommTimeoutError: the key was not set within the timeout.
        """

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (0 if unset); return the new value.

        The value is stored as ASCII decimal, so ``get`` of the key returns e.g. ``b"3"``.
        """

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """True when every key is set; never blocks."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        """Block until every key is set.

        Raises:
            CommTimeoutError: names the keys still missing.
        """
        for key in keys:  # subclasses override with one round trip
            self.get(key, timeout)

    def missing(self, keys: Iterable[str]) -> List[str]:
        """The keys of ``keys`` that are not set (never blocks)."""
        return [key for key in keys if not self.check([key])]

    def barrier(self, name: str, world_size: int, timeout: Optional[float] = None) -> None:
        """Block until ``world_size`` callers have entered the barrier ``name``.

        Each name is for one use. Raises ``CommTimeoutError`` naming how many arrived.
        """
        from ..errors import CommTimeoutError

        arrived = self.add(f"{name}/arrived", 1)
        if arrived == world_size:
            self.set(f"{name}/done", b"1")
        try:
            self.wait([f"{name}/done"], timeout)
        except CommTimeoutError as exc:
            count = self.add(f"{name}/arrived", 0)
            raise CommTimeoutError(
                f"store barrier {name!r}: {count} of {world_size} ranks arrived before the "
                f"timeout ({exc})") from None

    def close(self) -> None:
        """Release connections (and stop the server if this store owns one)."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


AUTH_REFUSED_KEY = "gpucoll/auth/refused"
"""Set by a TCP store's server when a client proved a different token (the message says who)."""


class PrefixStore(Store):
    """A view of another store with every key under ``prefix/``."""

    def __init__(self, prefix: str, store: Store):
        self.prefix = prefix.rstrip("/")
        self.store = store
        self.timeout = store.timeout

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._key(key), value)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self.store.get(self._key(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._key(key), amount)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check([self._key(k) for k in keys])

    def delete(self, key: str) -> bool:
        return self.store.delete(self._key(key))

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        self.store.wait([self._key(k) for k in keys], timeout)

    def missing(self, keys: Iterable[str]) -> List[str]:
        keys = list(keys)
        absent = set(self.store.missing([self._key(k) for k in keys]))
        return [k for k in keys if self._key(k) in absent]

    def close(self) -> None:
        """A prefix view never closes the store it wraps."""
