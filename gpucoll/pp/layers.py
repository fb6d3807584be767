"""Plain layers for pipeline stages: ``Linear`` and ``ReLU`` that keep one saved input per
forward call, and the softmax cross-entropy the last stage computes.

A pipeline stage runs several micro-batches' forwards before their backwards (GPipe: all of
them; 1F1B: up to ``stages - stage``). Both schedules run a stage's backwards in the order of
its forwards, so these layers queue what backward needs (first in, first out) instead of
keeping only the last input as the tensor-parallel layers do. Arrays are NumPy or CuPy (the
weights' module); ``gpucoll.tp.init_linear`` draws the weights.
"""

from __future__ import annotations

import collections
from typing import Any, List, Sequence

from ..tp.layers import _array_module, _check_linear

__all__ = ["Linear", "ReLU", "mlp_layers", "softmax_cross_entropy"]


class _Queued:
    """What backward needs, one entry per forward, consumed first in, first out."""

    saves_per_forward = True   # Stage: several forwards may be in flight before backward

    def __init__(self) -> None:
        self.training = True   # False: forward saves nothing (evaluation, recomputed stages)
        self._saved: collections.deque = collections.deque()

    def _save(self, value: Any) -> None:
        if self.training:
            self._saved.append(value)

    def _take(self) -> Any:
        if not self._saved:
            raise RuntimeError(f"{type(self).__name__}.backward() called before forward() "
                               f"(or more often than forward)")
        return self._saved.popleft()

    @property
    def saved(self) -> int:
        """Forwards whose backward has not run yet."""
        return len(self._saved)

    def clear(self) -> None:
        """Drop every saved input (after a failed step)."""
        self._saved.clear()


class Linear(_Queued):
    """``y = x W + b`` on the arrays given (no copy: an optimizer updating them in place
    updates the layer).

    Args:
        weight: (in_features, out_features).
        bias: (out_features,) or None.

    Raises:
        ValueError: weight not 2-D, or a bias of the wrong shape (shapes named).
    """

    def __init__(self, weight: Any, bias: Any = None):
        super().__init__()
        self.in_features, self.out_features = _check_linear(weight, bias)
        self.weight, self.bias, self.xp = weight, bias, _array_module(weight)
        self.grad_weight = self.grad_bias = None

    @property
    def params(self) -> List[Any]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    @property
    def grads(self) -> List[Any]:
        """Gradients of :attr:`params` from the last ``backward`` (the stage sums them)."""
        return [self.grad_weight] if self.bias is None else [self.grad_weight, self.grad_bias]

    def forward(self, x: Any) -> Any:
        if getattr(x, "ndim", None) != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Linear: x must have shape (rows, {self.in_features}), got "
                             f"{getattr(x, 'shape', None)}")
        self._save(x)
        y = x @ self.weight
        if self.bias is not None:
            y += self.bias
        return y

    def backward(self, grad_output: Any) -> Any:
        x = self._take()
        self.grad_weight = x.T @ grad_output
        if self.bias is not None:
            self.grad_bias = grad_output.sum(axis=0)
        return grad_output @ self.weight.T


class ReLU(_Queued):
    """``max(x, 0)``; saves the mask of positive inputs."""

    params: List[Any] = []
    grads: List[Any] = []

    def forward(self, x: Any) -> Any:
        positive = x > 0
        self._save(positive)
        return x * positive

    def backward(self, grad_output: Any) -> Any:
        return grad_output * self._take()


def mlp_layers(params: Sequence[Any], stages: int) -> List[List[Any]]:
    """Split an MLP given as ``[W0, b0, W1, b1, ...]`` (ReLU between layers, none after the
    last) into ``stages`` lists of layers, as evenly as the linear layers go (earlier stages
    take the extra one). The layers hold the arrays given, not copies.

    Raises:
        ValueError: an odd number of arrays, or more stages than linear layers.
    """
    if len(params) % 2:
        raise ValueError(f"params must alternate weight, bias: got {len(params)} arrays")
    count = len(params) // 2
    if not 1 <= stages <= count:
        raise ValueError(f"stages must be between 1 and the {count} linear layers, got {stages}")
    per_stage, extra = divmod(count, stages)
    result, start = [], 0
    for stage in range(stages):
        end = start + per_stage + (stage < extra)
        layers: List[Any] = []
        for index in range(start, end):
            layers.append(Linear(params[2 * index], params[2 * index + 1]))
            if index < count - 1:
                layers.append(ReLU())
        result.append(layers)
        start = end
    return result


def softmax_cross_entropy(logits: Any, labels: Any, scale: float):
    """Summed softmax cross-entropy of a micro-batch, its correct count, and the gradient of
    ``scale`` times the sum w.r.t. the logits.

    With ``scale = 1 / batch`` the micro-batches' gradients add up to the gradient of the whole
    batch's mean loss, as the unsplit model computes it.
    """
    xp = _array_module(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    probs = exp / exp.sum(axis=1, keepdims=True)
    rows = xp.arange(logits.shape[0])
    loss = float(-xp.log(probs[rows, labels] + 1e-12).sum())
    correct = int((logits.argmax(axis=1) == labels).sum())
    probs[rows, labels] -= 1
    probs *= scale
    return loss, correct, probs.astype(logits.dtype, copy=False)
