"""pytest-benchmark cases for the hot paths: all_reduce of 8 B, 64 KiB and 4 MiB, 2 ranks.

The test process is rank 0 and drives the benchmark; a fixture spawns the peer rank, which
answers every all_reduce rank 0 issues until it receives the stop size. Not part of the default
test run (``python -m pytest -q tests``); run it with::

    python -m pytest bench/test_bench_hotpaths.py --benchmark-only

Each backend in ``BACKENDS`` that can run here gets the same cases (``nccl`` needs CuPy, a
GPU per rank and a gpucoll with that backend; it is skipped otherwise).
"""

import multiprocessing as mp
import os
import secrets
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import gpucoll  # noqa: E402
from gpucoll.rendezvous import TCPStoreServer  # noqa: E402

SIZES = {"8B": 8, "64KiB": 64 << 10, "4MiB": 4 << 20}
BACKENDS = ("cpu", "nccl")
STOP = -1
WORLD = 2


def _backend_skip_reason(backend):
    if backend == "cpu":
        return None
    if backend not in gpucoll.api.available_backends() or \
            gpucoll.api.available_backends()[backend] != "available":
        return f"backend {backend!r} is not available in this installation"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < WORLD:
            return f"backend {backend!r} needs {WORLD} GPUs"
    except Exception as exc:
        return f"backend {backend!r} needs CuPy and GPUs ({type(exc).__name__})"
    return None


def _on(backend, array):
    """``array`` where ``backend`` wants it: host memory for cpu, the current GPU for nccl."""
    if backend == "nccl":
        import cupy

        return cupy.asarray(array)
    return array


def _arrays(backend, nbytes):
    count = nbytes // 4
    return _on(backend, np.ones(count, np.float32)), _on(backend, np.empty(count, np.float32))


def _receive(comm, backend) -> int:
    value = _on(backend, np.zeros(1, np.int64))
    comm.broadcast(value, root=0)
    return int(value[0])


def _peer(rank, url, token, backend):
    """Peer rank: run the all_reduce of every size it is told, until STOP."""
    os.environ.update(GPUCOLL_AUTH_TOKEN=token, GPUCOLL_LAUNCHER_STORE="1")
    if backend == "nccl":
        import cupy

        cupy.cuda.Device(rank).use()
    comm = gpucoll.init(backend=backend, rank=rank, world_size=WORLD, url=url, timeout=60)
    while True:
        size = _receive(comm, backend)  # what rank 0 will time next
        if size == STOP:
            break
        send, recv = _arrays(backend, size)
        while True:  # as many all_reduces as rank 0 runs: its last one carries a negative flag
            comm.all_reduce(send, out=recv)
            if float(recv[-1]) < 0:
                break
    comm.close()


class _Rank0:
    """This process as rank 0, plus the spawned peer."""

    def __init__(self, backend):
        token = secrets.token_hex(16)
        self.server = TCPStoreServer("127.0.0.1", 0, token=token)
        url = f"tcp://127.0.0.1:{self.server.port}"
        ctx = mp.get_context("spawn")
        self.peers = [ctx.Process(target=_peer, args=(r, url, token, backend), daemon=True)
                      for r in range(1, WORLD)]
        for proc in self.peers:
            proc.start()
        os.environ.update(GPUCOLL_AUTH_TOKEN=token, GPUCOLL_LAUNCHER_STORE="1")
        if backend == "nccl":
            import cupy

            cupy.cuda.Device(0).use()
        self.comm = gpucoll.init(backend=backend, rank=0, world_size=WORLD, url=url, timeout=60)

    def announce(self, value):
        self.comm.broadcast(_on(self.comm.backend, np.array([value], np.int64)), root=0)

    def close(self):
        try:
            self.announce(STOP)
            self.comm.close()
        finally:
            for proc in self.peers:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            self.server.close()


@pytest.fixture(scope="module", params=BACKENDS)
def rank0(request):
    reason = _backend_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    saved = {k: os.environ.get(k) for k in ("GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE")}
    ranks = _Rank0(request.param)
    yield ranks
    ranks.close()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("label", list(SIZES))
def test_all_reduce(benchmark, rank0, label):
    nbytes = SIZES[label]
    rounds, iterations = (20, 50) if nbytes <= 64 << 10 else (10, 5)
    rank0.announce(nbytes)
    send, recv = _arrays(rank0.comm.backend, nbytes)
    benchmark.extra_info.update(bytes=nbytes, ranks=WORLD, backend=rank0.comm.backend)
    try:
        benchmark.pedantic(rank0.comm.all_reduce, args=(send,), kwargs={"out": recv},
                           rounds=rounds, iterations=iterations, warmup_rounds=1)
        assert float(recv[0]) == WORLD
    finally:
        send[-1] = -1e6  # tells the peer this size is done
        rank0.comm.all_reduce(send, out=recv)
