"""Data-parallel helpers: bucketer equivalence with one-process training (real processes),
accumulation, compression, non-finite flag, parameter broadcast, metrics, sync batch norm,
and the distributed sampler."""

import contextlib

import numpy as np
import pytest

from gpucoll import kernels
from gpucoll.ddp import (Bucketer, DistributedSampler, SyncBatchNorm, all_reduce_metrics,
                         broadcast_parameters, plan_buckets, sync_batch_stats)
from gpucoll.examples.train_digits import init_params, loss_and_grads, sgd_step
from mp_harness import rank_pools

pytestmark = pytest.mark.timeout(120)

SIZES = [16, 32, 24, 5]        # a 3-layer MLP: 6 parameter arrays, ~1.5k floats
GLOBAL_BATCH = 12              # divisible by 1, 2, 3, 4
STEPS, LR = 4, 0.1


pool = rank_pools([2, 3], shared=True)


def _data(micro):
    rng = np.random.default_rng(7)
    n = STEPS * micro * GLOBAL_BATCH
    return rng.standard_normal((n, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], n)


def _batch(x, y, step, micro_index, micro, rank, size):
    start = (step * micro + micro_index) * GLOBAL_BATCH
    local = GLOBAL_BATCH // size
    lo = start + rank * local
    return x[lo:lo + local], y[lo:lo + local]


def train(comm, micro=1, compression=None, caps=(256, 1024)):
    """Data-parallel training; ``comm=None`` is the one-process reference on the full batch."""
    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    x, y = _data(micro)
    params = init_params(SIZES, seed=3)
    velocity = [np.zeros_like(p) for p in params]
    bucketer = None
    if comm is not None:
        bucketer = Bucketer(comm, params, first_bucket_cap_bytes=caps[0],
                            bucket_cap_bytes=caps[1], compression=compression)
    for step in range(STEPS):
        total = [np.zeros_like(p) for p in params]
        for m in range(micro):
            xb, yb = _batch(x, y, step, m, micro, rank, size)
            hook = bucketer.mark_ready if bucketer else None
            sync = bucketer is None or m == micro - 1
            with (contextlib.nullcontext() if sync else bucketer.no_sync()):
                _, _, grads = loss_and_grads(params, xb, yb, on_grad=hook, scale=1.0 / micro)
                if bucketer:
                    grads = bucketer.finish()
            if bucketer is None:
                for t, g in zip(total, grads):
                    t += g
        sgd_step(params, grads if bucketer else total, velocity, LR)
    return params, (bucketer.buckets if bucketer else None)


@pytest.mark.parametrize("micro", [1, 3], ids=["sync", "no_sync-accumulate-3"])
@pytest.mark.parametrize("compression,rtol,atol", [(None, 2e-5, 2e-6), ("fp16", 2e-2, 2e-3),
                                                   ("bf16", 5e-2, 1e-2)])
def test_data_parallel_equals_full_batch(pool, micro, compression, rtol, atol):
    if compression == "bf16" and kernels.bfloat16 is None:
        pytest.skip("bfloat16 on NumPy needs ml_dtypes")
    if compression == "bf16" and not pool.run(_backend_reduces_bfloat16)[0]:
        pytest.skip("this CPU backend cannot all-reduce bfloat16 arrays")
    expected, _ = train(None, micro)
    results = pool.run(train, micro, compression)
    for params, buckets in results:
        assert len(buckets) > 1, "small caps: several buckets, issued while backward runs"
        assert sorted(i for b in buckets for i in b) == list(range(len(expected)))
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    for params, _ in results[1:]:  # every rank holds the same weights, bit for bit
        for a, b in zip(params, results[0][0]):
            np.testing.assert_array_equal(a, b)


def _backend_reduces_bfloat16(comm):
    try:
        comm.all_reduce(np.ones(4, kernels.bfloat16))
        return True
    except Exception:
        return False


def test_default_caps_make_one_bucket(pool):
    expected, _ = train(None)
    for params, buckets in pool.run(train, 1, None, (1 << 20, 25 << 20)):
        assert buckets == [list(range(5, -1, -1))]
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def rank_mixed_dtypes(comm):
    shapes = [(3, 5), (0,), (7,), (2, 2), (1000,), (1,)]
    dtypes = [np.float32, np.float64, np.float32, np.float16, np.float64, np.float32]
    grads = [np.full(s, comm.rank + 1 + i, dtype=d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    bucketer = Bucketer(comm, grads, first_bucket_cap_bytes=64, bucket_cap_bytes=128)
    for bucket in bucketer.buckets:
        assert len({np.dtype(dtypes[i]) for i in bucket}) == 1, "one dtype per bucket"
    out = bucketer.reduce(grads)
    return [g.copy() for g in out], [g is o for g, o in zip(grads, out)]


def test_mixed_dtypes_are_averaged_in_place(pool):
    n = pool.world_size
    for grads, same in pool.run(rank_mixed_dtypes):
        assert all(same)
        for i, g in enumerate(grads):
            expected = np.mean([r + 1 + i for r in range(n)])
            np.testing.assert_allclose(g, np.full(g.shape, expected), rtol=1e-3)


def rank_non_finite(comm, bad, wire):
    grads = [np.ones((4, 4), np.float32), np.ones(9, np.float32)]
    bucketer = Bucketer(comm, grads, compression=wire)
    flags = []
    for step in range(3):
        grads = [np.full((4, 4), comm.rank + 1.0, np.float32), np.full(9, 2.0, np.float32)]
        if step == 1 and comm.rank == comm.size - 1:
            grads[1][4] = bad
        bucketer.reduce(grads, loss_scale=8.0)
        flags.append(bucketer.found_nonfinite())
        if step != 1:
            np.testing.assert_allclose(grads[0], np.full((4, 4), (comm.size + 1) / 2 / 8))
            np.testing.assert_allclose(grads[1], np.full(9, 2.0 / 8))
    return flags


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("wire", [None, "fp16"])
def test_non_finite_flag_trips_on_every_rank(pool, bad, wire):
    assert pool.run(rank_non_finite, bad, wire) == [[False, True, False]] * pool.world_size


def rank_broadcast(comm, root):
    params = init_params(SIZES, seed=comm.rank) + [np.arange(5) * (comm.rank + 1),
                                                   np.zeros(0, np.float32)]
    broadcast_parameters(comm, params, root=root, bucket_cap_bytes=2048)
    return params


def test_broadcast_parameters(pool):
    for root in range(pool.world_size):
        expected = init_params(SIZES, seed=root) + [np.arange(5) * (root + 1), np.zeros(0)]
        for params in pool.run(rank_broadcast, root):
            for got, want in zip(params, expected):
                np.testing.assert_array_equal(got, want)


def rank_metrics(comm):
    return all_reduce_metrics(comm, {"total": 10, "correct": np.int64(comm.rank),
                                     "loss": np.float32(0.5), "best": np.array([comm.rank])})


def test_all_reduce_metrics(pool):
    n = pool.world_size
    for totals in pool.run(rank_metrics):
        assert totals == {"total": 10 * n, "correct": n * (n - 1) // 2, "loss": 0.5 * n,
                          "best": n * (n - 1) // 2}
        assert isinstance(totals["total"], int) and isinstance(totals["loss"], float)


def _bn_inputs(rank):
    rng = np.random.default_rng(rank)
    return (rng.standard_normal((3 + 2 * rank, 6)) * (rank + 1) + rank).astype(np.float64)


def rank_sync_bn(comm):
    x = _bn_inputs(comm.rank)
    mean, var, count = sync_batch_stats(comm, x)
    bn = SyncBatchNorm(comm, 6, dtype=np.float64)
    y = bn.forward(x)
    dy = np.cos(np.arange(x.size).reshape(x.shape) + comm.rank)
    dx, dgamma, dbeta = bn.backward(dy)
    return mean, var, count, y, dx, dgamma, dbeta, bn.running_mean


def test_sync_batch_norm_matches_the_global_batch(pool):
    n = pool.world_size
    xs = [_bn_inputs(r) for r in range(n)]
    x = np.concatenate(xs)
    dys = [np.cos(np.arange(xr.size).reshape(xr.shape) + r) for r, xr in enumerate(xs)]
    dy = np.concatenate(dys)
    mean, var = x.mean(axis=0), x.var(axis=0)
    x_hat = (x - mean) / np.sqrt(var + 1e-5)
    # single-process batch norm backward on the concatenated batch (gamma = 1)
    m = len(x)
    dx_ref = (m * dy - dy.sum(0) - x_hat * (dy * x_hat).sum(0)) / (m * np.sqrt(var + 1e-5))
    bounds = np.cumsum([0] + [len(xr) for xr in xs])
    for r, (mu, v, count, y, dx, dgamma, dbeta, running) in enumerate(pool.run(rank_sync_bn)):
        assert count == m
        np.testing.assert_allclose(mu, mean, rtol=1e-12)
        np.testing.assert_allclose(v, var, rtol=1e-10)
        np.testing.assert_allclose(y, x_hat[bounds[r]:bounds[r + 1]], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(dx, dx_ref[bounds[r]:bounds[r + 1]], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(dbeta, dys[r].sum(0))
        np.testing.assert_allclose(running, 0.1 * mean, rtol=1e-12)


# ------------------------------------------------------------------ single-process checks
def test_plan_buckets_reverse_order_caps_and_dtypes():
    nbytes = [400, 400, 400, 400, 2000, 100]
    dtypes = ["float32", "float32", "float64", "float32", "float32", "float64"]
    # reverse walk: 5(f64) 4(f32: 2000 >= first cap 1000 -> closed) 3 2(f64) 1 0 ...
    assert plan_buckets(nbytes, dtypes, 1000, 1000) == [[4], [3, 1, 0], [5, 2]]
    assert plan_buckets(nbytes, dtypes, 10 ** 6, 10 ** 6) == [[5, 2], [4, 3, 1, 0]]
    assert plan_buckets([], [], 1, 1) == []


def test_bucketer_usage_errors(solo):
    params = [np.zeros(3, np.float32), np.zeros((2, 2), np.float32)]
    bucketer = Bucketer(solo, params)
    with pytest.raises(ValueError, match="shape"):
        bucketer.mark_ready(1, np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="float64"):
        bucketer.mark_ready(0, np.zeros(3))
    with pytest.raises(ValueError, match="out of range"):
        bucketer.mark_ready(2, np.zeros(3, np.float32))
    bucketer.mark_ready(0, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="already marked"):
        bucketer.mark_ready(0, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"gradients \[1\] were not marked"):
        bucketer.finish()
    grads = bucketer.reduce([np.ones(3, np.float32), np.full((2, 2), 2, np.float32)])
    np.testing.assert_array_equal(grads[1], np.full((2, 2), 2))  # usable after the error
    with pytest.raises(TypeError, match="int64"):
        Bucketer(solo, [np.zeros(3, np.int64)])
    with pytest.raises(ValueError, match="compression"):
        Bucketer(solo, params, compression="int8")


def test_mark_ready_asks_host_view_once_per_array_type_it_leaves_alone(solo, monkeypatch):
    """A plain NumPy gradient is left as it is by host_view, which its type decides: asked once,
    not for every gradient of every step; a type host_view converts is converted every time."""
    from gpucoll.ddp import bucketer as module

    class Subclass(np.ndarray):  # host_view reads it through DLPack: a plain ndarray view
        pass

    asked = []
    real = module.host_view
    monkeypatch.setattr(module, "host_view",
                        lambda x, name="x": asked.append(type(x)) or real(x, name))
    bucketer = Bucketer(solo, [np.zeros(4, np.float32), np.zeros(3, np.float32),
                               np.zeros(2, np.float32)])
    asked.clear()  # the parameters' views
    for step in range(3):
        grads = [np.full(4, step, np.float32), np.full(3, step + 1, np.float32).view(Subclass),
                 np.full(2, step + 2, np.float32)]
        out = bucketer.reduce(grads)
        for got, value in zip(out, (step, step + 1, step + 2)):
            np.testing.assert_array_equal(got, np.full(got.shape, value))
    assert asked.count(np.ndarray) == 1 and asked.count(Subclass) == 3, asked


def test_no_sync_accumulates_locally(solo):
    bucketer = Bucketer(solo, [np.zeros(4, np.float32)])
    with bucketer.no_sync():
        bucketer.reduce([np.ones(4, np.float32)])
        bucketer.reduce([np.full(4, 2, np.float32)])
    (grad,) = bucketer.reduce([np.full(4, 4, np.float32)])
    np.testing.assert_array_equal(grad, np.full(4, 7))
    (grad,) = bucketer.reduce([np.full(4, 4, np.float32)])
    np.testing.assert_array_equal(grad, np.full(4, 4)), "accumulators are cleared after a sync"


@pytest.mark.parametrize("size", [0, 1, 10, 11, 17])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_shards(size, world, shuffle):
    for epoch in range(3):
        shards = []
        for rank in range(world):
            sampler = DistributedSampler(size, rank=rank, world_size=world, shuffle=shuffle, seed=5)
            sampler.set_epoch(epoch)
            shards.append(sampler.indices())
            assert len(shards[-1]) == len(sampler) == -(-size // world)
        everything = np.concatenate(shards)
        assert set(everything.tolist()) == set(range(size)), "every index once per epoch"
        padding = len(everything) - size
        assert 0 <= padding < world
        if size:
            counts = np.bincount(everything, minlength=size)
            assert counts.min() >= 1 and counts.max() - counts.min() <= 1  # evenly padded
            assert counts.sum() - size == padding

        dropped = []
        for rank in range(world):
            sampler = DistributedSampler(size, rank=rank, world_size=world, shuffle=shuffle,
                                         seed=5, drop_last=True)
            sampler.set_epoch(epoch)
            dropped.append(sampler.indices())
            assert len(dropped[-1]) == len(sampler) == size // world
        flat = np.concatenate(dropped)
        assert len(set(flat.tolist())) == len(flat) == size // world * world, "no repeats"


def test_sampler_reshuffles_per_epoch_and_agrees_across_ranks():
    a = DistributedSampler(100, rank=0, world_size=2, seed=1)
    b = DistributedSampler(100, rank=1, world_size=2, seed=1)
    first = a.indices()
    a.set_epoch(1)
    assert not np.array_equal(first, a.indices())
    b.set_epoch(1)
    assert not set(a.indices().tolist()) & set(b.indices().tolist())
    assert list(a) == a.indices().tolist()
    with pytest.raises(ValueError, match="rank 2"):
        DistributedSampler(10, rank=2, world_size=2)


def test_example_trains_on_digits():
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "2", "-m",
                          "gpucoll.examples.train_digits", "--epochs", "3", "--cpu"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    epochs = [line for line in out.stdout.splitlines() if "] epoch" in line]
    assert len(epochs) == 3 and all(line.startswith("[rank 0]") for line in epochs)
    assert float(epochs[-1].split("test acc")[1].split()[0]) > 0.9


@pytest.mark.parametrize("where", ["shipped file", "load_digits"])
def test_the_examples_read_the_same_digits_as_scikit_learn(monkeypatch, tmp_path, where):
    """The examples read scikit-learn's digits file without importing scikit-learn; where the
    file is not in the package, ``load_digits()`` reads it: the same numbers either way."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets",
                                           reason="the digits example needs scikit-learn")
    import importlib.util
    import types

    from gpucoll.examples import train_digits
    if where == "load_digits":        # a package directory without the data file
        empty = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: empty)
    x, y = train_digits._digits_from_scikit_learn()
    digits = sklearn_datasets.load_digits()
    np.testing.assert_array_equal(x, digits.data)
    np.testing.assert_array_equal(y, digits.target)
    assert y.dtype == np.int64


def test_the_examples_say_what_to_install_without_scikit_learn(monkeypatch):
    import importlib.util

    from gpucoll.examples import train_digits
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"needs scikit-learn .* or --data FILE.npz"):
        train_digits.load_digits_split(0)
