"""Parameter servers beside NCCL: refused on the NCCL communicator itself, with the remedy
named, before anything is sent; run over its ``host_group()`` with device arrays (the CUDA
emulation here, real CuPy and NCCL on a GPU), where synchronous training equals one process
on the full batch and asynchronous training keeps its staleness bound.

A server takes whichever worker's message comes first. NCCL runs a rank's operations in issue
order, so a header receive posted for a slow worker would hold back the fast ones (and, with
several servers answering at once, can close a cycle of waits); the host group's receives
complete in any order.
"""

import numpy as np
import pytest

from gpucoll.examples.train_digits import init_params, loss_and_grads
from gpucoll.ps import ParameterServer, PSWorker
from mp_harness import run_ranks
from nccl_emulated_harness import emu, run  # noqa: F401
from test_nccl_gpu import MULTI_RANK_ENV, on_nccl, two_ranks
from test_ps import BATCH, LR, SIZES, STEPS, _data, reference

pytestmark = pytest.mark.timeout(120)


def _train(comm, xp, num_servers, staleness):
    """Servers serve, workers train on their slice of each batch, over ``comm.host_group()``;
    (role, server stats or worker parameters as NumPy arrays)."""
    params = [xp.asarray(p) for p in init_params(SIZES, seed=8)]
    host = comm.host_group()
    try:
        if comm.rank < num_servers:
            server = ParameterServer(host, params, num_servers=num_servers,
                                     staleness=staleness, lr=LR, momentum=0.9)
            return "server", server.serve()
        worker = PSWorker(host, params, num_servers=num_servers, staleness=staleness)
        workers, index = comm.size - num_servers, comm.rank - num_servers
        rows = slice(index * BATCH // workers, (index + 1) * BATCH // workers)
        x, y = _data()
        for step in range(STEPS):
            host_params = [xp.asnumpy(p) for p in params]
            _, _, grads = loss_and_grads(host_params, x[step, rows], y[step, rows], scale=1.0)
            worker.push_pull([xp.asarray(g) for g in grads])
        worker.close()
        return "worker", [xp.asnumpy(p) for p in params]
    finally:
        host.close()


def _check_synchronous(results, num_servers):
    expected = reference()
    for role, params in results[num_servers:]:
        assert role == "worker"
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for role, stats in results[:num_servers]:
        assert role == "server" and stats["updates"] == STEPS and stats["max_staleness"] == 0


@pytest.fixture
def emulated_arrays(emu):
    """The emulation's CuPy: the training helpers find it from its arrays, as they find CuPy."""
    return emu.cupy


def test_refused_on_nccl_before_anything_is_sent(run, emu, emulated_arrays):
    def fn(comm):
        params = [emulated_arrays.asarray(p) for p in init_params(SIZES, seed=8)]
        role = ParameterServer if comm.rank == 0 else PSWorker
        with pytest.raises(ValueError) as caught:
            role(comm, params, num_servers=1)
        comm.all_reduce(emulated_arrays.ones(2))   # nothing was sent: the ranks still agree
        return str(caught.value)

    for message in run(3, fn):
        assert "backend 'nccl' (cuda memory) runs each rank's operations in issue order" in message
        assert "Pass comm.host_group() instead" in message


@pytest.mark.parametrize("size,num_servers", [(3, 1), (4, 2)])
def test_synchronous_over_the_host_group_of_emulated_nccl(run, emulated_arrays, size,
                                                          num_servers):
    results = run(size, lambda comm: _train(comm, emulated_arrays, num_servers, 0))
    _check_synchronous(results, num_servers)


def test_asynchronous_over_the_host_group_of_emulated_nccl(run, emulated_arrays):
    results = run(4, lambda comm: _train(comm, emulated_arrays, 1, 1))
    role, stats = results[0]
    assert role == "server" and stats["updates"] == 3 * STEPS
    assert stats["max_lead"] <= 1
    assert stats["pushes"] == {1: STEPS, 2: STEPS, 3: STEPS}
    for role, params in results[1:]:
        assert role == "worker" and all(np.isfinite(p).all() for p in params)


def _gpu_rank(comm, num_servers):
    import cupy

    return _train(comm, cupy, num_servers, 0)


@pytest.mark.gpu
@two_ranks
def test_synchronous_over_the_host_group_of_nccl_on_one_gpu():
    """Three ranks share the GPU through NCCL; the parameter traffic takes the host group."""
    results = run_ranks(on_nccl, 3, _gpu_rank, 1, init=False, env=MULTI_RANK_ENV, timeout=240)
    _check_synchronous(results, 1)
