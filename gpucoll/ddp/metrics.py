"""Summing scalar metrics (correct / total counts, loss sums) across ranks in one all-reduce."""

from __future__ import annotations

from typing import Any, Dict, Mapping

import numpy as np

from .. import cuda_env

__all__ = ["all_reduce_metrics"]


def all_reduce_metrics(comm, metrics: Mapping[str, Any], op: str = "sum") -> Dict[str, Any]:
    """Reduce a dict of scalars across all ranks with a single float64 all-reduce.

    Args:
        comm: the communicator.
        metrics: name -> scalar (Python number, NumPy scalar, or 0-d / 1-element NumPy or CuPy
            array). Every rank passes the same names (the order does not matter).
        op: "sum", "avg", "min" or "max".

    Returns:
        name -> reduced value: an ``int`` where every rank's value was an integer and the op
        keeps integers (sum, min, max), else a ``float``.

    Example (two ranks)::

        totals = all_reduce_metrics(comm, {"correct": 40 + comm.rank, "total": 50})
        # both: {"correct": 81, "total": 100}; accuracy = totals["correct"] / totals["total"]
    """
    names = sorted(metrics)
    values = np.empty(len(names), dtype=np.float64)
    integral = []
    for position, name in enumerate(names):
        value = metrics[name]
        if hasattr(value, "item") and int(np.prod(getattr(value, "shape", ()))) == 1:
            value = value.item()  # NumPy, CuPy and torch scalars and 1-element arrays
        if not isinstance(value, (int, float, np.integer, np.floating, bool)):
            raise TypeError(f"metric {name!r} must be a scalar, got {type(value).__name__}")
        integral.append(isinstance(value, (int, np.integer)))
        values[position] = float(value)
    if comm.memory == "cuda":  # a GPU backend reduces device memory: one small round trip
        cupy = cuda_env.cupy_module()
        device = cupy.asarray(values)
        comm.all_reduce(device, op=op)
        values = cupy.asnumpy(device)  # waits for the stream
    else:
        comm.all_reduce(values, op=op)
    keep_int = op in ("sum", "min", "max")
    return {name: int(round(v)) if keep_int and is_int else float(v)
            for name, v, is_int in zip(names, values, integral)}
