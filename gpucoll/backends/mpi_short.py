"""The MPI backend's short paths: blocking collectives on host NumPy arrays, straight to mpi4py.

The general path (``MPICommunicator._collective``) stages every array, builds closures and
waits through several layers: about 20 µs of Python per call, several times MPI's own cost
for a small message. The common case needs none of it: a blocking ``all_reduce``,
``broadcast``, ``all_gather`` or ``reduce_scatter`` whose arrays are NumPy arrays (host
DLPack arrays such as torch CPU tensors arrive here as NumPy views), with GPUCOLL_DEBUG off.
These methods hand the arrays to mpi4py as they are and wait for the request against the
same deadline, with the same checks, results and errors (the backend's own ``_poll`` and
``_failed``: timeout, abort, MPI failure; the arguments were checked by ``Communicator``).
``async_op``, GPUCOLL_DEBUG (its signature check) and device arrays keep the general path.

In-place all-reduces above :data:`PIECES_ABOVE` go in pieces of :data:`PIECE_BYTES`, one
after the other: on Open MPI, the in-place all-reduce of 8 MiB and more is 1.4 to 2 times
faster on cache-sized pieces than in one call (non-blocking and blocking alike), which also
beats an out-of-place call into a scratch buffer plus a copy back, and needs no memory
(measured in bench/RESULTS.md). Every rank cuts the same message into the same pieces, and
the pieces share the call's one deadline and sequence number.

With ``GPUCOLL_MPI_BLOCKING=1`` (``blocking=True``) these paths call MPI's blocking
collectives under a :class:`~.mpi_blocking.BlockingWatchdog` instead (see that module).
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import numpy as np

from ..types import ReduceOp, finish_avg
from .mpi_types import reduction

__all__ = ["HostShortPaths", "PIECE_BYTES", "PIECES_ABOVE"]

PIECE_BYTES = 1 << 20   # an in-place all-reduce above PIECES_ABOVE goes in pieces of this size
PIECES_ABOVE = 2 << 20

_QUICK_TESTS = 32  # bare Tests before the general wait (about 10 µs)

_EXPORTS_BUFFER: Dict[np.dtype, bool] = {}


def _buffer(array: np.ndarray) -> np.ndarray:
    """``array`` itself when NumPy exports its buffer (mpi4py reads it without a copy), else
    a flat byte view (ml_dtypes' bfloat16 has no buffer format)."""
    dtype = array.dtype
    exports = _EXPORTS_BUFFER.get(dtype)
    if exports is None:
        try:
            memoryview(np.empty(1, dtype))
            exports = True
        except (TypeError, ValueError, BufferError):
            exports = False
        _EXPORTS_BUFFER[dtype] = exports
    return array if exports else array.reshape(-1).view(np.uint8)


def _each(method, in_place, pieces, mpi_op) -> None:
    """``method(in_place, piece, mpi_op)`` for every piece (blocking mode)."""
    for piece in pieces:
        method(in_place, piece, mpi_op)


class HostShortPaths:
    """The short paths of ``MPICommunicator`` (see module doc). Relies on its ``_comm``,
    ``_MPI``, ``_watchdog``, ``_check_alive``, ``_next_seq``, ``_failed`` and ``_poll``."""

    def _short(self, async_op: bool, x, out) -> bool:
        """Whether a call may take the short path."""
        return (not async_op and type(x) is np.ndarray and not self._debug
                and (out is None or type(out) is np.ndarray))

    # ------------------------------------------------------------------ waiting
    def _await(self, request, name: str, seq: int, started: Optional[float] = None) -> None:
        """Wait for ``request`` until the timeout counted from ``started`` (default now): a
        few bare Tests first (a small message is done within them, and the abort check and
        clock of ``_poll`` would only delay noticing it), then ``_poll``."""
        test = request.Test
        try:
            for _ in range(_QUICK_TESTS):
                if test():
                    return
        except self._MPI.Exception as exc:
            raise self._failed(name, seq, exc) from None
        if started is None:
            started = time.monotonic()
        self._poll(request, name, seq, started + self.timeout, started=started)

    def _start(self, name: str, seq: int, method, *args):
        """``method(*args)`` (a non-blocking mpi4py call): its request, MPI errors as ours."""
        try:
            return method(*args)
        except self._MPI.Exception as exc:
            raise self._failed(name, seq, exc) from None

    def _blocking(self, name: str, seq: int, method, *args) -> None:
        """``method(*args)`` (a blocking mpi4py call) under the watchdog."""
        watchdog = self._watchdog
        watchdog.arm(name, seq)
        try:
            method(*args)
        except self._MPI.Exception as exc:
            raise self._failed(name, seq, exc) from None
        finally:
            watchdog.disarm()

    # ------------------------------------------------------------------ collectives
    def _host_all_reduce(self, x: np.ndarray, op: ReduceOp, out: Optional[np.ndarray]):
        self._check_alive()
        seq = self._next_seq()
        datatype, mpi_op = reduction(op, x.dtype)
        result = x if out is None else out
        recv = [_buffer(result), datatype]
        send = self._MPI.IN_PLACE if out is None else [_buffer(x), datatype]
        if out is None and x.nbytes > PIECES_ABOVE:
            self._all_reduce_pieces(result, datatype, mpi_op, seq)
        elif self._watchdog is not None:
            self._blocking("all_reduce", seq, self._comm.Allreduce, send, recv, mpi_op)
        else:
            self._await(self._start("all_reduce", seq, self._comm.Iallreduce, send, recv,
                                    mpi_op), "all_reduce", seq)
        if op is ReduceOp.AVG:
            finish_avg(result.reshape(-1), self.size)
        return result

    def _all_reduce_pieces(self, result: np.ndarray, datatype, mpi_op, seq: int) -> None:
        """In-place all-reduce of ``result`` in pieces of about PIECE_BYTES (whole elements),
        one after the other, under one deadline (one watchdog arming in blocking mode)."""
        flat = result.reshape(-1).view(np.uint8)
        step = max(PIECE_BYTES // result.itemsize, 1) * result.itemsize
        pieces = [[flat[begin:begin + step], datatype] for begin in range(0, flat.size, step)]
        in_place = self._MPI.IN_PLACE
        if self._watchdog is not None:
            self._blocking("all_reduce", seq, _each, self._comm.Allreduce, in_place, pieces,
                           mpi_op)
            return
        started = time.monotonic()
        for piece in pieces:
            request = self._start("all_reduce", seq, self._comm.Iallreduce, in_place, piece,
                                  mpi_op)
            self._await(request, "all_reduce", seq, started)

    def _host_broadcast(self, x: np.ndarray, root: int):
        self._check_alive()
        seq = self._next_seq()
        buf = [_buffer(x), self._MPI.BYTE]
        if self._watchdog is not None:
            self._blocking("broadcast", seq, self._comm.Bcast, buf, root)
        else:
            self._await(self._start("broadcast", seq, self._comm.Ibcast, buf, root),
                        "broadcast", seq)
        return x

    def _host_all_gather(self, x: np.ndarray, out: Optional[np.ndarray]):
        self._check_alive()
        seq = self._next_seq()
        if out is None:
            out = np.empty((self.size,) + x.shape, x.dtype)
        BYTE = self._MPI.BYTE
        send, recv = [_buffer(x), BYTE], [_buffer(out), BYTE]
        if self._watchdog is not None:
            self._blocking("all_gather", seq, self._comm.Allgather, send, recv)
        else:
            self._await(self._start("all_gather", seq, self._comm.Iallgather, send, recv),
                        "all_gather", seq)
        return out

    def _host_reduce_scatter(self, x: np.ndarray, op: ReduceOp, out: Optional[np.ndarray]):
        self._check_alive()
        seq = self._next_seq()
        if out is None:
            out = np.empty(x.shape[1:], x.dtype)
        datatype, mpi_op = reduction(op, x.dtype)
        send, recv = [_buffer(x), datatype], [_buffer(out), datatype]
        if self._watchdog is not None:
            self._blocking("reduce_scatter", seq, self._comm.Reduce_scatter_block, send, recv,
                           mpi_op)
        else:
            self._await(self._start("reduce_scatter", seq, self._comm.Ireduce_scatter_block,
                                    send, recv, mpi_op), "reduce_scatter", seq)
        if op is ReduceOp.AVG:
            finish_avg(out.reshape(-1), self.size)
        return out
