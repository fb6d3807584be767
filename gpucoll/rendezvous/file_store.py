"""A key-value store in one file, for ranks that share a host (or a file system with flock).

The file is a log of records, appended and never rewritten; for each key the latest
record wins::

    record = op:u8 (1 set, 2 delete)  key_length:u32  value_length:u64  key  value

(big-endian; the key is utf-8). Every operation holds ``fcntl.flock`` on the file: shared
to read, exclusive to append. Each instance keeps the values it has read and the offset
it has read up to, so an operation reads only the records appended since its last one.
Waits (``get``, ``wait``) poll with a backoff growing from 1 ms to 50 ms until their
deadline. Nothing is pickled.

Use a fresh path per job: with ``world_size`` given, the file is deleted when that many
instances have closed, but a file left behind by a job that crashed still holds that
job's keys, and a new job reading them would rendezvous with ghosts. The file is created
with mode 0600, because unlike the TCP store it has no token.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import operator
import os
import struct
import threading
import time
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..errors import CommTimeoutError, StoreError
from .store import Store

__all__ = ["FileStore"]

logger = logging.getLogger("gpucoll.store")

_OP_SET, _OP_DELETE = 1, 2
_HEADER = struct.Struct("!BIQ")
_MAX_KEY_BYTES = 64 << 10
_JOINED_KEY = "\x00gpucoll/file_store/joined"
_FINISHED_KEY = "\x00gpucoll/file_store/finished"
_POLL_FIRST, _POLL_MAX = 0.001, 0.05  # seconds between looks while waiting for keys
_LOCK_POLL_MAX = 0.01                 # seconds between tries while another process holds the lock
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class FileStore(Store):
    """A :class:`Store` backed by one file on a local (or flock-capable) file system.

    Args:
        path: the file; created if missing. Use a fresh path per job.
        timeout: default seconds for blocking calls (and for taking the file lock).
        world_size: number of instances that will open this path. When given, each
            instance counts itself in on open and out on :meth:`close`; when all
            ``world_size`` have closed, the last one deletes the file.

    Raises:
        StoreError: the file cannot be opened.

    Example:
        >>> store = FileStore("/tmp/job-1234.store", world_size=1)
        >>> store.add("count", 2)
        2
        >>> store.get("count")
        b'2'
        >>> store.close()  # the last instance out deletes the file
    """

    def __init__(self, path: "os.PathLike[str] | str", *, timeout: float = 300.0,
                 world_size: Optional[int] = None):
        if world_size is not None and operator.index(world_size) < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.path = os.path.abspath(os.fspath(path))
        self.timeout = float(timeout)
        self.world_size = world_size
        self._lock = threading.Lock()
        self._values: Dict[str, bytes] = {}
        self._offset = 0
        self._closed = False
        self._fd = self._open()
        if world_size is not None:
            joined = self.add(_JOINED_KEY, 1)
            if joined > world_size:
                logger.warning("file store %s: %d instances joined, more than world_size=%d; "
                               "is the file left over from an earlier job?", self.path, joined,
                               world_size)

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot open the file store {self.path}: {exc}") from None
        self._pid = os.getpid()
        return fd

    def close(self) -> None:
        """Close the file; with ``world_size``, count out and delete the file if last. Idempotent."""
        if self._closed:
            return
        try:
            if self.world_size is not None:
                with self._locked(exclusive=True):
                    finished = self._add_locked(_FINISHED_KEY, 1)
                    if finished >= self.world_size:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self.path)
        except (StoreError, CommTimeoutError) as exc:
            logger.warning("file store %s: could not count this instance out: %s", self.path, exc)
        finally:
            with self._lock:
                self._closed = True
                os.close(self._fd)

    # -- file access ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """Hold this instance's thread lock and the file lock, with the log read up to date."""
        with self._lock:
            if self._closed:
                raise StoreError(f"the file store {self.path} is closed")
            if self._pid != os.getpid():  # a forked child needs its own lock (open file)
                os.close(self._fd)
                self._fd = self._open()
            self._flock(fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                self._read_new_records()
                if exclusive and os.fstat(self._fd).st_size > self._offset:
                    os.ftruncate(self._fd, self._offset)  # drop a record a dead writer left half-done
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _flock(self, mode: int) -> None:
        deadline = time.monotonic() + self.timeout
        delay = _POLL_FIRST
        while True:
            try:
                fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CommTimeoutError(
                        f"file store {self.path}: could not lock the file within "
                        f"{self.timeout:g} s; another process holds it (hung?)") from None
                time.sleep(delay)
                delay = min(delay * 2.0, _LOCK_POLL_MAX)

    def _read_new_records(self) -> None:
        try:
            same_file = os.path.samestat(os.stat(self.path), os.fstat(self._fd))
        except FileNotFoundError:
            same_file = False
        if not same_file:
            raise StoreError(f"the file store {self.path} was deleted or replaced while this "
                             f"instance had it open; use a fresh path per job")
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = bytearray()
        while len(data) < size - self._offset:
            chunk = os.pread(self._fd, size - self._offset - len(data), self._offset + len(data))
            if not chunk:
                break
            data += chunk
        view = memoryview(data)
        pos = 0
        while pos + _HEADER.size <= len(data):
            op, key_len, value_len = _HEADER.unpack_from(data, pos)
            if op not in (_OP_SET, _OP_DELETE) or key_len > _MAX_KEY_BYTES:
                raise StoreError(f"the file store {self.path} is corrupt at byte "
                                 f"{self._offset + pos} (not written by gpucoll?)")
            key_end = pos + _HEADER.size + key_len
            end = key_end + value_len
            if end > len(data):
                break  # a writer died half-way; the next writer truncates it away
            key = bytes(view[pos + _HEADER.size:key_end]).decode("utf-8")
            if op == _OP_SET:
                self._values[key] = bytes(view[key_end:end])
            else:
                self._values.pop(key, None)
            pos = end
        view.release()
        self._offset += pos

    def _append(self, op: int, key: str, value: bytes = b"") -> None:
        """Append one record (exclusive lock held) and apply it to our view."""
        key_bytes = key.encode("utf-8")
        if len(key_bytes) > _MAX_KEY_BYTES:
            raise ValueError(f"store key of {len(key_bytes)} bytes (at most {_MAX_KEY_BYTES}): "
                             f"{key[:64]!r}...")
        value = memoryview(value).cast("B")
        head = _HEADER.pack(op, len(key_bytes), value.nbytes) + key_bytes
        for part in (memoryview(head), value):
            while part.nbytes:
                part = part[os.write(self._fd, part):]
        self._offset += len(head) + value.nbytes
        if op == _OP_SET:
            self._values[key] = bytes(value)
        else:
            self._values.pop(key, None)

    def _add_locked(self, key: str, amount: int) -> int:
        old = self._values.get(key, b"0")
        try:
            new = int(old.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"file store {self.path}: key {key!r} holds {old[:32]!r}, "
                             f"not an integer") from None
        if not _I64_MIN <= new <= _I64_MAX:
            raise ValueError(f"file store {self.path}: adding {amount} to key {key!r} leaves "
                             f"the signed 64-bit range")
        self._append(_OP_SET, key, str(new).encode("ascii"))
        return new

    def _poll_until(self, keys: List[str], timeout: Optional[float]) -> Tuple[List[str], List[bytes]]:
        """Look until every key is set: ``([], values)``, or ``(missing, [])`` at the deadline."""
        timeout = self.timeout if timeout is None else max(float(timeout), 0.0)
        deadline = time.monotonic() + timeout
        delay = _POLL_FIRST
        while True:
            with self._locked(exclusive=False):
                missing = [k for k in keys if k not in self._values]
                if not missing:
                    return [], [self._values[k] for k in keys]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return missing, []
            time.sleep(min(delay, remaining))
            delay = min(delay * 2.0, _POLL_MAX)

    def _timeout_error(self, missing: Sequence[str], timeout: Optional[float]) -> CommTimeoutError:
        timeout = self.timeout if timeout is None else max(float(timeout), 0.0)
        shown = ", ".join(repr(k) for k in missing[:16])
        more = f" and {len(missing) - 16} more" if len(missing) > 16 else ""
        noun = "key" if len(missing) == 1 else "keys"
        return CommTimeoutError(f"file store {self.path}: timed out after {timeout:g} s waiting "
                                f"for {noun} {shown}{more}")

    # -- Store API -----------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` (bytes-like, any size) under ``key``."""
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__} {key!r}")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"store values are bytes, got {type(value).__name__}")
        with self._locked(exclusive=True):
            self._append(_OP_SET, key, value)

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """Return the value of ``key``, polling until some instance sets it.

        Raises:
            CommTimeoutError: the key was not set within ``timeout`` (names the key).
        """
        missing, values = self._poll_until([key], timeout)
        if missing:
            raise self._timeout_error(missing, timeout)
        return values[0]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (0 when unset).

        Raises:
            ValueError: the key holds something that is not an integer.
        """
        amount = operator.index(amount)
        with self._locked(exclusive=True):
            return self._add_locked(key, amount)

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key is set; never blocks on missing keys."""
        keys = _key_list(keys)
        with self._locked(exclusive=False):
            return all(k in self._values for k in keys)

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was set."""
        with self._locked(exclusive=True):
            if key not in self._values:
                return False
            self._append(_OP_DELETE, key)
            return True

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        """Block until every key is set.

        Raises:
            CommTimeoutError: names the keys still missing when the timeout passed.
        """
        missing, _ = self._poll_until(_key_list(keys), timeout)
        if missing:
            raise self._timeout_error(missing, timeout)

    def missing(self, keys: Iterable[str]) -> List[str]:
        """The keys of ``keys`` that are not set (never blocks)."""
        keys = _key_list(keys)
        with self._locked(exclusive=False):
            return [k for k in keys if k not in self._values]


def _key_list(keys: Iterable[str]) -> List[str]:
    if isinstance(keys, str):
        raise TypeError(f"expected a sequence of keys, got the single str {keys!r}")
    return list(keys)
