"""PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, 2019), as torch's DDP
``powerSGD_hook`` does it, over any communicator.

Each gradient matrix M (n x m; a tensor of more dimensions is seen as (shape[0], rest)) is
averaged through a rank-r approximation: ``P = M Q`` is summed over the ranks, orthogonalized,
``Q = M^T P`` is summed, and ``P Q^T / world_size`` replaces the average. Two all-reduces of
``r (n + m)`` elements instead of one of ``n m``: a 4096 x 4096 layer at rank 4 sends 512 x
fewer bytes. What the approximation leaves out is kept per rank and added to the next step's
gradient (error feedback), so it is delayed, not lost; Q starts from the last step's (warm
start), so one power iteration per step tracks the gradients' top subspace.

Vectors (biases, norms) and matrices that would not shrink by ``min_compression`` travel
uncompressed, packed into P's all-reduce, as do all gradients during the first ``start_step``
steps (plain averaging while the gradients change fastest, torch's ``start_powerSGD_iter``).
Every rank must pass gradients of the same shapes; Q starts from the same seed everywhere.
NumPy or CuPy arrays (the gradients' module).

Two schedules, one per-matrix implementation (``_Matrix``: project, refine, decompress):
``reduce(grads)`` after backward treats all gradients as one group; as a Bucketer's comm hook
each bucket is a group whose P all-reduce starts when the bucket fills, during backward, and
whose Q all-reduces are all issued in ``finish()`` before any is waited for. Each matrix's
arithmetic does not depend on the grouping, so both give the same averages (up to the order
the all-reduce sums in).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import kernels
from ..hostarrays import array_module
from .comm_hook import CommHook

__all__ = ["PowerSGD"]

_EPS = 1e-8


def orthogonalize(matrix: Any, xp: Any) -> None:
    """Gram-Schmidt on the columns of ``matrix`` (n x r), in place."""
    columns = matrix.shape[1]
    for i in range(columns):
        col = matrix[:, i:i + 1]
        col /= xp.sqrt((col * col).sum()) + _EPS
        if i + 1 < columns:
            rest = matrix[:, i + 1:]
            rest -= (col * rest).sum(axis=0, keepdims=True) * col


class _Matrix:
    """One compressed gradient: its warm-started Q, its error-feedback residual, and the
    three per-step stages (the same whichever group of gradients it travels with)."""

    __slots__ = ("index", "rows", "cols", "rank", "p", "q", "error")

    def __init__(self, index: int, shape: tuple, rank: int):
        self.index = index
        self.rows = int(shape[0])
        self.cols = int(np.prod(shape[1:], dtype=np.int64))
        self.rank = min(rank, self.rows, self.cols)
        self.p = self.q = self.error = None   # p, q: views of their group's buffers

    def project(self, grad: Any, xp: Any) -> Any:
        """P = (M + E) Q into ``self.p``; returns M + E (built in E's buffer)."""
        m = grad.reshape(self.rows, self.cols)
        if self.error is not None:
            self.error += m
            m = self.error
        xp.matmul(m, self.q, out=self.p)
        return m

    def refine(self, m: Any, xp: Any) -> None:
        """P (summed over the ranks) orthogonalized, then Q = (M + E)^T P into ``self.q``."""
        orthogonalize(self.p, xp)                       # the same on every rank
        xp.matmul(m.T, self.p, out=self.q)

    def decompress(self, grad: Any, size: int, xp: Any) -> None:
        """Q (summed) / size is kept for the next step; ``grad`` = P Q^T; E = M + E - P Q^T."""
        self.q /= size
        out = grad.reshape(self.rows, self.cols)
        xp.matmul(self.p, self.q.T, out=out)
        if self.error is not None:
            self.error -= out                           # what this rank's M + E lost

    def unproject(self, grad: Any) -> None:
        """Undo :meth:`project`'s change to E (a step abandoned before ``refine``)."""
        if self.error is not None:
            self.error -= grad.reshape(self.rows, self.cols)


class _Group:
    """Gradients averaged together: all of them (``PowerSGD.reduce``) or one Bucketer bucket.

    Compressing, the group's P and its plain gradients travel in one all-reduce, its Q in a
    second; averaging exactly, all its gradients travel in one."""

    def __init__(self, members: Sequence[int], compressed: Dict[int, _Matrix],
                 sizes: Sequence[int], dtype: np.dtype, like: Any):
        xp = array_module(like)
        self.members = list(members)
        self.matrices = [compressed[i] for i in self.members if i in compressed]
        self.plain = [i for i in self.members if i not in compressed]
        p_length = sum(m.rows * m.rank for m in self.matrices)
        q_length = sum(m.cols * m.rank for m in self.matrices)
        offsets, wire_length = kernels.bucket_offsets(
            [p_length] + [sizes[i] for i in self.plain], dtype.itemsize)
        self.plain_offsets = offsets[1:]
        self.exact_offsets, self.exact_length = kernels.bucket_offsets(
            [sizes[i] for i in self.members], dtype.itemsize)
        self.dtype, self.like, self.xp = dtype, like, xp
        with _device_of(like):
            self.wire = xp.zeros(max(wire_length, 1), dtype=dtype)   # [P | plain gradients]
            self.q = xp.zeros(max(q_length, 1), dtype=dtype)
        self.exact = None                    # exact averaging steps (allocated on first use)
        p_at = q_at = 0
        for matrix in self.matrices:         # Q moves into this group's buffer, P lives there
            q = self.q[q_at:q_at + matrix.cols * matrix.rank].reshape(matrix.cols, matrix.rank)
            q[...] = matrix.q
            matrix.q = q
            matrix.p = self.wire[p_at:p_at + matrix.rows * matrix.rank].reshape(
                matrix.rows, matrix.rank)
            p_at += matrix.rows * matrix.rank
            q_at += matrix.cols * matrix.rank
        self.compressing = False
        self.local: Optional[List[Any]] = None   # each matrix's M + E between the stages
        self.work = self.q_work = None

    def start(self, comm, grads: Sequence[Any], compress: bool) -> None:
        """Issue the first all-reduce: P and the plain gradients, or all of them exactly."""
        self.compressing = compress = compress and bool(self.matrices)
        if not compress:
            if self.exact is None:
                with _device_of(self.like):
                    self.exact = self.xp.zeros(max(self.exact_length, 1), dtype=self.dtype)
            kernels.pack([grads[i] for i in self.members], self.exact,
                         offsets=self.exact_offsets)
            self.work = comm.all_reduce(self.exact, async_op=True)
            return
        self.local = [m.project(grads[m.index], self.xp) for m in self.matrices]
        if self.plain:
            kernels.pack([grads[i] for i in self.plain], self.wire, offsets=self.plain_offsets)
        self.work = comm.all_reduce(self.wire, async_op=True)

    def exchange_q(self, comm) -> None:
        """Wait for P, then issue Q's all-reduce (nothing more when averaging exactly)."""
        work, self.work = self.work, None
        work.wait()
        if self.compressing:
            for matrix, m in zip(self.matrices, self.local):
                matrix.refine(m, self.xp)
            self.q_work = comm.all_reduce(self.q, async_op=True)

    def complete(self, grads: Sequence[Any], size: int) -> None:
        """Wait for Q and write the averages into ``grads``."""
        if not self.compressing:
            kernels.unpack(self.exact, [grads[i] for i in self.members],
                           offsets=self.exact_offsets, scale=1.0 / size)
            return
        work, self.q_work = self.q_work, None
        work.wait()
        for matrix in self.matrices:
            matrix.decompress(grads[matrix.index], size, self.xp)
        if self.plain:
            kernels.unpack(self.wire, [grads[i] for i in self.plain],
                           offsets=self.plain_offsets, scale=1.0 / size)
        self.local = None

    def cancel(self, grads: Sequence[Any]) -> None:
        """Wait for what was issued; undo error feedback's addition if Q was not made yet."""
        for work in (self.work, self.q_work):
            if work is not None:
                try:
                    work.wait()
                except Exception:
                    pass    # the Bucketer raises the step's error
        if self.compressing and self.local is not None and self.q_work is None:
            for matrix in self.matrices:
                matrix.unproject(grads[matrix.index])
        self.work = self.q_work = self.local = None


class PowerSGD(CommHook):
    """Average gradients through rank-``rank`` approximations (see the module doc).

    Use it after backward (:meth:`reduce`), or as a Bucketer's comm hook, where each bucket's
    P is computed and its all-reduce started as soon as the bucket fills during backward
    (torch's ``register_comm_hook(PowerSGDState(...), powerSGD_hook)``); both give the same
    averages.

    Args:
        comm: the data-parallel communicator.
        params: the parameters (or gradients) in registration order: shapes and one dtype,
            float32 or float64.
        rank: the approximation's rank (higher: closer to the exact average, more bytes).
        start_step: steps averaged exactly before compression starts.
        min_compression: compress a matrix only when ``n m / (r (n + m))`` is at least this.
        error_feedback: keep what each step's approximation left out and add it next step.
        seed: Q's starting values (the same on every rank).

    Example (two ranks)::

        compressor = PowerSGD(comm, params, rank=4)
        loss, grads = loss_and_grads(params, batch)
        compressor.reduce(grads)                 # grads now hold the (approximate) average

        # or overlapped with backward, bucket by bucket:
        bucketer = Bucketer(comm, params, comm_hook=PowerSGD(comm, params, rank=4))
        for i, grad in backward():               # a full bucket's P = M Q is sent here
            bucketer.mark_ready(i, grad)
        grads = bucketer.finish()                # Q = M^T P sent for every bucket, then waited
    """

    def __init__(self, comm, params: Sequence[Any], *, rank: int = 4, start_step: int = 10,
                 min_compression: float = 2.0, error_feedback: bool = True, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {rank!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, (int, np.integer)) \
                or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        if not min_compression > 0:
            raise ValueError(f"min_compression must be > 0, got {min_compression!r}")
        params = list(params)
        if not params:
            raise ValueError("params is empty")
        dtypes = {np.dtype(p.dtype).name for p in params}
        if len(dtypes) != 1 or not dtypes <= {"float32", "float64"}:
            raise TypeError(f"PowerSGD needs gradients of one dtype, float32 or float64; got "
                            f"{sorted(dtypes)}")
        self.comm, self.rank, self.start_step = comm, int(rank), int(start_step)
        self.error_feedback = error_feedback
        self.dtype = np.dtype(params[0].dtype)
        self.xp = xp = array_module(params[0])
        self._like = params[0]                 # where the buffers are allocated
        self.shapes = [tuple(int(d) for d in p.shape) for p in params]
        self.matrices: List[_Matrix] = []
        plain = []
        for index, shape in enumerate(self.shapes):
            matrix = _Matrix(index, shape, rank) if len(shape) >= 2 else None
            if matrix is not None and matrix.rows * matrix.cols >= \
                    min_compression * matrix.rank * (matrix.rows + matrix.cols):
                self.matrices.append(matrix)
            else:
                plain.append(index)
        self.plain = plain
        self._sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        rng = np.random.default_rng(seed)
        with _device_of(params[0]):
            for matrix in self.matrices:
                q = rng.standard_normal((matrix.cols, matrix.rank)).astype(self.dtype)
                matrix.q = xp.asarray(q)
                orthogonalize(matrix.q, xp)
                if error_feedback:
                    matrix.error = xp.zeros((matrix.rows, matrix.cols), dtype=self.dtype)
        self.steps = 0
        self._whole: Optional[_Group] = None      # reduce()'s group: every gradient
        self._buckets: Optional[List[_Group]] = None   # a Bucketer's buckets, once attached
        self._issued: List[_Group] = []            # this step's buckets issued so far
        self._step_grads: List[Any] = []

    def _group(self, members: Sequence[int]) -> _Group:
        return _Group(members, {m.index: m for m in self.matrices}, self._sizes, self.dtype,
                      self._like)

    def _compressing(self) -> bool:
        return self.steps > self.start_step

    # ------------------------------------------------------------------ sizes
    def wire_elements(self, compressed: bool = True) -> int:
        """Elements this rank all-reduces per step: P, Q and the plain tensors once
        compressing, every element before (``compressed=False``)."""
        if not compressed:
            return sum(self._sizes)
        return (sum(m.rank * (m.rows + m.cols) for m in self.matrices)
                + sum(self._sizes[i] for i in self.plain))

    # ------------------------------------------------------------------ after backward
    def reduce(self, grads: Sequence[Any]) -> List[Any]:
        """Replace ``grads`` (registration order, written in place) by their average over
        the ranks: exact for the first ``start_step`` steps and for the plain tensors,
        PowerSGD's approximation for the compressed matrices after that. Returns ``grads``.

        Raises:
            ValueError: wrong number or shapes of gradients, or this PowerSGD is a Bucketer's
                comm hook. TypeError: another dtype.
        """
        if self._buckets is not None:
            raise ValueError("this PowerSGD is a Bucketer's comm hook: its steps run through "
                             "bucketer.mark_ready() and bucketer.finish(), not reduce()")
        grads = list(grads)
        if len(grads) != len(self.shapes):
            raise ValueError(f"got {len(grads)} gradients for {len(self.shapes)} parameters")
        for index, (grad, shape) in enumerate(zip(grads, self.shapes)):
            if tuple(grad.shape) != shape:
                raise ValueError(f"gradient {index} has shape {tuple(grad.shape)}, expected "
                                 f"{shape}")
            if np.dtype(grad.dtype) != self.dtype:
                raise TypeError(f"gradient {index} has dtype {grad.dtype}, expected "
                                f"{self.dtype}")
            if not grad.flags.c_contiguous:
                raise ValueError(f"gradient {index} must be C-contiguous (it is written in "
                                 f"place)")
        if self._whole is None:
            self._whole = self._group(range(len(self.shapes)))
        self.steps += 1
        group = self._whole
        group.start(self.comm, grads, self._compressing())
        group.exchange_q(self.comm)
        group.complete(grads, self.comm.size)
        return grads

    # ------------------------------------------------------------------ as a comm hook
    def attach(self, comm, buckets: Sequence[Sequence[int]], shapes: Sequence[tuple],
               dtypes: Sequence[Any]) -> None:
        """Bucketer(..., comm_hook=self) calls this: one group per bucket from now on.

        Raises:
            ValueError: another communicator, other parameter shapes, or already attached.
            TypeError: other dtypes.
        """
        if self._buckets is not None:
            raise ValueError("this PowerSGD is already the comm hook of a Bucketer; make one "
                             "per Bucketer")
        if comm is not self.comm:
            raise ValueError("the Bucketer and its PowerSGD comm hook must share one "
                             "communicator")
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if shapes != self.shapes:
            raise ValueError(f"the Bucketer's parameters have shapes {shapes}, the PowerSGD's "
                             f"{self.shapes}")
        others = sorted({np.dtype(d).name for d in dtypes} - {self.dtype.name})
        if others:
            raise TypeError(f"the Bucketer's parameters include dtypes {others}; this PowerSGD "
                            f"averages {self.dtype.name}")
        self._buckets = [self._group(members) for members in buckets]
        self._whole = None
        self._step_grads = [None] * len(self.shapes)

    def issue(self, bucket: int, grads: List[Any]) -> None:
        """Bucket ``bucket`` filled: P = (M + E) Q and its all-reduce (with the bucket's plain
        gradients; the whole bucket during the first ``start_step`` steps), asynchronously."""
        if not self._issued:
            self.steps += 1
        group = self._buckets[bucket]
        for index, grad in zip(group.members, grads):
            self._step_grads[index] = grad
        group.start(self.comm, self._step_grads, self._compressing())
        self._issued.append(group)

    def finish(self) -> None:
        """Every bucket's Q all-reduce is issued before any is waited for: bucket k's Q
        travels while bucket k + 1's is computed."""
        groups, grads = self._issued, self._step_grads
        for group in groups:
            group.exchange_q(self.comm)
        for group in groups:
            group.complete(grads, self.comm.size)
        self._end_step()

    def cancel(self) -> None:
        """Abandon the step: wait for its all-reduces, undo error feedback, uncount it."""
        if not self._issued:
            return
        for group in self._issued:
            group.cancel(self._step_grads)
        self.steps -= 1
        self._end_step()

    def _end_step(self) -> None:
        self._issued = []
        self._step_grads = [None] * len(self.shapes)


def _device_of(array: Any):
    """The array's CUDA device as a context (CuPy), or nothing (NumPy)."""
    return array.device if array_module(array) is not np else contextlib.nullcontext()
