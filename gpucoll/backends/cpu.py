"""CPU backend: NumPy arrays, collectives run by ``gpucoll.algorithms`` over the socket transport.

Ordering: every operation takes its place in a per-channel queue (one channel per peer and
direction) when it is *issued*, in program order, and touches the wire only when it is first
in every queue it uses. Collectives use every channel; ``send``/``isend`` to rank p only
"send to p", ``recv``/``irecv`` from p only "receive from p". So messages appear on each
connection in issue order, asynchronous point-to-point transfers in opposite directions
progress together (no deadlock when two ranks both isend a large array and then irecv), and
a blocking collective issued after ``async_op`` work runs after it.

CuPy arrays (anything with ``__cuda_array_interface__``) are staged through host memory and
the result is copied back into the device array, so several processes can share a GPU
without NCCL.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .. import algorithms
from ..algorithms.direct import byte_view
from ..communicator import Communicator
from ..errors import (CollectiveMismatchError, CommAbortedError, CommTimeoutError, GpucollError,
                      PeerError)
from ..rendezvous.store import PrefixStore, Store
from ..transports.base import Frame, Recv
from ..transports.socket import SocketTransport
from ..types import ReduceOp, combine_fn, finish_avg, wire_code
from ..work import Work
from . import signature
from .ordering import Channel, OpOrder
from .staging import Staged

__all__ = ["CPUCommunicator"]

def _flat(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1)


class CPUCommunicator(Communicator):
    """Communicator over NumPy arrays (CuPy arrays are staged through the host)."""

    backend = "cpu"

    def __init__(self, store: Store, rank: int, size: int, *, comm_id: str, token: str,
                 timeout: float, transport_mode: str = "auto", advertise_host: str = "127.0.0.1",
                 socket_buffer: int = 0, chunk_bytes: int = 256 << 10,
                 ring_threshold: int = 256 << 10, algorithm_override: Optional[dict] = None,
                 debug: bool = False, owns_store: bool = True):
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is out of range for world_size={size}")
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        self.comm_id = comm_id
        self._root_store = store
        self._owns_store = owns_store
        self._store = PrefixStore(comm_id, store)
        self._token = token
        self._settings = dict(transport_mode=transport_mode, advertise_host=advertise_host,
                              socket_buffer=socket_buffer, chunk_bytes=chunk_bytes,
                              ring_threshold=ring_threshold, algorithm_override=algorithm_override,
                              debug=debug)
        self._ring_threshold = ring_threshold
        self._override = algorithm_override or {}
        self._debug = debug
        self._transport = SocketTransport.connect(
            self._store, rank, size, comm_id=comm_id, token=token, timeout=self.timeout,
            mode=transport_mode, advertise_host=advertise_host, buffer_bytes=socket_buffer,
            chunk_bytes=chunk_bytes)
        host_ids = self._host_ids()
        self.local_rank = sum(1 for r in range(rank) if host_ids[r] == host_ids[rank])
        self.local_size = sum(1 for h in host_ids if h == host_ids[rank])
        self._order = OpOrder(rank, size)
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._p2p_seq: Dict[Channel, int] = defaultdict(int)
        self._splits = 0
        self._aborted: Optional[str] = None
        self._closed = False

    def _host_ids(self) -> List[str]:
        import json

        if self.size == 1:
            return [""]
        return [json.loads(self._store.get(f"addr/{r}", self.timeout))["host_id"]
                for r in range(self.size)]

    @property
    def transport_kinds(self) -> Dict[int, str]:
        """peer -> "unix" or "tcp": the link used to each peer."""
        return dict(self._transport.kinds)

    # ------------------------------------------------------------------ execution
    def _next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def _check_alive(self) -> None:
        if self._aborted is not None:
            raise CommAbortedError(f"rank {self.rank}: communicator was aborted ({self._aborted}); "
                                   f"create a new one")
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: communicator is closed")

    def _submit(self, name: str, seq: int, channels: Sequence[Channel],
                body: Callable[[float], object], async_op: bool, timeout: Optional[float] = None):
        """Run ``body(deadline)`` in issue order, now or (async_op) on a worker thread."""
        self._check_alive()
        entry = self._order.issue(channels)
        limit = self.timeout if timeout is None else timeout
        if not async_op:
            return self._execute(name, seq, entry, body, limit)
        work = Work(name, seq, self.rank, limit * 2, on_timeout=self._abort_with)

        def run() -> None:
            try:
                result = self._execute(name, seq, entry, body, limit)
            except BaseException as exc:  # handed to wait()
                work._finish(exception=exc)
            else:
                work._finish(result)

        threading.Thread(target=run, name=f"gpucoll-{name}-{seq}", daemon=True).start()
        return work

    def _execute(self, name: str, seq: int, entry, body, limit: float):
        start = time.monotonic()
        try:
            if not self._order.acquire(entry, start + limit, lambda: self._aborted is not None):
                self._check_alive()
                raise CommTimeoutError(
                    f"rank {self.rank}: {name} #{seq} could not start within {limit:g} s: earlier "
                    f"operations on this communicator did not finish",
                    rank=self.rank, op=name, seq=seq, limit=limit)
            self._check_alive()
            return body(time.monotonic() + limit)
        except GpucollError as exc:
            if isinstance(exc, CommAbortedError):
                raise
            if self._aborted is not None and not isinstance(exc, CollectiveMismatchError):
                raise CommAbortedError(
                    f"rank {self.rank}: {name} #{seq} failed because the communicator was "
                    f"aborted ({self._aborted})") from exc
            if isinstance(exc, CommTimeoutError):
                exc.add_limit(limit)
            self._abort_with(str(exc))
            raise self._explain(exc)
        finally:
            self._order.release(entry)

    def _explain(self, exc: GpucollError) -> GpucollError:
        """Add what a dead or failing peer left in the store about why it stopped."""
        peer = getattr(exc, "peer", None)
        if not isinstance(exc, PeerError) or peer is None:
            return exc
        try:
            if self._store.check([f"abort/{peer}"]):
                reason = self._store.get(f"abort/{peer}", 1.0).decode(errors="replace")
                exc.args = (f"{exc.args[0]} (peer {peer} reported: {reason})",)
        except Exception:  # the store may be gone with the peer
            pass
        return exc

    def _abort_with(self, reason: str) -> None:
        if self._aborted is not None:
            return
        self._aborted = reason
        try:
            self._store.set(f"abort/{self.rank}", reason.encode())
        except Exception:
            pass
        self._transport.close()
        self._order.wake()

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
    def _all_reduce(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        seq = self._next_seq()
        src, dst = Staged(x, stream), (Staged(out, stream) if out is not None else None)
        target = dst if dst is not None else src

        def body(deadline: float):
            self._debug_check("all_reduce", seq, deadline, src.host.dtype, src.host.shape, op)
            if target is not src:
                np.copyto(target.host, src.host)
            flat = _flat(target.host)
            if self.size > 1:
                fn = self._algorithm("all_reduce", flat.nbytes, flat.itemsize)
                fn(self._transport, flat, combine_fn(op, flat.dtype),
                   self._frame("all_reduce", seq, flat.dtype), deadline)
            if op is ReduceOp.AVG:
                finish_avg(flat, self.size)
            target.write_back()
            return target.caller

        return self._submit("all_reduce", seq, self._order.all_channels, body, async_op)

    def _broadcast(self, x, root: int, async_op: bool, stream=None):
        seq = self._next_seq()
        buf = Staged(x, stream)

        def body(deadline: float):
            self._debug_check("broadcast", seq, deadline, buf.host.dtype, buf.host.shape, root=root)
            flat = _flat(buf.host)
            if self.size > 1:
                fn = self._algorithm("broadcast", flat.nbytes, flat.itemsize)
                fn(self._transport, flat, root, self._frame("broadcast", seq, flat.dtype), deadline)
            if self.rank != root:
                buf.write_back()
            return buf.caller

        return self._submit("broadcast", seq, self._order.all_channels, body, async_op)

    def _reduce(self, x, root: int, op: ReduceOp, out, async_op: bool, stream=None):
        seq = self._next_seq()
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else (src if self.rank == root else None)

        def body(deadline: float):
            self._debug_check("reduce", seq, deadline, src.host.dtype, src.host.shape, op, root)
            send = _flat(src.host)
            result = _flat(dst.host) if dst is not None else None
            if self.size > 1:
                fn = self._algorithm("reduce", send.nbytes, send.itemsize)
                fn(self._transport, send, result, root, combine_fn(op, send.dtype),
                   self._frame("reduce", seq, send.dtype), deadline)
            elif result is not None and result is not send:
                np.copyto(result, send)
            if dst is None:
                return None
            if op is ReduceOp.AVG:
                finish_avg(result, self.size)
            dst.write_back()
            return dst.caller

        return self._submit("reduce", seq, self._order.all_channels, body, async_op)

    def _all_gather(self, x, out, async_op: bool, stream=None):
        seq = self._next_seq()
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else Staged.empty(
            (self.size,) + src.host.shape, src.host.dtype, like=src, stream=stream)

        def body(deadline: float):
            self._debug_check("all_gather", seq, deadline, src.host.dtype, src.host.shape)
            send, result = _flat(src.host), _flat(dst.host)
            if self.size > 1:
                fn = self._algorithm("all_gather", send.nbytes * self.size, send.itemsize)
                fn(self._transport, send, result, self._frame("all_gather", seq, send.dtype), deadline)
            else:
                np.copyto(result, send)
            dst.write_back()
            return dst.caller

        return self._submit("all_gather", seq, self._order.all_channels, body, async_op)

    def _reduce_scatter(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        seq = self._next_seq()
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else Staged.empty(
            src.host.shape[1:], src.host.dtype, like=src, stream=stream)

        def body(deadline: float):
            self._debug_check("reduce_scatter", seq, deadline, src.host.dtype, src.host.shape, op)
            send, result = _flat(src.host), _flat(dst.host)
            if self.size > 1:
                fn = self._algorithm("reduce_scatter", send.nbytes, send.itemsize)
                fn(self._transport, send, result, combine_fn(op, send.dtype),
                   self._frame("reduce_scatter", seq, send.dtype), deadline)
            else:
                np.copyto(result, send)
            if op is ReduceOp.AVG:
                finish_avg(result, self.size)
            dst.write_back()
            return dst.caller

        return self._submit("reduce_scatter", seq, self._order.all_channels, body, async_op)

    def _gather(self, x, root: int, out, stream=None):
        seq = self._next_seq()
        src = Staged(x, stream)
        dst = None
        if self.rank == root:
            dst = Staged(out, stream) if out is not None else Staged.empty(
                (self.size,) + src.host.shape, src.host.dtype, like=src, stream=stream)

        def body(deadline: float):
            self._debug_check("gather", seq, deadline, src.host.dtype, src.host.shape, root=root)
            send = _flat(src.host)
            result = _flat(dst.host) if dst is not None else None
            if self.size > 1:
                fn = self._algorithm("gather", send.nbytes * self.size, send.itemsize)
                fn(self._transport, send, result, root, self._frame("gather", seq, send.dtype), deadline)
            else:
                np.copyto(result, send)
            if dst is None:
                return None
            dst.write_back()
            return dst.caller

        return self._submit("gather", seq, self._order.all_channels, body, False)

    def _scatter(self, x, root: int, out, template, stream=None):
        seq = self._next_seq()
        src = Staged(x, stream) if self.rank == root else None
        if out is not None:
            dst = Staged(out, stream)
        else:
            chunk, dtype = template
            dst = Staged.empty(chunk, dtype, like=src, stream=stream)

        def body(deadline: float):
            self._debug_check("scatter", seq, deadline, dst.host.dtype, dst.host.shape, root=root)
            result = _flat(dst.host)
            send = _flat(src.host) if src is not None else None
            if self.size > 1:
                fn = self._algorithm("scatter", result.nbytes * self.size, result.itemsize)
                fn(self._transport, send, result, root, self._frame("scatter", seq, result.dtype),
                   deadline)
            else:
                np.copyto(result, send)
            dst.write_back()
            return dst.caller

        return self._submit("scatter", seq, self._order.all_channels, body, False)

    def _all_to_all(self, x, out, stream=None):
        seq = self._next_seq()
        src = Staged(x, stream)
        dst = Staged(out, stream) if out is not None else Staged.empty(
            src.host.shape, src.host.dtype, like=src, stream=stream)

        def body(deadline: float):
            self._debug_check("all_to_all", seq, deadline, src.host.dtype, src.host.shape)
            send, result = _flat(src.host), _flat(dst.host)
            if self.size > 1:
                fn = self._algorithm("all_to_all", send.nbytes, send.itemsize)
                fn(self._transport, send, result, self._frame("all_to_all", seq, send.dtype), deadline)
            else:
                np.copyto(result, send)
            dst.write_back()
            return dst.caller

        return self._submit("all_to_all", seq, self._order.all_channels, body, False)

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

        return self._submit("send", frame.seq, [("send", dst)], body, async_op)

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
            if self.size > 1:
                algorithms.get("barrier", algorithms.select("barrier", 0, self.size, self._override))(
                    self._transport, self._frame("barrier", seq, None), deadline)

        self._submit("barrier", seq, self._order.all_channels, body, False, timeout=timeout)

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

    def abort(self) -> None:
        """Abort at once: pending and later operations raise ``CommAbortedError``."""
        self._abort_with(f"abort() called on rank {self.rank}")
        self._release_store()

    def close(self, timeout: Optional[float] = None) -> None:
        """Close after checking with every peer that no message was left unreceived.

        Collective: waits (at most ``timeout``, default the communicator's) for the peers'
        close. Raises ``CollectiveMismatchError`` when a peer had sent data nobody received
        (e.g. ranks that disagreed on a broadcast root). Idempotent; after an abort it only
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
        try:
            if self._order.acquire(entry, time.monotonic() + limit, lambda: self._aborted is not None):
                problems = self._transport.close_handshake(time.monotonic() + limit)
        finally:
            self._order.release(entry)
            self._closed = True
            self._transport.close()
            self._release_store()
        if problems:
            raise CollectiveMismatchError(
                f"rank {self.rank}: messages were left unreceived at close: " + "; ".join(problems),
                rank=self.rank)

    def __del__(self):  # best effort: never leave sockets behind
        try:
            if not self._closed and self._aborted is None:
                self._transport.close()
        except Exception:
            pass
