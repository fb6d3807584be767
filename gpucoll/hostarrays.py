"""Host arrays that are not NumPy arrays: torch CPU tensors and anything else with ``__dlpack__``
in host memory, seen as NumPy arrays without a copy, and results handed back in their type.

The host-memory backends (``cpu``, ``mpi``) and the training helpers use this, so that
``comm.all_reduce(torch.ones(4))`` reduces the tensor's own memory and ``all_gather`` of a
tensor returns a tensor. bfloat16 tensors travel as int16 through DLPack (NumPy has no
bfloat16) and are viewed as ``ml_dtypes.bfloat16``. CuPy arrays and other device arrays are
left alone (the backends stage or take them as they are). :func:`array_module` names the module
(NumPy or CuPy) an array belongs to, for the training helpers.

Example::

    view = host_view(torch.ones(4))     # a NumPy array over the tensor's memory
    view += 1                           # the tensor sees it
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import cuda_env

__all__ = ["host_view", "like_caller", "is_host_dlpack", "array_module"]

_HOST_DEVICES = (1, 3)  # DLPack kDLCPU, kDLCUDAHost (pinned host memory)


def array_module(x: Any):
    """CuPy for a CuPy array, else NumPy: the module the training helpers compute with (CuPy is
    imported only when ``x`` already is one of its arrays)."""
    if type(x).__module__.split(".")[0] == "cupy":
        return cuda_env.cupy_module()
    return np


def is_host_dlpack(x: Any) -> bool:
    """True for a non-NumPy object that exports host memory through DLPack."""
    device = getattr(x, "__dlpack_device__", None)
    if device is None or not hasattr(x, "__dlpack__"):
        return False
    try:
        return int(device()[0]) in _HOST_DEVICES
    except Exception:
        return False


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def host_view(x: Any, name: str = "x") -> Any:
    """``x`` as a NumPy array sharing its memory when it is a host DLPack object; NumPy arrays,
    device arrays and objects with a NumPy dtype are returned unchanged.

    Raises:
        TypeError: an object whose dtype NumPy cannot read and that exports no host DLPack
            buffer (the message names it), or a bfloat16 tensor without ``ml_dtypes``.
    """
    if type(x) is np.ndarray or cuda_env.is_cupy_array(x) or \
            hasattr(x, "__cuda_array_interface__"):
        return x
    if is_host_dlpack(x):
        if _is_torch(x):
            if getattr(x, "requires_grad", False):
                x = x.detach()  # same memory; DLPack refuses tensors that require grad
            if str(x.dtype) == "torch.bfloat16":
                bfloat16 = _bfloat16()
                if bfloat16 is None:
                    raise TypeError(f"{name} is a bfloat16 tensor; NumPy needs the ml_dtypes "
                                    f"package to hold bfloat16 (pip install ml-dtypes)")
                import torch

                return np.from_dlpack(x.view(torch.int16)).view(bfloat16)
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise TypeError(f"{name} ({type(x).__module__}.{type(x).__name__}) cannot be read "
                            f"through DLPack: {exc}") from None
    dtype = getattr(x, "dtype", None)
    if dtype is not None and hasattr(x, "shape"):
        try:
            np.dtype(dtype)
        except TypeError:
            raise TypeError(
                f"{name} is a {type(x).__module__}.{type(x).__name__} with dtype {dtype}, which "
                f"gpucoll cannot read: pass a NumPy array, an object with __dlpack__ in host "
                f"memory (e.g. a torch CPU tensor) or a CuPy array") from None
    return x


def like_caller(result: np.ndarray, like: Any) -> Any:
    """A new NumPy ``result`` in the array type of the caller's ``like``: a torch tensor for a
    torch tensor (bfloat16 included), ``type(like).from_dlpack`` where that exists, else NumPy.
    """
    if not isinstance(result, np.ndarray) or type(like) is np.ndarray or not is_host_dlpack(like):
        return result
    if _is_torch(like):
        torch = sys.modules["torch"]
        if result.dtype.name == "bfloat16":
            return torch.from_dlpack(result.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(result)
    from_dlpack = getattr(type(like), "from_dlpack", None)
    if callable(from_dlpack):
        try:
            return from_dlpack(result)
        except Exception:
            return result
    return result
