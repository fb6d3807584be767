"""Collectives built on the public ones, so every backend has them without code of its own.

- Object collectives (``broadcast_object``, ``all_gather_object``, ``gather_object``,
  ``scatter_object``) and object messages (``send_object``, ``recv_object``): values go
  through :mod:`gpucoll.objects` (never pickle) as uint8 arrays; lengths go first, so any
  size works.
- Uneven gathers (``all_gather_v``, ``gather_v``): each rank contributes its own number of
  rows (first axis). Two ways, chosen by the numbers (bench/bench_gatherv.py, bench/RESULTS.md):
  rows padded to the longest contribution and moved by one ``all_gather`` / ``gather``
  (``size * max(counts)`` rows on the wire instead of ``sum(counts)``, one collective), or, for
  ``all_gather_v`` when padding would at least add half again and the total is at least
  :data:`BROADCAST_MIN_BYTES`, one ``broadcast`` per rank with rows, straight into the result
  (no padding, ``size`` collectives).

Arrays stay in the memory the caller's array lives in: NumPy on the host, CuPy (or what the
NCCL backend imported) on the GPU; internal buffers come from the backend's ``_empty`` and
``_from_host``, so no backend-specific code lives here.
"""

from __future__ import annotations

import zlib
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import cuda_env, objects
from .graph_capture import HOST_STAGING, device_array_in_capture, refusal
from .flight_recorder import describe_array, describe_nothing, describe_object_p2p, \
    describe_rooted, describe_rooted_object, traced
from .types import DTYPES, wire_code

__all__ = ["CompositeCollectives"]

_MAX_LISTED_DIMS = 8  # trailing dimensions written out in the layout exchange
BROADCAST_MIN_BYTES = 4 << 20  # below this, per-rank broadcasts lose to padding (latency)
BROADCAST_MIN_PADDING = 1.5    # padded / exact bytes from which broadcasts win


def _to_host(array: Any) -> np.ndarray:
    """A NumPy copy (or the array itself) of a result of this communicator's collectives."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()  # CuPy (and CuPy-compatible device arrays)


def _layout_signature(x: Any) -> List[int]:
    """``[dtype code, ndim, crc of the trailing shape, trailing dims (padded to
    _MAX_LISTED_DIMS)]``: what every rank of an uneven collective must agree on."""
    shape = tuple(int(d) for d in x.shape)
    trailing = shape[1:]
    listed = list(trailing[:_MAX_LISTED_DIMS])
    listed += [0] * (_MAX_LISTED_DIMS - len(listed))
    return [wire_code(x.dtype), len(shape), zlib.crc32(repr(trailing).encode())] + listed


def _describe(code: int, ndim: int, dims: Sequence[int]) -> str:
    name = next((n for n, (c, _) in DTYPES.items() if c == code), f"code {code}")
    trailing = list(dims[:ndim - 1])
    more = ", ..." if ndim - 1 > _MAX_LISTED_DIMS else ""
    return f"{name} (n, {', '.join(map(str, trailing))}{more})" if trailing or more \
        else f"{name} (n,)"


class CompositeCollectives:
    """Mixin of :class:`gpucoll.Communicator`: object collectives and uneven gathers."""

    rank: int
    size: int

    # ------------------------------------------------------------------ memory helpers
    def _empty(self, shape: Tuple[int, ...], dtype: Any) -> Any:
        """A new array in the memory this backend's collectives take (NumPy here; the NCCL
        backend overrides it with its GPU's)."""
        return np.empty(shape, dtype=dtype)

    def _host_memory(self) -> bool:
        """True when this backend's collectives take host (NumPy) arrays."""
        known = self.__dict__.get("_takes_host_arrays")
        if known is None:
            known = self.__dict__["_takes_host_arrays"] = isinstance(
                self._empty((0,), np.uint8), np.ndarray)
        return known

    def _from_host(self, host: np.ndarray) -> Any:
        """``host`` copied into the memory this backend's collectives take."""
        buffer = self._empty(host.shape, host.dtype)
        if isinstance(buffer, np.ndarray):
            np.copyto(buffer, host)
        else:
            buffer.set(host)  # CuPy: host to device, on the current stream
        return buffer

    def _empty_as(self, like: Any, shape: Tuple[int, ...], dtype: Any) -> Any:
        """A new array where ``like`` lives: the host for NumPy arrays, else the backend's
        memory, or the GPU of a CuPy array the CPU backend stages through the host."""
        if isinstance(like, np.ndarray):
            return np.empty(shape, dtype=dtype)
        if not self._host_memory():
            return self._empty(shape, dtype)
        if hasattr(like, "__cuda_array_interface__"):
            cupy = cuda_env.cupy_module()  # a CuPy array given to a host backend
            with cupy.cuda.Device(like.device.id):
                return cupy.empty(shape, dtype=dtype)
        return np.empty(shape, dtype=dtype)

    def _refuse_in_capture(self, name: str, x: Any = None) -> None:
        """Raise before ``name`` sends anything when a CUDA graph capture would record it: the
        composite calls read counts or objects on the host, which a capture cannot do. A host
        backend stages device arrays through the host (so only ``x`` on a GPU is refused);
        the NCCL backend refuses any of them on its capturing stream."""
        if device_array_in_capture(x):
            raise refusal(self.backend, f"{name} of a CUDA array", HOST_STAGING)

    def _lengths(self, mine: int) -> List[int]:
        """Every rank's ``mine`` (one all_gather of int64)."""
        table = self.all_gather(self._from_host(np.array([mine], dtype=np.int64)))
        return [int(v) for v in _to_host(table).reshape(-1)]

    # ------------------------------------------------------------------ objects
    @traced(describe_rooted_object)
    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Send a Python value from ``root`` to every rank (mpi4py's ``bcast``).

        The value goes through gpucoll's codec (:mod:`gpucoll.objects`): JSON-compatible
        values plus tuples, bytes, int dict keys, NumPy arrays and scalars; never pickle.

        Args:
            obj: the value, read on ``root`` only (other ranks may pass anything).
            root: the sending rank.

        Returns:
            A decoded copy of the value on every rank, ``root`` included.

        Raises:
            TypeError: on ``root``, before anything is sent, when part of ``obj`` cannot be
                encoded; the message names its type and path (``obj['cfg'][2]``).

        Example (two ranks)::

            cfg = comm.broadcast_object({"lr": 0.1} if comm.rank == 0 else None)
            # both: {'lr': 0.1}
        """
        root = self._root(root)
        self._refuse_in_capture("broadcast_object")
        payload = objects.encode(obj, "obj") if self.rank == root else None
        length = self._from_host(np.array([0 if payload is None else payload.size], np.int64))
        count = int(_to_host(self.broadcast(length, root))[0])
        buffer = self._from_host(payload) if payload is not None else \
            self._empty((count,), np.uint8)
        return objects.decode(_to_host(self.broadcast(buffer, root)))

    @traced(describe_nothing)
    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's value, in rank order, on every rank (mpi4py's ``allgather``).

        Returns:
            A list of ``size`` decoded copies (this rank's own too).

        Raises:
            TypeError: ``obj`` cannot be encoded (before anything is sent).

        Example (two ranks)::

            comm.all_gather_object({"rank": comm.rank})   # both: [{'rank': 0}, {'rank': 1}]
        """
        self._refuse_in_capture("all_gather_object")
        payload = objects.encode(obj, "obj")
        lengths = self._lengths(payload.size)
        data, _ = self.all_gather_v(self._from_host(payload), counts=lengths)
        host = _to_host(data)
        return [objects.decode(host[a:b]) for a, b in objects.split_lengths(lengths)]

    @traced(describe_rooted_object)
    def gather_object(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        """Every rank's value, in rank order, on ``root`` (mpi4py's ``gather``).

        Returns:
            On ``root`` a list of ``size`` decoded values; None elsewhere.

        Example (two ranks)::

            comm.gather_object(comm.rank * 10, root=1)   # rank 1: [0, 10]; rank 0: None
        """
        root = self._root(root)
        self._refuse_in_capture("gather_object")
        payload = objects.encode(obj, "obj")
        lengths = self._lengths(payload.size)
        data, _ = self.gather_v(self._from_host(payload), root, counts=lengths)
        if data is None:
            return None
        host = _to_host(data)
        return [objects.decode(host[a:b]) for a, b in objects.split_lengths(lengths)]

    @traced(describe_rooted_object)
    def scatter_object(self, objs: Optional[Sequence[Any]] = None, root: int = 0) -> Any:
        """Send ``objs[r]`` from ``root`` to rank r (mpi4py's ``scatter``).

        Args:
            objs: on ``root``, a list or tuple of ``size`` values; ignored elsewhere.

        Returns:
            This rank's value (a decoded copy).

        Raises:
            TypeError / ValueError: on ``root``, before anything is sent: ``objs`` is not a
                list or tuple of ``size`` values, or one of them cannot be encoded.

        Example (two ranks)::

            mine = comm.scatter_object(["a", "b"] if comm.rank == 0 else None)
            # rank 0: 'a'; rank 1: 'b'
        """
        root = self._root(root)
        self._refuse_in_capture("scatter_object")
        if self.rank == root:
            if not isinstance(objs, (list, tuple)):
                raise TypeError(f"scatter_object: objs must be a list or tuple of {self.size} "
                                f"values on the root, got {type(objs).__name__}")
            if len(objs) != self.size:
                raise ValueError(f"scatter_object: objs has {len(objs)} values, expected one "
                                 f"per rank ({self.size})")
            payloads = [objects.encode(value, f"objs[{i}]") for i, value in enumerate(objs)]
            lengths = np.array([p.size for p in payloads], dtype=np.int64)
        else:
            lengths = np.zeros(self.size, dtype=np.int64)
        lengths = _to_host(self.broadcast(self._from_host(lengths), root))
        longest = int(lengths.max())
        if self.rank == root:
            table = np.zeros((self.size, longest), dtype=np.uint8)
            for row, payload in zip(table, payloads):
                row[:payload.size] = payload
            chunk = self.scatter(self._from_host(table), root)
        else:
            chunk = self.scatter(None, root, out=self._empty((longest,), np.uint8))
        return objects.decode(_to_host(chunk)[:int(lengths[self.rank])])

    @traced(describe_object_p2p)
    def send_object(self, obj: Any, dst: int, *, tag: int = 0) -> None:
        """Send a Python value to rank ``dst`` (mpi4py's ``send``, torch's
        ``send_object_list``): its length, then its bytes, as two messages with ``tag``.

        Raises:
            TypeError: part of ``obj`` cannot be encoded (before anything is sent).
            ValueError: ``dst`` is out of range or this rank.
        """
        dst = self._peer(dst, "dst")
        self._refuse_in_capture("send_object")
        payload = objects.encode(obj, "obj")
        self.send(self._from_host(np.array([payload.size], dtype=np.int64)), dst, tag=tag)
        self.send(self._from_host(payload), dst, tag=tag)

    @traced(describe_object_p2p)
    def recv_object(self, src: int, *, tag: int = 0) -> Any:
        """Receive a value that rank ``src`` sent with :meth:`send_object` and the same
        ``tag``; returns a decoded copy. Values between two ranks arrive in the order sent.

        Example (two ranks)::

            if comm.rank == 0:
                comm.send_object({"step": 3}, 1)
            else:
                comm.recv_object(0)        # {'step': 3}
        """
        src = self._peer(src, "src")
        self._refuse_in_capture("recv_object")
        length = self.recv(self._empty((1,), np.int64), src, tag=tag)
        count = int(_to_host(length)[0])
        payload = self.recv(self._empty((count,), np.uint8), src, tag=tag)
        return objects.decode(_to_host(payload))

    # ------------------------------------------------------------------ uneven gathers
    def _layout(self, x: Any, rows: int) -> List[int]:
        """Exchange (rows, dtype, trailing shape) with every rank; check they agree.

        Raises ``ValueError`` on every rank alike (all see the same table) when dtypes or
        trailing shapes differ, so the communicator stays usable.
        """
        mine = [rows] + _layout_signature(x)
        table = _to_host(self.all_gather(self._from_host(np.array(mine, dtype=np.int64))))
        signatures = {tuple(int(v) for v in row[1:]) for row in table}
        if len(signatures) > 1:
            parts = [f"rank {r}: {_describe(int(row[1]), int(row[2]), [int(v) for v in row[4:]])}"
                     for r, row in enumerate(table)]
            raise ValueError(f"gather of uneven arrays: ranks disagree on dtype or trailing "
                             f"shape ({'; '.join(parts)}); only the first axis may differ")
        return [int(row[0]) for row in table]

    def _one_per_rank(self, value: Any, name: str, label: str, kind: str,
                      items: str = "entries") -> None:
        """``TypeError`` unless ``value`` is a sequence (``kind`` says of what), ``ValueError``
        unless it has one of its ``items`` per rank."""
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise TypeError(f"{name}: {label} must be {kind}, got {type(value).__name__}")
        if len(value) != self.size:
            shown = f": {list(value)}" if items == "entries" else ""
            raise ValueError(f"{name}: {label} has {len(value)} {items}, expected one per rank "
                             f"({self.size}){shown}")

    def _count_list(self, counts: Any, name: str, label: str = "counts") -> List[int]:
        """``counts`` as ``size`` non-negative ints (``TypeError`` / ``ValueError`` naming
        ``label`` otherwise)."""
        self._one_per_rank(counts, name, label, f"a sequence of {self.size} ints")
        checked = []
        for index, count in enumerate(counts):
            if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)):
                raise TypeError(f"{name}: {label}[{index}] must be an int, got {count!r}")
            if count < 0:
                raise ValueError(f"{name}: {label}[{index}]={count} is negative")
            checked.append(int(count))
        return checked

    def _check_counts(self, counts: Any, rows: int, name: str) -> List[int]:
        checked = self._count_list(counts, name)
        if checked[self.rank] != rows:
            raise ValueError(f"{name}: counts[{self.rank}]={checked[self.rank]} but this rank's "
                             f"x has {rows} rows (x.shape[0])")
        return checked

    def _uneven_input(self, x: Any, counts: Any, name: str):
        """(backend view of x, its shape, every rank's rows), all checked."""
        self._refuse_in_capture(name, x)
        view = self._array(x, "x")
        shape = tuple(int(d) for d in view.shape)
        if not shape:
            raise ValueError(f"{name}: x must have at least one dimension (rows are counted "
                             f"along the first axis), got a 0-d array")
        rows = shape[0]
        if counts is None:
            counts = self._layout(view, rows)
        else:
            counts = self._check_counts(counts, rows, name)
        return view, shape, counts

    def _padded(self, view: Any, counts: List[int]) -> Any:
        """This rank's rows padded to the longest count (``view`` itself when it is)."""
        rows, longest = int(view.shape[0]), max(counts)
        if rows == longest:
            return view
        padded = self._empty_as(view, (longest,) + tuple(view.shape[1:]), view.dtype)
        if rows:
            padded[:rows] = view
        return padded

    def _concatenate(self, view: Any, blocks: Any, counts: List[int]) -> Any:
        """Rows ``blocks[r, :counts[r]]`` of every rank, one after another, in a new array
        (``blocks`` itself, reshaped, when every rank had as many rows)."""
        if min(counts) == max(counts):
            return blocks.reshape((sum(counts),) + tuple(view.shape[1:]))
        result = self._empty_as(view, (sum(counts),) + tuple(view.shape[1:]), view.dtype)
        start = 0
        for r, count in enumerate(counts):
            if count:
                result[start:start + count] = blocks[r, :count]
            start += count
        return result

    @traced(describe_array)
    def all_gather_v(self, x: Any, counts: Optional[Sequence[int]] = None) -> Tuple[Any, List[int]]:
        """Gather arrays whose first axis differs per rank; every rank gets all of them,
        concatenated in rank order (MPI's ``Allgatherv``).

        Args:
            x: this rank's rows, shape ``(n_r, *rest)``; ``rest`` and the dtype must be the
                same on every rank; ``n_r`` may be 0.
            counts: every rank's ``n_r``, the same list on every rank. None: exchanged
                first (one small all_gather, which also checks dtype and ``rest`` agree).

        Returns:
            ``(result, counts)``: ``result`` has shape ``(sum(counts), *rest)``, in the
            memory (and array type) of ``x``; ``counts`` is a list of ints.

        Raises:
            ValueError: ``counts`` has the wrong length, a negative entry, or disagrees
                with ``x.shape[0]``; ranks' dtypes or trailing shapes differ (on every rank).

        Example (two ranks)::

            x = np.arange(comm.rank + 1.0)          # rank 0: [0.], rank 1: [0., 1.]
            out, counts = comm.all_gather_v(x)      # both: [0., 0., 1.], [1, 2]
        """
        x_in = x
        view, shape, counts = self._uneven_input(x, counts, "all_gather_v")
        longest, total = max(counts), sum(counts)
        row_bytes = view.dtype.itemsize
        for dim in shape[1:]:
            row_bytes *= dim
        if longest == 0:
            result = self._empty_as(view, (0,) + shape[1:], view.dtype)
        elif total * row_bytes >= BROADCAST_MIN_BYTES and \
                self.size * longest >= BROADCAST_MIN_PADDING * total:
            result = self._all_gather_v_broadcasts(view, counts)
        else:
            result = self._all_gather_v_padded(view, counts)
        return self._hand_back(result, view, x_in), counts

    def _all_gather_v_padded(self, view: Any, counts: List[int]) -> Any:
        """One all_gather of every rank's rows padded to the longest; then compacted."""
        return self._concatenate(view, self.all_gather(self._padded(view, counts)), counts)

    def _all_gather_v_broadcasts(self, view: Any, counts: List[int]) -> Any:
        """One broadcast per rank with rows, straight into its slice of the result."""
        result = self._empty_as(view, (sum(counts),) + tuple(view.shape[1:]), view.dtype)
        start = 0
        for root, count in enumerate(counts):
            if count:
                block = result[start:start + count]
                if root == self.rank:
                    block[...] = view
                self.broadcast(block, root)
            start += count
        return result

    @traced(describe_rooted)
    def gather_v(self, x: Any, root: int = 0,
                 counts: Optional[Sequence[int]] = None) -> Tuple[Optional[Any], List[int]]:
        """Gather arrays whose first axis differs per rank onto ``root``, concatenated in
        rank order (MPI's ``Gatherv``).

        Args:
            x, counts: as for :meth:`all_gather_v` (counts are needed on every rank, since
                every rank pads to the longest).
            root: the receiving rank.

        Returns:
            ``(result, counts)`` on ``root``; ``(None, counts)`` elsewhere.

        Example (two ranks)::

            out, counts = comm.gather_v(np.full(comm.rank + 1, comm.rank), root=0)
            # rank 0: [0, 1, 1], [1, 2]; rank 1: None, [1, 2]
        """
        root = self._root(root)
        x_in = x
        view, shape, counts = self._uneven_input(x, counts, "gather_v")
        if max(counts) == 0:
            result = self._empty_as(view, (0,) + shape[1:], view.dtype) \
                if self.rank == root else None
        else:
            blocks = self.gather(self._padded(view, counts), root)
            result = self._concatenate(view, blocks, counts) if self.rank == root else None
        if result is None:
            return None, counts
        return self._hand_back(result, view, x_in), counts
