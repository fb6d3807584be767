"""The Communicator interface every backend implements, and the argument checks they share.

Public methods validate their arguments here, eagerly and identically for every backend
(``ValueError`` / ``TypeError`` naming the bad value, before anything is sent), then call the
backend's ``_<op>`` method with normalized arguments.
"""

from __future__ import annotations

import abc
from types import MappingProxyType
from typing import Any, Mapping, Optional, Tuple, Union

from . import flight_recorder
from .batch_p2p import BatchP2P
from .errors import CommAbortedError, UnsupportedOperationError
from .composite import CompositeCollectives
from .composite_alltoall import UnevenAllToAll
from .composite_scatter import UnevenScatters
from .flight_recorder import (FlightRecorded, describe_array, describe_nothing, describe_p2p,
                              describe_rooted, describe_scatter, traced)
from .groups import Groups
from .scan import PrefixReductions
from .sendrecv import SendRecv
from .types import ReduceOp, check_op_dtype, wire_code
from .work import Work

__all__ = ["Communicator"]

Array = Any  # numpy.ndarray, cupy.ndarray, or what a backend accepts
_parse_op = ReduceOp.parse  # bound once (hot path)


def _shape_of(x: Array) -> Tuple[int, ...]:
    shape = x.shape
    if type(shape) is tuple:  # NumPy, CuPy: already a tuple of ints
        return shape
    return tuple(int(d) for d in shape)


class Communicator(Groups, CompositeCollectives, UnevenAllToAll, UnevenScatters, PrefixReductions,
                   SendRecv, BatchP2P, FlightRecorded, abc.ABC):
    """A group of ``size`` ranks that run collectives together.

    Besides the collectives below, every backend has the object collectives and uneven
    gathers of :class:`gpucoll.composite.CompositeCollectives` (``broadcast_object``,
    ``all_gather_object``, ``gather_object``, ``scatter_object``, ``all_gather_v``,
    ``gather_v``) and the uneven ``all_to_all_v`` of
    :class:`gpucoll.composite_alltoall.UnevenAllToAll`, built on these, and the point-to-point
    ``sendrecv`` of :class:`gpucoll.sendrecv.SendRecv` (a send and a receive at once) and
    ``batch_isend_irecv`` of :class:`gpucoll.batch_p2p.BatchP2P` (many at once), and the
    prefix reductions ``scan`` and ``exscan`` of :class:`gpucoll.scan.PrefixReductions`. Its
    world ranks and sub-communicators (``ranks``, ``split``, ``new_group``, ``host_group``)
    are those of :class:`gpucoll.groups.Groups`. Every public call is remembered by its flight
    recorder (:meth:`trace`, :mod:`gpucoll.flight_recorder`).

    Attributes:
        rank: this process's rank in the group, 0 <= rank < size.
        size: number of ranks.
        local_rank: rank among the group's ranks on this host.
        local_size: number of the group's ranks on this host.
        backend: the registered name of the backend ("cpu", "nccl", ...).
        memory: where the arrays it takes live: "host" (NumPy; the CPU backend also stages
            CuPy arrays) or "cuda" (GPU arrays). Code that allocates buffers for a
            communicator asks this, never the backend's name.
        timeout: seconds a blocking call may wait.
        lost: on a communicator made by ``shrink()``, world rank -> why it was left out
            (e.g. "signal SIGKILL"); empty otherwise.
        joined: on a communicator made by ``grow()`` (or joined through ``init()``), the
            world ranks that came in; empty otherwise.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    backend: str
    memory: str = "host"
    timeout: float
    lost: Mapping[int, str] = MappingProxyType({})
    joined: Tuple[int, ...] = ()
    _aborted: Optional[str] = None  # why the communicator was aborted (backends set it)
    _closed: bool = False
    _recorder: Any = flight_recorder.NOT_STARTED  # its flight recorder, made at the first op
    _enqueued: Any = None  # a GPU backend's probe of its last blocking call, for the recorder

    # ------------------------------------------------------------------ checks
    def _check_alive(self) -> None:
        """CommAbortedError once the communicator is aborted or closed (before anything is sent)."""
        if self._aborted is not None:
            raise CommAbortedError(f"rank {self.rank}: communicator was aborted ({self._aborted}); "
                                   f"create a new one")
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: communicator is closed")

    def _array(self, x: Array, name: str) -> Array:
        """Return ``x`` as the backend's array type, checking type, dtype and contiguity."""
        x = self._import_array(x, name)
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array (NumPy, CuPy), got {type(x).__name__}")
        wire_code(x.dtype)  # TypeError for unsupported dtypes
        flags = getattr(x, "flags", None)
        if flags is not None and not flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (got strides {tuple(x.strides)} for "
                             f"shape {_shape_of(x)}); pass np.ascontiguousarray({name})")
        return x

    def _import_array(self, x: Array, name: str) -> Array:
        """The backend's view of a caller's array (identity here; the NCCL backend takes CuPy
        arrays, ``__cuda_array_interface__`` and DLPack objects without a copy)."""
        return x

    _converts_arrays = False  # True when _import_array may return a different object

    def _hand_back(self, result: Any, *pairs: Any) -> Any:
        """Map a backend result to what the caller passed: ``pairs`` is (view, original, ...).

        A result that is one of the views becomes the caller's original object; a new array
        is exported in the caller's array type (see ``_export``). A ``Work`` maps its result
        when it is read.
        """
        if not self._converts_arrays or result is None:
            return result
        if result is pairs[0]:  # the common case: the result is the first view (in place)
            return pairs[1]
        if isinstance(result, Work):
            result._map = lambda value: self._hand_back(value, *pairs)
            return result
        like = None
        for i in range(0, len(pairs), 2):
            if result is pairs[i] and pairs[i] is not None:
                return pairs[i + 1]
            if like is None:
                like = pairs[i + 1]
        return self._export(result, like) if like is not None else result

    def _export(self, result: Array, like: Array) -> Array:
        """A new result array in the type of the caller's array ``like`` (identity here)."""
        return result

    @staticmethod
    def _writable(x: Array, name: str) -> None:
        flags = getattr(x, "flags", None)
        if flags is not None and getattr(flags, "writeable", True) is False:
            raise ValueError(f"{name} is read-only; pass a writeable array (or out=)")

    def _out(self, out: Array, shape: Tuple[int, ...], dtype: Any, name: str = "out") -> Array:
        out = self._array(out, name)
        self._writable(out, name)
        if _shape_of(out) != tuple(shape):
            raise ValueError(f"{name} has shape {_shape_of(out)}, expected {tuple(shape)}")
        if out.dtype != dtype:
            raise TypeError(f"{name} has dtype {out.dtype}, expected {dtype}")
        return out

    def _root(self, root: int, name: str = "root") -> int:
        if isinstance(root, bool) or not isinstance(root, (int,)) and not hasattr(root, "__index__"):
            raise TypeError(f"{name} must be an int, got {type(root).__name__}")
        root = int(root)
        if not 0 <= root < self.size:
            raise ValueError(f"{name}={root} is out of range for a communicator of size {self.size}")
        return root

    def _peer(self, peer: int, name: str) -> int:
        peer = self._root(peer, name)
        if peer == self.rank:
            raise ValueError(f"{name}={peer} is this rank; send/recv need another rank")
        return peer

    def _leading(self, x: Array, name: str) -> Tuple[int, ...]:
        """Check that ``x`` has shape (size, *chunk) and return chunk."""
        shape = _shape_of(x)
        if not shape or shape[0] != self.size:
            raise ValueError(f"{name} must have shape (size={self.size}, ...), got {shape}")
        return shape[1:]

    # ------------------------------------------------------------------ collectives
    @traced(describe_array)
    def all_reduce(self, x: Array, op: Union[ReduceOp, str] = "sum", *, out: Optional[Array] = None,
                   async_op: bool = False, stream: Any = None):
        """Reduce ``x`` across all ranks; every rank gets the result.

        Args:
            x: input array (same shape and dtype on every rank).
            op: sum, prod, min, max, avg, or band/bor/bxor on integers.
            out: where to write the result; None reduces ``x`` in place.
            async_op: return a ``Work`` instead of blocking.
            stream: GPU backends: the CUDA stream to enqueue on (a CuPy stream, an object with
                ``cuda_stream`` or ``__cuda_stream__``, or a raw pointer); default the caller's
                current CuPy stream. The CPU backend uses it for staging copies only.

        Returns:
            The result array (``out`` or ``x``), or a ``Work`` when ``async_op``.

        Example (two ranks)::

            x = np.full(4, comm.rank + 1.0)   # rank 0: 1s, rank 1: 2s
            comm.all_reduce(x)                # both: [3, 3, 3, 3]
        """
        op = _parse_op(op)
        x_in, out_in = x, out
        x = self._array(x, "x")
        check_op_dtype(op, x.dtype)
        if out is None:
            self._writable(x, "x")
        else:
            out = self._out(out, _shape_of(x), x.dtype)
        result = self._all_reduce(x, op, out, async_op, stream)
        if result is x and self._converts_arrays:  # in place: _hand_back's first case, inlined
            return x_in
        return self._hand_back(result, x, x_in, out, out_in)

    @traced(describe_rooted)
    def broadcast(self, x: Array, root: int = 0, *, async_op: bool = False, stream: Any = None):
        """Copy ``x`` from ``root`` into ``x`` on every other rank (in place).

        Example (two ranks)::

            x = np.arange(3.0) if comm.rank == 0 else np.empty(3)
            comm.broadcast(x, root=0)         # both: [0, 1, 2]
        """
        root = self._root(root)
        x_in, x = x, self._array(x, "x")
        if self.rank != root:
            self._writable(x, "x")
        return self._hand_back(self._broadcast(x, root, async_op, stream), x, x_in)

    @traced(describe_rooted)
    def reduce(self, x: Array, root: int = 0, op: Union[ReduceOp, str] = "sum", *,
               out: Optional[Array] = None, async_op: bool = False, stream: Any = None):
        """Reduce ``x`` across ranks into ``out`` (or ``x``) on ``root``.

        Returns:
            The result on ``root``; None on other ranks (whose ``x`` is left unchanged).

        Example (two ranks)::

            y = comm.reduce(np.ones(2), root=1)   # rank 1: [2, 2]; rank 0: None
        """
        op = _parse_op(op)
        root = self._root(root)
        x_in, out_in = x, out
        x = self._array(x, "x")
        check_op_dtype(op, x.dtype)
        if self.rank == root:
            if out is None:
                self._writable(x, "x")
            else:
                out = self._out(out, _shape_of(x), x.dtype)
        else:
            out = None
        return self._hand_back(self._reduce(x, root, op, out, async_op, stream),
                               x, x_in, out, out_in)

    @traced(describe_array)
    def all_gather(self, x: Array, *, out: Optional[Array] = None, async_op: bool = False,
                   stream: Any = None):
        """Gather every rank's ``x`` into ``out`` of shape ``(size, *x.shape)`` on every rank.

        Example (two ranks)::

            comm.all_gather(np.array([comm.rank]))  # both: [[0], [1]]
        """
        x_in, out_in = x, out
        x = self._array(x, "x")
        if out is not None:
            out = self._out(out, (self.size,) + _shape_of(x), x.dtype)
        return self._hand_back(self._all_gather(x, out, async_op, stream), out, out_in, x, x_in)

    @traced(describe_array)
    def reduce_scatter(self, x: Array, op: Union[ReduceOp, str] = "sum", *,
                       out: Optional[Array] = None, async_op: bool = False, stream: Any = None):
        """Reduce ``x`` (shape ``(size, *chunk)``) across ranks; rank r gets block r.

        Example (two ranks)::

            x = np.array([[1.0], [2.0]]) * (comm.rank + 1)
            comm.reduce_scatter(x)            # rank 0: [3.]; rank 1: [6.]
        """
        op = _parse_op(op)
        x_in, out_in = x, out
        x = self._array(x, "x")
        check_op_dtype(op, x.dtype)
        chunk = self._leading(x, "x")
        if out is not None:
            out = self._out(out, chunk, x.dtype)
        return self._hand_back(self._reduce_scatter(x, op, out, async_op, stream),
                               out, out_in, x, x_in)

    @traced(describe_rooted)
    def gather(self, x: Array, root: int = 0, *, out: Optional[Array] = None, stream: Any = None):
        """Gather every rank's ``x`` into ``out`` (shape ``(size, *x.shape)``) on ``root``.

        Returns:
            The gathered array on ``root``; None elsewhere.

        Example (two ranks)::

            comm.gather(np.array([comm.rank * 10]), root=0)  # rank 0: [[0], [10]]
        """
        root = self._root(root)
        x_in, out_in = x, out
        x = self._array(x, "x")
        if self.rank == root and out is not None:
            out = self._out(out, (self.size,) + _shape_of(x), x.dtype)
        elif self.rank != root:
            out = None
        return self._hand_back(self._gather(x, root, out, stream), out, out_in, x, x_in)

    @traced(describe_scatter)
    def scatter(self, x: Optional[Array], root: int = 0, *, out: Optional[Array] = None,
                stream: Any = None):
        """Send block r of ``x`` (shape ``(size, *chunk)``, read on ``root`` only) to rank r.

        Args:
            x: on root, the array to scatter. Elsewhere it may be None when ``out`` is given,
                or an array of the full shape used only for shape and dtype.
            out: the chunk buffer; required on non-root ranks unless ``x`` is given.

        Example (two ranks)::

            x = np.array([[1], [2]]) if comm.rank == 0 else None
            comm.scatter(x, root=0, out=np.empty(1, np.int64))  # rank 0: [1]; rank 1: [2]
        """
        root = self._root(root)
        x_in, out_in = x, out
        if self.rank == root or x is not None:
            if x is None:
                raise ValueError("scatter: x is required on the root rank")
            x = self._array(x, "x")
            chunk = self._leading(x, "x")
            if out is not None:
                out = self._out(out, chunk, x.dtype)
        else:
            if out is None:
                raise ValueError(f"scatter: rank {self.rank} is not the root; pass out= (the chunk "
                                 f"buffer) or x (for its shape and dtype)")
            out = self._array(out, "out")
            self._writable(out, "out")
        result = self._scatter(x if self.rank == root else None, root, out,
                               None if x is None else (self._leading(x, "x"), x.dtype), stream)
        return self._hand_back(result, out, out_in, x, x_in)

    @traced(describe_array)
    def all_to_all(self, x: Array, *, out: Optional[Array] = None, stream: Any = None):
        """Rank r sends block j of ``x`` (shape ``(size, *chunk)``) to rank j, which stores it
        as its block r.

        Example (two ranks)::

            x = np.array([[comm.rank * 2], [comm.rank * 2 + 1]])
            comm.all_to_all(x)   # rank 0: [[0], [2]]; rank 1: [[1], [3]]
        """
        x_in, out_in = x, out
        x = self._array(x, "x")
        self._leading(x, "x")
        if out is not None:
            out = self._out(out, _shape_of(x), x.dtype)
            if out is x or out_in is x_in:
                raise ValueError("all_to_all: out must not be x (no in-place all_to_all)")
        return self._hand_back(self._all_to_all(x, out, stream), out, out_in, x, x_in)

    # ------------------------------------------------------------------ point to point
    @traced(describe_p2p)
    def send(self, x: Array, dst: int, *, tag: int = 0, stream: Any = None) -> None:
        """Send ``x`` to rank ``dst``; returns when ``x`` may be reused.

        Messages between two ranks arrive in the order they were sent; the receiver's
        ``tag`` must match (a mismatch raises ``CollectiveMismatchError``).
        """
        dst = self._peer(dst, "dst")
        x = self._array(x, "x")
        self._send(x, dst, self._tag(tag), False, stream)

    @traced(describe_p2p)
    def recv(self, out: Array, src: int, *, tag: int = 0, stream: Any = None):
        """Receive into ``out`` from rank ``src`` (shape and dtype must match the sent array)."""
        src = self._peer(src, "src")
        out_in, out = out, self._array(out, "out")
        self._writable(out, "out")
        return self._hand_back(self._recv(out, src, self._tag(tag), False, stream), out, out_in)

    @traced(describe_p2p)
    def isend(self, x: Array, dst: int, *, tag: int = 0, stream: Any = None) -> Work:
        """Start sending ``x`` to ``dst``; don't modify ``x`` until the Work completes."""
        dst = self._peer(dst, "dst")
        x = self._array(x, "x")
        return self._send(x, dst, self._tag(tag), True, stream)

    @traced(describe_p2p)
    def irecv(self, out: Array, src: int, *, tag: int = 0, stream: Any = None) -> Work:
        """Start receiving into ``out`` from ``src``; read ``out`` after the Work completes."""
        src = self._peer(src, "src")
        out_in, out = out, self._array(out, "out")
        self._writable(out, "out")
        return self._hand_back(self._recv(out, src, self._tag(tag), True, stream), out, out_in)

    @staticmethod
    def _tag(tag: int) -> int:
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 2 ** 32:
            raise ValueError(f"tag must be an int in [0, 2**32), got {tag!r}")
        return tag

    # ------------------------------------------------------------------ groups and lifetime
    @property
    def closed(self) -> bool:
        """True once ``close()`` has run (an aborted communicator is not closed until then)."""
        return bool(getattr(self, "_closed", False))

    @traced(describe_nothing)
    def barrier(self, timeout: Optional[float] = None) -> None:
        """Block until every rank has entered the barrier (at most ``timeout`` seconds)."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._barrier(self.timeout if timeout is None else float(timeout))

    @traced(describe_nothing)
    def shrink(self, timeout: Optional[float] = None) -> "Communicator":
        """A new communicator of the ranks still alive, after a failure (ULFM's
        ``MPIX_Comm_shrink``).

        Every surviving rank calls it, typically after catching ``PeerError``,
        ``CommTimeoutError`` or ``CommAbortedError``. The survivors agree through the store
        on who is left: a rank that calls ``shrink()`` within ``timeout`` seconds of the first
        one is kept; a rank that its launcher reported dead (``gpucoll run --elastic``) is
        not waited for, any other absent rank for at most ``timeout``. The new communicator
        numbers the survivors in their old order, keeps their world ranks (``ranks``,
        ``to_world``) and gets fresh connections; split and new_group rebuild subgroups
        from it. This communicator is aborted (on a healthy one, shrink() aborts it first, so
        every peer's pending operation fails and they shrink too); close() it afterwards. The
        new communicator takes over the store.

        Args:
            timeout: seconds to wait for ranks that neither called shrink nor are known dead
                (default: the communicator's timeout).

        Returns:
            The new communicator.

        Raises:
            CommAbortedError: this communicator was closed, or the survivors decided without
                this rank (it called too late).
            CommTimeoutError: a survivor died during the shrink; call ``shrink()`` again.

        Example (four ranks, rank 3 killed)::

            try:
                comm.all_reduce(x)
            except (gc.PeerError, gc.CommTimeoutError, gc.CommAbortedError):
                comm = comm.shrink()           # ranks 0, 1, 2: comm.size == 3
                comm.all_reduce(x)
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if self.closed:
            raise CommAbortedError(f"rank {self.rank}: shrink() on a closed communicator; "
                                   f"call shrink() before close()")
        return self._shrink(self.timeout if timeout is None else float(timeout))

    @traced(describe_nothing)
    def grow(self, timeout: Optional[float] = None, *, min_size: int = 0) -> "Communicator":
        """A communicator of this one's ranks and every rank waiting to join the job, or this
        communicator itself when none waits (the inverse of :meth:`shrink`).

        Collective over this communicator; call it at a step boundary, every few steps. A
        rank started to replace a lost one (``gpucoll run --elastic --replace N``, or any
        process whose ``init()`` sees GPUCOLL_JOIN=1) waits in ``init()`` until the members
        call ``grow()``. The new communicator orders its ranks by world rank, lists the
        newcomers' world ranks in ``joined``, gets fresh connections and takes over the
        store; this one stays usable until you ``close()`` it. Send the newcomers the state
        they need (e.g. ``broadcast_parameters``) on the new one. Costs a few store round
        trips when nobody waits.

        Args:
            timeout: seconds rank 0 waits for newcomers (with ``min_size``), and the others
                for its decision (default: the communicator's timeout).
            min_size: wait (at most ``timeout``) until enough ranks asked to join to make
                the communicator this big, e.g. the job's full size after a loss (what
                asked in time is taken either way); 0: take who is waiting now.

        Raises:
            CommAbortedError: the communicator is closed or aborted.
            CommTimeoutError: rank 0 did not decide in time (it died: ``shrink()``).
            UnsupportedOperationError: the backend cannot add ranks (MPI).
            ValueError: a bad argument, or a group made by split / new_group / host_group.

        Example (rank 2 of 4 was lost and the launcher started its replacement)::

            bigger = comm.grow()
            if bigger is not comm:             # bigger.joined == (2,)
                comm.close()
                comm = bigger
                broadcast_parameters(comm, params, root=0)
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError(f"min_size must be an int >= 0, got {min_size!r}")
        if self.closed or self._aborted is not None:
            raise CommAbortedError(f"rank {self.rank}: grow() on a closed or aborted "
                                   f"communicator; shrink() first after a failure")
        return self._grow(self.timeout if timeout is None else float(timeout), min_size)

    @abc.abstractmethod
    def abort(self) -> None:
        """Abort: fail every pending and future operation at once, close connections."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the communicator after a last check that no message was left unreceived."""

    def _release_store(self) -> None:
        """Close the rendezvous store when this communicator opened it (``init`` without
        ``store=``); sub-communicators share their parent's and leave it open."""
        if getattr(self, "_owns_store", False):
            try:
                self._root_store.close()
            except Exception:
                pass

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the peers' errors then say why: "rank 1 raised RuntimeError: boom"
            self._abort_for(f"rank {self.rank} raised {exc_type.__name__}: {exc}")

    # ------------------------------------------------------------------ flight recorder
    def _abort_for(self, reason: str) -> None:
        """``abort()``, telling the peers ``reason`` where the backend can (the CPU backend
        leaves it in the store, and a peer's ``PeerError`` quotes it)."""
        self.abort()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend} rank={self.rank} size={self.size}>"

    # ------------------------------------------------------------------ backend hooks
    # A backend overrides the operations it has; the others raise UnsupportedOperationError
    # ("backend X does not support Y") after the arguments were checked, before anything is sent.
    def _unsupported(self, op: str):
        raise UnsupportedOperationError(self.backend, op)

    def _all_reduce(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        return self._unsupported("all_reduce")

    def _broadcast(self, x, root: int, async_op: bool, stream=None):
        return self._unsupported("broadcast")

    def _reduce(self, x, root: int, op: ReduceOp, out, async_op: bool, stream=None):
        return self._unsupported("reduce")

    def _all_gather(self, x, out, async_op: bool, stream=None):
        return self._unsupported("all_gather")

    def _reduce_scatter(self, x, op: ReduceOp, out, async_op: bool, stream=None):
        return self._unsupported("reduce_scatter")

    def _gather(self, x, root: int, out, stream=None):
        return self._unsupported("gather")

    def _scatter(self, x, root: int, out, template, stream=None):
        return self._unsupported("scatter")

    def _all_to_all(self, x, out, stream=None):
        return self._unsupported("all_to_all")

    def _send(self, x, dst: int, tag: int, async_op: bool, stream=None):
        return self._unsupported("send")

    def _recv(self, out, src: int, tag: int, async_op: bool, stream=None):
        return self._unsupported("recv")

    def _barrier(self, timeout: float) -> None:
        return self._unsupported("barrier")

    def _shrink(self, timeout: float) -> "Communicator":
        return self._unsupported("shrink")

    def _grow(self, timeout: float, min_size: int) -> "Communicator":
        return self._unsupported("grow")
