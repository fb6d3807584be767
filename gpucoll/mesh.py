"""``Mesh``: the ranks of a communicator laid out on named axes, with a group per axis.

Several kinds of parallelism are combined by giving each rank a coordinate on each: with 8 ranks
as ``Mesh(comm, dp=2, pp=2, tp=2)``, world rank ``r`` sits at ``divmod``-style coordinates in
row-major order (the last axis varies fastest, so the ranks of one tensor-parallel group are
adjacent and land on one host, where its frequent small exchanges belong), and
``mesh["tp"]`` is the communicator of the ranks that differ from this one only along ``tp``:
average gradients over ``mesh["dp"]``, run a pipeline over ``mesh["pp"]``, split layers over
``mesh["tp"]``. It is torch's ``init_device_mesh`` for gpucoll communicators, on every backend.

Every axis's group is made when the mesh is (one ``split`` per axis, on every rank, in axis
order), so taking ``mesh[name]`` later is local. Groups over several axes at once
(``mesh.group("dp", "tp")``, e.g. for a ZeRO shard that spans both) are made on first use:
that first call is collective and every rank must make it, as any ``split``. Only the
``Communicator`` interface is used.
"""

from __future__ import annotations

import keyword
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Mesh"]


def _plan(size: int, axes: Dict[str, Any]) -> Dict[str, int]:
    """The axes' sizes, checked, with one ``-1`` inferred (``ValueError`` / ``TypeError``)."""
    if not axes:
        raise ValueError("Mesh: give at least one axis, e.g. Mesh(comm, dp=2, tp=2)")
    for name, extent in axes.items():
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"Mesh: axis name {name!r} is not an identifier")
        if isinstance(extent, bool) or not isinstance(extent, (int, np.integer)):
            raise TypeError(f"Mesh: axis {name} must have an int size, got {extent!r}")
        if extent < 1 and extent != -1:
            raise ValueError(f"Mesh: axis {name} has size {extent}; sizes are >= 1 (or -1 for "
                             f"the one to infer)")
    unknown = [name for name, extent in axes.items() if extent == -1]
    if len(unknown) > 1:
        raise ValueError(f"Mesh: only one axis may be -1, got {unknown}")
    known = int(np.prod([int(e) for e in axes.values() if e != -1], dtype=np.int64))
    shape = {name: int(extent) for name, extent in axes.items()}
    if unknown:
        if size % known:
            raise ValueError(f"Mesh: {size} ranks do not divide into axes {_text(shape)}")
        shape[unknown[0]] = size // known
    elif known != size:
        raise ValueError(f"Mesh: axes {_text(shape)} hold {known} ranks, the communicator has "
                         f"{size}")
    return shape


def _text(shape: Dict[str, int]) -> str:
    return " x ".join(f"{name}={extent}" for name, extent in shape.items())


class Mesh:
    """The ranks of ``comm`` on named axes (see the module doc).

    Args:
        comm: any gpucoll ``Communicator`` (the world, or a group).
        **axes: axis name -> size, in order from the slowest varying to the fastest; their
            product is ``comm.size`` (one size may be -1: inferred).

    Raises:
        ValueError, TypeError: no axes, a name that is not an identifier, a size that is not
            an int >= 1 (or one -1), or sizes whose product is not ``comm.size``; raised on
            every rank alike before anything is sent.

    Example (8 ranks)::

        mesh = Mesh(comm, dp=2, pp=2, tp=2)
        mesh.coords                    # rank 5: {'dp': 1, 'pp': 0, 'tp': 1}
        mesh["tp"].ranks               # rank 5: [4, 5]  (world ranks, in group order)
        mesh["dp"].all_reduce(grads)   # over ranks 1 and 5
        mesh.group("dp", "tp").ranks   # rank 5: [0, 1, 4, 5]
    """

    def __init__(self, comm, **axes: int) -> None:
        self.comm = comm
        self.shape: Dict[str, int] = _plan(comm.size, axes)
        self.names: Tuple[str, ...] = tuple(self.shape)
        grid = np.arange(comm.size).reshape(tuple(self.shape.values()))
        self.coords: Dict[str, int] = {
            name: int(c) for name, c in zip(self.names, np.argwhere(grid == comm.rank)[0])}
        self._grid = grid
        self._groups: Dict[Tuple[str, ...], Any] = {}
        try:
            for name in self.names:
                self.group(name)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str):
        """The communicator along axis ``name`` (made with the mesh)."""
        if name not in self.shape:
            raise KeyError(f"Mesh has no axis {name!r}; its axes are {list(self.names)}")
        return self._groups[(name,)]

    def __repr__(self) -> str:
        return f"Mesh({_text(self.shape)}; rank {self.comm.rank} at {self.coords})"

    def group(self, *names: str):
        """The communicator of the ranks that differ from this one only along ``names``;
        its ranks are ordered row-major over ``names`` in the order given.

        Collective the first time for a given ``names`` (every rank calls it), then cached.

        Raises:
            ValueError: no names, a name twice, or one that is not an axis (before any split).
        """
        self._check_names(names, "group")
        if names not in self._groups:
            self._groups[names] = self.comm.split(*self._color_and_key(names))
        return self._groups[names]

    def ranks(self, *names: str) -> List[int]:
        """The ranks of ``comm`` in :meth:`group` ``(*names)``, in group order (local: no
        communication)."""
        self._check_names(names, "ranks")
        moved = self._grid.transpose([self.names.index(n) for n in self.names if n not in names]
                                     + [self.names.index(n) for n in names])
        fixed = tuple(self.coords[n] for n in self.names if n not in names)
        return [int(r) for r in moved[fixed].reshape(-1)]

    def close(self) -> None:
        """Close every group the mesh made (not ``comm``). Idempotent."""
        groups, self._groups = self._groups, {}
        for group in groups.values():
            if group is not None:
                group.close()

    def _check_names(self, names: Sequence[str], method: str) -> None:
        if not names:
            raise ValueError(f"Mesh.{method}: name at least one axis of {list(self.names)}")
        unknown = [name for name in names if name not in self.shape]
        if unknown:
            raise ValueError(f"Mesh.{method}: no axis {unknown[0]!r}; the axes are "
                             f"{list(self.names)}")
        if len(set(names)) != len(names):
            raise ValueError(f"Mesh.{method}: an axis is named twice in {list(names)}")

    def _color_and_key(self, names: Sequence[str]) -> Tuple[int, int]:
        """``split``'s color (this rank's place along the other axes) and key (its place along
        ``names``, row-major in the order given)."""
        others = [n for n in self.names if n not in names]
        color = int(np.ravel_multi_index([self.coords[n] for n in others],
                                         [self.shape[n] for n in others])) if others else 0
        key = int(np.ravel_multi_index([self.coords[n] for n in names],
                                       [self.shape[n] for n in names]))
        return color, key

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc: Optional[BaseException]) -> None:
        self.close()
