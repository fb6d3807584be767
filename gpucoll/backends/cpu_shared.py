"""The CPU backend's collectives through this host's shared-memory segment.

:meth:`SharedMemoryPath._run_shared` runs a collective through the segment (node-aware when
the communicator spans hosts: :data:`NODE_AWARE`). The short path is the common case of a
training loop without the general machinery: a blocking ``all_reduce``, ``broadcast``,
``all_gather`` or ``reduce_scatter`` of small host NumPy arrays, on a communicator whose ranks
all share the segment, with nothing pending on it (so no issue-order queue to wait in). It
skips the staging objects, queue tickets and closures of the general path; the checks, the
results and the errors are the same.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional

import numpy as np

from .. import algorithms
from ..algorithms import shared as shared_algorithms
from ..algorithms.shared import SINGLE_COPY_BYTES
from ..algorithms.hierarchical import (hierarchical_all_gather, hierarchical_all_reduce,
                                       hierarchical_broadcast, hierarchical_reduce_scatter)
from ..errors import GpucollError
from ..transports.base import OP_CODES, Frame
from ..types import ReduceOp, combine_fn, finish_avg, wire_code

__all__ = ["SharedMemoryPath", "SHARED_ALGORITHMS", "OP_NUMBERS", "NODE_AWARE"]

SHARED_ALGORITHMS = {
    "all_reduce": shared_algorithms.shared_all_reduce,
    "broadcast": shared_algorithms.shared_broadcast,
    "reduce": shared_algorithms.shared_reduce,
    "all_gather": shared_algorithms.shared_all_gather,
    "reduce_scatter": shared_algorithms.shared_reduce_scatter,
    "gather": shared_algorithms.shared_gather,
    "scatter": shared_algorithms.shared_scatter,
    "all_to_all": shared_algorithms.shared_all_to_all,
}
# Across hosts, these run node-aware (shared memory inside a host, sockets between hosts);
# the others run a socket algorithm over every rank.
NODE_AWARE = frozenset({"all_reduce", "broadcast", "all_gather", "reduce_scatter"})
OP_NUMBERS = {op: number for number, op in enumerate(ReduceOp, 1)}
_COMBINERS: Dict[tuple, Callable] = {}
_SMALL = shared_algorithms.SMALL_BYTES


def _combiner(op: ReduceOp, dtype) -> Callable:
    """``combine_fn(op, dtype)``, memoized (the short path asks for it on every call)."""
    key = (op, dtype)
    fn = _COMBINERS.get(key)
    if fn is None:
        fn = _COMBINERS[key] = combine_fn(op, dtype)
    return fn


class SharedMemoryPath:
    """Mixin of :class:`~gpucoll.backends.cpu.CPUCommunicator`: its collectives through the
    segment (``self._shared``), and the short path (see the module doc)."""

    def _run_shared(self, name: str, seq: int, buffers, sample, nbytes: int,
                    op: Optional[ReduceOp], root: Optional[int], deadline: float) -> None:
        """The collective through this host's segment (node-aware across hosts: NODE_AWARE)."""
        frame = Frame(name, seq, wire_code(sample.dtype))
        if self._shared is not None:
            self._shared.expect((OP_CODES[name], frame.dtype, nbytes,
                                 -1 if root is None else root, OP_NUMBERS.get(op, 0)))
        combine = () if op is None else (_combiner(op, sample.dtype),)
        if self._all_shared:
            extra = (() if root is None else (root,)) + combine
            SHARED_ALGORITHMS[name](self._shared, *buffers, *extra, frame, deadline)
            return
        segment, transport = self._shared, self._transport
        if name == "all_gather":
            hierarchical_all_gather(segment, transport, self._hosts, *buffers, frame, deadline)
        elif name == "reduce_scatter":
            hierarchical_reduce_scatter(segment, transport, self._hosts, *buffers, *combine,
                                        frame, deadline)
        else:  # all_reduce, broadcast: a socket algorithm among one rank per host
            leader_fn = algorithms.get(name, algorithms.select(
                name, sample.nbytes, len(self._leaders), self._override,
                itemsize=sample.itemsize, ring_threshold=self._ring_threshold))
            if name == "broadcast":
                hierarchical_broadcast(segment, transport, self._hosts, buffers[0], root,
                                       leader_fn, frame, deadline)
            else:
                hierarchical_all_reduce(segment, transport, self._leaders, buffers[0],
                                        combine[0], leader_fn, frame, deadline)

    # ------------------------------------------------------------------ the short path
    def _short_path(self, async_op: bool, x, out=None, pieces: int = 1) -> bool:
        """May this call take the short path? ``x``, ``out``: the arrays as the backend sees
        them (``out`` None: a new one); ``pieces`` x ``x.nbytes``: what the segment carries
        per rank."""
        return (self._all_shared and not async_op and not self._debug
                and type(x) is np.ndarray and x.nbytes * pieces <= _SMALL
                and (out is None or type(out) is np.ndarray) and self._order.idle())

    def _short(self, name: str, buffers, sample: np.ndarray, nbytes: int,
               op: Optional[ReduceOp] = None, root: Optional[int] = None) -> None:
        """Run ``name`` now through the segment, failing as the general path fails."""
        seq = self._next_seq()
        self._check_alive()
        try:
            self._run_shared(name, seq, buffers, sample, nbytes, op, root,
                             time.monotonic() + self.timeout)
        except GpucollError as exc:
            self._fail(name, seq, exc, self.timeout)
        if op is ReduceOp.AVG:
            finish_avg(buffers[-1], self.size)

    # ------------------------------------------------------------------ uneven all-to-all
    def _exact_all_to_all_v_ready(self, x) -> bool:
        """Can this rank run :meth:`_exact_all_to_all_v` with ``x``? (Every rank must say so.)"""
        return (self._all_shared and self._shared.single_copy and type(x) is np.ndarray
                and not self._debug)

    def _exact_all_to_all_v(self, x: np.ndarray, matrix: np.ndarray) -> Optional[np.ndarray]:
        """``all_to_all_v`` with no padding: each rank reads exactly the rows meant for it
        straight from the senders' arrays (single copy). Called only when every rank is ready
        (:meth:`_exact_all_to_all_v_ready`); None when the exchange is too small to gain from
        it (the caller then pads). ``matrix[s, d]``: rows rank s sends rank d."""
        segment = self._shared
        row_bytes = x.itemsize * (x.size // x.shape[0] if x.shape[0] else 0)
        total = int(matrix.sum()) * row_bytes  # the same on every rank, and so the choice
        if total < SINGLE_COPY_BYTES * self.size:
            return None
        me = self.rank
        local = {rank: index for index, rank in enumerate(segment.ranks)}
        result = np.empty((int(matrix[:, me].sum()),) + x.shape[1:], x.dtype)
        seq = self._next_seq()

        def body(deadline: float):
            frame = Frame("all_to_all", seq, wire_code(x.dtype))
            segment.expect((OP_CODES["all_to_all"], frame.dtype, total, -2, 0))  # -2: the v form
            send, out = x.reshape(-1).view(np.uint8), result.reshape(-1).view(np.uint8)
            segment.lend(send)
            segment.sync(frame, deadline)
            start = 0
            for sender in range(self.size):
                nbytes = int(matrix[sender, me]) * row_bytes
                offset = int(matrix[sender, :me].sum()) * row_bytes
                if nbytes and sender == me:
                    np.copyto(out[start:start + nbytes], send[offset:offset + nbytes])
                elif nbytes:
                    segment.read_from(local[sender], out[start:start + nbytes], offset, frame)
                start += nbytes
            segment.sync(frame, deadline)
            return result

        return self._submit("all_to_all", seq, self._order.all_channels, body, False)

    def _short_all_reduce(self, x: np.ndarray, op: ReduceOp, out: Optional[np.ndarray]):
        result = x if out is None else out
        if out is not None:
            np.copyto(out, x)
        flat = result.reshape(-1)
        self._short("all_reduce", (flat,), flat, x.nbytes, op)
        return result

    def _short_broadcast(self, x: np.ndarray, root: int):
        flat = x.reshape(-1)
        self._short("broadcast", (flat,), flat, x.nbytes, root=root)
        return x

    def _short_all_gather(self, x: np.ndarray, out: Optional[np.ndarray]):
        result = np.empty((self.size,) + x.shape, x.dtype) if out is None else out
        self._short("all_gather", (x.reshape(-1), result.reshape(-1)), x, x.nbytes)
        return result

    def _short_reduce_scatter(self, x: np.ndarray, op: ReduceOp, out: Optional[np.ndarray]):
        result = np.empty(x.shape[1:], x.dtype) if out is None else out
        self._short("reduce_scatter", (x.reshape(-1), result.reshape(-1)), x, x.nbytes, op)
        return result
