"""Fully sharded parameters (ZeRO stage 3, FSDP): each rank keeps 1 / world_size of the
parameters, of the gradients and of the optimizer state, and holds a layer's full parameters
only while it computes with them.

The model is cut into *units* (typically one per layer: ``[W, b]``). Each unit's parameters
are packed into one flat space, padded to a multiple of the world size, and rank ``r`` keeps
slice ``r`` of it (the master copy, in the parameters' dtype). Around a unit's computation:

* ``gather(i)`` all-gathers the unit into a full flat buffer and returns views with the
  parameters' shapes; ``gather(i, async_op=True)`` starts that early (prefetch the next layer
  while this one computes); ``release(i)`` frees the buffer.
* ``reduce_gradients(i, grads)`` packs the unit's gradients and **reduce-scatters** them as
  soon as they exist, so rank ``r`` receives the sum of slice ``r`` while backward goes on.
* ``step()`` averages (and unscales, checking inf / NaN) the gradient slices and updates each
  rank's slices with an optimizer whose state covers only them. No all-gather follows: the
  next forward gathers each unit when it needs it.

Gradient accumulation: call ``reduce_gradients`` once per unit for each micro-batch. Each
call reduce-scatters at once and the reduced slices are summed in the parameters' dtype, so
memory stays at one slice per unit (FSDP2's way; FSDP1's ``no_sync`` would hold every unit's
full gradients instead). ``step()`` averages the sum over the ranks, as for one micro-batch:
divide the loss by the number of micro-batches for their mean, as with PyTorch.

With ``compute_dtype="bfloat16"`` (or "float16") the master slices stay float32 but units are
gathered, and gradients reduce-scattered, in the narrower type: half the bytes on the wire and
in the gathered buffers, as in mixed-precision FSDP. Casts run in the fused bucket kernels.

Hybrid sharding (HSDP, torch's ``HYBRID_SHARD``): with ``replicate_comm`` the parameters are
sharded over ``comm`` (a node's ranks) and replicated over ``replicate_comm`` (the ranks
holding the same slice in the other shard groups). Gathers and reduce-scatters stay inside
``comm``; in ``step()`` each rank all-reduces only its reduced slice over ``replicate_comm``
(started as each reduce-scatter finishes, all in flight together) and averages over every
rank, so training equals data parallelism over all of them (:mod:`.hybrid`).

Only the ``Communicator`` interface is used; arrays are NumPy or CuPy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence

import numpy as np

from .. import kernels
from .bucketer import _array_module, _wire_dtype
from .checkpoint import CheckpointView, Group
from .checkpointable import Checkpointable
from .clipping import check_max_norm, clip_grad_norm
from .hybrid import HybridSizes, check_replicate_comm, replicate_slice
from .layout import check_same_layout, shapes_checksum
from .loss_scaler import agree_on_overflow, average_reduced_slices, sharded_unscale_settings
from .optim import SGD, make_optimizer

__all__ = ["FullyShardedParameters"]

_LAYOUT_FIELDS = ("units", "parameters", "elements", "shape checksum", "dtype itemsize",
                  "compute itemsize")


class _Unit:
    """One unit's layout, its slices on this rank, and what is in flight for it."""

    __slots__ = ("shapes", "sizes", "offsets", "chunk", "length", "param", "grad", "full",
                 "gathering", "reducing", "wire_param", "wire_grad", "grad_buffer",
                 "accumulated", "reductions")

    def __init__(self, arrays: Sequence[Any], itemsize: int, world: int):
        self.shapes = [tuple(int(d) for d in a.shape) for a in arrays]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets, length = kernels.bucket_offsets(self.sizes, itemsize)
        self.chunk = max(-(-length // world), 1)    # elements of this unit each rank owns
        self.length = self.chunk * world            # padded: divisible by the world size
        self.param = self.grad = self.full = None
        self.gathering = self.reducing = None       # Work of the all-gather / reduce-scatter
        self.wire_grad = self.grad_buffer = None    # reduce-scatter output / input
        self.wire_param = None   # all-gather input in the compute dtype, kept until it is done
        self.accumulated = None  # sum of this step's earlier micro-batches' reduced slices
        self.reductions = 0      # reduce_gradients calls in this step

    def views(self, full: Any = None) -> List[Any]:
        """The parameters' views of a flat buffer of this unit (default: the gathered one)."""
        full = self.full if full is None else full
        return [full[o:o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]


class FullyShardedParameters(HybridSizes, Checkpointable):
    """Parameters sharded across data-parallel ranks (ZeRO-3 / FSDP), over any communicator.

    Args:
        comm: the data-parallel communicator.
        units: a list of units, each a list of parameter arrays (float32 or float64, one dtype
            for all, C-contiguous). Every rank passes arrays of the same shapes; only their
            values on ``sync_from`` count. The arrays are copied into the shards and not kept.
        optimizer: "sgd" (momentum) or "adam", or an ``SGD`` / ``Adam`` object.
        compute_dtype: None (the parameters' dtype), "bfloat16" or "float16" (float32
            parameters only): the dtype units are gathered and gradients reduced in.
        sync_from: the rank whose values every rank starts from (scattered: only its slices
            travel); None when every rank already holds the same values. With
            ``replicate_comm``: that rank of ``comm`` in the replica of replicate rank 0
            (its slices are then broadcast over ``replicate_comm``).
        replicate_comm: hybrid sharding: the communicator of the ranks that hold this rank's
            slice in the other shard groups (the same rank of a ``comm`` of the same size),
            over which each step's reduced slices are averaged; None: ``comm`` holds every
            data-parallel rank.
        **optimizer_kwargs: passed to the optimizer (``lr``, ``momentum``, ``betas``...).

    Raises:
        ValueError: no units, an empty unit, a non-contiguous array, layouts that differ
            between ranks (the numbers are named), a bad ``sync_from``; a ``replicate_comm``
            that is ``comm``, shares other ranks with it, uses another memory, or whose
            ranks hold different shards (checked with one small all-gather over it).
        TypeError: a parameter that is not float32 / float64, mixed dtypes, or a compute dtype
            that cannot be used; a ``replicate_comm`` that is not a communicator.

    Checkpoints (:meth:`state_dict`, :meth:`save_checkpoint`) hold every parameter and its
    optimizer state whole, so they load at any world size (:mod:`gpucoll.ddp.checkpoint`).

    Example (any number of ranks; one unit per linear layer)::

        fsdp = FullyShardedParameters(comm, [[W0, b0], [W1, b1]], "adam", lr=1e-3)
        with fsdp.gathered(0) as (w, b):
            h = np.maximum(x @ w + b, 0)
        ...                                      # backward: gather again, then
        fsdp.reduce_gradients(1, [gW1, gb1])     # as soon as a layer's gradients exist
        fsdp.reduce_gradients(0, [gW0, gb0])
        fsdp.step()                              # every rank's slices updated

    Hybrid sharding (4 ranks: 2 replicas of 2 shards; a shard group is adjacent ranks)::

        mesh = gpucoll.Mesh(comm, replicate=2, shard=2)
        fsdp = FullyShardedParameters(mesh["shard"], units, "adam",
                                      replicate_comm=mesh["replicate"])
    """

    def __init__(self, comm, units: Sequence[Sequence[Any]], optimizer: Any = "sgd", *,
                 compute_dtype: Optional[str] = None, sync_from: Optional[int] = 0,
                 replicate_comm: Any = None, **optimizer_kwargs):
        self.replicate_comm = check_replicate_comm("FullyShardedParameters", comm,
                                                   replicate_comm)
        units = [list(unit) for unit in units]
        if not units:
            raise ValueError("units is empty")
        empty = [i for i, unit in enumerate(units) if not unit]
        if empty:
            raise ValueError(f"units {empty} hold no parameters")
        if sync_from is not None and not (isinstance(sync_from, (int, np.integer))
                                          and 0 <= sync_from < comm.size):
            raise ValueError(f"sync_from must be a rank in [0, {comm.size}) or None, got "
                             f"{sync_from!r}")
        flat = [a for unit in units for a in unit]
        dtypes = {np.dtype(a.dtype).name for a in flat}
        if len(dtypes) != 1 or not dtypes <= {"float32", "float64"}:
            raise TypeError(f"FullyShardedParameters needs parameters of one dtype, float32 or "
                            f"float64; got {sorted(dtypes)}")
        for u, unit in enumerate(units):
            for p, array in enumerate(unit):
                if not array.flags.c_contiguous:
                    raise ValueError(f"units[{u}][{p}] must be C-contiguous (shape {array.shape})")
        self.comm = comm
        self.dtype = np.dtype(flat[0].dtype)
        self.compute_dtype = self._compute_dtype(compute_dtype)
        self.optimizer: SGD = make_optimizer(optimizer, **optimizer_kwargs)
        self.xp = _array_module(flat[0])
        self._units = [_Unit(unit, self.compute_dtype.itemsize, comm.size) for unit in units]
        check_same_layout(
            comm, "FullyShardedParameters", _LAYOUT_FIELDS,
            [len(units), len(flat), sum(u.length for u in self._units),
             shapes_checksum([u.shapes for u in self._units]), self.dtype.itemsize,
             self.compute_dtype.itemsize],
            flat[0], "every rank must pass units of the same parameter shapes and dtypes",
            replicate=self.replicate_comm)
        for unit, arrays in zip(self._units, units):
            self._shard(unit, arrays, sync_from)
            if sync_from is not None and self.replicas > 1:
                self.replicate_comm.broadcast(unit.param, root=0)
        self.found_inf = None
        self.steps = 0
        self.skipped_steps = 0
        self.grad_norm = None   # the last step's global gradient norm (with max_norm)
        self.wire_bytes = 0   # what this rank has sent in gathers and reductions (ring model)
        self.replicate_wire_bytes = 0   # what it has sent over replicate_comm (ring model)

    def _compute_dtype(self, name: Optional[str]) -> np.dtype:
        if name is None:
            return self.dtype
        if name not in ("bfloat16", "float16") or self.dtype != np.float32:
            raise TypeError(f"compute_dtype must be None, 'bfloat16' or 'float16' (float32 "
                            f"parameters only); got {name!r} for {self.dtype.name} parameters")
        return np.dtype(_wire_dtype(self.dtype, name))

    def _shard(self, unit: _Unit, arrays: Sequence[Any], sync_from: Optional[int]) -> None:
        """Keep this rank's slice of ``arrays`` (``sync_from``'s values when given)."""
        size, rank = self.comm.size, self.comm.rank
        unit.grad = self.xp.zeros(unit.chunk, dtype=self.dtype)
        if sync_from is not None and size > 1:
            unit.param = self.xp.empty(unit.chunk, dtype=self.dtype)
            flat = None
            if rank == sync_from:
                flat = self.xp.zeros(unit.length, dtype=self.dtype)   # padding stays 0
                kernels.pack(arrays, flat, offsets=unit.offsets)
                flat = flat.reshape(size, unit.chunk)
            self.comm.scatter(flat, root=sync_from, out=unit.param)
            return
        flat = self.xp.zeros(unit.length, dtype=self.dtype)
        kernels.pack(arrays, flat, offsets=unit.offsets)
        unit.param = flat[rank * unit.chunk:(rank + 1) * unit.chunk].copy()

    # ------------------------------------------------------------------ what is held
    @property
    def units(self) -> int:
        return len(self._units)

    @property
    def shapes(self) -> List[List[tuple]]:
        """The parameters' shapes, unit by unit."""
        return [list(unit.shapes) for unit in self._units]

    @property
    def shard_sizes(self) -> List[int]:
        """Elements of each unit's slice on this rank (every rank's are the same size)."""
        return [unit.chunk for unit in self._units]

    @property
    def shard_elements(self) -> int:
        """Elements of the flat parameter space this rank owns (sum over units)."""
        return sum(unit.chunk for unit in self._units)

    @property
    def total_elements(self) -> int:
        """Elements of all units together, padding included."""
        return sum(unit.length for unit in self._units)

    @property
    def gathered_units(self) -> List[int]:
        """Units whose full parameters are held now (gathered or being gathered)."""
        return [i for i, unit in enumerate(self._units) if unit.full is not None]

    def shards(self) -> List[Any]:
        """This rank's master slice of each unit (flat; the optimizer updates them in place)."""
        return [unit.param for unit in self._units]

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (about 1 / world_size of unsharded state)."""
        return self.optimizer.state_bytes()

    def resident_bytes(self) -> int:
        """Bytes this object holds now: master slices, gradient slices, optimizer state, the
        units gathered and the gradient buffers of reductions in flight."""
        held = {id(a): a for u in self._units
                for a in (u.param, u.grad, u.full, u.wire_param, u.wire_grad,
                          u.grad_buffer, u.accumulated) if a is not None}
        return sum(int(a.nbytes) for a in held.values()) + self.state_bytes()

    def _count(self, unit: _Unit, dtype: np.dtype) -> None:
        """Add one all-gather's or reduce-scatter's bytes: (n - 1) slices by the ring model."""
        self.wire_bytes += (self.comm.size - 1) * unit.chunk * dtype.itemsize

    # ------------------------------------------------------------------ gather / release
    def _unit(self, index: int) -> _Unit:
        if not isinstance(index, (int, np.integer)) or not 0 <= index < len(self._units):
            raise ValueError(f"unit index {index!r} is out of range for {len(self._units)} units")
        return self._units[index]

    def gather(self, index: int, *, async_op: bool = False) -> Optional[List[Any]]:
        """The full parameters of unit ``index``, as views of one gathered buffer.

        Every rank must gather the same units in the same order (it is an all-gather). A unit
        already gathered is not gathered again. With ``async_op=True`` the all-gather only
        starts (a prefetch) and None is returned; a later ``gather(index)`` waits for it.
        The views are valid until :meth:`release` or :meth:`step`; writing to them changes
        nothing that lasts (the master slices are what ``step`` updates).
        """
        unit = self._unit(index)
        if unit.full is None:
            size = self.comm.size
            if self.compute_dtype == self.dtype:
                mine = unit.param
            else:
                mine = unit.wire_param = self.xp.empty(unit.chunk, dtype=self.compute_dtype)
                kernels.pack([unit.param], mine)                   # fused cast
            unit.full = self.xp.empty(unit.length, dtype=self.compute_dtype)
            self._count(unit, self.compute_dtype)
            unit.gathering = self.comm.all_gather(
                mine, out=unit.full.reshape(size, unit.chunk), async_op=True)
        if async_op:
            return None
        if unit.gathering is not None:
            work, unit.gathering = unit.gathering, None
            try:
                work.wait()
            except BaseException:
                unit.full = unit.wire_param = None
                raise
            unit.wire_param = None
        return unit.views()

    def release(self, index: int) -> None:
        """Free unit ``index``'s gathered parameters (waiting for a prefetch still running)."""
        unit = self._unit(index)
        work, unit.gathering, unit.full = unit.gathering, None, None
        try:
            if work is not None:
                work.wait()
        finally:
            unit.wire_param = None

    @contextlib.contextmanager
    def gathered(self, index: int) -> Iterator[List[Any]]:
        """``gather(index)`` for the ``with`` block, ``release(index)`` after it."""
        views = self.gather(index)
        try:
            yield views
        finally:
            self.release(index)

    def full_parameters(self) -> List[List[Any]]:
        """Copies of every unit's full parameters in the parameters' dtype, gathered from the
        master slices (for evaluation or a checkpoint). A collective: every rank calls it.
        Units gathered before stay gathered."""
        result = []
        for unit in self._units:   # the master slices, never a cast copy
            full = self.xp.empty(unit.length, dtype=self.dtype)
            self._count(unit, self.dtype)
            self.comm.all_gather(unit.param, out=full.reshape(self.comm.size, unit.chunk))
            result.append([view.copy() for view in unit.views(full)])
        return result

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_view(self) -> CheckpointView:
        reducing = [i for i, unit in enumerate(self._units) if unit.reductions]
        busy = (f"the gradients of units {reducing} are being reduced for this step; call it "
                f"after step()") if reducing else None
        groups, first = [], 0
        for unit in self._units:
            groups.append(Group(list(range(first, first + len(unit.sizes))), unit.offsets,
                                unit.chunk))
            first += len(unit.sizes)
        return CheckpointView(self, [s for unit in self._units for s in unit.shapes], groups,
                              [unit.param for unit in self._units], busy=busy)

    def _release_for_load(self) -> None:
        """Units gathered before a load hold the old values: release them."""
        for index in self.gathered_units:
            self.release(index)

    # ------------------------------------------------------------------ gradients and the step
    def reduce_gradients(self, index: int, grads: Sequence[Any]) -> None:
        """Unit ``index``'s gradients exist (one per parameter, in the compute dtype): pack them
        and start their reduce-scatter; rank ``r`` gets the sum of its slice. Once per unit per
        micro-batch (once per step without accumulation), in the same unit order on every
        rank; a unit's earlier reduction in this step is waited for and added to its sum.

        Raises:
            ValueError: index out of range, wrong count or shape.
            TypeError: a gradient of another dtype than the compute dtype.
        """
        unit = self._unit(index)
        grads = list(grads)
        if len(grads) != len(unit.shapes):
            raise ValueError(f"unit {index} has {len(unit.shapes)} parameters, got "
                             f"{len(grads)} gradients")
        for number, (grad, shape) in enumerate(zip(grads, unit.shapes)):
            if tuple(grad.shape) != shape:
                raise ValueError(f"gradient {number} of unit {index} has shape "
                                 f"{tuple(grad.shape)}, expected {shape}")
            if np.dtype(grad.dtype) != self.compute_dtype:
                raise TypeError(f"gradient {number} of unit {index} has dtype {grad.dtype}, "
                                f"expected {self.compute_dtype.name}")
        if unit.reducing is not None:
            self._accumulate(unit)
        size = self.comm.size
        unit.grad_buffer = self.xp.zeros(unit.length, dtype=self.compute_dtype)  # padding 0
        kernels.pack(grads, unit.grad_buffer, offsets=unit.offsets)
        unit.wire_grad = unit.grad if self.compute_dtype == self.dtype else \
            self.xp.empty(unit.chunk, dtype=self.compute_dtype)
        self._count(unit, self.compute_dtype)
        unit.reductions += 1
        unit.reducing = self.comm.reduce_scatter(unit.grad_buffer.reshape(size, unit.chunk),
                                                 out=unit.wire_grad, async_op=True)

    def _accumulate(self, unit: _Unit) -> None:
        """Wait for ``unit``'s reduction in flight and add its slice to the unit's sum (in the
        parameters' dtype: a narrower wire dtype is cast back first)."""
        work, unit.reducing, unit.grad_buffer = unit.reducing, None, None
        work.wait()
        reduced = unit.wire_grad
        if reduced.dtype != self.dtype:
            reduced = kernels.unpack(reduced, [self.xp.empty(unit.chunk, dtype=self.dtype)])[0]
        if unit.accumulated is None:
            unit.accumulated = reduced.copy() if reduced is unit.wire_grad else reduced
        else:
            unit.accumulated += reduced

    def step(self, *, loss_scale: Optional[float] = None, scaler: Any = None,
             check_finite: Optional[bool] = None, max_norm: Optional[float] = None) -> bool:
        """Finish the reduce-scatters, average (and unscale) the slices, update them.

        Units still gathered are released first: their values are about to change.
        ``loss_scale``, ``scaler``, ``check_finite``, ``max_norm`` (clip to a global
        gradient norm; ``grad_norm`` holds it) and the answer (False: some rank's gradients
        had inf / NaN and every rank skipped the step) are as for ``ShardedOptimizer.step``.

        Raises:
            ValueError: some units' gradients were never reduced (listed), or units were
                reduced for different numbers of micro-batches (the counts are named); a bad
                max_norm.
        """
        try:
            check_max_norm(max_norm)
        except ValueError:
            self._reset()
            raise
        for index in self.gathered_units:
            self.release(index)
        missing = [i for i, unit in enumerate(self._units) if unit.reducing is None]
        if missing:
            self._reset()
            raise ValueError(f"the gradients of units {missing} were not reduced in this step; "
                             f"every rank must reduce every unit's gradients before step()")
        counts = [unit.reductions for unit in self._units]
        if len(set(counts)) > 1:
            self._reset()
            raise ValueError(f"units were reduced for different numbers of micro-batches in "
                             f"this step: {counts} (per unit); reduce every unit's gradients "
                             f"once per micro-batch")
        for unit in self._units:
            if unit.accumulated is not None:       # the last micro-batch joins the sum
                work = unit.reducing
                self._accumulate(unit)
                unit.reducing, unit.wire_grad = work, unit.accumulated
        loss_scale, self.found_inf = sharded_unscale_settings(self.xp, loss_scale, scaler,
                                                              check_finite)
        try:
            if self.replicas > 1:   # each slice summed over its replicas, all in flight
                for unit in self._units:
                    unit.reducing = replicate_slice(self.replicate_comm, unit.reducing,
                                                    unit.wire_grad)
                    self.replicate_wire_bytes += 2 * (self.replicas - 1) * \
                        int(unit.wire_grad.nbytes) // self.replicas
            average_reduced_slices(self.comm, [(u.reducing, u.wire_grad, u.grad)
                                               for u in self._units], loss_scale, self.found_inf,
                                   ranks=self.data_parallel_size)
        finally:
            self._reset()
        # inf / NaN in any replica reached every replica's slice: the shard group's flags
        # cover every rank, as the slices' squares do for clipping
        if agree_on_overflow(self.comm, self.found_inf, scaler):
            self.skipped_steps += 1
            return False
        if max_norm is not None:     # the slices' squares summed over the ranks: global
            self.grad_norm = clip_grad_norm([unit.grad for unit in self._units], max_norm, comm=self.comm)
        for number, unit in enumerate(self._units):
            self.optimizer.update(number, unit.param, unit.grad)
        self.steps += 1
        return True

    def _reset(self) -> None:
        for unit in self._units:
            if unit.reducing is not None:
                try:
                    unit.reducing.wait()
                except Exception:
                    pass  # raised (or about to be) by step()
            unit.reducing = unit.wire_grad = unit.grad_buffer = unit.accumulated = None
            unit.reductions = 0
