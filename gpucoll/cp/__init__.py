"""Context (sequence) parallelism: attention over a sequence split by tokens across ranks.

* :class:`RingAttention` - keys and values go around the ring, overlapped with the math;
  exact softmax attention, memory per rank independent of the other ranks' tokens.
* :class:`UlyssesAttention` - two all-to-alls swap the token split for a head split.
* :func:`shard_sequence`, :func:`unshard_sequence`, :func:`sequence_positions` - the
  ``"contiguous"`` and ``"zigzag"`` (causal load-balanced) splits of a sequence.

Both layers take ``q, k, v`` as ``(batch, local_seq, heads, head_dim)`` NumPy or CuPy arrays and
return the output and ``(dq, dk, dv)`` in the same layout; ``k, v`` may have fewer heads
(grouped-query / multi-query attention, ``heads % kv_heads == 0``). Only the ``Communicator``
interface is used. Importing this package never imports CuPy.
"""

from .ring import RingAttention
from .sharding import sequence_positions, sequence_segments, shard_sequence, unshard_sequence
from .ulysses import UlyssesAttention

__all__ = ["RingAttention", "UlyssesAttention", "shard_sequence", "unshard_sequence",
           "sequence_positions", "sequence_segments"]
