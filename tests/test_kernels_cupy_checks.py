"""``kernels.pack`` / ``unpack``'s checks and work tables for real CuPy arrays, which need no
GPU when their memory is host memory wrapped as device memory (``cupy.cuda.UnownedMemory``):
the fast path for arrays like the ones before gives what the full checks give, every error is
still named, and a work table goes to the GPU once per content and stream."""

from __future__ import annotations

import numpy as np
import pytest

from gpucoll import kernel_tables, kernels

cupy = pytest.importorskip("cupy")
from cupy.cuda import memory  # noqa: E402


def _on(host: np.ndarray, device: int = 0, dtype=None, shape=None, offset: int = 0):
    """A CuPy array over ``host``'s memory (from element ``offset``), said to be on ``device``."""
    dtype = np.dtype(dtype or host.dtype)
    shape = shape if shape is not None else ((host.nbytes - offset * host.itemsize) // dtype.itemsize,)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    owner = memory.UnownedMemory(host.ctypes.data + offset * host.itemsize, nbytes, host,
                                 device_id=device)
    return cupy.ndarray(shape, dtype, memptr=memory.MemoryPointer(owner, 0))


def _arrays(host, sizes):
    out, at = [], 0
    for size in sizes:
        out.append(_on(host, offset=at, shape=(size,)))
        at += size
    return out


def test_the_fast_path_agrees_with_the_full_checks():
    rng = np.random.default_rng(3)
    sizes = [int(s) for s in rng.integers(0, 50, 40)]
    host = np.zeros(sum(sizes) + 64, np.float32)
    arrays, bucket = _arrays(host, sizes), _on(np.zeros(sum(sizes) + 8, np.float32))
    got = kernels._validate(arrays, bucket, None, "pack")
    # one array per call takes the full checks every time: the reference
    one_by_one = [kernels._validate([a], bucket, None, "pack")[2][0] for a in arrays]
    assert got[0] == "float32" and got[2] == one_by_one == sizes
    assert got[1] == [int(x) for x in np.cumsum([0] + sizes[:-1])]
    gaps = [int(x) + i for i, x in enumerate(np.cumsum([0] + sizes[:-1]))]  # one apart
    wide = _on(np.zeros(sum(sizes) + len(sizes), np.float32))
    assert kernels._validate(arrays, wide, gaps, "pack")[1:3] == (gaps, sizes)


def test_every_error_is_still_named():
    host = np.zeros(64, np.float32)
    bucket = _on(np.zeros(32, np.float32))
    good = _arrays(host, [4, 4])
    cases = [
        (good + [_on(np.zeros(4, np.float64))], TypeError,
         "arrays[2] has dtype float64 but arrays[0] has float32"),
        (good + [_on(host, shape=(4, 4))[:, ::2]], ValueError, "arrays[2] must be C-contiguous"),
        (good + [_on(np.zeros(4, np.float32), device=1)], ValueError,
         "arrays[2] is on device 1, the bucket on device 0"),
        (good + [np.zeros(4, np.float32)], TypeError, "arrays[2] is a numpy.ndarray"),
        (good + _arrays(np.zeros(40, np.float32), [30]), ValueError,
         "arrays[2] (30 elements at offset 8) does not fit in the bucket of 32 elements"),
    ]
    for arrays, error, message in cases:
        with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            kernels._validate(arrays, bucket, None, "pack")
    with pytest.raises(ValueError, match=r"arrays\[1\] \(4 elements at offset -1\)"):
        kernels._validate(good, bucket, [0, -1], "pack")
    with pytest.raises(ValueError, match="got 1 offsets for 2 arrays"):
        kernels._validate(good, bucket, [0], "pack")


def test_a_list_checked_before_is_not_checked_again(monkeypatch):
    host = np.zeros(64, np.float32)
    arrays, bucket = _arrays(host, [4, 8, 0, 5]), _on(np.zeros(32, np.float32))
    first = kernels._validate(arrays, bucket, None, "pack")
    assert first[3] == [a.data.ptr for a in arrays]

    def checked_again(*args):
        raise AssertionError("checked again")

    monkeypatch.setattr(kernels, "_check_arrays", checked_again)
    assert kernels._validate(arrays, bucket, None, "pack") == first
    assert kernels._validate(tuple(arrays), bucket, None, "pack") == first  # same objects
    # the offsets are still checked at every call
    with pytest.raises(ValueError, match=r"arrays\[3\] \(5 elements at offset 30\)"):
        kernels._validate(arrays, bucket, [0, 4, 12, 30], "pack")
    # another object in the list, another order, another GPU: checked in full
    for other in ([*arrays[:3], _on(np.zeros(5, np.float32))], arrays[::-1]):
        with pytest.raises(AssertionError, match="checked again"):
            kernels._validate(other, bucket, None, "pack")
    with pytest.raises(AssertionError, match="checked again"):
        kernels._validate(arrays, _on(np.zeros(32, np.float32), device=1), None, "pack")


def test_a_placement_found_to_fit_before_is_not_worked_out_again(monkeypatch):
    host = np.zeros(64, np.float32)
    arrays, bucket = _arrays(host, [4, 8, 5]), _on(np.zeros(32, np.float32))
    first = kernels._validate(arrays, bucket, [0, 4, 12], "pack")
    default = kernels._validate(arrays, bucket, None, "pack")
    assert first[1:3] == ([0, 4, 12], [4, 8, 5]) and default[1] == [0, 4, 12]

    def placed_again(*args):
        raise AssertionError("placed again")

    monkeypatch.setattr(kernels, "_place", placed_again)
    assert kernels._validate(arrays, bucket, (0, 4, 12), "pack") == first  # same content
    assert kernels._validate(arrays, bucket, None, "pack") == default
    # other offsets, another bucket length, a list not checked before: worked out again
    for other_arrays, other_bucket, offsets in (
            (arrays, bucket, [0, 4, 13]), (arrays, _on(np.zeros(31, np.float32)), [0, 4, 12]),
            (arrays[:2], bucket, [0, 4])):
        with pytest.raises(AssertionError, match="placed again"):
            kernels._validate(other_arrays, other_bucket, offsets, "pack")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"arrays\[2\] \(5 elements at offset 28\)"):
        kernels._validate(arrays, bucket, [0, 4, 28], "pack")  # still checked


def test_launches_worked_out_before_are_reused():
    pointers, offsets, sizes = [4096, 8192, 12288], [0, 8, 100], [5, 0, 9000]
    plan = kernel_tables._planned(pointers, offsets, sizes)
    expected = list(kernels.work_tables(pointers, offsets, sizes))
    assert [(n, grid) for n, grid, _, _ in plan] == [(n, grid) for n, grid, _ in expected]
    for (_, _, table, content), (_, _, reference) in zip(plan, expected):
        np.testing.assert_array_equal(table, reference)
        assert content == reference.tobytes()
    assert kernel_tables._planned(list(pointers), tuple(offsets), sizes) is plan
    assert kernel_tables._planned(pointers, [0, 8, 101], sizes) is not plan
    assert kernel_tables._planned([4096, 8192, 12289], offsets, sizes) is not plan


def test_a_list_checked_before_still_names_a_new_error():
    host = np.zeros(64, np.float32)
    arrays, bucket = _arrays(host, [4, 4]), _on(np.zeros(32, np.float32))
    kernels._validate(arrays, bucket, None, "pack")
    arrays[1] = _on(host, shape=(4, 4))[:, ::2]  # the same list, an array that fails
    with pytest.raises(ValueError, match=r"arrays\[1\] must be C-contiguous"):
        kernels._validate(arrays, bucket, None, "pack")
    with pytest.raises(ValueError, match=r"arrays\[0\] is on device 0, the bucket on device 1"):
        kernels._validate(arrays[:1], _on(np.zeros(32, np.float32), device=1), None, "pack")


def test_the_record_keeps_no_array_alive():
    import gc
    import weakref

    host = np.zeros(64, np.float32)
    arrays, bucket = _arrays(host, [4, 4]), _on(np.zeros(32, np.float32))
    kernels._validate(arrays, bucket, None, "pack")
    refs = [weakref.ref(a) for a in arrays]
    key = tuple(map(id, arrays))
    assert key in kernels._CHECKED
    del arrays
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    stale = kernels._CHECKED[key]
    assert [ref() for ref in stale.refs] == [None, None]
    # new arrays that got the ids of the dead ones (as CPython may give them) do not match it
    fresh = _arrays(host, [4, 4])
    kernels._CHECKED[tuple(map(id, fresh))] = stale
    assert kernels._checked_before(fresh, 0) is None


class _Uploads:
    """Stands for the ``cupy`` module in ``_device_table``: counts uploads."""

    def __init__(self):
        self.count = 0

    def asarray(self, table):
        self.count += 1
        return ("on the GPU", table.copy())


def test_a_work_table_goes_to_the_gpu_once_per_content_and_stream(monkeypatch):
    monkeypatch.setattr(kernel_tables, "_TABLES", type(kernel_tables._TABLES)())
    monkeypatch.setattr(kernel_tables, "TABLES_KEPT", 2)
    up = _Uploads()
    a, b, c = (np.arange(4, dtype=np.int64) + k for k in range(3))
    first = kernel_tables._device_table(up, 0, 7, a)
    assert kernel_tables._device_table(up, 0, 7, a.copy()) is first and up.count == 1
    assert kernel_tables._device_table(up, 0, 8, a) is not first and up.count == 2  # other stream
    assert kernel_tables._device_table(up, 1, 7, a) is not first and up.count == 3  # other GPU
    kernel_tables._device_table(up, 0, 7, b)
    kernel_tables._device_table(up, 0, 7, c)
    assert len(kernel_tables._TABLES) == 2  # the oldest went
    np.testing.assert_array_equal(kernel_tables._device_table(up, 0, 7, b)[1], b)
    assert up.count == 5
    kernel_tables._device_table(up, 0, 7, a)
    assert up.count == 6  # evicted, so uploaded again


def test_the_host_benchmark_runs():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_bucket_host.py"),
                           "--arrays", "50", "--mib", "1", "--repeat", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "host path up to the launch" in proc.stdout
    assert "work-table uploads: 1 " in proc.stdout, proc.stdout
