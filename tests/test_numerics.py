"""Where NCCL's arithmetic is not NumPy's, and the difference is the documented one.

The CPU backend reduces with NumPy: MIN/MAX propagate NaN, AVG divides the sum. NCCL's
MIN/MAX ignore NaN (fmin/fmax), float AVG multiplies each input by 1/n (rounded to the dtype)
before summing, and float16/bfloat16 sums round at every step. The emulated NCCL backend
models this (so the conformance suite's expectations match what a GPU gives); on a GPU the
same checks run against real NCCL.
"""

import numpy as np
import pytest

from mp_harness import run_ranks
from nccl_emulated_harness import emu, run  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(120)

N = 3
NAN_INPUTS = [np.array([1.0, np.nan, 5.0, np.nan], np.float32),
              np.array([np.nan, 2.0, 4.0, np.nan], np.float32),
              np.array([3.0, 7.0, np.nan, np.nan], np.float32)]
AVG_INPUTS = [np.array([0.1, 1e-3, 7.0, -2.5], np.float32) * (r + 1) for r in range(N)]


def _nccl_avg(inputs, dtype):
    """NCCL's float AVG: each input times 1/n rounded to the dtype, then summed in rank order."""
    scale = np.asarray(1.0 / len(inputs)).astype(dtype)
    total = (inputs[0] * scale).astype(dtype)
    for x in inputs[1:]:
        total = (total + (x * scale).astype(dtype)).astype(dtype)
    return total


def rank_numerics(comm, to_device, to_host):
    r = comm.rank
    out = {}
    for op in ("max", "min"):
        x = to_device(NAN_INPUTS[r].copy())
        comm.all_reduce(x, op=op)
        out[op] = to_host(x)
    x = to_device(AVG_INPUTS[r].copy())
    comm.all_reduce(x, op="avg")
    out["avg"] = to_host(x)
    return out


def _cpu_rank(comm):
    return rank_numerics(comm, lambda a: a, lambda a: a)


def test_the_cpu_backend_reduces_as_numpy_does():
    stacked = np.stack(NAN_INPUTS)
    for result in run_ranks(_cpu_rank, N, timeout=60):
        np.testing.assert_array_equal(result["max"], np.maximum.reduce(stacked))  # NaN wins
        np.testing.assert_array_equal(result["min"], np.minimum.reduce(stacked))
        np.testing.assert_array_equal(result["avg"],
                                      (np.add.reduce(np.stack(AVG_INPUTS), axis=0) / N)
                                      .astype(np.float32))


def _check_nccl(results):
    stacked = np.stack(NAN_INPUTS)
    for result in results:
        np.testing.assert_array_equal(result["max"], np.fmax.reduce(stacked))  # NaN ignored
        np.testing.assert_array_equal(result["min"], np.fmin.reduce(stacked))
        np.testing.assert_allclose(result["avg"], _nccl_avg(AVG_INPUTS, np.float32),
                                   rtol=2e-7, atol=0)
    assert np.isnan(results[0]["max"][3])  # NaN everywhere stays NaN


def test_the_emulated_nccl_backend_reduces_as_nccl_does(run, emu):
    cp = emu.cupy
    _check_nccl(run(N, lambda comm: rank_numerics(comm, cp.asarray, lambda a: a.get())))


def test_emulated_half_precision_sums_round_at_every_step(run, emu):
    cp = emu.cupy
    inputs = [np.array([2048.0], np.float16), np.array([1.0], np.float16),
              np.array([1.0], np.float16)]

    def fn(comm):
        x = cp.asarray(inputs[comm.rank].copy())
        comm.all_reduce(x)
        return x.get()

    # in the emulation's order (rank 0, 1, 2), 2048 + 1 rounds back to 2048 in float16 at each
    # step, where a float32 accumulator would give 2050 (on a GPU the ring decides the order)
    for got in run(3, fn):
        np.testing.assert_array_equal(got, np.array([2048.0], np.float16))


def _gpu_rank(comm):
    import cupy

    return rank_numerics(comm, cupy.asarray, cupy.asnumpy)


@pytest.mark.gpu
def test_real_nccl_reduces_as_documented():
    from gpucoll import config, cuda_env

    if cuda_env.device_count() < N and not (config.get("NCCL_MULTI_RANK_GPU_ENABLE")
                                            and cuda_env.nccl_version_code() >= 23000):
        pytest.skip(f"needs {N} GPUs, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1")
    _check_nccl(run_ranks(_gpu_rank, N, backend="nccl", timeout=120))

