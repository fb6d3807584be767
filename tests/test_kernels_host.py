"""The CUDA bucketing kernels run on the host and agree bit for bit with the NumPy path.

``kernels/*.cu`` are compiled unchanged with the host C++ compiler through
``tests/kernel_host/cuda_host.h`` (CUDA's built-ins in C++: a block's 256 threads are fibers and
``__syncthreads_or`` is a real per-block barrier; the PTX conversions are C++ with the same
rounding), built once per test session into a shared object and driven through ctypes with the
work tables ``gpucoll.kernels.work_tables`` builds for the GPU. Every launch is compared with
``gpucoll.kernels.pack`` / ``unpack`` on NumPy arrays: buckets (gaps included), arrays (and the
guard elements around them) and the non-finite flag, bit for bit (any NaN matches any NaN, as
NaN payloads are not specified). Skipped, with the reason, where there is no C++ compiler.
"""

import ctypes
import os
import platform
import shutil
import subprocess

import numpy as np
import pytest

from gpucoll import kernel_tables, kernels

pytestmark = [pytest.mark.kernel_host,
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_host",
                      "kernels_host.cpp")
PAIRS = sorted(kernels.SUPPORTED_PAIRS)
GUARD = 5  # poisoned elements before and after every array
TILE = kernels.TILE_ELEMS  # elements one block copies: sizes around it cross tile edges


def _dtype(name):
    if name == "bfloat16":
        if kernels.bfloat16 is None:
            pytest.skip("bfloat16 on NumPy needs ml_dtypes")
        return kernels.bfloat16
    return np.dtype(name)


class HostKernels:
    """The host build: launches the kernels as ``gpucoll.kernels._launch`` does on a GPU."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        lib.gpucoll_host_launch.restype = ctypes.c_int
        lib.gpucoll_host_launch.argtypes = [
            ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_uint,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_double,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.gpucoll_host_barrier_test.restype = ctypes.c_int
        lib.gpucoll_host_barrier_test.argtypes = [
            ctypes.c_uint, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        self.lib = lib
        self.launches = 0

    @staticmethod
    def _check(status, error):
        assert status == 0, error.value.decode()

    def _run(self, name, src, dst, arrays, bucket, offsets, sizes, scale, found_inf):
        check = 0 if found_inf is None else 1
        flag = 0 if found_inf is None else found_inf.ctypes.data
        error = ctypes.create_string_buffer(256)
        for n_arrays, grid, table in kernels.work_tables([a.ctypes.data for a in arrays],
                                                         offsets, sizes):
            assert table.dtype == np.int64 and table.size == 4 * n_arrays + 1 + (grid + 1) // 2
            block_start = table[3 * n_arrays:4 * n_arrays + 1]
            owner = np.searchsorted(block_start, np.arange(grid), side="right") - 1
            np.testing.assert_array_equal(table[4 * n_arrays + 1:].view(np.int32)[:grid], owner)
            self._check(self.lib.gpucoll_host_launch(
                name.encode(), src.encode(), dst.encode(), grid, kernels.THREADS_PER_BLOCK,
                table.ctypes.data, n_arrays, kernels.TILE_ELEMS, bucket.ctypes.data, scale,
                check, flag, error, len(error)), error)
            self.launches += 1

    def pack(self, arrays, bucket, offsets=None, scale=1.0):
        array_dtype, offsets, sizes, _ = kernels._validate(arrays, bucket, offsets, "pack")
        if sizes:
            self._run("pack", array_dtype, bucket.dtype.name, arrays, bucket, offsets, sizes,
                      scale, None)

    def unpack(self, bucket, arrays, offsets=None, scale=1.0, loss_scale=None, found_inf=None):
        array_dtype, offsets, sizes, _ = kernels._validate(arrays, bucket, offsets, "unpack")
        if loss_scale is not None:
            scale = scale / float(loss_scale)  # as kernels.unpack folds it
        if sizes:
            self._run("unpack", bucket.dtype.name, array_dtype, arrays, bucket, offsets, sizes,
                      scale, found_inf)

    def barrier_test(self, grid, threads, voter):
        slots, seen, votes = (np.zeros(grid * threads, np.int32) for _ in range(3))
        error = ctypes.create_string_buffer(256)
        status = self.lib.gpucoll_host_barrier_test(grid, threads, voter, slots.ctypes.data,
                                                    seen.ctypes.data, votes.ctypes.data, error,
                                                    len(error))
        return status, error.value.decode(), seen, votes


def _build(tmp_path_factory, *defines):
    if platform.system() != "Linux":
        pytest.skip("the host kernel emulation uses ucontext fibers (Linux)")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler (g++ or clang++; e.g. apt-get install g++)")
    target = tmp_path_factory.mktemp("kernel_host") / "kernels_host.so"
    command = [compiler, "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing",
               "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", *defines, SOURCE, "-o",
               str(target)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stderr}"
    return HostKernels(str(target))


@pytest.fixture(scope="session")
def host(tmp_path_factory):
    return _build(tmp_path_factory)


@pytest.fixture(scope="session")
def host_searching(tmp_path_factory):
    """The kernels built to find each block's array by a binary search of the table's block
    starts instead of its block map (GPUCOLL_BLOCK_MAP=0, as bench/bench_bucket_tiles.py
    compares them)."""
    return _build(tmp_path_factory, "-DGPUCOLL_BLOCK_MAP=0")


# ------------------------------------------------------------------------------ helpers
def assert_same(actual, expected, what=""):
    """Bit-identical, except that any NaN matches any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    with np.errstate(invalid="ignore"):
        nan, actual_nan = np.isnan(expected.astype(np.float64)), np.isnan(actual.astype(np.float64))
    np.testing.assert_array_equal(actual_nan, nan, err_msg=what)
    a = np.ascontiguousarray(actual[~nan]).view(np.uint8)
    e = np.ascontiguousarray(expected[~nan]).view(np.uint8)
    if not np.array_equal(a, e):
        bad = np.flatnonzero((actual[~nan].view(f"u{actual.itemsize}")
                              != expected[~nan].view(f"u{actual.itemsize}")))[:5]
        pytest.fail(f"{what}: {bad.size}+ elements differ, e.g. at {bad.tolist()}: "
                    f"{actual[~nan][bad]} != {expected[~nan][bad]}")


def random_values(rng, n, dtype, specials):
    """Normal values of every magnitude, subnormals of ``dtype``, signed zeros, rounding ties
    for the casts, random bit patterns; inf and NaN only when ``specials``."""
    dtype = np.dtype(dtype)
    kind = rng.integers(0, 5, n)
    range_of = {np.dtype(np.float16): np.float16, np.dtype(np.float64): np.float64}
    tiny = float(np.finfo(range_of.get(dtype, np.float32)).smallest_normal)  # bf16: float32's
    values = np.where(kind == 0, rng.standard_normal(n) * 10.0 ** rng.integers(-8, 5, n), 0.0)
    values = np.where(kind == 1, rng.uniform(-1, 1, n) * tiny, values)         # subnormals
    values = np.where(kind == 2, np.copysign(0.0, rng.uniform(-1, 1, n)), values)
    values = np.where(kind == 3, rng.standard_normal(n), values)
    out = values.astype(dtype)
    if kind.size:  # random bit patterns (finite unless specials)
        bits = rng.integers(0, 1 << (8 * dtype.itemsize), n, dtype=np.uint64, endpoint=False)
        patterns = bits.astype(f"u{dtype.itemsize}").view(dtype)
        use = kind == 4
        if not specials:
            with np.errstate(invalid="ignore"):
                use &= np.isfinite(patterns.astype(np.float64))
        out[use] = patterns[use]
    if specials and n:
        where = rng.choice(n, size=min(n, 3), replace=False)
        out[where] = np.array([np.inf, -np.inf, np.nan][:where.size]).astype(dtype)
    return out


def guarded_arrays(layout, dtype, values=None):
    """Arrays of ``layout`` ((size, misalignment) pairs) as views of one NaN-poisoned buffer:
    each starts ``GUARD + misalignment`` elements after the previous one ends, so every array
    has poisoned guards on both sides and starts at any alignment.

    Returns (buffer, views); ``values`` (one flat array, the arrays' values back to back) fills
    the views (default: left NaN)."""
    starts, position = [], 0
    for size, misalign in layout:
        position += GUARD + misalign
        starts.append(position)
        position += size
    buffer = np.full(position + GUARD, np.nan, dtype)
    views = [buffer[start:start + size] for start, (size, _) in zip(starts, layout)]
    if values is not None:
        mask = np.zeros(buffer.size, bool)
        for start, (size, _) in zip(starts, layout):
            mask[start:start + size] = True
        buffer[mask] = values
    return buffer, views


def random_case(rng, array_dtype, bucket_dtype, n_arrays, specials):
    """A random work list: (layout, source arrays, bucket offsets, bucket size)."""
    sizes = [int(s) for s in rng.choice(
        [0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 100, 1000, TILE - 1, TILE, TILE + 1,
         2 * TILE + 8, 2 * TILE + 809],
        size=n_arrays)]
    layout = [(size, int(rng.integers(0, 4))) for size in sizes]
    values = random_values(rng, sum(sizes), array_dtype, specials)
    _, arrays = guarded_arrays(layout, array_dtype, values)
    if rng.integers(0, 2):
        offsets, total = kernels.bucket_offsets(sizes, np.dtype(bucket_dtype).itemsize)
    else:  # odd gaps: bucket slices at any alignment
        offsets, position = [], int(rng.integers(0, 4))
        for size in sizes:
            offsets.append(position)
            position += size + int(rng.integers(0, 4))
        total = position + 1
    return layout, arrays, offsets, total


def compare_pack(host, arrays, offsets, total, bucket_dtype, scale):
    """Pack on both paths into NaN-poisoned buckets; returns the (equal) bucket."""
    expected = np.full(total, np.nan, bucket_dtype)
    actual = expected.copy()
    kernels.pack(arrays, expected, offsets=offsets, scale=scale)
    host.pack(arrays, actual, offsets=offsets, scale=scale)
    assert_same(actual, expected, f"pack scale={scale!r}")
    return expected


def compare_unpack(host, bucket, layout, array_dtype, offsets, scale, loss_scale, check):
    """Unpack on both paths into poisoned, guarded arrays; returns the flag (or None)."""
    results = {}
    for path, run in (("numpy", kernels.unpack), ("host", host.unpack)):
        buffer, views = guarded_arrays(layout, array_dtype)
        flag = np.zeros(1, np.int32) if check else None
        run(bucket, views, offsets=offsets, scale=scale, loss_scale=loss_scale, found_inf=flag)
        results[path] = (buffer, flag)
    assert_same(results["host"][0], results["numpy"][0], "unpacked arrays (guards included)")
    if not check:
        return None
    assert results["host"][1][0] == results["numpy"][1][0], "non-finite flag"
    return int(results["numpy"][1][0])


# ------------------------------------------------------------------------------ the emulation
def test_barrier_waits_for_the_whole_block(host):
    status, error, seen, votes = host.barrier_test(3, 256, voter=17)
    assert status == 0, error
    index = np.arange(3 * 256)
    neighbour = index // 256 * 256 + (index % 256 + 1) % 256
    np.testing.assert_array_equal(seen, neighbour + 1)  # another thread's pre-barrier write
    np.testing.assert_array_equal(votes, 1)  # one vote in each block: the OR is 1 everywhere
    status, error, _, votes = host.barrier_test(2, 256, voter=1000)
    assert status == 0, error
    np.testing.assert_array_equal(votes, 0)
    status, error, _, _ = host.barrier_test(1, 256, voter=-1)  # thread 0 skips the barrier
    assert status == 1 and "255 of 256 threads" in error and "divergent" in error


# ------------------------------------------------------------------------------ conversions
def test_every_float16_converts_as_numpy(host):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    layout = [(every.size, 0)]
    compare_pack(host, [every], None, every.size, np.float16, 1.0)   # f16 -> f32 * 1 -> f16
    compare_unpack(host, every, layout, np.float32, None, 1.0, None, check=True)


def test_every_bfloat16_converts_as_numpy(host):
    bf16 = _dtype("bfloat16")
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(bf16)
    compare_pack(host, [every], None, every.size, bf16, 1.0)
    compare_unpack(host, every, [(every.size, 0)], np.float32, None, 1.0, None, check=True)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_float32_narrows_as_numpy(host, wire):
    """Rounding to nearest even at every exponent that matters: half subnormals, the normal
    range, overflow to inf; ties, ties +- 1 ulp, random mantissas, both signs."""
    rng = np.random.default_rng(7)
    if wire == "float16":
        exponents = np.arange(90, 160, dtype=np.uint32)
    else:
        exponents = np.r_[0:8, 120:135, 248:256].astype(np.uint32)
    low = np.array([0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x7fff, 0x8000, 0x8001, 0xffff],
                   np.uint32)
    mantissas = np.concatenate([rng.integers(0, 1 << 23, 300, dtype=np.uint32),
                                (rng.integers(0, 1 << 7, low.size, dtype=np.uint32) << 16) | low])
    bits = (exponents[:, None] << 23 | mantissas[None, :]).ravel()
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    values = bits.view(np.float32)
    compare_pack(host, [values], None, values.size, _dtype(wire), 1.0)


# ------------------------------------------------------------------------------ work tables
SCALES = [1.0, 0.37, 1.0 / 3, 2.0 ** -20, 3.0e4]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
@pytest.mark.parametrize("seed", [0, 1])
def test_random_work_tables_match_numpy(host, pair, seed):
    array_dtype, bucket_dtype = _dtype(pair[0]), _dtype(pair[1])
    rng = np.random.default_rng([seed, PAIRS.index(pair)])
    for specials in (False, True):
        layout, arrays, offsets, total = random_case(rng, array_dtype, bucket_dtype,
                                                     int(rng.integers(1, 12)), specials)
        scale = float(rng.choice(SCALES))
        bucket = compare_pack(host, arrays, offsets, total, bucket_dtype, scale)
        loss_scale = [None, 2.0 ** 12, 3.0][int(rng.integers(0, 3))]
        compare_unpack(host, bucket, layout, array_dtype, offsets, float(rng.choice(SCALES)),
                       loss_scale, check=True)
        compare_unpack(host, bucket, layout, array_dtype, offsets, 0.5, None, check=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_binary_search_finds_the_same_arrays(host_searching, seed):
    """Pack and unpack without the block map: many arrays (empty ones among them, which own
    no block) on random layouts, against NumPy."""
    f32 = np.dtype(np.float32)
    rng = np.random.default_rng([seed, 99])
    for specials in (False, True):
        layout, arrays, offsets, total = random_case(rng, f32, f32, 40, specials)
        bucket = compare_pack(host_searching, arrays, offsets, total, f32, 0.37)
        compare_unpack(host_searching, bucket, layout, f32, offsets, 0.5, None, check=True)


def test_subnormals_are_kept(host):
    """float32 and bfloat16 subnormals survive the scale multiply and the casts."""
    values = np.array([2.0 ** -149, 2.0 ** -133, -(2.0 ** -130), 3 * 2.0 ** -133, 2.0 ** -127,
                       -1.0e-39], np.float32)  # float32 subnormals, most also bfloat16 ones
    for wire in ("float32", "bfloat16"):
        wire = _dtype(wire)
        for scale in (1.0, 0.5, 2.0 ** -3):
            bucket = compare_pack(host, [values], None, values.size, wire, scale)
            assert np.count_nonzero(bucket.astype(np.float32)) >= 3, bucket  # not flushed
            compare_unpack(host, bucket, [(values.size, 1)], np.float32, None, 1.0, None, True)


def test_non_finite_values_set_the_flag(host):
    for wire in ("float32", "float16", "bfloat16"):
        bucket = np.ones(9000, _dtype(wire))
        layout = [(10, 1), (0, 0), (8990, 3)]
        offsets = [0, 10, 10]
        assert compare_unpack(host, bucket, layout, np.float32, offsets, 0.5, 4.0, True) == 0
        for bad in (np.inf, -np.inf, np.nan):
            bucket[8999] = bad  # in the tail of the last tile
            assert compare_unpack(host, bucket, layout, np.float32, offsets, 0.5, 4.0, True) == 1
            bucket[8999] = 1
    big = np.full(3, 6.0e4, np.float32)  # finite in float32, overflows the float16 cast
    bucket = compare_pack(host, [big], None, 3, np.float16, 2.0)
    assert np.isinf(bucket).all()


def test_launches_split_as_planned(host, monkeypatch):
    rng = np.random.default_rng(11)
    layout, arrays, offsets, total = random_case(rng, np.float32, np.float16, 40, True)
    for max_arrays, max_blocks in ((5, 2 ** 31 - 1), (65536, 4), (3, 3)):
        monkeypatch.setattr(kernel_tables, "MAX_ARRAYS_PER_LAUNCH", max_arrays)
        monkeypatch.setattr(kernel_tables, "MAX_BLOCKS_PER_LAUNCH", max_blocks)
        before = host.launches
        bucket = compare_pack(host, arrays, offsets, total, np.float16, 0.25)
        assert host.launches - before > 1
        compare_unpack(host, bucket, layout, np.float32, offsets, 4.0, None, True)


def test_more_arrays_than_one_launch_carries(host):
    """65,536 + 700 arrays (most empty, which own no block): two launches with full tables."""
    rng = np.random.default_rng(5)
    n = kernels.MAX_ARRAYS_PER_LAUNCH + 700
    sizes = np.zeros(n, np.int64)
    sizes[rng.choice(n, 700, replace=False)] = rng.integers(1, 40, 700)
    sizes[-1] = 5000
    layout = [(int(size), int(misalign)) for size, misalign in
              zip(sizes, rng.integers(0, 2, n))]
    _, arrays = guarded_arrays(layout, np.float32,
                               random_values(rng, int(sizes.sum()), np.float32, False))
    offsets, total = kernels.bucket_offsets(sizes, 2)
    before = host.launches
    bucket = compare_pack(host, arrays, offsets, total, _dtype("bfloat16"), 0.5)
    assert host.launches - before == 2
    compare_unpack(host, bucket, layout, np.float32, offsets, 2.0, 8.0, True)


def test_empty_lists_and_empty_arrays_launch_nothing(host):
    before = host.launches
    compare_pack(host, [], None, 4, np.float32, 1.0)
    compare_pack(host, [np.zeros(0, np.float32)] * 3, [0, 1, 2], 4, np.float32, 1.0)
    compare_unpack(host, np.ones(4, np.float32), [(0, 0), (0, 1)], np.float32, [0, 4], 1.0,
                   None, True)
    assert host.launches == before
