"""Ulysses attention: an all-to-all trades "my tokens, every head" for "every token, my heads".

Every rank holds its tokens' ``q, k, v`` for all ``H`` heads. One ``all_to_all`` of the three
(packed together) gives each rank the whole sequence for ``H / p`` heads; it computes exact
attention for those heads locally, and a second ``all_to_all`` sends each rank its tokens'
output for every head back. Backward is the mirror image: one ``all_to_all`` of the output
gradient, local attention backward, one ``all_to_all`` of ``dq, dk, dv`` packed together.

Grouped-query attention (``kv_heads`` key/value heads, query head h using ``h // group``):
rank j gets the contiguous query heads ``[j H/p, (j+1) H/p)``, which use exactly the key/value
heads ``[j kv_heads/p, (j+1) kv_heads/p)`` when ``kv_heads % p == 0`` (those are split like
the query heads), or the single head ``j // (p / kv_heads)`` when ``p % kv_heads == 0`` (each
such head is sent to the ``p / kv_heads`` ranks that use it, one copy each, and their gradients
are summed when they come home). Copying to the ranks that need a head, and no further, keeps
one all-to-all each way and the fewest bytes; any other ``kv_heads`` would need a rank's heads
from two groups, so it is refused (ring attention takes it).

Wire, per rank: ``(p - 1) / p`` of its ``q, k, v`` (``k, v`` with ``max(kv_heads, p)`` heads)
and of its output forward, of its output gradient and of ``dq, dk, dv`` backward: constant in p
where ring attention's grows, but the heads must divide by p, and each rank holds scores for the
whole sequence (for ``H / p`` heads). With ``causal=True`` the segment pairs under the mask are
skipped, whatever the sharding.
"""

from __future__ import annotations

from typing import Any, List, Optional

from .base import ContextParallelAttention, group_queries, grouped_segments, ungroup_queries
from .blockwise import RunningSoftmax, attend, attend_backward

__all__ = ["UlyssesAttention"]


class UlyssesAttention(ContextParallelAttention):
    """Exact softmax attention over the whole sequence with heads spread for the math.

    Args:
        comm: the context-parallel group (any gpucoll ``Communicator``).
        causal: a token attends only to tokens at its position or before.
        sharding: ``"contiguous"`` or ``"zigzag"``: how the inputs are split by tokens.
        scale: the scores' factor, default ``1 / sqrt(head_dim)``.

    Raises:
        ValueError / TypeError: as :class:`RingAttention`, and heads not divisible by the
            group size, or ``kv_heads`` neither a multiple nor a divisor of it (the numbers
            named).

    Example (two ranks, 8 heads)::

        attention = UlyssesAttention(comm, causal=True)
        out = attention.forward(q, k, v)       # q: (batch, local_seq, 8, head_dim)
        dq, dk, dv = attention.backward(grad_out)
        # grouped-query attention: k, v (batch, local_seq, kv_heads, head_dim), kv_heads a
        # multiple or a divisor of the group size; dk, dv come back shaped like k, v
    """

    def __init__(self, comm, *, causal: bool = False, sharding: str = "contiguous",
                 scale: Optional[float] = None):
        super().__init__(comm, causal=causal, sharding=sharding, scale=scale)
        self._sent_so_far = 0   # bytes sent so far in the running forward or backward

    def _heads_per_rank(self, heads: int) -> int:
        if heads % self.comm.size:
            raise ValueError(f"UlyssesAttention: {heads} heads are not divisible by the "
                             f"context-parallel group size {self.comm.size}")
        return heads // self.comm.size

    def _kv_copies(self, heads: int, kv_heads: int) -> int:
        """How many ranks each key/value head goes to: 1 when ``kv_heads`` splits over the
        group like the query heads, ``p / kv_heads`` when each serves several ranks."""
        size = self.comm.size
        self._heads_per_rank(heads)
        if kv_heads % size == 0:
            return 1
        if size % kv_heads == 0:
            return size // kv_heads
        raise ValueError(f"UlyssesAttention: {kv_heads} key/value heads can neither be split "
                         f"over nor copied to the context-parallel group's {size} ranks "
                         f"(kv_heads must be a multiple or a divisor of {size}); RingAttention "
                         f"takes any kv_heads that divides heads ({heads})")

    def _all_to_all(self, blocks: Any) -> Any:
        """Block j to rank j (counting what leaves this rank); itself on one rank."""
        size = self.comm.size
        if size == 1:
            return blocks
        self._sent_so_far += blocks.nbytes * (size - 1) // size
        return self.comm.all_to_all(blocks)

    def _swap(self, parts: List[Any], xp: Any, to_heads: bool) -> List[Any]:
        """One all_to_all for all of ``parts`` (one dtype). ``to_heads``: each part
        (n, b, s, H, d), this rank's tokens -> (n, b, H/p, p*s, d), every token of this rank's
        heads (ranks' tokens one after another); else the inverse."""
        size = self.comm.size
        blocks = []      # per part: (p, n, b, s, heads per rank, d), block j for rank j
        for x in parts:
            if to_heads:
                n, batch, seq, heads, dim = x.shape
                blocks.append(x.reshape(n, batch, seq, size, heads // size, dim)
                              .transpose(3, 0, 1, 2, 4, 5))
            else:
                n, batch, local, total, dim = x.shape
                blocks.append(x.reshape(n, batch, local, size, total // size, dim)
                              .transpose(3, 0, 1, 4, 2, 5))
        flat = [xp.ascontiguousarray(block).reshape(size, -1) for block in blocks]
        received = self._all_to_all(flat[0] if len(flat) == 1 else xp.concatenate(flat, 1))
        results, at = [], 0
        for block, width in zip(blocks, (f.shape[1] for f in flat)):
            got = received[:, at:at + width].reshape(block.shape)   # block j: rank j's
            at += width
            _, n, batch, seq, local, dim = block.shape
            if to_heads:
                results.append(xp.ascontiguousarray(got.transpose(1, 2, 4, 0, 3, 5))
                               .reshape(n, batch, local, size * seq, dim))
            else:
                results.append(xp.ascontiguousarray(got.transpose(1, 2, 3, 0, 4, 5))
                               .reshape(n, batch, seq, size * local, dim))
        return results

    def _segments(self, total: int):
        """Every rank's segments, at their place in the gathered sequence."""
        seq = total // self.comm.size
        return [segment for rank in range(self.comm.size)
                for segment in self.local_segments(total, rank, offset=rank * seq)]

    def forward(self, q: Any, k: Any, v: Any) -> Any:
        """This rank's output ``(batch, local_seq, heads, head_dim)``; two all-to-alls."""
        xp, compute = self._check_inputs(q, k, v)
        heads, kv_heads = int(q.shape[2]), int(k.shape[2])
        copies = self._kv_copies(heads, kv_heads)
        total, scale = int(q.shape[1]) * self.comm.size, self._scale(int(q.shape[3]))
        self._sent_so_far = 0
        kv = xp.stack([k, v])
        if copies > 1:                          # copy j of a head goes to rank j
            kv = xp.repeat(kv, copies, axis=3)
        local_q, local_kv = self._swap([q[None], kv], xp, to_heads=True)
        local_kv = local_kv.astype(compute, copy=False)
        queries = group_queries(local_q[0].astype(compute, copy=False), local_kv.shape[2])
        segments = self._segments(total)
        rows = grouped_segments(segments, queries.shape[2] // total, total)
        softmax = RunningSoftmax(queries, xp)
        attend(queries, local_kv[0], local_kv[1], rows, segments, self.causal, scale, xp,
               softmax)
        out, lse = softmax.finish()
        home = ungroup_queries(out, local_q.shape[2]).astype(q.dtype, copy=False)
        result = self._swap([home[None]], xp, to_heads=False)[0][0]
        self.sent_bytes = {"forward": self._sent_so_far, "backward": 0}
        self._saved = dict(shape=tuple(q.shape), dtype=q.dtype, xp=xp, queries=queries,
                           kv=local_kv, out=out, lse=lse, rows=rows, segments=segments,
                           scale=scale, compute=compute, copies=copies, kv_heads=kv_heads)
        return result

    def backward(self, grad_out: Any):
        """``(dq, dk, dv)`` for this rank's tokens, each like its input; two all-to-alls."""
        saved = self._saved_for(grad_out, "grad_out")
        xp, compute, queries, kv = saved["xp"], saved["compute"], saved["queries"], saved["kv"]
        dtype, copies = saved["dtype"], saved["copies"]
        self._sent_so_far = 0
        grad = self._swap([grad_out[None]], xp, to_heads=True)[0][0]
        heads_here = grad.shape[1]
        grad = group_queries(grad.astype(compute, copy=False), kv.shape[2])
        delta = (grad * saved["out"]).sum(axis=-1)
        dq, dk, dv = attend_backward(queries, kv[0], kv[1], grad, saved["lse"], delta,
                                     saved["rows"], saved["segments"], self.causal,
                                     saved["scale"], xp)
        dq = ungroup_queries(dq, heads_here).astype(dtype, copy=False)
        dq, dkv = self._swap([dq[None], xp.stack([dk, dv]).astype(dtype, copy=False)], xp,
                             to_heads=False)
        if copies > 1:                          # every copy's gradient, summed at home
            two, batch, seq, _, dim = dkv.shape
            dkv = dkv.astype(compute, copy=False).reshape(
                two, batch, seq, saved["kv_heads"], copies, dim).sum(axis=4).astype(dtype)
        self.sent_bytes = {"forward": self.sent_bytes["forward"],
                           "backward": self._sent_so_far}
        return dq[0], dkv[0], dkv[1]
