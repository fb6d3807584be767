"""The MPI backend's ``reduce_scatter_v``: MPI's own ``Ireduce_scatter`` with receive counts.

MPI moves and reduces exactly each rank's rows, where the generic form
(:mod:`gpucoll.composite_scatter`) pads them to the longest count or reduces once per rank.
Used for host (NumPy) arrays; every dtype and op of :func:`.mpi_types.reduction` (user-defined
ops for float16 and bfloat16, avg as a sum divided afterwards). Device arrays take the generic
form over this backend's collectives.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from ..types import ReduceOp
from .mpi_types import byte_spec, reduction

__all__ = ["MPIUnevenScatters"]


class MPIUnevenScatters:
    """Mixin of :class:`~gpucoll.backends.mpi.MPICommunicator` (uses its ``_stage``,
    ``_new_staged``, ``_collective`` and ``_comm``)."""

    def _exact_reduce_scatter_v(self, view: Any, counts: List[int], op: ReduceOp) -> Any:
        if not isinstance(view, np.ndarray):
            return None
        rest = tuple(int(d) for d in view.shape[1:])
        row = int(np.prod(rest, dtype=np.int64))
        src = self._stage(view, None)
        dst = self._new_staged((counts[self.rank],) + rest, view.dtype, src, None)
        kind, mpi_op = reduction(op, view.dtype)
        elements = [count * row for count in counts]
        return self._collective(
            "reduce_scatter_v", src, dst,
            lambda: self._comm.Ireduce_scatter(byte_spec(src.host, kind),
                                               byte_spec(dst.host, kind), elements, mpi_op),
            False, op=op)
