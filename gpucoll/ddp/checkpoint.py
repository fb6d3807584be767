"""Checkpoints of sharded training state that load at any world size.

``ShardedOptimizer`` (ZeRO-1) and ``FullyShardedParameters`` (FSDP) keep each rank's slice of
a flat, padded parameter space whose cut depends on the world size, the bucket caps and the
alignment. A checkpoint records none of that. It holds every parameter's values and its
optimizer state in the parameter's own shape (momentum, Adam's moments and step), the
optimizer's settings and the step counters, so it loads at any world size, with any caps,
into either class, and training goes on exactly where it stopped.

Two forms of the same content:

* ``state_dict()`` / ``load_state_dict()``: a dict of NumPy arrays, gathered to every rank or
  to one (torch's full state dict); keep it with ``np.savez``, pickle or anything else.
* ``save_checkpoint()`` / ``load_checkpoint()`` (:mod:`.checkpoint_files`): each rank writes
  only its slices and reads only the elements it will own (torch's distributed checkpoint).

Loading checks everything before it changes anything, and the ranks agree on the outcome:
when one rank cannot load, every rank raises an error of the same type and no rank's state
has changed. Ranks that pass different checkpoints are named.

Hybrid sharding (an object with a ``replicate_comm``): each replica holds the whole state, so
a checkpoint is that of one replica: replicate rank 0's shard group writes the files (the
others write nothing) and gathers a ``state_dict(root=...)``; every replica loads its slices
itself. The ranks of both communicators agree on every outcome.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from ..errors import GpucollError
from ..hostarrays import array_module
from .optim import make_optimizer

__all__ = ["FORMAT", "CheckpointError", "Group", "CheckpointView", "gather_state", "load_state",
           "plan_load", "apply_plan", "agree"]

FORMAT = "gpucoll.ddp.checkpoint/1"
PARAM = "param"          # the key of the parameters' values beside the optimizer's keys
_FINGERPRINT_ELEMENTS = 1024


class CheckpointError(GpucollError):
    """Another rank could not save or load a checkpoint (its error is quoted)."""


class Group(NamedTuple):
    """One bucket (ZeRO-1) or unit (FSDP) of the flat space, cut into equal rank slices."""
    members: List[int]   # indices of its parameters (in the object's flat parameter order)
    offsets: List[int]   # each member's first element in the group's flat space
    chunk: int           # elements each rank owns


class CheckpointView:
    """What a checkpoint reads and writes of a sharded-training object (its ``owner``)."""

    def __init__(self, owner: Any, shapes: Sequence[tuple], groups: Sequence[Group],
                 param_slices: Sequence[Any], replicated: Optional[Sequence[Any]] = None,
                 busy: Optional[str] = None):
        self.owner, self.comm, self.optimizer = owner, owner.comm, owner.optimizer
        replicate = getattr(owner, "replicate_comm", None)
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.dtype, self.xp = np.dtype(owner.dtype), owner.xp
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.groups = list(groups)
        self.param_slices = list(param_slices)   # this rank's slice of each group
        self.replicated = replicated              # ZeRO-1: the caller's full parameters
        self.busy = busy                          # why a checkpoint cannot be taken now


class Plan(NamedTuple):
    """Everything a load writes, read and checked before anything is written."""
    slices: Dict[str, List[np.ndarray]]     # key -> this rank's slice of each group
    scalars: Dict[str, List[Any]]           # scalar key -> its value for each group
    full: Optional[List[np.ndarray]]        # every parameter whole (replicated objects)
    settings: Dict[str, Any]
    steps: int
    skipped_steps: int
    fingerprint: list


# ---------------------------------------------------------------- the ranks agree
def agree(comm, what: str, error: Optional[BaseException], fingerprint: Any = None,
          replicate: Any = None) -> None:
    """Exchange each rank's outcome; raise on every rank when any rank failed.

    The failing rank raises its own error; the others raise one of the same type (OSError,
    ValueError, TypeError and their kin; CheckpointError otherwise) quoting it, so code that
    catches e.g. FileNotFoundError takes the same branch on every rank. Fingerprints that
    differ raise ValueError naming the ranks. With a ``replicate`` communicator, the outcome
    over ``comm`` is then exchanged over it the same way (nothing raises before both), so the
    ranks of every shard group of the job agree.
    """
    error = _outcome(comm, "rank", what, error, fingerprint)
    if replicate is not None and replicate.size > 1:
        error = _outcome(replicate, "replicate rank", what, error, fingerprint)
    if error is not None:
        raise error


def _outcome(comm, who: str, what: str, error: Optional[BaseException],
             fingerprint: Any) -> Optional[BaseException]:
    """The error every rank of ``comm`` raises (``error`` itself on its rank), or None."""
    report = None if error is None else [type(error).__name__, str(error)]
    table = comm.all_gather_object([report, fingerprint])
    if error is not None:
        return error
    for rank, (other, _) in enumerate(table):
        if other is not None:
            return _kind(other[0])(f"{what} failed on {who} {rank}: {other[0]}: {other[1]}")
    for rank, (_, theirs) in enumerate(table):
        if theirs != fingerprint:
            return ValueError(f"{what}: {who} {comm.rank} and {who} {rank} were given different "
                              f"checkpoints (step {fingerprint[0]} vs {theirs[0]}); every rank "
                              f"must load the same one")
    return None


_KINDS = {k.__name__: k for k in (FileNotFoundError, FileExistsError, PermissionError,
                                  IsADirectoryError, NotADirectoryError, OSError, ValueError,
                                  TypeError, KeyError)}


def _kind(name: str) -> type:
    return _KINDS.get(name, CheckpointError)


# ---------------------------------------------------------------- arrays
def to_host(x: Any) -> np.ndarray:
    """A NumPy array of ``x`` (CuPy arrays are copied to the host)."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def _like(host: np.ndarray, like: Any) -> Any:
    """A copy of ``host`` in the array module, dtype and device of ``like``."""
    if isinstance(like, np.ndarray):
        return np.array(host, dtype=like.dtype)
    with like.device:
        return array_module(like).asarray(np.ascontiguousarray(host, dtype=like.dtype))


def _check_idle(view: CheckpointView) -> None:
    if view.busy:
        raise ValueError(f"{type(view.owner).__name__}: a checkpoint is taken or loaded between "
                         f"steps; {view.busy}")


def _has_state(view: CheckpointView) -> bool:
    """Whether the optimizer holds state for every group (False before its first step)."""
    arrays, scalars = view.optimizer.state_keys()
    keys = arrays + scalars
    slots = view.optimizer.state
    held = [all(k in slot for k in keys) for slot in slots[:len(view.groups)]]
    if keys and len(slots) == len(view.groups) and all(held):
        return True
    if any(slot for slot in slots):
        raise ValueError(f"the optimizer holds state for only some of the {len(view.groups)} "
                         f"groups; it cannot be checkpointed")
    return False


# ---------------------------------------------------------------- the full state dict
def gather_state(view: CheckpointView, root: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Every parameter and its optimizer state, whole, as NumPy arrays (a collective).

    ``root=None`` gives the dict to every rank (all-gathers); ``root=r`` only to rank ``r``
    (gathers; the others get None). With a replicate communicator each shard group gathers
    its own copy for ``root=None``; for ``root=r`` only rank ``r`` of replicate rank 0's
    shard group gets one (the other replicas send nothing).
    """
    comm = view.comm
    if root is not None and not (isinstance(root, (int, np.integer)) and 0 <= root < comm.size):
        raise ValueError(f"root must be a rank in [0, {comm.size}) or None, got {root!r}")
    _check_idle(view)
    if root is not None and view.replicate is not None and view.replicate.rank != 0:
        return None
    optimizer = view.optimizer
    arrays, scalar_keys = optimizer.state_keys()
    has_state = _has_state(view)
    keys = [PARAM] + (list(arrays) if has_state else [])
    whole: Dict[str, List[Any]] = {key: [None] * len(view.shapes) for key in keys}
    for number, group in enumerate(view.groups):
        for key in keys:
            mine = view.param_slices[number] if key == PARAM else optimizer.state[number][key]
            flat = _gathered(comm, mine, group.chunk, root)
            if flat is None:
                continue
            for member, offset in zip(group.members, group.offsets):
                size = view.sizes[member]
                whole[key][member] = flat[offset:offset + size].reshape(view.shapes[member]).copy()
    if root is not None and comm.rank != root:
        return None
    group_of = {m: number for number, group in enumerate(view.groups) for m in group.members}
    scalars = {key: [optimizer.state[group_of[p]][key] for p in range(len(view.shapes))]
               for key in (scalar_keys if has_state else ())}
    return {"format": FORMAT, "dtype": view.dtype.name,
            "shapes": [list(s) for s in view.shapes], "params": whole[PARAM],
            "optimizer": {"name": optimizer.name, "settings": optimizer.settings(),
                          "state": {k: whole[k] for k in keys if k != PARAM},
                          "scalars": scalars},
            "steps": int(view.owner.steps), "skipped_steps": int(view.owner.skipped_steps)}


def _gathered(comm, mine: Any, chunk: int, root: Optional[int]) -> Optional[np.ndarray]:
    """Every rank's slice, end to end, on the host (None on non-roots when gathering)."""
    if root is None:
        return to_host(comm.all_gather(mine)).reshape(-1)
    out = comm.gather(mine, root)
    return None if out is None else to_host(out).reshape(-1)


def load_state(view: CheckpointView, state: Any) -> None:
    """Take this rank's slices of a full state dict (every rank passes the same dict)."""
    plan, error = None, None
    try:
        _check_idle(view)
        if not isinstance(state, dict):
            raise TypeError(f"state must be the dict state_dict() returned, got "
                            f"{type(state).__name__}")
        missing = [k for k in ("format", "dtype", "shapes", "params", "optimizer", "steps",
                               "skipped_steps") if k not in state]
        if missing:
            raise ValueError(f"state has no {', '.join(missing)}: it is not a state_dict() of "
                             f"a sharded optimizer")
        header = dict(state, optimizer={k: v for k, v in state["optimizer"].items()
                                        if k != "state"},
                      keys=[PARAM] + sorted(state["optimizer"].get("state", {})))
        stored = {PARAM: state["params"], **state["optimizer"].get("state", {})}
        _check_arrays(view, stored)
        plan = plan_load(view, header, lambda key, p, a, b: _flat(stored[key][p])[a:b])
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        error = exc
    agree(view.comm, "load_state_dict", error, None if plan is None else plan.fingerprint,
          view.replicate)
    apply_plan(view, plan)


def _flat(x: Any) -> np.ndarray:
    return np.asarray(x).reshape(-1)


def _check_arrays(view: CheckpointView, stored: Dict[str, Any]) -> None:
    for key, arrays in stored.items():
        if len(arrays) != len(view.shapes):
            raise ValueError(f"state holds {len(arrays)} arrays of {key!r}, expected "
                             f"{len(view.shapes)} (one per parameter)")
        for index, (array, shape) in enumerate(zip(arrays, view.shapes)):
            if tuple(np.shape(array)) != shape:
                raise ValueError(f"{key!r} of parameter {index} has shape "
                                 f"{tuple(np.shape(array))} in the state, expected {shape}")


# ---------------------------------------------------------------- checking and loading
def plan_load(view: CheckpointView, header: Dict[str, Any],
              read: Callable[[str, int, int, int], np.ndarray]) -> Plan:
    """Check a checkpoint's header against ``view`` and read this rank's slices.

    ``header`` holds format, dtype, shapes, optimizer (name, settings, scalars), keys (the
    array keys present, "param" first), steps, skipped_steps, and optionally an id.
    ``read(key, parameter, start, stop)`` returns flat elements of one stored array.
    """
    owner = type(view.owner).__name__
    if header.get("format") != FORMAT:
        raise ValueError(f"not a gpucoll sharded-training checkpoint (format "
                         f"{header.get('format')!r}, expected {FORMAT!r})")
    if header["dtype"] != view.dtype.name:
        raise TypeError(f"the checkpoint holds {header['dtype']} parameters; this {owner} "
                        f"holds {view.dtype.name}")
    shapes = [tuple(int(d) for d in s) for s in header["shapes"]]
    if len(shapes) != len(view.shapes):
        raise ValueError(f"the checkpoint holds {len(shapes)} parameters; this {owner} holds "
                         f"{len(view.shapes)}")
    for index, (theirs, ours) in enumerate(zip(shapes, view.shapes)):
        if theirs != ours:
            raise ValueError(f"parameter {index} has shape {theirs} in the checkpoint and "
                             f"{ours} in this {owner}")
    saved = header["optimizer"]
    if saved["name"] != view.optimizer.name:
        raise ValueError(f"the checkpoint was saved with optimizer {saved['name']!r}; this "
                         f"{owner} uses {view.optimizer.name!r}")
    settings = dict(saved["settings"])
    arrays, scalar_keys = make_optimizer(saved["name"], **settings).state_keys()
    keys = list(header["keys"])
    has_state = keys != [PARAM]
    if has_state and (sorted(keys[1:]) != sorted(arrays)
                      or sorted(saved.get("scalars", {})) != sorted(scalar_keys)):
        raise ValueError(f"the checkpoint's optimizer state holds {keys[1:]} and "
                         f"{sorted(saved.get('scalars', {}))}; {saved['name']} with its "
                         f"settings keeps {list(arrays)} and {list(scalar_keys)}")
    rank = view.comm.rank
    slices: Dict[str, List[np.ndarray]] = {key: [] for key in keys}
    for group in view.groups:
        lo, hi = rank * group.chunk, (rank + 1) * group.chunk
        for key in keys:
            buffer = np.zeros(group.chunk, dtype=view.dtype)     # padding stays 0
            for member, offset in zip(group.members, group.offsets):
                a, b = max(lo, offset), min(hi, offset + view.sizes[member])
                if a < b:
                    buffer[a - lo:b - lo] = read(key, member, a - offset, b - offset)
            slices[key].append(buffer)
    scalars: Dict[str, List[Any]] = {}
    for key in (scalar_keys if has_state else ()):
        values = saved["scalars"][key]
        scalars[key] = []
        for number, group in enumerate(view.groups):
            mine = {values[m] for m in group.members}
            if len(mine) != 1:
                raise ValueError(f"the checkpoint's {key!r} differs between parameters "
                                 f"{group.members} ({sorted(mine)}), which one group of this "
                                 f"{owner} updates together")
            scalars[key].append(mine.pop())
    full = None
    if view.replicated is not None:
        full = [np.asarray(read(PARAM, p, 0, size), dtype=view.dtype).reshape(shape)
                for p, (size, shape) in enumerate(zip(view.sizes, view.shapes))]
    fingerprint = [int(header["steps"]), int(header["skipped_steps"]), header.get("id"),
                   _checksum(view, read)]
    return Plan(slices, scalars, full, settings, int(header["steps"]),
                int(header["skipped_steps"]), fingerprint)


def _checksum(view: CheckpointView, read) -> int:
    """A CRC of the first elements of every parameter: ranks reading different checkpoints
    (of the same step) differ here."""
    crc = 0
    for p, size in enumerate(view.sizes):
        head = np.ascontiguousarray(read(PARAM, p, 0, min(size, _FINGERPRINT_ELEMENTS)),
                                    dtype=view.dtype)
        crc = zlib.crc32(head.tobytes(), crc)
    return crc


def apply_plan(view: CheckpointView, plan: Plan) -> None:
    """Write a checked plan into the object: slices, optimizer state and settings, the
    caller's full parameters (ZeRO-1), the step counters."""
    view.owner._release_for_load()
    for target, values in zip(view.param_slices, plan.slices[PARAM]):
        target[...] = _like(values, target)
    optimizer = view.optimizer
    optimizer.load_settings(plan.settings)
    state = []
    if len(plan.slices) > 1:
        for number, like in enumerate(view.param_slices):
            slot = {key: _like(plan.slices[key][number], like)
                    for key in plan.slices if key != PARAM}
            slot.update({key: values[number] for key, values in plan.scalars.items()})
            state.append(slot)
    optimizer.state = state
    if plan.full is not None:
        for target, values in zip(view.replicated, plan.full):
            target[...] = _like(values, target)
    view.owner.steps, view.owner.skipped_steps = plan.steps, plan.skipped_steps
