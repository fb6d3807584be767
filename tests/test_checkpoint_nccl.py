"""Checkpoints over the NCCL backend (the CUDA emulation here; real CuPy and NCCL on a GPU):
FSDP state on device arrays, gathered to one rank or to all through NCCL, saved by two ranks
and loaded by three into ZeRO-1, with the values a NumPy computation gives and the
optimizer's state created on the device."""

import numpy as np
import pytest

from gpucoll.ddp import FullyShardedParameters, ShardedOptimizer
from gpucoll.examples.train_digits import init_params
from mp_harness import run_ranks
from nccl_emulated_harness import emu, run  # noqa: F401
from test_nccl_gpu import MULTI_RANK_ENV, on_nccl, two_ranks

pytestmark = pytest.mark.timeout(120)

SIZES = [13, 17, 11, 7]
LR, MOMENTUM = 0.1, 0.9


@pytest.fixture
def device_arrays(emu):
    """The emulation's CuPy: the helpers find it from its arrays, as they find CuPy."""
    return emu.cupy


def _unit_grad(unit):
    return 0.01 * (unit + 1)


def expected():
    """One SGD-momentum update of every parameter of unit u by the constant gradient
    0.01 (u + 1), in NumPy: the velocity is the gradient, the parameter moves by lr times it."""
    params = init_params(SIZES, seed=3)
    grads = [np.full(p.shape, _unit_grad(i // 2), np.float32) for i, p in enumerate(params)]
    return [p - np.float32(LR) * g for p, g in zip(params, grads)], grads


def _save(comm, xp, where, steps=1):
    """FSDP on device arrays after one optimizer update of its slices (the fused bucket
    kernels, which the emulation does not run, are not needed for it)."""
    params = [xp.asarray(p) for p in init_params(SIZES, seed=3)]
    fsdp = FullyShardedParameters(comm, [params[i:i + 2] for i in range(0, 6, 2)], "sgd",
                                  lr=LR, momentum=MOMENTUM)
    for unit, mine in enumerate(fsdp.shards()):
        fsdp.optimizer.update(unit, mine, mine * 0 + _unit_grad(unit))
    fsdp.steps = 1
    on_one = fsdp.state_dict(root=1)
    on_all = fsdp.state_dict()
    fsdp.save_checkpoint(where)
    return on_one, on_all


def _load(comm, xp, where):
    params = [xp.asarray(p * 0) for p in init_params(SIZES, seed=3)]
    zero = ShardedOptimizer(comm, params, "sgd", lr=1.0, first_bucket_cap_bytes=64,
                            bucket_cap_bytes=512)
    zero.load_checkpoint(where)
    velocity = zero.state_dict()["optimizer"]["state"]["velocity"]
    modules = {type(slot["velocity"]).__module__ for slot in zero.optimizer.state}
    return [xp.asnumpy(p) for p in params], velocity, zero.optimizer.lr, modules


def _check(results):
    want_params, want_velocity = expected()
    for params, velocity, lr, modules in results:
        assert lr == LR and len(modules) == 1 and "numpy" not in modules.pop()
        for got, want in zip(params + velocity, want_params + want_velocity):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fsdp_saved_on_two_ranks_loads_into_zero_on_three(run, device_arrays, tmp_path):
    where = str(tmp_path / "ckpt")
    saved = run(2, lambda comm: _save(comm, device_arrays, where))
    want_params, want_velocity = expected()
    assert saved[0][0] is None
    for state in (saved[1][0], saved[0][1], saved[1][1]):
        for got, want in zip(state["params"], want_params):
            assert isinstance(got, np.ndarray)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(state["optimizer"]["state"]["velocity"], want_velocity):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    _check(run(3, lambda comm: _load(comm, device_arrays, where)))


def _gpu_rank(comm, where):
    import cupy

    _save(comm, cupy, where)
    return _load(comm, cupy, where)


@pytest.mark.gpu
@two_ranks
def test_over_nccl_two_ranks_on_one_gpu(tmp_path):
    got = run_ranks(on_nccl, 2, _gpu_rank, str(tmp_path / "ckpt"), init=False,
                    env=MULTI_RANK_ENV, timeout=240)
    _check(got)
