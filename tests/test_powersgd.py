"""PowerSGD compression: at full rank it is the exact average (NumPy's mean of the ranks'
gradients); at low rank every step equals a one-process NumPy simulation of the algorithm
(power iteration with Gram-Schmidt, warm start, error feedback), on 2 and 3 ranks; exact
averaging before ``start_step`` and for vectors; the bytes it sends; usage errors. As a
Bucketer's comm hook: the same steps as ``reduce`` and the simulation under several bucket
plans, what is sent during backward and in which order (a logging communicator, no timing),
``no_sync``, abandoned steps, and the combinations it refuses."""

import numpy as np
import pytest

from gpucoll.ddp import Bucketer, PowerSGD
from mp_harness import RankPool, error_text, rank_pools, run_ranks
from test_nccl_gpu import MULTI_RANK_ENV, on_nccl, two_ranks

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


def simulate(size, steps, rank, start_step, error_feedback=True):
    """Every rank's gradients after each step, in float64, by the algorithm of Vogels et al.
    with torch's choices (Q from a seeded normal draw, orthogonalized; Q kept between steps;
    error feedback of each rank's own residual, unless turned off)."""
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
                    error[(r, i)] = local[r] - approx if error_feedback else 0
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


# ---------------------------------------------------------------- as a Bucketer's comm hook
PLANS = {"one bucket": (25 << 20, 1 << 20), "two buckets": (1000, 500),
         "one tensor each": (1, 1)}


class Recording:
    """A communicator that logs every all-reduce it passes on (``("issue", n, elements)``)
    and every wait of one (``("wait", n)``): what was sent when, without timing anything."""

    def __init__(self, comm):
        self.comm, self.log = comm, []
        self.rank, self.size = comm.rank, comm.size

    def all_reduce(self, x, op="sum", *, out=None, async_op=False):
        number = sum(1 for entry in self.log if entry[0] == "issue")
        self.log.append(("issue", number, int(x.size)))
        work = self.comm.all_reduce(x, op, out=out, async_op=async_op)
        if not async_op:
            self.log.append(("wait", number))
            return work
        return RecordedWork(work, self.log, number)


class RecordedWork:
    def __init__(self, work, log, number):
        self.work, self.log, self.number = work, log, number

    def wait(self, timeout=None):
        self.log.append(("wait", self.number))
        return self.work.wait(timeout)


def bucketed(comm, params, plan, **settings):
    cap, first_cap = PLANS[plan]
    return Bucketer(comm, params, bucket_cap_bytes=cap, first_bucket_cap_bytes=first_cap,
                    comm_hook=PowerSGD(comm, params, **settings))


def rank_compress_bucketed(comm, steps, rank, start_step, error_feedback):
    """Each plan's bucketed history, and PowerSGD.reduce's on the same gradients."""
    params = [np.zeros(s, np.float32) for s in SHAPES]
    settings = dict(rank=rank, start_step=start_step, min_compression=0.1,
                    error_feedback=error_feedback)
    compressor = PowerSGD(comm, params, **settings)
    bucketers = {plan: bucketed(comm, params, plan, **settings) for plan in PLANS}
    histories = {plan: [] for plan in ["reduce", *PLANS]}
    for step in range(1, steps + 1):
        histories["reduce"].append(compressor.reduce(grads_of(comm.rank, step)))
        for plan, bucketer in bucketers.items():
            grads = grads_of(comm.rank, step)
            returned = bucketer.reduce(grads)
            assert all(a is b for a, b in zip(returned, grads))        # in place
            histories[plan].append(grads)
    return histories, {plan: b.buckets for plan, b in bucketers.items()}


@pytest.mark.parametrize("error_feedback", [True, False], ids=["feedback", "no-feedback"])
def test_bucketed_steps_equal_reduce_and_the_simulation(pool, error_feedback):
    n, steps, start, rank = pool.world_size, 4, 2, 2
    want = simulate(n, steps, rank, start, error_feedback)
    results = pool.run(rank_compress_bucketed, steps, rank, start, error_feedback)
    assert results[0][1] == {"one bucket": [[3, 2, 1, 0]], "two buckets": [[3, 2], [1, 0]],
                             "one tensor each": [[3], [2], [1], [0]]}
    for r, (histories, _) in enumerate(results):
        for plan in PLANS:
            for step in range(steps):
                for i, (got, reference) in enumerate(zip(histories[plan][step],
                                                         histories["reduce"][step])):
                    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6,
                                               err_msg=f"{plan}, step {step + 1}, grad {i}")
                    np.testing.assert_allclose(got, want[step][r][i], rtol=2e-4, atol=2e-5)


def test_p_is_sent_during_backward_and_every_q_before_any_wait(solo):
    comm = Recording(solo)
    bucketer = bucketed(comm, [np.zeros(s, np.float32) for s in SHAPES], "two buckets",
                        rank=2, start_step=1, min_compression=0.1)
    for step in (1, 2):                 # exact, then compressed
        comm.log.clear()
        grads = grads_of(0, step)
        for index, sent in [(3, 0), (2, 1), (1, 1), (0, 2)]:   # backward: last layer first
            bucketer.mark_ready(index, grads[index])
            assert len(comm.log) == sent, (step, index, comm.log)
        issued = list(comm.log)
        bucketer.finish()
        finished = comm.log[len(issued):]
        if step == 1:                   # each bucket whole, as the plain Bucketer sends it
            assert [e[2] for e in issued] == [8 + 16 * 4 * 3, 16 + 24 * 16]
            assert finished == [("wait", 0), ("wait", 1)]
            continue
        # P (16x12 and 24x16 at rank 2) with the plain vectors (5 and 16 floats; 4-aligned)
        assert [e[2] for e in issued] == [16 * 2 + 8, 24 * 2 + 16]
        assert finished == [("wait", 0), ("issue", 2, 12 * 2), ("wait", 1),
                            ("issue", 3, 16 * 2), ("wait", 2), ("wait", 3)]


def test_no_sync_accumulates_then_compresses_the_sum(solo):
    comm = Recording(solo)
    params = [np.zeros(s, np.float32) for s in SHAPES]
    bucketer = bucketed(comm, params, "two buckets", rank=2, start_step=1, min_compression=0.1)
    reference = PowerSGD(solo, params, rank=2, start_step=1, min_compression=0.1)
    for step in (1, 2, 3):              # two micro-batches each: the first accumulates
        with bucketer.no_sync():
            bucketer.reduce(grads_of(0, 10 + step))
        assert comm.log == []           # nothing sent inside no_sync
        got = bucketer.reduce(grads_of(0, step))
        comm.log.clear()
        want = reference.reduce([a + b for a, b in zip(grads_of(0, 10 + step),
                                                       grads_of(0, step))])
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"step {step}, {i}")


@pytest.mark.parametrize("abandon", ["loss_scale", "check_finite", "missing gradient"])
def test_an_abandoned_step_leaves_no_trace(solo, abandon):
    """The refused finish() raises, and the next steps equal those of a PowerSGD that never
    saw the abandoned ones: before step 2 (still exact: were it counted, step 2 would
    compress) and before step 4 (compressing: error feedback's addition is undone)."""
    params = [np.zeros(s, np.float32) for s in SHAPES]
    bucketer = bucketed(solo, params, "two buckets", rank=2, start_step=2, min_compression=0.1)
    reference = PowerSGD(solo, params, rank=2, start_step=2, min_compression=0.1)
    for step in (1, 2, 3, 4, 5):
        if step in (2, 4):
            grads = grads_of(0, 99)
            for index in (3, 2, 1) if abandon == "missing gradient" else (3, 2, 1, 0):
                bucketer.mark_ready(index, grads[index])
            kwargs = {"loss_scale": {"loss_scale": 2.0}, "check_finite": {"check_finite": True},
                      "missing gradient": {}}[abandon]
            words = "were not marked ready" if kwargs == {} else "neither unscales nor checks"
            with pytest.raises(ValueError, match=words):
                bucketer.finish(**kwargs)
            np.testing.assert_array_equal(grads[0], grads_of(0, 99)[0])    # untouched
        got = bucketer.reduce(grads_of(0, step))
        want = reference.reduce(grads_of(0, step))
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"step {step}, {i}")


def test_comm_hook_usage_errors(solo):
    comm = Recording(solo)
    params = [np.zeros(s, np.float32) for s in SHAPES]
    hook = PowerSGD(comm, params)
    for kwargs, words in [({"compression": "bf16"}, "compression='bf16' and a comm hook"),
                          ({"compression": "fp16"}, "compression='fp16' and a comm hook"),
                          ({"average": False}, "average=False and a comm hook"),
                          ({"uneven_inputs": True}, "uneven_inputs=True and a comm hook")]:
        with pytest.raises(ValueError, match=words):
            Bucketer(comm, params, comm_hook=hook, **kwargs)
    with pytest.raises(TypeError, match="comm_hook must be a gpucoll.ddp CommHook"):
        Bucketer(comm, params, comm_hook=lambda bucket: None)
    with pytest.raises(ValueError, match="must share one communicator"):
        Bucketer(solo, params, comm_hook=hook)
    with pytest.raises(ValueError, match="shapes"):
        Bucketer(comm, params[:2], comm_hook=hook)
    with pytest.raises(TypeError, match=r"dtypes \['float64'\]"):
        Bucketer(comm, [p.astype(np.float64) for p in params], comm_hook=hook)
    bucketer = Bucketer(comm, params, comm_hook=hook)
    with pytest.raises(ValueError, match="already the comm hook of a Bucketer"):
        Bucketer(comm, params, comm_hook=hook)
    with pytest.raises(ValueError, match="runs? through bucketer.mark_ready"):
        hook.reduce(params)
    with pytest.raises(ValueError, match="gradient 2 must be C-contiguous"):
        bucketer.mark_ready(2, np.zeros((16, 3, 4), np.float32).transpose(0, 2, 1))
    with pytest.raises(RuntimeError, match="join"):
        bucketer.join()
    assert comm.log == []               # every refusal came before anything was sent


def _gpu_compress_bucketed(comm):
    """Two buckets of CuPy gradients with PowerSGD as their comm hook: each step's results."""
    import cupy

    params = [cupy.zeros(s, cupy.float32) for s in SHAPES]
    cap, first_cap = PLANS["two buckets"]
    bucketer = Bucketer(comm, params, bucket_cap_bytes=cap, first_bucket_cap_bytes=first_cap,
                        comm_hook=PowerSGD(comm, params, rank=3, start_step=2,
                                           min_compression=0.1))
    history = []
    for step in range(1, 6):
        grads = [cupy.asarray(g) for g in grads_of(comm.rank, step)]
        bucketer.reduce(grads)
        history.append([cupy.asnumpy(g) for g in grads])
    return history, bucketer.buckets


def _check_against_the_simulation(results):
    want = simulate(2, 5, 3, 2)
    for r, (history, buckets) in enumerate(results):
        assert buckets == [[3, 2], [1, 0]]
        for step in range(5):
            for got, expected in zip(history[step], want[step][r]):
                np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5)


@pytest.mark.gpu
def test_bucketed_cupy_gradients_equal_the_simulation():
    """PowerSGD per bucket on CuPy arrays through the CPU backend (staged through host
    memory)."""
    ranks = RankPool(2)
    try:
        _check_against_the_simulation(ranks.run(_gpu_compress_bucketed))
    finally:
        ranks.close()


@pytest.mark.gpu
@two_ranks
def test_bucketed_over_nccl_two_ranks_on_one_gpu():
    _check_against_the_simulation(run_ranks(on_nccl, 2, _gpu_compress_bucketed, init=False,
                                            env=MULTI_RANK_ENV, timeout=240))
