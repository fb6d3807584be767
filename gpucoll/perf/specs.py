"""The collectives ``gpucoll bench`` measures, and the inputs and checks they share.

Each collective is one small :class:`Collective` subclass declaring its byte count, bus-bandwidth
factor, buffers, data generator, checker and the matching torch.distributed (Gloo) call.
Inputs come from :func:`~gpucoll.perf.reference.pattern` (seed, rank, element index), so every
rank computes its own expected result without extra communication; the inputs and expected
results are the test suite's too (:mod:`gpucoll.perf.reference`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

from .reference import count_wrong, expected_reduction, pattern

# ---------------------------------------------------------------- data and checks
_BLOCK = 1 << 20  # elements generated or checked at a time (bounds the checker's memory)


def _blocks(count: int):
    for start in range(0, count, _BLOCK):
        yield start, min(count, start + _BLOCK)


# ---------------------------------------------------------------- collectives
@dataclass
class Buffers:
    send: Any
    recv: Any
    count: int  # elements per rank (block elements for the blocked collectives)


class Collective:
    """One collective: sizes, bus-bandwidth factor, buffers, inputs, the call and its check.

    Modes are ``"out"`` (out-of-place) and ``"in"`` (in-place); ``gloo_mode`` is the mode
    torch.distributed's call matches, used for the ``--compare gloo`` ratio.
    """

    name = ""
    reduces = False
    rooted = False
    blocked = False  # size column = nranks x block bytes
    min_ranks = 1
    modes = ("out", "in")
    gloo_mode = "in"

    def bus_factor(self, nranks: int) -> float:
        return 1.0

    def count_for(self, nbytes: int, itemsize: int, nranks: int) -> int:
        """Elements per rank (per block when blocked) for a requested size."""
        return nbytes // (itemsize * nranks) if self.blocked else nbytes // itemsize

    def size_of(self, count: int, itemsize: int, nranks: int) -> int:
        """Bytes in the size column (and in algbw)."""
        return count * itemsize * (nranks if self.blocked else 1)

    def buffers(self, dev, count: int, dtype, nranks: int) -> Buffers:
        return Buffers(dev.empty(count, dtype), dev.empty(count, dtype), count)

    def input(self, seed, rank, nranks, count, dtype, op) -> np.ndarray:
        return pattern(seed, rank, count, dtype, op)

    def fill(self, dev, bufs: Buffers, mode: str, seed, rank, nranks, op, root) -> None:
        """Put this rank's input where ``mode`` reads it; poison the output."""
        host = self.input(seed, rank, nranks, bufs.count, bufs.send.dtype, op)
        dev.put(bufs.recv if mode == "in" else bufs.send, host)
        if mode == "out":
            dev.put(bufs.recv, np.full(bufs.recv.size, 77, bufs.recv.dtype))

    def run(self, comm, bufs: Buffers, mode: str, op, root) -> None:
        raise NotImplementedError

    def expected(self, seed, rank, nranks, bufs: Buffers, op, root, start, stop) -> Optional[np.ndarray]:
        """Elements [start, stop) of this rank's flattened result (None: nothing to check)."""
        raise NotImplementedError

    def wrong(self, dev, bufs: Buffers, mode: str, seed, rank, nranks, op, root) -> int:
        result = dev.get(bufs.recv).reshape(-1)
        wrong = 0
        for start, stop in _blocks(result.size):
            expected = self.expected(seed, rank, nranks, bufs, op, root, start, stop)
            if expected is not None:
                wrong += count_wrong(result[start:stop], expected, nranks)
        return wrong

    def gloo(self, dist, send, recv, op, root, rank, nranks) -> None:
        raise NotImplementedError


class AllReduce(Collective):
    name, reduces = "all_reduce", True

    def bus_factor(self, nranks):
        return 2.0 * (nranks - 1) / nranks

    def run(self, comm, bufs, mode, op, root):
        if mode == "in":
            comm.all_reduce(bufs.recv, op)
        else:
            comm.all_reduce(bufs.send, op, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        return expected_reduction(op, seed, nranks, stop - start, bufs.recv.dtype, start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        dist.all_reduce(recv, op=op)


class Broadcast(Collective):
    name, rooted, modes = "broadcast", True, ("in",)  # the API's broadcast is in place

    def fill(self, dev, bufs, mode, seed, rank, nranks, op, root):
        host = pattern(seed, rank, bufs.count, bufs.recv.dtype)
        dev.put(bufs.recv, host if rank == root else np.full(bufs.count, 77, bufs.recv.dtype))

    def run(self, comm, bufs, mode, op, root):
        comm.broadcast(bufs.recv, root)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        return pattern(seed, root, stop - start, bufs.recv.dtype, None, start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        dist.broadcast(recv, src=root)


class Reduce(Collective):
    name, reduces, rooted = "reduce", True, True

    def run(self, comm, bufs, mode, op, root):
        if mode == "in":
            comm.reduce(bufs.recv, root, op)
        else:
            comm.reduce(bufs.send, root, op, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        if rank != root:
            return None  # only the root's result is defined
        return expected_reduction(op, seed, nranks, stop - start, bufs.recv.dtype, start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        dist.reduce(recv, dst=root, op=op)


class AllGather(Collective):
    name, blocked, modes, gloo_mode = "all_gather", True, ("out",), "out"

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def buffers(self, dev, count, dtype, nranks):
        return Buffers(dev.empty(count, dtype), dev.empty((nranks, count), dtype), count)

    def run(self, comm, bufs, mode, op, root):
        comm.all_gather(bufs.send, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        index = np.arange(start, stop)
        owner, within = index // max(bufs.count, 1), index % max(bufs.count, 1)
        values = np.empty(stop - start, bufs.recv.dtype)
        for peer in np.unique(owner):
            mask = owner == peer
            first = int(within[mask][0])
            values[mask] = pattern(seed, int(peer), int(mask.sum()), bufs.recv.dtype, None, first)
        return values

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(recv.reshape(-1), send)


class ReduceScatter(Collective):
    name, reduces, blocked, modes, gloo_mode = "reduce_scatter", True, True, ("out",), "out"

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def buffers(self, dev, count, dtype, nranks):
        return Buffers(dev.empty((nranks, count), dtype), dev.empty(count, dtype), count)

    def input(self, seed, rank, nranks, count, dtype, op):
        return pattern(seed, rank, count * nranks, dtype, op)

    def run(self, comm, bufs, mode, op, root):
        comm.reduce_scatter(bufs.send, op, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        return expected_reduction(op, seed, nranks, stop - start, bufs.recv.dtype,
                                  rank * bufs.count + start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(recv, send.reshape(-1), op=op)


class AllToAll(Collective):
    name, blocked, modes, gloo_mode = "all_to_all", True, ("out",), "out"

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def buffers(self, dev, count, dtype, nranks):
        return Buffers(dev.empty((nranks, count), dtype), dev.empty((nranks, count), dtype), count)

    def input(self, seed, rank, nranks, count, dtype, op):
        return pattern(seed, rank, count * nranks, dtype, op)

    def run(self, comm, bufs, mode, op, root):
        comm.all_to_all(bufs.send, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        # block j of the result is block `rank` of rank j's input
        block = max(bufs.count, 1)
        index = np.arange(start, stop)
        owner, within = index // block, index % block
        values = np.empty(stop - start, bufs.recv.dtype)
        for peer in np.unique(owner):
            mask = owner == peer
            first = rank * bufs.count + int(within[mask][0])
            values[mask] = pattern(seed, int(peer), int(mask.sum()), bufs.recv.dtype, None, first)
        return values

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        dist.all_to_all_single(recv.reshape(-1), send.reshape(-1))


class SendRecv(Collective):
    """Rank r sends to r+1 and receives from r-1 (a ring shift), as nccl-tests' sendrecv: one
    ``comm.sendrecv`` (on NCCL one group, as nccl-tests issues it; an ``isend`` then ``recv``
    on one stream would deadlock there once messages outgrow NCCL's buffers)."""

    name, modes, gloo_mode, min_ranks = "sendrecv", ("out",), "out", 2

    def run(self, comm, bufs, mode, op, root):
        comm.sendrecv(bufs.send, (comm.rank + 1) % comm.size, bufs.recv,
                      (comm.rank - 1) % comm.size)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        return pattern(seed, (rank - 1) % nranks, stop - start, bufs.recv.dtype, None, start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        work = dist.isend(send, (rank + 1) % nranks)
        dist.recv(recv, (rank - 1) % nranks)
        work.wait()


class Halo(Collective):
    """A periodic 1-D halo exchange: rank r sends the first half of its buffer to r-1 and the
    second half to r+1, and receives r+1's first half and r-1's second half, as one
    ``comm.batch_isend_irecv`` of two receives and two sends (one NCCL group; torch's
    ``batch_isend_irecv`` for ``--compare gloo``). The size is what a rank sends in all."""

    name, modes, gloo_mode, min_ranks = "halo", ("out",), "out", 2

    @staticmethod
    def _ops(rank, nranks, send, recv, make):
        """The batch in one order for both libraries (receives from the left, then the right;
        sends right, then left: on two ranks, where left and right are one peer, each peer's
        messages then match in order)."""
        left, right, half = (rank - 1) % nranks, (rank + 1) % nranks, send.shape[0] // 2
        return [make("recv", recv[half:], left), make("recv", recv[:half], right),
                make("send", send[half:], right), make("send", send[:half], left)]

    def run(self, comm, bufs, mode, op, root):
        from ..batch_p2p import P2POp

        for work in comm.batch_isend_irecv(self._ops(comm.rank, comm.size, bufs.send,
                                                     bufs.recv, P2POp)):
            work.wait()

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        """Elements [0, half) come from the right neighbour's first half, [half, count) from
        the left neighbour's second half: in both, element i is the sender's element i."""
        half = bufs.count // 2
        pieces = []
        for lo, hi, sender in ((0, half, (rank + 1) % nranks), (half, bufs.count,
                                                                (rank - 1) % nranks)):
            lo, hi = max(lo, start), min(hi, stop)
            if lo < hi:
                pieces.append(pattern(seed, sender, hi - lo, bufs.recv.dtype, None, lo))
        return np.concatenate(pieces)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        def make(kind, tensor, peer):
            return dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer)

        for work in dist.batch_isend_irecv(self._ops(rank, nranks, send.reshape(-1),
                                                     recv.reshape(-1), make)):
            work.wait()


COLLECTIVES: Dict[str, Collective] = {c.name: c for c in (
    AllReduce(), AllGather(), ReduceScatter(), Broadcast(), Reduce(), AllToAll(), SendRecv(),
    Halo())}
