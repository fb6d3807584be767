"""DynamicLossScaler: the back-off / growth state machine, agreement across ranks when only
one rank overflowed, and training with the Bucketer through a scaled loss."""

import numpy as np
import pytest

from gpucoll.ddp import Bucketer, DynamicLossScaler
from gpucoll.examples.train_digits import init_params, loss_and_grads, sgd_step
from mp_harness import RankPool, rank_pools

pytestmark = pytest.mark.timeout(120)

SIZES = [10, 9, 4]


pool = rank_pools([2, 3], shared=True)


def test_backoff_growth_and_bounds():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3, min_scale=2.0, max_scale=32.0)
    flags = [False, False, False, True, True, True, False, False, False] + [False] * 6
    steps, scales = [], []
    for flag in flags:
        steps.append(scaler.update(flag))
        scales.append(scaler.scale)
    assert steps == [not f for f in flags]
    assert scales == [8, 8, 16, 8, 4, 2, 2, 2, 4, 4, 4, 8, 8, 8, 16]
    assert scaler.skipped_steps == 3 and scaler.steps == len(flags)
    scaler.update(False), scaler.update(False), scaler.update(False)
    scaler.update(False), scaler.update(False), scaler.update(False)
    assert scaler.scale == 32.0                       # capped at max_scale
    state = scaler.state_dict()
    other = DynamicLossScaler(init_scale=8.0)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert scaler.scale_loss(0.5) == 16.0
    assert scaler.update(np.array([1], np.int32)) is False   # the Bucketer's flag array


@pytest.mark.parametrize("kwargs,match", [
    (dict(init_scale=0.0), "init_scale must be finite and > 0, got 0.0"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(growth_factor=1.0), "growth_factor must be > 1, got 1.0"),
    (dict(backoff_factor=1.5), r"backoff_factor must be in \(0, 1\), got 1.5"),
    (dict(growth_interval=0), "growth_interval must be an int >= 1, got 0"),
    (dict(init_scale=4.0, min_scale=8.0), "min_scale <= init_scale"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


def rank_agree(comm):
    """Only the last rank's local flag is set: with a comm every rank must skip."""
    scaler = DynamicLossScaler(comm, init_scale=64.0)
    local = comm.rank == comm.size - 1
    return scaler.update(local), scaler.scale


def test_one_rank_flag_skips_every_rank(pool):
    assert pool.run(rank_agree) == [(False, 32.0)] * pool.world_size


def rank_train(comm, inject):
    """Train 5 steps with a scaled loss; on step 2 the last rank's gradient gets ``inject``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], (5, 6))
    params = init_params(SIZES, seed=2)
    velocity = [np.zeros_like(p) for p in params]
    bucketer = Bucketer(comm, params, first_bucket_cap_bytes=64)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2)
    log = []
    local = 6 // comm.size
    for step in range(5):
        xb = x[step, comm.rank * local:(comm.rank + 1) * local]
        yb = y[step, comm.rank * local:(comm.rank + 1) * local]
        _, _, grads = loss_and_grads(params, xb, yb, scale=scaler.scale)
        if step == 2 and comm.rank == comm.size - 1 and inject is not None:
            grads[0][1, 1] = inject
        bucketer.reduce(grads, loss_scale=scaler.scale)
        applied = scaler.update(bucketer.found_nonfinite())
        if applied:
            sgd_step(params, grads, velocity, 0.1)
        log.append((applied, scaler.scale))
    return params, log


def _reference(skip_step):
    """One process on the full batch, no scaling, step ``skip_step`` left out."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], (5, 6))
    params = init_params(SIZES, seed=2)
    velocity = [np.zeros_like(p) for p in params]
    for step in range(5):
        if step == skip_step:
            continue
        _, _, grads = loss_and_grads(params, x[step], y[step])
        sgd_step(params, grads, velocity, 0.1)
    return params


@pytest.mark.parametrize("inject", [None, np.inf, np.nan])
def test_bucketer_with_scaler_matches_unscaled_training(pool, inject):
    results = pool.run(rank_train, inject)
    expected = _reference(2 if inject is not None else None)
    for params, log in results:
        if inject is None:
            assert log == [(True, 1024.0), (True, 2048.0), (True, 2048.0), (True, 4096.0),
                           (True, 4096.0)]
        else:
            assert log == [(True, 1024.0), (True, 2048.0), (False, 1024.0), (True, 1024.0),
                           (True, 2048.0)]
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _gpu_overflow(comm):
    import cupy

    grads = [cupy.ones((4, 4), cupy.float32), cupy.ones(9, cupy.float32)]
    bucketer = Bucketer(comm, grads)
    scaler = DynamicLossScaler(comm, init_scale=8.0, growth_interval=1)
    log = []
    for step in range(3):
        grads = [cupy.full((4, 4), 8.0 * (comm.rank + 1), cupy.float32),
                 cupy.full(9, 16.0, cupy.float32)]
        if step == 1 and comm.rank == comm.size - 1:
            grads[1][4] = cupy.inf
        bucketer.reduce(grads, loss_scale=scaler.scale)   # fused unpack kernel on the GPU
        before = scaler.scale
        log.append((scaler.update(bucketer.found_nonfinite()), before,
                    float(grads[0][0, 0]) if step != 1 else None))
    return log


@pytest.mark.gpu
def test_bucketer_unscales_and_flags_on_cupy_arrays():
    pool = RankPool(2)
    try:
        results = pool.run(_gpu_overflow)
    finally:
        pool.close()
    for log in results:
        # step 0: mean of 8 and 16, unscaled by 8 -> 1.5; step 2: scale 16 after grow, back off
        assert log == [(True, 8.0, 1.5), (False, 16.0, None), (True, 8.0, 1.5)]
