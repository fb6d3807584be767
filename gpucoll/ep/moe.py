"""A mixture-of-experts layer with its experts spread over the ranks (expert parallelism).

Each rank holds ``experts_per_rank`` experts (rank r: global experts ``r * k`` to
``r * k + k - 1``) and a copy of the gate. Forward, for this rank's tokens ``x`` (T, d):

1. gate: ``probs = softmax(x @ gate)``; each token goes to its most probable expert (top-1) and
   its output is scaled by that probability (so the gate learns through it);
2. dispatch: one small ``all_gather`` gives every rank how many tokens each rank sends each
   expert; tokens sorted by expert (and so by the rank holding it) then go there in one
   ``all_to_all_v`` with that count matrix known (``counts=``), and each rank tells from the
   same table which of its experts each received token is for;
3. each rank runs its experts (``relu(x @ w1) @ w2``) on the tokens it received;
4. combine: the outputs go back in one ``all_to_all_v`` with the count matrix transposed, and
   are put back in token order.

Backward runs the same two exchanges, with the same matrix, so a step exchanges counts once:
output gradients to the experts, input gradients back. Gradients are those of the sum of every rank's loss: an expert's are complete on
its rank (every token routed to it came there), the gate's are summed over the ranks with one
``all_reduce``. No token is dropped (no capacity limit) and there is no load-balancing loss: the
layer is the exchange pattern, written plainly.

Only the ``Communicator`` interface is used; arrays are NumPy or CuPy (the weights' module).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..hostarrays import array_module as _array_module

__all__ = ["MoELayer", "init_experts"]


def _host_array(values: Any) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else values.get()


def init_experts(num_experts: int, features: int, hidden: int, *, seed: int = 0, xp: Any = np,
                 dtype: Any = np.float32) -> Tuple[Any, List[Tuple[Any, Any]]]:
    """(gate (features, num_experts), [(w1 (features, hidden), w2 (hidden, features)), ...]):
    every expert of the model, the same on every rank for the same seed (each rank keeps its
    own slice of the list)."""
    rng = np.random.default_rng(seed)
    gate = rng.normal(0.0, 1.0 / np.sqrt(features), (features, num_experts))
    experts = [(xp.asarray(rng.normal(0.0, np.sqrt(2.0 / features), (features, hidden)), dtype),
                xp.asarray(rng.normal(0.0, np.sqrt(2.0 / hidden), (hidden, features)), dtype))
               for _ in range(num_experts)]
    return xp.asarray(gate, dtype), experts


class MoELayer:
    """Top-1 mixture of experts; this rank holds ``experts`` (see the module doc).

    Args:
        comm: the expert-parallel group (any gpucoll ``Communicator``).
        gate: the gate's weight, ``(features, experts_per_rank * comm.size)``, the same on
            every rank.
        experts: this rank's experts, ``[(w1 (features, hidden), w2 (hidden, features)), ...]``;
            every rank holds as many.

    Raises:
        ValueError: shapes that do not fit together, or ranks holding different numbers of
            experts (checked with one small all_gather when the layer is made, on every rank).

    Example (two ranks, four experts)::

        gate, experts = init_experts(4, 16, 32, seed=0)
        layer = MoELayer(comm, gate, experts[2 * comm.rank:2 * comm.rank + 2])
        y = layer.forward(x)                 # x: this rank's tokens (T, 16)
        grad_x = layer.backward(grad_y)      # layer.grads: gate, then w1, w2 per expert
    """

    def __init__(self, comm, gate: Any, experts: Sequence[Tuple[Any, Any]]) -> None:
        if not experts:
            raise ValueError("MoELayer: this rank holds no experts")
        features = int(gate.shape[0])
        for index, (w1, w2) in enumerate(experts):
            if w1.ndim != 2 or w2.ndim != 2 or w1.shape[0] != features or \
                    w2.shape != (w1.shape[1], features):
                raise ValueError(f"MoELayer: expert {index} has w1 {tuple(w1.shape)} and w2 "
                                 f"{tuple(w2.shape)}; expected ({features}, h) and (h, {features})")
        held = comm.all_gather_object(len(experts))
        if len(set(held)) > 1:
            raise ValueError(f"MoELayer: every rank must hold as many experts; ranks hold {held}")
        if gate.ndim != 2 or gate.shape[1] != len(experts) * comm.size:
            raise ValueError(f"MoELayer: gate has shape {tuple(gate.shape)}; expected ({features}, "
                             f"{len(experts) * comm.size}) for {len(experts)} experts on each of "
                             f"{comm.size} ranks")
        self.comm, self.gate = comm, gate
        self.experts = [tuple(pair) for pair in experts]
        self.per_rank = len(experts)
        self.xp = _array_module(gate)
        self.gate_grad: Optional[Any] = None
        self.expert_grads: List[Tuple[Any, Any]] = []
        self._saved: Optional[dict] = None

    @property
    def params(self) -> List[Any]:
        """The gate, then ``w1``, ``w2`` of each expert this rank holds."""
        return [self.gate] + [w for pair in self.experts for w in pair]

    @property
    def grads(self) -> List[Any]:
        """Gradients in the order of :attr:`params` (after :meth:`backward`)."""
        return [self.gate_grad] + [g for pair in self.expert_grads for g in pair]

    def full_params(self) -> Tuple[Any, List[Tuple[Any, Any]]]:
        """``(gate, experts)``: a copy of the gate and every expert of the model as
        ``(w1, w2)`` in global order (rank 0's first), gathered from every rank: to save the
        layer, or to spread the experts again over another number of ranks. Experts may
        differ in hidden size. A collective: every rank of the group calls it.

        Raises:
            TypeError: the experts are not all of one dtype (on every rank, before the
                weights move).
        """
        xp = self.xp
        mine = [(int(w1.shape[1]), np.dtype(w1.dtype).name, np.dtype(w2.dtype).name)
                for w1, w2 in self.experts]
        layouts = self.comm.all_gather_object(mine)   # hidden sizes and dtypes of every rank
        dtypes = sorted({name for layout in layouts for _, *names in layout for name in names})
        if len(dtypes) > 1:
            raise TypeError(f"MoELayer.full_params: the experts' weights must share one dtype; "
                            f"the ranks hold {dtypes}")
        flat = xp.concatenate([xp.ravel(w) for pair in self.experts for w in pair])
        gathered, _ = self.comm.all_gather_v(flat)
        features, experts, at = int(self.gate.shape[0]), [], 0
        for layout in layouts:
            for hidden, _, _ in layout:
                size = features * hidden
                w1 = gathered[at:at + size].reshape(features, hidden)
                w2 = gathered[at + size:at + 2 * size].reshape(hidden, features)
                experts.append((w1, w2))
                at += 2 * size
        return self.gate.copy(), experts

    def tokens_per_expert(self) -> List[int]:
        """How many tokens each of this rank's experts took in the last forward."""
        if self._saved is None:
            raise RuntimeError("MoELayer: no forward yet")
        return [int(mask.sum()) for mask in self._saved["masks"]]

    # ------------------------------------------------------------------ forward
    def _route(self, per_expert: Any) -> Tuple[np.ndarray, Any]:
        """``(matrix, local)`` from this rank's token count per expert: ``matrix[s, d]``
        tokens rank s sends rank d (every rank's counts, one all_gather), and for each token
        this rank will receive (senders in rank order, each sorted by expert) the index of its
        expert among this rank's."""
        k, me = self.per_rank, self.comm.rank
        table = _host_array(self.comm.all_gather(per_expert)).astype(np.int64)  # (ranks, experts)
        matrix = table.reshape(self.comm.size, self.comm.size, k).sum(axis=2)
        mine = table[:, me * k:(me + 1) * k]  # (senders, my experts)
        local = np.repeat(np.tile(np.arange(k, dtype=np.int64), self.comm.size), mine.reshape(-1))
        return matrix, self.xp.asarray(local)

    def forward(self, x: Any) -> Any:
        """This rank's tokens ``x`` (T, features) through the layer: ``(T, features)``."""
        xp = self.xp
        if x.ndim != 2 or x.shape[1] != self.gate.shape[0]:
            raise ValueError(f"MoELayer.forward: x has shape {tuple(x.shape)}; expected "
                             f"(tokens, {self.gate.shape[0]})")
        logits = x @ self.gate
        logits = logits - logits.max(axis=1, keepdims=True)
        probs = xp.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        choice = probs.argmax(axis=1)
        rows = xp.arange(x.shape[0])
        weight = probs[rows, choice]
        order = xp.argsort(choice, kind="stable")  # by expert, and so by the rank holding it
        matrix, local = self._route(xp.bincount(choice, minlength=self.gate.shape[1]))
        tokens, _ = self.comm.all_to_all_v(x[order], counts=matrix)
        masks, hidden = [], []
        out = xp.empty_like(tokens)
        for index, (w1, w2) in enumerate(self.experts):
            mask = local == index
            pre = tokens[mask] @ w1
            h = xp.maximum(pre, 0)
            out[mask] = h @ w2
            masks.append(mask)
            hidden.append((pre, h))
        back, _ = self.comm.all_to_all_v(out, counts=matrix.T)
        expert_out = xp.empty_like(back)
        expert_out[order] = back
        self._saved = dict(x=x, probs=probs, choice=choice, weight=weight, order=order,
                           matrix=matrix, tokens=tokens, masks=masks, hidden=hidden,
                           expert_out=expert_out)
        return weight[:, None] * expert_out

    # ------------------------------------------------------------------ backward
    def backward(self, grad_output: Any) -> Any:
        """Gradient of the loss with respect to this rank's ``x``; sets :attr:`grads`."""
        if self._saved is None:
            raise RuntimeError("MoELayer.backward: call forward first")
        s, xp = self._saved, self.xp
        if grad_output.shape != s["x"].shape:
            raise ValueError(f"MoELayer.backward: grad_output has shape {tuple(grad_output.shape)}; "
                             f"expected {tuple(s['x'].shape)} (the forward's x)")
        grad_weight = (grad_output * s["expert_out"]).sum(axis=1)
        grad_expert_out = s["weight"][:, None] * grad_output
        grad_out, _ = self.comm.all_to_all_v(grad_expert_out[s["order"]], counts=s["matrix"])
        grad_tokens = xp.zeros_like(s["tokens"])
        self.expert_grads = []
        for (w1, w2), mask, (pre, h) in zip(self.experts, s["masks"], s["hidden"]):
            g = grad_out[mask]
            grad_h = (g @ w2.T) * (pre > 0)
            self.expert_grads.append((s["tokens"][mask].T @ grad_h, h.T @ g))
            grad_tokens[mask] = grad_h @ w1.T
        back, _ = self.comm.all_to_all_v(grad_tokens, counts=s["matrix"].T)
        grad_x = xp.empty_like(back)
        grad_x[s["order"]] = back
        # softmax backward: only the chosen probability has a gradient
        probs = s["probs"]
        grad_probs = xp.zeros_like(probs)
        grad_probs[xp.arange(probs.shape[0]), s["choice"]] = grad_weight
        grad_logits = probs * (grad_probs - (grad_probs * probs).sum(axis=1, keepdims=True))
        gate_grad = s["x"].T @ grad_logits
        self.gate_grad = self.comm.all_reduce(gate_grad)
        return grad_x + grad_logits @ self.gate.T
