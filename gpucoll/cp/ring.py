"""Ring attention: keys and values travel around the ring while each rank keeps its queries.

Every rank holds its tokens' ``q, k, v``. Forward takes ``p`` steps: at step s rank r attends
with its queries to the keys and values of rank ``r - s`` (its own at step 0) and merges the
block into its queries' running softmax, while that block goes on to rank ``r + 1``
and the next arrives from ``r - 1`` (one ``sendrecv`` per step, posted before the block's math
so the two overlap). No rank ever holds more than two ranks' keys and values, or a score
matrix larger than its own tokens times one block's.

Backward runs the ring again: the keys and values go round once more, and with each block
travels the gradient of its keys and values, to which each rank adds its share before passing
it on; after ``p`` steps it arrives home complete. The queries' gradient stays local.

Wire per rank, with a block of ``2 * batch * S/p * kv_heads * D`` elements (its keys and
values, at their own head count: grouped-query attention with ``kv_heads < heads`` shrinks
every message by ``kv_heads / heads``):
``p - 1`` blocks forward, in the inputs' dtype; backward ``p - 1`` blocks again plus ``p`` of
key/value gradient, in the compute dtype (float32 for 16-bit inputs, so the sum over the ring
is not rounded p times).

With ``causal=True`` blocks entirely in a query's future are skipped (no work); with
``sharding="contiguous"`` that leaves rank 0 one block and rank p - 1 all p, so use
``sharding="zigzag"``, where every rank does the same work.

On a GPU communicator (``comm.memory == "cuda"``) the exchanges go on a stream of their own,
ordered after the work that produced their buffers, so NCCL moves the next block while the
current one is computed; ``Work.wait()`` orders the compute stream after them.
"""

from __future__ import annotations

from typing import Any, Optional

from .. import cuda_env
from .base import ContextParallelAttention, group_queries, grouped_segments, ungroup_queries
from .blockwise import RunningSoftmax, attend, attend_backward

__all__ = ["RingAttention"]

KV_TAG, GRAD_TAG = 71, 72


class RingAttention(ContextParallelAttention):
    """Exact softmax attention over the whole sequence, sharded by tokens (see the module doc).

    Args:
        comm: the context-parallel group (any gpucoll ``Communicator`` with ``sendrecv``).
        causal: a token attends only to tokens at its position or before.
        sharding: ``"contiguous"`` or ``"zigzag"`` (see :mod:`gpucoll.cp.sharding`); the
            inputs must be split that way (:func:`gpucoll.cp.shard_sequence`).
        scale: the scores' factor, default ``1 / sqrt(head_dim)``.

    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query / multi-query attention,
    ``heads % kv_heads == 0``): they travel at their own head count, and ``dk, dv`` come back
    shaped like them, summed over each group of query heads.

    Raises:
        ValueError / TypeError: inputs of mismatched shapes or dtypes, ``kv_heads`` not
            dividing ``heads``, not floating point, or a sequence length the sharding cannot
            split (named, before anything is sent).

    Example (two ranks, a causal sequence of 1024 tokens)::

        attention = RingAttention(comm, causal=True, sharding="zigzag")
        q, k, v = (shard_sequence(t, comm.rank, comm.size, "zigzag") for t in (Q, K, V))
        out = attention.forward(q, k, v)         # (batch, 512, heads, head_dim)
        dq, dk, dv = attention.backward(grad_out)
    """

    def __init__(self, comm, *, causal: bool = False, sharding: str = "contiguous",
                 scale: Optional[float] = None):
        super().__init__(comm, causal=causal, sharding=sharding, scale=scale)
        self._stream = None

    # ------------------------------------------------------------------ the exchange
    def _exchange(self, send: Any, receive: Any, tag: int):
        """Post one ring step: ``send`` to the next rank, ``receive`` from the previous."""
        comm = self.comm
        after, before = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        stream = None
        if comm.memory == "cuda":
            cupy = cuda_env.cupy_module()
            if self._stream is None:
                self._stream = cupy.cuda.Stream(non_blocking=True)
            self._stream.wait_event(cupy.cuda.get_current_stream().record())
            stream = self._stream
        return comm.sendrecv(send, after, receive, before, tag=tag, async_op=True, stream=stream)

    # ------------------------------------------------------------------ forward
    def forward(self, q: Any, k: Any, v: Any) -> Any:
        """This rank's output ``(batch, local_seq, heads, head_dim)`` for its queries over
        every rank's keys and values; ``p - 1`` exchanges with the neighbours."""
        xp, compute = self._check_inputs(q, k, v)
        comm, size = self.comm, self.comm.size
        total, scale = int(q.shape[1]) * size, self._scale(int(q.shape[3]))
        kv_heads, seq = int(k.shape[2]), int(q.shape[1])
        mine = grouped_segments(self.local_segments(total, comm.rank),
                                int(q.shape[2]) // kv_heads, seq)
        queries = group_queries(self.to_heads_first(q, compute, xp), kv_heads)
        blocks = xp.stack([self.to_heads_first(k, q.dtype, xp),
                           self.to_heads_first(v, q.dtype, xp)])     # (2, b, h, s, d) on the wire
        own, inbox = blocks, _Inboxes(blocks, xp)
        softmax = RunningSoftmax(queries, xp)
        sent = 0
        for step in range(size):
            source = (comm.rank - step) % size
            work = self._exchange(blocks, inbox[step], KV_TAG) if step < size - 1 else None
            sent += blocks.nbytes if work is not None else 0
            attend(queries, blocks[0].astype(compute, copy=False),
                   blocks[1].astype(compute, copy=False), mine,
                   self.local_segments(total, source), self.causal, scale, xp, softmax)
            if work is not None:
                work.wait()
                blocks = inbox[step]
        out, lse = softmax.finish()
        self.sent_bytes = {"forward": sent, "backward": 0}
        self._saved = dict(shape=tuple(q.shape), dtype=q.dtype, xp=xp, queries=queries, own=own,
                           out=out, lse=lse, total=total, scale=scale, compute=compute,
                           mine=mine)
        return self.to_tokens_first(ungroup_queries(out, int(q.shape[2])), q.dtype, xp)

    # ------------------------------------------------------------------ backward
    def backward(self, grad_out: Any):
        """``(dq, dk, dv)`` for this rank's tokens, each like its input; ``p - 1`` exchanges
        of keys and values and ``p`` of their gradient."""
        saved = self._saved_for(grad_out, "grad_out")
        comm, size = self.comm, self.comm.size
        xp, compute, scale = saved["xp"], saved["compute"], saved["scale"]
        total, queries = saved["total"], saved["queries"]
        mine, kv_heads = saved["mine"], int(queries.shape[1])
        grad = group_queries(self.to_heads_first(grad_out, compute, xp), kv_heads)
        delta = (grad * saved["out"]).sum(axis=-1)
        dq = xp.zeros_like(queries)
        blocks = saved["own"]
        inbox = _Inboxes(blocks, xp)
        travelling = xp.zeros(blocks.shape, dtype=compute)   # dk, dv of the block here
        arriving = xp.empty_like(travelling) if size > 1 else None
        sent, grads_work = 0, None
        for step in range(size):
            source = (comm.rank - step) % size
            work = self._exchange(blocks, inbox[step], KV_TAG) if step < size - 1 else None
            sent += blocks.nbytes if work is not None else 0
            if grads_work is not None:            # the block's gradient so far, from before
                grads_work.wait()
                travelling, arriving = arriving, travelling
            attend_backward(queries, blocks[0].astype(compute, copy=False),
                            blocks[1].astype(compute, copy=False), grad, saved["lse"], delta,
                            mine, self.local_segments(total, source), self.causal, scale, xp,
                            into=(dq, travelling[0], travelling[1]))
            if size > 1:
                grads_work = self._exchange(travelling, arriving, GRAD_TAG)
                sent += travelling.nbytes
            if work is not None:
                work.wait()
                blocks = inbox[step]
        if grads_work is not None:                # this rank's own block, complete
            grads_work.wait()
            travelling = arriving
        self.sent_bytes = {"forward": self.sent_bytes["forward"], "backward": sent}
        dtype = saved["dtype"]
        dq = ungroup_queries(dq, saved["shape"][2])
        return (self.to_tokens_first(dq, dtype, xp), self.to_tokens_first(travelling[0], dtype, xp),
                self.to_tokens_first(travelling[1], dtype, xp))


class _Inboxes:
    """Where step s's incoming block lands: two buffers taken in turn, never the rank's own
    block (forward keeps it for backward). Step s receives into one while sending the other,
    whose previous receive (step s - 1) has finished; a buffer is made when first needed."""

    def __init__(self, like: Any, xp: Any):
        self._like, self._xp = like, xp
        self._buffers: list = []

    def __getitem__(self, step: int) -> Any:
        while len(self._buffers) <= step % 2:
            self._buffers.append(self._xp.empty_like(self._like))
        return self._buffers[step % 2]
