"""Shared set-up of the emulated-NCCL tests: the emulation fixture, ranks as threads
(``run(n, fn)``), the dtype tables and helpers. See tests/emulated_cuda/ for the model."""

import collections
import itertools
import threading
import time

import numpy as np
import pytest

import gpucoll
from gpucoll import cuda_env

import emulated_cuda
from emulated_cuda import Emulation
from reference import assert_equal_result, make_input, reduce_reference


HAVE_BFLOAT16 = emulated_cuda.ml_dtypes is not None
REDUCIBLE = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
             "float64"] + (["bfloat16"] if HAVE_BFLOAT16 else [])
MOVABLE = REDUCIBLE + ["int16", "uint16", "complex64", "complex128", "bool"]
OPS = ["sum", "prod", "min", "max", "avg"]
SIZES = [1, 2, 3]


def _dtype(name):
    if name == "bfloat16":
        return np.dtype(emulated_cuda.ml_dtypes.bfloat16)
    return np.dtype(name)


def _host(seed, rank, shape, name, op="sum"):
    if name == "bfloat16":
        return make_input(seed, rank, shape, "float32", op).astype(_dtype(name))
    return make_input(seed, rank, shape, name, op)


def _expected(stacked, op):
    """reduce_reference, with bfloat16 (a NumPy "V" kind) reduced as the float it is."""
    if stacked.dtype.name == "bfloat16":
        return reduce_reference(stacked.astype(np.float32), op).astype(stacked.dtype)
    return reduce_reference(stacked, op)


def _check(got, expected, what, op="sum"):
    if expected.dtype.name == "bfloat16" and op == "avg":
        np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                                   rtol=1e-2, atol=1e-2, err_msg=what)
        assert got.dtype == expected.dtype
        return
    assert_equal_result(got, expected, what, op)


# ---------------------------------------------------------------- harness
@pytest.fixture
def emu(monkeypatch):
    e = Emulation(device_count=4, timeout=5.0)
    monkeypatch.setattr(cuda_env, "_LOADED", (e.cupy, e.nccl))
    monkeypatch.setenv("GPUCOLL_WATCHDOG_INTERVAL", "0.01")
    monkeypatch.delenv("GPUCOLL_DEBUG", raising=False)
    monkeypatch.delenv("GPUCOLL_DEVICE", raising=False)
    yield e
    e.release_all()  # held work of aborted communicators is dropped, nothing hangs
    assert not e.errors, e.errors


@pytest.fixture
def run(emu, tmp_path):
    """``run(n, fn)``: ``fn(comm)`` on n rank threads; their results, or the first error."""
    stores = itertools.count()

    def run(n, fn, *, timeout=10.0, join=30.0):
        url = f"file://{tmp_path}/store{next(stores)}"
        results = [None] * n
        errors = []
        lock = threading.Lock()

        def body(rank):
            comm = None
            try:
                comm = gpucoll.init(backend="nccl", rank=rank, world_size=n, url=url,
                                    timeout=timeout)
                results[rank] = fn(comm)
                comm.close()
            except BaseException as exc:  # the first one is raised below
                with lock:
                    errors.append((rank, exc))
                if comm is not None:
                    comm.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True)
                   for r in range(n)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + join
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        assert not stuck, f"still running after {join} s: {stuck}"
        if errors:
            rank, exc = errors[0]
            raise AssertionError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
        return results

    return run


@pytest.fixture
def traced(emu, monkeypatch):
    """thread id -> the NCCL calls (group brackets, sends, receives) that thread made."""
    log = collections.defaultdict(list)

    def tracing(name, real):
        def call(*args, **kwargs):
            log[threading.get_ident()].append(name)
            return real(*args, **kwargs)
        return call

    for name in ("groupStart", "groupEnd"):
        monkeypatch.setattr(emu.nccl, name, tracing(name, getattr(emu.nccl, name)))
    for name in ("send", "recv"):
        comm_type = emu.nccl.NcclCommunicator
        monkeypatch.setattr(comm_type, name, tracing(name, getattr(comm_type, name)))
    return log


def _calls(emu, comm, name=None):
    """The NCCL operations ``comm`` issued (optionally only those called ``name``)."""
    return [(n, a) for c, n, a in list(emu.history)
            if c is comm.nccl_comm and (name is None or n == name)]


def _wait_until(predicate, limit=5.0):
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class _Foreign:
    """A device array of another library: only ``__cuda_array_interface__``."""

    def __init__(self, array):
        self._array = array

    @property
    def __cuda_array_interface__(self):
        return self._array.__cuda_array_interface__
