"""The NCCL backend's ``all_to_all_v`` with exact sizes: one group of sends and receives.

:meth:`gpucoll.Communicator.all_to_all_v` exchanges the count matrix first; on NCCL the rows
then go as one ``groupStart`` / ``groupEnd`` of point-to-point sends and receives of exactly the
rows each pair exchanges (the rank's own rows as a device-to-device copy), the way NCCL's own
all-to-all is built, instead of one all-to-all of blocks padded to the largest count.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

__all__ = ["ExactAllToAllV"]


def _offsets(counts, row_bytes: int) -> List[int]:
    """Byte offset of each block of ``counts`` rows, one after another."""
    return [int(v) * row_bytes for v in np.concatenate(([0], np.cumsum(counts)[:-1]))]


class ExactAllToAllV:
    """Mixin of :class:`~gpucoll.backends.nccl.NCCLCommunicator` (uses its ``_grouped``,
    ``_enqueue``, ``_empty`` and ``_next_seq``)."""

    def _exact_all_to_all_v_ready(self, x: Any) -> bool:
        """Always: every array the NCCL backend takes is on its GPU."""
        return True

    def _exact_all_to_all_v(self, x: Any, matrix: np.ndarray) -> Any:
        """Rows ``matrix[me, d]`` of ``x`` to each rank d, ``matrix[s, me]`` from each rank s,
        into a new array in rank order (enqueued on the current stream)."""
        me, rest = self.rank, tuple(int(d) for d in x.shape[1:])
        row_bytes = x.itemsize * int(np.prod(rest, dtype=np.int64))
        result = self._empty((int(matrix[:, me].sum()),) + rest, dtype=x.dtype)
        send_at, recv_at = _offsets(matrix[me], row_bytes), _offsets(matrix[:, me], row_bytes)
        src, dst = x.data.ptr, result.data.ptr
        peers = [r for r in range(self.size) if r != me]
        sends = [(src + send_at[d], int(matrix[me, d]) * row_bytes, d) for d in peers
                 if matrix[me, d]]
        recvs = [(dst + recv_at[s], int(matrix[s, me]) * row_bytes, s) for s in peers
                 if matrix[s, me]]
        launch = self._grouped(sends, recvs, [(dst + recv_at[me], src + send_at[me],
                                               int(matrix[me, me]) * row_bytes)])
        seq = self._next_seq()
        return self._enqueue("all_to_all", launch, None, False, result, seq=seq,
                             check=(x.dtype, (int(matrix.sum()),) + rest))
