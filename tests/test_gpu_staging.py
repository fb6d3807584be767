"""CuPy arrays on the CPU backend: staged through host memory, results back on the device.

This is how several processes share one GPU without NCCL. Skipped without CuPy and a GPU.
"""

import numpy as np
import pytest

from mp_harness import RankPool

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


def rank_cupy_collectives(comm):
    import cupy

    n, r = comm.size, comm.rank
    x = cupy.arange(1000, dtype=cupy.float32) * (r + 1)
    result = comm.all_reduce(x)
    assert result is x and isinstance(result, cupy.ndarray)
    out = cupy.zeros(1000, cupy.float32)
    comm.all_reduce(cupy.ones(1000, cupy.float32), op="max", out=out)
    gathered = comm.all_gather(cupy.full(3, r, cupy.int32))
    assert isinstance(gathered, cupy.ndarray)
    scattered = comm.reduce_scatter(cupy.ones((n, 4), cupy.float64))
    assert isinstance(scattered, cupy.ndarray)
    b = cupy.arange(5, dtype=cupy.int64) if r == 0 else cupy.zeros(5, cupy.int64)
    comm.broadcast(b, root=0)
    work = comm.all_reduce(cupy.full(7, 2.0), async_op=True)
    return (cupy.asnumpy(x), cupy.asnumpy(out), cupy.asnumpy(gathered), cupy.asnumpy(scattered),
            cupy.asnumpy(b), cupy.asnumpy(work.result()))


def test_cupy_arrays_staged_through_host():
    pool = RankPool(2)
    try:
        results = pool.run(rank_cupy_collectives)
    finally:
        pool.close()
    for x, out, gathered, scattered, b, avg in results:
        np.testing.assert_array_equal(x, np.arange(1000, dtype=np.float32) * 3)
        np.testing.assert_array_equal(out, np.ones(1000, np.float32))
        np.testing.assert_array_equal(gathered, [[0] * 3, [1] * 3])
        np.testing.assert_array_equal(scattered, np.full(4, 2.0))
        np.testing.assert_array_equal(b, np.arange(5))
        np.testing.assert_array_equal(avg, np.full(7, 4.0))
