"""The CPU backend's host staging of device arrays, over the CUDA emulation (no GPU needed).

A device array that is not a CuPy array (a torch CUDA tensor: ``__cuda_array_interface__``
and DLPack, but no ``set``) gets its result copied back through a CuPy view of its memory.
"""

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
