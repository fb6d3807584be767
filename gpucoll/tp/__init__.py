"""Tensor parallelism over any gpucoll ``Communicator`` (Megatron-style).

* :class:`ColumnParallelLinear`, :class:`RowParallelLinear` - linear layers whose weights are
  split by output / input features; forward and backward with the array module.
* :class:`ParallelMLP` - column, ReLU, row: one all-reduce forward, one backward; with
  ``sequence_parallel=True`` an all-gather and a reduce-scatter instead.
* :func:`init_linear` - the unsharded layer's parameters, identical on every rank per seed.

Importing this package never imports CuPy.
"""

from .layers import ColumnParallelLinear, RowParallelLinear, init_linear
from .mlp import ParallelMLP

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "init_linear"]
