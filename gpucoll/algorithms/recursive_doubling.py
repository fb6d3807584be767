"""Recursive doubling (butterfly) all-reduce and the dissemination barrier: ``log2 n`` rounds
in which every rank exchanges with a partner at distance ``2**k``; latency-optimal for small
messages.
"""

from __future__ import annotations

import numpy as np

from gpucoll.algorithms.direct import EMPTY, Combine, byte_view, copy_into, reducer_into
from gpucoll.transports.base import Frame, Recv, Transport

__all__ = ["recursive_doubling_all_reduce", "dissemination_barrier"]


def recursive_doubling_all_reduce(t: Transport, buf: np.ndarray, combine: Combine,
                                  frame: Frame, deadline: float) -> None:
    """All-reduce in place by recursive doubling, with a fold for non-power-of-two sizes.

    Let ``p`` be the largest power of two not above ``n`` and ``extra = n - p``. First (tag 0)
    each even rank below ``2 * extra`` sends its buffer to the next odd rank, which folds it in
    and stands for both. The ``p`` remaining ranks then run ``log2 p`` butterfly steps (tags
    ``1..log2 p``): at step ``k`` partners at distance ``2**k`` swap their whole buffers and
    combine them. Last (tag ``log2 p + 1``) each folded odd rank sends the result back to its
    even partner.

    Both partners of a butterfly step compute ``lower (op) upper`` (the partial result of the
    lower-numbered half on the left), so every rank ends with bitwise-identical results even
    for floating point.

    Steps: ``log2 n`` when ``n`` is a power of two, else ``floor(log2 n) + 2``.
    Bytes: ``log2 p * N``, plus ``N`` for ranks taking part in the fold. Scratch: ``N``.
    """
    rank, size = t.rank, t.size
    if size == 1:
        return
    itemsize = buf.dtype.itemsize
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    rounds = pof2.bit_length() - 1
    unfold = frame.with_tag(rounds + 1)

    if rank < 2 * extra:
        if rank % 2 == 0:
            # Stand aside: hand our contribution to rank + 1 and wait for the result.
            t.exchange([(rank + 1, byte_view(buf))], [], frame.with_tag(0), deadline)
            t.exchange([], [Recv(rank + 1, byte_view(buf))], unfold, deadline)
            return
        t.exchange([], [Recv(rank - 1, byte_view(buf), reducer_into(buf, combine), itemsize)],
                   frame.with_tag(0), deadline)
        vrank = rank // 2
    else:
        vrank = rank - extra

    def real_rank(virtual: int) -> int:
        return 2 * virtual + 1 if virtual < extra else virtual + extra

    current, other = buf, np.empty_like(buf)
    for step in range(rounds):
        partner_v = vrank ^ (1 << step)
        partner = real_rank(partner_v)
        # ``current`` is being sent, so the incoming buffer cannot be folded into it while it
        # arrives: receive whole, then combine with the lower half's value on the left.
        t.exchange([(partner, byte_view(current))], [Recv(partner, byte_view(other))],
                   frame.with_tag(step + 1), deadline)
        if vrank < partner_v:
            combine(current, other)
        else:
            combine(other, current)
            current, other = other, current
    copy_into(buf, current)

    if rank < 2 * extra:
        t.exchange([(rank - 1, byte_view(buf))], [], unfold, deadline)


def dissemination_barrier(t: Transport, frame: Frame, deadline: float) -> None:
    """Barrier: in round ``k`` every rank sends an empty message to ``rank + 2**k`` and waits
    for one from ``rank - 2**k``. After the last round each rank has (transitively) heard from
    every other, so no rank leaves before all have entered.

    Steps: ``ceil(log2 n)``. Bytes: none (one header per round).
    """
    rank, size = t.rank, t.size
    distance, step = 1, 0
    while distance < size:
        t.exchange([((rank + distance) % size, EMPTY)], [Recv((rank - distance) % size, EMPTY)],
                   frame.with_tag(step), deadline)
        distance <<= 1
        step += 1
