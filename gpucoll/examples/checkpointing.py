"""Step checkpoints for the examples: ``<root>/step-<N>`` directories of sharded state, the
newest complete one found by rank 0, older ones pruned.

A checkpoint holds the sharded optimizer's state (``save_checkpoint``) and, as its ``extra``,
where training is (epoch, position in the epoch's sample order, step) and the loss scaler's
state, so a run resumes from it at any number of ranks: at start (a restarted job), or after
a lost rank (the survivors shrink and go back to it).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Optional

from gpucoll.ddp import checkpoint_exists

__all__ = ["newest_checkpoint", "save_step", "resume"]

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _complete(root: str):
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and checkpoint_exists(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def newest_checkpoint(comm, root: str) -> Optional[str]:
    """The newest complete checkpoint under ``root`` (rank 0 looks; every rank gets its
    answer, so they agree even while the directory changes)."""
    path = None
    if comm.rank == 0:
        complete = _complete(root)
        path = complete[-1][1] if complete else None
    return comm.broadcast_object(path)


def save_step(optimizer, root: str, progress: Any, scaler: Any = None, keep: int = 2) -> str:
    """Save ``optimizer`` (a ShardedOptimizer or FullyShardedParameters) to
    ``root/step-<progress.step>`` with the progress and the scaler's state; rank 0 then removes
    every step directory but the newest ``keep`` complete ones."""
    path = os.path.join(root, f"step-{progress.step:08d}")
    optimizer.save_checkpoint(path, extra={
        "epoch": progress.epoch, "offset": progress.offset, "step": progress.step,
        "scaler": scaler.state_dict() if scaler is not None else None})
    if optimizer.comm.rank == 0:
        kept = {p for _, p in _complete(root)[-keep:]}
        for name in os.listdir(root):
            full = os.path.join(root, name)
            if _STEP_DIR.match(name) and full not in kept:
                shutil.rmtree(full, ignore_errors=True)
    return path


def resume(optimizer, root: str, progress: Any, scaler: Any = None) -> Optional[str]:
    """Load the newest complete checkpoint under ``root`` into ``optimizer`` (and the scaler),
    set ``progress`` from it, and return its path; None when there is none."""
    path = newest_checkpoint(optimizer.comm, root)
    if path is None:
        return None
    extra = optimizer.load_checkpoint(path)
    progress.epoch, progress.offset, progress.step = (extra["epoch"], extra["offset"],
                                                      extra["step"])
    if scaler is not None and extra.get("scaler") is not None:
        scaler.load_state_dict(extra["scaler"])
    return path
