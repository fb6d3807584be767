"""Tensor-parallel layers: outputs and gradients equal to the unsharded layers (NumPy
reference) at 2, 3 and 4 ranks, plain and sequence-parallel, the number of collectives an MLP
needs, and usage errors."""

import os

import numpy as np
import pytest

from gpucoll.tp import ColumnParallelLinear, ParallelMLP, RowParallelLinear, init_linear
from mp_harness import RankPool, rank_pools

# ranks share the cores: one BLAS thread each (else oversubscription slows steps 100x)
_ONE_BLAS_THREAD = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")

pytestmark = pytest.mark.timeout(120)

IN, HIDDEN, OUT = 7, 12, 5     # hidden divides by 2, 3, 4; IN and OUT are prime
ROWS = 12


pool = rank_pools([2, 3, 4], shared=True)


class Counting:
    """The communicator, counting each collective it is asked for."""

    def __init__(self, comm):
        self._comm, self.calls = comm, {}

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            def counted(*args, **kwargs):
                self.calls[name] = self.calls.get(name, 0) + 1
                return attr(*args, **kwargs)
            return counted
        return attr


def _inputs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((ROWS, IN)).astype(np.float32)
    dy = rng.standard_normal((ROWS, OUT)).astype(np.float32)
    return x, dy


def reference_mlp():
    """Unsharded forward and backward in float64."""
    x, dy = _inputs()
    w1, b1 = (a.astype(np.float64) for a in init_linear(IN, HIDDEN, seed=9))
    w2, b2 = (a.astype(np.float64) for a in init_linear(HIDDEN, OUT, seed=10))
    h = x @ w1 + b1
    a = np.maximum(h, 0)
    y = a @ w2 + b2
    dw2, db2 = a.T @ dy, dy.sum(0)
    dh = (dy @ w2.T) * (h > 0)
    dw1, db1 = x.T @ dh, dh.sum(0)
    dx = dh @ w1.T
    return y, dx, (dw1, db1, dw2, db2)


def rank_mlp(comm, sequence_parallel):
    counting = Counting(comm)
    mlp = ParallelMLP(counting, IN, HIDDEN, OUT, seed=9, sequence_parallel=sequence_parallel)
    x, dy = _inputs()
    rows = slice(comm.rank * ROWS // comm.size, (comm.rank + 1) * ROWS // comm.size)
    if sequence_parallel:
        x, dy = x[rows], dy[rows]
    y = mlp.forward(x)
    forward_calls = dict(counting.calls)
    dx = mlp.backward(dy)
    backward_calls = {k: v - forward_calls.get(k, 0) for k, v in counting.calls.items()}
    return y, dx, [g.copy() for g in mlp.grads], forward_calls, backward_calls


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tensor", "sequence"])
def test_mlp_equals_unsharded(pool, sequence_parallel):
    n = pool.world_size
    y_ref, dx_ref, grads_ref = reference_mlp()
    share = HIDDEN // n
    for rank, (y, dx, grads, fwd, bwd) in enumerate(pool.run(rank_mlp, sequence_parallel)):
        rows = slice(rank * ROWS // n, (rank + 1) * ROWS // n) if sequence_parallel else slice(None)
        np.testing.assert_allclose(y, y_ref[rows], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, dx_ref[rows], rtol=1e-5, atol=1e-5)
        dw1, db1, dw2, db2 = grads_ref
        mine = slice(rank * share, (rank + 1) * share)
        for got, want in zip(grads, [dw1[:, mine], db1[mine], dw2[mine], db2]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if sequence_parallel:
            assert fwd == {"all_gather": 1, "reduce_scatter": 1}
            assert bwd == {"all_gather": 1, "reduce_scatter": 1}
        else:
            assert fwd == {"all_reduce": 1} and bwd == {"all_reduce": 1}


def rank_full_params(comm):
    """Each rank's slices moved by a rank-dependent amount, then gathered whole."""
    mlp = ParallelMLP(comm, IN, HIDDEN, OUT, seed=9)
    for param in mlp.params[:3]:                 # W1, b1, W2 slices (b2 is replicated)
        param += 1000.0 * (comm.rank + 1)
    return mlp.full_params()


def test_full_params_gathers_the_slices_in_rank_order(pool):
    n = pool.world_size
    (w1, b1), (w2, b2) = init_linear(IN, HIDDEN, seed=9), init_linear(HIDDEN, OUT, seed=10)
    share = HIDDEN // n
    moved = np.repeat(1000.0 * np.arange(1, n + 1), share).astype(np.float32)
    want = [w1 + moved[None, :], b1 + moved, w2 + moved[:, None], b2]
    for got in pool.run(rank_full_params):
        assert [g.shape for g in got] == [(IN, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (OUT,)]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def rank_layers(comm):
    """Column layer gathering its output; row layer taking a full input."""
    x, _ = _inputs()
    w, b = init_linear(IN, HIDDEN, seed=4)
    rng = np.random.default_rng(comm.size)
    column = ColumnParallelLinear(comm, w, b, gather_output=True)
    y1 = column.forward(x)
    g1 = rng.standard_normal(y1.shape).astype(np.float32)
    dx1 = column.backward(g1)
    w2, b2 = init_linear(HIDDEN, OUT, seed=5)
    row = RowParallelLinear(comm, w2, b2, input_is_parallel=False)
    y2 = row.forward(y1)
    g2 = rng.standard_normal(y2.shape).astype(np.float32)
    dx2 = row.backward(g2)
    return y1, dx1, y2, dx2, g1, g2, column.grad_weight, row.grad_weight


def test_gathered_and_full_inputs(pool):
    n = pool.world_size
    x, _ = _inputs()
    w, b = (a.astype(np.float64) for a in init_linear(IN, HIDDEN, seed=4))
    w2, b2 = (a.astype(np.float64) for a in init_linear(HIDDEN, OUT, seed=5))
    for rank, (y1, dx1, y2, dx2, g1, g2, gw1, gw2) in enumerate(pool.run(rank_layers)):
        np.testing.assert_allclose(y1, x @ w + b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx1, g1 @ w.T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y2, y1 @ w2 + b2, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx2, g2 @ w2.T, rtol=1e-5, atol=1e-5)
        mine = slice(rank * HIDDEN // n, (rank + 1) * HIDDEN // n)
        np.testing.assert_allclose(gw1, (x.T @ g1)[:, mine], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gw2, (y1.T @ g2)[mine], rtol=1e-5, atol=1e-5)


class FakeGroup:
    """Only rank and size: the checks below must fail before any collective is called."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_group_size_must_divide_the_split_dimension():
    w, b = init_linear(IN, 10)
    with pytest.raises(ValueError, match="out_features 10 is not divisible by the "
                                         "tensor-parallel group size 4"):
        ColumnParallelLinear(FakeGroup(0, 4), w, b)
    with pytest.raises(ValueError, match="in_features 7 is not divisible by the "
                                         "tensor-parallel group size 2"):
        RowParallelLinear(FakeGroup(1, 2), w, b)
    with pytest.raises(ValueError, match="bias must have shape"):
        ColumnParallelLinear(FakeGroup(0, 2), w, b[:3])
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ColumnParallelLinear(FakeGroup(0, 2), b)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel group size 3"):
        ParallelMLP(FakeGroup(0, 3), 4, 8, 2)
    column = ColumnParallelLinear(FakeGroup(0, 2), w, b)
    with pytest.raises(ValueError, match=r"x must have shape \(rows, 7\), got \(3, 6\)"):
        column.forward(np.zeros((3, 6), np.float32))
    with pytest.raises(RuntimeError, match="before forward"):
        column.backward(np.zeros((3, 5), np.float32))
    row = RowParallelLinear(FakeGroup(0, 2), *init_linear(8, 3), sequence_parallel=True)
    with pytest.raises(ValueError, match="the number of rows 5 is not divisible by the "
                                         "tensor-parallel group size 2"):
        row.forward(np.zeros((5, 4), np.float32))


def test_one_rank_is_the_plain_layer(solo):
    y_ref, dx_ref, grads_ref = reference_mlp()
    mlp = ParallelMLP(solo, IN, HIDDEN, OUT, seed=9)
    x, dy = _inputs()
    np.testing.assert_allclose(mlp.forward(x), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mlp.backward(dy), dx_ref, rtol=1e-5, atol=1e-5)


def _gpu_mlp(comm, sequence_parallel):
    import cupy

    mlp = ParallelMLP(comm, IN, HIDDEN, OUT, seed=9, xp=cupy, sequence_parallel=sequence_parallel)
    x, dy = _inputs()
    rows = slice(comm.rank * ROWS // comm.size, (comm.rank + 1) * ROWS // comm.size)
    if sequence_parallel:
        x, dy = x[rows], dy[rows]
    y = mlp.forward(cupy.asarray(x))
    dx = mlp.backward(cupy.asarray(dy))
    return cupy.asnumpy(y), cupy.asnumpy(dx)


@pytest.mark.gpu
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mlp_on_cupy_arrays(sequence_parallel):
    pool = RankPool(2)
    try:
        results = pool.run(_gpu_mlp, sequence_parallel)
    finally:
        pool.close()
    y_ref, dx_ref, _ = reference_mlp()
    for rank, (y, dx) in enumerate(results):
        rows = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2) if sequence_parallel else slice(None)
        np.testing.assert_allclose(y, y_ref[rows], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, dx_ref[rows], rtol=1e-5, atol=1e-5)


def test_example_trains_with_tensor_parallel_groups():
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "4", "-m",
                          "gpucoll.examples.train_tp", "--epochs", "2", "--cpu",
                          "--sequence-parallel"], capture_output=True, text=True, timeout=100,
                         env=_ONE_BLAS_THREAD)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 data-parallel replica(s) x 2 tensor-parallel rank(s)" in out.stdout
    epochs = [line for line in out.stdout.splitlines() if "] epoch" in line]
    assert len(epochs) == 2 and float(epochs[-1].split("test acc")[1].split()[0]) > 0.9
