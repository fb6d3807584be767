"""Parameter servers: synchronous training equals one process on the full batch (1 and 2
servers, shards of unequal size), workers arriving in any order, the staleness bound of
asynchronous mode, a dead or silent worker reported by rank, and usage errors."""

import os
import time

import numpy as np
import pytest

from gpucoll.examples.train_digits import init_params, loss_and_grads, sgd_step
from gpucoll.ps import ParameterServer, PSLayout, PSWorker
from mp_harness import RankPool, rank_pools, run_ranks

# ranks share the cores: one BLAS thread each (else oversubscription slows steps 100x)
_ONE_BLAS_THREAD = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")

pytestmark = pytest.mark.timeout(120)

SIZES = [9, 11, 5]         # 170 elements, 176 with alignment padding: 3 servers get 59/59/58
BATCH = 12                 # divisible by 1, 2 and 3 workers
STEPS, LR = 4, 0.1


pool = rank_pools([3, 4], shared=True)


def _data():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((STEPS, BATCH, SIZES[0])).astype(np.float32)
    return x, rng.integers(0, SIZES[-1], (STEPS, BATCH))


def reference():
    x, y = _data()
    params = init_params(SIZES, seed=8)
    velocity = [np.zeros_like(p) for p in params]
    for step in range(STEPS):
        _, _, grads = loss_and_grads(params, x[step], y[step])
        sgd_step(params, grads, velocity, LR, momentum=0.9)
    return params


def rank_train(comm, num_servers, staleness=0, delays=None):
    """Servers serve; worker i trains on its slice of every batch, sleeping
    ``delays[i][step]`` seconds before each push (arrival order under the test's control)."""
    params = init_params(SIZES, seed=8 if comm.rank < num_servers else 100 + comm.rank)
    if comm.rank < num_servers:
        server = ParameterServer(comm, params, num_servers=num_servers, staleness=staleness,
                                 lr=LR, momentum=0.9)
        return "server", server.serve(), server.state_bytes()
    worker = PSWorker(comm, params, num_servers=num_servers, staleness=staleness)
    index, workers = comm.rank - num_servers, comm.size - num_servers
    local = BATCH // workers
    x, y = _data()
    for step in range(STEPS):
        rows = slice(index * local, (index + 1) * local)
        _, _, grads = loss_and_grads(params, x[step, rows], y[step, rows], scale=1.0)
        if delays:
            time.sleep(delays[index][step])
        worker.push_pull(grads)
    worker.close()
    return "worker", params, (worker.bytes_sent, worker.bytes_received)


@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_synchronous_equals_full_batch(pool, num_servers):
    if num_servers >= pool.world_size:
        pytest.skip("no worker left")
    expected = reference()
    results = pool.run(rank_train, num_servers)
    workers = pool.world_size - num_servers
    layout = PSLayout(type("C", (), {"size": pool.world_size})(), expected, num_servers, 0)
    if num_servers == 3:
        assert layout.total % 3, "shards of unequal size"
    for role, params, extra in results[num_servers:]:
        assert role == "worker"
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        sent, received = extra
        itemsize = 4
        assert sent == STEPS * layout.total * itemsize + (STEPS + 1) * 16 * num_servers
        assert received == (STEPS + 1) * layout.total * itemsize
    shard_sizes = []
    for server, (role, stats, state_bytes) in enumerate(results[:num_servers]):
        assert role == "server" and stats["updates"] == STEPS
        assert stats["pushes"] == {w: STEPS for w in range(num_servers, pool.world_size)}
        assert stats["max_staleness"] == 0 and len(stats["arrivals"]) == STEPS * workers
        shard_sizes.append(state_bytes // 4)    # momentum: one float per owned element
    assert sum(shard_sizes) == layout.total and max(shard_sizes) - min(shard_sizes) <= 1


def test_workers_arriving_in_reverse_order(pool):
    """The last worker pushes first at every step: the server must take it first and the
    result must not change."""
    workers = pool.world_size - 1
    delays = [[0.15 * (workers - 1 - i) if step % 2 == 0 else 0.0 for step in range(STEPS)]
              for i in range(workers)]
    expected = reference()
    results = pool.run(rank_train, 1, 0, delays)
    arrivals = results[0][1]["arrivals"]
    assert arrivals[:workers] == list(range(pool.world_size - 1, 0, -1))
    for _, params, _ in results[1:]:
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_async_staleness_bound(pool, staleness):
    """Worker 0 is slow: the others may run ahead of it by ``staleness`` steps, never more."""
    workers = pool.world_size - 1
    delays = [[0.08] * STEPS] + [[0.0] * STEPS for _ in range(workers - 1)]
    results = pool.run(rank_train, 1, staleness, delays)
    stats = results[0][1]
    assert stats["max_lead"] <= staleness
    assert stats["updates"] == (STEPS * workers if staleness else STEPS)
    if staleness:
        assert stats["max_lead"] == staleness      # the fast workers did run ahead
        assert stats["max_staleness"] >= 1
    params = [r[1] for r in results[1:]]
    for got in params:      # async training still moves towards the same weights
        for g in got:
            assert np.isfinite(g).all()


def rank_dies(rank, size, url, num_servers, mode):
    """The last rank dies (or hangs) after two steps; every other rank reports."""
    import gpucoll

    comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url)
    params = init_params(SIZES, seed=1)
    start = time.monotonic()
    try:
        if rank < num_servers:
            ParameterServer(comm, params, num_servers=num_servers, lr=LR).serve()
            return "served", None
        worker = PSWorker(comm, params, num_servers=num_servers)
        for step in range(STEPS):
            if step == 2 and rank == size - 1:
                if mode == "dies":
                    os._exit(3)
                time.sleep(30)          # hangs: silent past the timeout
            _, _, grads = loss_and_grads(params, np.ones((2, SIZES[0]), np.float32),
                                         np.zeros(2, np.int64))
            start = time.monotonic()
            worker.push_pull(grads)
        worker.close()
        return "finished", None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_dead_worker_is_reported_by_rank(mode):
    size, timeout = 4, 2.0
    results = run_ranks(rank_dies, size, 2, mode, init=False, ranks=[0, 1, 2], timeout=60,
                        env={"GPUCOLL_TIMEOUT": str(timeout)})
    for server in (0, 1):
        message, elapsed = results[server]
        assert message.startswith("PeerError: parameter server rank")
        assert f"worker rank {size - 1}" in message and "after 2 pushes" in message
        assert elapsed < 3 * timeout
    message, _ = results[2]     # the surviving worker fails too instead of hanging
    assert message.split(":")[0] in ("PeerError", "CommAbortedError", "CommTimeoutError")


class FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_usage_errors():
    params = init_params(SIZES)
    with pytest.raises(ValueError, match="num_servers=3 leaves no worker among 3 ranks"):
        ParameterServer(FakeComm(0, 3), params, num_servers=3)
    with pytest.raises(ValueError, match="num_servers=5 leaves no worker among 4 ranks"):
        PSWorker(FakeComm(3, 4), params, num_servers=5)
    with pytest.raises(ValueError, match="num_servers must be an int >= 1, got 0"):
        PSLayout(FakeComm(0, 3), params, 0, 0)
    with pytest.raises(ValueError, match="staleness must be an int >= 0, got -1"):
        PSLayout(FakeComm(0, 3), params, 1, -1)
    with pytest.raises(ValueError, match="rank 2 is a worker"):
        ParameterServer(FakeComm(2, 3), params)
    with pytest.raises(ValueError, match="rank 0 is a server"):
        PSWorker(FakeComm(0, 3), params)
    with pytest.raises(ValueError, match="2 parameter elements cannot be sharded across 4"):
        PSLayout(FakeComm(0, 5), [np.zeros(2, np.float64)], 4, 0)
    with pytest.raises(TypeError, match="float16"):
        PSLayout(FakeComm(0, 3), [np.zeros(3, np.float16)], 1, 0)
    layout = PSLayout(FakeComm(0, 9), params, 3, 0)
    with pytest.raises(ValueError, match="shapes"):
        layout.check(params[:-1] + [np.zeros(7, np.float32)])


def _gpu_rank(comm):
    import cupy

    params = [cupy.asarray(p) for p in init_params(SIZES, seed=8)]
    if comm.rank == 0:
        ParameterServer(comm, params, lr=LR, momentum=0.9).serve()
        return None
    worker = PSWorker(comm, params)
    x, y = _data()
    local = BATCH // (comm.size - 1)
    rows = slice((comm.rank - 1) * local, comm.rank * local)
    for step in range(STEPS):
        _, _, grads = loss_and_grads(params, cupy.asarray(x[step, rows]),
                                     cupy.asarray(y[step, rows]), cupy)
        worker.push_pull(grads)
    worker.close()
    return [cupy.asnumpy(p) for p in params]


@pytest.mark.gpu
def test_synchronous_on_cupy_arrays():
    pool = RankPool(3)
    try:
        results = pool.run(_gpu_rank)
    finally:
        pool.close()
    expected = reference()
    for params in results[1:]:
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _final_accuracy(argv, n):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", str(n), "-m"] + argv +
                         ["--epochs", "6", "--cpu", "--batch-size", "60"],
                         capture_output=True, text=True, timeout=100,
                         env=_ONE_BLAS_THREAD)
    assert out.returncode == 0, out.stdout + out.stderr
    epochs = [line for line in out.stdout.splitlines() if "] epoch" in line]
    assert len(epochs) == 6
    return float(epochs[-1].split("test acc")[1].split()[0]), out.stdout


def test_example_reaches_data_parallel_accuracy():
    """Async PS, 2 servers, 2 workers, against data parallelism on 2 ranks: within 2 points."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    ps, stdout = _final_accuracy(["gpucoll.examples.train_ps", "--mode", "async", "--servers",
                                  "2", "--staleness", "1"], 4)
    ddp, _ = _final_accuracy(["gpucoll.examples.train_digits"], 2)
    assert "2 server(s), 2 worker(s), mode async (staleness 1)" in stdout
    assert ps > 0.9 and abs(ps - ddp) <= 0.02, (ps, ddp)
