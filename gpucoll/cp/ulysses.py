"""Ulysses attention: an all-to-all trades "my tokens, every head" for "every token, my heads".

Every rank holds its tokens' ``q, k, v`` for all ``H`` heads. One ``all_to_all`` of the three
(packed together) gives each rank the whole sequence for ``H / p`` heads; it computes exact
attention for those heads locally, and a second ``all_to_all`` sends each rank its tokens'
output for every head back. Backward is the mirror image: one ``all_to_all`` of the output
gradient, local attention backward, one ``all_to_all`` of ``dq, dk, dv`` packed together.

Wire, per rank: ``(p - 1) / p`` of its ``q, k, v`` and of its output forward, of its output
gradient and of ``dq, dk, dv`` backward: constant in p where ring attention's grows, but the
heads must divide by p, and each rank holds scores for the whole sequence (for ``H / p`` heads).
With ``causal=True`` the segment pairs under the mask are skipped, whatever the sharding.
"""

from __future__ import annotations

from typing import Any, Optional

from .base import ContextParallelAttention
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
            group size (both numbers named).

    Example (two ranks, 8 heads)::

        attention = UlyssesAttention(comm, causal=True)
        out = attention.forward(q, k, v)       # q: (batch, local_seq, 8, head_dim)
        dq, dk, dv = attention.backward(grad_out)
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

    def _all_to_all(self, blocks: Any) -> Any:
        """Block j to rank j (counting what leaves this rank); itself on one rank."""
        size = self.comm.size
        if size == 1:
            return blocks
        self._sent_so_far += blocks.nbytes * (size - 1) // size
        return self.comm.all_to_all(blocks)

    def _tokens_to_heads(self, packed: Any, xp: Any) -> Any:
        """(n, b, s, H, d), this rank's tokens -> (n, b, H/p, p*s, d), every token of this
        rank's heads (ranks' tokens one after another)."""
        size = self.comm.size
        n, batch, seq, heads, dim = packed.shape
        local = heads // size
        blocks = self._all_to_all(xp.ascontiguousarray(
            packed.reshape(n, batch, seq, size, local, dim).transpose(3, 0, 1, 2, 4, 5)))
        # block j: rank j's tokens
        return xp.ascontiguousarray(blocks.transpose(1, 2, 4, 0, 3, 5)).reshape(
            n, batch, local, size * seq, dim)

    def _heads_to_tokens(self, packed: Any, xp: Any) -> Any:
        """The inverse: (n, b, H/p, p*s, d) -> (n, b, s, H, d)."""
        size = self.comm.size
        n, batch, local, total, dim = packed.shape
        seq = total // size
        blocks = self._all_to_all(xp.ascontiguousarray(
            packed.reshape(n, batch, local, size, seq, dim).transpose(3, 0, 1, 4, 2, 5)))
        # block j: rank j's heads
        return xp.ascontiguousarray(blocks.transpose(1, 2, 3, 0, 4, 5)).reshape(
            n, batch, seq, size * local, dim)

    def _segments(self, total: int):
        """Every rank's segments, at their place in the gathered sequence."""
        seq = total // self.comm.size
        return [segment for rank in range(self.comm.size)
                for segment in self.local_segments(total, rank, offset=rank * seq)]

    def forward(self, q: Any, k: Any, v: Any) -> Any:
        """This rank's output ``(batch, local_seq, heads, head_dim)``; two all-to-alls."""
        xp, compute = self._check_inputs(q, k, v)
        self._heads_per_rank(int(q.shape[2]))
        total, scale = int(q.shape[1]) * self.comm.size, self._scale(int(q.shape[3]))
        self._sent_so_far = 0
        qkv = self._tokens_to_heads(xp.stack([q, k, v]), xp).astype(compute, copy=False)
        segments = self._segments(total)
        softmax = RunningSoftmax(qkv[0], xp)
        attend(qkv[0], qkv[1], qkv[2], segments, segments, self.causal, scale, xp, softmax)
        out, lse = softmax.finish()
        result = self._heads_to_tokens(out.astype(q.dtype, copy=False)[None], xp)[0]
        self.sent_bytes = {"forward": self._sent_so_far, "backward": 0}
        self._saved = dict(shape=tuple(q.shape), dtype=q.dtype, xp=xp, qkv=qkv, out=out,
                           lse=lse, total=total, scale=scale, compute=compute)
        return result

    def backward(self, grad_out: Any):
        """``(dq, dk, dv)`` for this rank's tokens, each like its input; two all-to-alls."""
        saved = self._saved_for(grad_out, "grad_out")
        xp, compute, qkv = saved["xp"], saved["compute"], saved["qkv"]
        self._sent_so_far = 0
        grad = self._tokens_to_heads(xp.ascontiguousarray(grad_out)[None], xp)[0]
        grad = grad.astype(compute, copy=False)
        delta = (grad * saved["out"]).sum(axis=-1)
        segments = self._segments(saved["total"])
        grads = attend_backward(qkv[0], qkv[1], qkv[2], grad, saved["lse"], delta, segments,
                                segments, self.causal, saved["scale"], xp)
        packed = xp.stack(grads).astype(saved["dtype"], copy=False)
        dq, dk, dv = self._heads_to_tokens(packed, xp)
        self.sent_bytes = {"forward": self.sent_bytes["forward"],
                           "backward": self._sent_so_far}
        return dq, dk, dv
