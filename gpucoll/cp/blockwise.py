"""Attention over blocks of keys with running softmax statistics, forward and backward.

The context-parallel layers never hold the whole ``S x S`` score matrix: queries meet keys one
segment pair at a time (see :mod:`gpucoll.cp.sharding` for segments), and the softmax is
accumulated online in a :class:`RunningSoftmax` (largest score, sum of exponentials, weighted
values), the way blockwise / flash attention does, over as many blocks of keys as arrive (ring
attention folds in one rank's keys per step). Its result is ``(out, lse)``: the output and the
log-sum-exp of every score of the row. Backward recomputes each block's probabilities from
that ``lse``, so it needs only ``q, k, v``, the output and ``lse``.

Arrays here are ``(batch, heads, seq, head_dim)`` in the compute dtype (float32 for 16-bit
inputs); segments are ``(local offset, first global position, length)``. With ``causal`` a query
at position i sees keys at positions <= i: a segment pair is fully visible, hidden (skipped,
no work) or overlapping (masked by positions).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["RunningSoftmax", "attend", "attend_backward", "visibility", "visible_pairs"]

LocalSegment = Tuple[int, int, int]  # (offset in the local array, first global position, length)


def visibility(q_seg: LocalSegment, k_seg: LocalSegment, causal: bool) -> str:
    """"full", "hidden" (every query comes before every key) or "masked" (they overlap)."""
    if not causal:
        return "full"
    _, q_start, q_len = q_seg
    _, k_start, k_len = k_seg
    if q_start + q_len - 1 < k_start:
        return "hidden"
    if q_start >= k_start + k_len - 1:
        return "full"
    return "masked"


def visible_pairs(q_segs: Sequence[LocalSegment], k_segs: Sequence[LocalSegment],
                  causal: bool) -> int:
    """How many segment pairs have any visible key (the blocks that cost work)."""
    return sum(visibility(q, k, causal) != "hidden" for q in q_segs for k in k_segs)


def _mask(q_seg: LocalSegment, k_seg: LocalSegment, causal: bool, xp: Any):
    """None (all visible), False (all hidden) or a (q_len, k_len) bool mask."""
    seen = visibility(q_seg, k_seg, causal)
    if seen != "masked":
        return None if seen == "full" else False
    q_pos = xp.arange(q_seg[1], q_seg[1] + q_seg[2])
    k_pos = xp.arange(k_seg[1], k_seg[1] + k_seg[2])
    return q_pos[:, None] >= k_pos[None, :]


TILE_SCORES = 1 << 20  # score elements per tile: a few MB per temporary, so they stay in cache


def _tiles(q: Any, q_segs: Sequence[LocalSegment],
           k_segs: Sequence[LocalSegment]) -> List[LocalSegment]:
    """``q_segs`` cut into runs of rows whose scores against one key segment take at most
    :data:`TILE_SCORES` elements (the element-wise softmax work is bound by memory, and a
    tile's temporaries then stay in cache; a tile of a diagonal pair may also be hidden)."""
    widest = max((seg[2] for seg in k_segs), default=1)
    rows = max(1, TILE_SCORES // max(1, q.shape[0] * q.shape[1] * widest))
    return [(offset + at, start + at, min(rows, length - at))
            for offset, start, length in q_segs for at in range(0, length, rows)]


def _rows(x: Any, seg: LocalSegment) -> Any:
    return x[:, :, seg[0]:seg[0] + seg[2]]


class RunningSoftmax:
    """Every query row's running softmax over the keys seen so far: the largest score, the sum
    of exponentials (relative to it) and the values weighted by them; :meth:`finish` gives
    ``(out, lse)``."""

    def __init__(self, q: Any, xp: Any):
        self.xp = xp
        self.largest = xp.full(q.shape[:3], -xp.inf, dtype=q.dtype)
        self.total = xp.zeros(q.shape[:3], dtype=q.dtype)
        self.weighted = xp.zeros_like(q)

    def finish(self) -> Tuple[Any, Any]:
        """``(out, lse)``: rows that saw no key get ``out = 0`` and ``lse = -inf``."""
        xp = self.xp
        seen = self.total > 0
        total = xp.where(seen, self.total, 1)
        shift = xp.where(xp.isneginf(self.largest), 0, self.largest)
        return self.weighted / total[..., None], xp.where(seen, shift + xp.log(total), -xp.inf)


def attend(q: Any, k: Any, v: Any, q_segs: Sequence[LocalSegment],
           k_segs: Sequence[LocalSegment], causal: bool, scale: float, xp: Any,
           state: RunningSoftmax) -> bool:
    """Fold the keys of ``k_segs`` into ``state``, the running softmax of ``q``'s rows;
    False when every pair is hidden (nothing was done)."""
    any_visible = False
    for q_seg in _tiles(q, q_segs, k_segs):
        qi = _rows(q, q_seg)
        rows = slice(q_seg[0], q_seg[0] + q_seg[2])
        for k_seg in k_segs:
            mask = _mask(q_seg, k_seg, causal, xp)
            if mask is False:
                continue
            any_visible = True
            scores = (qi @ _rows(k, k_seg).swapaxes(-1, -2)) * scale
            if mask is not None:
                scores = xp.where(mask, scores, -xp.inf)
            largest = state.largest[:, :, rows]
            new_largest = xp.maximum(largest, scores.max(axis=-1))
            shift = xp.where(xp.isneginf(new_largest), 0, new_largest)
            probs = xp.exp(scores - shift[..., None])
            decay = xp.exp(largest - shift)
            state.total[:, :, rows] = state.total[:, :, rows] * decay + probs.sum(axis=-1)
            state.weighted[:, :, rows] = (state.weighted[:, :, rows] * decay[..., None]
                                          + probs @ _rows(v, k_seg))
            state.largest[:, :, rows] = new_largest
    return any_visible


def attend_backward(q: Any, k: Any, v: Any, grad_out: Any, lse: Any, delta: Any,
                    q_segs: Sequence[LocalSegment], k_segs: Sequence[LocalSegment],
                    causal: bool, scale: float, xp: Any,
                    into: Optional[Sequence[Any]] = None) -> Optional[List[Any]]:
    """``[dq, dk, dv]`` of this block (queries ``q`` against keys ``k_segs``), given the
    whole attention's ``lse`` and ``delta = sum(grad_out * out, -1)``; None when every pair
    is hidden. With ``into`` (three arrays shaped like q, k, v) the block's gradients are
    added to those instead (no new arrays; ring attention accumulates over its steps)."""
    dq, dk, dv = (xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)) if into is None \
        else into
    shift = xp.where(xp.isneginf(lse), 0, lse)
    any_visible = False
    for q_seg in _tiles(q, q_segs, k_segs):
        qi, gi = _rows(q, q_seg), _rows(grad_out, q_seg)
        lse_i, delta_i = _rows(shift, q_seg)[..., None], _rows(delta, q_seg)[..., None]
        for k_seg in k_segs:
            mask = _mask(q_seg, k_seg, causal, xp)
            if mask is False:
                continue
            any_visible = True
            kj, vj = _rows(k, k_seg), _rows(v, k_seg)
            probs = xp.exp((qi @ kj.swapaxes(-1, -2)) * scale - lse_i)
            if mask is not None:
                probs = xp.where(mask, probs, 0)
            _rows(dv, k_seg)[...] += probs.swapaxes(-1, -2) @ gi
            dscores = probs * (gi @ vj.swapaxes(-1, -2) - delta_i)
            _rows(dq, q_seg)[...] += (dscores @ kj) * scale
            _rows(dk, k_seg)[...] += (dscores.swapaxes(-1, -2) @ qi) * scale
    return [dq, dk, dv] if any_visible else None
