"""The NCCL backend run against an emulation of CuPy and NCCL (tests/emulated_cuda/).

Ranks are threads; each builds its communicator with ``gpucoll.init(backend="nccl")`` through a
file store. What is tested is gpucoll's own bookkeeping: how arguments become NCCL calls, the
pointer arithmetic of gather / scatter / all_to_all, which array comes back, Work, streams,
the watchdog, debug signature checks, split, abort and close. Real NCCL on a real GPU is
tested by tests/test_nccl_gpu.py.
"""

import itertools
import sys
import threading
import time
import types

import numpy as np
import pytest

import gpucoll
from gpucoll import api
from gpucoll.backends.nccl import CudaWork
from gpucoll.errors import CollectiveMismatchError, CommAbortedError, CommTimeoutError
from gpucoll import cuda_env

import emulated_cuda
from emulated_cuda import Emulation, NcclError
from reference import assert_equal_result, make_input, reduce_reference

pytestmark = pytest.mark.timeout(60)

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
                                   rtol=1e-2, err_msg=what)
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


# ---------------------------------------------------------------- set-up
@pytest.mark.parametrize("n", SIZES)
def test_init_puts_each_rank_on_its_gpu(run, emu, n):
    def fn(comm):
        nc = comm.nccl_comm
        return (comm.backend, comm.rank, comm.size, comm.device, comm.local_rank,
                comm.local_size, comm.nccl_version, nc.rank_id(), nc.size(), nc.device_id())

    for rank, got in enumerate(run(n, fn)):
        assert got == ("nccl", rank, n, rank, rank, n, "2.32.3", rank, n, rank)
    assert emu.calls["NcclCommunicator"] == n and emu.calls["destroy"] == n


def test_gpucoll_device_overrides_the_local_rank(run, emu, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUCOLL_DEVICE", "3")
    assert run(1, lambda comm: (comm.device, comm.nccl_comm.device_id())) == [(3, 3)]
    assert run(1, lambda comm: comm.device) == [3]
    monkeypatch.delenv("GPUCOLL_DEVICE")
    with gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{tmp_path}/d",
                      timeout=5, device=2) as comm:
        assert (comm.device, comm.nccl_comm.device_id()) == (2, 2)
        x = emu.cupy.ones(2)  # init made GPU 2 current in this thread
        assert x.device.id == 2 and comm.all_reduce(x) is x
    monkeypatch.setenv("GPUCOLL_DEVICE", "4")
    with pytest.raises(ValueError, match=r"rank 0: GPU 4 does not exist \(4 visible"):
        gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{tmp_path}/s", timeout=5)


# ---------------------------------------------------------------- reductions
@pytest.mark.parametrize("n", SIZES)
def test_reductions_every_dtype_op_and_root(run, emu, n):
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        for name in REDUCIBLE:
            for op in OPS:
                what = f"rank {r} {name}/{op}"
                host = _host(1, r, (3, 5), name, op)
                expected = _expected(
                    np.stack([_host(1, q, (3, 5), name, op) for q in range(n)]), op)
                x = cp.asarray(host)
                assert comm.all_reduce(x, op) is x
                _check(x.get(), expected, f"{what} all_reduce", op)
                x, out = cp.asarray(host), cp.zeros((3, 5), dtype=host.dtype)
                assert comm.all_reduce(x, op, out=out) is out
                _check(out.get(), expected, f"{what} all_reduce out=", op)
                np.testing.assert_array_equal(x.get(), host)
                for root in range(n):
                    x = cp.asarray(host)
                    got = comm.reduce(x, root=root, op=op)
                    if r == root:
                        assert got is x
                        _check(x.get(), expected, f"{what} reduce root {root}", op)
                    else:
                        assert got is None
                        np.testing.assert_array_equal(x.get(), host)
                    x, out = cp.asarray(host), cp.zeros((3, 5), dtype=host.dtype)
                    got = comm.reduce(x, root, op, out=out)
                    if r == root:
                        assert got is out
                        _check(out.get(), expected, f"{what} reduce out= root {root}", op)
                    else:
                        assert got is None
                        np.testing.assert_array_equal(out.get(), np.zeros_like(host))
                full = _host(2, r, (n, 2, 3), name, op)
                blocks = _expected(
                    np.stack([_host(2, q, (n, 2, 3), name, op) for q in range(n)]), op)
                got = comm.reduce_scatter(cp.asarray(full), op)
                assert got.shape == (2, 3)
                _check(got.get(), blocks[r], f"{what} reduce_scatter", op)
                out = cp.zeros((2, 3), dtype=host.dtype)
                assert comm.reduce_scatter(cp.asarray(full), op, out=out) is out
                _check(out.get(), blocks[r], f"{what} reduce_scatter out=", op)
        # every reduction went to NCCL as its own dtype, element count and op
        name, args = _calls(emu, comm, "allReduce")[-1]
        assert (args["datatype"], args["count"], args["op"]) == \
            (emu.nccl.NCCL_BFLOAT16 if HAVE_BFLOAT16 else emu.nccl.NCCL_FLOAT64, 15,
             emu.nccl.NCCL_AVG)
        name, args = _calls(emu, comm, "reduceScatter")[-1]
        assert args["count"] == 6
        return True

    assert run(n, fn) == [True] * n


@pytest.mark.parametrize("n", SIZES)
def test_complex_sum_and_avg_reduce_as_pairs_of_floats(run, emu, n):
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        for name in ("complex64", "complex128"):
            for op in ("sum", "avg"):
                host = _host(3, r, (4, 3), name, op)
                expected = _expected(
                    np.stack([_host(3, q, (4, 3), name, op) for q in range(n)]), op)
                x = cp.asarray(host)
                assert comm.all_reduce(x, op) is x
                _check(x.get(), expected, f"{name}/{op}", op)
                _, args = _calls(emu, comm, "allReduce")[-1]
                real = emu.nccl.NCCL_FLOAT32 if name == "complex64" else emu.nccl.NCCL_FLOAT64
                assert (args["datatype"], args["count"]) == (real, 24)
                y = cp.asarray(host)
                got = comm.reduce(y, root=n - 1, op=op)
                if r == n - 1:
                    _check(got.get(), expected, f"{name}/{op} reduce", op)
                full = _host(4, r, (n, 2), name, op)
                blocks = _expected(
                    np.stack([_host(4, q, (n, 2), name, op) for q in range(n)]), op)
                _check(comm.reduce_scatter(cp.asarray(full), op).get(), blocks[r],
                       f"{name}/{op} reduce_scatter", op)
                _, args = _calls(emu, comm, "reduceScatter")[-1]
                assert args["count"] == 4  # 2 complex numbers per rank = 4 floats
        return True

    assert run(n, fn) == [True] * n


# ---------------------------------------------------------------- data movement
@pytest.mark.parametrize("n", SIZES)
def test_data_movement_every_dtype_and_root(run, emu, n):
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        for name in MOVABLE:
            dtype = _dtype(name)
            what = f"rank {r} {name}"
            hosts = [_host(5, q, (2, 3), name) for q in range(n)]
            x = cp.asarray(hosts[r])
            for root in range(n):
                b = cp.asarray(hosts[r])
                assert comm.broadcast(b, root=root) is b
                np.testing.assert_array_equal(b.get(), hosts[root], err_msg=f"{what} bcast")
            gathered = comm.all_gather(x)
            assert isinstance(gathered, cp.ndarray) and gathered is not x
            assert gathered.shape == (n, 2, 3) and gathered.dtype == dtype
            np.testing.assert_array_equal(gathered.get(), np.stack(hosts), err_msg=what)
            _, args = _calls(emu, comm, "allGather")[-1]
            assert (args["datatype"], args["count"]) == (emu.nccl.NCCL_UINT8, x.nbytes)
            out = cp.zeros((n, 2, 3), dtype=dtype)
            assert comm.all_gather(x, out=out) is out
            np.testing.assert_array_equal(out.get(), np.stack(hosts), err_msg=what)
            for root in range(n):
                got = comm.gather(x, root=root)
                if r == root:
                    assert got.shape == (n, 2, 3) and got.dtype == dtype
                    np.testing.assert_array_equal(got.get(), np.stack(hosts),
                                                  err_msg=f"{what} gather root {root}")
                else:
                    assert got is None
                out = cp.zeros((n, 2, 3), dtype=dtype)
                got = comm.gather(x, root=root, out=out if r == root else None)
                assert got is (out if r == root else None)
                if r == root:
                    np.testing.assert_array_equal(out.get(), np.stack(hosts), err_msg=what)
            for root in range(n):
                blocks = np.stack([_host(6 + root, j, (2, 3), name) for j in range(n)])
                if r == root:
                    got = comm.scatter(cp.asarray(blocks), root=root)
                elif r % 2:
                    out = cp.zeros((2, 3), dtype=dtype)
                    assert comm.scatter(None, root=root, out=out) is out
                    got = out
                else:  # x of the full shape, only for its shape and dtype
                    got = comm.scatter(cp.zeros((n, 2, 3), dtype=dtype), root=root)
                assert got.shape == (2, 3) and got.dtype == dtype
                np.testing.assert_array_equal(got.get(), blocks[r],
                                              err_msg=f"{what} scatter root {root}")
                out = cp.zeros((2, 3), dtype=dtype)
                src = cp.asarray(blocks) if r == root else None
                assert comm.scatter(src, root=root, out=out) is out
                np.testing.assert_array_equal(out.get(), blocks[r], err_msg=what)
            mine = np.stack([_host(20 + r, j, (2, 3), name) for j in range(n)])
            expected = np.stack([_host(20 + q, r, (2, 3), name) for q in range(n)])
            got = comm.all_to_all(cp.asarray(mine))
            assert got.shape == (n, 2, 3) and got.dtype == dtype
            np.testing.assert_array_equal(got.get(), expected, err_msg=f"{what} all_to_all")
            out = cp.zeros((n, 2, 3), dtype=dtype)
            assert comm.all_to_all(cp.asarray(mine), out=out) is out
            np.testing.assert_array_equal(out.get(), expected, err_msg=what)
        return True

    assert run(n, fn) == [True] * n


@pytest.mark.parametrize("n", [2, 3])
def test_empty_arrays_move_nothing(run, emu, n):
    cp = emu.cupy

    def fn(comm):
        x = cp.zeros((0, 3), dtype=cp.float32)
        assert comm.all_reduce(x) is x
        assert comm.all_gather(x).shape == (n, 0, 3)
        assert comm.all_to_all(cp.zeros((n, 0), dtype=cp.int16)).shape == (n, 0)
        g = comm.gather(x, root=0)
        assert (g.shape if comm.rank == 0 else g) == ((n, 0, 3) if comm.rank == 0 else None)
        return True

    assert run(n, fn) == [True] * n


# ---------------------------------------------------------------- point to point
@pytest.mark.parametrize("n", [2, 3])
def test_send_recv_and_their_work(run, emu, n):
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        right, left = (r + 1) % n, (r - 1) % n
        x = cp.asarray(np.arange(6.0).reshape(2, 3) + 10 * r)
        got = cp.zeros((2, 3))
        if r % 2 == 0:
            assert comm.send(x, right, tag=7) is None
            assert comm.recv(got, left, tag=7) is got
        else:
            assert comm.recv(got, left) is got
            comm.send(x, right)
        np.testing.assert_array_equal(got.get(), np.arange(6.0).reshape(2, 3) + 10 * left)
        _, args = _calls(emu, comm, "send")[-1]
        assert (args["datatype"], args["count"], args["peer"]) == \
            (emu.nccl.NCCL_UINT8, 48, right)
        if r == 0:
            work = comm.isend(cp.arange(5, dtype=cp.int16), 1)
            assert isinstance(work, CudaWork) and (work.op, work.seq) == ("send", 3)
            assert work.wait() and work.synchronize() and work.is_completed()
            assert work.result() is None and work.exception() is None
            back = cp.zeros(5, dtype=cp.int16)
            work = comm.irecv(back, 1)
            assert work.result() is back
            np.testing.assert_array_equal(back.get(), np.arange(5) * 2)
        elif r == 1:
            into = cp.zeros(5, dtype=cp.int16)
            work = comm.irecv(into, 0)
            assert (work.op, work.seq, work.synchronize()) == ("recv", 3, True)
            assert work.result() is into
            comm.isend(into * 2, 0).synchronize()
        return comm._seq

    assert run(n, fn) == [0] * n  # point-to-point does not use collective numbers


# ---------------------------------------------------------------- arrays handed back
class _Foreign:
    """A device array of another library: only ``__cuda_array_interface__``."""

    def __init__(self, array):
        self._array = array

    @property
    def __cuda_array_interface__(self):
        return self._array.__cuda_array_interface__


class _OnlyDLPack:
    def __init__(self, array, device=None):
        self._array, self._device = array, device

    def __dlpack__(self, stream=None, **kwargs):
        return self._array.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self):
        return self._device or self._array.__dlpack_device__()


@pytest.fixture
def foreign_module(emu, monkeypatch):
    """A module ``foreignarrays`` whose ``Tensor`` wraps device memory and has from_dlpack."""
    module = types.ModuleType("foreignarrays")

    class Tensor(_Foreign):
        pass

    Tensor.__module__ = "foreignarrays"
    module.Tensor = Tensor
    module.from_dlpack = lambda obj: Tensor(emu.cupy.from_dlpack(obj))
    monkeypatch.setitem(sys.modules, "foreignarrays", module)
    return module


def test_results_come_back_as_what_the_caller_passed(run, emu, foreign_module):
    cp = emu.cupy
    Tensor = foreign_module.Tensor

    def fn(comm):
        r = comm.rank
        base = cp.asarray(np.arange(4, dtype=np.float32) + r)
        t = Tensor(base)
        view = comm._import_array(t, "x")
        assert view.data.ptr == base.data.ptr and view is not base  # a view, not a copy
        assert comm.all_reduce(t) is t
        np.testing.assert_array_equal(base.get(), 2 * np.arange(4) + 1)
        out = Tensor(cp.zeros(4, dtype=cp.float32))
        assert comm.all_reduce(base, "max", out=out) is out
        np.testing.assert_array_equal(out._array.get(), 2 * np.arange(4) + 1)
        gathered = comm.all_gather(t)  # allocated by gpucoll: comes back as a Tensor
        assert type(gathered) is Tensor
        np.testing.assert_array_equal(gathered._array.get(), [2 * np.arange(4) + 1] * 2)
        target = Tensor(cp.zeros((2, 4), dtype=cp.float32))
        assert comm.all_gather(t, out=target) is target
        scattered = comm.reduce_scatter(Tensor(cp.ones((2, 3), dtype=cp.float32)))
        assert type(scattered) is Tensor
        np.testing.assert_array_equal(scattered._array.get(), [2, 2, 2])
        work = comm.all_reduce(t, "min", async_op=True)
        assert isinstance(work, CudaWork) and work.result() is t
        work = comm.all_gather(t, async_op=True)
        assert type(work.result()) is Tensor
        g = comm.gather(t, root=1)
        assert (type(g) is Tensor) if r == 1 else g is None
        # DLPack-only objects are imported without a copy and handed back
        wrapped = _OnlyDLPack(base)
        assert comm._import_array(wrapped, "x").data.ptr == base.data.ptr
        assert comm.all_reduce(wrapped, "max") is wrapped
        assert comm.broadcast(wrapped, root=1) is wrapped
        received = cp.zeros(4, dtype=cp.float32)
        if r == 0:
            comm.send(Tensor(base), 1)
        else:
            into = Tensor(received)
            assert comm.recv(into, 0) is into
            np.testing.assert_array_equal(received.get(), base.get())
        # a CuPy array given in comes back as itself; new arrays are CuPy arrays
        assert type(comm.all_gather(base)) is cp.ndarray
        return True

    assert run(2, fn) == [True, True]


def test_arrays_that_cannot_be_used(run, emu):
    cp = emu.cupy

    def fn(comm):
        with pytest.raises(TypeError, match=r"NumPy array \(host memory\).*backend='cpu'"):
            comm.all_reduce(np.ones(3))
        with pytest.raises(TypeError, match="lives in host memory"):
            comm.all_reduce(_OnlyDLPack(cp.ones(3), device=(1, 0)))
        with pytest.raises(TypeError, match="cannot be imported through DLPack"):
            comm.all_reduce(_OnlyDLPack(object(), device=(2, 0)))
        with cp.cuda.Device(comm.device + 1):
            elsewhere = cp.ones(3)
        with pytest.raises(ValueError, match=f"x is on GPU {comm.device + 1}, but rank 0's "
                                             f"communicator uses GPU {comm.device}"):
            comm.all_reduce(elsewhere)
        with pytest.raises(TypeError, match="must be an array"):
            comm.all_reduce([1.0, 2.0])
        assert _calls(emu, comm) == []
        return True

    assert run(1, fn) == [True]


# ---------------------------------------------------------------- usage errors
@pytest.mark.parametrize("n", [1, 2])
def test_usage_errors_enqueue_nothing(run, emu, n):
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        other = (r + 1) % n
        x = cp.ones(3, dtype=cp.float32)
        comm.all_reduce(x)  # #1
        seq, p2p, issued = comm._seq, comm._p2p_seq, len(_calls(emu, comm))
        x_n = cp.ones((n, 2))
        cases = [
            (TypeError, "NumPy array", lambda: comm.all_reduce(np.ones(3))),
            (ValueError, r"out has shape \(4,\), expected \(3,\)",
             lambda: comm.all_reduce(x, out=cp.ones(4, dtype=cp.float32))),
            (TypeError, "out has dtype float64, expected float32",
             lambda: comm.all_reduce(x, out=cp.ones(3))),
            (TypeError, "op band is not supported by NCCL",
             lambda: comm.all_reduce(cp.ones(3, dtype=cp.int32), "band")),
            (TypeError, "NCCL cannot reduce dtype int16",
             lambda: comm.all_reduce(cp.ones(3, dtype=cp.int16))),
            (TypeError, "NCCL cannot reduce dtype bool",
             lambda: comm.reduce(cp.ones(3, dtype=cp.bool_), root=0, op="max")),
            (TypeError, "NCCL cannot reduce dtype uint16",
             lambda: comm.reduce_scatter(cp.ones((n, 2), dtype=cp.uint16))),
            (TypeError, "op max is undefined for complex",
             lambda: comm.all_reduce(cp.ones(3, dtype=cp.complex64), "max")),
            (TypeError, "NCCL cannot reduce dtype complex64 with op prod",
             lambda: comm.all_reduce(cp.ones(3, dtype=cp.complex64), "prod")),
            (ValueError, "unknown reduction op", lambda: comm.all_reduce(x, "mean")),
            (ValueError, "C-contiguous", lambda: comm.all_reduce(cp.ones((4, 4))[:, ::2])),
            (ValueError, f"root={n} is out of range", lambda: comm.broadcast(x, root=n)),
            (ValueError, "root=-1 is out of range", lambda: comm.reduce(x, root=-1)),
            (ValueError, rf"x must have shape \(size={n}, \.\.\.\)",
             lambda: comm.reduce_scatter(cp.ones((n + 1, 3)))),
            (ValueError, r"out has shape",
             lambda: comm.all_gather(x, out=cp.ones((n + 1, 3), dtype=cp.float32))),
            (ValueError, r"out has shape",
             lambda: comm.gather(x, root=r, out=cp.ones((n, 4), dtype=cp.float32))),
            (ValueError, "x is required on the root rank", lambda: comm.scatter(None, root=r)),
            (ValueError, "out must not be x", lambda: comm.all_to_all(x_n, out=x_n)),
            (TypeError, "stream must be", lambda: comm.all_reduce(x, stream="default")),
            (TypeError, "stream must be", lambda: comm.gather(x, stream=object())),
            (ValueError, "timeout must be positive", lambda: comm.barrier(timeout=0)),
            (TypeError, "color must be an int", lambda: comm.split("red")),
            (TypeError, "dtype str32 is not supported",
             lambda: comm.all_gather(cp.asarray(np.array(["a"])))),
        ]
        if n > 1:
            cases += [
                (ValueError, r"scatter: rank \d is not the root",
                 lambda: comm.scatter(None, root=other)),
                (ValueError, f"dst={r} is this rank", lambda: comm.send(x, r)),
                (ValueError, f"dst={n} is out of range", lambda: comm.isend(x, n)),
                (ValueError, "src=-1 is out of range", lambda: comm.recv(x, -1)),
                (ValueError, r"tag must be an int in \[0, 2\*\*32\)",
                 lambda: comm.send(x, other, tag=-1)),
                (TypeError, "stream must be", lambda: comm.isend(x, other, stream=1.5)),
            ]
        for error, pattern, call in cases:
            with pytest.raises(error, match=pattern):
                call()
        assert (comm._seq, comm._p2p_seq) == (seq, p2p)
        assert len(_calls(emu, comm)) == issued
        comm.all_reduce(x)  # still usable, numbered #2 on every rank
        np.testing.assert_array_equal(x.get(), np.full(3, n * n))
        return comm._seq

    assert run(n, fn) == [2] * n


# ---------------------------------------------------------------- Work and streams
class _TorchLikeStream:
    def __init__(self, ptr):
        self.cuda_stream = ptr


class _ProtocolStream:
    def __init__(self, ptr):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


def test_async_work_follows_its_stream(run, emu):
    cp = emu.cupy

    def fn(comm):
        producer = cp.cuda.Stream(non_blocking=True)
        consumer = cp.cuda.Stream(non_blocking=True)
        x = cp.arange(8, dtype=cp.float32)
        emu.stall(producer)
        work = comm.all_reduce(x, "max", async_op=True, stream=producer)
        assert isinstance(work, CudaWork) and isinstance(work, gpucoll.Work)
        assert (work.op, work.seq) == ("all_reduce", 1)
        assert not work.is_completed() and work.exception() is None
        assert "pending" in repr(work)
        assert emu.pending(producer) == 2  # the all-reduce and its event
        with consumer:
            assert work.wait()  # the consumer stream waits; the host does not
            after = cp.cuda.Event()
            after.record(consumer)
        assert not after.done  # held behind the producer's operation
        emu.release(producer)
        assert work.is_completed() and after.done and "done" in repr(work)
        assert work.synchronize() and work.exception() is None
        assert work.result() is x

        with producer:  # no stream=: the current stream
            emu.stall(producer)
            w2 = comm.all_reduce(cp.full(4, 3.0), async_op=True)
            assert not w2.is_completed() and emu.pending(producer) == 2
            emu.release(producer)
        assert w2.is_completed()
        for given in (producer.ptr, _TorchLikeStream(producer.ptr), _ProtocolStream(producer.ptr),
                      producer):
            emu.stall(producer)
            z = cp.ones(2)
            assert comm.all_reduce(z, stream=given) is z
            assert emu.pending(producer) == 2, given
            emu.release(producer)
        comm.synchronize(timeout=5)
        assert _wait_until(lambda: comm._watchdog.outstanding() == [])  # retired by the watchdog
        return True

    assert run(1, fn) == [True]


def test_a_held_collective_runs_when_its_stream_goes_on(run, emu):
    cp = emu.cupy
    releasing = threading.Event()

    def fn(comm):
        x = cp.full(4, comm.rank + 1.0)
        if comm.rank == 0:
            stream = cp.cuda.Stream(non_blocking=True)
            emu.stall(stream)
            work = comm.all_reduce(x, async_op=True, stream=stream)
            time.sleep(0.1)
            assert not work.is_completed()
            np.testing.assert_array_equal(x.get(), np.full(4, 1.0))  # nothing ran yet
            releasing.set()
            emu.release(stream)  # runs here and meets rank 1
            assert work.synchronize(timeout=5)
        else:
            comm.all_reduce(x)  # waits in the emulated NCCL for rank 0
            assert releasing.is_set()
        np.testing.assert_array_equal(x.get(), np.full(4, 3.0))
        return True

    assert run(2, fn) == [True, True]


def test_synchronize_timeout_aborts_the_communicator(run, emu):
    cp = emu.cupy

    def fn(comm):
        stream = cp.cuda.Stream(non_blocking=True)
        x = cp.ones(4)
        emu.stall(stream)
        work = comm.all_reduce(x, async_op=True, stream=stream)
        started = time.monotonic()
        with pytest.raises(CommTimeoutError,
                           match=r"rank 0: all_reduce #1 did not complete on GPU 0 within 0.2 s"
                                 r"; every rank had issued it, so NCCL itself stalled.*"
                                 r"the communicator was aborted") as info:
            work.synchronize(timeout=0.2)
        assert 0.2 <= time.monotonic() - started < 3
        assert (info.value.op, info.value.seq, info.value.rank) == ("all_reduce", 1, 0)
        assert comm.nccl_comm._status == "aborted"
        assert work.is_completed() and isinstance(work.exception(), CommTimeoutError)
        with pytest.raises(CommTimeoutError, match="all_reduce #1 did not complete"):
            work.wait()
        with pytest.raises(CommTimeoutError, match="all_reduce #1 did not complete"):
            comm.all_reduce(x)
        with pytest.raises(CommTimeoutError):
            comm.barrier()
        emu.release(stream)  # the aborted operation is dropped; nothing hangs
        assert work.is_completed()
        return True

    assert run(1, fn) == [True]
    assert emu.calls["abort"] == 1


# ---------------------------------------------------------------- watchdog
def test_watchdog_names_the_rank_that_never_arrived(run, emu):
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        x = cp.ones(16, dtype=cp.float32)
        comm.all_reduce(x)  # #1 on both ranks
        if comm.rank == 1:
            assert finished.wait(10)  # never issues #2
            return "skipped"
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            emu.stall(stream)  # #2 cannot complete: rank 1 never issues it
            started = time.monotonic()
            comm.all_reduce(x, stream=stream)
            assert _wait_until(lambda: comm.nccl_comm._status == "aborted")
            assert 0.5 <= time.monotonic() - started < 4
            with pytest.raises(CommTimeoutError) as info:
                comm.all_reduce(x)
            with pytest.raises(CommTimeoutError):
                comm.synchronize()
            return str(info.value)
        finally:
            finished.set()

    message, skipped = run(2, fn, timeout=0.5)
    assert skipped == "skipped"
    assert "rank 0: all_reduce #2 did not complete on GPU 0 within 0.5 s" in message, message
    assert "ranks that had not reached it: 1 (of 2)" in message, message
    assert "the communicator was aborted, create a new one" in message, message


def test_barrier_timeout_names_the_missing_rank(run, emu):
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        comm.barrier()  # #1
        if comm.rank == 1:
            assert finished.wait(10)
            return None
        try:
            stream = cp.cuda.Stream()
            with stream:
                emu.stall(stream)  # the barrier's all-reduce waits for rank 1, which never comes
                with pytest.raises(CommTimeoutError) as info:
                    comm.barrier(timeout=0.3)
            return str(info.value)
        finally:
            finished.set()

    message, _ = run(2, fn)
    assert "rank 0: barrier #2 did not complete on GPU 0 within 0.3 s; ranks that had not " \
           "reached it: 1 (of 2)" in message, message


def test_asynchronous_nccl_error_aborts(run, emu):
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(4)
        comm.all_reduce(x)  # completed: the error is not blamed on it
        emu.inject_async_error(comm.nccl_comm, "peer 1 vanished")
        assert _wait_until(lambda: comm.nccl_comm._status == "aborted")
        with pytest.raises(CommAbortedError,
                           match=r"rank 0: NCCL reported an asynchronous error: "
                                 r"NCCL_ERROR_REMOTE_ERROR: peer 1 vanished; the communicator "
                                 r"was aborted, create a new one"):
            comm.all_reduce(x)
        assert comm.nccl_comm._status == "aborted"
        return True

    assert run(1, fn) == [True]


def test_nccl_refusing_a_call_aborts(run, emu):
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(4)
        comm.nccl_comm.abort()  # behind gpucoll's back: NCCL refuses what comes next
        with pytest.raises(CommAbortedError, match=r"rank 0: all_reduce #1: NCCL refused the "
                                                   r"call: NCCL_ERROR_INVALID_ARGUMENT"):
            comm.all_reduce(x)
        with pytest.raises(CommAbortedError, match="NCCL refused the call"):
            comm.all_reduce(x)
        return True

    assert run(1, fn) == [True]


# ---------------------------------------------------------------- GPUCOLL_DEBUG
def test_debug_mismatch_is_reported_on_every_rank_before_anything_runs(run, emu, monkeypatch):
    monkeypatch.setenv("GPUCOLL_DEBUG", "1")
    cp = emu.cupy

    def fn(comm):
        assert comm._debug
        x = cp.ones(4, dtype=cp.float32)
        comm.all_reduce(x)  # #1 agrees
        comm.broadcast(x, root=1)  # #2 agrees
        issued = len(_calls(emu, comm))
        y = cp.ones(4 if comm.rank == 0 else 5, dtype=cp.float32)
        with pytest.raises(CollectiveMismatchError) as info:
            comm.all_reduce(y)
        assert len(_calls(emu, comm)) == issued  # nothing enqueued
        np.testing.assert_array_equal(y.get(), np.ones(y.size))
        with pytest.raises(CommAbortedError):  # a mismatch aborts, as on the CPU backend
            comm.all_reduce(x)
        return str(info.value), info.value.peer

    for message, peer in run(2, fn):
        assert peer == 1
        assert "collective mismatch at op #3: rank 0 (and 0 more) called all_reduce " \
               "#3(dtype=float32, shape=(4,), op=sum), but rank 1 called all_reduce " \
               "#3(dtype=float32, shape=(5,), op=sum)" in message, message


def test_debug_names_the_rank_with_another_root(run, emu, monkeypatch):
    monkeypatch.setenv("GPUCOLL_DEBUG", "1")
    cp = emu.cupy

    def fn(comm):
        x = cp.ones(3, dtype=cp.int64)
        for _ in range(4):  # the signatures of old collectives are cleaned up as it goes
            comm.all_reduce(x)
        with pytest.raises(CollectiveMismatchError) as info:
            comm.broadcast(x, root=2 if comm.rank == 2 else 0)
        return str(info.value)

    for message in run(3, fn):
        assert "rank 0 (and 1 more) called broadcast #5(dtype=int64, shape=(3,), root=0), " \
               "but rank 2 called broadcast #5(dtype=int64, shape=(3,), root=2)" in message


# ---------------------------------------------------------------- split and groups
def test_split_and_new_group(run, emu):
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        sub = comm.split([0, 0, 1][r])
        assert (sub.rank, sub.size) == ([0, 1, 0][r], [2, 2, 1][r])
        assert (sub.backend, sub.device, sub.local_rank, sub.local_size) == \
            ("nccl", comm.device, sub.rank, sub.size)
        assert (sub.nccl_comm.rank_id(), sub.nccl_comm.size()) == (sub.rank, sub.size)
        x = cp.full(3, r + 1.0)
        assert sub.all_reduce(x) is x
        np.testing.assert_array_equal(x.get(), np.full(3, [3.0, 3.0, 3.0][r]))
        reverse = comm.split(0, key=-r)
        assert reverse.rank == 2 - r
        gathered = reverse.all_gather(cp.full(1, r, dtype=cp.int32))
        np.testing.assert_array_equal(gathered.get(), [[2], [1], [0]])
        partial = comm.split(None if r == 1 else 5)
        assert (partial is None) if r == 1 else (partial.size == 2)
        assert comm.split(-3) is None
        group = comm.new_group([2, 0])
        if r == 1:
            assert group is None
        else:
            assert group.rank == {2: 0, 0: 1}[r]
            y = cp.full(2, 10.0 * r)
            group.broadcast(y, root=0)  # from parent rank 2
            np.testing.assert_array_equal(y.get(), [20.0, 20.0])
            assert group.barrier() is None
        z = cp.ones(2)
        comm.all_reduce(z)  # the parent still works; splits used numbers 1 to 5
        assert comm._seq == 6
        for c in (sub, reverse, partial, group):
            if c is not None:
                c.close()
        return True

    assert run(3, fn) == [True] * 3
    assert emu.calls["commSplit"] == 3 * 5


# ---------------------------------------------------------------- lifetime
def test_barrier_close_and_abort(run, emu):
    cp = emu.cupy
    aborted = threading.Event()

    def fn(comm):
        x = cp.ones(3)
        comm.barrier()
        comm.barrier(timeout=5)
        comm.all_reduce(x)
        comm.synchronize(timeout=5)
        _, args = _calls(emu, comm, "allReduce")[0]  # the barrier: one int32, summed
        assert (args["count"], args["datatype"], args["op"]) == \
            (1, emu.nccl.NCCL_INT32, emu.nccl.NCCL_SUM)
        if comm.rank == 0:
            comm.close()
            comm.close()  # idempotent
            assert comm.nccl_comm._status == "destroyed"
            with pytest.raises(CommAbortedError, match="rank 0: communicator is closed"):
                comm.all_reduce(x)
            with pytest.raises(CommAbortedError, match="closed"):
                comm.barrier()
            with pytest.raises(CommAbortedError, match="closed"):
                comm.split(0)
        else:
            comm.abort()
            comm.abort()
            aborted.set()
            assert comm.nccl_comm._status == "aborted"
            with pytest.raises(CommAbortedError, match="abort\\(\\) called on rank 1"):
                comm.all_reduce(x)
            with pytest.raises(CommAbortedError, match="abort"):
                comm.isend(x, 0)
        return True

    assert run(2, fn) == [True, True]
    assert emu.calls["destroy"] == 1  # an aborted communicator is not destroyed


def test_context_manager_closes(run, emu, tmp_path):
    with gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{tmp_path}/cm",
                      timeout=10) as comm:
        comm.all_reduce(emu.cupy.ones(2))
    assert comm.nccl_comm._status == "destroyed" and not comm._watchdog.alive
    with pytest.raises(CommAbortedError):
        comm.all_reduce(emu.cupy.ones(2))


# ---------------------------------------------------------------- the emulation itself
def test_the_emulation_refuses_what_nccl_would(emu):
    """The emulation must catch wrong bookkeeping, or the tests above would prove little."""
    cp, nccl = emu.cupy, emu.nccl
    uid = nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(TypeError, match="expected bytes"):
        nccl.NcclCommunicator(1, tuple(uid), 0)
    with pytest.raises(NcclError, match="out of range"):
        nccl.NcclCommunicator(1, uid, 1)
    with pytest.raises(NcclError, match="not made by get_unique_id"):
        nccl.NcclCommunicator(1, bytes(128), 0)
    comm = nccl.NcclCommunicator(1, uid, 0)
    x = cp.arange(4, dtype=cp.float32)
    s = cp.cuda.get_current_stream().ptr
    comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    for call, pattern in [
        (lambda: comm.allReduce(x.data.ptr, x.data.ptr, 5, nccl.NCCL_FLOAT32, 0, s),
         "not inside one device allocation"),
        (lambda: comm.allReduce(x.data.ptr + 4, x.data.ptr, 4, nccl.NCCL_FLOAT32, 0, s),
         "not inside one device allocation"),
        (lambda: comm.allReduce(x.data.ptr, x.data.ptr, 4, 42, 0, s), "invalid datatype"),
        (lambda: comm.allReduce(x.data.ptr, x.data.ptr, 4, 7, 9, s), "invalid reduction op"),
        (lambda: comm.broadcast(x.data.ptr, x.data.ptr, 4, 7, 1, s), "root 1 is out of range"),
        (lambda: comm.send(x.data.ptr, 4, 7, 2, s), "peer 2 is out of range"),
        (lambda: comm.allReduce(x.data.ptr, x.data.ptr, 4, 7, 0, 12345), "not a stream"),
        (lambda: comm.allGather(x.data.ptr, x.data.ptr, 17, nccl.NCCL_UINT8, s),
         "not inside one device allocation"),
        (lambda: comm.reduceScatter(x.data.ptr, x.data.ptr, 5, nccl.NCCL_FLOAT32, 0, s),
         "not inside one device allocation"),
    ]:
        with pytest.raises(NcclError, match=pattern):
            call()
    with cp.cuda.Device(1):
        other = cp.ones(4, dtype=cp.float32)
    with pytest.raises(NcclError, match="memory of GPU 1"):
        comm.allReduce(other.data.ptr, other.data.ptr, 4, 7, 0, s)
    with pytest.raises(OverflowError):
        comm.allReduce(x.data.ptr, x.data.ptr, -1, 7, 0, s)
    # a view made from __cuda_array_interface__ is the same memory
    view = cp.asarray(_Foreign(x))
    assert view.data.ptr == x.data.ptr
    view[0] = 42
    assert x.get()[0] == 42
    assert cp.from_dlpack(x).data.ptr == x.data.ptr
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    comm.abort()
    with pytest.raises(NcclError, match="aborted"):
        comm.check_async_error()


def test_the_emulation_matches_sends_in_order_and_by_size(emu):
    cp, nccl = emu.cupy, emu.nccl
    uid = nccl.get_unique_id()
    comms = [None, None]
    errors = []

    def rank(r):
        try:
            cp.cuda.Device(r).use()
            comms[r] = nccl.NcclCommunicator(2, uid, r)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and all(comms)
    with cp.cuda.Device(0):
        a, b = cp.arange(3, dtype=cp.int64), cp.arange(3, 7, dtype=cp.int64)
        s0 = cp.cuda.Stream()
    with cp.cuda.Device(1):
        into = cp.zeros(7, dtype=cp.int64)
        s1 = cp.cuda.Stream()
    def exchange(sends, recvs):
        """Rank 0's grouped sends and rank 1's grouped receives, each held on its stream and
        then released from a thread of its own (one thread cannot be both ranks)."""
        emu.stall(s0)
        emu.stall(s1)
        nccl.groupStart()
        for buf, count in sends:
            comms[0].send(buf.data.ptr, count, nccl.NCCL_INT64, 1, s0.ptr)
        nccl.groupEnd()
        nccl.groupStart()
        for ptr, count in recvs:
            comms[1].recv(ptr, count, nccl.NCCL_INT64, 0, s1.ptr)
        nccl.groupEnd()
        assert emu.pending(s0) == 1 and emu.pending(s1) == 1
        helper = threading.Thread(target=emu.release, args=(s0,))
        helper.start()
        emu.release(s1)
        helper.join(10)
        assert not helper.is_alive()

    exchange([(a, 3), (b, 4)], [(into.data.ptr, 3), (into.data.ptr + 24, 4)])
    np.testing.assert_array_equal(into.get(), np.arange(7))  # matched in order
    for c in comms:
        c.check_async_error()
    exchange([(a, 2)], [(into.data.ptr, 3)])
    for c in comms:  # held work that failed: an asynchronous error
        with pytest.raises(NcclError, match="rank 0 sent 16 bytes, rank 1 receives 24"):
            c.check_async_error()
    with pytest.raises(NcclError, match="groupEnd"):
        nccl.groupEnd()


def test_calls_made_while_another_gpu_is_current(run, emu):
    """Arrays gpucoll allocates, its events and the default stream belong to the
    communicator's GPU even when the calling thread has another device current."""
    cp = emu.cupy

    def fn(comm):
        x = cp.full((2, 2), comm.rank + 1.0)
        elsewhere = (comm.device + 1) % emu.device_count
        stream = cp.cuda.Stream()
        with cp.cuda.Device(elsewhere):
            gathered = comm.all_gather(x)
            assert gathered.device.id == comm.device
            assert comm.reduce_scatter(cp.asarray(x)).device.id == comm.device
            assert comm.all_to_all(x).device.id == comm.device
            g = comm.gather(x[0], root=0)
            assert g is None or g.device.id == comm.device
            assert comm.scatter(x, root=1).device.id == comm.device
            emu.stall(stream)
            work = comm.all_reduce(x, async_op=True, stream=stream)
            assert not work.is_completed()  # its event follows the operation
            emu.release(stream)
            assert work.synchronize(timeout=5)
            emu.stall(0, device=comm.device)  # the null stream of the communicator's GPU
            work = comm.all_reduce(x, async_op=True)
            assert not work.is_completed() and emu.pending(0, device=comm.device) == 2
            emu.release(0, device=comm.device)
            assert work.synchronize(timeout=5)
        np.testing.assert_array_equal(gathered.get()[:, 0, 0], [1.0, 2.0])
        np.testing.assert_array_equal(x.get(), np.full((2, 2), 6.0))
        return True

    assert run(2, fn) == [True, True]


def test_split_timeout_names_the_missing_rank_and_aborts(run, emu):
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            assert finished.wait(10)  # never calls split
            return None
        try:
            with pytest.raises(CommTimeoutError,
                               match=r"rank 0: split #1: ranks 1 did not call split within "
                                     r"0.5 s") as info:
                comm.split(0)
            assert (info.value.op, info.value.seq) == ("split", 1)
            with pytest.raises(CommTimeoutError, match="did not call split"):
                comm.all_reduce(cp.ones(2))  # aborted: no NCCL call that could hang
            assert comm.nccl_comm._status == "aborted"
            return True
        finally:
            finished.set()

    assert run(2, fn, timeout=0.5) == [True, None]
    assert emu.calls["commSplit"] == 0


def test_nccl_refusing_a_split_aborts(run, emu):
    def fn(comm):
        comm.nccl_comm.abort()
        with pytest.raises(CommAbortedError, match=r"rank 0: split #1: NCCL refused the call"):
            comm.split(0)
        with pytest.raises(CommAbortedError, match="NCCL refused"):
            comm.barrier()
        return True

    assert run(1, fn) == [True]


def test_debug_check_timeout_names_the_missing_rank(run, emu, monkeypatch):
    monkeypatch.setenv("GPUCOLL_DEBUG", "1")
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            assert finished.wait(10)
            return None
        try:
            with pytest.raises(CommTimeoutError,
                               match=r"rank 0: GPUCOLL_DEBUG check of all_gather #1: ranks 1 did "
                                     r"not reach it within 0.5 s"):
                comm.all_gather(cp.ones(3))
            assert _calls(emu, comm) == []
            with pytest.raises(CommTimeoutError, match="GPUCOLL_DEBUG check"):
                comm.all_reduce(cp.ones(2))
            return True
        finally:
            finished.set()

    assert run(2, fn, timeout=0.5) == [True, None]


def test_init_without_the_other_ranks_times_out(emu, tmp_path):
    started = time.monotonic()
    with pytest.raises(CommTimeoutError):
        gpucoll.init(backend="nccl", rank=0, world_size=2, url=f"file://{tmp_path}/alone",
                     timeout=0.3)
    assert time.monotonic() - started < 3
    assert emu.calls["NcclCommunicator"] == 0


def test_point_to_point_timeout_names_the_peer(run, emu):
    cp = emu.cupy
    finished = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            assert finished.wait(10)  # never receives
            return None
        try:
            stream = cp.cuda.Stream()
            emu.stall(stream)
            work = comm.isend(cp.ones(3), 1, stream=stream)
            with pytest.raises(CommTimeoutError,
                               match=r"rank 0: send #1 did not complete on GPU 0 within 0.2 s "
                                     r"\(peer rank 1\)") as info:
                work.synchronize(timeout=0.2)
            assert (info.value.peer, info.value.op) == (1, "send")
            return True
        finally:
            finished.set()

    assert run(2, fn) == [True, None]
