"""ZeRO stage 1: optimizer state sharded across data-parallel ranks.

Gradients are packed into flat buckets (the Bucketer's plan and fused pack kernel), each bucket
padded to a multiple of the world size and **reduce-scattered** as soon as its gradients exist,
so rank ``r`` receives the summed gradients of slice ``r`` of every bucket while backward still
runs. ``step()`` averages and unscales that slice (the fused unpack kernel, which also flags
inf / NaN), updates it with an optimizer whose state covers only that slice, then
**all-gathers** the updated slices and unpacks them into the parameters.

Bytes on the wire per step equal a ring all-reduce's (reduce-scatter + all-gather is how a ring
all-reduce works), but each rank keeps 1 / world_size of the optimizer state and does
1 / world_size of the update arithmetic. Only the ``Communicator`` interface is used.

Hybrid sharding: with ``replicate_comm`` the state is sharded over ``comm`` and replicated over
``replicate_comm``; each rank's reduced slice is all-reduced over ``replicate_comm`` before the
update, and averaged over every rank (:mod:`.hybrid`).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from .. import kernels
from .bucketer import MiB, _array_module, plan_buckets
from .checkpoint import CheckpointView, Group
from .checkpointable import Checkpointable
from .clipping import check_max_norm, clip_grad_norm
from .hybrid import HybridSizes, check_replicate_comm, replicate_slice
from .layout import check_same_layout, shapes_checksum
from .loss_scaler import agree_on_overflow, average_reduced_slices, sharded_unscale_settings
from .optim import SGD, make_optimizer

__all__ = ["ShardedOptimizer"]

_LAYOUT_FIELDS = ("parameters", "elements", "buckets", "shape checksum", "dtype itemsize")


class _Shard:
    __slots__ = ("members", "offsets", "length", "chunk", "buffer", "grad", "param", "ready",
                 "work")

    def __init__(self, members: List[int], sizes: Sequence[int], itemsize: int, world: int):
        self.members = members
        self.offsets, length = kernels.bucket_offsets([sizes[i] for i in members], itemsize)
        self.chunk = -(-length // world)          # elements of this bucket each rank owns
        self.length = self.chunk * world          # padded: divisible by the world size
        self.buffer = self.grad = self.param = None
        self.ready = 0
        self.work = None


class ShardedOptimizer(HybridSizes, Checkpointable):
    """Data-parallel optimizer step with sharded state (ZeRO-1), over any communicator.

    Args:
        comm: the data-parallel communicator.
        params: the parameters (float32 or float64, one dtype), equal on every rank (see
            ``broadcast_parameters``); updated in place by :meth:`step`.
        optimizer: "sgd" (momentum) or "adam", or an ``SGD`` / ``Adam`` object.
        bucket_cap_bytes, first_bucket_cap_bytes: as for the ``Bucketer``.
        replicate_comm: hybrid sharding: the communicator of the ranks holding this rank's
            slice in the other shard groups (as for ``FullyShardedParameters``); None: ``comm``
            holds every data-parallel rank.
        **optimizer_kwargs: passed to the optimizer (``lr``, ``momentum``, ``betas``...).

    Raises:
        ValueError: parameter layouts differ between ranks (the numbers are named); bad caps;
            a ``replicate_comm`` that is ``comm``, shares other ranks with it, uses another
            memory, or whose ranks hold different shards.
        TypeError: a parameter that is not float32 / float64, or mixed dtypes; a
            ``replicate_comm`` that is not a communicator.

    Checkpoints (:meth:`state_dict`, :meth:`save_checkpoint`) hold the parameters and the
    optimizer state whole, so they load at any world size (:mod:`gpucoll.ddp.checkpoint`).

    Example (two ranks)::

        opt = ShardedOptimizer(comm, params, "adam", lr=1e-3)
        loss, grads = loss_and_grads(params, batch, on_grad=opt.mark_ready)
        opt.step()                       # params updated on every rank
    """

    def __init__(self, comm, params: Sequence[Any], optimizer: Any = "sgd", *,
                 bucket_cap_bytes: int = 25 * MiB, first_bucket_cap_bytes: int = 1 * MiB,
                 replicate_comm: Any = None, **optimizer_kwargs):
        self.replicate_comm = check_replicate_comm("ShardedOptimizer", comm, replicate_comm)
        if bucket_cap_bytes <= 0 or first_bucket_cap_bytes <= 0:
            raise ValueError(f"bucket caps must be positive, got {bucket_cap_bytes} and "
                             f"{first_bucket_cap_bytes}")
        if not params:
            raise ValueError("params is empty")
        self.comm = comm
        self.params = list(params)
        self.optimizer: SGD = make_optimizer(optimizer, **optimizer_kwargs)
        dtypes = {np.dtype(p.dtype).name for p in self.params}
        if len(dtypes) != 1 or not dtypes <= {"float32", "float64"}:
            raise TypeError(f"ShardedOptimizer needs parameters of one dtype, float32 or float64; "
                            f"got {sorted(dtypes)}")
        self.dtype = np.dtype(self.params[0].dtype)
        self.shapes = [tuple(int(d) for d in p.shape) for p in self.params]
        for index, param in enumerate(self.params):
            if not param.flags.c_contiguous:
                raise ValueError(f"params[{index}] must be C-contiguous (shape {param.shape})")
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        plan = plan_buckets([s * self.dtype.itemsize for s in sizes], [self.dtype] * len(sizes),
                            bucket_cap_bytes, first_bucket_cap_bytes)
        self._shards = [_Shard(m, sizes, self.dtype.itemsize, comm.size) for m in plan]
        self._shard_of = {i: b for b, shard in enumerate(self._shards) for i in shard.members}
        self.xp = _array_module(self.params[0])
        self._check_layout(sizes)
        for shard in self._shards:
            shard.buffer = self.xp.zeros(shard.length, dtype=self.dtype)   # padding stays 0
            kernels.pack([self.params[i] for i in shard.members], shard.buffer,
                         offsets=shard.offsets)
            mine = slice(comm.rank * shard.chunk, (comm.rank + 1) * shard.chunk)
            shard.param = shard.buffer[mine].copy()                         # this rank's slice
            shard.grad = self.xp.zeros(shard.chunk, dtype=self.dtype)
        self._grads: List[Any] = [None] * len(self.params)
        self._next_issue = 0
        self.found_inf = None
        self.steps = 0
        self.skipped_steps = 0
        self.grad_norm = None   # the last step's global gradient norm (with max_norm)

    # ------------------------------------------------------------------ layout
    def _check_layout(self, sizes: Sequence[int]) -> None:
        """All-gather (parameters, elements, buckets, shape checksum, itemsize) and compare."""
        check_same_layout(self.comm, "ShardedOptimizer", _LAYOUT_FIELDS,
                          [len(self.params), sum(sizes), len(self._shards),
                           shapes_checksum(self.shapes), self.dtype.itemsize],
                          self.params[0], "every rank must pass the same parameter shapes and "
                          "bucket caps", replicate=self.replicate_comm)

    @property
    def buckets(self) -> List[List[int]]:
        """Parameter indices of each bucket, in issue order."""
        return [list(shard.members) for shard in self._shards]

    @property
    def shard_elements(self) -> int:
        """Elements of the flat parameter space this rank owns (sum over buckets)."""
        return sum(shard.chunk for shard in self._shards)

    @property
    def total_elements(self) -> int:
        """Elements of all buckets together, padding included."""
        return sum(shard.length for shard in self._shards)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (about 1 / world_size of unsharded state)."""
        return self.optimizer.state_bytes()

    def wire_bytes_per_step(self) -> int:
        """Bytes this rank sends per step over ``comm`` by the ring model: (n - 1) / n of the
        buckets for the reduce-scatter and the same for the all-gather (with hybrid
        sharding, its slices' all-reduce over ``replicate_comm`` comes on top)."""
        n = self.comm.size
        return int(2 * (n - 1) * self.shard_elements * self.dtype.itemsize)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_view(self) -> CheckpointView:
        marked = [i for i, grad in enumerate(self._grads) if grad is not None]
        busy = (f"gradients {marked} of this step were already marked ready; call it after "
                f"step()") if marked else None
        return CheckpointView(self, self.shapes,
                              [Group(s.members, s.offsets, s.chunk) for s in self._shards],
                              [s.param for s in self._shards], replicated=self.params, busy=busy)

    def _release_for_load(self) -> None:
        """Nothing is held between steps that a load would make stale."""

    # ------------------------------------------------------------------ the step
    def mark_ready(self, index: int, grad: Any) -> None:
        """Gradient ``index`` (registration order) exists; full buckets start their
        reduce-scatter now, in bucket order.

        Raises:
            ValueError: index out of range, marked twice, or wrong shape. TypeError: dtype.
        """
        if not 0 <= index < len(self.params):
            raise ValueError(f"gradient index {index} is out of range for {len(self.params)} "
                             f"parameters")
        if tuple(grad.shape) != self.shapes[index]:
            raise ValueError(f"gradient {index} has shape {tuple(grad.shape)}, expected "
                             f"{self.shapes[index]}")
        if np.dtype(grad.dtype) != self.dtype:
            raise TypeError(f"gradient {index} has dtype {grad.dtype}, expected {self.dtype}")
        if self._grads[index] is not None:
            raise ValueError(f"gradient {index} was already marked ready in this step")
        self._grads[index] = grad
        shard = self._shards[self._shard_of[index]]
        shard.ready += 1
        if shard.ready == len(shard.members):
            self._issue_ready()

    def _issue_ready(self) -> None:
        size = self.comm.size
        while self._next_issue < len(self._shards):
            shard = self._shards[self._next_issue]
            if shard.ready < len(shard.members):
                return
            kernels.pack([self._grads[i] for i in shard.members], shard.buffer,
                         offsets=shard.offsets)
            shard.work = self.comm.reduce_scatter(shard.buffer.reshape(size, shard.chunk),
                                                  out=shard.grad, async_op=True)
            self._next_issue += 1

    def step(self, *, loss_scale: Optional[float] = None, scaler: Any = None,
             check_finite: Optional[bool] = None, max_norm: Optional[float] = None) -> bool:
        """Finish the reduce-scatters, update this rank's shard, all-gather the parameters.

        Args:
            loss_scale: divide the gradients by it (mixed precision); implies the check.
            scaler: a ``DynamicLossScaler``: its ``scale`` unscales, and it is updated with
                the overflow flag all ranks agreed on.
            check_finite: check for inf / NaN (default: when unscaling).
            max_norm: clip the averaged gradients to this global 2-norm (one all-reduce of
                the slices' sums of squares); the norm before clipping is in ``grad_norm``.

        Returns:
            True when the parameters were updated; False when some rank's gradients had inf /
            NaN and every rank skipped the step.

        Raises:
            ValueError: some gradients were never marked ready (listed); a bad max_norm.
        """
        missing = [i for i, grad in enumerate(self._grads) if grad is None]
        try:
            check_max_norm(max_norm)
        except ValueError:
            self._reset()
            raise
        if missing:
            self._reset()
            raise ValueError(f"gradients {missing} were not marked ready in this step; every "
                             f"rank must produce every gradient")
        loss_scale, self.found_inf = sharded_unscale_settings(self.xp, loss_scale, scaler,
                                                              check_finite)
        try:
            self._issue_ready()
            if self.replicas > 1:   # each slice summed over its replicas, all in flight
                for shard in self._shards:
                    shard.work = replicate_slice(self.replicate_comm, shard.work, shard.grad)
            average_reduced_slices(self.comm, [(s.work, s.grad, s.grad) for s in self._shards],
                                   loss_scale, self.found_inf, ranks=self.data_parallel_size)
        finally:
            self._reset()
        if agree_on_overflow(self.comm, self.found_inf, scaler):
            self.skipped_steps += 1
            return False
        if max_norm is not None:     # the slices' squares summed over the ranks: global
            self.grad_norm = clip_grad_norm([shard.grad for shard in self._shards], max_norm, comm=self.comm)
        for number, shard in enumerate(self._shards):
            self.optimizer.update(number, shard.param, shard.grad)
            shard.work = self.comm.all_gather(shard.param, out=shard.buffer.reshape(
                self.comm.size, shard.chunk), async_op=True)
        try:
            for shard in self._shards:
                shard.work.wait()
                kernels.unpack(shard.buffer, [self.params[i] for i in shard.members],
                               offsets=shard.offsets)
        finally:
            self._reset()
        self.steps += 1
        return True

    def reduce_and_step(self, grads: Sequence[Any], **step_kwargs) -> bool:
        """``mark_ready`` every gradient (last first), then :meth:`step`."""
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        for index in reversed(range(len(grads))):
            self.mark_ready(index, grads[index])
        return self.step(**step_kwargs)

    def _reset(self) -> None:
        for shard in self._shards:
            if shard.work is not None:
                try:
                    shard.work.wait()
                except Exception:
                    pass  # raised (or about to be) by step()
            shard.ready = 0
            shard.work = None
        self._grads = [None] * len(self.params)
        self._next_issue = 0
