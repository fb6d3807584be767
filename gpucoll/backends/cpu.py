"""CPU backend: NumPy arrays, collectives run by ``gpucoll.algorithms`` over the transport that
``gpucoll.transports.select`` picks for each peer.

Ordering: every operation takes its place in a per-channel queue (one channel per peer and
direction) when it is *issued*, in program order, and touches the wire only when it is first
in every queue it uses. Collectives use every channel; ``send``/``isend`` to rank p only
"send to p", ``recv``/``irecv`` from p only "receive from p". So messages appear on each
connection in issue order, asynchronous point-to-point transfers in opposite directions
progress together (no deadlock when two ranks both isend a large array and then irecv;
``sendrecv`` is such an irecv and isend, waited together; ``batch_isend_irecv`` every irecv,
then every isend of its list), and a blocking collective issued
after ``async_op`` work runs after it.

CuPy arrays (anything with ``__cuda_array_interface__``) are staged through host memory and
the result is copied back into the device array, so several processes can share a GPU
without NCCL.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .. import algorithms
from ..algorithms.direct import byte_view
from ..communicator import Communicator
from ..hostarrays import host_view, like_caller
from ..errors import (CollectiveMismatchError, CommAbortedError, CommTimeoutError, GpucollError,
                      PeerError)
from ..rendezvous.best_effort import ABORT_BUDGET, READ_BUDGET, best_effort, ranks_behind
from ..algorithms import shared as shared_algorithms
from ..rendezvous.store import PrefixStore, Store
from ..transports.base import Frame, Recv
from ..rendezvous import hosts
from ..rendezvous.survivors import agree_on_survivors
from .growing import grow_communicator
from ..transports import select as select_transport
from ..transports import shm
from ..transports.base import OP_CODES
from ..types import ReduceOp, combine_fn, finish_avg, wire_code
from .cpu_shared import NODE_AWARE, SharedMemoryPath
from ..work import Work
from . import signature
from .ordering import Channel, OpOrder
from .staging import Staged
from .workers import WorkerThreads

__all__ = ["CPUCommunicator", "EAGER_SEND_BYTES"]

#: ``isend`` of at most this many bytes writes in the caller's thread what the link takes at
#: once (usually all of it: the Work is done on return), when no earlier operation holds the
#: link; a worker thread sends any rest. Larger ones go to a worker whole, so the caller's
#: thread is never held up copying much.
EAGER_SEND_BYTES = 64 << 10

def _flat(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1)


def _selection_bytes(name: str, send, result, size: int) -> int:
    """The message size ``algorithms.select`` decides by: the whole (size, *chunk) buffer for
    the gathers and scatter, else the input (or, without one, the output)."""
    if name in ("all_gather", "gather"):
        return send.nbytes * size
    if name == "scatter":
        return result.nbytes * size
    return (send if send is not None else result).nbytes


class CPUCommunicator(SharedMemoryPath, Communicator):
    """Communicator over NumPy arrays (CuPy arrays are staged through the host)."""

    backend = "cpu"
    _converts_arrays = True  # torch CPU tensors and other host DLPack objects, in place

    def __init__(self, store: Store, rank: int, size: int, *, comm_id: str, token: str,
                 timeout: float, transport: str = "auto", advertise_host: str = "127.0.0.1",
                 socket_buffer: int = 0, chunk_bytes: int = 256 << 10,
                 ring_threshold: int = 256 << 10, algorithm_override: Optional[dict] = None,
                 debug: bool = False, shm_bytes: int = 2 << 20, shm_single_copy: bool = True,
                 owns_store: bool = True):
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is out of range for world_size={size}")
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        self.comm_id = comm_id
        self._root_store = store
        self._owns_store = owns_store
        self._store = PrefixStore(comm_id, store)
        self._token = token
        self._settings = dict(transport=transport, advertise_host=advertise_host,
                              socket_buffer=socket_buffer, chunk_bytes=chunk_bytes,
                              ring_threshold=ring_threshold, algorithm_override=algorithm_override,
                              debug=debug, shm_bytes=shm_bytes,
                              shm_single_copy=shm_single_copy)
        self._ring_threshold = ring_threshold
        self._override = algorithm_override or {}
        self._debug = debug
        deadline = time.monotonic() + self.timeout
        host_ids = hosts.exchange_host_ids(self._store, rank, size, self.timeout)
        self.local_rank, self.local_size = hosts.local_rank(host_ids, rank)
        self._transport = select_transport.connect(
            self._store, rank, size, host_ids=host_ids, mode=transport, comm_id=comm_id,
            token=token, timeout=max(deadline - time.monotonic(), 0.001),
            advertise_host=advertise_host, buffer_bytes=socket_buffer, chunk_bytes=chunk_bytes)
        self._shared: Optional[shm.SharedSegment] = None
        self._leaders: List[int] = []  # node-aware collectives: each host's first rank
        self._hosts: List[List[int]] = []  # and each host's ranks
        self._all_shared = False
        if size > 1 and select_transport.shared_memory_mode(transport) != "off":
            self._open_shared(host_ids, transport, token, shm_bytes, shm_single_copy, deadline)
        self._order = OpOrder(rank, size)
        self._workers = WorkerThreads(f"gpucoll-rank{rank}-async")
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._p2p_seq: Dict[Channel, int] = defaultdict(int)
        self._splits = 0
        self._shrinks = 0
        self._aborted: Optional[str] = None
        self._closed = False

    def _import_array(self, x, name: str):
        return host_view(x, name)

    def _export(self, result, like):
        return like_caller(result, like)

    def _open_shared(self, host_ids: List[str], mode: str, token: str, shm_bytes: int,
                     single_copy: bool, deadline: float) -> None:
        """Map this host's segment (every rank agrees on whether shared memory is used)."""
        try:
            segment, reason = shm.open_local_segment(
                self._store, self.rank, host_ids, token=token, comm_id=self.comm_id,
                slot_bytes=shm_bytes, timeout=max(deadline - time.monotonic(), 0.001))
        except BaseException:
            self._transport.close()
            raise
        if reason is not None:
            if select_transport.shared_memory_mode(mode) == "required":
                self._transport.close()
                raise shm.SharedMemoryUnavailable(
                    f"rank {self.rank}: transport 'shm' needs shared memory: {reason}")
            if not reason.startswith("unsupported: "):
                warnings.warn(f"gpucoll: rank {self.rank}: shared memory unavailable, using "
                              f"sockets between ranks on one host: {reason}", RuntimeWarning,
                              stacklevel=4)
            return
        self._shared = segment
        if segment is not None:
            segment.liveness = self._transport.hung_up
            if single_copy:
                try:
                    segment.probe_single_copy(Frame("barrier", 0), deadline)
                except GpucollError:
                    self._transport.close()
                    raise
        firsts = sorted({host_ids.index(h) for h in host_ids})
        self._all_shared = segment is not None and segment.size == self.size
        if not self._all_shared and len(firsts) < self.size:
            self._leaders = firsts
            self._hosts = [[r for r in range(self.size) if host_ids[r] == host_ids[first]]
                           for first in firsts]

    @property
    def transport_kinds(self) -> Dict[int, str]:
        """peer -> "shm", "unix" or "tcp": how collectives reach each peer ("shm": through
        this host's shared-memory segment; point-to-point still uses a socket)."""
        kinds = dict(self._transport.kinds)
        if self._shared is not None:
            kinds.update({peer: "shm" for peer in self._shared.ranks if peer != self.rank})
        return kinds

    # ------------------------------------------------------------------ execution
    def _next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def _submit(self, name: str, seq: int, channels: Sequence[Channel],
                body: Callable[[float], object], async_op: bool, timeout: Optional[float] = None,
                start: Optional[Callable[[float], Optional[Callable[[float], object]]]] = None):
        """Run ``body(deadline)`` in issue order, now or (async_op) on a worker thread.

        ``start`` (async_op only): when no earlier operation holds the channels, run at once in
        the caller's thread instead of handing the whole operation to a worker: it returns None
        when it finished the operation (the Work is done), else the body that finishes it."""
        self._check_alive()
        entry = self._order.issue(channels)
        limit = self.timeout if timeout is None else timeout
        if not async_op:
            return self._execute(name, seq, entry, body, limit)
        work = Work(name, seq, self.rank, limit * 2, on_timeout=self._abort_with)
        started = start is not None and self._order.try_acquire(entry)
        if started:
            body = self._start_now(name, seq, entry, start, limit, work)
            if body is None:
                return work

        def run() -> None:
            try:
                result = self._execute(name, seq, entry, body, limit, acquired=started)
            except BaseException as exc:  # handed to wait()
                work._finish(exception=exc)
            else:
                work._finish(result)

        self._workers.submit(run)
        return work

    def _start_now(self, name: str, seq: int, entry, start, limit: float, work: Work):
        """``start`` of an operation first in its channels, in the caller's thread: None when
        it finished the operation (or failed: ``work`` holds the outcome, the channels are
        released), else the body that finishes it, the channels still held for it."""
        try:
            rest = self._execute(name, seq, entry, start, limit, acquired=True, hold=True)
        except BaseException as exc:  # handed to wait(), as from a worker
            work._finish(exception=exc)
            return None
        if rest is None:
            self._order.release(entry)
            work._finish(None)
        return rest

    def _execute(self, name: str, seq: int, entry, body, limit: float, *,
                 acquired: bool = False, hold: bool = False):
        """``body(deadline)`` once the operation is first in its channels (``acquired``: it
        already is); the channels are released after it, or only on an error with ``hold``
        (what ``body`` returned continues the operation)."""
        start = time.monotonic()
        done = False
        try:
            if not acquired and not self._order.acquire(entry, start + limit,
                                                         lambda: self._aborted is not None):
                self._check_alive()
                raise CommTimeoutError(
                    f"rank {self.rank}: {name} #{seq} could not start within {limit:g} s: earlier "
                    f"operations on this communicator did not finish",
                    rank=self.rank, op=name, seq=seq, limit=limit)
            self._check_alive()
            result = body(time.monotonic() + limit)
            done = True
            return result
        except GpucollError as exc:
            self._fail(name, seq, exc, limit)
        finally:
            if not (hold and done):
                self._order.release(entry)

    def _fail(self, name: str, seq: int, exc: GpucollError, limit: float) -> None:
        """Raise what a failed op should raise, aborting the communicator (a dead peer, a
        timeout or a mismatch leaves it unusable)."""
        if isinstance(exc, CommAbortedError):
            raise exc
        if self._aborted is not None and not isinstance(exc, CollectiveMismatchError):
            raise CommAbortedError(
                f"rank {self.rank}: {name} #{seq} failed because the communicator was "
                f"aborted ({self._aborted})") from exc
        if isinstance(exc, CommTimeoutError):
            exc.add_limit(limit)
        self._abort_with(str(exc))
        raise self._explain(exc)

    def _explain(self, exc: GpucollError) -> GpucollError:
        """Add what a dead or failing peer left in the store about why it stopped."""
        peer = getattr(exc, "peer", None)
        if not isinstance(exc, PeerError) or peer is None:
            return exc
        key = f"abort/{peer}"
        # the store may be gone with the peer: ask for a moment only, never a full timeout
        read, reason = best_effort(
            lambda: self._store.get(key, 0.0) if self._store.check([key]) else None, READ_BUDGET)
        if read and reason is not None:
            exc.args = (f"{exc.args[0]} (peer {peer} reported: "
                        f"{reason.decode(errors='replace')})",)
        return exc

    def _abort_with(self, reason: str) -> None:
        if self._aborted is not None:
            return
        self._aborted = reason
        # why, for the peers' errors: published before the links close (peers read it when
        # they see the closed link); best effort, since the store may be unreachable now
        best_effort(lambda: self._store.set(f"abort/{self.rank}", reason.encode()), ABORT_BUDGET)
        if self._shared is not None:
            self._shared.mark_aborted()
        self._transport.close()
        self._order.wake()
        self._trace_dump(reason)

    def _frame(self, name: str, seq: int, dtype) -> Frame:
        return Frame(name, seq, wire_code(dtype) if dtype is not None else 0)

    def _algorithm(self, collective: str, nbytes: int, itemsize: int):
        name = algorithms.select(collective, nbytes, self.size, self._override, itemsize=itemsize,
                                 ring_threshold=self._ring_threshold)
        return algorithms.get(collective, name)

    def _debug_check(self, name: str, seq: int, deadline: float, dtype, shape,
                     op: Optional[ReduceOp] = None, root: int = -1) -> None:
        """GPUCOLL_DEBUG: compare (op, dtype, shape, root, seq) across ranks before the op."""
        if not self._debug or self.size == 1:
            return
        mine = signature.pack(name, seq, dtype, shape, op, root)
        peers = [p for p in range(self.size) if p != self.rank]
        got = {p: bytearray(signature.SIGNATURE.size) for p in peers}
        self._transport.exchange([(p, memoryview(mine)) for p in peers],
                                 [Recv(p, memoryview(got[p])) for p in peers],
                                 Frame("debug_check", seq), deadline)
        signatures = {p: bytes(b) for p, b in got.items()}
        signatures[self.rank] = mine
        error = signature.mismatch_error(signatures, self.rank, name, seq)
        if error is not None:
            raise error

    # ------------------------------------------------------------------ collectives
    def _collective(self, name: str, src: Optional[Staged], dst: Optional[Staged], *,
                    op: Optional[ReduceOp] = None, root: Optional[int] = None,
                    in_place: bool = False, async_op: bool = False):
        """The skeleton every collective shares, run in issue order.

        Debug signature check, then the algorithm that ``algorithms.select`` picks for the
        message (or the one-rank copy), AVG's division, and the copy back into a staged
        device array. Algorithms take ``(transport, *buffers, [root], [combine], frame,
        deadline)``: one buffer when ``in_place`` (all_reduce, broadcast: ``dst`` is
        reduced or overwritten where it lies, after ``src`` is copied into it), else
        ``(send, result)`` where either may be None on ranks that have no such buffer.
        """
        seq = self._next_seq()
        signed = dst if name == "scatter" else src  # what GPUCOLL_DEBUG compares

        def body(deadline: float):
            self._debug_check(name, seq, deadline, signed.host.dtype, signed.host.shape, op,
                              -1 if root is None else root)
            send = _flat(src.host) if src is not None else None
            result = _flat(dst.host) if dst is not None else None
            if in_place and dst is not src:
                np.copyto(result, send)
            if self.size > 1:
                buffers = (result,) if in_place else (send, result)
                sample = send if send is not None else result
                if self._all_shared or (self._leaders and name in NODE_AWARE):
                    self._run_shared(name, seq, buffers, sample, signed.host.nbytes, op, root,
                                     deadline)
                else:
                    fn = self._algorithm(name, _selection_bytes(name, send, result, self.size),
                                         sample.itemsize)
                    extra = (() if root is None else (root,)) + (
                        () if op is None else (combine_fn(op, sample.dtype),))
                    fn(self._transport, *buffers, *extra, self._frame(name, seq, sample.dtype),
                       deadline)
            elif not in_place and result is not None and result is not send:
                np.copyto(result, send)
            if dst is None:
                return None
            if op is ReduceOp.AVG:
                finish_avg(result, self.size)
            if not (name == "broadcast" and self.rank == root):
                dst.write_back()
            return dst.caller

        return self._submit(name, seq, self._order.all_channels, body, async_op)

    def _all_reduce(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        if self._short_path(async_op, x, out):
            return self._short_all_reduce(x, op, out)
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else src
        return self._collective("all_reduce", src, dst, op=op, in_place=True, async_op=async_op)

    def _broadcast(self, x, root: int, async_op: bool, stream=None):
        if self._short_path(async_op, x):
            return self._short_broadcast(x, root)
        buf = Staged(x, stream)
        return self._collective("broadcast", buf, buf, root=root, in_place=True,
                                async_op=async_op)

    def _reduce(self, x, root: int, op: ReduceOp, out, async_op: bool, stream=None):
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else (src if self.rank == root else None)
        return self._collective("reduce", src, dst, op=op, root=root, async_op=async_op)

    def _all_gather(self, x, out, async_op: bool, stream=None):
        if self._short_path(async_op, x, out, self.size):
            return self._short_all_gather(x, out)
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else Staged.empty(
            (self.size,) + src.host.shape, src.host.dtype, like=src, stream=stream)
        return self._collective("all_gather", src, dst, async_op=async_op)

    def _reduce_scatter(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        if self._short_path(async_op, x, out):
            return self._short_reduce_scatter(x, op, out)
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else Staged.empty(
            src.host.shape[1:], src.host.dtype, like=src, stream=stream)
        return self._collective("reduce_scatter", src, dst, op=op, async_op=async_op)

    def _gather(self, x, root: int, out, stream=None):
        src = Staged(x, stream)
        dst = None
        if self.rank == root:
            dst = Staged(out, stream) if out is not None else Staged.empty(
                (self.size,) + src.host.shape, src.host.dtype, like=src, stream=stream)
        return self._collective("gather", src, dst, root=root)

    def _scatter(self, x, root: int, out, template, stream=None):
        src = Staged(x, stream) if self.rank == root else None
        if out is not None:
            dst = Staged(out, stream)
        else:
            chunk, dtype = template
            dst = Staged.empty(chunk, dtype, like=src, stream=stream)
        return self._collective("scatter", src, dst, root=root)

    def _all_to_all(self, x, out, stream=None):
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else Staged.empty(
            src.host.shape, src.host.dtype, like=src, stream=stream)
        return self._collective("all_to_all", src, dst)

    # ------------------------------------------------------------------ point to point
    def _p2p_frame(self, channel: Channel, tag: int, dtype) -> Frame:
        with self._seq_lock:
            self._p2p_seq[channel] += 1
            number = self._p2p_seq[channel]
        return Frame("send", number, wire_code(dtype), tag)

    def _send(self, x, dst: int, tag: int, async_op: bool, stream=None):
        self._check_alive()
        src = Staged(x, stream)
        frame = self._p2p_frame(("send", dst), tag, src.host.dtype)

        def body(deadline: float):
            self._transport.send(dst, byte_view(src.host), frame, deadline)
            return None

        def start(deadline: float):  # an eager isend: what the link takes now, as MPI's
            return self._transport.start_send(dst, byte_view(src.host), frame)

        eager = async_op and src.host.nbytes <= EAGER_SEND_BYTES
        return self._submit("send", frame.seq, [("send", dst)], body, async_op,
                            start=start if eager else None)

    def _recv(self, out, src: int, tag: int, async_op: bool, stream=None):
        self._check_alive()
        dst = Staged(out, stream)
        frame = self._p2p_frame(("recv", src), tag, dst.host.dtype)

        def body(deadline: float):
            self._transport.recv(src, byte_view(dst.host), frame, deadline)
            dst.write_back()
            return dst.caller

        return self._submit("recv", frame.seq, [("recv", src)], body, async_op)

    # ------------------------------------------------------------------ groups and lifetime
    def _barrier(self, timeout: float) -> None:
        seq = self._next_seq()

        def body(deadline: float):
            if self._all_shared:
                frame = self._frame("barrier", seq, None)
                self._shared.expect((OP_CODES["barrier"], 0, 0, -1, 0))
                shared_algorithms.shared_barrier(self._shared, frame, deadline)
            elif self.size > 1:
                if self.size > 2:  # who arrived, for naming the late ranks (with 2: the peer)
                    self._store.set(f"barrier/{self.rank}", str(seq).encode())
                algorithms.get("barrier", algorithms.select("barrier", 0, self.size, self._override))(
                    self._transport, self._frame("barrier", seq, None), deadline)

        try:
            self._submit("barrier", seq, self._order.all_channels, body, False, timeout=timeout)
        except CommTimeoutError as exc:
            raise self._name_late_ranks(exc, seq) from None

    def _name_late_ranks(self, exc: CommTimeoutError, seq: int) -> CommTimeoutError:
        """Name who never reached barrier ``seq``, not the peer the dissemination step waited on."""
        ranks = (ranks_behind(self._store, "barrier", self.size, self.rank, seq)
                 if self.size > 2 and not self._all_shared else None)  # shm names them itself
        if ranks:
            head, sep, tail = str(exc.args[0]).partition(" (the limit is")
            exc.args = (f"rank {self.rank}: barrier #{seq} timed out: rank(s) {ranks} did not "
                        f"reach it{sep}{tail}",)
            exc.peer = ranks[0]
        return exc

    def _split(self, color: Optional[int], key: int) -> Optional["CPUCommunicator"]:
        seq = self._next_seq()
        self._splits += 1
        number = self._splits
        mine = np.array([-1 if color is None else color, key], dtype=np.int64)
        table = np.empty((self.size, 2), dtype=np.int64)

        def body(deadline: float):
            if self.size > 1:
                fn = algorithms.get("all_gather", "direct")
                fn(self._transport, mine, _flat(table), self._frame("split", seq, np.int64), deadline)
            else:
                table[0] = mine
            return table

        self._submit("split", seq, self._order.all_channels, body, False)
        if color is None:
            return None
        members = sorted((int(k), r) for r, (c, k) in enumerate(table) if c == color)
        ranks = [r for _, r in members]
        return self._child(CPUCommunicator(
            self._root_store, ranks.index(self.rank), len(ranks),
            comm_id=f"{self.comm_id}/split{number}/color{color}", token=self._token,
            timeout=self.timeout, owns_store=False, **self._settings), ranks)

    def _shrink(self, timeout: float) -> "CPUCommunicator":
        """Abort this communicator, agree on the survivors, connect a fresh socket mesh."""
        self._shrinks += 1
        number = self._shrinks
        self._abort_with(f"shrink() called on rank {self.rank}")
        agreed = agree_on_survivors(self._store, self._root_store, self.rank, self.ranks,
                                    f"shrink{number}", timeout)
        members = agreed.members
        child = CPUCommunicator(
            self._root_store, members.index(self.rank), len(members),
            comm_id=f"{self.comm_id}/shrink{number}", token=self._token, timeout=self.timeout,
            owns_store=self._owns_store, **self._settings)
        self._owns_store = False  # the new communicator closes the store now
        child.lost = {self.to_world(r): why for r, why in agreed.lost.items()}
        return self._child(child, members)

    def _grow(self, timeout: float, min_size: int) -> "CPUCommunicator":
        """Agree with the members on who joins; a fresh socket mesh with them (if any)."""
        return grow_communicator(self, timeout, min_size, lambda comm_id, rank, size: CPUCommunicator(
            self._root_store, rank, size, comm_id=comm_id, token=self._token,
            timeout=self.timeout, owns_store=False, **self._settings))

    def abort(self) -> None:
        """Abort at once: pending and later operations raise ``CommAbortedError``."""
        self._abort_with(f"abort() called on rank {self.rank}")
        self._release_store()

    def _abort_for(self, reason: str) -> None:
        self._abort_with(reason)
        self._release_store()

    def close(self, timeout: Optional[float] = None) -> None:
        """Close after checking with every peer that no message was left unreceived.

        Collective: waits (at most ``timeout``, default the communicator's) for the peers'
        close. Raises ``CollectiveMismatchError`` when a peer had sent data nobody received
        (e.g. ranks that disagreed on a broadcast root), and ``CommTimeoutError`` naming the
        peers still connected but silent at the timeout (cut off, or not closing): as any
        collective, close never lets a fault pass unreported. A peer that already exited is
        fine. Resources are released in every case. Idempotent; after an abort it only
        releases resources.
        """
        if self._closed:
            return
        if self._aborted is not None:
            self._closed = True
            self._release_store()
            return
        limit = self.timeout if timeout is None else timeout
        entry = self._order.issue(self._order.all_channels)
        problems: List[str] = []
        silent: List[int] = []
        try:
            if self._order.acquire(entry, time.monotonic() + limit, lambda: self._aborted is not None):
                problems, silent = self._transport.close_handshake(time.monotonic() + limit)
        finally:
            self._order.release(entry)
            self._closed = True
            self._transport.close()
            if self._shared is not None:
                self._shared.close()
            self._release_store()
        if problems:
            raise CollectiveMismatchError(
                f"rank {self.rank}: messages were left unreceived at close: " + "; ".join(problems),
                rank=self.rank)
        if silent:
            raise CommTimeoutError(
                f"rank {self.rank}: close timed out waiting for peer(s) {silent} to close; their "
                f"connections stayed open but silent (cut off, or not closing)", rank=self.rank,
                peer=silent[0] if len(silent) == 1 else None, op="close", limit=limit)

    def __del__(self):  # best effort: never leave sockets behind
        try:
            if not self._closed and self._aborted is None:
                self._transport.close()
        except Exception:
            pass
