"""Gradient clipping by the global norm, for replicated and for sharded gradients.

The norm is taken over every gradient of the model: ``sqrt(sum of squares)``. Replicated
gradients (what the ``Bucketer`` returns) hold it whole on every rank. Sharded ones (the slices
``ShardedOptimizer`` and ``FullyShardedParameters`` update) hold 1 / n each, so the ranks'
sums of squares are all-reduced first: one all-reduce of one float64. The gradients are then
multiplied by ``min(1, max_norm / (norm + 1e-6))`` on their own device, without reading the
norm back to the host (as torch's ``clip_grad_norm_`` does), so a GPU step does not wait for
it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ..hostarrays import array_module

__all__ = ["clip_grad_norm", "global_grad_norm", "check_max_norm"]

_EPS = 1e-6


def check_max_norm(max_norm: Any) -> Optional[float]:
    """``max_norm`` as a float (None stays None); ValueError unless finite and > 0."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float, np.floating,
                                                               np.integer)) \
            or not np.isfinite(max_norm) or max_norm <= 0:
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
    return float(max_norm)


def global_grad_norm(grads: Sequence[Any], *, comm: Any = None) -> Any:
    """The 2-norm of all ``grads`` together, as a one-element float64 array on their device.

    Args:
        grads: arrays of one array module (NumPy or CuPy), any shapes and float dtypes.
        comm: when the gradients are this rank's slices of sharded ones, the communicator
            whose ranks hold the other slices (their sums of squares are all-reduced); None
            when every rank holds them whole.
    """
    grads = list(grads)
    if not grads:
        raise ValueError("grads is empty")
    xp = array_module(grads[0])
    total = xp.zeros(1, dtype=np.float64)
    for grad in grads:
        flat = grad.reshape(-1)
        if flat.dtype.itemsize < 4:                      # float16 / bfloat16: square in float32
            flat = flat.astype(np.float32)
        total += xp.dot(flat, flat).astype(np.float64)
    if comm is not None and comm.size > 1:
        comm.all_reduce(total)
    return xp.sqrt(total)


def clip_grad_norm(grads: Sequence[Any], max_norm: float, *, comm: Any = None) -> Any:
    """Scale ``grads`` in place so that their global 2-norm is at most ``max_norm``.

    Args:
        grads: the gradients (replicated), or this rank's slices of them with ``comm``.
        max_norm: the largest norm allowed (> 0).
        comm: see :func:`global_grad_norm`; every rank of it must call this.

    Returns:
        The norm before clipping: a one-element float64 array on the gradients' device (read
        it with ``float(norm[0])`` when needed; that waits for the GPU). Inf or NaN when a
        gradient is not finite; the gradients then become NaN or 0, as with torch.

    Example (data parallelism: the Bucketer's gradients are whole on every rank)::

        grads = bucketer.finish()
        clip_grad_norm(grads, 1.0)
    """
    max_norm = check_max_norm(max_norm)
    if max_norm is None:
        raise ValueError("max_norm must be a finite number > 0, got None")
    norm = global_grad_norm(grads, comm=comm)
    xp = array_module(norm)
    coef = xp.minimum(max_norm / (norm + _EPS), 1.0)
    for grad in grads:
        grad *= coef.astype(grad.dtype)
    return norm
