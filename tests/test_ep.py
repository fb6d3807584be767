"""Expert parallelism (gpucoll.ep.MoELayer) against a one-process NumPy model, in real processes.

The reference runs every token through the whole model one at a time (gate, softmax, top-1
expert, scaled output, and the backward by hand), with no sorting and no exchange: the layer's
outputs, input gradients, expert gradients (on the rank holding each expert) and gate gradient
(summed over ranks) must equal it, at 1 to 3 ranks, with uneven token counts, a rank with no
tokens, and every token routed to one expert (so other ranks' experts get none).
"""

from __future__ import annotations

import numpy as np
import pytest

from mp_harness import error_text, rank_pools

pytestmark = pytest.mark.timeout(180)

FEATURES, HIDDEN, PER_RANK = 6, 5, 2
TOLERANCE = dict(rtol=1e-10, atol=1e-12)


def tokens_of(rank, size, case, seed=3):
    counts = {"uneven": 5 + 4 * rank, "one_empty": 0 if rank == size - 1 else 6,
              "one_expert": 4 + rank}
    x = np.random.default_rng(seed + 10 * rank).normal(size=(counts[case], FEATURES))
    if case == "one_expert":
        x[:, 0] = 1.0
    return x


def grad_of(rank, x):
    return np.random.default_rng(100 + rank).normal(size=x.shape)


def model(size, case):
    from gpucoll.ep import init_experts

    gate, experts = init_experts(PER_RANK * size, FEATURES, HIDDEN, seed=7, dtype=np.float64)
    if case == "one_expert":
        gate[0, 0] = 50.0  # feature 0 is 1 on every token: expert 0 always wins
    return gate, experts


def reference(size, case):
    """Per token, by hand: outputs, input gradients, expert and gate gradients, expert loads."""
    gate, experts = model(size, case)
    xs = [tokens_of(r, size, case) for r in range(size)]
    ys, dxs = [], []
    dgate = np.zeros_like(gate)
    dexperts = [(np.zeros_like(w1), np.zeros_like(w2)) for w1, w2 in experts]
    load = np.zeros(len(experts), int)
    for r, x in enumerate(xs):
        y, dx = np.zeros_like(x), np.zeros_like(x)
        for t, token in enumerate(x):
            logits = token @ gate
            p = np.exp(logits - logits.max())
            p /= p.sum()
            e = int(np.argmax(p))
            load[e] += 1
            w1, w2 = experts[e]
            pre = token @ w1
            h = np.maximum(pre, 0.0)
            o = h @ w2
            y[t] = p[e] * o
            g = grad_of(r, x)[t]
            dp_e = g @ o
            do = p[e] * g
            dexperts[e][1][...] += np.outer(h, do)
            dh = (w2 @ do) * (pre > 0)
            dexperts[e][0][...] += np.outer(token, dh)
            dlogits = -p * p[e] * dp_e
            dlogits[e] += p[e] * dp_e
            dgate += np.outer(token, dlogits)
            dx[t] = w1 @ dh + gate @ dlogits
        ys.append(y)
        dxs.append(dx)
    return ys, dxs, dexperts, dgate, load


pool = rank_pools([1, 2, 3], ids=lambda n: f"world{n}", shared=True)


def rank_moe(comm, case):
    from gpucoll.ep import MoELayer

    gate, experts = model(comm.size, case)
    mine = experts[comm.rank * PER_RANK:(comm.rank + 1) * PER_RANK]
    layer = MoELayer(comm, gate, mine)
    x = tokens_of(comm.rank, comm.size, case)
    y = layer.forward(x)
    dx = layer.backward(grad_of(comm.rank, x))
    assert len(layer.params) == len(layer.grads) == 1 + 2 * PER_RANK
    return y, dx, layer.expert_grads, layer.gate_grad, layer.tokens_per_expert()


@pytest.mark.parametrize("case", ["uneven", "one_empty", "one_expert"])
def test_moe_matches_the_one_process_model(pool, case):
    n = pool.world_size
    ys, dxs, dexperts, dgate, load = reference(n, case)
    if case == "one_expert":
        assert load[0] == load.sum() > 0  # the case does what it says
    for rank, (y, dx, expert_grads, gate_grad, tokens) in enumerate(pool.run(rank_moe, case)):
        np.testing.assert_allclose(y, ys[rank], **TOLERANCE)
        np.testing.assert_allclose(dx, dxs[rank], **TOLERANCE)
        np.testing.assert_allclose(gate_grad, dgate, **TOLERANCE)
        held = range(rank * PER_RANK, (rank + 1) * PER_RANK)
        assert tokens == [int(load[e]) for e in held]
        for (dw1, dw2), e in zip(expert_grads, held):
            np.testing.assert_allclose(dw1, dexperts[e][0], **TOLERANCE)
            np.testing.assert_allclose(dw2, dexperts[e][1], **TOLERANCE)


def _error(call):
    return error_text(call, (TypeError, ValueError, RuntimeError))


def rank_bad_layers(comm):
    from gpucoll.ep import MoELayer, init_experts

    n, r = comm.size, comm.rank
    gate, experts = init_experts(PER_RANK * n, FEATURES, HIDDEN, dtype=np.float64)
    mine = experts[r * PER_RANK:(r + 1) * PER_RANK]
    layer = MoELayer(comm, gate, mine)
    local = [
        _error(lambda: MoELayer(comm, gate, [])),
        _error(lambda: MoELayer(comm, gate, [(mine[0][0], mine[0][0])])),
        _error(lambda: layer.backward(np.zeros((2, FEATURES)))),
        _error(lambda: layer.forward(np.zeros((2, FEATURES + 1)))),
        _error(lambda: layer.tokens_per_expert()),
    ]
    uneven = _error(lambda: MoELayer(comm, gate, mine[:1] if r == n - 1 else mine))
    wrong_gate = _error(lambda: MoELayer(comm, gate[:, :-1], mine))
    layer.forward(np.ones((3, FEATURES)))
    local.append(_error(lambda: layer.backward(np.ones((2, FEATURES)))))
    after = layer.backward(np.ones((3, FEATURES)))  # still usable
    return local, uneven, wrong_gate, after


def test_moe_bad_input(pool):
    n = pool.world_size
    for rank, (local, uneven, wrong_gate, after) in enumerate(pool.run(rank_bad_layers)):
        assert local[0] == "ValueError: MoELayer: this rank holds no experts"
        assert local[1] == (f"ValueError: MoELayer: expert 0 has w1 ({FEATURES}, {HIDDEN}) and w2 "
                            f"({FEATURES}, {HIDDEN}); expected ({FEATURES}, h) and (h, {FEATURES})")
        assert local[2] == "RuntimeError: MoELayer.backward: call forward first"
        assert local[3] == (f"ValueError: MoELayer.forward: x has shape (2, {FEATURES + 1}); "
                            f"expected (tokens, {FEATURES})")
        assert local[4] == "RuntimeError: MoELayer: no forward yet"
        if n > 1:
            assert uneven == (f"ValueError: MoELayer: every rank must hold as many experts; ranks "
                              f"hold {[PER_RANK] * (n - 1) + [1]}")
        assert wrong_gate.startswith(f"ValueError: MoELayer: gate has shape ({FEATURES}, "
                                     f"{PER_RANK * n - 1})")
        assert local[5] == (f"ValueError: MoELayer.backward: grad_output has shape (2, {FEATURES}); "
                            f"expected (3, {FEATURES}) (the forward's x)")
        assert after.shape == (3, FEATURES) and np.isfinite(after).all()


def rank_full_params(comm):
    """Rank r's experts have hidden size HIDDEN + r + index and are moved by 1000 (r + 1);
    gathered, then spread again over one rank (a layer of every expert) and run."""
    from gpucoll.ep import MoELayer

    gate = np.random.default_rng(1).normal(size=(FEATURES, PER_RANK * comm.size))
    rng = np.random.default_rng(20 + comm.rank)
    mine = [(rng.normal(size=(FEATURES, HIDDEN + comm.rank + i)) + 1000.0 * (comm.rank + 1),
             rng.normal(size=(HIDDEN + comm.rank + i, FEATURES))) for i in range(PER_RANK)]
    layer = MoELayer(comm, gate, mine)
    full_gate, experts = layer.full_params()
    mixed = MoELayer(comm, gate, [(mine[0][0], mine[0][1].astype(np.float32))] + mine[1:])
    return mine, full_gate, experts, _error(mixed.full_params)


def test_full_params_gathers_every_expert_in_global_order(pool):
    n = pool.world_size
    results = pool.run(rank_full_params)
    want = [pair for mine, _, _, _ in results for pair in mine]   # rank 0's experts first
    gate = np.random.default_rng(1).normal(size=(FEATURES, PER_RANK * n))
    for mine, full_gate, experts, mixed in results:
        np.testing.assert_array_equal(full_gate, gate)
        assert len(experts) == PER_RANK * n
        for (w1, w2), (want1, want2) in zip(experts, want):
            assert w1.shape == want1.shape and w2.shape == want2.shape
            np.testing.assert_array_equal(w1, want1)
            np.testing.assert_array_equal(w2, want2)
        assert mixed == ("TypeError: MoELayer.full_params: the experts' weights must share one "
                         "dtype; the ranks hold ['float32', 'float64']")
