"""Fused pack / unpack kernels against independent NumPy references.

Every case poisons the destination (NaN, or 0xFF bytes) first and checks every element,
including that bucket gaps are left untouched. The same cases run on the NumPy path here and on
the CUDA kernels (``@pytest.mark.gpu``) where CuPy and a GPU are present.
"""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gpucoll import kernel_tables, kernels

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = kernels.bfloat16

PAIRS = sorted(kernels.SUPPORTED_PAIRS)
SIZE_SETS = {
    "empty-list": [],
    "one-empty": [0],
    "one": [1],
    "zeros-around": [0, 0, 5, 0],
    "odd": [7, 13, 1, 0, 1031],
    "tile-edges": [kernels.TILE_ELEMS - 1, kernels.TILE_ELEMS, kernels.TILE_ELEMS + 1,
                   2 * kernels.TILE_ELEMS - 1, 3],
    "many-small": list(np.random.default_rng(1).integers(0, 300, 257)),
    "large": [1 << 18, 12345],
}


def _dtype(name):
    if name == "bfloat16":
        if BF16 is None:
            pytest.skip("bfloat16 on NumPy needs ml_dtypes")
        return BF16
    return np.dtype(name)


def _compute(a, b):
    return np.dtype(np.float64 if np.float64 in (np.dtype(a), np.dtype(b)) else np.float32)


def _values(rng, n, dtype):
    """Mixed magnitudes (incl. subnormal-ish and rounding-sensitive values) in ``dtype``."""
    x = rng.standard_normal(n) * rng.choice([1e-3, 1.0, 3.0e2, 6.0e4], n)
    return x.astype(np.float32).astype(dtype)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same(actual, expected):
    """Bit-identical, except that any NaN matches any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
    nan = np.isnan(e64)
    np.testing.assert_array_equal(np.isnan(a64), nan)
    np.testing.assert_array_equal(_bits(actual[~nan]), _bits(expected[~nan]))


def _offsets(kind, sizes, itemsize, rng):
    if kind == "packed":
        return None, int(sum(sizes))
    if kind == "aligned":
        return kernels.bucket_offsets(sizes, itemsize)
    offsets, position = [], 3  # odd gaps: unaligned starts
    for size in sizes:
        offsets.append(position)
        position += int(size) + int(rng.integers(0, 3)) * 2 + 1
    return offsets, position + 1


def _make_case(array_dtype, bucket_dtype, sizes, offset_kind, unaligned_src, seed=0):
    rng = np.random.default_rng(seed)
    arrays = []
    for size in sizes:
        values = _values(rng, int(size), array_dtype)
        if unaligned_src:  # a view one element into a larger array: not 16-byte aligned
            base = np.empty(int(size) + 1, array_dtype)
            base[1:] = values
            values = base[1:]
        arrays.append(values)
    offsets, total = _offsets(offset_kind, sizes, np.dtype(bucket_dtype).itemsize, rng)
    return arrays, offsets, total


def ref_pack(arrays, bucket, offsets, scale):
    expected = bucket.copy()
    compute = _compute(arrays[0].dtype if arrays else np.float32, bucket.dtype)
    position = 0
    for index, array in enumerate(arrays):
        start = position if offsets is None else offsets[index]
        scaled = array.reshape(-1).astype(compute) * compute.type(scale)
        expected[start:start + array.size] = scaled.astype(bucket.dtype)
        position = start + array.size
    return expected


def ref_unpack(bucket, arrays, offsets, scale):
    compute = _compute(arrays[0].dtype if arrays else np.float32, bucket.dtype)
    out, position = [], 0
    for index, array in enumerate(arrays):
        start = position if offsets is None else offsets[index]
        segment = bucket[start:start + array.size].astype(compute) * compute.type(scale)
        out.append(segment.astype(array.dtype).reshape(array.shape))
        position = start + array.size
    return out


def poison(array):
    """NaN for floats, 0xFF bytes otherwise (in place)."""
    if np.dtype(array.dtype).kind == "f" or array.dtype == BF16:
        array[...] = np.nan
    else:
        array.view(np.uint8)[...] = 0xFF
    return array


# ------------------------------------------------------------------------------ NumPy path
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
@pytest.mark.parametrize("sizes", list(SIZE_SETS), ids=str)
@pytest.mark.parametrize("offset_kind", ["packed", "aligned", "odd"])
def test_pack_unpack_numpy(pair, sizes, offset_kind):
    array_dtype, bucket_dtype = _dtype(pair[0]), _dtype(pair[1])
    sizes = SIZE_SETS[sizes]
    arrays, offsets, total = _make_case(array_dtype, bucket_dtype, sizes, offset_kind,
                                        unaligned_src=offset_kind == "odd")
    for scale in (1.0, 0.37):
        bucket = poison(np.empty(total, bucket_dtype))
        expected = ref_pack(arrays, bucket, offsets, scale)
        assert kernels.pack(arrays, bucket, offsets=offsets, scale=scale) is bucket
        assert_same(bucket, expected)  # gaps still NaN: untouched

        outs = [poison(np.empty_like(a)) for a in arrays]
        kernels.unpack(bucket, outs, offsets=offsets, scale=1.0 / 3)
        for out, ref in zip(outs, ref_unpack(bucket, arrays, offsets, 1.0 / 3)):
            assert_same(out, ref)


def test_shapes_are_flattened_and_written_in_place():
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 1, 3), np.float32)]
    bucket = kernels.pack(arrays, np.empty(18, np.float32))
    np.testing.assert_array_equal(bucket, np.concatenate([a.ravel() for a in arrays]))
    outs = [np.zeros((3, 4), np.float32), np.zeros((2, 1, 3), np.float32)]
    kernels.unpack(bucket * 2, outs, scale=0.5)
    for out, array in zip(outs, arrays):
        np.testing.assert_array_equal(out, array)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_unpack_flags_non_finite(bad, wire):
    wire = _dtype(wire)
    arrays = [np.zeros(n, np.float32) for n in (5, 0, 70)]
    bucket = np.ones(75, wire)
    flag = np.zeros(1, np.int32)
    kernels.unpack(bucket, arrays, scale=0.5, loss_scale=4.0, found_inf=flag)
    assert flag[0] == 0
    np.testing.assert_array_equal(arrays[2], np.full(70, 0.125, np.float32))  # 1 * 0.5 / 4
    bucket[60] = bad
    kernels.unpack(bucket, arrays, scale=0.5, loss_scale=4.0, found_inf=flag)
    assert flag[0] == 1
    assert not np.isfinite(arrays[2][55])
    kernels.unpack(np.ones(75, wire), arrays, found_inf=flag)
    assert flag[0] == 1, "the flag is sticky: only the caller clears it"


def test_usage_errors():
    f32 = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="float64"):
        kernels.pack([f32, np.zeros(2)], np.zeros(6, np.float32))
    with pytest.raises(TypeError, match="int32"):
        kernels.pack([np.zeros(2, np.int32)], np.zeros(2, np.int32))
    with pytest.raises(TypeError, match=r"float64, float32"):
        kernels.pack([np.zeros(2)], np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.pack([f32, f32], np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="offset 5"):
        kernels.pack([f32], np.zeros(8, np.float32), offsets=[5])
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.pack([np.zeros((4, 4), np.float32)[:, 1]], np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        kernels.pack([f32], np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="int32"):
        kernels.unpack(np.zeros(4, np.float32), [f32], found_inf=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="loss_scale"):
        kernels.unpack(np.zeros(4, np.float32), [f32], loss_scale=0.0)


def test_bucket_offsets_align_to_16_bytes():
    offsets, total = kernels.bucket_offsets([0, 1, 5, 8, 3], 4)
    assert offsets == [0, 0, 4, 12, 20] and total == 24
    offsets, total = kernels.bucket_offsets([3, 9], 2)
    assert offsets == [0, 8] and total == 24


def test_launch_plan_splits_long_lists(monkeypatch):
    sizes = [0, 1, 4096, 4097, 0, 10, 9000]
    (plan,) = kernels.launch_plan(sizes, tile=4096)
    first, stop, block_start = plan
    assert (first, stop) == (0, 7)
    np.testing.assert_array_equal(block_start, [0, 0, 1, 2, 4, 4, 5, 8])
    monkeypatch.setattr(kernel_tables, "MAX_ARRAYS_PER_LAUNCH", 3)
    plan = kernels.launch_plan(sizes, tile=4096)
    assert [(f, s) for f, s, _ in plan] == [(0, 3), (3, 6), (6, 7)]
    monkeypatch.setattr(kernel_tables, "MAX_ARRAYS_PER_LAUNCH", 65536)
    monkeypatch.setattr(kernel_tables, "MAX_BLOCKS_PER_LAUNCH", 3)
    plan = kernels.launch_plan(sizes, tile=4096)
    assert [(f, s) for f, s, _ in plan] == [(0, 3), (3, 6), (6, 7)]
    assert [int(bs[-1]) for _, _, bs in plan] == [2, 3, 3]
    monkeypatch.setattr(kernel_tables, "MAX_BLOCKS_PER_LAUNCH", 2)
    with pytest.raises(ValueError, match="9000 elements"):
        kernels.launch_plan(sizes, tile=4096)


def test_import_does_not_import_cupy():
    code = "import sys, gpucoll, gpucoll.kernels, gpucoll.ddp; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_kernel_sources_are_found_and_inline_the_header():
    for name in ("bucket_pack", "bucket_unpack"):
        source = kernels.kernel_source(name)
        assert f"gpucoll_{name}" in source and '#include "common.cuh"' not in source
        assert "namespace gpucoll" in source


def test_packaging_lists_every_package_and_ships_kernels():
    try:
        import tomllib
    except ImportError:  # Python 3.10: the test extra installs tomli
        import tomli as tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        setuptools_cfg = tomllib.load(handle)["tool"]["setuptools"]
    listed = set(setuptools_cfg["packages"])
    found = {os.path.relpath(d, ROOT).replace(os.sep, ".")
             for d, _, files in os.walk(os.path.join(ROOT, "gpucoll")) if "__init__.py" in files}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert setuptools_cfg["package-dir"]["gpucoll._kernels"] == "kernels"
    assert "*.cu" in setuptools_cfg["package-data"]["gpucoll._kernels"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
@pytest.mark.parametrize("name", ["bucket_pack", "bucket_unpack"])
def test_kernels_compile_with_nvcc(tmp_path, name, arch):
    """Offline compile of every instantiation, with -ftz=true as CuPy adds it: still no .ftz."""
    ptx = tmp_path / f"{name}.ptx"
    subprocess.run(["nvcc", "-ptx", f"-arch={arch}", "-ftz=true", "-DGPUCOLL_INSTANTIATE_ALL",
                    os.path.join(ROOT, "kernels", name + ".cu"), "-o", str(ptx)],
                   check=True, capture_output=True, timeout=120)
    text = ptx.read_text()
    assert text.count(".entry _Z") >= 6, "one entry point per dtype pair"
    # 16-byte accesses: as float4 / double2, or as four words with the cache hints
    assert re.search(r"\.v4\.[fub]32\b", text) and re.search(r"\.v(2\.[fub]64|4\.[fub]32)\b", text), \
        "16-byte vector accesses were generated"
    assert ".ftz" not in text, "flush-to-zero instructions would drop subnormals"


# ------------------------------------------------------------------------------ CUDA path
def _cupy():
    import cupy

    return cupy


def _gpu_dtype(name):
    dtype = _dtype(name)
    if name == "bfloat16":
        cupy = _cupy()
        try:
            cupy.zeros(1, dtype)
        except Exception as exc:
            pytest.skip(f"this CuPy has no bfloat16 arrays ({exc})")
    return dtype


def _gpu_round_trip(pair, sizes, offset_kind, scale=0.37):
    cupy = _cupy()
    array_dtype, bucket_dtype = _gpu_dtype(pair[0]), _gpu_dtype(pair[1])
    arrays, offsets, total = _make_case(array_dtype, bucket_dtype, sizes, offset_kind, False)
    device_arrays = []
    for i, array in enumerate(arrays):
        if offset_kind == "odd" and i % 2:  # device view one element in: unaligned pointer
            base = cupy.empty(array.size + 1, array_dtype)
            base[1:] = cupy.asarray(array)
            device_arrays.append(base[1:])
        else:
            device_arrays.append(cupy.asarray(array))
    host_bucket = poison(np.empty(total, bucket_dtype))
    expected = ref_pack(arrays, host_bucket, offsets, scale)
    bucket = cupy.asarray(host_bucket)
    kernels.pack(device_arrays, bucket, offsets=offsets, scale=scale)
    assert_same(cupy.asnumpy(bucket), expected)
    outs = [cupy.asarray(poison(np.empty_like(a))) for a in arrays]
    kernels.unpack(bucket, outs, offsets=offsets, scale=0.25)
    for out, ref in zip(outs, ref_unpack(expected, arrays, offsets, 0.25)):
        assert_same(cupy.asnumpy(out), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
@pytest.mark.parametrize("sizes", list(SIZE_SETS), ids=str)
@pytest.mark.parametrize("offset_kind", ["packed", "aligned", "odd"])
def test_pack_unpack_gpu(pair, sizes, offset_kind):
    _gpu_round_trip(pair, SIZE_SETS[sizes], offset_kind)


@pytest.mark.gpu
def test_gpu_chunks_long_lists(monkeypatch):
    monkeypatch.setattr(kernel_tables, "MAX_ARRAYS_PER_LAUNCH", 5)
    _gpu_round_trip(("float32", "float16"), SIZE_SETS["odd"] + SIZE_SETS["many-small"], "odd")
    monkeypatch.setattr(kernel_tables, "MAX_ARRAYS_PER_LAUNCH", 65536)
    monkeypatch.setattr(kernel_tables, "MAX_BLOCKS_PER_LAUNCH", 2)
    _gpu_round_trip(("float32", "float32"), SIZE_SETS["tile-edges"], "aligned")


@pytest.mark.gpu
def test_gpu_more_arrays_than_one_launch_carries():
    sizes = [int(s) for s in np.random.default_rng(2).integers(0, 4, kernels.MAX_ARRAYS_PER_LAUNCH + 3000)]
    _gpu_round_trip(("float32", "float32"), sizes, "packed", scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_gpu_unpack_flags_non_finite(bad):
    cupy = _cupy()
    arrays = [cupy.zeros(n, cupy.float32) for n in (5, 0, 70000)]
    bucket = cupy.ones(70005, cupy.float16)
    flag = cupy.zeros(1, cupy.int32)
    kernels.unpack(bucket, arrays, scale=0.5, loss_scale=4.0, found_inf=flag)
    assert int(flag[0]) == 0
    np.testing.assert_array_equal(cupy.asnumpy(arrays[2]), np.full(70000, 0.125, np.float32))
    bucket[69999] = bad
    kernels.unpack(bucket, arrays, scale=0.5, loss_scale=4.0, found_inf=flag)
    assert int(flag[0]) == 1


@pytest.mark.gpu
def test_gpu_kernels_compiled_once_per_device_and_pair():
    cupy = _cupy()
    kernels._kernel.cache_clear()
    flag = cupy.zeros(1, cupy.int32)
    for _ in range(3):
        kernels.pack([cupy.ones(10, cupy.float32)], cupy.zeros(10, cupy.float16))
        kernels.unpack(cupy.zeros(10, cupy.float16), [cupy.ones(10, cupy.float32)])
        kernels.unpack(cupy.zeros(10, cupy.float16), [cupy.ones(10, cupy.float32)], found_inf=flag)
    assert kernels._kernel.cache_info().currsize == 3  # pack, unpack, unpack with the check
    assert int(flag[0]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_gpu_keeps_subnormals(wire):
    """CuPy compiles with -ftz=true; the kernels must still keep float32 / bfloat16 subnormals."""
    cupy = _cupy()
    wire = _gpu_dtype(wire)
    values = np.array([2.0 ** -149, 2.0 ** -133, -(2.0 ** -130), 3 * 2.0 ** -133, 2.0 ** -127,
                       -1.0e-39, 1.0], np.float32)
    for scale in (1.0, 0.5):
        bucket = kernels.pack([cupy.asarray(values)], cupy.zeros(values.size, wire), scale=scale)
        expected = ref_pack([values], np.zeros(values.size, wire), None, scale)
        assert np.count_nonzero(expected.astype(np.float32)) >= 4
        assert_same(cupy.asnumpy(bucket), expected)
        out = cupy.zeros(values.size, cupy.float32)
        kernels.unpack(bucket, [out], scale=0.5)
        assert_same(cupy.asnumpy(out), ref_unpack(expected, [values], None, 0.5)[0])


@pytest.mark.gpu
def test_gpu_bucketer_allocates_on_the_gradients_device():
    """Buckets, the unpack flag and found_inf live on the gradients' GPU, not the current one."""
    cupy = _cupy()
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    from gpucoll.ddp import Bucketer

    class OneRank:  # the Communicator surface Bucketer uses, for one rank
        size = 1

        def all_reduce(self, x, async_op=False):
            class Done:
                def wait(self):
                    pass
            return Done()

    with cupy.cuda.Device(1):
        grads = [cupy.full(1000, 2.0, cupy.float32), cupy.full(10, 3.0, cupy.float32)]
    with cupy.cuda.Device(0):  # current device differs from the gradients'
        bucketer = Bucketer(OneRank(), grads, compression="bf16")
        out = bucketer.reduce(grads, loss_scale=2.0)
        assert bucketer.found_inf.device.id == 1 and not bucketer.found_nonfinite()
        assert all(b.buffer.device.id == 1 for b in bucketer._buckets)
    np.testing.assert_array_equal(cupy.asnumpy(out[0]), np.full(1000, 1.0, np.float32))
    np.testing.assert_array_equal(cupy.asnumpy(out[1]), np.full(10, 1.5, np.float32))
    with cupy.cuda.Device(0):
        flag_on_0 = cupy.zeros(1, cupy.int32)
    with cupy.cuda.Device(1):
        bucket = cupy.ones(10, cupy.float32)
    with pytest.raises(ValueError, match="found_inf is on device 0"):
        kernels.unpack(bucket, [grads[1]], found_inf=flag_on_0)
