"""Sharded checkpoints on disk: each rank writes its own slices, loads read only what they own.

A checkpoint is a directory on a file system every rank sees:

* ``<key>-rank<r>-of-<n>.npy``: rank ``r``'s slices of every group, end to end, for each key
  (``param``, then the optimizer's arrays: ``velocity``, or Adam's ``m`` and ``v``). A rank
  holds 1 / n of the state, and writes no more.
* ``metadata.json``: the layout of the run that saved it (each group's parameters, their
  offsets, the slice length), the parameters' shapes and dtype, the optimizer's name,
  settings and scalars (Adam's step), the step counters, the caller's ``extra`` and an id.
  Rank 0 writes it last, after every rank's files are in place and it has found them all:
  a directory without it holds no complete checkpoint (a save that died, or none yet).

Loading maps each element this rank will own, under the *current* layout, to the file and
position that hold it under the saved one, and reads it through a memory map: a run of any
world size, bucket caps or class (ZeRO-1 or FSDP) reads its 1 / n. Saving into a directory
that holds a checkpoint first removes its metadata, so a save that dies leaves no checkpoint
that looks complete; keep one directory per step to always have one to go back to.

With hybrid sharding only replicate rank 0's shard group writes (files named by its shard
ranks: the checkpoint of one replica, loadable like any other); the other replicas write
nothing and learn the outcome, so every rank returns, or raises, alike.
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from typing import Any, Dict, List, Optional

import numpy as np

from .checkpoint import (FORMAT, PARAM, CheckpointError, CheckpointView, Group, _check_idle,
                         _has_state, agree, apply_plan, plan_load, to_host)

__all__ = ["METADATA", "PendingCheckpoint", "save", "load", "checkpoint_exists"]

METADATA = "metadata.json"
_SHARD_FILE = re.compile(r"^[A-Za-z0-9_]+-rank\d+-of-\d+\.npy$")


def checkpoint_exists(directory: str) -> bool:
    """Whether ``directory`` holds a complete checkpoint (its metadata was written)."""
    return os.path.isfile(os.path.join(os.fspath(directory), METADATA))


def _file_name(key: str, rank: int, size: int) -> str:
    return f"{key}-rank{rank:05d}-of-{size:05d}.npy"


def save(view: CheckpointView, directory: str, extra: Any = None,
         async_write: bool = False) -> Any:
    """Write this rank's slices and (rank 0) the metadata; a collective.

    Args:
        view: the object's checkpoint view.
        directory: created if missing; the same path on a file system every rank sees.
        extra: JSON-compatible values saved beside the state (epoch, data position, the
            loss scaler's ``state_dict()``...); :func:`load` returns them.
        async_write: copy this rank's slices to host memory, write them in a background
            thread and return a :class:`PendingCheckpoint` at once; training goes on while
            the files are written, and its ``wait()`` (a collective) completes the
            checkpoint. The copy holds this rank's share of the state until then.

    Returns:
        The metadata file's path (with ``async_write``: a PendingCheckpoint).

    Raises:
        TypeError: ``extra`` is not JSON-compatible (on every rank, before anything is
            written); ValueError: a step is in progress; OSError: a rank could not write,
            or rank 0 could not find every rank's files (the directory is not shared).
            Every rank raises an error of the same type (with ``async_write``, write errors
            come from ``wait()``).
    """
    replicate = view.replicate
    if replicate is None:
        return _save(view, directory, extra, async_write)
    result, error = None, None
    if replicate.rank == 0:      # one replica writes; the others only hear how it went
        try:
            result = _save(view, directory, extra, async_write)
        except (OSError, TypeError, ValueError, KeyError, CheckpointError) as exc:
            error = exc
    agree(replicate, "save_checkpoint", error)
    if not async_write:
        return os.path.join(os.fspath(directory), METADATA)
    if result is None:
        result = PendingCheckpoint(view.comm, os.fspath(directory), None, writes=False)
    result.replicate = replicate    # its wait() shares the writers' outcome
    return result


def _save(view: CheckpointView, directory: str, extra: Any, async_write: bool) -> Any:
    """:func:`save` over the shard communicator: its ranks write."""
    comm = view.comm
    error, header = None, None
    try:
        directory = os.fspath(directory)
        _check_idle(view)
        header = _header(view, extra)
    except (TypeError, ValueError) as exc:
        error = exc
    agree(comm, "save_checkpoint", error)
    metadata = os.path.join(directory, METADATA)
    if comm.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            if os.path.exists(metadata):
                os.remove(metadata)     # from here on the directory holds no checkpoint
        except OSError as exc:
            error = exc
    agree(comm, "save_checkpoint", error)
    paths = {key: os.path.join(directory, _file_name(key, comm.rank, comm.size))
             for key in header["keys"]}
    pending = PendingCheckpoint(comm, directory, header)
    if async_write:
        snapshot = {key: _snapshot(view, key) for key in header["keys"]}   # before returning
        pending.start(lambda: _write_all(directory, paths, snapshot.pop))
        return pending
    pending.start(lambda: _write_all(directory, paths, lambda key: _snapshot(view, key)),
                  inline=True)
    return pending.wait()


def _write_all(directory: str, paths: Dict[str, str], take) -> None:
    os.makedirs(directory, exist_ok=True)
    for key, path in paths.items():
        _write_array(take(key), path)


class PendingCheckpoint:
    """A checkpoint whose files are being written (``save_checkpoint(async_write=True)``).

    Until :meth:`wait` has returned on every rank the directory holds no complete
    checkpoint (rank 0 writes the metadata in ``wait``), so a job that dies meanwhile leaves
    the previous checkpoint as the newest.
    """

    def __init__(self, comm, directory: str, header: Optional[Dict[str, Any]], *,
                 writes: bool = True):
        self.comm, self.directory, self.header = comm, directory, header
        self.writes = writes    # False on the replicas that do not write (hybrid sharding)
        self.replicate = None   # hybrid sharding: the writers' outcome is shared over it
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._result: Optional[str] = None

    def start(self, write, inline: bool = False) -> None:
        def run():
            try:
                write()
            except OSError as exc:
                self._error = exc
        if inline:
            run()
            return
        self._thread = threading.Thread(target=run, name="gpucoll-checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether this rank's files are written (``wait()`` still completes the checkpoint)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Wait for this rank's files, agree with the other ranks, and (rank 0) write the
        metadata; a collective. Returns the metadata file's path. Raises as
        ``save_checkpoint`` does, on every rank; a second call returns at once."""
        if self._result is not None:
            return self._result
        metadata = os.path.join(self.directory, METADATA)
        if self.replicate is None:
            self._finish(metadata)
        else:
            error = None
            if self.writes:
                try:
                    self._finish(metadata)
                except (OSError, TypeError, ValueError, KeyError, CheckpointError) as exc:
                    error = exc
            agree(self.replicate, "save_checkpoint", error)
        self._result = metadata
        return metadata

    def _finish(self, metadata: str) -> None:
        """The writers' part of :meth:`wait`."""
        if self._thread is not None:
            self._thread.join()
        comm = self.comm
        agree(comm, "save_checkpoint", self._error)
        error = None
        if comm.rank == 0:
            try:
                _check_files(self.directory, self.header)
                text = json.dumps(self.header, indent=1).encode()
                _write_atomically(metadata, lambda f: f.write(text))
                _remove_stale(self.directory, self.header)
            except (OSError, ValueError) as exc:
                error = exc
        agree(comm, "save_checkpoint", error)


def _header(view: CheckpointView, extra: Any) -> Dict[str, Any]:
    """The metadata (every rank builds it; rank 0 writes it)."""
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"extra must be JSON-compatible (numbers, strings, lists, dicts): "
                        f"{exc}") from None
    optimizer = view.optimizer
    arrays, scalar_keys = optimizer.state_keys()
    has_state = _has_state(view)
    keys = [PARAM] + (list(arrays) if has_state else [])
    scalars: Dict[str, List[Any]] = {}
    for key in (scalar_keys if has_state else ()):
        values: List[Any] = [None] * len(view.shapes)
        for number, group in enumerate(view.groups):
            for member in group.members:
                values[member] = _plain(optimizer.state[number][key])
        scalars[key] = values
    size = view.comm.size
    return {"format": FORMAT, "id": uuid.uuid4().hex if view.comm.rank == 0 else None,
            "world_size": size, "dtype": view.dtype.name,
            "shapes": [list(s) for s in view.shapes],
            "groups": [{"members": list(g.members), "offsets": list(g.offsets),
                        "chunk": int(g.chunk)} for g in view.groups],
            "keys": keys,
            "files": {key: [_file_name(key, r, size) for r in range(size)] for key in keys},
            "optimizer": {"name": optimizer.name, "settings": optimizer.settings(),
                          "scalars": scalars},
            "steps": int(view.owner.steps), "skipped_steps": int(view.owner.skipped_steps),
            "extra": extra}


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _snapshot(view: CheckpointView, key: str) -> np.ndarray:
    """A host copy of this rank's slices of every group for ``key``, end to end."""
    parts = [to_host(view.param_slices[number] if key == PARAM
                     else view.optimizer.state[number][key]) for number in range(len(view.groups))]
    return np.concatenate(parts).astype(view.dtype, copy=False)


def _write_array(array: np.ndarray, path: str) -> None:
    """``array`` as a .npy file at ``path`` (see :func:`_write_atomically`)."""
    _write_atomically(path, lambda f: np.save(f, array))


def _write_atomically(path: str, write) -> None:
    """``write(file)`` into a file beside ``path``, fsynced, then renamed into place: a crash
    leaves the old file or the new one, never half of one."""
    temporary = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _check_files(directory: str, header: Dict[str, Any]) -> None:
    """Rank 0 finds every rank's files, of the right length (else the directory is not one
    file system shared by every rank)."""
    total = sum(group["chunk"] for group in header["groups"])
    for key, names in header["files"].items():
        for rank, name in enumerate(names):
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"rank {rank} wrote {name}, but rank 0 cannot find it in {directory}: "
                    f"every rank must save to one directory on a shared file system")
            shape = np.load(path, mmap_mode="r").shape
            if shape != (total,):
                raise ValueError(f"{name} holds {shape} elements, expected ({total},)")


def _remove_stale(directory: str, header: Dict[str, Any]) -> None:
    """Remove slice files of an earlier save into this directory that this one does not use."""
    used = {name for names in header["files"].values() for name in names}
    for name in os.listdir(directory):
        if _SHARD_FILE.match(name) and name not in used:
            os.remove(os.path.join(directory, name))


# ---------------------------------------------------------------- loading
def load(view: CheckpointView, directory: str) -> Any:
    """Read the elements this rank owns from a checkpoint saved at any world size; a
    collective. Returns the ``extra`` it was saved with.

    Raises:
        FileNotFoundError: no complete checkpoint in ``directory`` (no metadata), or a slice
            file is missing. ValueError, TypeError: it does not fit this object (shapes,
            dtype, optimizer), or ranks read different checkpoints. Every rank raises an
            error of the same type, and nothing has changed on any rank.
    """
    comm = view.comm
    plan, error, header = None, None, None
    try:
        directory = os.fspath(directory)
        _check_idle(view)
        header = _read_metadata(directory)
        reader = _SliceReader(directory, header)
        plan = plan_load(view, header, reader.read)
    except (OSError, TypeError, ValueError, KeyError) as exc:
        error = exc
    agree(comm, "load_checkpoint", error, None if plan is None else plan.fingerprint,
          view.replicate)
    apply_plan(view, plan)
    return header.get("extra")


def _read_metadata(directory: str) -> Dict[str, Any]:
    path = os.path.join(directory, METADATA)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no complete checkpoint in {directory}: {METADATA} is missing "
                                f"(a save that did not finish leaves none)")
    with open(path, "rb") as f:
        try:
            header = json.loads(f.read())
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise ValueError(f"{path} is not a gpucoll sharded-training checkpoint (format "
                         f"{found!r}, expected {FORMAT!r})")
    return header


class _SliceReader:
    """Flat elements of one stored parameter, from the saving run's slice files."""

    def __init__(self, directory: str, header: Dict[str, Any]):
        self.directory, self.files = directory, header["files"]
        self.world = int(header["world_size"])
        groups = [Group(list(g["members"]), list(g["offsets"]), int(g["chunk"]))
                  for g in header["groups"]]
        self.where: Dict[int, tuple] = {}   # parameter -> (group start in file, offset, chunk)
        start = 0
        sizes = [int(np.prod(s, dtype=np.int64)) for s in header["shapes"]]
        for group in groups:
            for member, offset in zip(group.members, group.offsets):
                if member in self.where or not 0 <= member < len(sizes) \
                        or offset + sizes[member] > group.chunk * self.world:
                    raise ValueError(f"{METADATA} in {directory} describes an impossible "
                                     f"layout (parameter {member}); the checkpoint is damaged")
                self.where[member] = (start, offset, group.chunk)
            start += group.chunk
        missing = sorted(set(range(len(sizes))) - set(self.where))
        if missing:
            raise ValueError(f"{METADATA} in {directory} places no data for parameters "
                             f"{missing}; the checkpoint is damaged")
        self.total = start
        self.dtype = np.dtype(header["dtype"])
        self._maps: Dict[tuple, np.ndarray] = {}

    def _map(self, key: str, rank: int) -> np.ndarray:
        if (key, rank) not in self._maps:
            name = self.files[key][rank]
            path = os.path.join(self.directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{name} is missing from the checkpoint in "
                                        f"{self.directory}")
            data = np.load(path, mmap_mode="r")
            if data.shape != (self.total,) or data.dtype != self.dtype:
                raise ValueError(f"{name} holds {data.dtype} {data.shape}, expected "
                                 f"{self.dtype} ({self.total},); the checkpoint is damaged")
            self._maps[(key, rank)] = data
        return self._maps[(key, rank)]

    def read(self, key: str, param: int, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of parameter ``param``'s flat ``key`` array."""
        base, offset, chunk = self.where[param]
        out = np.empty(stop - start, dtype=self.dtype)
        position, end = offset + start, offset + stop     # in the saved group's flat space
        while position < end:
            rank = position // chunk
            upto = min(end, (rank + 1) * chunk)
            source = self._map(key, rank)
            first = base + position - rank * chunk
            out[position - offset - start:upto - offset - start] = \
                source[first:first + upto - position]
            position = upto
        return out

