"""Gradient bucketing for data-parallel training: pack, all-reduce while backward runs, unpack.

Gradients are grouped into flat buckets (one dtype each, in reverse registration order, since
backward produces the last layer's gradients first; the first bucket is small so that
communication starts early). As each gradient is produced the training loop calls
``mark_ready(i, grad)``; when every gradient of a bucket is ready it is packed (one fused kernel
on the GPU) and its all-reduce is issued with ``async_op=True``, so it runs while the rest of
backward is still computing. ``finish()`` waits and unpacks (one fused kernel: average, cast
back, optional loss-scale unscaling and non-finite check) into the gradient arrays.

Buckets are always issued in bucket order, whatever order gradients arrive in, so every rank
issues the same collectives in the same order. Only the ``Communicator`` interface is used.
A comm hook (``comm_hook=``, e.g. ``PowerSGD``; see ``comm_hook.py``) can replace the packed
all-reduce: it is handed each bucket as it fills and completes the step in ``finish()``.

A step on CuPy arrays can be captured into a CUDA graph (``stream.begin_capture()``, the
``mark_ready`` calls or ``reduce``, ``finish()``, ``end_capture()``) and launched once per step
with ``comm.launch_graph``: on a capturing stream the all-reduces are issued blocking (they are
recorded, as a kernel is), ``finish()`` waits for nothing, and the non-finite flag the graph
writes stays alive with it. The loss scale is the one given at capture. What reads the host or
keeps arrays past the step is refused in a capture: ``join``, ``no_sync`` accumulation, a comm
hook.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from .. import kernels
from ..cuda_env import is_cupy_array
from ..graph_capture import device_array_in_capture
from ..hostarrays import array_module as _array_module, host_view
from .comm_hook import CommHook

__all__ = ["Bucketer", "broadcast_parameters", "plan_buckets"]

MiB = 1 << 20
_NOT_CAPTURED = ("Bucketer: {what} cannot be captured into a CUDA graph: {why} (end the "
                 "capture first; see gpucoll.ddp.bucketer)")
_ABANDONED = " (this step was abandoned)"
_COMPRESSION = {None: None, "none": None, "bf16": "bfloat16", "bfloat16": "bfloat16",
                "fp16": "float16", "float16": "float16"}


def _zeros_beside(like: Any, length: int, dtype: Any) -> Any:
    """Zeros of ``length`` elements on ``like``'s device (CuPy: its GPU, not the current one)."""
    xp = _array_module(like)
    if xp is np:
        return np.zeros(length, dtype=dtype)
    with like.device:
        return xp.zeros(length, dtype=dtype)


def _host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def _wire_dtype(dtype: np.dtype, compression: Optional[str]) -> np.dtype:
    if compression is None or dtype != np.float32:
        return dtype
    if compression == "bfloat16":
        if kernels.bfloat16 is None:
            raise TypeError("bfloat16 compression needs the ml_dtypes package for NumPy "
                            "arrays (pip install ml-dtypes); float16 compression works without")
        return kernels.bfloat16
    return np.dtype(np.float16)


def plan_buckets(nbytes: Sequence[int], dtypes: Sequence[Any], bucket_cap_bytes: int,
                 first_bucket_cap_bytes: int) -> List[List[int]]:
    """Assign tensors to buckets: walk them in reverse order, one open bucket per dtype, and
    close a bucket once it holds at least its cap (``first_bucket_cap_bytes`` for the first
    bucket closed, ``bucket_cap_bytes`` after); buckets still open at the end follow, in the
    order their last tensor comes. Returns the buckets' tensor indices, in the
    order they are issued."""
    open_buckets: Dict[str, List[Any]] = {}
    closed: List[List[int]] = []
    for index in reversed(range(len(nbytes))):
        key = np.dtype(dtypes[index]).name
        members, size = open_buckets.pop(key, ([], 0))
        members.append(index)
        size += int(nbytes[index])
        cap = first_bucket_cap_bytes if not closed else bucket_cap_bytes
        if size >= cap:
            closed.append(members)
        else:
            open_buckets[key] = (members, size)
    # the rest in the order backward completes them (their last member is produced)
    closed.extend(sorted((members for members, _ in open_buckets.values()),
                         key=lambda members: -members[-1]))
    return closed


class _Bucket:
    __slots__ = ("members", "dtype", "wire_dtype", "offsets", "length", "buffer", "ready", "work")

    def __init__(self, members: List[int], dtype: np.dtype, wire_dtype: np.dtype,
                 sizes: Sequence[int]):
        self.members = members
        self.dtype = dtype
        self.wire_dtype = wire_dtype
        self.offsets, self.length = kernels.bucket_offsets([sizes[i] for i in members],
                                                           wire_dtype.itemsize)
        self.buffer = None
        self.ready = 0
        self.work = None


class Bucketer:
    """Averages gradients across the ranks of ``comm`` in a few fused, overlapped all-reduces.

    Args:
        comm: the communicator (any backend).
        params: the parameters (or gradients; anything with ``shape`` and ``dtype``) in
            registration order; gradient ``i`` must have the shape and dtype of ``params[i]``.
        bucket_cap_bytes: bytes (on the wire) per bucket after the first.
        first_bucket_cap_bytes: bytes of the first bucket, issued while most of backward is
            still to run.
        compression: None, "bf16" or "fp16": float32 gradients travel (and are summed) in that
            dtype; scaling and the result are float32. Pre-divided by the world size before the
            cast, so float16 sums do not overflow.
        average: divide the sum by the world size (True) or return the sum.
        uneven_inputs: ranks may run out of batches at different steps (torch's ``Join``):
            the first bucket carries one more element, 1 on every rank still training, and a
            rank out of batches calls :meth:`join`, which takes part in the others' steps
            with zero gradients until every rank has joined. Averages still divide by the
            world size, so every sample weighs the same (torch's default).
        comm_hook: a :class:`~gpucoll.ddp.comm_hook.CommHook` (e.g. ``PowerSGD``) that sends
            each bucket instead of the packed all-reduce (torch's ``register_comm_hook``):
            called as each bucket fills and in ``finish()``. It decides what travels, so not
            with ``compression``, ``average=False`` or ``uneven_inputs``; ``no_sync`` works.

    Example (two ranks)::

        bucketer = Bucketer(comm, params)
        for i, grad in backward():        # last layer first
            bucketer.mark_ready(i, grad)  # full buckets start their all-reduce here
        grads = bucketer.finish()         # averaged, in registration order
    """

    def __init__(self, comm, params: Sequence[Any], *, bucket_cap_bytes: int = 25 * MiB,
                 first_bucket_cap_bytes: int = 1 * MiB, compression: Optional[str] = None,
                 average: bool = True, uneven_inputs: bool = False,
                 comm_hook: Optional[CommHook] = None):
        if compression not in _COMPRESSION:
            raise ValueError(f"compression must be None, 'bf16' or 'fp16', got {compression!r}")
        if bucket_cap_bytes <= 0 or first_bucket_cap_bytes <= 0:
            raise ValueError(f"bucket caps must be positive, got {bucket_cap_bytes} and "
                             f"{first_bucket_cap_bytes}")
        if comm_hook is not None:
            _check_hook_settings(comm_hook, compression, average, uneven_inputs)
        self.comm_hook = comm_hook
        self.comm = comm
        self.compression = _COMPRESSION[compression]
        self.average = average
        params = [host_view(p, f"params[{i}]") for i, p in enumerate(params)]
        self.shapes = [tuple(p.shape) for p in params]
        self.dtypes = [np.dtype(p.dtype) for p in params]
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        wire = [_wire_dtype(dtype, self.compression) for dtype in self.dtypes]
        for index, (dtype, wire_dtype) in enumerate(zip(self.dtypes, wire)):
            if (dtype.name, wire_dtype.name) not in kernels.SUPPORTED_PAIRS:
                raise TypeError(f"params[{index}] has dtype {dtype.name}; gradients must be "
                                f"float16, bfloat16, float32 or float64")
        plan = plan_buckets([s * w.itemsize for s, w in zip(sizes, wire)], self.dtypes,
                            bucket_cap_bytes, first_bucket_cap_bytes)
        self._buckets = [_Bucket(members, self.dtypes[members[0]], wire[members[0]], sizes)
                         for members in plan]
        self.uneven_inputs = bool(uneven_inputs) and bool(self._buckets)
        self._flag_at = None     # the first bucket's element that counts the ranks training
        if self.uneven_inputs:
            self._flag_at = self._buckets[0].length
            self._buckets[0].length += 1
        self._like = params[0] if params else None   # where join() allocates
        if comm_hook is not None:
            comm_hook.attach(comm, plan, self.shapes, self.dtypes)
        self._bucket_of: List[Optional[_Bucket]] = [None] * len(self.shapes)  # by gradient
        for bucket in self._buckets:
            for i in bucket.members:
                self._bucket_of[i] = bucket
        self._grads: List[Any] = [None] * len(self.shapes)
        self._callers: List[Any] = [None] * len(self.shapes)
        self._next_issue = 0
        self._accumulating = False
        self._accumulated: Dict[int, Any] = {}
        self._unchanged_types: set = set()  # gradients of these types need no host_view
        self.found_inf = None  # int32 flag array of the last finish() that checked
        self._graph_flags: List[Any] = []  # flags captured steps write: alive with their graphs

    # ------------------------------------------------------------------ introspection
    @property
    def buckets(self) -> List[List[int]]:
        """Parameter indices of each bucket, in issue order."""
        return [list(bucket.members) for bucket in self._buckets]

    def wire_bytes_per_step(self) -> int:
        """Bytes this rank hands to the all-reduces of one step: every bucket in its wire
        dtype, the alignment padding included."""
        return sum(bucket.length * bucket.wire_dtype.itemsize for bucket in self._buckets)

    # ------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def no_sync(self) -> Iterator["Bucketer"]:
        """Gradient accumulation: inside, ``mark_ready`` / ``reduce`` only add gradients into
        local accumulators (no communication); the next synchronized step adds them to its own
        gradients before the all-reduce, so it averages the sum over all micro-batches."""
        if self._accumulating:
            raise RuntimeError("no_sync() is already active")
        self._accumulating = True
        try:
            yield self
        finally:
            self._accumulating = False

    def mark_ready(self, index: int, grad: Any) -> None:
        """Gradient ``index`` (registration order) is computed; ``grad`` receives the average.

        Raises:
            ValueError: index out of range, marked twice in one step, or shape mismatch.
            TypeError: dtype mismatch.
        """
        if not 0 <= index < len(self.shapes):
            raise ValueError(f"gradient index {index} is out of range for {len(self.shapes)} "
                             f"parameters")
        caller = grad
        if type(grad) not in self._unchanged_types:  # host_view returns these as they are
            grad = host_view(grad, f"gradient {index}")  # torch CPU tensors too
            if len(self._unchanged_types) < 8 and (
                    type(grad) is np.ndarray or is_cupy_array(grad)):
                self._unchanged_types.add(type(grad))  # decided by the type alone
        shape = grad.shape  # a tuple already for NumPy and CuPy: no new one per gradient
        if shape != self.shapes[index] and tuple(shape) != self.shapes[index]:
            raise ValueError(f"gradient {index} has shape {tuple(shape)}, expected "
                             f"{self.shapes[index]}")
        dtype = grad.dtype  # NumPy's builtin dtypes are singletons: "is" decides at once
        if dtype is not self.dtypes[index] and np.dtype(dtype) != self.dtypes[index]:
            raise TypeError(f"gradient {index} has dtype {dtype}, expected "
                            f"{self.dtypes[index]}")
        if self._grads[index] is not None:
            raise ValueError(f"gradient {index} was already marked ready in this step")
        if self.comm_hook is not None and not grad.flags.c_contiguous:
            raise ValueError(f"gradient {index} must be C-contiguous (the comm hook writes "
                             f"the average into it)")
        if self._accumulating and device_array_in_capture(grad):
            self._reset(wait=False)
            raise RuntimeError(_NOT_CAPTURED.format(what="gradient accumulation (no_sync)",
                                                    why="its accumulators outlive the step; "
                                                        "add micro-batch gradients into the "
                                                        "gradient arrays inside the step")
                               + _ABANDONED)
        self._grads[index] = grad
        self._callers[index] = caller
        if self._accumulating:
            return
        if self._accumulated:  # micro-batches of no_sync() before this step
            previous = self._accumulated.pop(index, None)
            if previous is not None:
                grad += previous
        bucket = self._bucket_of[index]
        bucket.ready += 1
        if bucket.ready == len(bucket.members):
            self._issue_ready()

    def _issue_ready(self) -> None:
        """Pack and issue, in bucket order, every full bucket not issued yet."""
        while self._next_issue < len(self._buckets):
            bucket = self._buckets[self._next_issue]
            if bucket.ready < len(bucket.members):
                return
            grads = [self._grads[i] for i in bucket.members]
            capturing = device_array_in_capture(grads[0])
            if self.comm_hook is not None:
                if capturing:
                    self._reset(wait=False)
                    raise RuntimeError(_NOT_CAPTURED.format(
                        what=f"a comm hook ({type(self.comm_hook).__name__})",
                        why="it decides on the host what travels") + _ABANDONED)
                self.comm_hook.issue(self._next_issue, grads)
                self._next_issue += 1
                continue
            if bucket.buffer is None:  # gaps between arrays stay 0
                bucket.buffer = _zeros_beside(grads[0], bucket.length, bucket.wire_dtype)
            prescale = (1.0 / self.comm.size if self.average and bucket.wire_dtype != bucket.dtype
                        else 1.0)
            kernels.pack(grads, bucket.buffer, offsets=bucket.offsets, scale=prescale)
            if self._next_issue == 0 and self._flag_at is not None:
                bucket.buffer[self._flag_at] = 1     # this rank is still training
            if capturing:  # recorded into the graph like a kernel: nothing to wait for
                self.comm.all_reduce(bucket.buffer)
            else:
                bucket.work = self.comm.all_reduce(bucket.buffer, async_op=True)
            self._next_issue += 1

    def finish(self, *, loss_scale: Optional[float] = None,
               check_finite: Optional[bool] = None) -> List[Any]:
        """Wait for every bucket and write the averaged gradients into the arrays given to
        ``mark_ready``.

        Args:
            loss_scale: divide the gradients by it as well (mixed-precision unscaling).
            check_finite: set ``self.found_inf[0] = 1`` when any result is inf or NaN (default:
                when ``loss_scale`` is given). Every rank sees the same flag, since the
                all-reduce spreads a non-finite value to all ranks.

        Returns:
            The gradient arrays in registration order (inside ``no_sync``: unchanged).

        Raises:
            ValueError: some gradients were never marked ready (listed); ``loss_scale`` or
                ``check_finite`` with a comm hook. The step is abandoned on every rank.
        """
        grads = self._grads
        missing = [i for i, grad in enumerate(grads) if grad is None]
        if missing:
            self._reset(wait=True)
            raise ValueError(f"gradients {missing} were not marked ready in this step; every "
                             f"rank must produce every gradient")
        if self._accumulating:
            for index, grad in enumerate(grads):
                if index in self._accumulated:
                    self._accumulated[index] += grad
                else:
                    self._accumulated[index] = grad.copy()
            callers = self._callers
            self._reset(wait=False)
            return callers
        check = (loss_scale is not None) if check_finite is None else check_finite
        if self.comm_hook is not None and (loss_scale is not None or check):
            self._reset(wait=True)
            raise ValueError(f"finish(loss_scale={loss_scale!r}, check_finite={check_finite!r})"
                             f": a Bucketer with a comm hook neither unscales nor checks; "
                             f"unscale before mark_ready (this step was abandoned)")
        self.found_inf = _zeros_beside(grads[0] if grads else None, 1, np.int32) if check \
            else None
        if check and device_array_in_capture(self.found_inf):
            self._graph_flags.append(self.found_inf)  # the graph writes it at every launch
        try:
            self._issue_ready()
            if self.comm_hook is not None:
                self.comm_hook.finish()        # results land in the arrays it was given
            else:
                for bucket in self._buckets:
                    if bucket.work is not None:
                        bucket.work.wait()
                    postscale = (1.0 / self.comm.size if self.average and
                                 bucket.wire_dtype == bucket.dtype else 1.0)
                    kernels.unpack(bucket.buffer, [grads[i] for i in bucket.members],
                                   offsets=bucket.offsets, scale=postscale,
                                   loss_scale=loss_scale, found_inf=self.found_inf)
        finally:
            callers = self._callers
            self._reset(wait=True)
        return callers

    def join(self, on_step: Optional[Callable[[List[Any]], None]] = None) -> int:
        """This rank is out of batches: take part in the other ranks' steps with zero
        gradients until every rank has called ``join()``; every rank returns together.

        Args:
            on_step: called with the averaged gradients (registration order, as ``finish()``
                returns them, without loss-scale unscaling) of each step the others take:
                apply the optimizer to them and this rank's parameters and optimizer state
                stay identical to theirs. Without it they stay as they were; broadcast them
                from a rank that trained to the end afterwards (``broadcast_parameters``).

        Returns:
            The number of steps this rank took part in without batches.

        Raises:
            RuntimeError: the Bucketer was made without ``uneven_inputs=True``.
            ValueError: called inside a step (gradients marked) or with gradients still
                accumulated by ``no_sync``.
        """
        if not self.uneven_inputs:
            raise RuntimeError("join() needs Bucketer(..., uneven_inputs=True): every rank's "
                               "steps must carry the count of ranks still training")
        if device_array_in_capture(self._like):
            raise RuntimeError(_NOT_CAPTURED.format(what="join()", why="it reads on the host "
                                                    "whether every rank has joined"))
        marked = [i for i, grad in enumerate(self._grads) if grad is not None]
        if marked or self._accumulated or self._accumulating:
            raise ValueError(f"join() is called between steps, outside no_sync() and with no "
                             f"accumulated gradients (gradients marked: {marked}, accumulated: "
                             f"{sorted(self._accumulated)})")
        grads = [_zeros_beside(self._like, int(np.prod(shape, dtype=np.int64)), dtype)
                 .reshape(shape) for shape, dtype in zip(self.shapes, self.dtypes)] \
            if on_step is not None else None
        steps = 0
        while True:
            try:
                for bucket in self._buckets:
                    if bucket.buffer is None:
                        bucket.buffer = _zeros_beside(self._like, bucket.length,
                                                      bucket.wire_dtype)
                    else:
                        bucket.buffer.fill(0)
                    bucket.work = self.comm.all_reduce(bucket.buffer, async_op=True)
                for bucket in self._buckets:
                    bucket.work.wait()
            finally:
                self._reset(wait=True)
            first = self._buckets[0].buffer
            if float(_host(first[self._flag_at:self._flag_at + 1])[0]) == 0:
                return steps      # every rank has joined
            steps += 1
            if grads is not None:
                for bucket in self._buckets:
                    postscale = (1.0 / self.comm.size if self.average and
                                 bucket.wire_dtype == bucket.dtype else 1.0)
                    kernels.unpack(bucket.buffer, [grads[i] for i in bucket.members],
                                   offsets=bucket.offsets, scale=postscale)
                on_step(grads)

    def found_nonfinite(self) -> bool:
        """Whether the last checked ``finish()`` saw inf or NaN (reads the flag: a sync point)."""
        return self.found_inf is not None and bool(int(self.found_inf.reshape(-1)[0]))

    def reduce(self, grads: Sequence[Any], **finish_kwargs) -> List[Any]:
        """Average ``grads`` (registration order) in place: ``mark_ready`` for each, last
        first, then ``finish(**finish_kwargs)``."""
        if len(grads) != len(self.shapes):
            raise ValueError(f"got {len(grads)} gradients for {len(self.shapes)} parameters")
        for index in reversed(range(len(grads))):
            self.mark_ready(index, grads[index])
        return self.finish(**finish_kwargs)

    def _reset(self, wait: bool) -> None:
        if wait and self.comm_hook is not None:
            self.comm_hook.cancel()    # a step the hook finished is not cancelled
        for bucket in self._buckets:
            if wait and bucket.work is not None:
                try:
                    bucket.work.wait()
                except Exception:
                    pass  # already raised (or about to be) by finish()
            bucket.ready = 0
            bucket.work = None
        self._grads = [None] * len(self.shapes)
        self._callers = [None] * len(self.shapes)  # what mark_ready was given (finish returns it)
        self._next_issue = 0


def _check_hook_settings(comm_hook: Any, compression: Optional[str], average: bool,
                         uneven_inputs: bool) -> None:
    """A comm hook decides what travels and how it is reduced: refuse what contradicts it."""
    if not isinstance(comm_hook, CommHook):
        raise TypeError(f"comm_hook must be a gpucoll.ddp CommHook (e.g. PowerSGD), got "
                        f"{type(comm_hook).__name__}")
    if _COMPRESSION[compression] is not None:
        raise ValueError(f"compression={compression!r} and a comm hook: the hook decides what "
                         f"travels (PowerSGD sends float32/float64 low-rank factors)")
    if not average:
        raise ValueError("average=False and a comm hook: the hook returns averages")
    if uneven_inputs:
        raise ValueError("uneven_inputs=True and a comm hook: join() cannot shadow the hook's "
                         "collectives")


def broadcast_parameters(comm, params: Sequence[Any], root: int = 0, *,
                         bucket_cap_bytes: int = 25 * MiB) -> Sequence[Any]:
    """Copy ``root``'s parameters to every rank, in place, a bucket at a time.

    Floating-point parameters are packed into buckets of at most ``bucket_cap_bytes`` (one
    broadcast per bucket); other dtypes are broadcast one array at a time.

    Example (two ranks)::

        params = init_params(seed=comm.rank)    # differ
        broadcast_parameters(comm, params)      # now all equal rank 0's
    """
    given, params = params, [host_view(p, "params[]") for p in params]  # torch CPU tensors too
    groups: Dict[str, List[int]] = {}
    for index, param in enumerate(params):
        name = np.dtype(param.dtype).name
        if (name, name) in kernels.SUPPORTED_PAIRS:
            groups.setdefault(name, []).append(index)
        else:
            comm.broadcast(params[index], root=root)
    for name, members in groups.items():
        dtype = np.dtype(params[members[0]].dtype)
        chunks: List[List[int]] = [[]]
        size = 0
        for index in members:
            nbytes = int(params[index].size) * dtype.itemsize
            if chunks[-1] and size + nbytes > bucket_cap_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(index)
            size += nbytes
        for chunk in chunks:
            arrays = [params[i] for i in chunk]
            offsets, length = kernels.bucket_offsets([a.size for a in arrays], dtype.itemsize)
            buffer = _zeros_beside(arrays[0], length, dtype)
            if comm.rank == root:
                kernels.pack(arrays, buffer, offsets=offsets)
            comm.broadcast(buffer, root=root)
            if comm.rank != root:
                kernels.unpack(buffer, arrays, offsets=offsets)
    return given
