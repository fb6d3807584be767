"""Uneven all-to-all (``all_to_all_v``), built on the public collectives like the uneven gathers.

Every rank sends its own number of rows to each rank (MPI's ``Alltoallv``, torch's
``all_to_all_single`` with split sizes): the exchange at the heart of expert parallelism, where
each rank routes each token to the rank holding its expert. One small ``all_gather`` first gives
every rank the whole count matrix (and checks that dtypes and trailing shapes agree); then the
rows, padded per destination to the largest count anywhere, go in one ``all_to_all`` and are
compacted. Padding moves ``size * max`` rows per rank instead of the exact rows, which is what
capacity-bounded routing (a fixed number of tokens per expert) sends anyway, and it keeps one
collective that every backend has. A backend may move the exact rows instead, when every rank
says it can (``_exact_all_to_all_v_ready``, exchanged with the counts) and through
``_exact_all_to_all_v``: NCCL as one group of sends and receives
(:mod:`gpucoll.backends.nccl_alltoallv`); the CPU backend, when all ranks share one host's
memory and can read each other's arrays, by reading its rows straight from the senders' arrays.
"""

from __future__ import annotations

import zlib
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .composite import _describe, _layout_signature, _to_host
from .flight_recorder import describe_array, traced

__all__ = ["UnevenAllToAll"]


def _host_rows(counts: Any) -> List[Any]:
    """The rows of a count matrix, from the host (a CuPy matrix is copied over once)."""
    if not isinstance(counts, np.ndarray) and hasattr(counts, "__cuda_array_interface__"):
        counts = counts.get()
    return [counts[index] for index in range(len(counts))]


class UnevenAllToAll:
    """Mixin of :class:`gpucoll.Communicator`: :meth:`all_to_all_v`. Uses the helpers of
    :class:`gpucoll.composite.CompositeCollectives` (``_empty_as``, ``_from_host``,
    ``_concatenate``, ``_count_list``, ``_one_per_rank``)."""

    rank: int
    size: int

    @traced(describe_array)
    def all_to_all_v(self, x: Any, send_counts: Optional[Sequence[int]] = None, *,
                     counts: Any = None) -> Tuple[Any, List[int]]:
        """Send ``send_counts[r]`` rows of ``x`` to rank r; receive every rank's rows for this one.

        Args:
            x: shape ``(sum(send_counts), *rest)``: the rows for rank 0 first, then those for
                rank 1, and so on. ``rest`` and the dtype must be the same on every rank.
            send_counts: rows for each rank (``size`` ints, each >= 0; zeros allowed). May be
                left out when ``counts`` is given (it is then ``counts[rank]``).
            counts: the whole count matrix, the same on every rank: ``counts[s][d]`` rows go
                from rank s to rank d (``size`` x ``size`` ints; NumPy array or nested lists).
                Given, nothing is exchanged first, which saves one small ``all_gather`` per
                call where the counts are already known (e.g. sending the rows back with
                ``counts.T``). Every rank must pass the same matrix and the same kind of array
                (all NumPy or all CuPy); dtype and ``rest`` are not compared beforehand (a
                mismatch still fails the exchange itself). With ``GPUCOLL_DEBUG=1`` the
                exchange runs anyway and checks that every rank passed the same matrix.

        Returns:
            ``(result, recv_counts)``: ``result`` has shape ``(sum(recv_counts), *rest)``,
            rank 0's rows first, in the memory (and array type) of ``x``; ``recv_counts[s]``
            is the number of rows rank ``s`` sent here.

        Raises:
            TypeError, ValueError: ``send_counts`` is not ``size`` non-negative ints summing to
                ``x.shape[0]``, or ``counts`` is not a ``size`` x ``size`` matrix of them whose
                row ``rank`` is ``send_counts`` (before anything is sent); ranks' dtypes or
                trailing shapes differ, or (``GPUCOLL_DEBUG=1``) their ``counts`` (on every
                rank alike, after the count exchange; the communicator stays usable).

        Example (two ranks)::

            x = np.arange(3.0) + 10 * comm.rank     # rank 0: [0, 1, 2]; rank 1: [10, 11, 12]
            out, got = comm.all_to_all_v(x, [1, 2] if comm.rank == 0 else [2, 1])
            # rank 0: [0., 10., 11.], [1, 2];  rank 1: [1., 2., 12.], [2, 1]
        """
        x_in = x
        self._refuse_in_capture("all_to_all_v", x)
        view = self._array(x, "x")
        shape = tuple(int(d) for d in view.shape)
        if not shape:
            raise ValueError("all_to_all_v: x must have at least one dimension (rows are "
                             "counted along the first axis), got a 0-d array")
        exact_here = getattr(self, "_exact_all_to_all_v_ready", None)
        ready = bool(exact_here and exact_here(view))  # this rank could take the exact path
        if counts is None:
            if send_counts is None:
                raise TypeError("all_to_all_v: give send_counts (or counts, the whole count "
                                "matrix)")
            send = self._check_send_counts(send_counts, shape[0])
            matrix, exact = self._count_matrix(view, send, ready)
        else:
            matrix = self._check_count_matrix(counts, send_counts, shape[0])
            send = [int(c) for c in matrix[self.rank]]
            if getattr(self, "_debug", False):
                _, exact = self._count_matrix(view, send, ready, matrix)
            else:
                exact = ready
        recv = [int(c) for c in matrix[:, self.rank]]
        longest = int(matrix.max())
        result = self._exact_all_to_all_v(view, matrix) if exact and longest else None
        if result is None and longest == 0:
            result = self._empty_as(view, (0,) + shape[1:], view.dtype)
        elif result is None:
            blocks = self.all_to_all(self._blocks(view, send, longest))
            result = self._concatenate(view, blocks[:, :max(recv)], recv)
        return self._hand_back(result, view, x_in), recv

    def _check_send_counts(self, counts: Any, rows: int) -> List[int]:
        checked = self._count_list(counts, "all_to_all_v", "send_counts")
        if sum(checked) != rows:
            raise ValueError(f"all_to_all_v: send_counts sum to {sum(checked)} but x has {rows} "
                             f"rows (x.shape[0])")
        return checked

    def _check_count_matrix(self, counts: Any, send_counts: Any, rows: int) -> np.ndarray:
        """``counts`` as a checked ``(size, size)`` int64 matrix (``send_counts``, when also
        given, must be its row ``rank``)."""
        self._one_per_rank(counts, "all_to_all_v", "counts",
                           f"a {self.size} x {self.size} matrix of ints", items="rows")
        matrix = np.array([self._count_list(row, "all_to_all_v", f"counts[{sender}]")
                           for sender, row in enumerate(_host_rows(counts))], dtype=np.int64)
        mine = [int(c) for c in matrix[self.rank]]
        if send_counts is not None and self._count_list(send_counts, "all_to_all_v",
                                                        "send_counts") != mine:
            raise ValueError(f"all_to_all_v: send_counts {list(send_counts)} is not counts"
                             f"[{self.rank}] {mine}")
        if sum(mine) != rows:
            raise ValueError(f"all_to_all_v: counts[{self.rank}] sums to {sum(mine)} but x has "
                             f"{rows} rows (x.shape[0])")
        return matrix

    def _count_matrix(self, view: Any, send: List[int], ready: bool,
                      given: Optional[np.ndarray] = None) -> Tuple[np.ndarray, bool]:
        """``(matrix, exact)``: ``matrix[s, d]`` rows rank s sends to rank d (one all_gather,
        layouts checked, and with ``given``, that every rank was given the same matrix);
        ``exact``: every rank is ready for the backend's exact exchange."""
        checksum = [] if given is None else [zlib.crc32(np.ascontiguousarray(given).tobytes())]
        mine = np.array(checksum + [int(ready)] + send + _layout_signature(view), dtype=np.int64)
        table = _to_host(self.all_gather(self._from_host(mine)))
        if given is not None:
            if len(set(table[:, 0].tolist())) > 1:
                groups: dict = {}
                for rank, value in enumerate(table[:, 0].tolist()):
                    groups.setdefault(value, []).append(rank)
                raise ValueError(f"all_to_all_v: ranks passed different count matrices (the same "
                                 f"within each of the groups {sorted(groups.values())})")
            table = table[:, 1:]
        exact, table = bool(table[:, 0].all()), table[:, 1:]
        n = self.size
        if len({tuple(int(v) for v in row[n:]) for row in table}) > 1:
            parts = [f"rank {r}: {_describe(int(row[n]), int(row[n + 1]), [int(v) for v in row[n + 3:]])}"
                     for r, row in enumerate(table)]
            raise ValueError(f"all_to_all_v: ranks disagree on dtype or trailing shape "
                             f"({'; '.join(parts)}); only the row counts may differ")
        return table[:, :n], exact

    def _blocks(self, view: Any, send: List[int], longest: int) -> Any:
        """``(size, longest, *rest)``: the rows for each rank, padded (``view`` reshaped when
        every count is already ``longest``)."""
        rest = tuple(view.shape[1:])
        if all(count == longest for count in send):
            return view.reshape((self.size, longest) + rest)
        blocks = self._empty_as(view, (self.size, longest) + rest, view.dtype)
        start = 0
        for rank, count in enumerate(send):
            if count:
                blocks[rank, :count] = view[start:start + count]
            start += count
        return blocks
