"""The MPI backend's ``scan`` and ``exscan``: MPI's own ``Iscan`` / ``Iexscan``.

Used for host (NumPy) arrays of a dtype that MPI reduces with its own datatype and op (see
:mod:`.mpi_types`: every integer, float32/64, complex, bool); rank 0 of ``exscan``, which
MPI leaves undefined, is then set to the op's identity here. float16, bfloat16 and device
arrays take the generic algorithms of :mod:`gpucoll.scan` (recursive doubling, or the
pipelined chain for large arrays) over this backend's point-to-point calls. A blocking scan of NumPy arrays with GPUCOLL_DEBUG off takes the short
path of the other collectives (:mod:`.mpi_short`): the arrays straight to mpi4py, no staging.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..scan import identity
from ..types import ReduceOp
from .mpi_short import _buffer
from .mpi_types import byte_spec, mpi, native_reduction

__all__ = ["MPIPrefixReductions"]

_NATIVE: dict = {}   # (op, dtype): native_reduction's answer (hot path)
_UNKNOWN = object()


class MPIPrefixReductions:
    """Mixin of :class:`~gpucoll.backends.mpi.MPICommunicator` (uses its ``_stage``,
    ``_collective``, ``_comm`` and the short paths' ``_short``, ``_await``, ``_start`` and
    ``_blocking``)."""

    def _scan(self, x: Any, op: ReduceOp, out: Any, exclusive: bool, stream: Any = None):
        if self._short(False, x, out):   # the hot path: NumPy arrays, GPUCOLL_DEBUG off
            key = (op, x.dtype)
            found = _NATIVE.get(key, _UNKNOWN)
            if found is _UNKNOWN:
                found = _NATIVE[key] = native_reduction(op, x.dtype)
            if found is not None:
                return self._host_scan(x, op, out, exclusive, *found)
        found = native_reduction(op, x.dtype) if isinstance(x, np.ndarray) and (
            out is None or isinstance(out, np.ndarray)) else None
        if found is None:
            return super()._scan(x, op, out, exclusive, stream)
        datatype, mpi_op = found
        src = self._stage(x, stream)
        dst = self._stage(out, stream) if out is not None else src
        send = mpi().IN_PLACE if dst is src else byte_spec(src.host, datatype)
        recv = byte_spec(dst.host, datatype)
        if exclusive:
            start = lambda: self._comm.Iexscan(send, recv, mpi_op)  # noqa: E731
        else:
            start = lambda: self._comm.Iscan(send, recv, mpi_op)  # noqa: E731
        result = self._collective("exscan" if exclusive else "scan", src, dst, start, False,
                                  op=op)
        if exclusive and self.rank == 0:
            dst.host.fill(identity(op, x.dtype)[()])
        return result

    def _host_scan(self, x: np.ndarray, op: ReduceOp, out: Any, exclusive: bool, datatype,
                   mpi_op):
        """The short path: ``Iexscan`` / ``Iscan`` (blocking mode: ``Exscan`` / ``Scan``
        under the watchdog) on the NumPy arrays themselves."""
        self._check_alive()
        seq = self._next_seq()
        name = "exscan" if exclusive else "scan"
        result = x if out is None else out
        send = self._MPI.IN_PLACE if out is None else [_buffer(x), datatype]
        recv = [_buffer(result), datatype]
        comm = self._comm
        if self._watchdog is not None:
            self._blocking(name, seq, comm.Exscan if exclusive else comm.Scan, send, recv, mpi_op)
        else:
            self._await(self._start(name, seq, comm.Iexscan if exclusive else comm.Iscan, send,
                                    recv, mpi_op), name, seq)
        if exclusive and self.rank == 0:
            result.fill(identity(op, x.dtype)[()])
        return result
