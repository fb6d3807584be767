"""Object collectives, uneven gathers and uneven scatters with real CuPy arrays (skipped with a
reason without CuPy and a GPU): on a 1-rank NCCL communicator (buffers and results stay on the
GPU) and on the CPU backend, which stages CuPy arrays through the host and hands CuPy arrays
back."""

import numpy as np
import pytest

import gpucoll
from reference import make_input

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(params=["nccl", "cpu"])
def comm(request, tmp_path):
    c = gpucoll.init(backend=request.param, rank=0, world_size=1, url=f"file://{tmp_path}/s",
                     timeout=60, set_default=False)
    yield c
    c.close()


def test_objects_and_uneven_gathers_with_cupy(comm):
    import cupy

    value = {"w": np.arange(5.0), "name": "gpu", "n": (1, 2)}
    got = comm.broadcast_object(value)
    np.testing.assert_array_equal(got["w"], value["w"])
    assert (got["name"], got["n"]) == ("gpu", (1, 2))
    assert comm.all_gather_object(3) == [3] and comm.scatter_object(["s"]) == "s"
    host = make_input(3, 0, (7, 2), "float32")
    for big in (False, True):
        x = cupy.asarray(np.repeat(host, 100_000, axis=0) if big else host)
        out, counts = comm.all_gather_v(x)
        assert isinstance(out, cupy.ndarray) and counts == [x.shape[0]]
        np.testing.assert_array_equal(out.get(), x.get())
        rooted, _ = comm.gather_v(x, root=0)
        assert isinstance(rooted, cupy.ndarray)
        np.testing.assert_array_equal(rooted.get(), x.get())
        both = (comm._all_gather_v_padded(comm._array(x, "x"), counts),
                comm._all_gather_v_broadcasts(comm._array(x, "x"), counts))
        for result in both:
            assert isinstance(result, cupy.ndarray)
            np.testing.assert_array_equal(result.get(), x.get())


def test_uneven_scatters_with_cupy(comm):
    import cupy

    host = make_input(4, 0, (7, 3), "float32")
    x = cupy.asarray(host)
    reduced, counts = comm.reduce_scatter_v(x, op="sum")
    scattered, scattered_counts = comm.scatter_v(x, root=0, counts=[7])
    assert counts == scattered_counts == [7]
    for result in (reduced, scattered):
        assert isinstance(result, cupy.ndarray) and result.device.id == x.device.id
        np.testing.assert_array_equal(result.get(), host)
    np.testing.assert_array_equal(x.get(), host)  # the input is not changed
