"""The NCCL backend run against an emulation of CuPy and NCCL (tests/emulated_cuda/): set-up,
reductions and data movement for every dtype, point-to-point, arrays handed back, usage errors.

Ranks are threads; each builds its communicator with ``gpucoll.init(backend="nccl")`` through a
file store. What is tested is gpucoll's own bookkeeping: how arguments become NCCL calls, the
pointer arithmetic of gather / scatter / all_to_all, which array comes back. Real NCCL on a
real GPU is tested by tests/test_nccl_gpu.py; faults and the watchdog by
tests/test_nccl_emulated_faults.py, Work and streams by tests/test_nccl_emulated_streams.py.
"""

import sys
import types

import numpy as np
import pytest

import gpucoll
from gpucoll.backends.nccl import CudaWork

from nccl_emulated_harness import (HAVE_BFLOAT16, MOVABLE, OPS, REDUCIBLE, SIZES, _calls,  # noqa: F401
                                   _check, _dtype, _expected, _Foreign, _host, emu, run)

pytestmark = pytest.mark.timeout(60)


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


@pytest.mark.parametrize("version, enabled, outcome", [
    (22809, "1", "refused before NCCL"), (23203, None, "refused before NCCL"),
    (23203, "1", "runs")], ids=["nccl-2.28", "variable-unset", "nccl-2.32-enabled"])
def test_two_ranks_on_one_gpu_as_nccl_allows(monkeypatch, tmp_path, version, enabled, outcome):
    """Two local ranks, one GPU: NCCL refuses that with an opaque "invalid usage" unless it is
    2.30 or later with NCCL_MULTI_RANK_GPU_ENABLE=1 (seen on an H100 with NCCL 2.28.9);
    gpucoll says why before NCCL is called, and runs it where NCCL allows it."""
    import threading

    from emulated_cuda import Emulation
    from gpucoll import cuda_env

    one = Emulation(device_count=1, timeout=5.0)
    one.nccl_version = version
    monkeypatch.setattr(cuda_env, "_LOADED", (one.cupy, one.nccl))
    monkeypatch.delenv("GPUCOLL_DEVICE", raising=False)
    if enabled:
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", enabled)
    else:
        monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    results = [None, None]

    def rank(r):
        try:
            with gpucoll.init(backend="nccl", rank=r, world_size=2, url=f"file://{tmp_path}/s",
                              timeout=5) as comm:
                x = one.cupy.asarray(np.full(3, r + 1.0, np.float32))
                # a stream each: rank threads of the emulation share a device's null stream,
                # where processes on a real GPU have a context, and a null stream, each
                stream = one.cupy.cuda.Stream(non_blocking=True)
                comm.all_reduce(x, stream=stream)
                stream.synchronize()
                results[r] = ("ran", comm.device, x.get().tolist())
        except Exception as exc:
            results[r] = (type(exc).__name__, str(exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if outcome == "runs":
        assert results == [("ran", 0, [3.0, 3.0, 3.0])] * 2
        return
    for r, (kind, message) in enumerate(results):
        assert kind == "BackendUnavailableError", results
        assert message.startswith(f"rank {r}: 2 ranks on this host share 1 GPU(s); NCCL needs "
                                  f"one GPU per rank (or NCCL >= 2.30 with "
                                  f"NCCL_MULTI_RANK_GPU_ENABLE=1); use backend='cpu'"), message
    assert one.calls["NcclCommunicator"] == 0


def test_a_refused_shared_gpu_gets_a_hint(run, emu, monkeypatch):
    """Ranks put on one GPU by GPUCOLL_DEVICE (gpucoll cannot know beforehand): NCCL's
    refusal comes with what would allow it."""
    monkeypatch.setenv("GPUCOLL_DEVICE", "0")
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    with pytest.raises(AssertionError) as info:
        run(2, lambda comm: None)
    message = str(info.value)
    assert "ncclCommInitRank failed on GPU 0" in message and "Duplicate GPU" in message
    assert "if two ranks share GPU 0: NCCL allows that from 2.30 with " \
           "NCCL_MULTI_RANK_GPU_ENABLE=1 (this is NCCL code 23203, the variable is unset)" \
           in message, message


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
        # every reduction went to NCCL as its own dtype, element count and op (one rank's
        # AVG as the SUM it equals: test_one_rank_avg_is_whole_on_an_nccl_that_drops_its_tail)
        name, args = _calls(emu, comm, "allReduce")[-1]
        assert (args["datatype"], args["count"], args["op"]) == \
            (emu.nccl.NCCL_BFLOAT16 if HAVE_BFLOAT16 else emu.nccl.NCCL_FLOAT64, 15,
             emu.nccl.NCCL_AVG if n > 1 else emu.nccl.NCCL_SUM)
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


def test_one_rank_avg_is_whole_on_an_nccl_that_drops_its_tail(run, emu):
    """NCCL before 2.29.7 leaves the last count % 32 elements of a one-rank float AVG unwritten
    (NVIDIA/nccl#1950; found on an H100 with NCCL 2.28.9): gpucoll sends a one-rank AVG as
    the SUM it equals, and every element arrives."""
    cp = emu.cupy
    emu.nccl_version = 22809
    count = 100003  # 3 past a multiple of 32, as on the GPU
    host = (np.arange(count) % 13 - 6.5).astype(np.float32)  # no zeros

    def fn(comm):
        src, raw = cp.asarray(host), cp.zeros(count, dtype=cp.float32)
        # called directly, the emulation drops the tail, like that NCCL
        comm.nccl_comm.allReduce(src.data.ptr, raw.data.ptr, count,
                                 emu.nccl.NCCL_FLOAT32, emu.nccl.NCCL_AVG,
                                 cp.cuda.get_current_stream().ptr)
        cp.cuda.get_current_stream().synchronize()
        dropped = int((raw.get() != host).sum())
        zeros = lambda: cp.zeros(count, dtype=cp.float32)  # noqa: E731 (in place hides it)
        results = [comm.all_reduce(src, "avg", out=zeros()).get(),
                   comm.reduce(src, root=0, op="avg", out=zeros()).get(),
                   comm.reduce_scatter(src.reshape(1, -1), "avg", out=zeros()).get()]
        return dropped, results, [args["op"] for _, args in _calls(emu, comm, "allReduce")]

    [(dropped, results, ops)] = run(1, fn)
    assert dropped == 3
    for got in results:
        np.testing.assert_array_equal(got, host)
    assert ops == [emu.nccl.NCCL_AVG, emu.nccl.NCCL_SUM]


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


def test_the_one_pass_array_check_agrees_with_the_full_checks(run, emu):
    """The NCCL backend takes a C-contiguous CuPy array on its GPU, of a dtype accepted before,
    in one pass; every argument gets what the full checks give: the same array or error."""
    from gpucoll.communicator import Communicator

    cp = emu.cupy

    def outcome(check, x):
        try:
            got = check(x, "x")
        except (TypeError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return type(got), got.data.ptr, got.shape, got.dtype

    def fn(comm):
        with cp.cuda.Device(comm.device + 1):
            elsewhere = cp.ones(3)
        plain = cp.ones(3, dtype=cp.float32)
        cases = [plain, cp.ones((2, 3), dtype=cp.float16), cp.ones(4, dtype=cp.uint16),
                 cp.ones((4, 4))[:, ::2], elsewhere, cp.asarray(np.array(["a"])), np.ones(3),
                 [1.0], _OnlyDLPack(cp.ones(3)), _Foreign(cp.ones((2, 2))[:, :1])]
        for x in cases + cases:  # the second time, every dtype accepted is known
            assert outcome(comm._array, x) == outcome(
                lambda y, name: Communicator._array(comm, y, name), x)
        assert comm._array(plain, "x") is plain
        return True

    assert run(1, fn) == [True]


class _TorchBFloat16Like(_OnlyDLPack):
    """What torch hands out for a bfloat16 CUDA tensor: DLPack with the real dtype, and a
    ``__cuda_array_interface__`` whose typestr is ``"<V2"`` with no ``descr`` (CuPy reads that
    as a 2-byte void)."""

    @property
    def __cuda_array_interface__(self):
        interface = dict(self._array.__cuda_array_interface__)
        interface["typestr"] = "<V2"
        interface.pop("descr", None)
        return interface


@pytest.mark.skipif(not HAVE_BFLOAT16, reason="ml_dtypes is not installed")
def test_bfloat16_tensors_come_in_through_dlpack(run, emu):
    cp = emu.cupy

    def fn(comm):
        x = cp.asarray(np.full(6, comm.rank + 1.5, dtype=_dtype("bfloat16")))
        tensor = _TorchBFloat16Like(x)
        assert cp.asarray(tensor).dtype.kind == "V"  # the interface alone would be refused
        result = comm.all_reduce(tensor)
        assert result is tensor and x.dtype == _dtype("bfloat16")
        return x.get().astype(np.float32)

    results = run(2, fn)
    for got in results:
        np.testing.assert_array_equal(got, np.full(6, 4.0, np.float32))


def test_cuda_managed_memory_through_dlpack_is_accepted(run, emu):
    cp = emu.cupy

    def fn(comm):
        x = cp.arange(5, dtype=cp.float32)
        comm.all_reduce(_OnlyDLPack(x, device=(13, comm.device)))  # kDLCUDAManaged
        return x.get()

    for got in run(2, fn):
        np.testing.assert_array_equal(got, 2 * np.arange(5, dtype=np.float32))


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
