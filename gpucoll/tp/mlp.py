"""A two-layer tensor-parallel MLP: column-parallel, ReLU, row-parallel.

One all-reduce in forward and one in backward (or, sequence-parallel, one all-gather and one
reduce-scatter each way). The hidden activations never leave their rank.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from .layers import ColumnParallelLinear, RowParallelLinear, init_linear

__all__ = ["ParallelMLP"]


class ParallelMLP:
    """``relu(x W1 + b1) W2 + b2`` with the hidden features split across ``comm``'s ranks.

    Args:
        comm: the tensor-parallel group (hidden_features must divide by its size).
        in_features, hidden_features, out_features: layer widths.
        seed: weights are drawn from it identically on every rank, so the sharded model equals
            the unsharded one with the same seed (``init_linear(..., seed)``, ``seed + 1``).
        xp, dtype: array module and dtype of the parameters.
        sequence_parallel: inputs and outputs split by rows (see ``gpucoll.tp.layers``).

    Example (two ranks)::

        mlp = ParallelMLP(comm, 64, 256, 10)
        logits = mlp.forward(x)            # (rows, 10) on every rank: one all-reduce
        dx = mlp.backward(dlogits)         # one all-reduce; mlp.grads now hold this rank's slices
    """

    def __init__(self, comm, in_features: int, hidden_features: int, out_features: int, *,
                 seed: int = 0, xp: Any = np, dtype: Any = np.float32,
                 sequence_parallel: bool = False):
        w1, b1 = init_linear(in_features, hidden_features, seed=seed, xp=xp, dtype=dtype)
        w2, b2 = init_linear(hidden_features, out_features, seed=seed + 1, xp=xp, dtype=dtype)
        self.fc1 = ColumnParallelLinear(comm, w1, b1, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(comm, w2, b2, sequence_parallel=sequence_parallel)
        self._hidden = None

    @property
    def params(self) -> List[Any]:
        """This rank's parameters: [W1 slice, b1 slice, W2 slice, b2]."""
        return self.fc1.params + self.fc2.params

    @property
    def grads(self) -> List[Any]:
        """Gradients of :attr:`params` from the last ``backward``."""
        return self.fc1.grads + self.fc2.grads

    def full_params(self) -> List[Any]:
        """The unsharded [W1, b1, W2, b2] (a collective; see ``full_params`` of the layers)."""
        return self.fc1.full_params() + self.fc2.full_params()

    def forward(self, x: Any) -> Any:
        hidden = self.fc1.forward(x)
        self._hidden = hidden
        return self.fc2.forward(hidden * (hidden > 0))

    def backward(self, grad_output: Any) -> Any:
        if self._hidden is None:
            raise RuntimeError("ParallelMLP.backward() called before forward()")
        grad_hidden = self.fc2.backward(grad_output) * (self._hidden > 0)
        self._hidden = None
        return self.fc1.backward(grad_hidden)
