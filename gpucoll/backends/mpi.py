"""MPI backend: the public API through mpi4py, for jobs started by mpiexec / mpirun / srun --mpi.

Every operation is MPI's non-blocking form (``Iallreduce``, ``Ibcast``, ``Isend``...). A
blocking call polls its request against the communicator's timeout, so a dead, stuck or
absent peer raises ``CommTimeoutError`` naming the op and its sequence number instead of
blocking forever (MPI itself would); the communicator is then aborted. ``async_op=True``,
``isend`` and ``irecv`` return a :class:`MPIWork` over the request, polled the same way by
``wait()``; ``sendrecv`` is an ``Irecv`` and an ``Isend`` waited together (the default of
:mod:`gpucoll.sendrecv`), ``batch_isend_irecv`` every ``Irecv`` then every ``Isend`` of its list
(:mod:`gpucoll.batch_p2p`), ``scan`` / ``exscan`` MPI's ``Iscan`` / ``Iexscan`` where MPI
reduces the dtype natively (:mod:`.mpi_scan`), ``reduce_scatter_v`` MPI's ``Ireduce_scatter``
with receive counts (:mod:`.mpi_uneven`). Blocking collectives on host NumPy arrays take
the short paths of :mod:`.mpi_short` (with GPUCOLL_MPI_BLOCKING=1, MPI's blocking forms
under the watchdog of :mod:`.mpi_blocking`). MPI orders collectives by issue order, and
messages between two ranks arrive in send order.

Semantics match the other backends: shapes, in-place rules, ``out=``, ops (see
:mod:`.mpi_types`: AVG is SUM then the shared division), usage errors (checked by
``Communicator`` before anything is sent). Tags are checked, not used for matching: a receive
takes the next message from its source and a different tag or size is a
``CollectiveMismatchError``. Host arrays (NumPy, torch CPU tensors, DLPack) are used in
place; device arrays are handed to MPI directly when the library is CUDA-aware, else staged
through host memory like the CPU backend does.

The world communicator is a duplicate of ``MPI.COMM_WORLD`` (``Idup``), so gpucoll's traffic
never mixes with the program's own mpi4py calls.
"""

from __future__ import annotations

import hashlib
import itertools
import socket
import os
import threading
import time
from typing import Any, Callable, Dict, Optional

import numpy as np

from .. import cuda_env
from ..communicator import Communicator
from ..errors import (CollectiveMismatchError, CommAbortedError, CommTimeoutError, GpucollError,
                      PeerError)
from ..hostarrays import host_view, like_caller
from ..types import ReduceOp, finish_avg
from ..work import LiveProbe, Work
from . import mpi_types, signature
from .mpi_blocking import BlockingWatchdog
from .mpi_scan import MPIPrefixReductions
from .mpi_uneven import MPIUnevenScatters
from .mpi_short import HostShortPaths
from .mpi_types import byte_spec, mpi, reduction
from .staging import Staged, as_cupy_stream, refuse_capture

__all__ = ["MPICommunicator", "MPIWork", "mpi_factory"]

_SPIN_SECONDS = 200e-6  # poll without sleeping this long (latency), then yield the core
_YIELD_SECONDS = 0.05   # between Tests until this long (large messages), then back off to 1 ms


class _Direct:
    """A device array MPI reads and writes itself (CUDA-aware MPI): no staging."""

    __slots__ = ("host", "caller")

    def __init__(self, array, stream) -> None:
        cupy = cuda_env.cupy_module()
        stream = as_cupy_stream(cupy, stream) or cupy.cuda.get_current_stream()
        refuse_capture(stream, "mpi")  # MPI would read the memory now, before the graph ran
        stream.synchronize()  # MPI reads after the stream
        self.host = self.caller = array

    def write_back(self) -> None:
        pass


class MPIWork(Work):
    """A ``Work`` over one MPI request; ``wait()`` polls it against the timeout.

    When ``wait()`` returns, the operation has finished (its output holds the result, the
    input may be reused), as on the CPU backend.
    """

    def __init__(self, comm: "MPICommunicator", op: str, seq: int, request,
                 finish: Callable[[], Any], status=None):
        super().__init__(op, seq, comm.rank, comm.timeout)
        self._comm, self._request, self._finish_op, self._status = comm, request, finish, status
        self._lock = threading.Lock()

    def _settle(self, wait_seconds: Optional[float]) -> None:
        with self._lock:
            if self._done.is_set():
                return
            try:
                if wait_seconds is None:
                    if not self._comm._test(self._request, self.op, self.seq, self._status):
                        return
                else:
                    self._comm._poll(self._request, self.op, self.seq,
                                     time.monotonic() + wait_seconds, self._status)
                result = self._finish_op()
            except BaseException as exc:
                self._finish(exception=exc)
            else:
                self._finish(result)

    def _trace_probe(self) -> LiveProbe:
        return LiveProbe(self)  # reading the trace tests the request while the Work lives

    def is_completed(self) -> bool:
        """True once the request has completed (tests it; never blocks)."""
        self._settle(None)
        return self._done.is_set()

    def exception(self) -> Optional[BaseException]:
        self._settle(None)
        return super().exception()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Poll until the operation finished (at most ``timeout``, default the communicator's).

        Raises:
            CommTimeoutError: not finished in time (the communicator is aborted).
            The operation's own error (PeerError, CollectiveMismatchError...).
        """
        self._settle(self._default_timeout if timeout is None else timeout)
        if self._exception is not None:
            raise self._exception
        return True


def _host_key() -> int:
    digest = hashlib.sha1(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:7], "little")


class MPICommunicator(HostShortPaths, MPIPrefixReductions, MPIUnevenScatters, Communicator):
    """Communicator over an mpi4py communicator (see module doc).

    Args:
        mpi_comm: the mpi4py communicator (gpucoll's own duplicate).
        comm_id: a name for this communicator.
        timeout: seconds a blocking call may wait.
        debug: GPUCOLL_DEBUG: compare each collective's signature across ranks first.
        blocking: GPUCOLL_MPI_BLOCKING: the short paths call MPI's blocking collectives,
            bounded by a watchdog that ends the process at the timeout (see
            :mod:`.mpi_blocking`).
    """

    backend = "mpi"
    memory = "host"
    _converts_arrays = True

    def __init__(self, mpi_comm, *, comm_id: str, timeout: float, debug: bool = False,
                 blocking: bool = False):
        self._comm, self._MPI = mpi_comm, mpi()
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.comm_id, self.timeout, self._debug = comm_id, float(timeout), debug
        self._seqs = itertools.count(1)  # next() is atomic: no lock on every call
        self._p2p: Dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._aborted: Optional[str] = None
        self._closed = False
        self._splits = 0
        self._direct: Optional[bool] = None
        self._tag_ub = int(mpi_comm.Get_attr(mpi().TAG_UB) or 32767)
        self._watchdog: Optional[BlockingWatchdog] = None
        hosts = self._table(np.array([_host_key()], np.int64), "init")
        same = [r for r in range(self.size) if hosts[r, 0] == hosts[self.rank, 0]]
        self.local_rank, self.local_size = same.index(self.rank), len(same)
        if blocking:
            self._watchdog = BlockingWatchdog(self.rank, self.size, self.timeout)

    # ------------------------------------------------------------------ arrays
    def _import_array(self, x, name: str):
        return host_view(x, name)

    def _export(self, result, like):
        return like_caller(result, like)

    def _stage(self, array, stream):
        if array is None:
            return None
        if hasattr(array, "__cuda_array_interface__"):
            if self._direct is None:
                self._direct = mpi_types.cuda_aware()
            if self._direct:
                return _Direct(array, stream)
        return Staged(array, stream, "mpi")

    def _new_staged(self, shape, dtype, like, stream):
        """A result buffer beside ``like`` (a device array the MPI library takes directly, or
        a staged one); not ``_empty``, which the composite collectives call for host arrays."""
        if isinstance(like, _Direct):
            return _Direct(cuda_env.cupy_module().empty(shape, dtype), stream)
        return Staged.empty(shape, dtype, like=like, stream=stream)

    # ------------------------------------------------------------------ progress
    def _next_seq(self) -> int:
        return next(self._seqs)

    def _failed(self, name: str, seq: int, exc: BaseException) -> GpucollError:
        """An MPI error as gpucoll's: a truncated message is a mismatch, others a peer error."""
        MPI = mpi()
        text = exc.Get_error_string() if isinstance(exc, MPI.Exception) else str(exc)
        truncated = isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_TRUNCATE
        kind = CollectiveMismatchError if truncated else PeerError
        error = kind(f"rank {self.rank}: {name} #{seq} failed in MPI: {text}", rank=self.rank,
                     op=name, seq=seq)
        self._abort_with(str(error))
        return error

    def _test(self, request, name: str, seq: int, status=None) -> bool:
        if self._aborted is not None:
            raise CommAbortedError(f"rank {self.rank}: {name} #{seq} failed because the "
                                   f"communicator was aborted ({self._aborted})")
        try:
            return request.Test(status)
        except mpi().Exception as exc:
            raise self._failed(name, seq, exc) from None

    def _poll(self, request, name: str, seq: int, deadline: float, status=None,
              peer: Optional[int] = None, started: Optional[float] = None) -> None:
        """Test ``request`` until it completes; at ``deadline`` abort and raise (the message
        counts from ``started``, default now)."""
        start = time.monotonic()
        if started is None:
            started = start
        pause = 0.0
        while not self._test(request, name, seq, status):
            now = time.monotonic()
            if now >= deadline:
                who = (f"peer {peer}" if peer is not None else
                       f"the other {self.size - 1} rank(s)")
                message = (f"rank {self.rank}: {name} #{seq} did not complete within "
                           f"{now - started:.3g} s: MPI was still waiting for {who} (dead, stuck, "
                           f"or calling another operation); the communicator was aborted, "
                           f"create a new one")
                self._abort_with(message)
                raise CommTimeoutError(message, rank=self.rank, peer=peer, op=name, seq=seq)
            if now - start > _YIELD_SECONDS:
                pause = min(pause * 2 or 10e-6, 1e-3, max(deadline - now, 0.0))
                time.sleep(pause)
            elif now - start > _SPIN_SECONDS:
                os.sched_yield()  # MPI progresses a non-blocking collective only inside Test

    def _run(self, name: str, seq: int, start: Callable[[], Any], finish: Callable[[], Any],
             async_op: bool, timeout: Optional[float] = None, status=None,
             peer: Optional[int] = None):
        """Start the request, then wait for it (or hand back a Work) and ``finish()``."""
        try:
            request = start()
        except mpi().Exception as exc:
            raise self._failed(name, seq, exc) from None
        if async_op:
            return MPIWork(self, name, seq, request, finish, status)
        limit = self.timeout if timeout is None else timeout
        self._poll(request, name, seq, time.monotonic() + limit, status, peer)
        return finish()

    def _table(self, mine: np.ndarray, name: str, seq: int = 0) -> np.ndarray:
        """Every rank's ``mine`` (int64 row), gathered with the timeout."""
        table = np.empty((self.size, mine.size), np.int64)
        return self._run(name, seq, lambda: self._comm.Iallgather(mine, table),
                         lambda: table, False)

    def _debug_check(self, name: str, seq: int, dtype, shape, op=None, root: int = -1) -> None:
        """GPUCOLL_DEBUG: compare (op, dtype, shape, root, seq) across ranks before the op."""
        if not self._debug or self.size == 1:
            return
        mine = np.frombuffer(signature.pack(name, seq, dtype, shape, op, root), np.uint8)
        table = np.empty((self.size, mine.size), np.uint8)
        self._run("debug_check", seq, lambda: self._comm.Iallgather(mine, table),
                  lambda: None, False)
        error = signature.mismatch_error({r: table[r].tobytes() for r in range(self.size)},
                                         self.rank, name, seq)
        if error is not None:
            self._abort_with(str(error))
            raise error

    def _collective(self, name: str, src, dst, start: Callable[[], Any], async_op: bool, *,
                    op: Optional[ReduceOp] = None, root: Optional[int] = None):
        self._check_alive()
        seq = self._next_seq()
        signed = dst if name == "scatter" else src
        self._debug_check(name, seq, signed.host.dtype, signed.host.shape, op,
                          -1 if root is None else root)

        def finish():
            if dst is None:
                return None
            if op is ReduceOp.AVG:
                finish_avg(dst.host.reshape(-1), self.size)
            if not (name == "broadcast" and self.rank == root):
                dst.write_back()
            return dst.caller

        return self._run(name, seq, start, finish, async_op)

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        if self._short(async_op, x, out):
            return self._host_all_reduce(x, op, out)
        src = self._stage(x, stream)
        dst = self._stage(out, stream) if out is not None else src
        kind, mpi_op = reduction(op, src.host.dtype)
        send = mpi().IN_PLACE if dst is src else byte_spec(src.host, kind)
        return self._collective(
            "all_reduce", src, dst,
            lambda: self._comm.Iallreduce(send, byte_spec(dst.host, kind), mpi_op), async_op,
            op=op)

    def _broadcast(self, x, root: int, async_op: bool, stream=None):
        if self._short(async_op, x, None):
            return self._host_broadcast(x, root)
        buf = self._stage(x, stream)
        return self._collective("broadcast", buf, buf,
                                lambda: self._comm.Ibcast(byte_spec(buf.host), root), async_op,
                                root=root)

    def _reduce(self, x, root: int, op: ReduceOp, out, async_op: bool, stream=None):
        src = self._stage(x, stream)
        dst = (self._stage(out, stream) if out is not None else src) if self.rank == root else None
        kind, mpi_op = reduction(op, src.host.dtype)
        if dst is None:
            send, recv = byte_spec(src.host, kind), None
        else:
            send = mpi().IN_PLACE if dst is src else byte_spec(src.host, kind)
            recv = byte_spec(dst.host, kind)
        return self._collective("reduce", src, dst,
                                lambda: self._comm.Ireduce(send, recv, mpi_op, root), async_op,
                                op=op, root=root)

    def _all_gather(self, x, out, async_op: bool, stream=None):
        if self._short(async_op, x, out):
            return self._host_all_gather(x, out)
        src = self._stage(x, stream)
        dst = self._stage(out, stream) if out is not None else self._new_staged(
            (self.size,) + src.host.shape, src.host.dtype, src, stream)
        return self._collective(
            "all_gather", src, dst,
            lambda: self._comm.Iallgather(byte_spec(src.host), byte_spec(dst.host)), async_op)

    def _reduce_scatter(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        if self._short(async_op, x, out):
            return self._host_reduce_scatter(x, op, out)
        src = self._stage(x, stream)
        dst = self._stage(out, stream) if out is not None else self._new_staged(
            src.host.shape[1:], src.host.dtype, src, stream)
        kind, mpi_op = reduction(op, src.host.dtype)
        return self._collective(
            "reduce_scatter", src, dst,
            lambda: self._comm.Ireduce_scatter_block(byte_spec(src.host, kind),
                                                     byte_spec(dst.host, kind), mpi_op),
            async_op, op=op)

    def _gather(self, x, root: int, out, stream=None):
        src = self._stage(x, stream)
        dst = None
        if self.rank == root:
            dst = self._stage(out, stream) if out is not None else self._new_staged(
                (self.size,) + src.host.shape, src.host.dtype, src, stream)
        return self._collective(
            "gather", src, dst,
            lambda: self._comm.Igather(byte_spec(src.host),
                                       byte_spec(dst.host) if dst is not None else None, root),
            False, root=root)

    def _scatter(self, x, root: int, out, template, stream=None):
        src = self._stage(x, stream) if self.rank == root else None
        if out is not None:
            dst = self._stage(out, stream)
        else:
            chunk, dtype = template
            dst = self._new_staged(chunk, dtype, src, stream)
        return self._collective(
            "scatter", src, dst,
            lambda: self._comm.Iscatter(byte_spec(src.host) if src is not None else None,
                                        byte_spec(dst.host), root),
            False, root=root)

    def _all_to_all(self, x, out, stream=None):
        src = self._stage(x, stream)
        dst = self._stage(out, stream) if out is not None else self._new_staged(
            src.host.shape, src.host.dtype, src, stream)
        return self._collective(
            "all_to_all", src, dst,
            lambda: self._comm.Ialltoall(byte_spec(src.host), byte_spec(dst.host)), False)

    # ------------------------------------------------------------------ point to point
    def _message_number(self, channel: tuple) -> int:
        with self._lock:
            self._p2p[channel] = self._p2p.get(channel, 0) + 1
            return self._p2p[channel]

    def _check_tag_limit(self, tag: int) -> None:
        if tag > self._tag_ub:
            raise ValueError(f"tag={tag} exceeds this MPI library's largest tag (MPI_TAG_UB = "
                             f"{self._tag_ub})")

    def _send(self, x, dst: int, tag: int, async_op: bool, stream=None):
        self._check_alive()
        self._check_tag_limit(tag)
        src = self._stage(x, stream)
        number = self._message_number(("send", dst))
        return self._run("send", number,
                         lambda: self._comm.Isend(byte_spec(src.host), dst, tag),
                         lambda: None, async_op, peer=dst)

    def _recv(self, out, src: int, tag: int, async_op: bool, stream=None):
        self._check_alive()
        self._check_tag_limit(tag)
        dst = self._stage(out, stream)
        number = self._message_number(("recv", src))
        status = mpi().Status()
        expected = dst.host.nbytes

        def finish():
            got_tag, got_bytes = status.Get_tag(), status.Get_count(mpi().BYTE)
            if got_tag != tag or got_bytes != expected:
                error = CollectiveMismatchError(
                    f"rank {self.rank}: recv #{number} from peer {src} expected tag {tag} and "
                    f"{expected} bytes, but the message has tag {got_tag} and {got_bytes} bytes",
                    rank=self.rank, peer=src, op="recv", seq=number)
                self._abort_with(str(error))
                raise error
            dst.write_back()
            return dst.caller

        return self._run("recv", number,
                         lambda: self._comm.Irecv(byte_spec(dst.host), src, mpi().ANY_TAG),
                         finish, async_op, status=status, peer=src)

    # ------------------------------------------------------------------ groups and lifetime
    def _barrier(self, timeout: float) -> None:
        self._check_alive()
        seq = self._next_seq()
        self._run("barrier", seq, self._comm.Ibarrier, lambda: None, False, timeout=timeout)

    def _split(self, color: Optional[int], key: int) -> Optional["MPICommunicator"]:
        self._check_alive()
        seq = self._next_seq()
        self._splits += 1
        # Everyone is known to be here (gathered with the timeout) before MPI's blocking split.
        table = self._table(np.array([-1 if color is None else color, key], np.int64),
                            "split", seq)
        MPI = mpi()
        try:
            child = self._comm.Split(MPI.UNDEFINED if color is None else color, key)
        except MPI.Exception as exc:
            raise self._failed("split", seq, exc) from None
        if child == MPI.COMM_NULL:
            return None
        members = [r for _, r in sorted((int(k), r) for r, (c, k) in enumerate(table)
                                        if c == color)]  # MPI's order: (key, rank)
        return self._child(MPICommunicator(
            child, comm_id=f"{self.comm_id}/split{self._splits}/color{color}",
            timeout=self.timeout, debug=self._debug, blocking=self._watchdog is not None),
            members)

    def _abort_with(self, reason: str) -> None:
        if self._aborted is None:
            self._aborted = reason
            self._trace_dump(reason)

    def abort(self) -> None:
        """Abort: later operations and waits raise ``CommAbortedError``. MPI cannot cancel a
        started collective, so requests still pending stay with MPI until the job ends."""
        self._abort_with(f"abort() called on rank {self.rank}")

    def _abort_for(self, reason: str) -> None:
        self._abort_with(reason)

    def close(self) -> None:
        """Release the MPI communicator (when nothing was aborted). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.close()
        if self._aborted is None:
            try:
                self._comm.Free()
            except mpi().Exception:
                pass


def mpi_factory(store, rank: int, world_size: int, *, comm_id: str, token: str, timeout: float,
                debug: bool = False, owns_store: bool = False, blocking: bool = False,
                **unused) -> MPICommunicator:
    """An ``MPICommunicator`` over a duplicate of ``MPI.COMM_WORLD``; ``blocking``: see
    ``MPICommunicator``.

    Raises:
        ValueError: ``rank`` / ``world_size`` disagree with MPI's.
        CommTimeoutError: not every rank joined within ``timeout``.
    """
    MPI = mpi()
    world = MPI.COMM_WORLD
    if (rank, world_size) != (world.Get_rank(), world.Get_size()):
        raise ValueError(f"init(): rank={rank}, world_size={world_size} disagree with MPI's "
                         f"COMM_WORLD (rank {world.Get_rank()} of {world.Get_size()}); leave "
                         f"rank= and world_size= out under mpiexec")
    duplicate, request = world.Idup()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() >= deadline:
            raise CommTimeoutError(f"rank {rank}: init timed out after {timeout:g} s: not every "
                                   f"MPI rank called gpucoll.init(backend='mpi')", rank=rank,
                                   op="init")
        time.sleep(1e-3)
    return MPICommunicator(duplicate, comm_id=comm_id, timeout=timeout, debug=debug,
                           blocking=blocking)
