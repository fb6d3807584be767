"""Attention over blocks of keys with running softmax statistics, forward and backward.

The context-parallel layers never hold the whole ``S x S`` score matrix: queries meet keys one
segment pair at a time (see :mod:`gpucoll.cp.sharding` for segments), and the softmax is
accumulated online (running maximum, sum of exponentials, weighted values), the way blockwise /
flash attention does. A block's result is ``(out, lse)``: the output normalized over the keys
seen so far and the log-sum-exp of their scores, so results over disjoint key sets merge
exactly (:func:`merge`). Backward recomputes each block's probabilities from the final
``lse``, so it needs only ``q, k, v``, the output and ``lse``.

Arrays here are ``(batch, heads, seq, head_dim)`` in the compute dtype (float32 for 16-bit
inputs); segments are ``(local offset, first global position, length)``. With ``causal`` a query
at position i sees keys at positions <= i: a segment pair is fully visible, hidden (skipped,
no work) or overlapping (masked by positions).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["attend", "attend_backward", "merge", "visibility", "visible_pairs"]

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


def _rows(x: Any, seg: LocalSegment) -> Any:
    return x[:, :, seg[0]:seg[0] + seg[2]]


def attend(q: Any, k: Any, v: Any, q_segs: Sequence[LocalSegment],
           k_segs: Sequence[LocalSegment], causal: bool, scale: float,
           xp: Any) -> Optional[Tuple[Any, Any]]:
    """``(out, lse)`` of ``q`` over the keys of ``k_segs``, or None when every pair is hidden.

    Rows that see no key get ``out = 0`` and ``lse = -inf`` (they merge as nothing).
    """
    batch, heads, rows, _ = q.shape
    out = xp.zeros_like(q)
    lse = xp.full((batch, heads, rows), -xp.inf, dtype=q.dtype)
    any_visible = False
    for q_seg in q_segs:
        qi = _rows(q, q_seg)
        running_max = xp.full(qi.shape[:3], -xp.inf, dtype=q.dtype)
        total = xp.zeros(qi.shape[:3], dtype=q.dtype)
        weighted = xp.zeros_like(qi)
        for k_seg in k_segs:
            mask = _mask(q_seg, k_seg, causal, xp)
            if mask is False:
                continue
            any_visible = True
            scores = (qi @ _rows(k, k_seg).swapaxes(-1, -2)) * scale
            if mask is not None:
                scores = xp.where(mask, scores, -xp.inf)
            new_max = xp.maximum(running_max, scores.max(axis=-1))
            shift = xp.where(xp.isneginf(new_max), 0, new_max)
            probs = xp.exp(scores - shift[..., None])
            decay = xp.exp(running_max - shift)
            total = total * decay + probs.sum(axis=-1)
            weighted = weighted * decay[..., None] + probs @ _rows(v, k_seg)
            running_max = new_max
        seen = total > 0
        safe_total = xp.where(seen, total, 1)
        shift = xp.where(xp.isneginf(running_max), 0, running_max)
        out[:, :, q_seg[0]:q_seg[0] + q_seg[2]] = weighted / safe_total[..., None]
        lse[:, :, q_seg[0]:q_seg[0] + q_seg[2]] = xp.where(seen, shift + xp.log(safe_total),
                                                           -xp.inf)
    return (out, lse) if any_visible else None


def merge(out: Any, lse: Any, block_out: Any, block_lse: Any, xp: Any) -> None:
    """Fold a block's ``(out, lse)`` into the running ``(out, lse)`` in place."""
    new_lse = xp.logaddexp(lse, block_lse)
    shift = xp.where(xp.isneginf(new_lse), 0, new_lse)
    out *= xp.exp(lse - shift)[..., None]
    out += block_out * xp.exp(block_lse - shift)[..., None]
    lse[...] = new_lse


def attend_backward(q: Any, k: Any, v: Any, grad_out: Any, lse: Any, delta: Any,
                    q_segs: Sequence[LocalSegment], k_segs: Sequence[LocalSegment],
                    causal: bool, scale: float, xp: Any) -> Optional[List[Any]]:
    """``[dq, dk, dv]`` of this block (queries ``q`` against keys ``k_segs``), given the
    whole attention's ``lse`` and ``delta = sum(grad_out * out, -1)``; None when every pair
    is hidden."""
    dq, dk, dv = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    shift = xp.where(xp.isneginf(lse), 0, lse)
    any_visible = False
    for q_seg in q_segs:
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
