"""Uneven inputs (``Bucketer(uneven_inputs=True)`` and ``join()``, torch's ``Join``): ranks with
different numbers of batches all finish together, every rank ends with the weights one NumPy
process computes (each step's gradient: the sum over the ranks still training, divided by the
world size), bit-identical across ranks when the joined ones apply ``on_step``; compressed
buckets; the usage errors."""

import numpy as np
import pytest

from gpucoll.ddp import Bucketer
from gpucoll.examples.train_digits import init_params, loss_and_grads
from mp_harness import error_text, rank_pools

pytestmark = pytest.mark.timeout(120)

SIZES = [16, 32, 24, 5]
BATCH = 6
LR, MOMENTUM = 0.1, 0.9
CAPS = dict(first_bucket_cap_bytes=256, bucket_cap_bytes=1024)    # several buckets

pool = rank_pools([2, 3], shared=True)


def batches_of(rank):
    """Rank r trains on 2 + 3 r batches (rank 0 runs out first)."""
    return 2 + 3 * rank


def _data(rank, step):
    rng = np.random.default_rng([5, rank, step])
    return (rng.standard_normal((BATCH, SIZES[0])).astype(np.float32),
            rng.integers(0, SIZES[-1], BATCH))


def _sgd(params, velocity, grads):
    for p, v, g in zip(params, velocity, grads):
        v *= MOMENTUM
        v += g
        p -= LR * v


def reference(size):
    """One process: at each step, the gradients of the ranks that still have a batch, summed
    and divided by the world size, in float64."""
    params = [p.astype(np.float64) for p in init_params(SIZES, seed=2)]
    velocity = [np.zeros_like(p) for p in params]
    for step in range(batches_of(size - 1)):
        total = [np.zeros_like(p) for p in params]
        for rank in range(size):
            if step < batches_of(rank):
                _, _, grads = loss_and_grads([p.astype(np.float32) for p in params],
                                             *_data(rank, step))
                total = [t + g for t, g in zip(total, grads)]
        _sgd(params, velocity, [t / size for t in total])
    return params


def rank_uneven(comm, compression, follow):
    params = init_params(SIZES, seed=2)
    velocity = [np.zeros_like(p) for p in params]
    bucketer = Bucketer(comm, params, uneven_inputs=True, compression=compression, **CAPS)
    for step in range(batches_of(comm.rank)):
        _, _, grads = loss_and_grads(params, *_data(comm.rank, step), on_grad=bucketer.mark_ready)
        _sgd(params, velocity, bucketer.finish())
    shadowed = bucketer.join(on_step=(lambda grads: _sgd(params, velocity, grads))
                             if follow else None)
    after = comm.all_gather_object("after join")   # every rank is back in step
    return params, shadowed, after, len(bucketer.buckets)


@pytest.mark.parametrize("compression,rtol,atol", [(None, 1e-4, 1e-5), ("fp16", 2e-2, 2e-3)])
def test_uneven_ranks_finish_together_with_the_reference_weights(pool, compression, rtol, atol):
    n = pool.world_size
    results = pool.run(rank_uneven, compression, True)
    want = reference(n)
    last = batches_of(n - 1)
    for rank, (params, shadowed, after, buckets) in enumerate(results):
        assert buckets > 1
        assert shadowed == last - batches_of(rank)
        assert after == ["after join"] * n
        for got, expected in zip(params, want):
            np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
        for got, first in zip(params, results[0][0]):   # on_step keeps every rank identical
            np.testing.assert_array_equal(got, first)


def test_without_on_step_the_joined_ranks_keep_their_weights(pool):
    n = pool.world_size
    results = pool.run(rank_uneven, None, False)
    for got, expected in zip(results[-1][0], reference(n)):   # the last rank trained to the end
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert not np.array_equal(results[0][0][0], results[-1][0][0])


def rank_join_errors(comm):
    params = init_params(SIZES, seed=2)
    plain = Bucketer(comm, params)
    errors = [error_text(plain.join, (RuntimeError,))]
    bucketer = Bucketer(comm, params, uneven_inputs=True)
    bucketer.mark_ready(5, np.zeros(5, np.float32))
    errors.append(error_text(bucketer.join))
    for index in reversed(range(5)):
        bucketer.mark_ready(index, np.zeros_like(params[index]))
    bucketer.finish()
    with bucketer.no_sync():
        bucketer.reduce([np.ones_like(p) for p in params])
    errors.append(error_text(bucketer.join))
    bucketer.reduce([np.ones_like(p) for p in params])     # adds the accumulated ones
    errors.append(bucketer.join())                         # everyone joins at once: no step
    return errors


def test_join_usage_errors(pool):
    for errors in pool.run(rank_join_errors):
        assert errors[0].startswith("RuntimeError: join() needs Bucketer(..., "
                                    "uneven_inputs=True)"), errors[0]
        assert errors[1].startswith("ValueError: join() is called between steps") \
            and "gradients marked: [5]" in errors[1], errors[1]
        assert "accumulated: [0, 1, 2, 3, 4, 5]" in errors[2], errors[2]
        assert errors[3] == 0


def _gpu_uneven(comm):
    import cupy

    params = [cupy.asarray(p) for p in init_params(SIZES, seed=2)]
    velocity = [cupy.zeros_like(p) for p in params]
    bucketer = Bucketer(comm, params, uneven_inputs=True, **CAPS)
    for step in range(batches_of(comm.rank)):
        x, y = (cupy.asarray(a) for a in _data(comm.rank, step))
        _, _, grads = loss_and_grads(params, x, y, cupy, on_grad=bucketer.mark_ready)
        _sgd(params, velocity, bucketer.finish())
    shadowed = bucketer.join(on_step=lambda grads: _sgd(params, velocity, grads))
    return [cupy.asnumpy(p) for p in params], shadowed


@pytest.mark.gpu
def test_uneven_inputs_on_cupy_arrays():
    """CuPy buckets over the cpu backend: the flag written on the device, read by join()."""
    from mp_harness import RankPool

    ranks = RankPool(2)
    try:
        results = ranks.run(_gpu_uneven)
    finally:
        ranks.close()
    want = reference(2)
    for rank, (params, shadowed) in enumerate(results):
        assert shadowed == batches_of(1) - batches_of(rank)
        for got, expected in zip(params, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
