"""Hybrid sharding (HSDP, ZeRO++'s hpZ): shard inside a group, replicate across groups.

A sharded-training object takes two communicators: the *shard* communicator, over which
parameters are all-gathered and gradients reduce-scattered (the ranks of one node, on fast
links), and the *replicate* communicator, the ranks that hold the same slice in the other
shard groups. After the reduce-scatter each rank all-reduces (sums) only its slice over the
replicate communicator, and the slice is divided by ``shard size x replicate size``: the
average over every rank, as plain data parallelism would give. Per step that is one
all-reduce of ``1 / shard size`` of the gradients across the slow links; gathers never cross
them. ``Mesh(comm, replicate=R, shard=S)`` gives both communicators.

This module holds the local checks of the replicate communicator and the step's all-reduce
of the reduced slices; the layout check is :func:`.layout.check_same_layout`.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["HybridSizes", "check_replicate_comm", "replicate_slice"]


class HybridSizes:
    """Mixin of the sharded classes (FSDP, ZeRO-1): their sizes with a replicate
    communicator. Needs ``comm`` (the shard group) and ``replicate_comm`` (or None)."""

    comm: Any
    replicate_comm: Any

    @property
    def replicas(self) -> int:
        """Shard groups holding the same shards (``replicate_comm.size``; 1 without)."""
        return 1 if self.replicate_comm is None else self.replicate_comm.size

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients each step averages: ``comm.size x replicas``."""
        return self.comm.size * self.replicas


def check_replicate_comm(who: str, comm, replicate: Any) -> Optional[Any]:
    """``replicate`` checked against the shard communicator ``comm``, before anything is sent.

    Returns:
        ``replicate`` (None stays None).

    Raises:
        TypeError: ``replicate`` is not a communicator.
        ValueError: it is ``comm`` itself, it holds its arrays in another memory than ``comm``
            ("host" / "cuda"), or the two share world ranks other than this rank's (a rank
            must not be both in this rank's shard group and among its replicas).
    """
    if replicate is None:
        return None
    if not all(hasattr(replicate, name) for name in ("rank", "size", "all_reduce")):
        raise TypeError(f"{who}: replicate_comm must be a gpucoll Communicator (or None), got "
                        f"{type(replicate).__name__}")
    if replicate is comm:
        raise ValueError(f"{who}: replicate_comm is the shard communicator itself; pass the "
                         f"communicator of the ranks holding the same shard in the other "
                         f"groups (Mesh(comm, replicate=R, shard=S)['replicate'])")
    memories = getattr(comm, "memory", "host"), getattr(replicate, "memory", "host")
    if memories[0] != memories[1]:
        raise ValueError(f"{who}: the shard communicator holds {memories[0]!r} arrays and "
                         f"replicate_comm {memories[1]!r} ones; both must use one memory "
                         f"(backends cpu/mpi: host, nccl: cuda)")
    shard_ranks, replica_ranks = _world_ranks(comm), _world_ranks(replicate)
    if shard_ranks is not None and replica_ranks is not None:
        shared = sorted(set(shard_ranks) & set(replica_ranks))
        if len(shared) != 1:
            raise ValueError(f"{who}: the shard communicator (world ranks {shard_ranks}) and "
                             f"replicate_comm (world ranks {replica_ranks}) share world ranks "
                             f"{shared}; they must meet in this rank only")
    return replicate


def _world_ranks(comm) -> Optional[list]:
    ranks = getattr(comm, "ranks", None)
    return list(ranks) if isinstance(ranks, (list, tuple)) else None


def replicate_slice(replicate, work: Any, reduced: Any) -> Any:
    """Wait for a slice's reduce-scatter ``work``, then start summing ``reduced`` (in place)
    over ``replicate``; returns that all-reduce's Work (the next use waits for it)."""
    work.wait()
    return replicate.all_reduce(reduced, async_op=True)
