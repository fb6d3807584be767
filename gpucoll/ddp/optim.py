"""Element-wise optimizers on flat arrays (NumPy or CuPy), for sharded and server-side state.

Each optimizer updates one flat parameter array from one flat gradient array of the same shape
and keeps its state (momentum, Adam moments) in arrays of that shape, created lazily with the
parameter's array module, so a ZeRO-1 rank or a parameter server only ever holds the state of
the shard it owns. The maths is written with the arrays' own in-place operators and so runs
unchanged on NumPy and CuPy.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

__all__ = ["SGD", "Adam", "make_optimizer"]


class SGD:
    """SGD with (heavy-ball) momentum, as in ``v = m v + g; p -= lr v``, or Nesterov's
    (``p -= lr (g + m v)``, torch's ``SGD(nesterov=True)``).

    Args:
        lr: learning rate (> 0).
        momentum: momentum factor in [0, 1); 0 keeps no state at all.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
    """

    name = "sgd"
    _SETTINGS = ("lr", "momentum", "weight_decay", "nesterov")

    def __init__(self, lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 0.0,
                 nesterov: bool = False):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if nesterov and not momentum > 0:
            raise ValueError(f"nesterov=True needs momentum > 0, got momentum={momentum!r}")
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.nesterov = bool(nesterov)
        self.state: List[Dict[str, Any]] = []

    def _slot(self, index: int) -> Dict[str, Any]:
        while len(self.state) <= index:
            self.state.append({})
        return self.state[index]

    def update(self, index: int, param: Any, grad: Any) -> None:
        """Update ``param`` in place from ``grad`` (slot ``index`` holds its state)."""
        if self.weight_decay:
            grad = grad + self.weight_decay * param
        if self.momentum:
            slot = self._slot(index)
            velocity = slot.get("velocity")
            if velocity is None:
                velocity = slot["velocity"] = param * 0
            velocity *= self.momentum
            velocity += grad
            grad = grad + self.momentum * velocity if self.nesterov else velocity
        param -= self.lr * grad

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (what ZeRO-1 divides by the world size)."""
        return sum(int(a.nbytes) for slot in self.state for a in slot.values()
                   if hasattr(a, "nbytes"))

    # ------------------------------------------------------------------ checkpoints
    def settings(self) -> Dict[str, Any]:
        """The constructor's arguments (JSON-compatible): what a checkpoint restores."""
        return {key: (list(value) if isinstance(value, tuple) else value)
                for key, value in ((k, getattr(self, k)) for k in self._SETTINGS)}

    def state_keys(self) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        """(array keys, scalar keys) of each slot once it has state."""
        return (("velocity",) if self.momentum else ()), ()

    def load_settings(self, settings: Dict[str, Any]) -> None:
        """Take a checkpoint's settings (checked as the constructor checks them)."""
        checked = type(self)(**settings)
        for key in self._SETTINGS:
            setattr(self, key, getattr(checked, key))


class Adam(SGD):
    """Adam (Kingma & Ba) with bias correction; ``weight_decay`` is decoupled (AdamW) when
    ``decoupled=True``, else added to the gradient."""

    name = "adam"
    _SETTINGS = ("lr", "betas", "eps", "weight_decay", "decoupled")

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = False):
        super().__init__(lr=lr, momentum=0.0, weight_decay=weight_decay)
        beta1, beta2 = (float(b) for b in betas)
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.beta1, self.beta2, self.eps, self.decoupled = beta1, beta2, float(eps), decoupled

    @property
    def betas(self) -> Tuple[float, float]:
        return self.beta1, self.beta2

    @betas.setter
    def betas(self, value) -> None:
        self.beta1, self.beta2 = (float(b) for b in value)

    def state_keys(self) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        return ("m", "v"), ("step",)

    def update(self, index: int, param: Any, grad: Any) -> None:
        if self.weight_decay and not self.decoupled:
            grad = grad + self.weight_decay * param
        slot = self._slot(index)
        if "m" not in slot:
            slot["m"], slot["v"], slot["step"] = param * 0, param * 0, 0
        slot["step"] += 1
        m, v, step = slot["m"], slot["v"], slot["step"]
        m *= self.beta1
        m += (1 - self.beta1) * grad
        v *= self.beta2
        v += (1 - self.beta2) * (grad * grad)
        step_size = self.lr * math.sqrt(1 - self.beta2 ** step) / (1 - self.beta1 ** step)
        if self.weight_decay and self.decoupled:
            param -= (self.lr * self.weight_decay) * param
        denominator = v ** 0.5
        denominator += self.eps * math.sqrt(1 - self.beta2 ** step)
        param -= step_size * (m / denominator)


def make_optimizer(optimizer: Any = "sgd", **kwargs) -> SGD:
    """An optimizer object from a name ("sgd", "adam") and keyword arguments, or the object."""
    if isinstance(optimizer, SGD):
        if kwargs:
            raise ValueError(f"pass optimizer settings to the optimizer object, not {sorted(kwargs)}")
        return optimizer
    if optimizer == "sgd":
        return SGD(**kwargs)
    if optimizer == "adam":
        return Adam(**kwargs)
    raise ValueError(f"optimizer must be 'sgd', 'adam' or an SGD/Adam object, got {optimizer!r}")
