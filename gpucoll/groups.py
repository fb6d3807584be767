"""Groups of a communicator: its world ranks, ``split``, ``new_group`` and ``host_group``.

A mixin of :class:`gpucoll.communicator.Communicator`. The checks run here, on every backend,
before anything is sent; a backend makes the new communicator in ``_split`` (and, where its
own memory is not the host's, ``_host_group``) and records its members with ``_child``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .flight_recorder import describe_nothing, traced

__all__ = ["Groups"]

_INT32_LIMIT = 2 ** 31


class Groups:
    """World ranks and sub-communicators (see the module doc)."""

    # ------------------------------------------------------------------ world ranks
    _world_ranks: Optional[Tuple[int, ...]] = None  # set on communicators made by split
    _subgroup = False  # made by split / new_group / host_group (or shrunk from one)

    @property
    def ranks(self) -> List[int]:
        """The world ranks this communicator holds, in its rank order (``ranks[i]`` is the
        world rank of rank i). The world is the communicator ``init()`` made; there
        ``ranks == list(range(size))``. Kept through ``split`` and ``new_group`` of groups.

        Example (four ranks)::

            odds = comm.new_group([3, 1])   # on ranks 3 and 1
            odds.ranks                      # [3, 1]
        """
        if self._world_ranks is None:
            return list(range(self.size))
        return list(self._world_ranks)

    def to_world(self, rank: int) -> int:
        """The world rank of this communicator's ``rank`` (torch's ``get_global_rank``)."""
        rank = self._root(rank, "rank")
        return rank if self._world_ranks is None else self._world_ranks[rank]

    def from_world(self, world_rank: int) -> int:
        """This communicator's rank of world rank ``world_rank`` (MPI's ``Translate_ranks``).

        Raises:
            ValueError: ``world_rank`` is not a member of this communicator.
        """
        if isinstance(world_rank, bool) or not isinstance(world_rank, int) \
                and not hasattr(world_rank, "__index__"):
            raise TypeError(f"world_rank must be an int, got {type(world_rank).__name__}")
        world_rank = int(world_rank)
        ranks = self.ranks
        if world_rank not in ranks:
            raise ValueError(f"world rank {world_rank} is not in this communicator (its world "
                             f"ranks: {ranks})")
        return ranks.index(world_rank)

    def _child(self, child: Optional["Groups"], members: Sequence[int]):
        """Record on ``child`` (made by a backend's ``_split``) the world ranks of
        ``members``, its ranks given as ranks of this communicator, in the child's order."""
        if child is not None:
            ranks = self.ranks
            child._world_ranks = tuple(ranks[m] for m in members)
            child._subgroup = self._subgroup  # a shrunk group is still a group
        return child

    @staticmethod
    def _group(child: Optional["Groups"]) -> Optional["Groups"]:
        if child is not None:
            child._subgroup = True
        return child

    # ------------------------------------------------------------------ new groups
    @traced(describe_nothing)
    def split(self, color: Optional[int], key: Optional[int] = None) -> Optional["Groups"]:
        """Split into sub-communicators: ranks with equal ``color`` form one, ordered by
        (``key``, rank). Collective over this communicator.

        Returns:
            The new communicator, or None for ranks that pass ``color=None`` (or a negative color).
        """
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)):
            raise TypeError(f"color must be an int or None, got {color!r}")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
            raise TypeError(f"key must be an int or None, got {key!r}")
        # NCCL's color and key are C ints: check the range here, on every backend, before
        # anything is sent (a rank that failed later would leave the others waiting).
        if color is not None and color >= _INT32_LIMIT:
            raise ValueError(f"color={color} is too large: colors must be below 2**31")
        if key is not None and not -_INT32_LIMIT <= key < _INT32_LIMIT:
            raise ValueError(f"key={key} is out of range: keys must be in [-2**31, 2**31)")
        if color is not None and color < 0:
            color = None
        return self._group(self._split(color, self.rank if key is None else key))

    @traced(describe_nothing)
    def new_group(self, ranks: Sequence[int]) -> Optional["Groups"]:
        """A communicator of ``ranks`` (in that order: ``ranks[i]`` becomes rank i).

        Every rank must call it with the same list; ranks outside it get None.

        Example (four ranks)::

            evens = comm.new_group([0, 2])   # ranks 0, 2 -> group ranks 0, 1; others None
        """
        ranks = [self._root(r, "ranks[]") for r in ranks]
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"new_group: ranks must be a non-empty list of distinct ranks, got {ranks}")
        if self.rank in ranks:
            return self._group(self._split(0, ranks.index(self.rank)))
        return self._split(None, 0)

    @traced(describe_nothing)
    def host_group(self) -> "Groups":
        """A new communicator of the same ranks for host (NumPy) arrays, beside this one.

        For small control messages, object collectives and CPU tensors next to GPU traffic
        (``torch.distributed.new_group(backend="gloo")`` beside NCCL): NCCL runs a rank's
        operations in issue order on its stream, so a receive posted early holds back every
        later operation until its message comes, while the host group's operations complete
        in any order. On NCCL it is a CPU-backend communicator over the same rendezvous store;
        on a backend that already works on host memory, a new group of that backend with its
        own tag space. Collective: every rank calls it, in the same order as ``split``.
        Close it (or use it as a context manager) before this one.
        """
        self._check_alive()
        return self._group(self._host_group())

    # ------------------------------------------------------------------ backend hooks
    def _split(self, color: Optional[int], key: int) -> Optional["Groups"]:
        return self._unsupported("split")

    def _host_group(self) -> "Groups":
        if self.memory == "host":
            return self._split(0, self.rank)  # split(0), recorded as this host_group
        return self._unsupported("host_group")
