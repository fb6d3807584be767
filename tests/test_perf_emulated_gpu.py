"""``gpucoll bench``'s GPU path (device buffers, the pid and time gathers, the result check)
on the emulated CuPy and NCCL (tests/emulated_cuda/), two ranks as threads; and the emulated
``ndarray.set`` refusing what CuPy's refuses, which that path relies on."""

import sys

import numpy as np
import pytest

from gpucoll import perf
from gpucoll.perf.engine import run_rank

from nccl_emulated_harness import emu, run  # noqa: F401


@pytest.fixture
def cupy_is_emulated(emu, monkeypatch):  # noqa: F811
    """``import cupy`` (as gpucoll.perf's device buffers do) gives the emulation."""
    monkeypatch.setitem(sys.modules, "cupy", emu.cupy)
    return emu


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "broadcast", "sendrecv",
                                        "halo"])
def test_bench_sweep_on_device_buffers_checks_every_result(run, cupy_is_emulated,  # noqa: F811
                                                           collective):
    opts = perf.BenchOptions(collectives=(collective,), min_bytes=4, max_bytes=4 << 10,
                             factor=32, iters=3, warmup=1, backend="nccl", timeout=10)
    events = []

    def rank(comm):
        run_rank(comm, opts, lambda kind, value: events.append((kind, value)))
        return comm.memory

    assert run(2, rank, timeout=10) == ["cuda", "cuda"]
    begin = [value for kind, value in events if kind == "begin"]
    rows = [value for kind, value in events if kind == "row"]
    assert len(begin) == 1 and begin[0]["backend"] == "nccl" and len(begin[0]["pids"]) == 2
    assert begin[0]["machine"]["cupy"] == cupy_is_emulated.cupy.__version__
    assert [row["size"] for row in rows] == [size - size % (8 if collective == "all_gather" else 4)
                                             for size in opts.sizes]
    for row in rows:
        for mode in perf.COLLECTIVES[collective].modes:
            assert row[mode]["wrong"] == 0 and row[mode]["time_us"] > 0, row


def test_device_buffer_put_and_get_round_trip(cupy_is_emulated):
    dev = perf._Cuda()
    buf = dev.empty((2, 3), np.int64)
    dev.put(buf, np.arange(6, dtype=np.int64))  # reshaped to the buffer's shape
    dev.sync()
    np.testing.assert_array_equal(dev.get(buf), np.arange(6).reshape(2, 3))


def test_emulated_set_refuses_what_cupy_refuses(emu):  # noqa: F811
    x = emu.cupy.zeros(4, np.float32)
    with pytest.raises(TypeError, match="Only numpy.ndarray"):
        x.set([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError, match="float64 array cannot be set to float32"):
        x.set(np.ones(4))
    with pytest.raises(ValueError, match="Shape mismatch"):
        x.set(np.ones((2, 2), np.float32))
    x.set(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(x.get(), np.arange(4))
