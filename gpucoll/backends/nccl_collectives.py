"""What each operation of the NCCL backend asks of NCCL: the dtype and op translation, and the
NCCL call and arguments that :meth:`~gpucoll.backends.nccl.NCCLCommunicator._enqueue` launches.

all_reduce, broadcast, reduce, all_gather, reduce_scatter, send, recv and barrier are one NCCL
call each: they hand ``_enqueue`` the NCCL communicator's bound method and its arguments, with
no closure built per call, and read their sequence number and the dtype/op translation's cache
inline. gather, scatter and all_to_all are grouped sends and receives (:mod:`.nccl_grouped`).
Kept apart from the communicator's lifetime, failure handling and the enqueueing itself
(:mod:`.nccl`): this is the code every training step runs. The arguments were checked by
:class:`~gpucoll.communicator.Communicator` before any of these runs.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ..graph_capture import refusal
from ..types import ReduceOp
from . import nccl_runtime

__all__ = ["NCCLCollectives"]


class NCCLCollectives:
    """Mixin of :class:`~gpucoll.backends.nccl.NCCLCommunicator` (uses its ``nccl_comm``,
    ``_nccl``, ``_enqueue``, ``_grouped``, ``_empty``, ``_seq``, ``_debug``, ``_bytes_type``,
    ``_reductions`` and ``_barrier_buffer``)."""

    # ------------------------------------------------------------------ reductions
    def _reduction(self, x: Any, op: ReduceOp) -> Tuple[int, int, int]:
        """(NCCL dtype, element count, NCCL op) for reducing ``x`` with ``op``."""
        try:
            dtype, per_element, reduce_op = self._reductions[(x.dtype, op)]
            return dtype, per_element * x.size, reduce_op
        except KeyError:
            pass
        dtype, count, reduce_op = self._translate_reduction(x, op)
        if x.size:
            self._reductions[(x.dtype, op)] = (dtype, count // x.size, reduce_op)
        return dtype, count, reduce_op

    def _translate_reduction(self, x: Any, op: ReduceOp) -> Tuple[int, int, int]:
        nccl = self._nccl
        if op is ReduceOp.AVG and self.size == 1:
            # the average of one rank is its own value, as is the sum; NCCL before 2.29.7
            # leaves the tail of a one-rank float AVG unwritten (NVIDIA/nccl#1950)
            op = ReduceOp.SUM
        reduce_op = nccl_runtime.nccl_op(nccl, op)
        name = x.dtype.name
        if name in nccl_runtime.REDUCIBLE:
            return nccl_runtime.nccl_dtype(nccl, name), x.size, reduce_op
        if x.dtype.kind == "c" and op in (ReduceOp.SUM, ReduceOp.AVG):
            real = "float32" if x.dtype.itemsize == 8 else "float64"
            return nccl_runtime.nccl_dtype(nccl, real), 2 * x.size, reduce_op
        raise TypeError(f"NCCL cannot reduce dtype {name} with op {op.value} (it reduces "
                        f"{', '.join(sorted(nccl_runtime.REDUCIBLE))}); cast the array or "
                        f"use the cpu backend")

    # ------------------------------------------------------------------ collectives
    # Each passes seq=self._seq + 1 (``_next_seq()``, inlined) and builds the GPUCOLL_DEBUG
    # signature (``check``) only when the debug check runs; all_reduce, the hottest, also
    # inlines ``_reduction``'s cache.
    def _all_reduce(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        try:  # _reduction, its cache inlined
            dtype, per_element, reduce_op = self._reductions[(x.dtype, op)]
            count = per_element * x.size
        except KeyError:
            dtype, count, reduce_op = self._reduction(x, op)
        src = x.data.ptr
        target, dst = (x, src) if out is None else (out, out.data.ptr)
        return self._enqueue(
            "all_reduce", self.nccl_comm.allReduce, stream, async_op, target, seq=self._seq + 1,
            check=(x.dtype, x.shape, op) if self._debug else None,
            args=(src, dst, count, dtype, reduce_op))

    def _broadcast(self, x, root: int, async_op: bool, stream=None):
        ptr = x.data.ptr
        return self._enqueue(
            "broadcast", self.nccl_comm.broadcast, stream, async_op, x, seq=self._seq + 1,
            check=(x.dtype, x.shape, None, root) if self._debug else None,
            args=(ptr, ptr, x.nbytes, self._bytes_type, root))

    def _reduce(self, x, root: int, op: ReduceOp, out, async_op: bool, stream=None):
        dtype, count, reduce_op = self._reduction(x, op)
        src = x.data.ptr
        if self.rank != root:
            target, dst = None, src
        else:
            target, dst = (x, src) if out is None else (out, out.data.ptr)
        return self._enqueue(
            "reduce", self.nccl_comm.reduce, stream, async_op, target, seq=self._seq + 1,
            check=(x.dtype, x.shape, op, root) if self._debug else None,
            args=(src, dst, count, dtype, reduce_op, root))

    def _all_gather(self, x, out, async_op: bool, stream=None):
        if out is None:
            out = self._empty((self.size,) + tuple(x.shape), dtype=x.dtype)
        return self._enqueue(
            "all_gather", self.nccl_comm.allGather, stream, async_op, out, seq=self._seq + 1,
            check=(x.dtype, x.shape) if self._debug else None,
            args=(x.data.ptr, out.data.ptr, x.nbytes, self._bytes_type))

    def _reduce_scatter(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        dtype, count, reduce_op = self._reduction(x, op)
        if out is None:
            out = self._empty(tuple(x.shape[1:]), dtype=x.dtype)
        return self._enqueue(
            "reduce_scatter", self.nccl_comm.reduceScatter, stream, async_op, out,
            seq=self._seq + 1, check=(x.dtype, x.shape, op) if self._debug else None,
            args=(x.data.ptr, out.data.ptr, count // self.size, dtype, reduce_op))

    def _gather(self, x, root: int, out, stream=None):
        if self.rank == root:
            if out is None:
                out = self._empty((self.size,) + tuple(x.shape), dtype=x.dtype)
            block, base = x.nbytes, out.data.ptr
            recvs = [(base + r * block, block, r) for r in range(self.size) if r != root]
            launch = self._grouped([], recvs, [(base + root * block, x.data.ptr, block)])
        else:
            out = None
            launch = self._grouped([(x.data.ptr, x.nbytes, root)], [], [])
        seq = self._next_seq()
        return self._enqueue("gather", launch, stream, False, out, seq=seq,
                             check=(x.dtype, x.shape, None, root))

    def _scatter(self, x, root: int, out, template, stream=None):
        if out is None:
            chunk, dtype = template
            out = self._empty(chunk, dtype=dtype)
        block = out.nbytes
        if self.rank == root:
            base = x.data.ptr
            sends = [(base + r * block, block, r) for r in range(self.size) if r != root]
            launch = self._grouped(sends, [], [(out.data.ptr, base + root * block, block)])
        else:
            launch = self._grouped([], [(out.data.ptr, block, root)], [])
        seq = self._next_seq()
        return self._enqueue("scatter", launch, stream, False, out, seq=seq,
                             check=(out.dtype, out.shape, None, root))

    def _all_to_all(self, x, out, stream=None):
        if out is None:
            out = self._empty(tuple(x.shape), dtype=x.dtype)
        block = x.nbytes // self.size if self.size else 0
        src, dst = x.data.ptr, out.data.ptr
        peers = [r for r in range(self.size) if r != self.rank]
        launch = self._grouped([(src + r * block, block, r) for r in peers],
                               [(dst + r * block, block, r) for r in peers],
                               [(dst + self.rank * block, src + self.rank * block, block)])
        seq = self._next_seq()
        return self._enqueue("all_to_all", launch, stream, False, out, seq=seq,
                             check=(x.dtype, x.shape))

    # ------------------------------------------------------------------ point to point
    def _send(self, x, dst: int, tag: int, async_op: bool, stream=None):
        return self._enqueue("send", self.nccl_comm.send, stream, async_op, None, peer=dst,
                             args=(x.data.ptr, x.nbytes, self._bytes_type, dst))

    def _recv(self, out, src: int, tag: int, async_op: bool, stream=None):
        return self._enqueue("recv", self.nccl_comm.recv, stream, async_op, out, peer=src,
                             args=(out.data.ptr, out.nbytes, self._bytes_type, src))

    # ------------------------------------------------------------------ barrier
    def _barrier(self, timeout: float) -> None:
        """A one-element all-reduce on the current stream that the host waits for."""
        if self._capturing_now():
            raise refusal(self.backend, "barrier", "it waits on the host; end the capture first")
        ptr, nccl = self._barrier_buffer.data.ptr, self._nccl
        work = self._enqueue("barrier", self.nccl_comm.allReduce, None, True, None,
                             seq=self._seq + 1,
                             check=(np.int32, (1,)) if self._debug else None,
                             args=(ptr, ptr, 1, nccl.NCCL_INT32, nccl.NCCL_SUM))
        work.synchronize(timeout)
