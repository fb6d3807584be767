"""Uneven scatters (``scatter_v``, ``reduce_scatter_v``), built on the public collectives like
the uneven gathers in :mod:`gpucoll.composite`.

Rank r gets ``counts[r]`` rows (first axis) of an array of ``sum(counts)`` rows: MPI's
``Scatterv`` and ``Reduce_scatter`` (with receive counts), torch's ``reduce_scatter`` of
uneven blocks, the sharding of an FSDP parameter whose rows do not divide by the ranks.

- ``scatter_v``: the root sends one small ``broadcast`` first (the counts, dtype and trailing
  shape, or that it refused its input, so every rank raises alike), then the rows padded per
  rank to the longest count go in one ``scatter``: ``size * max(counts)`` rows leave the root
  instead of ``sum(counts)``, in one collective every backend has.
- ``reduce_scatter_v``: every rank holds all ``sum(counts)`` rows. A backend with its own uneven
  reduce-scatter does it (MPI's ``Reduce_scatter`` on host arrays,
  :mod:`gpucoll.backends.mpi_uneven`). Otherwise: padded to the longest count
  and reduced by one ``reduce_scatter`` (``size * max(counts)`` rows per rank into the
  algorithm instead of ``sum(counts)``); or, when padding would at least add half again and
  the rows are at least :data:`~gpucoll.composite.BROADCAST_MIN_BYTES` (4 MiB), or triple
  them from :data:`REDUCES_MIN_BYTES` (1 MiB), one ``reduce`` per rank with rows, straight into
  its result (no padding, ``size`` collectives), as ``all_gather_v`` chooses between padding
  and broadcasts.

Both take ``counts=None`` as an even split (``np.array_split``: the first ``n % size`` ranks
get one row more). Results live where the caller's arrays do (NumPy, or the backend's device
memory), through the backend's ``_empty`` like the other composite calls.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .composite import BROADCAST_MIN_BYTES, BROADCAST_MIN_PADDING, _to_host
from .flight_recorder import describe_array, describe_rooted, traced
from .types import ReduceOp, check_op_dtype, dtype_from_code, wire_code

__all__ = ["UnevenScatters", "even_counts"]

_MAX_TRAILING_DIMS = 8  # trailing dimensions scatter_v's header carries
REDUCES_MIN_BYTES = 1 << 20  # from here, padding of REDUCES_MIN_PADDING or more loses to reduces
REDUCES_MIN_PADDING = 3.0    # (bench/bench_reduce_scatterv.py, bench/RESULTS.md)
_OK, _REFUSED = 0, 1    # the header's first entry


def even_counts(rows: int, size: int) -> List[int]:
    """``rows`` split over ``size`` ranks as ``np.array_split`` does: the first
    ``rows % size`` ranks get one row more."""
    base, extra = divmod(int(rows), size)
    return [base + (1 if rank < extra else 0) for rank in range(size)]


def _dtype_of(code: int) -> np.dtype:
    """The NumPy dtype of a wire code (bfloat16 through ml_dtypes, which its sender had)."""
    name = dtype_from_code(code)
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _reduces_win(total_bytes: int, padding: float) -> bool:
    """Whether one reduce per rank beats one padded reduce_scatter, for ``total_bytes`` of rows
    padded ``padding`` times (``size * max(counts) / sum(counts)``): measured on the CPU
    backend, padding of half again loses from 4 MiB, and of 3 times from 1 MiB."""
    return (total_bytes >= BROADCAST_MIN_BYTES and padding >= BROADCAST_MIN_PADDING) or \
        (total_bytes >= REDUCES_MIN_BYTES and padding >= REDUCES_MIN_PADDING)


def _row_bytes(view: Any) -> int:
    size = view.dtype.itemsize
    for dim in view.shape[1:]:
        size *= int(dim)
    return size


class UnevenScatters:
    """Mixin of :class:`gpucoll.Communicator`: :meth:`scatter_v` and :meth:`reduce_scatter_v`.
    Uses the helpers of :class:`gpucoll.composite.CompositeCollectives` (``_empty_as``,
    ``_from_host``, ``_count_list``, ``_refuse_in_capture``)."""

    rank: int
    size: int

    def _rows_and_counts(self, x: Any, counts: Any, name: str) -> Tuple[Any, List[int]]:
        """(backend view of x, counts) with x at least 1-d and ``sum(counts) == x.shape[0]``."""
        view = self._array(x, "x")
        shape = tuple(int(d) for d in view.shape)
        if not shape:
            raise ValueError(f"{name}: x must have at least one dimension (rows are counted "
                             f"along the first axis), got a 0-d array")
        if counts is None:
            return view, even_counts(shape[0], self.size)
        checked = self._count_list(counts, name)
        if sum(checked) != shape[0]:
            raise ValueError(f"{name}: counts {checked} add up to {sum(checked)} rows but x has "
                             f"{shape[0]} (x.shape[0])")
        return view, checked

    # ------------------------------------------------------------------ scatter_v
    @traced(describe_rooted)
    def scatter_v(self, x: Any = None, root: int = 0,
                  counts: Optional[Sequence[int]] = None) -> Tuple[Any, List[int]]:
        """Send ``counts[r]`` rows of ``x`` (read on ``root`` only) to rank r (MPI's ``Scatterv``).

        Args:
            x: on ``root``, shape ``(sum(counts), *rest)``: rank 0's rows first, then rank 1's,
                and so on. Elsewhere None, or any array whose memory the result should take
                (a CuPy array with a host backend); its shape is not read.
            root: the sending rank.
            counts: rows per rank (``size`` ints >= 0), read on ``root`` only; None splits
                ``x.shape[0]`` as evenly as ``np.array_split`` does. The other ranks learn
                the counts, dtype and ``rest`` from the root in one small broadcast.

        Returns:
            ``(rows, counts)``: this rank's ``(counts[rank], *rest)`` rows, in the memory of
            ``x`` (or the backend's), and every rank's count.

        Raises:
            ValueError / TypeError: on ``root``, a bad ``x`` or ``counts``; the other ranks
                then raise ``ValueError`` too (the root says so in its broadcast), and the
                communicator stays usable.

        Example (two ranks)::

            x = np.arange(5.0) if comm.rank == 0 else None
            rows, counts = comm.scatter_v(x, root=0, counts=[2, 3])
            # rank 0: [0., 1.]; rank 1: [2., 3., 4.]; counts == [2, 3] on both
        """
        root = self._root(root)
        self._refuse_in_capture("scatter_v", x)
        length = 3 + _MAX_TRAILING_DIMS + self.size
        if self.rank == root:
            try:
                view, counts = self._scatter_v_input(x, counts)
            except (TypeError, ValueError):
                refused = np.zeros(length, dtype=np.int64)
                refused[0] = _REFUSED
                self.broadcast(self._from_host(refused), root)
                raise
            rest = tuple(int(d) for d in view.shape[1:])
            header = np.zeros(length, dtype=np.int64)
            header[1], header[2] = wire_code(view.dtype), len(rest)
            header[3:3 + len(rest)] = rest
            header[3 + _MAX_TRAILING_DIMS:] = counts
            self.broadcast(self._from_host(header), root)
            dtype, like = view.dtype, view
        else:
            like = None if x is None else self._array(x, "x")
            header = _to_host(self.broadcast(self._empty((length,), np.int64), root))
            if int(header[0]) == _REFUSED:
                raise ValueError(f"scatter_v: root {root} refused its input (its own error "
                                 f"says why); nothing was scattered")
            code, ndim = int(header[1]), int(header[2])
            rest = tuple(int(d) for d in header[3:3 + ndim])
            counts = [int(c) for c in header[3 + _MAX_TRAILING_DIMS:]]
            dtype = _dtype_of(code)
        longest = max(counts)
        chunk = (self._empty_as(like, (longest,) + rest, dtype) if like is not None
                 else self._empty((longest,) + rest, dtype))
        if longest:
            padded = self._padded_blocks(view, counts) if self.rank == root else None
            self.scatter(padded, root, out=chunk)
        result = chunk[:counts[self.rank]]
        return (self._hand_back(result, view, x) if self.rank == root else result), counts

    def _scatter_v_input(self, x: Any, counts: Any) -> Tuple[Any, List[int]]:
        if x is None:
            raise ValueError("scatter_v: x is required on the root rank")
        view, counts = self._rows_and_counts(x, counts, "scatter_v")
        if view.ndim - 1 > _MAX_TRAILING_DIMS:
            raise ValueError(f"scatter_v: x has {view.ndim} dimensions; at most "
                             f"{_MAX_TRAILING_DIMS + 1} are supported")
        return view, counts

    def _padded_blocks(self, view: Any, counts: List[int]) -> Any:
        """``(size, max(counts), *rest)``: rank r's rows of ``view`` in block r, zero padded
        (``view`` reshaped, without a copy, when every count is the same)."""
        longest, rest = max(counts), tuple(view.shape[1:])
        if min(counts) == longest:
            return view.reshape((self.size, longest) + rest)
        blocks = self._empty_as(view, (self.size, longest) + rest, view.dtype)
        start = 0
        for rank, count in enumerate(counts):
            blocks[rank, :count] = view[start:start + count]
            blocks[rank, count:] = 0  # pads are reduced too: keep them finite
            start += count
        return blocks

    # ------------------------------------------------------------------ reduce_scatter_v
    @traced(describe_array)
    def reduce_scatter_v(self, x: Any, counts: Optional[Sequence[int]] = None,
                         op: Any = "sum") -> Tuple[Any, List[int]]:
        """Reduce ``x`` across ranks; rank r gets rows ``[sum(counts[:r]), sum(counts[:r+1]))``
        of the result (MPI's ``Reduce_scatter`` with receive counts).

        Args:
            x: shape ``(sum(counts), *rest)``, the same shape and dtype on every rank; not
                changed.
            counts: rows per rank (``size`` ints >= 0), the same list on every rank; None
                splits ``x.shape[0]`` as evenly as ``np.array_split`` does.
            op: as for :meth:`reduce_scatter` (``avg`` included).

        Returns:
            ``(rows, counts)``: this rank's ``(counts[rank], *rest)`` reduced rows, a new
            array in the memory of ``x``, and the counts used.

        Raises:
            ValueError / TypeError: bad ``counts`` (length, negative, or not adding up to
                ``x.shape[0]``), op or dtype; before anything is sent.

        Example (two ranks)::

            x = np.arange(5.0) * (comm.rank + 1)
            rows, counts = comm.reduce_scatter_v(x, counts=[2, 3])
            # rank 0: [0., 3.]; rank 1: [6., 9., 12.]
        """
        op = ReduceOp.parse(op)
        self._refuse_in_capture("reduce_scatter_v", x)
        view, counts = self._rows_and_counts(x, counts, "reduce_scatter_v")
        check_op_dtype(op, view.dtype)
        longest, total = max(counts), sum(counts)
        exact = self._exact_reduce_scatter_v(view, counts, op) if longest else None
        if exact is not None:
            result = exact
        elif longest == 0:
            result = self._empty_as(view, (0,) + tuple(view.shape[1:]), view.dtype)
        elif _reduces_win(total * _row_bytes(view), self.size * longest / total):
            result = self._reduce_scatter_v_reduces(view, counts, op)
        else:
            result = self._reduce_scatter_v_padded(view, counts, op)
        return self._hand_back(result, view, x), counts

    def _exact_reduce_scatter_v(self, view: Any, counts: List[int], op: ReduceOp) -> Any:
        """A backend's own uneven reduce-scatter (MPI's ``Reduce_scatter``), or None to build
        it from the collectives here."""
        return None

    def _reduce_scatter_v_padded(self, view: Any, counts: List[int], op: ReduceOp) -> Any:
        """One reduce_scatter of every rank's block padded to the longest; then trimmed."""
        reduced = self.reduce_scatter(self._padded_blocks(view, counts), op)
        return reduced[:counts[self.rank]]

    def _reduce_scatter_v_reduces(self, view: Any, counts: List[int], op: ReduceOp) -> Any:
        """One reduce per rank with rows, onto that rank, straight into its result."""
        result = self._empty_as(view, (counts[self.rank],) + tuple(view.shape[1:]), view.dtype)
        start = 0
        for root, count in enumerate(counts):
            if count:
                self.reduce(view[start:start + count], root, op,
                            out=result if root == self.rank else None)
            start += count
        return result
