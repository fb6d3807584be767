"""The checkpoint methods that ``ShardedOptimizer`` and ``FullyShardedParameters`` share:
the full state dict (:mod:`.checkpoint`) and sharded files (:mod:`.checkpoint_files`)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from .checkpoint import gather_state, load_state
from .checkpoint_files import load, save

__all__ = ["Checkpointable"]


class Checkpointable:
    """The checkpoint methods of ``ShardedOptimizer`` and ``FullyShardedParameters``; each
    provides ``_checkpoint_view()`` and ``_release_for_load()``."""

    def state_dict(self, root: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """Every parameter and its optimizer state, whole, as NumPy arrays in the
        parameters' shapes, with the optimizer's settings and the step counters: a
        checkpoint that loads at any world size. A collective: every rank calls it.

        Args:
            root: None gives the dict to every rank; a rank number gives it to that rank
                only (the others return None), holding one copy in all. With hybrid
                sharding it is a rank of ``comm`` in the shard group of replicate rank 0.
        """
        return gather_state(self._checkpoint_view(), root)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take this rank's part of ``state`` (from :meth:`state_dict`, at any world size;
        every rank passes the same). The optimizer's settings are restored too. A
        collective; nothing changes on any rank when one rank's check fails.

        Raises:
            ValueError, TypeError: the state does not fit (shapes, dtype, optimizer), or
                ranks passed different states; the same type on every rank.
        """
        load_state(self._checkpoint_view(), state)

    def save_checkpoint(self, directory: str, *, extra: Any = None,
                        async_write: bool = False) -> Any:
        """Write this rank's slices to ``directory`` (shared by every rank); see
        :func:`gpucoll.ddp.checkpoint_files.save`. Returns the metadata file's path, or with
        ``async_write=True`` a ``PendingCheckpoint`` at once (training goes on while the
        files are written; its ``wait()``, on every rank, completes the checkpoint). With
        hybrid sharding only the shard group of replicate rank 0 writes; every rank calls it."""
        self._no_pending_save("save_checkpoint")
        result = save(self._checkpoint_view(), directory, extra, async_write)
        if async_write:
            self._pending_save = result
        return result

    def load_checkpoint(self, directory: str) -> Any:
        """Read the elements this rank owns from a checkpoint directory saved at any world
        size; see :func:`gpucoll.ddp.checkpoint_files.load`. Returns the saved ``extra``."""
        self._no_pending_save("load_checkpoint")
        return load(self._checkpoint_view(), directory)

    def _no_pending_save(self, what: str) -> None:
        """A save still writing must be waited for first (every rank has one, or none)."""
        pending = getattr(self, "_pending_save", None)
        if pending is not None and pending._result is None:
            raise ValueError(f"{what}: the previous save_checkpoint(async_write=True) has not "
                             f"been waited for; call its wait() on every rank first")
        self._pending_save = None
