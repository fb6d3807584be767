"""Megatron-style tensor-parallel linear layers, forward and backward with the array module.

A ``ColumnParallelLinear`` holds a slice of the output features (its weight's columns); a
``RowParallelLinear`` holds a slice of the input features (its weight's rows). Put one after
the other (column, element-wise activation, row) and an MLP needs exactly one all-reduce in
forward (summing the row layer's partial outputs) and one in backward (summing the column
layer's partial input gradients); everything between stays sharded.

With ``sequence_parallel=True`` the activations entering the column layer and leaving the row
layer are split by rows (tokens / batch) across the group instead of replicated: the column
layer all-gathers its input and reduce-scatters its input gradient, the row layer
reduce-scatters its output and all-gathers its output gradient. Same bytes as the all-reduce
(all-reduce = reduce-scatter + all-gather), but activations outside the MLP are 1 / group size.

Only the ``Communicator`` interface is used; arrays are NumPy or CuPy (the weights' module).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from ..hostarrays import array_module as _array_module

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "init_linear"]


def init_linear(in_features: int, out_features: int, *, seed: int = 0, xp: Any = np,
                dtype: Any = np.float32):
    """The unsharded layer's (weight (in, out), bias (out,)): He-normal weights, zero bias,
    the same on every rank for the same seed (so each rank can take its own slice)."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(0.0, np.sqrt(2.0 / in_features), (in_features, out_features))
    return xp.asarray(weight, dtype=dtype), xp.zeros(out_features, dtype=dtype)


def _split(total: int, parts: int, what: str, layer: str) -> int:
    if total % parts:
        raise ValueError(f"{layer}: {what} {total} is not divisible by the tensor-parallel group "
                         f"size {parts}")
    return total // parts


class _ParallelLinear:
    comm: Any
    weight: Any
    bias: Optional[Any]
    grad_weight: Any
    grad_bias: Optional[Any]
    sequence_parallel: bool

    @property
    def params(self) -> List[Any]:
        """This rank's parameters: ``[weight, bias]`` (or ``[weight]``)."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    @property
    def grads(self) -> List[Any]:
        """Gradients of :attr:`params` from the last ``backward``."""
        return [self.grad_weight] if self.bias is None else [self.grad_weight, self.grad_bias]

    def full_params(self) -> List[Any]:
        """The unsharded ``[weight (in, out), bias (out,)]`` (or ``[weight]``), gathered from
        every rank's slice: to save the layer, or to build it again at another group size
        from them. A collective: every rank of the group calls it."""
        weight = self._gather(self.weight, self._split_axis)
        if self.bias is None:
            return [weight]
        bias = self._gather(self.bias, 0) if self._split_axis == 1 else self.bias.copy()
        return [weight, bias]

    def _gather(self, part: Any, axis: int) -> Any:
        """Every rank's ``part`` joined along ``axis`` (rank order)."""
        if self.comm.size == 1:
            return part.copy()
        stacked = self.comm.all_gather(self.xp.ascontiguousarray(part))   # (p, *part.shape)
        return self.xp.concatenate(list(stacked), axis=axis)

    def _check_input(self, x: Any, features: int, name: str) -> None:
        if getattr(x, "ndim", None) != 2 or x.shape[1] != features:
            raise ValueError(f"{type(self).__name__}: {name} must have shape (rows, {features}), "
                             f"got {getattr(x, 'shape', None)}")

    def _gather_rows(self, x: Any) -> Any:
        """(rows / p, f) on each rank -> (rows, f) on every rank."""
        p = self.comm.size
        if p == 1:
            return x
        out = self.comm.all_gather(self.xp.ascontiguousarray(x))
        return out.reshape(p * x.shape[0], x.shape[1])

    def _scatter_rows(self, x: Any) -> Any:
        """(rows, f) partial sums on each rank -> summed rows block r on rank r."""
        p = self.comm.size
        if p == 1:
            return x
        rows = _split(x.shape[0], p, "the number of rows", type(self).__name__)
        return self.comm.reduce_scatter(self.xp.ascontiguousarray(x).reshape(p, rows, x.shape[1]))


def _check_linear(weight: Any, bias: Optional[Any]) -> Tuple[int, int]:
    """(in_features, out_features) of a full layer's weight; ValueError for a bad shape."""
    if getattr(weight, "ndim", None) != 2:
        raise ValueError(f"weight must be 2-D (in_features, out_features), got shape "
                         f"{getattr(weight, 'shape', None)}")
    in_features, out_features = int(weight.shape[0]), int(weight.shape[1])
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},), got {bias.shape}")
    return in_features, out_features


class ColumnParallelLinear(_ParallelLinear):
    _split_axis = 1   # the weight's columns (output features)

    """``y = x W + b`` with W's columns (output features) split across ``comm``'s ranks.

    Args:
        comm: the tensor-parallel group.
        weight: the *unsharded* weight, shape (in_features, out_features); rank r keeps
            columns ``[r * out / p, (r + 1) * out / p)``.
        bias: the unsharded bias (out_features,) or None.
        gather_output: all-gather the output so every rank gets all out_features (else each
            rank returns its (rows, out / p) slice, ready for a ``RowParallelLinear``).
        sequence_parallel: the input arrives split by rows (see the module doc).

    Raises:
        ValueError: out_features not divisible by the group size (both numbers named).

    Example (two ranks)::

        weight, bias = init_linear(64, 128, seed=0)
        layer = ColumnParallelLinear(comm, weight, bias)      # holds 64 x 64
        y = layer.forward(x)                                  # (rows, 64): this rank's half
        dx = layer.backward(dy)                               # one all-reduce
    """

    def __init__(self, comm, weight: Any, bias: Optional[Any] = None, *,
                 gather_output: bool = False, sequence_parallel: bool = False):
        self.comm, self.xp = comm, _array_module(weight)
        self.in_features, self.out_features = _check_linear(weight, bias)
        self.local_out = _split(self.out_features, comm.size, "out_features",
                                "ColumnParallelLinear")
        cols = slice(comm.rank * self.local_out, (comm.rank + 1) * self.local_out)
        self.weight = self.xp.ascontiguousarray(weight[:, cols])
        self.bias = None if bias is None else self.xp.ascontiguousarray(bias[cols])
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.grad_weight = self.grad_bias = None
        self._input = None

    def forward(self, x: Any) -> Any:
        """x: (rows, in) replicated, or (rows / p, in) with sequence parallelism."""
        self._check_input(x, self.in_features, "x")
        full = self._gather_rows(x) if self.sequence_parallel else x
        self._input = full
        y = full @ self.weight
        if self.bias is not None:
            y += self.bias
        if not self.gather_output or self.comm.size == 1:
            return y
        gathered = self.comm.all_gather(self.xp.ascontiguousarray(y))   # (p, rows, out / p)
        return self.xp.ascontiguousarray(gathered.transpose(1, 0, 2)).reshape(
            y.shape[0], self.out_features)

    def backward(self, grad_output: Any) -> Any:
        """Gradient of the loss w.r.t. the input (replicated, or this rank's rows with sequence
        parallelism); sets ``grad_weight`` / ``grad_bias`` for this rank's slice."""
        if self._input is None:
            raise RuntimeError("ColumnParallelLinear.backward() called before forward()")
        if self.gather_output and self.comm.size > 1:
            self._check_input(grad_output, self.out_features, "grad_output")
            r = self.comm.rank
            grad_output = self.xp.ascontiguousarray(
                grad_output[:, r * self.local_out:(r + 1) * self.local_out])
        self._check_input(grad_output, self.local_out, "grad_output")
        x, self._input = self._input, None
        self.grad_weight = x.T @ grad_output
        if self.bias is not None:
            self.grad_bias = grad_output.sum(axis=0)
        partial = grad_output @ self.weight.T           # this rank's share of dL/dx
        if self.comm.size == 1:
            return partial
        if self.sequence_parallel:
            return self._scatter_rows(partial)
        return self.comm.all_reduce(partial)


class RowParallelLinear(_ParallelLinear):
    _split_axis = 0   # the weight's rows (input features)

    """``y = x W + b`` with W's rows (input features) split across ``comm``'s ranks.

    Args:
        comm: the tensor-parallel group.
        weight: the *unsharded* weight (in_features, out_features); rank r keeps rows
            ``[r * in / p, (r + 1) * in / p)``.
        bias: the unsharded bias (out_features,) or None; added once, after the sum.
        input_is_parallel: the input is already this rank's (rows, in / p) slice (as a
            ``ColumnParallelLinear`` returns it); else a full (rows, in) input is sliced.
        sequence_parallel: return this rank's rows of the output (reduce-scatter) instead of
            all of them (all-reduce).

    Raises:
        ValueError: in_features not divisible by the group size (both numbers named).
    """

    def __init__(self, comm, weight: Any, bias: Optional[Any] = None, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        self.comm, self.xp = comm, _array_module(weight)
        self.in_features, self.out_features = _check_linear(weight, bias)
        self.local_in = _split(self.in_features, comm.size, "in_features", "RowParallelLinear")
        rows = slice(comm.rank * self.local_in, (comm.rank + 1) * self.local_in)
        self.weight = self.xp.ascontiguousarray(weight[rows])
        self.bias = None if bias is None else self.xp.array(bias, copy=True)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.grad_weight = self.grad_bias = None
        self._input = None

    def forward(self, x: Any) -> Any:
        """x: (rows, in / p), this rank's features. Returns (rows, out), or (rows / p, out)
        with sequence parallelism."""
        if not self.input_is_parallel:
            self._check_input(x, self.in_features, "x")
            r = self.comm.rank
            x = self.xp.ascontiguousarray(x[:, r * self.local_in:(r + 1) * self.local_in])
        self._check_input(x, self.local_in, "x")
        if self.sequence_parallel:
            _split(x.shape[0], self.comm.size, "the number of rows", "RowParallelLinear")
        self._input = x
        partial = x @ self.weight
        if self.comm.size > 1:
            partial = (self._scatter_rows(partial) if self.sequence_parallel
                       else self.comm.all_reduce(partial))
        if self.bias is not None:
            partial += self.bias
        return partial

    def backward(self, grad_output: Any) -> Any:
        """Gradient w.r.t. this rank's input slice (rows, in / p); no communication unless
        sequence-parallel (then one all-gather of the output gradient's rows)."""
        if self._input is None:
            raise RuntimeError("RowParallelLinear.backward() called before forward()")
        self._check_input(grad_output, self.out_features, "grad_output")
        if self.sequence_parallel:
            grad_output = self._gather_rows(grad_output)
        x, self._input = self._input, None
        self.grad_weight = x.T @ grad_output
        if self.bias is not None:
            self.grad_bias = grad_output.sum(axis=0)
        grad_input = grad_output @ self.weight.T
        if not self.input_is_parallel and self.comm.size > 1:
            grad_input = self.comm.all_gather(self.xp.ascontiguousarray(grad_input))
            grad_input = self.xp.ascontiguousarray(grad_input.transpose(1, 0, 2)).reshape(
                grad_input.shape[1], self.in_features)
        return grad_input
