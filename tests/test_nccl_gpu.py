"""The NCCL backend on a real GPU with real NCCL (skipped with a reason without one).

One GPU: every collective on a 1-rank communicator for every dtype and op, usage errors before
anything is enqueued, the watchdog on a deliberately stalled stream, DLPack and torch tensors,
asynchronous Work and streams, a CUDA graph of collectives, scan / exscan. Two ranks on one GPU when NCCL >= 2.30 allows it
(NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL_MAX_CTAS capped), in real processes under a hard timeout:
the collectives, a large ``sendrecv`` both ways at once and a ``batch_isend_irecv`` halo
exchange, scan / exscan on a busy stream; three such ranks, one SIGKILLed, for ``shrink()``;
two that ``grow()`` with a third, started with GPUCOLL_JOIN.
"""

import time

import numpy as np
import pytest

import gpucoll
from gpucoll.errors import CommAbortedError, CommTimeoutError
from mp_harness import run_ranks
from reference import identity_reference, make_input, prefix_reference, reduce_reference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

REDUCIBLE = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
             "float64", "bfloat16"]
MOVABLE = REDUCIBLE + ["int16", "uint16", "complex64", "complex128", "bool"]
OPS = ["sum", "prod", "min", "max", "avg"]

SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _device_array(host):
    import cupy

    try:
        return cupy.asarray(host)
    except (TypeError, ValueError) as exc:
        pytest.skip(f"CuPy {cupy.__version__} cannot hold {host.dtype} arrays: {exc}")


def _host_input(rank, shape, name, op="sum"):
    if name == "bfloat16":
        return make_input(7, rank, shape, "float32", op).astype(_dtype(name))
    return make_input(7, rank, shape, name, op)


def _spin(stream, seconds):
    """Occupy ``stream`` for about ``seconds`` with a one-thread busy loop."""
    import cupy

    kernel = cupy.RawKernel(SPIN_SOURCE, "spin")
    rate = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)
    with stream:
        kernel((1,), (1,), (np.int64(seconds * rate * 1000),))


@pytest.fixture(scope="module")
def comm(tmp_path_factory):
    path = tmp_path_factory.mktemp("nccl") / "store"
    c = gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{path}", timeout=60)
    yield c
    c.close()


def test_init_picks_nccl(comm):
    from gpucoll import api

    assert comm.backend == "nccl" and comm.size == 1 and comm.rank == 0
    assert api.resolve_backend("auto") == "nccl"
    assert comm.nccl_version.count(".") == 2 and comm.device == 0


@pytest.mark.parametrize("name", REDUCIBLE)
@pytest.mark.parametrize("op", OPS)
def test_reductions_one_rank(comm, name, op):
    import cupy

    host = _host_input(0, (5, 13), name, op)
    expected = reduce_reference(host[None], op)
    x = _device_array(host)
    out = cupy.zeros_like(x)
    assert comm.all_reduce(x, op, out=out) is out
    np.testing.assert_array_equal(cupy.asnumpy(out), expected)
    y = x.copy()
    assert comm.all_reduce(y, op) is y
    np.testing.assert_array_equal(cupy.asnumpy(y), expected)
    r = cupy.zeros_like(x)
    assert comm.reduce(x, root=0, op=op, out=r) is r
    np.testing.assert_array_equal(cupy.asnumpy(r), expected)
    rs = comm.reduce_scatter(x.reshape(1, 5, 13), op)
    assert rs.shape == (5, 13)
    np.testing.assert_array_equal(cupy.asnumpy(rs), expected)
    cupy.cuda.get_current_stream().synchronize()


@pytest.mark.parametrize("name", MOVABLE)
def test_data_movement_one_rank(comm, name):
    import cupy

    host = _host_input(0, (3, 7), name)
    x = _device_array(host)
    b = x.copy()
    assert comm.broadcast(b, root=0) is b
    gathered = comm.all_gather(x)
    assert gathered.shape == (1, 3, 7) and gathered.dtype == x.dtype
    out = cupy.zeros((1, 3, 7), dtype=x.dtype)
    assert comm.all_gather(x, out=out) is out
    g = comm.gather(x, root=0)
    s = comm.scatter(x.reshape(1, 3, 7), root=0)
    a = comm.all_to_all(x.reshape(1, 3, 7))
    for got in (b, gathered[0], out[0], g[0], s, a[0]):
        np.testing.assert_array_equal(cupy.asnumpy(got), host)


def test_barrier_split_and_groups(comm):
    import cupy

    comm.barrier(timeout=10)
    sub = comm.split(0)
    try:
        assert sub.size == 1 and sub.backend == "nccl" and sub.device == comm.device
        x = cupy.arange(4, dtype=cupy.float32)
        sub.all_reduce(x)
        np.testing.assert_array_equal(cupy.asnumpy(x), np.arange(4))
    finally:
        sub.close()
    assert comm.split(None) is None


def test_usage_errors_enqueue_nothing(comm):
    import cupy

    before = comm._seq
    with pytest.raises(TypeError, match="NumPy array .*host memory"):
        comm.all_reduce(np.ones(3))
    with pytest.raises(ValueError, match=r"out has shape \(4,\), expected \(3,\)"):
        comm.all_reduce(cupy.ones(3), out=cupy.ones(4))
    with pytest.raises(TypeError, match="op band is not supported by NCCL"):
        comm.all_reduce(cupy.ones(3, cupy.int32), "band")
    with pytest.raises(TypeError, match="NCCL cannot reduce dtype int16"):
        comm.all_reduce(cupy.ones(3, cupy.int16))
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.all_reduce(cupy.ones((4, 4))[:, ::2])
    with pytest.raises(ValueError, match="root=1 is out of range"):
        comm.broadcast(cupy.ones(3), root=1)
    with pytest.raises(ValueError, match=r"x must have shape \(size=1, \.\.\.\)"):
        comm.reduce_scatter(cupy.ones((2, 3)))
    with pytest.raises(TypeError, match="stream must be"):
        comm.all_reduce(cupy.ones(3), stream="default")
    assert comm._seq == before
    x = cupy.ones(3)
    comm.all_reduce(x)  # still usable
    np.testing.assert_array_equal(cupy.asnumpy(x), np.ones(3))


def test_async_work_and_streams(comm):
    import cupy

    producer = cupy.cuda.Stream(non_blocking=True)
    consumer = cupy.cuda.Stream(non_blocking=True)
    with producer:
        x = cupy.arange(1 << 20, dtype=cupy.float32)
    _spin(producer, 0.5)
    started = time.monotonic()
    work = comm.all_reduce(x, "max", async_op=True, stream=producer)
    assert isinstance(work, gpucoll.Work)
    assert not work.is_completed()  # queued behind the spin
    with consumer:
        work.wait()  # the consumer stream waits; the host does not
        after = cupy.cuda.Event()
        after.record(consumer)
    assert time.monotonic() - started < 0.25
    assert not after.done  # the consumer really waits for the producer's operation
    assert work.synchronize() and work.is_completed() and work.exception() is None
    consumer.synchronize()
    assert after.done
    np.testing.assert_array_equal(cupy.asnumpy(work.result()), np.arange(1 << 20))

    with producer:  # no stream=: the current stream is used
        y = cupy.full(8, 3.0)
        w2 = comm.all_reduce(y, async_op=True)
        producer.synchronize()
    assert w2.is_completed()
    comm.synchronize(timeout=10)


def test_dlpack_objects_are_used_without_copy(comm):
    import cupy

    class OnlyDLPack:
        def __init__(self, array):
            self._array = array

        def __dlpack__(self, stream=None, **kw):
            return self._array.__dlpack__(stream=stream, **kw)

        def __dlpack_device__(self):
            return self._array.__dlpack_device__()

    base = cupy.arange(6, dtype=cupy.float32)
    wrapped = OnlyDLPack(base)
    assert comm._import_array(wrapped, "x").data.ptr == base.data.ptr
    assert comm.all_reduce(wrapped, "max") is wrapped
    assert comm.broadcast(wrapped) is wrapped
    np.testing.assert_array_equal(cupy.asnumpy(base), np.arange(6))


def test_torch_cuda_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        comm = gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{tmp}/s",
                            timeout=60)
        try:
            t = torch.arange(10, dtype=torch.float32, device="cuda")
            assert comm._import_array(t, "x").data.ptr == t.data_ptr()  # no copy
            stream = torch.cuda.current_stream()
            assert comm.all_reduce(t, stream=stream) is t
            out = torch.zeros(10, device="cuda")
            assert comm.all_reduce(t, "max", out=out, stream=stream) is out
            gathered = comm.all_gather(t, stream=stream)
            assert isinstance(gathered, torch.Tensor) and gathered.shape == (1, 10)
            bf = torch.arange(8, device="cuda").to(torch.bfloat16)
            assert comm.all_reduce(bf, "avg", stream=stream) is bf
            torch.cuda.synchronize()
            assert out.cpu().tolist() == list(range(10))
            assert gathered.cpu().tolist() == [list(range(10))]
            assert bf.float().cpu().tolist() == list(range(8))
            with pytest.raises(TypeError, match="host memory"):
                comm.all_reduce(torch.ones(3))
        finally:
            comm.close()


def test_watchdog_aborts_a_stalled_operation(tmp_path):
    import cupy

    # creation (CUDA context, NCCL's set-up) may take seconds on a fresh process: it gets a
    # long limit, the operations below the short one
    comm = gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{tmp_path}/s",
                        timeout=60)
    comm.timeout = 1.0
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(16, dtype=cupy.float32)
    stream.synchronize()
    _spin(stream, 4.0)  # the all_reduce below cannot complete for 4 s
    work = comm.all_reduce(x, stream=stream, async_op=True)
    time.sleep(2.5)  # the 1 s deadline passes; the watchdog aborts the communicator
    with pytest.raises(CommTimeoutError, match=r"all_reduce #1 did not complete on GPU 0 within 1 s"):
        comm.all_reduce(x)
    with pytest.raises(CommTimeoutError):
        comm.barrier()
    stream.synchronize()  # the spin ends; nothing hangs
    # the aborted kernel exited, so the operation's event completed: the Work still fails
    assert work._event.done
    assert isinstance(work.exception(), CommTimeoutError)
    with pytest.raises(CommTimeoutError, match="all_reduce #1 did not complete"):
        work.wait()
    comm.close()
    with pytest.raises(CommAbortedError):
        comm.all_reduce(x)


# ---------------------------------------------------------------- two ranks on one GPU
def test_a_cuda_graph_replays_captured_collectives(comm):
    """A CuPy kernel and NCCL collectives captured on a stream run at each launch and not
    before; ``launch_graph`` holds each launch to the watchdog; the records say so."""
    import cupy

    x = cupy.arange(8, dtype=cupy.float32)
    gathered = cupy.zeros((1, 8), dtype=cupy.float32)
    comm.all_reduce(x)  # the one-pass path knows float32 / sum: it must not take the capture
    comm.all_reduce(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        x *= 2
        comm.all_reduce(x)
        comm.all_gather(x, out=gathered)
        graph = stream.end_capture()
    assert cupy.asnumpy(x).tolist() == list(range(8))  # nothing ran
    assert [e["state"] for e in comm.trace()[-2:]] == ["captured"] * 2
    for _ in range(3):
        comm.launch_graph(graph, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(x), np.arange(8) * 8.0)
    np.testing.assert_array_equal(cupy.asnumpy(gathered), [np.arange(8) * 8.0])
    comm.synchronize()
    assert [e["state"] for e in comm.trace()[-3:]] == ["done"] * 3


def test_what_a_capture_cannot_hold_is_refused_and_the_capture_stays_valid(comm):
    """Real CUDA as the emulation models it: a host copy waited for in a capture is refused
    and invalidates the capture. gpucoll's composite calls (host reads) are refused first,
    so the capture around them stays valid and the collectives captured before them replay."""
    import cupy

    x = cupy.arange(4, dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(Exception, match="captur"):
            x.get()
        try:  # CUDA invalidates the capture after such a call (the emulation does the same)
            stream.end_capture()
        except Exception as exc:
            assert "nvalidated" in str(exc) or "previous error" in str(exc), exc
    with stream:
        stream.begin_capture()
        comm.all_reduce(x)
        for call in (lambda: comm.all_gather_v(x), lambda: comm.broadcast_object({"a": 1}),
                     lambda: comm.all_to_all_v(x, counts=[[4]])):
            with pytest.raises(gpucoll.UnsupportedOperationError,
                               match="in a CUDA graph capture; it reads counts or objects"):
                call()
        graph = stream.end_capture()
    comm.launch_graph(graph, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(x), np.arange(4, dtype=np.float32))
    assert comm.all_gather_v(x)[1] == [4]


@pytest.mark.parametrize("name", MOVABLE)
def test_scan_and_exscan_one_rank(comm, name):
    """One rank: scan is x itself, exscan the op's identity; in a capture both are refused
    before anything is enqueued and the capture stays valid."""
    import cupy

    for op in ("sum", "prod", "min", "max", "bxor"):
        host = _host_input(0, (3, 7), name, op)
        if (op in ("min", "max") and host.dtype.kind == "c") or \
                (op == "bxor" and host.dtype.kind not in "biu"):
            continue
        x = _device_array(host)
        out = cupy.zeros_like(x)
        assert comm.scan(x, op, out=out) is out
        assert comm.exscan(x, op) is x
        np.testing.assert_array_equal(cupy.asnumpy(out), host)
        np.testing.assert_array_equal(cupy.asnumpy(x), identity_reference(op, x.dtype, (3, 7)))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(gpucoll.UnsupportedOperationError,
                           match="scan of a CUDA array in a CUDA graph capture; it combines"):
            comm.scan(x)
        stream.end_capture()
    cupy.cuda.get_current_stream().synchronize()


def test_a_graph_of_two_communicators_is_followed_by_both(comm):
    """One graph with collectives of two communicators of the GPU, launched by one of them
    naming the other: each launch is one collective of both, and the results are right."""
    import cupy

    group = comm.split(0)
    try:
        x = cupy.arange(6, dtype=cupy.float32)
        out = cupy.zeros((1, 6), dtype=cupy.float32)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            x *= 2
            comm.all_reduce(x)
            group.all_gather(x, out=out)
            graph = stream.end_capture()
        seqs = (comm._seq, group._seq)
        for _ in range(3):
            comm.launch_graph(graph, stream=stream, also=[group])
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), [np.arange(6) * 8.0])
        comm.synchronize()
        group.synchronize()
        assert (comm._seq - seqs[0], group._seq - seqs[1]) == (3, 3)
    finally:
        group.close()


def test_a_data_parallel_step_captured_into_a_cuda_graph(comm):
    """The Bucketer's fused kernels (NVRTC) and NCCL all-reduces captured once, launched once
    per step: each launch unscales (through bfloat16) what the gradient arrays hold then, the
    non-finite flag is zeroed and set by each launch, and the work tables outlive the eager
    cache (tests/test_ddp_nccl_emulated.py runs the same on 2 and 3 emulated ranks)."""
    import cupy

    from gpucoll import kernel_tables
    from gpucoll.ddp import Bucketer

    shapes = [(3, 5), (7,), (4096,), (1,)]
    bucketer = Bucketer(comm, [np.zeros(s, np.float32) for s in shapes], bucket_cap_bytes=4096,
                        first_bucket_cap_bytes=64, compression="bf16")
    grads = [cupy.zeros(s, dtype=cupy.float32) for s in shapes]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        bucketer.reduce(grads, loss_scale=4.0)
        graph = stream.end_capture()
    flag = bucketer.found_inf
    rng = np.random.default_rng(5)
    for step in range(3):
        host = [(rng.integers(-64, 64, s) / 8).astype(np.float32) for s in shapes]  # bf16-exact
        if step == 1:
            host[2][5] = np.inf
        for array, values in zip(grads, host):
            array.set(values)
        cupy.cuda.Device().synchronize()
        kernel_tables._TABLES.clear()
        comm.launch_graph(graph, stream=stream)
        stream.synchronize()
        assert int(flag.get()[0]) == (1 if step == 1 else 0), step
        if step != 1:
            for array, values in zip(grads, host):
                np.testing.assert_array_equal(cupy.asnumpy(array), values / 4.0)
    comm.synchronize()


def _nccl_version():
    try:
        from cupy.cuda import nccl

        return nccl.get_version()
    except Exception:
        return 0


MULTI_RANK_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "2",
                  "GPUCOLL_DEVICE": "0", "GPUCOLL_TIMEOUT": "60"}
two_ranks = pytest.mark.skipif(
    _nccl_version() < 23000,
    reason=f"two ranks on one GPU need NCCL >= 2.30 (found code {_nccl_version()})")


def on_nccl(rank, size, url, fn, *args):
    """A rank of ``run_ranks(..., init=False)``: ``fn(comm, *args)`` on a new NCCL
    communicator, whose GPU work is finished before it is closed."""
    comm = gpucoll.init(backend="nccl", rank=rank, world_size=size, url=url, timeout=60)
    try:
        result = fn(comm, *args)
        comm.synchronize()
        return result
    finally:
        comm.close(timeout=30)


def _rank_collectives(rank, size, url):
    import cupy

    comm = gpucoll.init(backend="nccl", rank=rank, world_size=size, url=url, timeout=60)
    try:
        results = {}
        for op in OPS:
            x = cupy.asarray(make_input(3, rank, (1000,), "float32", op))
            comm.all_reduce(x, op)
            results[f"all_reduce/{op}"] = cupy.asnumpy(x)
        b = cupy.arange(10, dtype=cupy.int64) if rank == 1 else cupy.zeros(10, cupy.int64)
        comm.broadcast(b, root=1)
        results["broadcast"] = cupy.asnumpy(b)
        results["all_gather"] = cupy.asnumpy(comm.all_gather(cupy.full(3, rank, cupy.int32)))
        results["reduce_scatter"] = cupy.asnumpy(
            comm.reduce_scatter(cupy.asarray(make_input(4, rank, (size, 6), "int32"))))
        red = comm.reduce(cupy.full(4, rank + 1.0), root=0)
        results["reduce"] = None if red is None else cupy.asnumpy(red)
        g = comm.gather(cupy.full(2, rank, cupy.int16), root=1)
        results["gather"] = None if g is None else cupy.asnumpy(g)
        src = cupy.arange(size * 3, dtype=cupy.float64).reshape(size, 3) if rank == 0 else None
        results["scatter"] = cupy.asnumpy(comm.scatter(src, root=0, out=cupy.zeros(3)))
        a2a = cupy.asarray(np.arange(size * 2).reshape(size, 2) + 10 * rank)
        results["all_to_all"] = cupy.asnumpy(comm.all_to_all(a2a))
        rows = cupy.arange(12, dtype=cupy.float32).reshape(4, 3) + 100 * rank  # exact sizes:
        uneven, got = comm.all_to_all_v(rows, [1, 3] if rank == 0 else [4, 0])  # grouped p2p
        results["all_to_all_v"] = (cupy.asnumpy(uneven), got)
        known, known_got = comm.all_to_all_v(rows, counts=[[1, 3], [4, 0]])  # no count exchange
        results["all_to_all_v known"] = (cupy.asnumpy(known), known_got)
        if rank == 0:
            comm.send(cupy.arange(5.0), 1)
            back = cupy.zeros(5)
            comm.irecv(back, 1).synchronize()
            results["p2p"] = cupy.asnumpy(back)
        else:
            got = cupy.zeros(5)
            comm.recv(got, 0)
            comm.isend(got * 2, 0).synchronize()
            results["p2p"] = cupy.asnumpy(got)
        empty = cupy.zeros((0, 3), cupy.float32)  # count 0 and a null pointer reach NCCL
        assert comm.all_reduce(empty) is empty and comm.broadcast(empty, root=1) is empty
        results["empty"] = (comm.all_gather(empty).shape,
                            comm.all_to_all(cupy.zeros((size, 0), cupy.int16)).shape)
        sub = comm.split(0 if rank == 1 else None)
        if sub is not None:
            results["split"] = (sub.rank, sub.size)
            sub.close()
        comm.barrier(timeout=30)
        cupy.cuda.get_current_stream().synchronize()
        return results
    finally:
        comm.close(timeout=30)


@two_ranks
def test_two_ranks_on_one_gpu():
    results = run_ranks(_rank_collectives, 2, init=False, env=MULTI_RANK_ENV, timeout=240)
    for op in OPS:
        expected = reduce_reference(
            np.stack([make_input(3, r, (1000,), "float32", op) for r in range(2)]), op)
        for r in range(2):
            np.testing.assert_allclose(results[r][f"all_reduce/{op}"], expected, rtol=1e-6)
    rs = reduce_reference(np.stack([make_input(4, r, (2, 6), "int32") for r in range(2)]), "sum")
    for r in range(2):
        np.testing.assert_array_equal(results[r]["broadcast"], np.arange(10))
        np.testing.assert_array_equal(results[r]["all_gather"], [[0] * 3, [1] * 3])
        np.testing.assert_array_equal(results[r]["reduce_scatter"], rs[r])
        np.testing.assert_array_equal(results[r]["scatter"], np.arange(6.0).reshape(2, 3)[r])
        np.testing.assert_array_equal(results[r]["all_to_all"],
                                      [[2 * r + 10 * s, 2 * r + 1 + 10 * s] for s in range(2)])
    rows = [np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * r for r in range(2)]
    np.testing.assert_array_equal(results[0]["all_to_all_v"][0],
                                  np.concatenate([rows[0][:1], rows[1]]))
    np.testing.assert_array_equal(results[1]["all_to_all_v"][0], rows[0][1:])
    assert results[0]["all_to_all_v"][1] == [1, 4] and results[1]["all_to_all_v"][1] == [3, 0]
    for r in range(2):
        np.testing.assert_array_equal(results[r]["all_to_all_v known"][0],
                                      results[r]["all_to_all_v"][0])
        assert results[r]["all_to_all_v known"][1] == results[r]["all_to_all_v"][1]
    np.testing.assert_array_equal(results[0]["reduce"], np.full(4, 3.0))
    assert results[1]["reduce"] is None and results[0]["gather"] is None
    np.testing.assert_array_equal(results[1]["gather"], [[0, 0], [1, 1]])
    np.testing.assert_array_equal(results[1]["p2p"], np.arange(5.0))
    np.testing.assert_array_equal(results[0]["p2p"], np.arange(5.0) * 2)
    assert results[1]["split"] == (0, 1) and "split" not in results[0]
    assert results[0]["empty"] == results[1]["empty"] == ((2, 0, 3), (2, 0))


def _rank_sendrecv(rank, size, url):
    import cupy

    comm = gpucoll.init(backend="nccl", rank=rank, world_size=size, url=url, timeout=60)
    try:
        peer = 1 - rank
        mine, theirs = (16 * 2 ** 20 + r for r in (rank, peer))  # 64 MiB of float32 each way
        x = cupy.asarray(make_input(11, rank, (mine,), "float32"))
        out = cupy.zeros(theirs, cupy.float32)
        assert comm.sendrecv(x, peer, out, peer) is out  # both ranks send at once
        back = cupy.zeros_like(x)
        work = comm.sendrecv(out, peer, back, peer, async_op=True)  # and back again
        assert work.synchronize() and work.result() is back
        cupy.cuda.get_current_stream().synchronize()
        return (bool((cupy.asnumpy(out) == make_input(11, peer, (theirs,), "float32")).all()),
                bool((back == x).all()))
    finally:
        comm.close(timeout=30)


@two_ranks
def test_two_ranks_on_one_gpu_exchange_large_arrays_with_sendrecv():
    """Both ranks send 64 MiB to each other at once: NCCL's send waits for its receiver, so
    this completes only because each send is grouped with its receive."""
    assert run_ranks(_rank_sendrecv, 2, init=False, env=MULTI_RANK_ENV, timeout=240) == \
        [(True, True)] * 2


def _first_receive_after_sends(comm):
    """Rank 0 sends twice, then groups its first receive from rank 1 with a third send; rank 1
    sends only once that third message arrived. NCCL connects 1 -> 0 inside rank 0's group
    call, which waits for rank 1's first send: connected first, it runs (GPipe's pattern)."""
    import cupy

    comm.connect_peers([1 - comm.rank])
    comm.connect_peers([1 - comm.rank])  # the second time: nothing to do
    if comm.rank == 0:
        comm.isend(cupy.full(4, 1.0), 1)
        comm.isend(cupy.full(4, 2.0), 1)
        return cupy.asnumpy(comm.sendrecv(cupy.full(4, 3.0), 1, cupy.zeros(4), 1)).tolist()
    got = [cupy.asnumpy(comm.recv(cupy.zeros(4), 0)).tolist() for _ in range(3)]
    comm.send(cupy.full(4, 9.0), 0)
    return got


@two_ranks
def test_two_ranks_on_one_gpu_connect_peers_before_an_asymmetric_exchange():
    assert run_ranks(on_nccl, 2, _first_receive_after_sends, init=False, env=MULTI_RANK_ENV,
                     timeout=240) == [[9.0] * 4, [[1.0] * 4, [2.0] * 4, [3.0] * 4]]


def _graph_replays(comm):
    """Both ranks capture an all_reduce, a broadcast and a send / recv, then launch the graph
    three times; the results after each launch, against NumPy in the test."""
    import cupy

    rank, peer = comm.rank, 1 - comm.rank
    x = cupy.full(1024, rank + 1.0, dtype=cupy.float32)
    b = cupy.full(16, 5.0 if rank == 0 else 0.0)
    sent, got = cupy.full(32, 7 + rank, dtype=cupy.int32), cupy.zeros(32, dtype=cupy.int32)
    comm.connect_peers([peer])  # connected before the capture, so its host calls do not wait
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        comm.all_reduce(x)
        comm.broadcast(b, root=0)
        comm.sendrecv(sent, peer, got, peer)
        graph = stream.end_capture()
    untouched = float(cupy.asnumpy(x)[0])
    seen = []
    for _ in range(3):
        comm.launch_graph(graph, stream=stream)
        stream.synchronize()
        seen.append(float(cupy.asnumpy(x)[0]))
    return (untouched, seen, float(cupy.asnumpy(b).sum()), int(cupy.asnumpy(got)[0]),
            [e["state"] for e in comm.trace()[-3:]])


@two_ranks
def test_two_ranks_on_one_gpu_replay_a_cuda_graph_of_collectives():
    results = run_ranks(on_nccl, 2, _graph_replays, init=False, env=MULTI_RANK_ENV,
                        timeout=240)
    for rank, (untouched, seen, b_sum, got, states) in enumerate(results):
        assert untouched == rank + 1.0  # nothing ran at capture
        assert seen == [3.0, 6.0, 12.0], seen  # each launch sums the two ranks' x
        assert b_sum == 80.0 and got == 7 + (1 - rank)
        assert states == ["done"] * 3, states


def _batch_halo(comm):
    """A periodic halo exchange of two ranks: both faces go to the one neighbour, both come
    from it; 32 MiB of float32 each message, all four in one NCCL group."""
    import cupy

    rank, peer = comm.rank, 1 - comm.rank
    count = 8 * 2 ** 20
    to_right, to_left = (cupy.asarray(make_input(12 + side, rank, (count,), "float32"))
                         for side in (0, 1))
    from_left, from_right = cupy.zeros(count, cupy.float32), cupy.zeros(count, cupy.float32)
    works = comm.batch_isend_irecv([
        gpucoll.P2POp("recv", from_left, peer), gpucoll.P2POp("recv", from_right, peer),
        gpucoll.P2POp("send", to_right, peer), gpucoll.P2POp("send", to_left, peer)])
    assert works[0].synchronize() and works[1].result() is from_right
    return (bool((cupy.asnumpy(from_left) == make_input(12, peer, (count,), "float32")).all()),
            bool((cupy.asnumpy(from_right) == make_input(13, peer, (count,), "float32")).all()))


@two_ranks
def test_two_ranks_on_one_gpu_halo_exchange_with_batch_isend_irecv():
    """Every rank sends both faces before it receives: NCCL's sends wait for their receivers,
    so this completes only because the batch is one group."""
    assert run_ranks(on_nccl, 2, _batch_halo, init=False, env=MULTI_RANK_ENV,
                     timeout=240) == [(True, True)] * 2


SCAN_CASES = [("float32", "sum", 1000), ("int64", "max", 13), ("float16", "prod", 13),
              ("uint8", "bxor", 1), ("bool", "sum", 13), ("complex64", "sum", 13),
              ("int32", "min", 4 * 2 ** 20)]


def _scans(comm, spin=_spin):
    """scan and exscan of each case on a non-default stream kept busy first: a combine that
    did not follow its receive on that stream would read the receive buffer too early."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    results = {}
    for name, op, count in SCAN_CASES:
        host = make_input(21, comm.rank, (count,), name, op)
        x, y = cupy.asarray(host), cupy.asarray(host)
        spin(stream, 0.05)
        assert comm.scan(x, op, stream=stream) is x
        out = cupy.zeros_like(y)
        with stream:
            spin(stream, 0.05)
            assert comm.exscan(y, op, out=out) is out
        stream.synchronize()
        results[(name, op, count)] = (cupy.asnumpy(x), cupy.asnumpy(out), cupy.asnumpy(y))
    return results


@two_ranks
def test_two_ranks_on_one_gpu_scan_and_exscan():
    results = run_ranks(on_nccl, 2, _scans, init=False, env=MULTI_RANK_ENV, timeout=240)
    for rank, by_case in enumerate(results):
        for (name, op, count), (scanned, exscanned, untouched) in by_case.items():
            stacked = np.stack([make_input(21, r, (count,), name, op) for r in range(2)])
            prefix = prefix_reference(stacked, op)
            np.testing.assert_array_equal(scanned, prefix[rank])
            np.testing.assert_array_equal(exscanned, prefix[0] if rank else
                                          identity_reference(op, stacked.dtype, (count,)))
            np.testing.assert_array_equal(untouched, stacked[rank])


def _rank_stalls(rank, size, url):
    import cupy

    comm = gpucoll.init(backend="nccl", rank=rank, world_size=size, url=url, timeout=60)
    comm.timeout = 3.0  # for the operations; creation had the long limit
    x = cupy.ones(1024, dtype=cupy.float32)
    comm.all_reduce(x)  # #1: both ranks
    cupy.cuda.get_current_stream().synchronize()
    if rank == 1:
        time.sleep(8)  # never calls #2; rank 0's watchdog must give up
        comm.abort()
        return "skipped"
    comm.all_reduce(x)  # #2: rank 1 never arrives
    time.sleep(5)
    try:
        comm.all_reduce(x)
    except CommTimeoutError as exc:
        return str(exc)
    finally:
        cupy.cuda.get_current_stream().synchronize()  # the abort let the kernel exit
    return "no error"


@two_ranks
def test_two_ranks_watchdog_names_the_missing_rank():
    results = run_ranks(_rank_stalls, 2, init=False, env=MULTI_RANK_ENV, timeout=120)
    assert "all_reduce #2 did not complete" in results[0], results[0]
    assert "ranks that had not reached it: 1 (of 2)" in results[0], results[0]



def _rank_shrinks(rank, size, url):
    import os
    import signal

    import cupy

    from gpucoll.errors import PeerError

    comm = gpucoll.init(backend="nccl", rank=rank, world_size=size, url=url, timeout=60)
    comm.timeout = 3.0  # for the operations and shrink; creation had the long limit
    x = cupy.ones(1024, dtype=cupy.float32)
    comm.all_reduce(x)  # #1: every rank
    cupy.cuda.get_current_stream().synchronize()
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the last rank dies; #2 never completes
    try:
        comm.all_reduce(x)
        comm.synchronize()
        time.sleep(5)  # the watchdog gives up on #2 within the 3 s timeout
        comm.all_reduce(x)
        return "no error"
    except (CommTimeoutError, CommAbortedError, PeerError):
        pass
    new = comm.shrink()
    comm.close()
    try:
        y = cupy.asarray(make_input(5, new.rank, (1000,), "float32"))
        new.all_reduce(y)
        cupy.cuda.get_current_stream().synchronize()
        return new.rank, new.size, new.ranks, dict(new.lost), cupy.asnumpy(y)
    finally:
        new.close(timeout=30)


@two_ranks
def test_three_ranks_one_killed_survivors_shrink_to_a_new_nccl_communicator():
    results = run_ranks(_rank_shrinks, 3, init=False, env=MULTI_RANK_ENV, ranks=[0, 1],
                        timeout=180)
    expected = reduce_reference(np.stack([make_input(5, r, (1000,), "float32")
                                          for r in range(2)]), "sum")
    for r in range(2):
        rank, size, ranks, lost, got = results[r]
        assert (rank, size, ranks, lost) == (r, 2, [0, 1], {2: "did not call shrink within 3 s"})
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def _rank_grows(rank, size, url):
    """Ranks 0 and 1 of a two-rank job all-reduce, then grow with ``min_size=3``; the third
    process asks to join through ``init()`` with GPUCOLL_JOIN, as a launcher's newcomer does.
    Every rank all-reduces on the grown NCCL communicator."""
    import os

    import cupy

    if rank == 2:
        os.environ["GPUCOLL_JOIN"] = "newcomer"
        comm = gpucoll.init(backend="nccl", rank=2, world_size=3, url=url, timeout=120)
        before = None
    else:
        comm = gpucoll.init(backend="nccl", rank=rank, world_size=2, url=url, timeout=120)
        x = cupy.full(1024, rank + 1, dtype=cupy.float32)
        comm.all_reduce(x)
        before = float(cupy.asnumpy(x)[0])
        bigger = comm.grow(min_size=3, timeout=120)
        assert bigger is not comm, "the newcomer did not come in"
        comm.close()
        comm = bigger
    try:
        y = cupy.asarray(make_input(6, comm.rank, (1000,), "float32"))
        comm.all_reduce(y)
        cupy.cuda.get_current_stream().synchronize()
        return comm.rank, comm.size, comm.ranks, sorted(comm.joined), before, cupy.asnumpy(y)
    finally:
        comm.close(timeout=30)


@two_ranks
def test_two_ranks_grow_to_three_nccl_ranks_with_a_newcomer():
    results = run_ranks(_rank_grows, 3, init=False, env=MULTI_RANK_ENV, timeout=240)
    expected = reduce_reference(np.stack([make_input(6, r, (1000,), "float32")
                                          for r in range(3)]), "sum")
    for r in range(3):
        rank, size, ranks, joined, before, got = results[r]
        assert (rank, size, ranks, joined) == (r, 3, [0, 1, 2], [2])
        assert before == (None if r == 2 else 3.0)
        np.testing.assert_allclose(got, expected, rtol=1e-6)
