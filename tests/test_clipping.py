"""Gradient clipping by the global norm: ``clip_grad_norm`` against NumPy's norm of every
gradient together; ZeRO-1 and FSDP ``step(max_norm=...)`` (each rank's slices, their squares
all-reduced) and the Bucketer's replicated gradients, clipped at every step, end with the
weights of one process that clips its full-batch gradients the same way, and report its norms."""

import numpy as np
import pytest

from gpucoll.ddp import (Bucketer, FullyShardedParameters, ShardedOptimizer, clip_grad_norm,
                         global_grad_norm)
from gpucoll.examples.train_digits import init_params, loss_and_grads
from gpucoll.examples.train_fsdp import fsdp_loss_and_grads
from mp_harness import error_text, rank_pools
from reference_training import (SETTINGS, ReferenceOptimizer, one_process_training, rank_batch,
                                training_data)

pytestmark = pytest.mark.timeout(120)

SIZES = [13, 17, 11, 7]
GLOBAL_BATCH = 12
STEPS = 4
MAX_NORM = 0.3          # below every step's norm here: clipping acts at each step

pool = rank_pools([2, 3], shared=True)


def _data():
    return training_data(SIZES, STEPS, GLOBAL_BATCH)


def reference(optimizer, max_norm=MAX_NORM):
    """One process, the whole batch, clipped in float64 as torch's clip_grad_norm_ does."""
    return one_process_training(optimizer, SIZES, _data(), STEPS, GLOBAL_BATCH, max_norm)


def test_clip_grad_norm_against_numpy():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (5,), (2, 2, 2)]]
    whole = np.concatenate([g.ravel().astype(np.float64) for g in grads])
    norm = np.linalg.norm(whole)
    original = [g.copy() for g in grads]
    got = clip_grad_norm(grads, norm / 4)
    assert got.shape == (1,) and got.dtype == np.float64
    np.testing.assert_allclose(got[0], norm, rtol=1e-6)
    for g, o in zip(grads, original):
        np.testing.assert_allclose(g, o * (norm / 4) / (norm + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(np.concatenate([g.ravel() for g in grads])),
                               norm / 4, rtol=1e-5)
    kept = [g.copy() for g in grads]
    clip_grad_norm(grads, 10 * norm)                  # below the limit: unchanged
    for g, k in zip(grads, kept):
        np.testing.assert_array_equal(g, k)
    half = [g.astype(np.float16) for g in original]
    np.testing.assert_allclose(global_grad_norm(half)[0], norm, rtol=1e-3)


def test_clip_usage_errors():
    grads = [np.ones(3, np.float32)]
    for bad in (0, -1.0, float("inf"), float("nan"), None, True, "1"):
        with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
            clip_grad_norm(grads, bad)
    with pytest.raises(ValueError, match="grads is empty"):
        clip_grad_norm([], 1.0)


def rank_train(comm, kind, optimizer):
    x, y = _data()
    params = init_params(SIZES, seed=5)
    norms = []
    if kind == "fsdp":
        obj = FullyShardedParameters(comm, [params[i:i + 2] for i in range(0, 6, 2)], optimizer,
                                     **SETTINGS[optimizer])
    elif kind == "zero":
        obj = ShardedOptimizer(comm, params, optimizer, first_bucket_cap_bytes=64,
                               bucket_cap_bytes=512, **SETTINGS[optimizer])
    else:
        bucketer = Bucketer(comm, params, first_bucket_cap_bytes=64, bucket_cap_bytes=512)
        reference_opt = ReferenceOptimizer(optimizer, params)
    for step in range(STEPS):
        xb, yb = rank_batch(x, y, step, comm.rank, comm.size, GLOBAL_BATCH)
        if kind == "fsdp":
            fsdp_loss_and_grads(obj, xb, yb)
        elif kind == "zero":
            loss_and_grads(params, xb, yb, on_grad=obj.mark_ready)
        else:
            _, _, grads = loss_and_grads(params, xb, yb, on_grad=bucketer.mark_ready)
            grads = bucketer.finish()
            norms.append(float(clip_grad_norm(grads, MAX_NORM)[0]))   # replicated: no comm
            reference_opt.step(params, grads)
            continue
        assert obj.step(max_norm=MAX_NORM)
        norms.append(float(obj.grad_norm[0]))
    if kind == "fsdp":
        params = [p for unit in obj.full_parameters() for p in unit]
    return params, norms


@pytest.mark.parametrize("kind", ["zero", "fsdp", "ddp"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_clipped_training_equals_one_clipping_process(pool, kind, optimizer):
    if kind == "ddp" and optimizer == "adam":
        pytest.skip("the replicated path is checked once (sgd)")
    want, want_norms = reference(optimizer)
    assert min(want_norms) > MAX_NORM          # clipping acted at every step
    unclipped, _ = reference(optimizer, max_norm=1e9)
    assert not np.allclose(unclipped[0], want[0], rtol=1e-3)   # and it changed the result
    for params, norms in pool.run(rank_train, kind, optimizer):
        np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
        for got, expected in zip(params, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def rank_bad_max_norm(comm):
    params = init_params(SIZES, seed=5)
    opt = ShardedOptimizer(comm, params, "sgd")
    grads = [np.ones_like(p) for p in params]
    for index in reversed(range(len(params))):
        opt.mark_ready(index, grads[index])
    text = error_text(lambda: opt.step(max_norm=-1))
    assert opt.reduce_and_step(grads, max_norm=1e9)   # the refused step left nothing behind
    return text, float(opt.grad_norm[0])


def test_a_bad_max_norm_is_refused_and_the_next_step_works(pool):
    elements = sum(p.size for p in init_params(SIZES, seed=5))
    for text, norm in pool.run(rank_bad_max_norm):
        assert text == "ValueError: max_norm must be a finite number > 0, got -1"
        assert norm == pytest.approx(np.sqrt(elements))   # averaged ones: 1 per element


def _gpu_clip(comm):
    import cupy

    x, y = _data()
    params = [cupy.asarray(p) for p in init_params(SIZES, seed=5)]
    fsdp = FullyShardedParameters(comm, [params[i:i + 2] for i in range(0, 6, 2)], "sgd",
                                  **SETTINGS["sgd"])
    norms = []
    for step in range(STEPS):
        xb, yb = (cupy.asarray(a) for a in rank_batch(x, y, step, comm.rank, comm.size,
                                                      GLOBAL_BATCH))
        fsdp_loss_and_grads(fsdp, xb, yb, cupy)
        assert fsdp.step(max_norm=MAX_NORM)
        assert type(fsdp.grad_norm).__module__.startswith("cupy")   # never read to the host
        norms.append(float(fsdp.grad_norm[0]))
    return [cupy.asnumpy(p) for unit in fsdp.full_parameters() for p in unit], norms


@pytest.mark.gpu
def test_clipping_on_cupy_slices():
    from mp_harness import RankPool

    ranks = RankPool(2)
    try:
        results = ranks.run(_gpu_clip)
    finally:
        ranks.close()
    want, want_norms = reference("sgd")
    for params, norms in results:
        np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
        for got, expected in zip(params, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
