"""Synchronized batch normalization: batch statistics over the global batch of all ranks.

Each rank contributes its per-channel sum, sum of squares and count; one float64 all-reduce
of ``[sum, sum_sq, count]`` gives every rank the global mean and (biased) variance. The
backward pass needs the global ``sum(dy)`` and ``sum(dy * x_hat)``: one more all-reduce.
Works on NumPy and CuPy arrays (``x`` of shape ``(batch, channels)``, reduced over axis 0;
any layout where the reduced axes are given by ``axes``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .. import cuda_env

__all__ = ["sync_batch_stats", "SyncBatchNorm"]


def _xp(x: Any):
    if type(x).__module__.split(".")[0] == "cupy":
        return cuda_env.cupy_module()
    return np


def sync_batch_stats(comm, x: Any, axes: Sequence[int] = (0,)) -> Tuple[Any, Any, int]:
    """Global per-channel mean, biased variance and sample count of ``x`` over all ranks.

    Args:
        comm: the communicator.
        x: this rank's activations (NumPy or CuPy); ranks may have different batch sizes.
        axes: the reduced axes (default: the batch axis 0).

    Returns:
        (mean, var, count): mean and var as float64 arrays of the remaining shape (same
        library as ``x``), count the number of reduced elements over all ranks.

    Example (two ranks)::

        mean, var, n = sync_batch_stats(comm, x)    # as if x of both ranks were concatenated
    """
    xp = _xp(x)
    axes = tuple(a % x.ndim for a in axes)
    x64 = x.astype(np.float64, copy=False)
    local_sum = x64.sum(axis=axes)
    local_sq = (x64 * x64).sum(axis=axes)
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    channels = local_sum.size
    packed = xp.concatenate([local_sum.reshape(-1), local_sq.reshape(-1),
                             xp.full(1, float(count), dtype=np.float64)])
    comm.all_reduce(packed)
    total = int(round(float(packed[-1])))
    if total == 0:
        raise ValueError("sync_batch_stats: every rank passed an empty batch")
    mean = packed[:channels] / total
    var = xp.maximum(packed[channels:2 * channels] / total - mean * mean, 0.0)
    return mean.reshape(local_sum.shape), var.reshape(local_sum.shape), total


class SyncBatchNorm:
    """Batch norm over ``(batch, channels)`` activations with statistics from all ranks.

    ``forward(x, training=True)`` normalizes with the global batch statistics (and updates the
    running mean / unbiased running variance); ``backward(dy)`` returns ``(dx, dgamma, dbeta)``
    exactly as single-process batch norm on the concatenated global batch would, except that
    ``dgamma`` and ``dbeta`` are this rank's share (average or sum them with the other
    gradients, as for any parameter).
    """

    def __init__(self, comm, channels: int, *, eps: float = 1e-5, momentum: float = 0.1,
                 xp: Any = np, dtype: Any = np.float32):
        self.comm, self.eps, self.momentum = comm, eps, momentum
        self.gamma = xp.ones(channels, dtype=dtype)
        self.beta = xp.zeros(channels, dtype=dtype)
        self.running_mean = xp.zeros(channels, dtype=dtype)
        self.running_var = xp.ones(channels, dtype=dtype)
        self._cache: Optional[tuple] = None

    def forward(self, x: Any, training: bool = True) -> Any:
        if not training:
            return ((x - self.running_mean) / _xp(x).sqrt(self.running_var + self.eps)
                    * self.gamma + self.beta).astype(x.dtype)
        mean, var, count = sync_batch_stats(self.comm, x)
        inv_std = 1.0 / _xp(x).sqrt(var + self.eps)
        x_hat = (x - mean) * inv_std
        m = self.momentum
        unbiased = var * (count / max(count - 1, 1))
        self.running_mean[...] = (1 - m) * self.running_mean + m * mean
        self.running_var[...] = (1 - m) * self.running_var + m * unbiased
        self._cache = (x_hat, inv_std, count)
        return (x_hat * self.gamma + self.beta).astype(x.dtype)

    def backward(self, dy: Any) -> Tuple[Any, Any, Any]:
        if self._cache is None:
            raise RuntimeError("SyncBatchNorm.backward called before forward(training=True)")
        xp = _xp(dy)
        x_hat, inv_std, count = self._cache
        dy64 = dy.astype(np.float64, copy=False)
        dbeta = dy64.sum(axis=0)
        dgamma = (dy64 * x_hat).sum(axis=0)
        channels = dbeta.size
        packed = xp.concatenate([dbeta, dgamma])
        self.comm.all_reduce(packed)
        sum_dy, sum_dy_xhat = packed[:channels], packed[channels:]
        dx = (self.gamma * inv_std / count) * (count * dy64 - sum_dy - x_hat * sum_dy_xhat)
        self._cache = None
        return dx.astype(dy.dtype), dgamma.astype(dy.dtype), dbeta.astype(dy.dtype)
