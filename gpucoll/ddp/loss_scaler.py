"""Dynamic loss scaling for mixed-precision training.

The loss (and so every gradient) is multiplied by ``scale`` before backward, so that small
float16 / bfloat16 gradients do not flush to zero. The fused unpack of the :class:`Bucketer`
(or the :class:`ShardedOptimizer`) divides by the same scale and flags inf / NaN on the way.
When any rank saw a non-finite gradient, every rank skips the step and the scale backs off;
after ``growth_interval`` clean steps in a row it grows again.

Example (two ranks)::

    scaler = DynamicLossScaler(comm)
    for batch in batches:
        loss, grads = loss_and_grads(params, batch, scale=scaler.scale)
        bucketer.reduce(grads, loss_scale=scaler.scale)
        if scaler.update(bucketer.found_nonfinite()):   # same answer on every rank
            sgd_step(params, grads)
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import numpy as np

from .. import cuda_env, kernels

__all__ = ["DynamicLossScaler", "sharded_unscale_settings", "average_reduced_slices",
           "agree_on_overflow"]


def sharded_unscale_settings(xp: Any, loss_scale: Any, scaler: Any, check_finite: Any):
    """For a sharded optimizer's step: the loss scale to divide by (the scaler's when given)
    and a zeroed int32 inf / NaN flag, or None when nothing is to be checked (by default, the
    check runs when unscaling)."""
    if scaler is not None:
        loss_scale = scaler.scale
    check = (loss_scale is not None) if check_finite is None else check_finite
    return loss_scale, (xp.zeros(1, dtype=np.int32) if check else None)


def average_reduced_slices(comm: Any, slices, loss_scale: Any, found_inf: Any,
                           ranks: Optional[int] = None) -> None:
    """Wait for each ``(work, reduced, grad)`` reduction and write ``reduced`` averaged over
    the ranks (``ranks`` of them, default ``comm.size``; hybrid sharding sums over more) and
    unscaled, flagging inf / NaN in ``found_inf``, into ``grad``: one fused unpack each,
    which also casts a narrower wire dtype back."""
    for work, reduced, grad in slices:
        work.wait()
        kernels.unpack(reduced, [grad], scale=1.0 / (ranks or comm.size),
                       loss_scale=loss_scale, found_inf=found_inf)


def agree_on_overflow(comm: Any, found_inf: Any, scaler: Any) -> bool:
    """Whether any rank flagged inf / NaN in the slices it checked (one MAX all-reduce of the
    flag: each rank saw only its own slices), and the scaler updated with that answer."""
    overflow = False
    if found_inf is not None:
        comm.all_reduce(found_inf, op="max")
        overflow = bool(int(found_inf[0]))
    if scaler is not None:
        scaler.update(overflow, agreed=True)
    return overflow


class DynamicLossScaler:
    """Multiply the loss by ``scale``; back off on overflow, grow after clean steps.

    Args:
        comm: when given, ``update`` agrees on the overflow flag across all ranks (one tiny
            all-reduce, MAX), so every rank skips together even when each rank checked only
            its own values. The Bucketer's flag is already equal on every rank (the all-reduce
            spreads inf / NaN); the ShardedOptimizer agrees on its own.
        init_scale: the first scale (a power of two keeps the scaling exact).
        growth_factor: multiplier after ``growth_interval`` clean steps in a row (> 1).
        backoff_factor: multiplier after an overflow (in (0, 1)).
        growth_interval: clean steps between two growths (>= 1).
        min_scale, max_scale: bounds the scale never leaves.
    """

    def __init__(self, comm: Any = None, *, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be finite and > 0, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or int(growth_interval) != growth_interval \
                or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        if not 0 < min_scale <= init_scale <= max_scale:
            raise ValueError(f"need 0 < min_scale <= init_scale <= max_scale, got {min_scale!r}, "
                             f"{init_scale!r}, {max_scale!r}")
        self.comm = comm
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.clean_steps = 0     # clean steps since the last growth or overflow
        self.skipped_steps = 0   # steps skipped because of an overflow, in total
        self.steps = 0           # update() calls

    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale`` (a Python number or an array)."""
        return loss * self.scale

    def agree(self, found_nonfinite: Any) -> bool:
        """Whether any rank found a non-finite value (this rank's flag: a bool, or an int32
        flag array as the Bucketer's ``found_inf``). With a ``comm``, one all-reduce (MAX)."""
        if hasattr(found_nonfinite, "reshape"):
            local = int(found_nonfinite.reshape(-1)[0])
        else:
            local = int(bool(found_nonfinite))
        if self.comm is None or self.comm.size == 1:
            return bool(local)
        flag = np.array([local], dtype=np.int32)
        if getattr(self.comm, "backend", "cpu") == "nccl":
            device = cuda_env.cupy_module().asarray(flag)  # for NCCL: a 4-byte round trip
            self.comm.all_reduce(device, op="max")
            return bool(int(device[0]))
        self.comm.all_reduce(flag, op="max")
        return bool(flag[0])

    def update(self, found_nonfinite: Any, *, agreed: bool = False) -> bool:
        """Account for one step; return True when the step should be applied.

        Args:
            found_nonfinite: this rank's overflow flag (see :meth:`agree`).
            agreed: the flag is already the same on every rank (skip the all-reduce).

        Returns:
            False (skip the step, on every rank) after an overflow, which also multiplies the
            scale by ``backoff_factor``; True otherwise, multiplying the scale by
            ``growth_factor`` after ``growth_interval`` clean steps in a row.
        """
        self.steps += 1
        overflow = bool(found_nonfinite) if agreed else self.agree(found_nonfinite)
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.clean_steps = 0
        return True

    def state_dict(self) -> Dict[str, float]:
        """The scaler's state, for checkpoints."""
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps, "steps": self.steps}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Restore :meth:`state_dict`'s output."""
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"state scale must be finite and > 0, got {scale!r}")
        self.scale = scale
        self.clean_steps = int(state.get("clean_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.steps = int(state.get("steps", 0))

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale:g}, clean_steps={self.clean_steps}, "
                f"skipped_steps={self.skipped_steps})")
