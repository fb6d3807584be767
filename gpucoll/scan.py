"""Prefix reductions across ranks: ``scan`` and ``exscan`` (MPI's ``MPI_Scan`` / ``MPI_Exscan``).

Rank r gets ``op(x_0, ..., x_r)`` (``scan``) or ``op(x_0, ..., x_{r-1})`` (``exscan``),
elementwise: a rank's offset into a shared file, or its first global index, is the exclusive
prefix sum of the per-rank counts. Every backend has them through two algorithms built on the
communicator's own point-to-point calls, picked by :func:`scan_algorithm`: recursive doubling
for small arrays (:func:`recursive_doubling_scan`) and a pipelined chain for large ones
(:func:`chain_scan`); the MPI backend
calls MPI's own ``Iscan`` / ``Iexscan`` where MPI reduces the dtype natively
(:mod:`gpucoll.backends.mpi_scan`).

Arrays stay where the caller's array lives: NumPy on the host; CuPy (or what the NCCL
backend imported) on the GPU, combined with CuPy on the call's stream after the receive
that feeds it, in stream order.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import numpy as np

from . import cuda_env
from .flight_recorder import describe_array, traced
from .graph_capture import HOST_STAGING, is_device_array, refusal, stream_is_capturing
from .types import ReduceOp, check_op_dtype, combine_fn

__all__ = ["PrefixReductions", "identity", "recursive_doubling_scan", "chain_scan",
           "scan_algorithm", "SCAN_TAG"]

SCAN_TAG = 23714  # the tag of a scan's messages (below MPI's smallest allowed TAG_UB, 32767)

# When the chain replaces recursive doubling, measured with bench/bench_scan.py on 2-4 ranks
# (bench/RESULTS.md, "Prefix reductions: the pipelined chain"); module-level so that tests
# can force either algorithm. (from this many ranks, arrays of at least this many bytes):
CHAIN_MIN_BYTES = ((2, 4 << 20), (3, 256 << 10))
CHAIN_MEASURED_RANKS = 4  # beyond: the chain also needs at least size - 1 segments
CHAIN_SEGMENT_BYTES = 4 << 20  # the unit the chain forwards

_TEMPORARIES = ("it combines through temporary arrays that a graph would go on using after "
                "they are freed; call it outside the capture")


def identity(op: ReduceOp, dtype: Any) -> np.ndarray:
    """The 0-d array of ``dtype`` that ``op`` leaves unchanged: what ``exscan`` gives rank 0.

    0 for sum, bor and bxor; 1 for prod; the largest value (+inf for floating dtypes) for min,
    the smallest (-inf) for max; all bits set for band. On bool: False for sum, max, bor and
    bxor; True for prod, min and band (sum is "or", prod "and", as for every reduction).

    Raises:
        ValueError: ``op`` is avg, which has no identity.
    """
    dtype = np.dtype(dtype)
    kind = dtype.kind
    if op is ReduceOp.AVG:
        raise ValueError("op avg has no identity")
    if op in (ReduceOp.SUM, ReduceOp.BOR, ReduceOp.BXOR):
        return np.zeros((), dtype)
    if op is ReduceOp.PROD:
        return np.ones((), dtype)
    if kind == "b":
        return np.array(op in (ReduceOp.MIN, ReduceOp.BAND))
    if op is ReduceOp.BAND:
        return np.array(-1).astype(dtype) if kind == "i" else np.array(np.iinfo(dtype).max, dtype)
    largest = op is ReduceOp.MIN
    if kind in "iu":
        info = np.iinfo(dtype)
        return np.array(info.max if largest else info.min, dtype)
    return np.array(np.inf if largest else -np.inf).astype(dtype)  # float16/32/64, bfloat16


def _array_module(array: Any) -> Any:
    """NumPy for host arrays, else CuPy (or the module the NCCL backend was handed)."""
    return np if isinstance(array, np.ndarray) else cuda_env.cupy_module()


def recursive_doubling_scan(comm: Any, x: Any, result: Any, op: ReduceOp, exclusive: bool,
                            stream: Any = None) -> None:
    """Hillis–Steele (recursive doubling) prefix reduction of ``x`` into ``result``, over
    ``comm``'s ``sendrecv`` / ``send`` / ``recv``, as MPICH's ``MPI_Scan``.

    In round k = 0, 1, ... (distance d = 2**k) rank r sends its partial reduction of
    ``x_{r-d+1..r}`` to rank r + d and receives rank r - d's, which covers the ranks just
    below its own (``x_{r-2d+1..r-d}``) and is combined on the left (lower ranks first, as
    ``np.add.accumulate`` does): after the round, its partial covers ``x_{r-2d+1..r}`` (ranks
    below 0 left out). Messages go only to higher ranks and a receive waits only for lower
    ones, so the rounds cannot deadlock. ``exscan`` keeps a second
    array, the reduction of what it received only; rank 0, which receives nothing, gets the
    op's :func:`identity`.

    Steps: ceil(log2 p) rounds of at most one send and one receive per rank. Bytes on the
    wire: each rank sends ``x.nbytes`` in each round where r + d < p and receives as many
    where r - d >= 0: at most ceil(log2 p) * nbytes each way per rank, and
    ``nbytes * sum over rounds of (p - d)`` in all (about p log2 p nbytes). ``x`` is read, and
    ``result`` (which may be ``x``) written; temporaries: one array like ``x`` for ``scan``,
    two for ``exscan``.
    """
    xp = _array_module(x)
    rank, size = comm.rank, comm.size
    combine = getattr(xp, combine_fn(op, x.dtype).ufunc.__name__)
    if not exclusive:
        if result is not x:
            result[...] = x
        if size == 1 or x.size == 0:
            return
    partial = None
    if exclusive and size > 1 and x.size:
        partial = comm._empty_as(x, tuple(x.shape), x.dtype)  # what this rank sends on
        partial[...] = x
    if exclusive and rank == 0:
        result.fill(identity(op, x.dtype)[()])
    if partial is None and exclusive:
        return
    incoming = None  # receive buffer, made at the first receive into something not result
    received = False
    distance = 1
    while distance < size:
        dst = rank + distance if rank + distance < size else None
        src = rank - distance if rank >= distance else None
        sending = result if not exclusive else partial
        if src is None and dst is None:  # neither neighbour at this distance exists
            pass
        elif src is None:
            comm.send(sending, dst, tag=SCAN_TAG, stream=stream)
        else:
            if exclusive and not received:
                target = result  # the first (highest) block of the exclusive prefix
            else:
                if incoming is None:
                    incoming = comm._empty_as(x, tuple(x.shape), x.dtype)
                target = incoming
            if dst is None:
                comm.recv(target, src, tag=SCAN_TAG, stream=stream)
            else:
                comm.sendrecv(sending, dst, target, src, tag=SCAN_TAG, stream=stream)
            if target is incoming:
                combine(incoming, result, out=result)
            if exclusive and rank + 2 * distance < size:  # partial is sent again later
                combine(target, partial, out=partial)
            received = True
        distance *= 2


def scan_algorithm(nbytes: int, size: int) -> str:
    """``"chain"`` or ``"recursive_doubling"`` for an array of ``nbytes`` on ``size`` ranks.

    The chain from the ``CHAIN_MIN_BYTES`` that applies to ``size`` (4 MiB on 2 ranks,
    256 KiB from 3, measured); recursive doubling below (fewer steps). On more than
    ``CHAIN_MEASURED_RANKS`` ranks, unmeasured here, the chain also needs at least
    ``size - 1`` segments: its p - 1 + S - 1 segment steps are then at most 2 S, fewer than
    the ceil(log2 p) S of recursive doubling (p > 4).
    """
    minimum = None
    for ranks, nbytes_from in CHAIN_MIN_BYTES:
        if size >= ranks:
            minimum = nbytes_from
    if minimum is None or nbytes < minimum:
        return "recursive_doubling"
    segments = -(-nbytes // max(CHAIN_SEGMENT_BYTES, 1))
    if size > CHAIN_MEASURED_RANKS and size - 1 > segments:
        return "recursive_doubling"
    return "chain"


def chain_scan(comm: Any, x: Any, result: Any, op: ReduceOp, exclusive: bool,
               stream: Any = None, segment_bytes: Optional[int] = None) -> None:
    """Segmented, pipelined chain prefix reduction of ``x`` into ``result``, over ``comm``'s
    ``isend`` / ``irecv`` (for large arrays, where recursive doubling moves log2 p full
    arrays per rank).

    ``x`` is cut into segments of ``segment_bytes`` (default ``CHAIN_SEGMENT_BYTES``). Rank
    r receives segment k of ``prefix_{r-1} = op(x_0, ..., x_{r-1})`` from rank r - 1,
    combines it on the left of its own segment k (lower ranks first, as
    ``np.add.accumulate``) and sends ``op(prefix_{r-1}, x_r)`` segment k on to rank r + 1,
    while segment k + 1 is already being received. ``scan`` keeps what it sends;
    ``exscan`` keeps what it received (rank 0 gets the op's :func:`identity`). Messages go
    only from r to r + 1, so the chain cannot deadlock, even with synchronous sends.

    Steps: p - 1 + S - 1 segment steps on the critical path for S segments (the last
    segment leaves rank 0 after S - 1 steps and needs p - 1 hops). Bytes on the wire:
    ranks 0..p-2 each send ``x.nbytes`` once and ranks 1..p-1 each receive it once:
    ``(p - 1) * nbytes`` in all, one combine of ``x`` per rank. ``x`` is read, and
    ``result`` (which may be ``x``) written; temporaries: two segments (``scan`` in place)
    or one array like ``x`` (``exscan`` on ranks 1..p-2), none otherwise.
    """
    xp = _array_module(x)
    rank, size = comm.rank, comm.size
    combine = getattr(xp, combine_fn(op, x.dtype).ufunc.__name__)
    if not exclusive and result is not x:
        result[...] = x
    if size == 1 or x.size == 0:
        if exclusive:
            result.fill(identity(op, x.dtype)[()])
        return
    step = max(1, (CHAIN_SEGMENT_BYTES if segment_bytes is None else segment_bytes)
               // x.itemsize)
    bounds = [(start, min(start + step, x.size)) for start in range(0, x.size, step)]
    flat_x, flat_result = x.reshape(-1), result.reshape(-1)
    first, last = rank == 0, rank == size - 1
    # received[k]: where segment k of prefix_{r-1} lands; sent[k]: what goes on to r + 1
    if first:
        received = None
        sent = flat_x if exclusive else flat_result
    elif exclusive:
        # in place, a middle rank sends op(prefix, x) from x itself and keeps the prefix in
        # a temporary until x has been sent on; otherwise the prefix lands in result
        keep_in_x = result is x and not last
        received = comm._empty_as(x, (x.size,), x.dtype) if keep_in_x else flat_result
        sent = None if last else flat_x if keep_in_x else comm._empty_as(x, (x.size,), x.dtype)
    else:
        sent = flat_result
        received = flat_result if result is not x else None
    incoming = None
    if received is None and not first:  # scan in place: two segment buffers, in turn
        incoming = [comm._empty_as(x, (step,), x.dtype) for _ in range(min(2, len(bounds)))]

    def post_receive(k: int):
        start, stop = bounds[k]
        target = received[start:stop] if incoming is None else incoming[k % 2][:stop - start]
        return comm.irecv(target, rank - 1, tag=SCAN_TAG, stream=stream), target

    sends = []
    pending = None if first else post_receive(0)
    for k, (start, stop) in enumerate(bounds):
        if not first:
            work, target = pending
            pending = post_receive(k + 1) if k + 1 < len(bounds) else None
            work.wait()
            if not exclusive:
                combine(target, flat_x[start:stop], out=flat_result[start:stop])
            elif not last:
                combine(target, flat_x[start:stop], out=sent[start:stop])
        if not last:
            sends.append(comm.isend(sent[start:stop], rank + 1, tag=SCAN_TAG, stream=stream))
    for work in sends:
        work.wait()
    if exclusive and first:
        result.fill(identity(op, x.dtype)[()])
    elif exclusive and received is not flat_result:
        flat_result[...] = received


class PrefixReductions:
    """Mixin of :class:`gpucoll.Communicator`: :meth:`scan`, :meth:`exscan` and their default
    backend hook (uses the Communicator's argument checks and point-to-point calls)."""

    rank: int
    size: int
    backend: str

    @traced(describe_array)
    def scan(self, x: Any, op: Union[ReduceOp, str] = "sum", *, out: Optional[Any] = None,
             stream: Any = None):
        """Inclusive prefix reduction across ranks (MPI's ``Scan``): rank r gets
        ``op(x_0, ..., x_r)`` elementwise, where ``x_q`` is rank q's ``x``.

        Partial results are combined in rank order (lower ranks on the left), in
        ceil(log2 size) rounds of point-to-point messages (:func:`recursive_doubling_scan`),
        or for large arrays along a pipelined chain of ranks (:func:`chain_scan`; which one:
        :func:`scan_algorithm`).

        Args:
            x: input array (same shape and dtype on every rank).
            op: sum, prod, min, max, or band/bor/bxor on integers and bool (not avg).
            out: where to write the result; None writes it into ``x``.
            stream: GPU arrays: the CUDA stream to enqueue on (as for ``all_reduce``);
                default the caller's current CuPy stream.

        Returns:
            The result array (``out`` or ``x``).

        Raises:
            ValueError: op avg, a read-only ``x``, or ``out`` of the wrong shape; before
                anything is sent.
            TypeError: an unsupported dtype, an op the dtype has not (min on complex, band on
                floats), or ``out`` of another dtype; before anything is sent.
            UnsupportedOperationError: a device array on a stream that is capturing a CUDA
                graph (before anything is sent).

        Example (two ranks)::

            x = np.full(3, comm.rank + 1)     # rank 0: 1s, rank 1: 2s
            comm.scan(x)                      # rank 0: [1, 1, 1]; rank 1: [3, 3, 3]
        """
        return self._prefix("scan", x, op, out, stream, exclusive=False)

    @traced(describe_array)
    def exscan(self, x: Any, op: Union[ReduceOp, str] = "sum", *, out: Optional[Any] = None,
               stream: Any = None):
        """Exclusive prefix reduction across ranks (MPI's ``Exscan``): rank r gets
        ``op(x_0, ..., x_{r-1})`` elementwise; rank 0 gets the op's identity (MPI leaves it
        undefined): 0 for sum, bor and bxor, 1 for prod, the dtype's largest value (+inf)
        for min, its smallest (-inf) for max, all bits set for band (on bool: False, or
        True for prod, min and band).

        The exclusive prefix sum of per-rank counts is each rank's offset: into a shared
        file, or into a global index. Arguments, errors and algorithm as for :meth:`scan`.

        Returns:
            The result array (``out`` or ``x``).

        Example (two ranks)::

            count = np.array([10 if comm.rank == 0 else 7])
            comm.exscan(count)                # rank 0: [0]; rank 1: [10]
        """
        return self._prefix("exscan", x, op, out, stream, exclusive=True)

    def _prefix(self, name: str, x: Any, op: Union[ReduceOp, str], out: Any, stream: Any,
                exclusive: bool):
        """Check the arguments (before anything is sent), then run the backend's ``_scan``."""
        op = ReduceOp.parse(op)
        if op is ReduceOp.AVG:
            raise ValueError(f"{name}: op avg is not a prefix reduction (each rank would divide "
                             f"by its own count of ranks, which MPI does not define either); "
                             f"{name} with op='sum' and divide by "
                             f"{'comm.rank + 1' if not exclusive else 'comm.rank'} yourself")
        x_in, out_in = x, out
        x = self._array(x, "x")
        check_op_dtype(op, x.dtype)
        if out is None or out is x_in:
            self._writable(x, "x")
            out = None
        else:
            out = self._out(out, tuple(int(d) for d in x.shape), x.dtype)
        self._check_alive()
        if type(x) is not np.ndarray:   # NumPy arrays (the hot path) are never captured
            self._refuse_scan_in_capture(name, x, stream)
        result = self._scan(x, op, out, exclusive, stream)
        return self._hand_back(result, x, x_in, out, out_in)

    def _refuse_scan_in_capture(self, name: str, x: Any, stream: Any) -> None:
        """Raise before anything is sent when ``x`` is a device array and the call's stream
        captures a CUDA graph: the scan's temporaries (and, on a host backend, its staging
        through host memory) cannot be recorded into a graph."""
        if not is_device_array(x):
            return
        cupy = cuda_env.cupy_module()
        with cupy.cuda.Device(_device_view(cupy, x).device.id):
            capturing = stream_is_capturing(cuda_env.as_cupy_stream(cupy, stream))
        if capturing:
            reason = HOST_STAGING if getattr(self, "memory", "host") == "host" else _TEMPORARIES
            raise refusal(self.backend, f"{name} of a CUDA array", reason)

    def _scan(self, x: Any, op: ReduceOp, out: Any, exclusive: bool, stream: Any = None):
        """Backend hook: :func:`recursive_doubling_scan`, or :func:`chain_scan` for large
        arrays (:func:`scan_algorithm`), into ``out`` (None: ``x``). Device
        arrays are combined as CuPy arrays (views of the caller's memory), on ``stream``
        (None: the current one) of their GPU, which is made current meanwhile, so that the
        combines and temporaries follow the receives that feed them. Returns the result."""
        result = x if out is None else out
        if isinstance(x, np.ndarray) or not is_device_array(x):
            _algorithm(x, self.size)(self, x, result, op, exclusive, stream)
            return result
        cupy = cuda_env.cupy_module()
        x_view = _device_view(cupy, x)    # a foreign device array (a torch tensor) has no nbytes
        result_view = x_view if result is x else _device_view(cupy, result)
        with cupy.cuda.Device(x_view.device.id):
            resolved = cuda_env.as_cupy_stream(cupy, stream) or cupy.cuda.get_current_stream()
            with resolved:
                _algorithm(x_view, self.size)(self, x_view, result_view, op, exclusive, resolved)
        return result


def _algorithm(x: Any, size: int) -> Callable[..., None]:
    """:func:`chain_scan` or :func:`recursive_doubling_scan`, as :func:`scan_algorithm` says for
    ``x`` (a NumPy or CuPy array) on ``size`` ranks."""
    return chain_scan if scan_algorithm(x.nbytes, size) == "chain" else recursive_doubling_scan


def _device_view(cupy: Any, array: Any) -> Any:
    """``array`` itself when it is a CuPy array, else a CuPy view of its memory (a torch CUDA
    tensor given to a host backend, say)."""
    return array if isinstance(array, cupy.ndarray) else cupy.asarray(array)
