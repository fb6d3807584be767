"""PowerSGD compression: at full rank it is the exact average (NumPy's mean of the ranks'
gradients); at low rank every step equals a one-process NumPy simulation of the algorithm
(power iteration with Gram-Schmidt, warm start, error feedback), on 2 and 3 ranks; exact
averaging before ``start_step`` and for vectors; the bytes it sends; usage errors."""

import numpy as np
import pytest

from gpucoll.ddp import PowerSGD
from mp_harness import RankPool, error_text, rank_pools

pytestmark = pytest.mark.timeout(120)

SHAPES = [(24, 16), (16,), (16, 4, 3), (5,)]    # two matrices (one 3-D), two vectors
pool = rank_pools([2, 3])


def grads_of(rank, step):
    rng = np.random.default_rng([3, rank, step])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def gram_schmidt(matrix):
    out = matrix.astype(np.float64)
    for i in range(out.shape[1]):
        out[:, i] /= np.linalg.norm(out[:, i]) + 1e-8
        for j in range(i + 1, out.shape[1]):
            out[:, j] -= (out[:, i] @ out[:, j]) * out[:, i]
    return out


def simulate(size, steps, rank, start_step):
    """Every rank's gradients after each step, in float64, by the algorithm of Vogels et al.
    with torch's choices (Q from a seeded normal draw, orthogonalized; Q kept between steps;
    error feedback of each rank's own residual)."""
    rng = np.random.default_rng(0)
    matrices = [i for i, s in enumerate(SHAPES) if len(s) >= 2]
    dims = {i: (SHAPES[i][0], int(np.prod(SHAPES[i][1:]))) for i in matrices}
    ranks = {i: min(rank, *dims[i]) for i in matrices}
    q = {i: gram_schmidt(rng.standard_normal((dims[i][1], ranks[i])).astype(np.float32))
         for i in matrices}
    error = {(r, i): np.zeros(dims[i]) for r in range(size) for i in matrices}
    history = []
    for step in range(1, steps + 1):
        given = [[g.astype(np.float64) for g in grads_of(r, step)] for r in range(size)]
        mean = [sum(given[r][i] for r in range(size)) / size for i in range(len(SHAPES))]
        out = [[m.copy() for m in mean] for _ in range(size)]
        if step > start_step:
            for i in matrices:
                local = [given[r][i].reshape(dims[i]) + error[(r, i)] for r in range(size)]
                p = gram_schmidt(sum(m @ q[i] for m in local))
                q[i] = sum(m.T @ p for m in local) / size
                approx = p @ q[i].T
                for r in range(size):
                    error[(r, i)] = local[r] - approx
                    out[r][i] = approx.reshape(SHAPES[i])
        history.append(out)
    return history


def rank_compress(comm, steps, rank, start_step, min_compression=0.1):
    compressor = PowerSGD(comm, [np.zeros(s, np.float32) for s in SHAPES], rank=rank,
                          start_step=start_step, min_compression=min_compression)
    history = []
    for step in range(1, steps + 1):
        grads = grads_of(comm.rank, step)
        assert compressor.reduce(grads)[0] is grads[0]          # in place
        history.append(grads)
    return history, [m.index for m in compressor.matrices], compressor.wire_elements(), \
        compressor.wire_elements(compressed=False)


def test_full_rank_is_the_exact_average(pool):
    n = pool.world_size
    for history, compressed, _, _ in pool.run(rank_compress, 3, 64, 0):
        assert compressed == [0, 2]
        for step, grads in enumerate(history, start=1):
            given = [grads_of(r, step) for r in range(n)]
            for i, got in enumerate(grads):
                np.testing.assert_allclose(got, np.mean([g[i] for g in given], axis=0),
                                           rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rank", [1, 3])
def test_low_rank_steps_equal_the_simulation(pool, rank):
    n, steps, start = pool.world_size, 5, 2
    want = simulate(n, steps, rank, start)
    results = pool.run(rank_compress, steps, rank, start)
    for r, (history, _, wire, plain) in enumerate(results):
        assert plain == sum(int(np.prod(s)) for s in SHAPES)
        assert wire == rank * (24 + 16) + rank * (16 + 12) + 16 + 5
        for step in range(steps):
            for got, expected in zip(history[step], want[step][r]):
                np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5)
    # low rank is not the mean: the compressed steps differ from it, the others do not
    mean = np.mean([grads_of(r, steps)[0] for r in range(n)], axis=0)
    assert not np.allclose(results[0][0][-1][0], mean, atol=1e-3)
    np.testing.assert_allclose(results[0][0][-1][1],
                               np.mean([grads_of(r, steps)[1] for r in range(n)], axis=0),
                               rtol=1e-5, atol=1e-6)


def test_small_matrices_stay_uncompressed(solo):
    compressor = PowerSGD(solo, [np.zeros(s, np.float32) for s in SHAPES], rank=4)
    assert [m.index for m in compressor.matrices] == [0]      # 16x12 at rank 4 saves < 2x
    assert compressor.plain == [1, 2, 3]


def test_usage_errors(solo):
    params = [np.zeros(s, np.float32) for s in SHAPES]
    for kwargs, words in [({"rank": 0}, "rank must be an int >= 1"),
                          ({"start_step": -1}, "start_step must be an int >= 0"),
                          ({"min_compression": 0}, "min_compression must be > 0")]:
        with pytest.raises(ValueError, match=words):
            PowerSGD(solo, params, **kwargs)
    with pytest.raises(TypeError, match="one dtype, float32 or float64"):
        PowerSGD(solo, [np.zeros(3, np.float16)])
    compressor = PowerSGD(solo, params)
    assert error_text(lambda: compressor.reduce(params[:2])) == \
        "ValueError: got 2 gradients for 4 parameters"
    bad = [p.copy() for p in params]
    bad[2] = np.zeros((16, 4, 3), np.float64)
    assert error_text(lambda: compressor.reduce(bad)) == \
        "TypeError: gradient 2 has dtype float64, expected float32"
    bad[2] = np.zeros((16, 3, 4), np.float32).transpose(0, 2, 1)
    assert error_text(lambda: compressor.reduce(bad)).startswith(
        "ValueError: gradient 2 must be C-contiguous")


def _gpu_compress(comm):
    import cupy

    compressor = PowerSGD(comm, [cupy.zeros(s, cupy.float32) for s in SHAPES], rank=3,
                          start_step=2, min_compression=0.1)
    history = []
    for step in range(1, 6):
        grads = [cupy.asarray(g) for g in grads_of(comm.rank, step)]
        compressor.reduce(grads)
        history.append([cupy.asnumpy(g) for g in grads])
    return history


@pytest.mark.gpu
def test_cupy_gradients_equal_the_simulation():
    ranks = RankPool(2)
    try:
        results = ranks.run(_gpu_compress)
    finally:
        ranks.close()
    want = simulate(2, 5, 3, 2)
    for r, history in enumerate(results):
        for step in range(5):
            for got, expected in zip(history[step], want[step][r]):
                np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5)


def test_the_digits_example_trains_as_well_compressed():
    """Error feedback at work: rank-4 approximations of every weight's gradient reach the
    exact average's accuracy (the weights are 64x128, 128x128 and 128x10)."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GPUCOLL_QUIET="1")
    accuracy = {}
    for extra in ([], ["--powersgd", "4"]):
        run = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "2", "-m",
                              "gpucoll.examples.train_digits", "--cpu", "--epochs", "5", *extra],
                             capture_output=True, text=True, timeout=100, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        found = re.findall(r"epoch +5 .* test acc ([0-9.]+)", run.stdout)
        assert found, run.stdout
        accuracy[bool(extra)] = float(found[0])
    assert accuracy[False] > 0.95
    assert abs(accuracy[True] - accuracy[False]) <= 0.02, accuracy
