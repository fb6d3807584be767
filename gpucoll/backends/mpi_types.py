"""What the MPI backend needs from mpi4py besides the communicator: whether it can run here,
how gpucoll's dtypes and ops map onto MPI's, and whether the MPI library is CUDA-aware.

Reductions use MPI's own datatypes and ops where MPI defines the pair (every integer,
float32/64, complex64/128; bool with MPI's logical ops, gpucoll's bool rules: sum and max
are "or", prod and min "and", bxor "xor"). float16 and bfloat16, which MPI does not
reduce, use a user-defined commutative op over a contiguous type of the element size,
combining with NumPy as the CPU backend does. AVG is MPI's SUM followed by the CPU
backend's division (integers truncate toward zero).

Importing this module does not import mpi4py; :func:`mpi` does (and initialises MPI).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .. import config
from ..types import ReduceOp, combine_fn

__all__ = ["mpi", "mpi_unavailable_reason", "reduction", "native_reduction", "byte_spec",
           "cuda_aware", "library_version"]

_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")

_NATIVE_TYPES = {
    "int8": "INT8_T", "uint8": "UINT8_T", "int16": "INT16_T", "uint16": "UINT16_T",
    "int32": "INT32_T", "uint32": "UINT32_T", "int64": "INT64_T", "uint64": "UINT64_T",
    "float32": "FLOAT", "float64": "DOUBLE", "complex64": "C_FLOAT_COMPLEX",
    "complex128": "C_DOUBLE_COMPLEX", "bool": "C_BOOL",
}
_NATIVE_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVG: "SUM", ReduceOp.PROD: "PROD",
               ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX", ReduceOp.BAND: "BAND",
               ReduceOp.BOR: "BOR", ReduceOp.BXOR: "BXOR"}
_BOOL_OPS = {ReduceOp.SUM: "LOR", ReduceOp.MAX: "LOR", ReduceOp.BOR: "LOR",
             ReduceOp.PROD: "LAND", ReduceOp.MIN: "LAND", ReduceOp.BAND: "LAND",
             ReduceOp.BXOR: "LXOR"}

_USER_OPS: Dict[Tuple[ReduceOp, str], Any] = {}
_ELEMENT_TYPES: Dict[int, Any] = {}
_REDUCTIONS: Dict[Tuple[ReduceOp, Any], Tuple[Any, Any]] = {}


def mpi():
    """The ``mpi4py.MPI`` module (importing it initialises MPI)."""
    from mpi4py import MPI

    return MPI


def mpi_unavailable_reason() -> Optional[str]:
    """Why ``backend="mpi"`` cannot run here (None: it can). Does not initialise MPI."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'gpucoll[mpi]' brings mpi4py and Open MPI)"
    if not any(config.is_set(name) for name in _LAUNCHER_VARIABLES):
        return ("this process was not started by an MPI launcher (mpiexec, mpirun or "
                "srun --mpi): no OMPI_COMM_WORLD_SIZE, PMI_SIZE or SLURM_NTASKS")
    return None


def _element_type(itemsize: int):
    """A committed contiguous MPI type of ``itemsize`` bytes (MPI never splits an element)."""
    found = _ELEMENT_TYPES.get(itemsize)
    if found is None:
        found = _ELEMENT_TYPES[itemsize] = mpi().BYTE.Create_contiguous(itemsize).Commit()
    return found


def _user_op(op: ReduceOp, dtype: np.dtype):
    key = (op, dtype.name)
    found = _USER_OPS.get(key)
    if found is None:
        combine = combine_fn(op, dtype)

        def apply(inbuf, inoutbuf, datatype) -> None:
            combine(np.frombuffer(inoutbuf, dtype), np.frombuffer(inbuf, dtype))

        found = _USER_OPS[key] = mpi().Op.Create(apply, commute=True)
    return found


def reduction(op: ReduceOp, dtype: np.dtype) -> Tuple[Any, Any]:
    """(MPI datatype, MPI op) that reduce ``dtype`` with ``op`` as gpucoll defines it.
    Memoized per (op, dtype): it is on every reduction's path."""
    key = (op, dtype)
    found = _REDUCTIONS.get(key)
    if found is None:
        MPI = mpi()
        name = _NATIVE_TYPES.get(dtype.name)
        if name is None or not hasattr(MPI, name):
            found = (_element_type(dtype.itemsize), _user_op(op, dtype))
        else:
            ops = _BOOL_OPS if dtype.kind == "b" else _NATIVE_OPS
            found = (getattr(MPI, name), getattr(MPI, ops[op]))
        _REDUCTIONS[key] = found
    return found


def native_reduction(op: ReduceOp, dtype: np.dtype) -> Optional[Tuple[Any, Any]]:
    """(MPI datatype, MPI op) when MPI reduces ``dtype`` with ``op`` natively (no user-defined
    op: what ``MPI_Scan`` / ``MPI_Exscan`` are given); None otherwise (float16, bfloat16)."""
    name = _NATIVE_TYPES.get(np.dtype(dtype).name)
    if name is None or op is ReduceOp.AVG or not hasattr(mpi(), name):
        return None
    return reduction(op, np.dtype(dtype))


def byte_spec(array: np.ndarray, datatype=None) -> list:
    """mpi4py buffer spec over ``array``'s bytes: ``[bytes, datatype]`` (MPI.BYTE default)."""
    return [array.reshape(-1).view(np.uint8), mpi().BYTE if datatype is None else datatype]


def library_version() -> str:
    """First line of the MPI library's version string (MPI need not be initialised)."""
    return mpi().Get_library_version().strip().splitlines()[0]


def cuda_aware() -> bool:
    """Whether the MPI library takes CUDA device buffers (Open MPI's MPIX_Query_cuda_support;
    False when the library cannot say)."""
    MPI = mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if callable(query):
        try:
            return bool(query())
        except Exception:
            return False
    try:
        import ctypes

        return bool(ctypes.CDLL(None).MPIX_Query_cuda_support())
    except (AttributeError, OSError):
        return False
