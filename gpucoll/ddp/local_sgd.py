"""Local SGD and DiLoCo: data parallelism that communicates every ``sync_every`` steps.

Each replica trains on its own batches with its own (inner) optimizer and no communication;
every ``sync_every`` (H) steps the replicas meet:

* :class:`LocalSGD` (torch's ``PeriodicModelAverager`` / post-local SGD, torchft's
  ``LocalSGD``) replaces every replica's parameters by their average.
* :class:`DiLoCo` (Douillard et al., 2023; torchft's ``DiLoCo``) averages the
  *pseudo-gradient* ``anchor - params`` (the anchor: the parameters at the last sync) and
  applies it to the anchor with an outer optimizer, SGD with Nesterov momentum (the paper's
  lr 0.7, momentum 0.9); every replica then starts again from the new anchor.

One all-reduce of every parameter per sync instead of one per step: H times fewer bytes
than the Bucketer. The averaging *is* a Bucketer's (the parameters, or the pseudo-gradients,
packed into buckets by the fused kernels, one all-reduce per bucket), so NumPy, CuPy and torch
CPU tensors work, and ``compression="bf16" | "fp16"`` sends half precision. With compression
LocalSGD sends each parameter's change since the last sync (small numbers, which lose little
in half precision) rather than the parameters, so it keeps an anchor too.

State (anchor, outer momentum, counters) is the same on every replica after each sync;
``state_dict()`` / ``load_state_dict()`` keep it (the caller keeps its parameters and inner
optimizer), and ``rebind(comm)`` carries on over the communicator ``comm.shrink()`` gave
after a lost rank, or ``comm.grow()`` gave when replacements came in: a newcomer constructs
its object with ``joined=True`` and receives the anchor, the outer momentum and the counters
from a member, so that the next sync includes it.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..hostarrays import array_module, host_view
from .bucketer import _COMPRESSION, MiB, Bucketer, _wire_dtype, broadcast_parameters
from .checkpoint import agree, to_host
from .layout import check_same_layout, shapes_checksum
from .optim import SGD

__all__ = ["LocalSGD", "DiLoCo", "FORMAT"]

FORMAT = "gpucoll.ddp.local_sgd/1"
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_LAYOUT_FIELDS = ("parameters", "elements", "shape checksum", "dtype checksum", "sync_every",
                  "wire itemsize")
_FINGERPRINT_ELEMENTS = 1024
# what a rank does in the exchange that binds it to a communicator (the first column of it)
_FRESH, _REBINDING, _JOINING = 0, 1, 2


def _device_of(array: Any):
    """The array's CUDA device as a context (CuPy), or nothing (NumPy)."""
    return array.device if array_module(array) is not np else contextlib.nullcontext()


def _copy_beside(array: Any) -> Any:
    """A copy of ``array`` on its own device."""
    with _device_of(array):
        return array.copy()


class _Periodic:
    """What LocalSGD and DiLoCo share: checks, the step counter, the averaging Bucketer, the
    anchor, checkpoints and ``rebind``. A subclass defines :meth:`_sync` and ``_outer``."""

    _outer: Optional[SGD] = None

    def __init__(self, comm, params: Sequence[Any], sync_every: int, compression: Optional[str],
                 bucket_cap_bytes: int, keep_anchor: bool, joined: bool):
        if isinstance(sync_every, bool) or not isinstance(sync_every, (int, np.integer)) \
                or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if compression not in _COMPRESSION:
            raise ValueError(f"compression must be None, 'bf16' or 'fp16', got {compression!r}")
        if not bucket_cap_bytes > 0:
            raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes!r}")
        if not isinstance(joined, (bool, np.bool_)):
            raise TypeError(f"joined must be True or False, got {joined!r}")
        params = list(params)
        if not params:
            raise ValueError("params is empty")
        self.params = [host_view(p, f"params[{i}]") for i, p in enumerate(params)]
        modules = {array_module(p).__name__ for p in self.params}
        if len(modules) != 1:
            raise TypeError(f"params mix array modules {sorted(modules)}; pass all NumPy (or "
                            f"host tensors) or all CuPy arrays")
        for index, param in enumerate(self.params):
            if np.dtype(param.dtype).name not in _FLOATS:
                raise TypeError(f"params[{index}] has dtype {np.dtype(param.dtype).name}; "
                                f"{type(self).__name__} averages float16, bfloat16, float32 or "
                                f"float64 parameters")
            if not param.flags.c_contiguous:
                raise ValueError(f"params[{index}] must be C-contiguous (shape "
                                 f"{tuple(param.shape)}): it is written in place")
        self.xp = array_module(self.params[0])
        self.shapes = [tuple(int(d) for d in p.shape) for p in self.params]
        self.dtypes = [np.dtype(p.dtype) for p in self.params]
        self.sync_every = int(sync_every)
        self.compression = _COMPRESSION[compression]
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        self.steps = 0        # inner steps counted by step()
        self.syncs = 0        # syncs completed
        self._pending = False  # a sync raised on this rank and was not completed
        self.anchor: Optional[List[Any]] = \
            [_copy_beside(p) for p in self.params] if keep_anchor else None
        self._delta: Optional[List[Any]] = None    # the pseudo-gradients (made at first sync)
        table = self._bind(comm, _JOINING if joined else _FRESH)
        if joined:
            self._adopt(table)

    # ------------------------------------------------------------------ the communicator
    def _bind(self, comm, role: int) -> np.ndarray:
        """Check ``comm`` against the arrays, every rank's layout and outer optimizer, and
        what each rank does (``role``: a new object, ``rebind``, ``joined=True``); make the
        Bucketer. Returns every rank's row of (role, syncs, steps, interrupted)."""
        if getattr(comm, "memory", "host") == "cuda" and self.xp is np:
            raise TypeError(f"backend {comm.backend!r} takes GPU arrays and the parameters are "
                            f"host arrays; use a host backend (cpu, mpi) or CuPy parameters")
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        wire = max(_wire_dtype(d, self.compression).itemsize for d in self.dtypes)
        check_same_layout(comm, type(self).__name__, _LAYOUT_FIELDS,
                          [len(self.shapes), sum(sizes), shapes_checksum(self.shapes),
                           shapes_checksum([d.name for d in self.dtypes]), self.sync_every,
                           wire], self.params[0],
                          "every rank must pass the same parameter shapes and dtypes, "
                          "sync_every and compression")
        outer = (self._outer.lr, self._outer.momentum) if self._outer is not None else (0, 0)
        mine = np.array([role, self.syncs, self.steps, int(self._pending), *outer], np.float64)
        table = to_host(comm.all_gather(self.xp.asarray(mine))).reshape(comm.size, 6)
        self._check_roles(comm, table)
        self.comm = comm
        self._bucketer = Bucketer(comm, self.params, bucket_cap_bytes=self.bucket_cap_bytes,
                                  first_bucket_cap_bytes=self.bucket_cap_bytes,
                                  compression=self.compression)
        return table[:, :4].astype(np.int64)

    def _check_roles(self, comm, table: np.ndarray) -> None:
        """Raise on every rank (they all hold ``table``) when the ranks' outer optimizers
        differ, or a newcomer (``joined=True``) or a new object meets ranks that rebind."""
        kind = type(self).__name__
        for rank, row in enumerate(table):
            if not np.array_equal(row[4:], table[comm.rank, 4:]):
                raise ValueError(f"{kind}: rank {comm.rank} and rank {rank} have different outer "
                                 f"optimizers (outer_lr {table[comm.rank, 4]:g} vs {row[4]:g}, "
                                 f"outer_momentum {table[comm.rank, 5]:g} vs {row[5]:g}); "
                                 f"every rank must pass the same outer_lr and outer_momentum")
        roles = table[:, 0]
        fresh, members, newcomers = (np.flatnonzero(roles == role).tolist()
                                     for role in (_FRESH, _REBINDING, _JOINING))
        if newcomers and not members:
            raise ValueError(f"{kind}: ranks {newcomers} construct with joined=True and no rank "
                             f"holds the state to hand them: after grow(), the members call "
                             f"rebind(comm) with the grown communicator"
                             + (f" (ranks {fresh} construct a new {kind} instead)" if fresh
                                else ""))
        if fresh and members:
            raise ValueError(f"{kind}: ranks {fresh} construct a new {kind} while ranks "
                             f"{members} call rebind(): a rank that came in through grow() holds "
                             f"no state; construct its {kind} with joined=True")

    @property
    def buckets(self) -> List[List[int]]:
        """Parameter indices of each all-reduce of a sync."""
        return self._bucketer.buckets

    def wire_bytes_per_sync(self) -> int:
        """Bytes this rank hands to the all-reduces of one sync (every parameter once, in
        the wire dtype, with the buckets' alignment padding)."""
        return self._bucketer.wire_bytes_per_step()

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        """Count one inner step (call it after each optimizer step); every ``sync_every``-th
        synchronizes the replicas, a collective.

        Returns:
            Whether this step synchronized (the parameters are then equal on every rank).

        Raises:
            PeerError, CommTimeoutError, CommAbortedError: the sync failed (a lost rank); the
                step is not counted, and after ``comm.shrink()`` :meth:`rebind` completes it
                on the survivors.
        """
        if (self.steps + 1) % self.sync_every:
            self.steps += 1
            return False
        self._pending = True
        self._sync()
        self._pending = False
        self.steps += 1
        self.syncs += 1
        return True

    def _sync(self) -> None:
        raise NotImplementedError

    def _average_deltas(self) -> List[Any]:
        """The pseudo-gradients ``anchor - params``, averaged over the ranks (a new buffer:
        the parameters stay as they are until the average has arrived)."""
        if self._delta is None:
            self._delta = [_copy_beside(p) for p in self.params]
        for delta, anchor, param in zip(self._delta, self.anchor, self.params):
            self.xp.subtract(anchor, param, out=delta)
        self._bucketer.reduce(self._delta)
        return self._delta

    # ------------------------------------------------------------------ lost ranks
    def rebind(self, comm) -> None:
        """Go on over ``comm``, the communicator ``comm.shrink()`` returned after a lost rank,
        or ``comm.grow()`` returned with newcomers; a collective of its ranks.

        After a shrink the survivors agree on one state: when a lost rank's sync completed
        on some of them (the all-reduce had every rank's part before the failure), those
        ranks' parameters, anchor, outer momentum and counters are broadcast to the others;
        when it completed on none, the survivors redo it among themselves (from their
        parameters as the failure left them: LocalSGD averages them in place, bucket by
        bucket, so a failure between two buckets leaves some already averaged). Either way,
        on return the step whose sync raised is complete on every rank, as if nothing had
        failed (continue with the next batch).

        After a grow, the newcomers construct theirs with ``joined=True`` while the members
        call this: the first member sends them the anchor, the outer momentum and the
        counters (see ``joined``), and the members' parameters stay as they are. The next
        sync, at the same step on every rank, includes the newcomers. The inner optimizer's
        state stays each rank's own.

        Raises:
            ValueError: the ranks of ``comm`` hold other parameter layouts or settings;
                some of them were interrupted in a sync and others not, or interrupted
                where newcomers join (shrink and rebind first); a rank of ``comm``
                constructs a new object without ``joined=True`` (ranks named).
            TypeError: ``comm`` takes GPU arrays and the parameters are host arrays.
        """
        self._adopt(self._bind(comm, _REBINDING))

    def _adopt(self, table: np.ndarray) -> None:
        """With every rank's (role, syncs, steps, interrupted): take the newest state (a
        shrink), complete an interrupted sync, or hand the state to the newcomers (a grow)."""
        comm, kind = self.comm, type(self).__name__
        members = np.flatnonzero(table[:, 0] == _REBINDING)
        newcomers = np.flatnonzero(table[:, 0] == _JOINING)
        newest = int(table[members, 1].max())
        source = int(members[np.argmax(table[members, 1])])
        if newcomers.size:
            interrupted = members[table[members, 3].astype(bool)]
            if interrupted.size:
                raise ValueError(f"{kind}.rebind: ranks {interrupted.tolist()} were interrupted "
                                 f"in a sync and ranks {newcomers.tolist()} join: rebind() to "
                                 f"the communicator shrink() gave first, then grow()")
            if (table[members, 1:3] != table[source, 1:3]).any():
                raise ValueError(f"{kind}.rebind: the members are at different points (syncs "
                                 f"{table[members, 1].tolist()}, steps "
                                 f"{table[members, 2].tolist()} on ranks {members.tolist()}); "
                                 f"call grow() and rebind() at the same step on every member")
            self._welcome(source, members.size, int(table[source, 2]),
                          newcomer=comm.rank in newcomers)
            self.syncs, self.steps = newest, int(table[source, 2])
            self._pending = False
            return
        if (table[:, 1] != newest).any():       # some completed the sync: take their state
            arrays = list(self.params) + list(self.anchor or [])
            if self._outer is not None and self._outer.momentum:
                arrays += self._velocity()
            broadcast_parameters(comm, arrays, root=source)
            self.syncs, self.steps = newest, int(table[source, 2])
            self._pending = False
            return
        pending = table[:, 3].astype(bool)
        if pending.any() and not pending.all():
            raise ValueError(f"{kind}.rebind: ranks {np.flatnonzero(pending)} "
                             f"were interrupted in sync {newest + 1} and ranks "
                             f"{np.flatnonzero(~pending)} were not; every survivor must call "
                             f"rebind() from the same failed step")
        if self._pending:                        # nobody completed it: redo it here
            self.step()

    def _welcome(self, source: int, members: int, steps: int, newcomer: bool) -> None:
        """Send the newcomers ``source``'s anchor and outer momentum; their parameters become
        the anchor, or without one (LocalSGD without compression) the members' parameters:
        at a sync (``steps`` a multiple of ``sync_every``) ``source``'s, which are every
        member's, between two the members' average, what a sync now would give them."""
        if self.anchor is not None:
            arrays = list(self.anchor)
            if self._outer is not None and self._outer.momentum:
                arrays += self._velocity()
            broadcast_parameters(self.comm, arrays, root=source)
            if newcomer:
                for param, anchor in zip(self.params, self.anchor):
                    param[...] = anchor
        elif steps % self.sync_every == 0:
            broadcast_parameters(self.comm, self.params, root=source)
        else:                                 # the newcomers add zeros to the members' sum
            buffers = []
            for param in self.params:
                with _device_of(param):
                    buffers.append(self.xp.zeros_like(param) if newcomer else param.copy())
            self._bucketer.reduce(buffers)    # the average over every rank of comm
            if newcomer:
                for param, average in zip(self.params, buffers):
                    param[...] = average * (self.comm.size / members)

    def _velocity(self) -> List[Any]:
        """The outer momentum of every parameter (zeros before the first sync)."""
        outer = self._outer
        for index, anchor in enumerate(self.anchor):
            slot = outer._slot(index)
            if "velocity" not in slot:
                with _device_of(anchor):
                    slot["velocity"] = self.xp.zeros_like(anchor)
        return [outer.state[i]["velocity"] for i in range(len(self.anchor))]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """What this object holds, as NumPy arrays in the parameters' shapes: the anchor (the
        parameters at the last sync; DiLoCo, or LocalSGD with compression), the outer
        optimizer's settings and momentum (DiLoCo), and the counters. The same on every rank
        after a sync; no communication. Save the parameters and the inner optimizer beside it
        (after a sync, one rank's parameters are every rank's).
        """
        state: Dict[str, Any] = {
            "format": FORMAT, "kind": type(self).__name__, "sync_every": self.sync_every,
            "shapes": [list(s) for s in self.shapes], "dtypes": [d.name for d in self.dtypes],
            "steps": int(self.steps), "syncs": int(self.syncs),
            "anchor": None if self.anchor is None else [to_host(a).copy() for a in self.anchor]}
        if self._outer is not None:
            velocity = [slot["velocity"] for slot in self._outer.state if "velocity" in slot]
            state["outer"] = {"name": self._outer.name, "settings": self._outer.settings(),
                              "velocity": [to_host(v).copy() for v in velocity]
                              if len(velocity) == len(self.shapes) else None}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take a :meth:`state_dict` (every rank passes the same). Everything is checked
        before anything changes, and the ranks agree: a collective.

        Raises:
            ValueError, TypeError: the state does not fit this object (kind, shapes, dtypes,
                sync_every), or ranks passed different states; the same type on every rank.
        """
        error, fingerprint = None, None
        try:
            fingerprint = self._check_state(state)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            error = exc
        agree(self.comm, "load_state_dict", error, fingerprint)
        if self.anchor is not None:
            for target, values in zip(self.anchor, state["anchor"]):
                target[...] = self.xp.asarray(np.asarray(values, dtype=target.dtype))
        if self._outer is not None:
            saved = state["outer"]
            self._outer.load_settings(saved["settings"])
            self._outer.state = []
            if saved["velocity"] is not None and self._outer.momentum:
                for target, values in zip(self._velocity(), saved["velocity"]):
                    target[...] = self.xp.asarray(np.asarray(values, dtype=target.dtype))
        self.steps, self.syncs, self._pending = int(state["steps"]), int(state["syncs"]), False

    def _check_state(self, state: Any) -> list:
        """Raise when ``state`` does not fit; return its fingerprint (for the ranks to agree)."""
        kind = type(self).__name__
        if not isinstance(state, dict):
            raise TypeError(f"state must be the dict state_dict() returned, got "
                            f"{type(state).__name__}")
        if state.get("format") != FORMAT:
            raise ValueError(f"not a LocalSGD / DiLoCo state (format {state.get('format')!r}, "
                             f"expected {FORMAT!r})")
        if state["kind"] != kind:
            raise ValueError(f"the state is a {state['kind']}'s; this is a {kind}")
        if int(state["sync_every"]) != self.sync_every:
            raise ValueError(f"the state was saved with sync_every={state['sync_every']}; this "
                             f"{kind} has sync_every={self.sync_every}")
        shapes = [tuple(int(d) for d in s) for s in state["shapes"]]
        if shapes != self.shapes:
            raise ValueError(f"the state holds parameters of shapes {shapes}; this {kind}'s "
                             f"are {self.shapes}")
        if list(state["dtypes"]) != [d.name for d in self.dtypes]:
            raise TypeError(f"the state holds parameters of dtypes {list(state['dtypes'])}; "
                            f"this {kind}'s are {[d.name for d in self.dtypes]}")
        if (state["anchor"] is None) != (self.anchor is None):
            raise ValueError(f"the state {'has no' if state['anchor'] is None else 'has an'} "
                             f"anchor and this {kind} {'keeps' if self.anchor else 'keeps no'} "
                             f"one (LocalSGD keeps one only with compression)")
        arrays = {"anchor": state["anchor"] or []}
        if self._outer is not None:
            saved = state["outer"]
            if saved["name"] != self._outer.name:
                raise ValueError(f"the state's outer optimizer is {saved['name']!r}, this "
                                 f"{kind}'s {self._outer.name!r}")
            type(self._outer)(**saved["settings"])          # checked as the constructor does
            arrays["velocity"] = saved["velocity"] or []
        for key, values in arrays.items():
            if values and [tuple(np.shape(v)) for v in values] != self.shapes:
                raise ValueError(f"the state's {key} arrays have shapes "
                                 f"{[tuple(np.shape(v)) for v in values]}, expected {self.shapes}")
        crc = 0
        for values in arrays["anchor"]:
            crc = zlib.crc32(np.ascontiguousarray(np.asarray(values).reshape(-1)
                                                  [:_FINGERPRINT_ELEMENTS]).tobytes(), crc)
        return [int(state["steps"]), int(state["syncs"]), crc]


class LocalSGD(_Periodic):
    """Every ``sync_every`` steps, replace each replica's parameters by their average.

    Args:
        comm: the data-parallel communicator.
        params: the parameters (NumPy, CuPy or torch CPU; float16, bfloat16, float32,
            float64), equal on every rank at the start (``broadcast_parameters``); averaged in
            place.
        sync_every: H, the inner steps between averages (1: every step, as DDP with the
            average taken after the update).
        compression: None, "bf16" or "fp16": float32 values travel in that dtype. The change
            since the last sync travels then (the parameters at the last sync are kept).
        bucket_cap_bytes: bytes (on the wire) per all-reduce.
        joined: this rank came in through ``comm.grow()`` (``comm.to_world(comm.rank) in
            comm.joined``) and holds nothing; the members call :meth:`rebind` with ``comm``
            meanwhile and the first of them sends it the counters, so that its next sync is
            theirs, and the parameters: the anchor with compression, otherwise the members'
            (their average between two syncs). ``params`` need only the right shapes.

    Raises:
        ValueError: ``sync_every < 1``, bad compression, no parameters, a non-contiguous one,
            or ranks with other shapes, dtypes or settings (checked with small all-gathers,
            the ranks named); ``joined=True`` where no rank calls :meth:`rebind`, or not
            ``joined`` where some do. TypeError: a dtype that is not floating point, mixed
            array modules, host arrays with a GPU-only communicator, ``joined`` not a bool.

    Example (two ranks)::

        broadcast_parameters(comm, params)
        averager = LocalSGD(comm, params, sync_every=8)
        for batch in batches:
            optimizer_step(params, grads_of(params, batch))   # local, no communication
            averager.step()                  # every 8th call: params = their mean over ranks
    """

    def __init__(self, comm, params: Sequence[Any], *, sync_every: int,
                 compression: Optional[str] = None, bucket_cap_bytes: int = 25 * MiB,
                 joined: bool = False):
        super().__init__(comm, params, sync_every, compression, bucket_cap_bytes,
                         keep_anchor=_COMPRESSION.get(compression) is not None, joined=joined)

    def _sync(self) -> None:
        if self.anchor is None:
            self._bucketer.reduce(self.params)       # the parameters, averaged in place
            return
        for anchor, param, delta in zip(self.anchor, self.params, self._average_deltas()):
            anchor -= delta                          # anchor - mean(anchor - p) = mean(p)
            param[...] = anchor


class DiLoCo(_Periodic):
    """DiLoCo: every ``sync_every`` inner steps, an outer optimizer step on the average of
    the replicas' pseudo-gradients ``anchor - params``; every replica then continues from the
    new anchor.

    The outer step is SGD with Nesterov momentum on the anchor (``v = m v + d;
    anchor -= lr (d + m v)``, torch's ``SGD(nesterov=True)``); the anchor and momentum are
    kept in the parameters' dtype and device, the same on every rank.

    Args:
        comm: the data-parallel communicator.
        params: as for :class:`LocalSGD`; equal on every rank at the start.
        sync_every: H, inner steps between outer steps (the paper: hundreds).
        outer_lr: the outer learning rate (the paper's 0.7; 1.0 with momentum 0 is LocalSGD).
        outer_momentum: Nesterov momentum in [0, 1) (the paper's 0.9; 0: plain SGD).
        compression: None, "bf16" or "fp16": float32 pseudo-gradients travel in that dtype.
        bucket_cap_bytes: bytes (on the wire) per all-reduce.
        joined: this rank came in through ``comm.grow()`` and holds nothing (as for
            :class:`LocalSGD`): a member sends it the anchor, which its parameters become,
            the outer momentum and the counters.

    Raises:
        ValueError, TypeError: as :class:`LocalSGD`; ``outer_lr <= 0`` or ``outer_momentum``
            outside [0, 1), or other ranks with another ``outer_lr`` or ``outer_momentum``.

    Example (two ranks)::

        broadcast_parameters(comm, params)
        diloco = DiLoCo(comm, params, sync_every=50, outer_lr=0.7, outer_momentum=0.9)
        for batch in batches:
            inner_optimizer_step(params, grads_of(params, batch))   # local
            diloco.step()                    # every 50th call: outer step, params = anchor
    """

    def __init__(self, comm, params: Sequence[Any], *, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, compression: Optional[str] = None,
                 bucket_cap_bytes: int = 25 * MiB, joined: bool = False):
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float, np.number)) \
                or not outer_lr > 0:
            raise ValueError(f"outer_lr must be a number > 0, got {outer_lr!r}")
        if isinstance(outer_momentum, bool) or \
                not isinstance(outer_momentum, (int, float, np.number)) \
                or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        self._outer = SGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        super().__init__(comm, params, sync_every, compression, bucket_cap_bytes,
                         keep_anchor=True, joined=joined)

    @property
    def outer_optimizer(self) -> SGD:
        """The outer SGD (``lr``, ``momentum``; its ``state`` holds the momentum)."""
        return self._outer

    def _sync(self) -> None:
        deltas = self._average_deltas()
        for index, (anchor, param, delta) in enumerate(zip(self.anchor, self.params, deltas)):
            self._outer.update(index, anchor, delta)
            param[...] = anchor
