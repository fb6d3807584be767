"""Fused bucketing kernels: pack many arrays into one flat bucket and unpack it again.

``pack`` and ``unpack`` take NumPy or CuPy arrays and dispatch on the array type:

* CuPy: one launch of ``gpucoll_bucket_pack`` / ``gpucoll_bucket_unpack`` (``kernels/*.cu``,
  compiled with ``cupy.RawModule`` once per device and dtype pair, then cached) per 65,536
  arrays, on the current CuPy stream, with 16-byte vector accesses wherever an array and its
  bucket slice share 16-byte alignment.
* NumPy: the same semantics with ufuncs, so the bucketer runs (and is tested) on any machine.

Semantics (both paths; ``C`` is float32, or float64 when either side is float64)::

    pack:    bucket[offsets[a] + i] = bucket.dtype(C(arrays[a].flat[i]) * scale)
    unpack:  arrays[a].flat[i]      = arrays[a].dtype(C(bucket[offsets[a] + i]) * scale / loss_scale)
             found_inf[0] = 1 if any value written is inf or NaN (only when found_inf is given)

Each launch reads a work table (:mod:`gpucoll.kernel_tables`), built and uploaded once per
layout. On a stream that is capturing a CUDA graph the launches are recorded like any kernel;
their work tables are uploaded outside the capture and kept for every replay (see
:func:`release_graph_tables`).

Rounding is to nearest even in both paths, so they agree bit for bit. Supported
(array dtype, bucket dtype) pairs: (float32, float32 | bfloat16 | float16), (float16, float16),
(bfloat16, bfloat16), (float64, float64). bfloat16 needs CuPy's bfloat16 dtype on the GPU and the
``ml_dtypes`` package on the CPU; without it the NumPy path supports float16/32/64 only.

Importing this module never imports CuPy.
"""

from __future__ import annotations

import collections
import functools
import operator
import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import cuda_env
from .kernel_tables import (MAX_ARRAYS_PER_LAUNCH, TILE_ELEMS, _device_table, _graph_table,
                            _keep_newest, _planned, _touch, launch_plan, release_graph_tables,
                            work_tables)

__all__ = ["pack", "unpack", "bucket_offsets", "bfloat16", "SUPPORTED_PAIRS", "kernel_source",
           "compile_request", "launch_plan", "work_tables", "release_graph_tables",
           "MAX_ARRAYS_PER_LAUNCH", "TILE_ELEMS"]

try:  # NumPy has no bfloat16; ml_dtypes (a JAX dependency) provides one
    import ml_dtypes as _ml_dtypes

    bfloat16: Optional[np.dtype] = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    bfloat16 = None

#: (array dtype name, bucket dtype name) pairs both paths implement.
SUPPORTED_PAIRS = frozenset({
    ("float32", "float32"), ("float32", "bfloat16"), ("float32", "float16"),
    ("float16", "float16"), ("bfloat16", "bfloat16"), ("float64", "float64"),
})

THREADS_PER_BLOCK = 256
#: Options the loader gives NVRTC (through ``cupy.RawModule``).
NVRTC_OPTIONS = ("--std=c++14",)

_C_TYPES = {"float32": "float", "float64": "double", "float16": "gpucoll::f16_t",
            "bfloat16": "gpucoll::bf16_t"}
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE_DIRS = (os.path.join(_HERE, "_kernels"),                       # installed wheel
                os.path.join(os.path.dirname(_HERE), "kernels"))       # source tree


# ---------------------------------------------------------------------------- helpers
def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


_DTYPE_NAMES: Dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """``np.dtype(dtype).name``, remembered: NumPy builds that string anew each time (about
    4 µs), which once cost more than everything else ``pack`` does per array."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype-like
        name = np.dtype(dtype).name
        if len(_DTYPE_NAMES) < 256:
            try:
                _DTYPE_NAMES[dtype] = name
            except TypeError:
                pass
        return name


def _contiguous(array: Any) -> bool:
    return array.flags.c_contiguous


def _cupy_contiguous(array: Any) -> bool:
    try:
        return array._c_contiguous  # CuPy's own flag: no Flags object per call
    except AttributeError:
        return array.flags.c_contiguous


def _check_pair(array_dtype: str, bucket_dtype: str) -> None:
    if (array_dtype, bucket_dtype) not in SUPPORTED_PAIRS:
        pairs = ", ".join(f"{a}->{b}" for a, b in sorted(SUPPORTED_PAIRS))
        raise TypeError(f"unsupported (array dtype, bucket dtype) pair ({array_dtype}, "
                        f"{bucket_dtype}); supported: {pairs}")


def bucket_offsets(sizes: Sequence[int], itemsize: int, align_bytes: int = 16) -> Tuple[List[int], int]:
    """Element offsets that place arrays of ``sizes`` elements back to back in a bucket, each
    starting on an ``align_bytes`` boundary (so the kernels can use vector accesses).

    Returns:
        (offsets, total elements the bucket needs).
    """
    step = max(align_bytes // itemsize, 1)
    offsets, position = [], 0
    for size in sizes:
        offsets.append(position)
        position += -(-int(size) // step) * step
    return offsets, position


#: Lists of CuPy arrays that passed the checks, {ids: _Checked}, newest last: a training step
#: packs and unpacks the same gradients at every step, and a CuPy array's type, dtype, memory,
#: size, contiguity and device never change (only its shape can be set, to one of the same size
#: and contiguity), so a list of the same live objects needs no checks again.
_CHECKED: "collections.OrderedDict[Tuple[int, ...], _Checked]" = collections.OrderedDict()
#: How many lists are remembered (each holds weak references only).
CHECKED_KEPT = 64


class _Checked:
    """What the checks found for one list of CuPy arrays."""

    __slots__ = ("refs", "device", "dtype", "sizes", "pointers", "placed")

    def __init__(self, arrays: Sequence[Any], device: int, dtype: str, sizes: np.ndarray):
        self.refs = [weakref.ref(array) for array in arrays]  # never keeps an array alive
        self.device, self.dtype, self.sizes = device, dtype, sizes
        self.pointers = [array.data.ptr for array in arrays]
        # {(offsets as a tuple, or None; bucket length): (offsets, sizes) as lists} that fit
        self.placed: Dict[Tuple[Any, int], Tuple[List[int], List[int]]] = {}


def _checked_before(arrays: Sequence[Any], device: int) -> Optional[_Checked]:
    """The record of ``arrays`` (a list or tuple of the very same live objects, in order)
    checked before for ``device``, else None."""
    if type(arrays) not in (list, tuple):
        return None
    key = tuple(map(id, arrays))
    found = _CHECKED.get(key)
    if found is None or found.device != device or \
            not all(map(operator.is_, [ref() for ref in found.refs], arrays)):
        return None
    _touch(_CHECKED, key)
    return found


def _remember_checked(arrays: Sequence[Any], device: int, dtype: str,
                      sizes: np.ndarray) -> Optional[_Checked]:
    """Remember that ``arrays`` passed the checks; returns the record (None: not kept)."""
    if type(arrays) not in (list, tuple):
        return None
    try:
        checked = _Checked(arrays, device, dtype, sizes)
    except TypeError:  # an array type without weak references: checked at every call
        return None
    _CHECKED[tuple(map(id, arrays))] = checked
    _keep_newest(_CHECKED, CHECKED_KEPT)
    return checked


def _placement_key(offsets: Optional[Sequence[int]], length: int) -> Optional[Tuple[Any, int]]:
    """The key of ``_Checked.placed`` for these offsets and bucket length (None: unhashable)."""
    try:
        key = (None if offsets is None else tuple(offsets), length)
        hash(key)
        return key
    except TypeError:  # offsets that are not a sequence of ints: checked in full
        return None


def _validate(arrays: Sequence[Any], bucket: Any, offsets: Optional[Sequence[int]],
              what: str) -> Tuple[str, List[int], List[int], Optional[List[int]]]:
    """The arrays' dtype name, offsets and sizes (lists of ints), and for CuPy arrays their
    pointers (None for NumPy), once every check passed."""
    if not hasattr(bucket, "dtype") or getattr(bucket, "ndim", None) != 1:
        raise ValueError(f"bucket must be a 1-D array, got {type(bucket).__name__} with shape "
                         f"{getattr(bucket, 'shape', None)}")
    if not bucket.flags.c_contiguous:
        raise ValueError(f"bucket must be contiguous (strides {bucket.strides})")
    gpu = _is_cupy(bucket)
    device = bucket.data.device_id if gpu else None
    found = _checked_before(arrays, device) if gpu else None
    if found is not None:
        array_dtype, sizes_np, pointers = found.dtype, found.sizes, found.pointers
    else:
        array_dtype, sizes_np = _check_arrays(arrays, bucket, gpu, device, what)
        found = _remember_checked(arrays, device, array_dtype, sizes_np) if gpu else None
        pointers = found.pointers if found is not None else \
            [array.data.ptr for array in arrays] if gpu else None
    if array_dtype is not None:
        _check_pair(array_dtype, _dtype_name(bucket.dtype))
    # where these arrays go in a bucket of this length, found to fit before (a training step
    # packs each bucket the same way at every step: its few small NumPy calls cost more than
    # the rest of a small bucket's pack)
    placement = _placement_key(offsets, bucket.size) if found is not None else None
    placed = found.placed.get(placement) if placement is not None else None
    if placed is not None:
        return array_dtype or "", placed[0], placed[1], pointers
    offsets, sizes = _place(offsets, sizes_np, bucket.size)
    if placement is not None:
        if len(found.placed) >= 16:  # buckets of ever new layouts: keep the newest few
            found.placed.clear()
        found.placed[placement] = (offsets, sizes)
    return array_dtype or "", offsets, sizes, pointers


def _place(offsets: Optional[Sequence[int]], sizes_np: np.ndarray,
           length: int) -> Tuple[List[int], List[int]]:
    """``(offsets, sizes)`` as lists of ints once every array fits in a bucket of ``length``
    elements at its offset (default: back to back from 0)."""
    if offsets is None:
        offsets_np = np.zeros(len(sizes_np), dtype=np.int64)
        np.cumsum(sizes_np[:-1], out=offsets_np[1:])
    elif len(offsets) != len(sizes_np):
        raise ValueError(f"got {len(offsets)} offsets for {len(sizes_np)} arrays")
    else:
        offsets_np = np.asarray(offsets, dtype=np.int64)
    outside = np.flatnonzero((offsets_np < 0) | (offsets_np + sizes_np > length))
    if outside.size:
        index = int(outside[0])
        raise ValueError(f"arrays[{index}] ({int(sizes_np[index])} elements at offset "
                         f"{int(offsets_np[index])}) does not fit in the bucket of "
                         f"{length} elements")
    return offsets_np.tolist(), sizes_np.tolist()


def _check_arrays(arrays: Sequence[Any], bucket: Any, gpu: bool, device: Optional[int],
                  what: str) -> Tuple[Optional[str], np.ndarray]:
    """Every array's checks: ``(dtype name or None for no array, sizes as int64)``."""
    contiguous = _cupy_contiguous if gpu else _contiguous
    array_dtype = first_type = first_dtype = None
    sizes = []
    for index, array in enumerate(arrays):
        # fast path: the same type and dtype as the arrays checked in full before
        if type(array) is first_type and array.dtype == first_dtype and contiguous(array) \
                and (not gpu or array.data.device_id == device):
            sizes.append(array.size)
            continue
        if _is_cupy(array) != gpu:
            raise TypeError(f"arrays[{index}] is a {type(array).__module__}.{type(array).__name__} "
                            f"but the bucket is a {type(bucket).__module__}.{type(bucket).__name__}; "
                            f"{what} needs one array library")
        name = _dtype_name(array.dtype)
        if array_dtype is None:
            array_dtype = name
        elif name != array_dtype:
            raise TypeError(f"arrays[{index}] has dtype {name} but arrays[0] has {array_dtype}; "
                            f"one {what} call takes arrays of one dtype")
        if not array.flags.c_contiguous:
            raise ValueError(f"arrays[{index}] must be C-contiguous (shape {array.shape}, strides "
                             f"{array.strides})")
        if gpu and array.data.device_id != device:
            raise ValueError(f"arrays[{index}] is on device {array.data.device_id}, the bucket "
                             f"on device {device}")
        sizes.append(int(array.size))
        first_type, first_dtype = type(array), array.dtype
    return array_dtype, np.asarray(sizes, dtype=np.int64)


def _compute_dtype(a: str, b: str) -> np.dtype:
    return np.dtype(np.float64 if "float64" in (a, b) else np.float32)


def _check_flag(found_inf: Any, bucket: Any) -> None:
    if found_inf is None:
        return
    if _is_cupy(found_inf) != _is_cupy(bucket):
        raise TypeError("found_inf must be the same kind of array as the bucket (NumPy or CuPy)")
    if _dtype_name(found_inf.dtype) != "int32" or found_inf.size < 1:
        raise TypeError(f"found_inf must be an int32 array of at least one element, got dtype "
                        f"{found_inf.dtype} and size {found_inf.size}")
    if _is_cupy(bucket) and found_inf.device.id != bucket.device.id:
        raise ValueError(f"found_inf is on device {found_inf.device.id}, the bucket on device "
                         f"{bucket.device.id}")


# ---------------------------------------------------------------------------- public API
def pack(arrays: Sequence[Any], bucket: Any, *, offsets: Optional[Sequence[int]] = None,
         scale: float = 1.0) -> Any:
    """Copy ``arrays`` (one dtype, any shapes) into the flat ``bucket``, casting and scaling.

    Args:
        arrays: C-contiguous arrays (all NumPy, or all CuPy on the bucket's device).
        bucket: 1-D array; its dtype is the wire dtype (same as the arrays, or bfloat16 /
            float16 for float32 arrays).
        offsets: element offset of each array in the bucket (default: back to back from 0).
        scale: multiplier applied in float32 (float64 for float64 data) before the cast.

    Returns:
        ``bucket``. On the GPU the copy is enqueued on the current stream.

    Raises:
        TypeError: mixed array libraries or dtypes, or an unsupported dtype pair.
        ValueError: a non-contiguous array, or an array that does not fit in the bucket.
    """
    array_dtype, offsets, sizes, pointers = _validate(arrays, bucket, offsets, "pack")
    if not sizes:
        return bucket
    if _is_cupy(bucket):
        _launch("bucket_pack", pointers, bucket, offsets, sizes, array_dtype, scale, None)
        return bucket
    compute = _compute_dtype(array_dtype, _dtype_name(bucket.dtype))
    same = bucket.dtype == arrays[0].dtype
    with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN follow IEEE, as on the GPU
        _pack_numpy(arrays, bucket, offsets, sizes, scale, compute, same)
    return bucket


def _pack_numpy(arrays, bucket, offsets, sizes, scale, compute, same) -> None:
    for array, offset, size in zip(arrays, offsets, sizes):
        if size == 0:
            continue
        src, dst = array.reshape(-1), bucket[offset:offset + size]
        if scale == 1.0:
            dst[...] = src  # one rounding (nearest even), same as x * 1 then the cast
        elif same and compute == bucket.dtype:
            np.multiply(src, compute.type(scale), out=dst)
        else:
            np.multiply(src, compute.type(scale), out=dst, dtype=compute, casting="unsafe")


def unpack(bucket: Any, arrays: Sequence[Any], *, offsets: Optional[Sequence[int]] = None,
           scale: float = 1.0, loss_scale: Optional[float] = None,
           found_inf: Optional[Any] = None) -> Sequence[Any]:
    """Copy the flat ``bucket`` back into ``arrays``, scaling, unscaling and casting back.

    Args:
        bucket: 1-D array written by :func:`pack` (and usually all-reduced since).
        arrays: destination arrays (one dtype); written in place.
        offsets: element offset of each array in the bucket (default: back to back from 0).
        scale: multiplier, e.g. ``1 / world_size`` to average a sum.
        loss_scale: when given, values are also divided by it (mixed-precision unscaling).
        found_inf: int32 array (same library as the bucket); element 0 is set to 1 when any
            value written is inf or NaN, and left alone otherwise (zero it before the step).

    Returns:
        ``arrays``. On the GPU the copy is enqueued on the current stream.

    Raises:
        TypeError, ValueError: as for :func:`pack`; a found_inf that is not an int32 array.
    """
    array_dtype, offsets, sizes, pointers = _validate(arrays, bucket, offsets, "unpack")
    _check_flag(found_inf, bucket)
    if loss_scale is not None:
        if not loss_scale or not np.isfinite(loss_scale):
            raise ValueError(f"loss_scale must be finite and nonzero, got {loss_scale!r}")
        scale = scale / float(loss_scale)
    if not sizes:
        return arrays
    if _is_cupy(bucket):
        _launch("bucket_unpack", pointers, bucket, offsets, sizes, array_dtype, scale,
                found_inf)
        return arrays
    compute = _compute_dtype(array_dtype, _dtype_name(bucket.dtype))
    with np.errstate(over="ignore", invalid="ignore"):
        bad = _unpack_numpy(bucket, arrays, offsets, sizes, scale, compute, found_inf is not None)
    if bad:
        found_inf.reshape(-1)[0] = 1
    return arrays


def _unpack_numpy(bucket, arrays, offsets, sizes, scale, compute, check) -> bool:
    bad = False
    for array, offset, size in zip(arrays, offsets, sizes):
        if size == 0:
            continue
        src, dst = bucket[offset:offset + size], array.reshape(-1)
        if scale == 1.0:
            dst[...] = src
        elif bucket.dtype == array.dtype == compute:
            np.multiply(src, compute.type(scale), out=dst)
        else:
            np.multiply(src, compute.type(scale), out=dst, dtype=compute, casting="unsafe")
        if check and not bad:
            bad = not bool(np.isfinite(dst).all())
    return bad


# ---------------------------------------------------------------------------- GPU path
def kernel_source(name: str) -> str:
    """Source of ``kernels/<name>.cu`` with ``common.cuh`` inlined (for NVRTC)."""
    for directory in _SOURCE_DIRS:
        path = os.path.join(directory, name + ".cu")
        if os.path.exists(path):
            break
    else:
        raise FileNotFoundError(f"kernel source {name}.cu not found in {list(_SOURCE_DIRS)}")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    with open(os.path.join(directory, "common.cuh"), encoding="utf-8") as handle:
        common = handle.read()
    return text.replace('#include "common.cuh"', common)


def _template_name(name: str, array_dtype: str, bucket_dtype: str, check: bool) -> str:
    if name == "bucket_pack":
        return f"gpucoll_{name}<{_C_TYPES[array_dtype]}, {_C_TYPES[bucket_dtype]}>"
    flag = "true" if check else "false"
    return f"gpucoll_{name}<{_C_TYPES[bucket_dtype]}, {_C_TYPES[array_dtype]}, {flag}>"


def compile_request(name: str, array_dtype: str, bucket_dtype: str,
                    check: bool = False) -> Tuple[str, Tuple[str, ...], str]:
    """What the loader hands ``cupy.RawModule`` for one kernel and dtype pair: ``(source,
    options, name expression)``; ``check``: the unpack variant that flags non-finite values.
    CuPy appends its own options (``-ftz=true`` among them) after these; the kernels keep
    subnormals regardless (see ``kernels/common.cuh``)."""
    _check_pair(array_dtype, bucket_dtype)
    return (kernel_source(name), NVRTC_OPTIONS,
            _template_name(name, array_dtype, bucket_dtype, check))


@functools.lru_cache(maxsize=None)
def _kernel(device_id: int, name: str, array_dtype: str, bucket_dtype: str, check: bool = False):
    """Compiled kernel for one device, dtype pair and variant (memoized: compiled once)."""
    cupy = cuda_env.cupy_module()
    source, options, expression = compile_request(name, array_dtype, bucket_dtype, check)
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=source, options=options, name_expressions=[expression])
        return module.get_function(expression)


def _launch(name: str, pointers: List[int], bucket: Any, offsets: List[int], sizes: List[int],
            array_dtype: str, scale: float, found_inf: Any) -> None:
    cupy = cuda_env.cupy_module()
    bucket_dtype = _dtype_name(bucket.dtype)
    check = found_inf is not None
    device = bucket.data.device_id
    kernel = _kernel(device, name, array_dtype, bucket_dtype, check)
    with bucket.device:  # every allocation and launch below on the bucket's GPU
        stream = cupy.cuda.get_current_stream().ptr
        capturing = stream != 0 and cupy.cuda.runtime.streamIsCapturing(stream)
        for n_arrays, grid, table, content in _planned(pointers, offsets, sizes):
            on_gpu = _graph_table(cupy, device, table, content) if capturing else \
                _device_table(cupy, device, stream, table, content)
            args = [on_gpu, np.int32(n_arrays),
                    np.int64(TILE_ELEMS), bucket, np.float64(scale)]
            if name == "bucket_unpack":  # the flag; null for the variant that never reads it
                args.append(found_inf if check else np.uint64(0))
            kernel((grid,), (THREADS_PER_BLOCK,), tuple(args))
