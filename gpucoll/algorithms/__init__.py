"""Collective algorithms over a :class:`~gpucoll.transports.base.Transport`, and their selection.

Every algorithm is a plain function named ``<algorithm>_<collective>``; all algorithms of one
collective share a signature, so a backend picks one by name and calls it:

============== ================================================== ===========================
collective     signature                                          algorithms
============== ================================================== ===========================
all_reduce     ``f(t, buf, combine, frame, deadline)``            ring, recursive_doubling, tree
reduce_scatter ``f(t, send, out, combine, frame, deadline)``      ring, direct
all_gather     ``f(t, send, out, frame, deadline)``               ring, direct
broadcast      ``f(t, buf, root, frame, deadline)``               binomial, scatter_allgather
reduce         ``f(t, send, out, root, combine, frame, deadline)`` binomial, ring
gather         ``f(t, send, out, root, frame, deadline)``         direct
scatter        ``f(t, send, out, root, frame, deadline)``         direct
all_to_all     ``f(t, send, out, frame, deadline)``               direct
barrier        ``f(t, frame, deadline)``                          dissemination
============== ================================================== ===========================

:func:`select` chooses by message size and world size: few steps for small messages, few bytes
per rank for large ones. ``GPUCOLL_ALGORITHM`` (parsed by :func:`parse_override`, read by the
caller) forces a choice per collective.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

from gpucoll import config
from gpucoll.algorithms.direct import (direct_all_gather, direct_all_to_all, direct_gather,
                                       direct_reduce_scatter, direct_scatter)
from gpucoll.algorithms.recursive_doubling import (dissemination_barrier,
                                                   recursive_doubling_all_reduce)
from gpucoll.algorithms.ring import (ring_all_gather, ring_all_reduce, ring_reduce,
                                     ring_reduce_scatter, scatter_allgather_broadcast)
from gpucoll.algorithms.tree import binomial_broadcast, binomial_reduce, tree_all_reduce

__all__ = ["ALGORITHMS", "select", "parse_override", "get"]

ALGORITHMS: Dict[str, Dict[str, Callable[..., None]]] = {
    "all_reduce": {"ring": ring_all_reduce,
                   "recursive_doubling": recursive_doubling_all_reduce,
                   "tree": tree_all_reduce},
    "reduce_scatter": {"ring": ring_reduce_scatter, "direct": direct_reduce_scatter},
    "all_gather": {"ring": ring_all_gather, "direct": direct_all_gather},
    "broadcast": {"binomial": binomial_broadcast, "scatter_allgather": scatter_allgather_broadcast},
    "reduce": {"binomial": binomial_reduce, "ring": ring_reduce},
    "gather": {"direct": direct_gather},
    "scatter": {"direct": direct_scatter},
    "all_to_all": {"direct": direct_all_to_all},
    "barrier": {"dissemination": dissemination_barrier},
}


def _check_collective(collective: str) -> Dict[str, Callable[..., None]]:
    try:
        return ALGORITHMS[collective]
    except KeyError:
        raise ValueError(f"unknown collective {collective!r}; expected one of "
                         f"{', '.join(ALGORITHMS)}") from None


def get(collective: str, name: str) -> Callable[..., None]:
    """The function implementing algorithm ``name`` of ``collective``.

    Raises:
        ValueError: unknown collective or algorithm; the message lists the valid names.
    """
    table = _check_collective(collective)
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {collective} algorithm {name!r}; expected one of "
                         f"{', '.join(table)}") from None


def parse_override(text: Optional[str]) -> Dict[str, str]:
    """Parse a ``GPUCOLL_ALGORITHM`` value such as ``"all_reduce=ring,broadcast=binomial"``.

    Empty text or ``auto`` means no override (``{}``). Names are case-insensitive; spaces
    around them are ignored.

    Returns:
        ``{collective: algorithm}``.

    Raises:
        ValueError: an item is not ``collective=algorithm``, a collective appears twice, or a
            collective or algorithm is unknown; the message lists the valid names.
    """
    if text is None or text.strip().lower() in ("", "auto"):
        return {}
    chosen: Dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        collective, sep, name = item.partition("=")
        collective, name = collective.strip().lower(), name.strip().lower()
        if not sep or not collective or not name:
            raise ValueError(f"algorithm override {item!r} in {text!r} is not of the form "
                             f"collective=algorithm (e.g. all_reduce=ring)")
        if collective in chosen:
            raise ValueError(f"algorithm override {text!r} names {collective} twice")
        get(collective, name)
        chosen[collective] = name
    return chosen


def select(collective: str, nbytes: int, world_size: int,
           override: Optional[Mapping[str, str]] = None, *, itemsize: int = 1,
           ring_threshold: Optional[int] = None) -> str:
    """Name of the algorithm to run for one call.

    Args:
        collective: e.g. ``"all_reduce"``.
        nbytes: bytes of the collective's largest buffer (all_reduce/broadcast/reduce: the
            buffer; all_gather/reduce_scatter/gather/scatter/all_to_all: the ``n * m`` array).
        world_size: number of ranks.
        override: ``{collective: algorithm}`` from :func:`parse_override`; wins when it names
            ``collective``.
        itemsize: element size, to turn ``nbytes`` into a count.
        ring_threshold: per-rank share (``nbytes / world_size``) from which the ring
            all-reduce is used; default ``GPUCOLL_RING_THRESHOLD``.

    Rules (``share = nbytes / world_size``; ``T = ring_threshold``, 256 KiB by default). The
    crossovers were measured with the CPU backend on loopback (2 and 4 ranks on 2 cores,
    ``bench/RESULTS.md``): moving fewer bytes in total beats neighbour-only links until
    messages are large, so the bandwidth algorithms start late:

    - all_reduce: ``ring`` when ``share >= T`` and ``count >= world_size``, else
      ``recursive_doubling``.
    - reduce_scatter, all_gather: ``direct`` (one step, the same bytes as the ring) up to 8
      ranks; beyond, ``ring`` when ``share >= T`` (neighbour links, bounded scratch).
    - broadcast: ``scatter_allgather`` when ``world_size > 2`` and ``share >= 16 T`` (the root
      sends ``N`` instead of ``ceil(log2 n) * N``), else ``binomial``.
    - reduce: ``ring`` when ``world_size > 2`` and ``share >= 64 T``, else ``binomial``.
    - gather, scatter, all_to_all: ``direct``; barrier: ``dissemination``.

    Raises:
        ValueError: unknown collective, or an override naming an unknown algorithm.
    """
    table = _check_collective(collective)
    if override and collective in override:
        name = override[collective]
        get(collective, name)
        return name
    if ring_threshold is None:
        ring_threshold = config.get("GPUCOLL_RING_THRESHOLD")
    share = nbytes / max(1, world_size)
    if collective == "all_reduce":
        count = nbytes // max(1, itemsize)
        return "ring" if share >= ring_threshold and count >= world_size else "recursive_doubling"
    if collective in ("reduce_scatter", "all_gather"):
        return "ring" if world_size > 8 and share >= ring_threshold else "direct"
    if collective == "broadcast":
        return ("scatter_allgather" if world_size > 2 and share >= 16 * ring_threshold
                else "binomial")
    if collective == "reduce":
        return "ring" if world_size > 2 and share >= 64 * ring_threshold else "binomial"
    return next(iter(table))
