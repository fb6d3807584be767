"""A pipeline stage: a list of layers run in order, with gradients summed over micro-batches.

A layer is any object with ``forward(x)``, ``backward(grad)`` and ``params`` / ``grads``
(lists, attributes or methods): ``gpucoll.pp.Linear`` / ``ReLU``, the ``gpucoll.tp`` layers.
Layers that queue one saved input per forward (``saves_per_forward = True``) may have several
micro-batches in flight; layers that keep only the last one (the tp layers) need
``recompute=True``: the stage then keeps only its input per micro-batch and runs the forward
again just before the backward (GPipe's re-materialisation).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from ..tp.layers import _array_module

__all__ = ["Stage"]


def _listed(layer: Any, name: str) -> List[Any]:
    value = getattr(layer, name, [])
    return list(value() if callable(value) else value)


class Stage:
    """Layers ``[l0, l1, ...]`` of one pipeline stage.

    Args:
        layers: run in order by ``forward``, in reverse by ``backward``.
        index, stages: where this stage sits (optional; ``Pipeline`` checks them against the
            communicator's rank and size when given).
        in_features, out_features: the stage's input / output width; default: the first / last
            layer's ``in_features`` / ``out_features``.
        dtype: of the activations sent and received; default: the first parameter's.
        recompute: keep only the stage input per micro-batch and redo the forward before
            each backward (less memory, one more forward; needed for single-slot layers).

    Raises:
        ValueError: no layers, neighbouring layers whose widths differ (layers and widths
            named), a width that cannot be inferred, or single-slot layers without
            ``recompute``.
        TypeError: a layer without ``forward`` / ``backward``.
    """

    def __init__(self, layers: Sequence[Any], *, index: Optional[int] = None,
                 stages: Optional[int] = None, in_features: Optional[int] = None,
                 out_features: Optional[int] = None, dtype: Any = None, recompute: bool = False):
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("Stage: layers must not be empty")
        for position, layer in enumerate(self.layers):
            if not (callable(getattr(layer, "forward", None))
                    and callable(getattr(layer, "backward", None))):
                raise TypeError(f"Stage: layer {position} ({type(layer).__name__}) has no "
                                f"forward() / backward()")
        self.index, self.stages, self.recompute = index, stages, bool(recompute)
        self.name = "Stage" if index is None else f"stage {index}"
        widths = [(position, layer) for position, layer in enumerate(self.layers)
                  if hasattr(layer, "in_features") and hasattr(layer, "out_features")]
        for (a, left), (b, right) in zip(widths, widths[1:]):
            if left.out_features != right.in_features:
                raise ValueError(f"{self.name}: layer {a} ({type(left).__name__}) gives "
                                 f"{left.out_features} features but layer {b} "
                                 f"({type(right).__name__}) takes {right.in_features}")
        self.in_features = int(in_features if in_features is not None else
                               widths[0][1].in_features if widths else -1)
        self.out_features = int(out_features if out_features is not None else
                                widths[-1][1].out_features if widths else -1)
        if self.in_features < 1 or self.out_features < 1:
            raise ValueError(f"{self.name}: pass in_features and out_features (no layer "
                             f"declares them)")
        single = [f"{p} ({type(l).__name__})" for p, l in enumerate(self.layers)
                  if self.params_of(l) and not getattr(l, "saves_per_forward", False)]
        if single and not self.recompute:
            raise ValueError(f"{self.name}: layer(s) {', '.join(single)} keep only the last "
                             f"input, not one per micro-batch in flight: pass recompute=True")
        params = self.params
        self.xp = _array_module(params[0]) if params else np
        self.dtype = np.dtype(dtype if dtype is not None else
                              params[0].dtype if params else np.float32)
        self._grads: List[Any] = [None] * len(params)
        self._inputs: List[Any] = []   # recompute: the stage input of each micro-batch in flight
        self.stored = 0                # micro-batches whose activations are held now
        self.peak_stored = 0           # the most held at once since reset_peak()

    @staticmethod
    def params_of(layer: Any) -> List[Any]:
        return _listed(layer, "params")

    @property
    def params(self) -> List[Any]:
        """Every layer's parameters, in layer order."""
        return [p for layer in self.layers for p in self.params_of(layer)]

    @property
    def grads(self) -> List[Any]:
        """Gradients of :attr:`params`, summed over the micro-batches since ``zero_grad``
        (zeros for parameters no backward has reached)."""
        return [g if g is not None else self.xp.zeros_like(p)
                for g, p in zip(self._grads, self.params)]

    def zero_grad(self) -> None:
        """Forget the summed gradients (a pipeline step starts with this)."""
        self._grads = [None] * len(self._grads)

    def reset_peak(self) -> None:
        self.peak_stored = self.stored

    def _set_training(self, training: bool) -> None:
        for layer in self.layers:
            if hasattr(layer, "training"):
                layer.training = training

    def _run(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def forward(self, x: Any) -> Any:
        """One micro-batch's forward; what backward needs is kept until its ``backward``."""
        if self.recompute:
            self._set_training(False)
            try:
                y = self._run(x)
            finally:
                self._set_training(True)
            self._inputs.append(x)
        else:
            y = self._run(x)
        self.stored += 1
        self.peak_stored = max(self.peak_stored, self.stored)
        return y

    def predict(self, x: Any) -> Any:
        """Forward without keeping anything (evaluation)."""
        self._set_training(False)
        try:
            return self._run(x)
        finally:
            self._set_training(True)

    def backward(self, grad_output: Any) -> Any:
        """Backward of the oldest micro-batch in flight; adds its parameter gradients to
        :attr:`grads` and returns the gradient w.r.t. the stage input."""
        if self.stored == 0:
            raise RuntimeError("Stage.backward() called with no forward in flight")
        if self.recompute:
            self._run(self._inputs.pop(0))
        grad = grad_output
        for layer in reversed(self.layers):
            grad = layer.backward(grad)
        position = 0
        for layer in self.layers:
            for g in _listed(layer, "grads"):
                if self._grads[position] is None:
                    self._grads[position] = g.copy()
                else:
                    self._grads[position] += g
                position += 1
        self.stored -= 1
        return grad

    def clear(self) -> None:
        """Drop every micro-batch in flight (after a failed step)."""
        for layer in self.layers:
            if callable(getattr(layer, "clear", None)):
                layer.clear()
        self._inputs.clear()
        self.stored = 0
