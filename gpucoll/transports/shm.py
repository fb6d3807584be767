"""Shared memory among the ranks of one host: one segment per communicator and host.

Layout of a segment (``L`` local ranks, ``S`` slot bytes)::

    control   L lines of 16 int64 (128 B each): arrival counter, aborted flag, pid,
              the local rank this one sleeps on (+1; 0: none), the address of the array
              it lends for single-copy reads, whether it can make them,
              two op headers by op parity, 3 words each: (op | dtype << 8 | reduce op
              << 16 | (root + 1) << 24), bytes, sequence number
    data      2 buffer sets x L slots of S bytes (set b = step % 2)

A *step* is: write into my slot of the current set, :meth:`SharedSegment.sync` (every local
rank arrives), read the others' slots (optionally reduce, sync again, read again). A rank
writes into set b at step t+2 only after the first sync of step t+1, which every rank reaches
after its reads of step t: two sets make one sync per step enough.

The first sync of every op also publishes a header; every rank compares all headers, so
ranks that called different collectives, dtypes, sizes or roots raise
``CollectiveMismatchError`` on every rank instead of reading the wrong bytes.

Waiting spins briefly, then yields the CPU, then blocks in a futex wait on the missing rank's
counter, which that rank wakes when it arrives (so oversubscribed hosts progress), and
checks the deadline, the peers' aborted flags and whether a peer's socket hung up (a rank
that died), naming the rank. Stores then counter stores are seen in that order by other cores
on x86-64 (TSO), which the flag protocol relies on; other machines use sockets (see
:func:`usable_here`).

Segments are files in ``/dev/shm`` created with ``os.open`` (no resource tracker), named
``gpucoll-<job>-<id>`` (``<job>`` from the job's token, so a launcher can sweep a dead job's
leftovers) and unlinked as soon as every local rank has mapped them: after set-up nothing is
left in ``/dev/shm``, whatever happens to the processes.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import hashlib
import mmap
import os
import platform
import secrets
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from ..errors import CollectiveMismatchError, CommTimeoutError, PeerError
from . import cma
from ..rendezvous.store import Store

__all__ = ["SharedSegment", "open_local_segment", "job_prefix", "sweep_job", "usable_here",
           "SHM_DIR", "SharedMemoryUnavailable", "MIN_SLOT_BYTES"]

SHM_DIR = "/dev/shm"
# A slot holds at least this much, so that every small message goes in one step (the
# collectives' one-sync path for messages up to this size relies on it).
MIN_SLOT_BYTES = 64 << 10
_LINE = 16  # int64 per control line
_COUNTER, _ABORTED, _PID, _SLEEPING, _HEADER, _ADDRESS, _SINGLE_COPY = 0, 1, 2, 3, 4, 10, 11
_HEADER_FIELDS = 3
# Waiting: busy polls for a while, then sched_yield, then futex waits. A rank per core polls
# long (yielding hands the core to any other process for a whole time slice); with more
# local ranks than cores, polling steals the core the late rank needs, so it blocks soon.
_SPIN_SECONDS, _YIELD_SECONDS = 200e-6, 1e-3
_SPIN_OVERSUBSCRIBED, _YIELD_OVERSUBSCRIBED = 20e-6, 100e-6
_SLEEP = 50e-6           # (or, without futex, sleep this long per round)
_FUTEX_TIMEOUT_NS = 500_000  # a missed wake costs at most this
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the word lives in a shared mapping


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_call():
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_FUTEX = _futex_call()
_WAIT_TIMEOUT = _Timespec(0, _FUTEX_TIMEOUT_NS)
_CHECK_EVERY = 0.02  # seconds between deadline / liveness checks


class SharedMemoryUnavailable(OSError):
    """The segment could not be created or mapped (the message says why and what to do)."""


def usable_here() -> Optional[str]:
    """None when shared-memory collectives can run on this machine, else the reason."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return (f"shared-memory collectives rely on x86-64 store ordering; this machine is "
                f"{platform.machine()}")
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return None


def job_prefix(token: str) -> str:
    """File-name prefix of every segment of the job whose auth token is ``token``."""
    return "gpucoll-" + hashlib.sha256(b"gpucoll-shm:" + token.encode()).hexdigest()[:12] + "-"


def sweep_job(token: str, directory: str = SHM_DIR) -> List[str]:
    """Remove what a job left in ``directory`` (only possible if a rank died during set-up)."""
    removed = []
    for path in glob.glob(os.path.join(directory, job_prefix(token) + "*")):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _too_small(total: int, directory: str, detail: str) -> SharedMemoryUnavailable:
    return SharedMemoryUnavailable(
        errno.ENOSPC,
        f"a shared-memory segment of {total} bytes does not fit in {directory} ({detail}); in a "
        f"container, start it with a larger --shm-size (docker run --shm-size=1g) or "
        f"--ipc=host, or lower GPUCOLL_SHM_BYTES")


def _create(path: str, total: int) -> mmap.mmap:
    directory = os.path.dirname(path)
    try:
        stats = os.statvfs(directory)
        free = stats.f_bavail * stats.f_frsize
    except OSError as exc:
        raise SharedMemoryUnavailable(exc.errno, f"{directory}: {exc.strerror}") from None
    if free < total:
        raise _too_small(total, directory, f"{free} bytes free")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, total)  # reserve now: no SIGBUS on a full tmpfs later
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise _too_small(total, directory, exc.strerror) from None
            raise
        return mmap.mmap(fd, total)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _attach(path: str, total: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != total:
            raise SharedMemoryUnavailable(errno.EINVAL, f"{path} has the wrong size")
        return mmap.mmap(fd, total)
    finally:
        os.close(fd)


class SharedSegment:
    """The mapped segment of one communicator on this host, and its synchronization.

    Attributes:
        index: this rank's position among the local ranks.
        size: number of local ranks.
        ranks: global rank of each local rank (used in error messages).
        slot_bytes: capacity of one slot.
    """

    def __init__(self, buffer: mmap.mmap, index: int, ranks: Sequence[int], slot_bytes: int):
        self.index, self.size, self.ranks = index, len(ranks), list(ranks)
        self.rank = self.ranks[index]
        self.slot_bytes = slot_bytes
        self._mmap = buffer
        control = _control_bytes(self.size)
        self._ctrl = np.ndarray((self.size, _LINE), np.int64, buffer=buffer)
        self._counters = self._ctrl[:, _COUNTER]
        self._data = np.ndarray((2, self.size, slot_bytes), np.uint8, buffer=buffer, offset=control)
        self._mine = self._ctrl[index]
        self._slots = [[self._data[b, q] for q in range(self.size)] for b in (0, 1)]
        self._views: dict = {}
        self._scratch = np.empty(0, np.uint8)
        self.single_copy = False  # set by probe_single_copy
        self._words = memoryview(buffer)[:control].cast("q")  # fast scalar reads and writes
        self._counter_index = [i * _LINE + _COUNTER for i in range(self.size)]
        self._my_counter = index * _LINE + _COUNTER
        self._sleeping_index = [i * _LINE + _SLEEPING for i in range(self.size)]
        self._my_sleeping = index * _LINE + _SLEEPING
        self._address = self._ctrl.ctypes.data  # futex words: the counters' low halves
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        crowded = self.size > cores
        self._spin_seconds = _SPIN_OVERSUBSCRIBED if crowded else _SPIN_SECONDS
        self._yield_seconds = _YIELD_OVERSUBSCRIBED if crowded else _YIELD_SECONDS
        self._mine[_PID] = os.getpid()
        self._epoch = 0
        self._ops = 0
        self._step = 0
        self._pending: Optional[Sequence[int]] = None
        self.liveness: Callable[[Sequence[int]], List[int]] = lambda ranks: []
        self.closed = False

    # ------------------------------------------------------------------ buffers
    def slot(self, local: int) -> np.ndarray:
        """Slot of local rank ``local`` in the current buffer set (uint8, ``slot_bytes``)."""
        return self._slots[self._step & 1][local]

    def block(self, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of every slot of the current set as one (local ranks,
        ``nbytes``) uint8 array, rows in local rank order (memoized, as :meth:`views`)."""
        key = (self._step & 1, nbytes, None, 0)
        found = self._views.get(key)
        if found is None:
            if len(self._views) > 64:
                self._views.clear()
            found = self._views[key] = self._data[self._step & 1, :, :nbytes]
        return found

    def views(self, nbytes: int, dtype, start: int = 0) -> List[np.ndarray]:
        """Bytes ``start`` to ``start + nbytes`` of every slot of the current set as ``dtype``
        arrays (memoized: the small-message path asks for the same views again and again)."""
        key = (self._step & 1, nbytes, dtype, start)
        found = self._views.get(key)
        if found is None:
            if len(self._views) > 64:
                self._views.clear()
            found = self._views[key] = [slot[start:start + nbytes].view(dtype)
                                        for slot in self._slots[self._step & 1]]
        return found

    # ------------------------------------------------------------------ single-copy reads
    def probe_single_copy(self, frame, deadline: float) -> bool:
        """Can every local rank read every other's memory (:mod:`.cma`)? Collective over
        the local ranks; sets (and returns) :attr:`single_copy`."""
        words, line = self._words, self.index * _LINE
        words[line + _ADDRESS] = self._ctrl.ctypes.data
        self.sync(frame, deadline)
        works = cma.available() is None
        probe = np.zeros(1, np.int64)
        for q in range(self.size):
            if q == self.index or not works:
                continue
            try:
                cma.read_into(probe, words[q * _LINE + _PID],
                              words[q * _LINE + _ADDRESS] + (q * _LINE + _PID) * 8)
            except OSError:
                works = False
            works = works and int(probe[0]) == words[q * _LINE + _PID]
        words[line + _SINGLE_COPY] = 1 if works else 2
        self.sync(frame, deadline)
        self.single_copy = all(words[q * _LINE + _SINGLE_COPY] == 1 for q in range(self.size))
        return self.single_copy

    def lend(self, array: np.ndarray) -> None:
        """Publish ``array``'s address for the peers' :meth:`read_from` (valid until the
        op's next sync that follows their reads)."""
        self._words[self.index * _LINE + _ADDRESS] = array.ctypes.data

    def read_from(self, local: int, target: np.ndarray, offset: int, frame) -> None:
        """Copy ``target.nbytes`` bytes from byte ``offset`` of the array local rank
        ``local`` lent into ``target`` (PeerError naming it when it is gone)."""
        words = self._words
        try:
            cma.read_into(target, words[local * _LINE + _PID],
                          words[local * _LINE + _ADDRESS] + offset)
        except OSError as exc:
            peer = self.ranks[local]
            raise PeerError(f"rank {self.rank}: cannot read peer {peer}'s memory during "
                            f"{frame.op} #{frame.seq} ({exc.strerror}); it likely exited",
                            rank=self.rank, peer=peer, op=frame.op, seq=frame.seq) from None

    def scratch(self, nbytes: int) -> np.ndarray:
        """A private byte buffer of at least ``nbytes`` (reused)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch

    def next_step(self) -> None:
        """Move to the other buffer set (call after the reads of a step)."""
        self._step += 1

    # ------------------------------------------------------------------ synchronization
    def expect(self, header: Sequence[int]) -> None:
        """Publish ``header`` (op, dtype, bytes, root, reduce op: what every local rank must
        agree on) with the next :meth:`sync`, the op's first, and check everyone's there."""
        self._pending = header

    def sync(self, frame, deadline: float) -> None:
        """Arrive and wait until every local rank has arrived.

        Args:
            frame: the op's ``Frame`` (names it in errors).
            deadline: ``time.monotonic()`` limit.

        Raises:
            CollectiveMismatchError: headers differ (every local rank raises it).
            PeerError: a local rank aborted or died.
            CommTimeoutError: not every rank arrived in time (names the missing ranks).
        """
        if self.closed:
            raise PeerError(f"rank {self.rank}: transport closed during {frame.op} #{frame.seq}",
                            rank=self.rank, op=frame.op, seq=frame.seq)
        parity = self._ops & 1
        header, self._pending = self._pending, None
        words = self._words
        if header is not None:
            op, dtype, nbytes, root, reduce_op = header
            start = self.index * _LINE + _HEADER + parity * _HEADER_FIELDS
            words[start] = op | dtype << 8 | reduce_op << 16 | (root + 1) << 24
            words[start + 1] = nbytes
            words[start + 2] = frame.seq
        self._epoch += 1
        epoch = self._epoch
        words[self._my_counter] = epoch
        mark = self.index + 1
        for i in self._sleeping_index:
            if words[i] == mark:  # someone blocks on my counter: wake them all
                _FUTEX(_SYS_FUTEX, ctypes.c_void_p(self._address + self._my_counter * 8),
                       _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
                break
        for i in self._counter_index:
            if words[i] < epoch:
                self._wait(epoch, frame, deadline)
                break
        if header is not None:
            self._ops += 1
            self._check_headers(parity, frame)

    def _wait(self, epoch: int, frame, deadline: float) -> None:
        words, lines = self._words, self._counter_index
        monotonic = time.monotonic
        start = monotonic()
        spin_until, yield_until = start + self._spin_seconds, start + self._yield_seconds
        next_check = start + _CHECK_EVERY
        pending = [i for i in lines if words[i] < epoch]
        while pending:
            for _ in range(32):
                pending = [i for i in pending if words[i] < epoch]
                if not pending:
                    return
            now = monotonic()
            if now >= next_check:
                self._check_peers(epoch, frame, deadline, now)
                next_check = now + _CHECK_EVERY
            if now < spin_until:
                continue
            if now < yield_until:
                os.sched_yield()
            elif _FUTEX is not None:
                self._block_on(pending[0], epoch)
            else:
                time.sleep(_SLEEP)

    def _block_on(self, line: int, epoch: int) -> None:
        """Sleep until the rank whose counter is at word ``line`` arrives (or a timeout)."""
        words = self._words
        words[self._my_sleeping] = line // _LINE + 1
        try:
            _FUTEX(_SYS_FUTEX, ctypes.c_void_p(self._address + line * 8), _FUTEX_WAIT,
                   (epoch - 1) & 0xFFFFFFFF, ctypes.byref(_WAIT_TIMEOUT), None, 0)
        finally:
            words[self._my_sleeping] = 0

    def _check_peers(self, epoch: int, frame, deadline: float, now: float) -> None:
        if self.closed:
            raise PeerError(f"rank {self.rank}: transport closed during {frame.op} #{frame.seq}",
                            rank=self.rank, op=frame.op, seq=frame.seq)
        missing = [self.ranks[i] for i in range(self.size) if self._counters[i] < epoch]
        aborted = [self.ranks[i] for i in range(self.size) if self._ctrl[i, _ABORTED]]
        dead = self.liveness(missing)
        gone = [r for r in missing if r in aborted or r in dead]
        if gone:
            peer = gone[0]
            raise PeerError(
                f"rank {self.rank}: peer {peer} closed its connection during {frame.op} "
                f"#{frame.seq}; it exited, crashed or aborted", rank=self.rank, peer=peer,
                op=frame.op, seq=frame.seq)
        if now >= deadline:
            peer = missing[0] if len(missing) == 1 else None
            raise CommTimeoutError(
                f"rank {self.rank}: {frame.op} #{frame.seq} timed out waiting for peer(s) "
                f"{missing} (shared memory: they did not arrive)", rank=self.rank, peer=peer,
                op=frame.op, seq=frame.seq)

    def _check_headers(self, parity: int, frame) -> None:
        start = _HEADER + parity * _HEADER_FIELDS
        words = self._words
        mine = self.index * _LINE + start
        kind, nbytes, seq = words[mine], words[mine + 1], words[mine + 2]
        odd = [i for i in range(self.size) if (words[i * _LINE + start], words[i * _LINE + start + 1],
                                               words[i * _LINE + start + 2]) != (kind, nbytes, seq)]
        if not odd:
            return
        from .base import OP_NAMES, dtype_text

        def describe(i: int) -> str:
            base = i * _LINE + start
            kind, nbytes, seq = words[base], words[base + 1], words[base + 2]
            op, dtype, root = kind & 0xFF, (kind >> 8) & 0xFF, (kind >> 24) - 1
            text = f"{OP_NAMES.get(op, op)} #{seq} ({nbytes} bytes, {dtype_text(dtype)}"
            return text + (f", root {root})" if root >= 0 else ")")

        others = "; ".join(f"rank {self.ranks[i]} called {describe(i)}" for i in odd)
        raise CollectiveMismatchError(
            f"rank {self.rank}: collective mismatch in {frame.op} #{frame.seq}: this rank called "
            f"{describe(self.index)}, but {others}", rank=self.rank,
            peer=self.ranks[odd[0]], op=frame.op, seq=frame.seq)

    # ------------------------------------------------------------------ lifetime
    def mark_aborted(self) -> None:
        """Tell the local peers this rank gave up (their waits raise, naming it)."""
        self.closed = True
        try:
            self._mine[_ABORTED] = 1
        except (ValueError, TypeError):  # already unmapped
            pass

    def close(self) -> None:
        self.closed = True
        self._ctrl = self._counters = self._data = self._mine = self._slots = None  # views first
        self._views = {}
        self._words.release()
        try:
            self._mmap.close()
        except BufferError:  # a view escaped; the mapping goes with the process
            pass


def _control_bytes(size: int) -> int:
    return (size * _LINE * 8 + 4095) // 4096 * 4096


def segment_bytes(size: int, slot_bytes: int) -> int:
    return _control_bytes(size) + 2 * size * slot_bytes


def open_local_segment(store: Store, rank: int, host_ids: List[str], *, token: str,
                       comm_id: str, slot_bytes: int, timeout: float,
                       directory: str = SHM_DIR) -> tuple:
    """Create (first local rank) or map (the others) this host's segment.

    Collective over every rank of the communicator (all hosts), so that all agree: returns
    ``(segment or None, reason or None)``; the segment is None on every rank when some
    rank of any host could not map its host's segment (``reason`` says why, e.g. /dev/shm
    too small; it starts with ``"unsupported: "`` when the machine cannot use shared memory
    at all, see :func:`usable_here`) or when this host has only one rank. Everything
    created is unlinked before this returns.
    """
    size = len(host_ids)
    mine = host_ids[rank]
    ranks = [r for r, h in enumerate(host_ids) if h == mine]
    index, leader = ranks.index(rank), ranks[0]
    slot_bytes = max(MIN_SLOT_BYTES, (int(slot_bytes) + 4095) // 4096 * 4096)
    total = segment_bytes(len(ranks), slot_bytes)
    deadline = time.monotonic() + timeout
    buffer, path, problem = None, None, usable_here()
    if problem is not None:
        problem = "unsupported: " + problem
    if len(ranks) > 1 and problem is None:
        name_key = f"shm/name/{leader}"
        try:
            if index == 0:
                path = os.path.join(directory, job_prefix(token) + secrets.token_hex(8))
                try:
                    buffer = _create(path, total)
                except OSError as exc:
                    path = None
                    problem = str(exc) if isinstance(exc, SharedMemoryUnavailable) else \
                        f"cannot create a segment in {directory}: {exc.strerror or exc}"
                store.set(name_key, ("!" + problem if problem else path).encode())
            else:
                store.wait([name_key], max(deadline - time.monotonic(), 0.001))
                text = store.get(name_key, 1.0).decode()
                if text.startswith("!"):
                    problem = text[1:]
                else:
                    path = text
                    try:
                        buffer = _attach(path, total)
                    except OSError as exc:
                        problem = f"rank {rank} cannot map {path}: {exc.strerror or exc}"
        except CommTimeoutError:
            problem = f"rank {leader} did not publish this host's segment in time"
    verdict = "ok" if problem is None else "!" + problem
    store.set(f"shm/ok/{rank}", verdict.encode())
    keys = [f"shm/ok/{r}" for r in range(size)]
    try:
        store.wait(keys, max(deadline - time.monotonic(), 0.001))
        verdicts = [store.get(key, 1.0).decode() for key in keys]
    finally:
        if path is not None:  # every rank (here or on another host) is done mapping
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    failed = [(r, v[1:]) for r, v in enumerate(verdicts) if v != "ok"]
    if failed:
        if buffer is not None:
            buffer.close()
        return None, f"rank {failed[0][0]}: {failed[0][1]}"
    if buffer is None:
        return None, None
    return SharedSegment(buffer, index, ranks, slot_bytes), None
