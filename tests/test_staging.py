"""The CPU backend's host staging of device arrays, over the CUDA emulation (no GPU needed).

A device array that is not a CuPy array (a torch CUDA tensor: ``__cuda_array_interface__``
and DLPack, but no ``set``) gets its result copied back through a CuPy view of its memory.
"""

import sys

import numpy as np
import pytest

import gpucoll
from gpucoll import cuda_env
from gpucoll.backends.staging import Staged, is_device_array

from emulated_cuda import Emulation

pytestmark = pytest.mark.timeout(60)


class _TensorLike:
    """Device memory of another library: the CUDA array interface only, no ``set``."""

    def __init__(self, array):
        self._array = array

    @property
    def __cuda_array_interface__(self):
        return self._array.__cuda_array_interface__

    @property
    def shape(self):
        return self._array.shape

    @property
    def dtype(self):
        return self._array.dtype


@pytest.fixture
def emu(monkeypatch):
    emulation = Emulation(device_count=1)
    monkeypatch.setattr(cuda_env, "_LOADED", (emulation.cupy, emulation.nccl))
    yield emulation
    emulation.release_all()


def test_a_foreign_device_array_gets_its_result_back(emu, tmp_path):
    cp = emu.cupy
    comm = gpucoll.init(backend="cpu", rank=0, world_size=1, url=f"file://{tmp_path}/s", timeout=5)
    try:
        memory = cp.asarray(np.arange(6, dtype=np.float32))
        tensor = _TensorLike(memory)
        assert not hasattr(tensor, "set") and is_device_array(tensor)
        result = comm.all_reduce(tensor, op="avg")
        assert result is tensor
        np.testing.assert_array_equal(memory.get(), np.arange(6, dtype=np.float32))
        out = _TensorLike(cp.zeros(6, dtype=cp.float32))
        comm.all_reduce(tensor, out=out)
        np.testing.assert_array_equal(out._array.get(), np.arange(6, dtype=np.float32))
        assert comm.scan(tensor, out=out) is out  # combined through a CuPy view of its memory
        np.testing.assert_array_equal(out._array.get(), np.arange(6, dtype=np.float32))
        assert comm.exscan(tensor, op="max") is tensor  # rank 0 of 1: the identity
        np.testing.assert_array_equal(memory.get(), np.full(6, -np.inf, np.float32))
    finally:
        comm.close()


def test_dlpack_only_device_arrays_are_staged(emu):
    cp = emu.cupy

    class OnlyDLPack:
        def __init__(self, array):
            self._array = array

        def __dlpack__(self, stream=None):
            return self._array.__dlpack__()

        def __dlpack_device__(self):
            return (2, 0)

    memory = cp.asarray(np.array([1, 2, 3], np.int32))
    staged = Staged(OnlyDLPack(memory))
    np.testing.assert_array_equal(staged.host, [1, 2, 3])
    staged.host[...] = 7
    staged.write_back()
    np.testing.assert_array_equal(memory.get(), [7, 7, 7])
    assert not is_device_array(np.ones(2)) and not is_device_array([1, 2])


def test_cupy_arrays_are_told_without_building_their_cuda_array_interface(emu, monkeypatch):
    """CuPy builds ``__cuda_array_interface__`` anew (a dict, the dtype's description, the
    current stream) at each read: a data-parallel step asks about every gradient, so a CuPy
    array (or a subclass) is known by its type; other objects still by the interface."""
    from gpucoll.graph_capture import is_device_array as is_device
    from gpucoll.hostarrays import host_view

    cp = emu.cupy
    reads = []
    interface = cp.ndarray.__cuda_array_interface__
    monkeypatch.setattr(cp.ndarray, "__cuda_array_interface__",
                        property(lambda self: reads.append(1) or interface.fget(self)))
    subclass = type("Sub", (cp.ndarray,), {})
    array = cp.ones(3, dtype=cp.float32)
    derived = subclass(array._a, array._device_id, array._owner, array._owndata)
    for x in (array, derived):
        assert cuda_env.is_cupy_array(x) and host_view(x, "g") is x and is_device(x)
    assert reads == []
    foreign = _TensorLike(array)  # another library's device array: asked through the interface
    assert not cuda_env.is_cupy_array(foreign) and is_device(foreign)
    assert host_view(foreign, "g") is foreign and len(reads) == 2
    assert not cuda_env.is_cupy_array(np.ones(2)) and not cuda_env.is_cupy_array(None)
    monkeypatch.setattr(cuda_env, "_LOADED", None)  # no CuPy in use: nothing is one of its arrays
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert not cuda_env.is_cupy_array(array)


def test_copies_run_on_the_callers_stream_even_from_the_worker_of_an_async_op(monkeypatch,
                                                                             tmp_path):
    """CuPy's current stream belongs to a thread (and a GPU): the copy back of an async_op
    runs on a worker thread, where it is another stream (the null stream of whichever GPU is
    current there). The staging copies must use, and wait for, the stream that was current
    for the array's GPU in the caller's thread when the operation was issued."""
    emu = Emulation(device_count=2)
    monkeypatch.setattr(cuda_env, "_LOADED", (emu.cupy, emu.nccl))
    cp = emu.cupy
    comm = gpucoll.init(backend="cpu", rank=0, world_size=1, url=f"file://{tmp_path}/s", timeout=5)
    try:
        with cp.cuda.Device(1):
            x = cp.asarray(np.arange(6, dtype=np.float32))
            stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            for async_op in (False, True):
                del emu.host_copies[:]
                result = comm.all_reduce(x, op="max", async_op=async_op)
                if async_op:
                    assert result.wait(timeout=5)
                used = [(kind, state.name) for kind, state in emu.host_copies]
                assert used == [("get", f"stream {stream.ptr:#x}"),
                                ("set", f"stream {stream.ptr:#x}")], (async_op, used)
        with cp.cuda.Device(1):  # no stream: the null stream of the array's GPU, not GPU 0's
            del emu.host_copies[:]
            comm.all_reduce(x, async_op=True).wait(timeout=5)
        assert [(kind, state.name) for kind, state in emu.host_copies] == \
            [("get", "null stream of GPU 1"), ("set", "null stream of GPU 1")]
        np.testing.assert_array_equal(x.get(), np.arange(6, dtype=np.float32))
    finally:
        comm.close()


def test_device_arrays_in_a_cuda_graph_capture_are_refused_before_anything_is_sent(emu,
                                                                                  tmp_path):
    """Host staging copies a device array to the host and waits for the copy: on a capturing
    stream CUDA refuses the wait and invalidates the whole capture (the emulation does the
    same). The call is refused first, naming the backend: nothing sent or recorded, the
    capture still valid, the communicator usable. Host-only calls (objects) are not
    refused: they involve no device memory."""
    cp = emu.cupy
    comm = gpucoll.init(backend="cpu", rank=0, world_size=1, url=f"file://{tmp_path}/s", timeout=5)
    try:
        x = cp.asarray(np.arange(4, dtype=np.float32))
        out = cp.zeros(4, dtype=cp.float32)
        comm.all_reduce(x)
        records = len(comm.trace())
        refused = {
            "all_reduce": lambda s: comm.all_reduce(x),
            "all_reduce(out=)": lambda s: comm.all_reduce(np.ones(4, np.float32), out=out),
            "all_reduce(async_op)": lambda s: comm.all_reduce(x, async_op=True),
            "broadcast(stream=)": lambda s: comm.broadcast(x, stream=s),
            "all_gather": lambda s: comm.all_gather(x),
            "all_gather_v": lambda s: comm.all_gather_v(x),
            "gather_v": lambda s: comm.gather_v(x, counts=[4]),
            "all_to_all_v": lambda s: comm.all_to_all_v(x, [4]),
            "scatter_v": lambda s: comm.scatter_v(x, 0, [4]),
            "reduce_scatter_v": lambda s: comm.reduce_scatter_v(x),
            "scan": lambda s: comm.scan(x),
            "exscan(stream=)": lambda s: comm.exscan(x, stream=s),
        }
        stream = cp.cuda.Stream(non_blocking=True)
        for name, call in refused.items():
            with stream:
                stream.begin_capture()
                with pytest.raises(gpucoll.UnsupportedOperationError,
                                   match=r"^backend 'cpu' does not support (\w+ of )?a CUDA "
                                         r"array in a CUDA graph capture; this backend "
                                         r"copies device arrays through host memory") as error:
                    call(stream)
                graph = stream.end_capture()  # valid: CUDA was asked nothing it refuses
            assert graph.nodes == [] and len(comm.trace()) == records, (name, error.value)
        with stream:
            stream.begin_capture()
            assert comm.broadcast_object({"lr": 0.1}) == {"lr": 0.1}
            stream.end_capture()
        comm.all_reduce(x, op="max")
        np.testing.assert_array_equal(x.get(), np.arange(4, dtype=np.float32))
    finally:
        comm.close()


def test_the_mpi_backends_direct_device_arrays_are_refused_in_a_capture(emu):
    """CUDA-aware MPI reads device memory itself, after waiting for the stream: in a capture
    that wait is refused (and the memory not yet written), so it is refused first."""
    from gpucoll.backends.mpi import _Direct

    cp = emu.cupy
    x = cp.ones(3, dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    assert _Direct(x, stream).caller is x
    stream.begin_capture()
    for given in (stream, None):
        with stream, pytest.raises(gpucoll.UnsupportedOperationError,
                                   match="backend 'mpi' does not support a CUDA array in a "
                                         "CUDA graph capture"):
            _Direct(x, given)
    assert stream.end_capture().nodes == []
