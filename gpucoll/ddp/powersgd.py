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
uncompressed in one packed all-reduce, as do all gradients during the first ``start_step``
steps (plain averaging while the gradients change fastest, torch's ``start_powerSGD_iter``).
Every rank must pass gradients of the same shapes; Q starts from the same seed everywhere.
NumPy or CuPy arrays (the gradients' module).
"""

from __future__ import annotations

import contextlib
from typing import Any, List, Sequence

import numpy as np

from .. import kernels
from ..hostarrays import array_module

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
    __slots__ = ("index", "rows", "cols", "rank", "p_at", "q_at", "q", "error")

    def __init__(self, index: int, shape: tuple, rank: int):
        self.index = index
        self.rows = int(shape[0])
        self.cols = int(np.prod(shape[1:], dtype=np.int64))
        self.rank = min(rank, self.rows, self.cols)
        self.p_at = self.q_at = 0
        self.q = self.error = None


class PowerSGD:
    """Average gradients through rank-``rank`` approximations (see the module doc).

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
        self.xp = array_module(params[0])
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
        self._plain_offsets, plain_length = kernels.bucket_offsets(
            [self._sizes[i] for i in plain], self.dtype.itemsize)
        all_offsets, all_length = kernels.bucket_offsets(self._sizes, self.dtype.itemsize)
        self._all_offsets = all_offsets
        p_length = q_length = 0
        rng = np.random.default_rng(seed)
        for matrix in self.matrices:
            matrix.p_at, matrix.q_at = p_length, q_length
            p_length += matrix.rows * matrix.rank
            q_length += matrix.cols * matrix.rank
        xp, dtype = self.xp, self.dtype
        with _device_of(params[0]):
            self._plain_buffer = xp.zeros(max(plain_length, 1), dtype=dtype)
            self._all_buffer = None          # exact averaging steps (allocated on first use)
            self._all_length = all_length
            self._p = xp.zeros(max(p_length, 1), dtype=dtype)
            self._q = xp.zeros(max(q_length, 1), dtype=dtype)
            for matrix in self.matrices:
                q = self._q_of(matrix)
                q[...] = xp.asarray(rng.standard_normal(q.shape).astype(dtype))
                orthogonalize(q, xp)
                if error_feedback:
                    matrix.error = xp.zeros((matrix.rows, matrix.cols), dtype=dtype)
        self.steps = 0

    def _p_of(self, matrix: _Matrix) -> Any:
        return self._p[matrix.p_at:matrix.p_at + matrix.rows * matrix.rank].reshape(
            matrix.rows, matrix.rank)

    def _q_of(self, matrix: _Matrix) -> Any:
        return self._q[matrix.q_at:matrix.q_at + matrix.cols * matrix.rank].reshape(
            matrix.cols, matrix.rank)

    # ------------------------------------------------------------------ sizes
    def wire_elements(self, compressed: bool = True) -> int:
        """Elements this rank all-reduces per step: P, Q and the plain tensors once
        compressing, every element before (``compressed=False``)."""
        if not compressed:
            return sum(self._sizes)
        return (sum(m.rank * (m.rows + m.cols) for m in self.matrices)
                + sum(self._sizes[i] for i in self.plain))

    # ------------------------------------------------------------------ the step
    def reduce(self, grads: Sequence[Any]) -> List[Any]:
        """Replace ``grads`` (registration order, written in place) by their average over
        the ranks: exact for the first ``start_step`` steps and for the plain tensors,
        PowerSGD's approximation for the compressed matrices after that. Returns ``grads``.

        Raises:
            ValueError: wrong number or shapes of gradients. TypeError: another dtype.
        """
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
        self.steps += 1
        if self.steps <= self.start_step or not self.matrices:
            self._average_exactly(grads)
            return grads
        self._compress(grads)
        return grads

    def _average_exactly(self, grads: List[Any]) -> None:
        if self._all_buffer is None:
            with _device_of(grads[0]):
                self._all_buffer = self.xp.zeros(self._all_length, dtype=self.dtype)
        kernels.pack(grads, self._all_buffer, offsets=self._all_offsets)
        self.comm.all_reduce(self._all_buffer)
        kernels.unpack(self._all_buffer, grads, offsets=self._all_offsets,
                       scale=1.0 / self.comm.size)

    def _compress(self, grads: List[Any]) -> None:
        xp, size = self.xp, self.comm.size
        plain = [grads[i] for i in self.plain]
        plain_work = None
        if plain:
            kernels.pack(plain, self._plain_buffer, offsets=self._plain_offsets)
            plain_work = self.comm.all_reduce(self._plain_buffer, async_op=True)
        local = []
        for matrix in self.matrices:
            m = grads[matrix.index].reshape(matrix.rows, matrix.cols)
            if matrix.error is not None:    # error feedback: M + E, built in E's buffer
                matrix.error += m
                m = matrix.error
            local.append(m)
            xp.matmul(m, self._q_of(matrix), out=self._p_of(matrix))
        self.comm.all_reduce(self._p)                    # sum of M Q over the ranks
        for matrix, m in zip(self.matrices, local):
            p = self._p_of(matrix)
            orthogonalize(p, xp)                         # the same on every rank
            xp.matmul(m.T, p, out=self._q_of(matrix))
        self.comm.all_reduce(self._q)                    # sum of M^T P over the ranks
        self._q /= size                                  # kept: the next step's start
        for matrix, m in zip(self.matrices, local):
            out = grads[matrix.index].reshape(matrix.rows, matrix.cols)
            xp.matmul(self._p_of(matrix), self._q_of(matrix).T, out=out)
            if matrix.error is not None:
                matrix.error -= out                      # what this rank's M + E lost
        if plain_work is not None:
            plain_work.wait()
            kernels.unpack(self._plain_buffer, plain, offsets=self._plain_offsets,
                           scale=1.0 / size)


def _device_of(array: Any):
    """The array's CUDA device as a context (CuPy), or nothing (NumPy)."""
    return array.device if array_module(array) is not np else contextlib.nullcontext()
