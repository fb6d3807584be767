"""CuPy arrays on the CPU backend, every collective: staged through host memory, results back on
the device.

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


def rank_cupy_remaining_collectives(comm):
    """reduce, gather, scatter, all_to_all, send / recv and barrier on CuPy arrays."""
    import cupy

    n, r = comm.size, comm.rank
    reduced = comm.reduce(cupy.full(6, r + 1, cupy.int64), root=1, op="max")
    gathered = comm.gather(cupy.full(2, r, cupy.float32), root=0)
    blocks = cupy.arange(n * 3, dtype=cupy.float64).reshape(n, 3) if r == 0 else None
    chunk = comm.scatter(blocks, root=0, out=cupy.empty(3, cupy.float64))
    exchanged = comm.all_to_all(cupy.arange(n * 2, dtype=cupy.int32).reshape(n, 2) + 100 * r)
    if r == 0:
        comm.send(cupy.arange(4, dtype=cupy.float16), dst=1)
        received = None
    else:
        received = comm.recv(cupy.empty(4, cupy.float16), src=0)
    comm.barrier()
    kinds = {type(v).__module__.split(".")[0] for v in (reduced, gathered, chunk, exchanged, received)
             if v is not None}
    host = lambda v: None if v is None else cupy.asnumpy(v)  # noqa: E731
    return kinds, host(reduced), host(gathered), host(chunk), host(exchanged), host(received)


def rank_cupy_scans(comm):
    """scan and exscan of CuPy arrays: staged sends and receives, combined on the GPU."""
    import cupy

    r = comm.rank
    x = cupy.arange(6, dtype=cupy.int64) + 10 * r
    out = cupy.zeros(6, cupy.int64)
    assert comm.scan(x, out=out) is out
    y = cupy.full(3, r + 1.0, cupy.float32)
    assert comm.exscan(y, op="min") is y
    return cupy.asnumpy(out), cupy.asnumpy(y)


def test_scan_and_exscan_on_cupy_arrays():
    pool = RankPool(3)
    try:
        results = pool.run(rank_cupy_scans)
    finally:
        pool.close()
    for r, (scanned, exscanned) in enumerate(results):
        np.testing.assert_array_equal(scanned, sum(np.arange(6) + 10 * q for q in range(r + 1)))
        np.testing.assert_array_equal(exscanned, np.full(3, 1.0 if r else np.inf, np.float32))


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


def test_every_other_collective_on_cupy_arrays():
    pool = RankPool(2)
    try:
        results = pool.run(rank_cupy_remaining_collectives)
    finally:
        pool.close()
    for r, (kinds, reduced, gathered, chunk, exchanged, received) in enumerate(results):
        assert kinds == {"cupy"}, f"rank {r}: results must come back as CuPy arrays, got {kinds}"
        if r == 1:
            np.testing.assert_array_equal(reduced, np.full(6, 2))
            np.testing.assert_array_equal(received, np.arange(4, dtype=np.float16))
        else:
            assert reduced is None and received is None
            np.testing.assert_array_equal(gathered, [[0, 0], [1, 1]])
        np.testing.assert_array_equal(chunk, np.arange(6, dtype=np.float64).reshape(2, 3)[r])
        sent = [np.arange(4, dtype=np.int32).reshape(2, 2) + 100 * q for q in range(2)]
        np.testing.assert_array_equal(exchanged, np.stack([sent[q][r] for q in range(2)]))
