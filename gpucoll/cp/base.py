"""What the context-parallel attention layers share: input checks, layouts, compute dtype.

Callers give ``q`` as ``(batch, local_seq, heads, head_dim)`` and ``k, v`` as ``(batch,
local_seq, kv_heads, head_dim)``: this rank's tokens (see :mod:`gpucoll.cp.sharding`) of every
head. ``kv_heads`` divides ``heads`` (grouped-query attention; 1 is multi-query attention):
query head h uses key/value head ``h // (heads // kv_heads)``, the grouping of Hugging Face's
``repeat_kv`` and PyTorch's ``enable_gqa``. The math runs on ``(batch, heads, seq, head_dim)``
in float32 for 16-bit inputs (float32 / float64 inputs keep their type); outputs and gradients
come back in the inputs' dtype and layout.

Grouped queries are computed without repeating keys and values: the queries of one group are
laid end to end as the rows of their key/value head (:func:`group_queries`), each group's rows
with the same segments (:func:`grouped_segments`), so the blockwise math sees ``kv_heads`` heads
with ``group * seq`` query rows, and the key/value gradients sum over the group as they
accumulate.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..hostarrays import array_module
from .sharding import SHARDINGS, sequence_segments

__all__ = ["ContextParallelAttention", "group_queries", "grouped_segments", "ungroup_queries"]


class ContextParallelAttention:
    """Base of :class:`RingAttention` and :class:`UlyssesAttention` (checks and bookkeeping).

    Attributes:
        sent_bytes: bytes this rank sent in the last ``forward`` and ``backward``
            (``{"forward": n, "backward": n}``).
    """

    def __init__(self, comm, *, causal: bool = False, sharding: str = "contiguous",
                 scale: Optional[float] = None):
        if sharding not in SHARDINGS:
            raise ValueError(f"{type(self).__name__}: sharding must be one of {SHARDINGS}, "
                             f"got {sharding!r}")
        if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(f"{type(self).__name__}: scale must be a positive number, got "
                             f"{scale!r}")
        self.comm, self.causal, self.sharding, self.scale = comm, bool(causal), sharding, scale
        self.sent_bytes: Dict[str, int] = {"forward": 0, "backward": 0}
        self._saved: Optional[dict] = None

    # ------------------------------------------------------------------ checks
    def _check_inputs(self, q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
        """(array module, compute dtype) after checking shapes, dtypes and the sharding."""
        name = type(self).__name__
        for label, x in (("q", q), ("k", k), ("v", v)):
            if getattr(x, "ndim", None) != 4:
                raise ValueError(f"{name}: {label} must be (batch, local_seq, heads, head_dim), "
                                 f"got shape {getattr(x, 'shape', None)}")
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"{name}: k and v must have one shape, got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        (batch, seq, heads, dim), kv_heads = tuple(q.shape), int(k.shape[2])
        if (int(k.shape[0]), int(k.shape[1]), int(k.shape[3])) != (batch, seq, dim):
            raise ValueError(f"{name}: q and k, v must agree in batch, local_seq and head_dim, "
                             f"got q {tuple(q.shape)}, k and v {tuple(k.shape)}")
        if kv_heads and heads % kv_heads:
            raise ValueError(f"{name}: q's {heads} heads are not a multiple of k and v's "
                             f"{kv_heads} heads (grouped-query attention needs heads % kv_heads "
                             f"== 0)")
        if not q.dtype == k.dtype == v.dtype:
            raise TypeError(f"{name}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, "
                            f"{v.dtype}")
        xp = array_module(q)
        if array_module(k) is not xp or array_module(v) is not xp:
            raise TypeError(f"{name}: q, k and v must be arrays of one library (all NumPy or "
                            f"all CuPy)")
        if 0 in tuple(q.shape) + tuple(k.shape):
            raise ValueError(f"{name}: q, k and v must have no empty axis, got shapes "
                             f"{tuple(q.shape)}, {tuple(k.shape)}")
        kind = np.dtype(q.dtype)
        if kind.kind != "f" and kind.name != "bfloat16":
            raise TypeError(f"{name}: q, k and v must be floating point, got {kind}")
        total = int(q.shape[1]) * self.comm.size
        try:
            sequence_segments(total, self.comm.rank, self.comm.size, self.sharding)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc} ({q.shape[1]} tokens on each of {self.comm.size} "
                             f"ranks)") from None
        compute = np.dtype(np.float32) if kind.itemsize < 4 else kind
        return xp, compute

    def _scale(self, head_dim: int) -> float:
        return float(self.scale) if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def _saved_for(self, grad_out: Any, what: str) -> dict:
        if self._saved is None:
            raise RuntimeError(f"{type(self).__name__}: backward() called before forward() (or "
                               f"twice for one forward)")
        if tuple(grad_out.shape) != self._saved["shape"]:
            raise ValueError(f"{type(self).__name__}: {what} has shape {tuple(grad_out.shape)}, "
                             f"the forward's output {self._saved['shape']}")
        saved, self._saved = self._saved, None
        return saved

    # ------------------------------------------------------------------ layouts
    def local_segments(self, total: int, rank: int, offset: int = 0) -> List[Tuple[int, int, int]]:
        """Rank ``rank``'s segments as (local offset, global start, length), shifted by
        ``offset`` (where its tokens start in a buffer holding several ranks' tokens)."""
        segments, at = [], offset
        for start, length in sequence_segments(total, rank, self.comm.size, self.sharding):
            segments.append((at, start, length))
            at += length
        return segments

    @staticmethod
    def to_heads_first(x: Any, dtype: Any, xp: Any) -> Any:
        """(batch, seq, heads, dim) -> contiguous (batch, heads, seq, dim) in ``dtype``."""
        return xp.ascontiguousarray(x.transpose(0, 2, 1, 3).astype(dtype, copy=False))

    @staticmethod
    def to_tokens_first(x: Any, dtype: Any, xp: Any) -> Any:
        """(batch, heads, seq, dim) -> contiguous (batch, seq, heads, dim) in ``dtype``."""
        return xp.ascontiguousarray(x.transpose(0, 2, 1, 3)).astype(dtype, copy=False)


# ---------------------------------------------------------------------- grouped queries
def group_queries(queries: Any, kv_heads: int) -> Any:
    """(batch, heads, seq, dim) -> (batch, kv_heads, group * seq, dim), no copy: the rows of
    key/value head j are query heads ``j * group ... (j + 1) * group - 1``, one after another."""
    batch, heads, seq, dim = queries.shape
    return queries.reshape(batch, kv_heads, (heads // kv_heads) * seq, dim)


def ungroup_queries(grouped: Any, heads: int) -> Any:
    """The inverse of :func:`group_queries`: (batch, kv_heads, group * seq, dim) ->
    (batch, heads, seq, dim)."""
    batch, kv_heads, rows, dim = grouped.shape
    return grouped.reshape(batch, heads, rows * kv_heads // heads, dim)


def grouped_segments(segments: List[Tuple[int, int, int]], group: int,
                     seq: int) -> List[Tuple[int, int, int]]:
    """``segments`` (local offset, global start, length) of a ``seq``-row query array, for the
    ``group`` query heads laid end to end by :func:`group_queries` (same positions, offsets
    shifted by ``seq`` per head)."""
    return [(head * seq + offset, start, length)
            for head in range(group) for offset, start, length in segments]
