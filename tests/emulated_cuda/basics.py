"""Constants of CUDA and NCCL, the two error types, and argument conversion as Cython does it."""

from __future__ import annotations

import operator
from typing import Any, Dict, Tuple

import numpy as np

try:
    import ml_dtypes
except ImportError:  # bfloat16 is then not emulated
    ml_dtypes = None

UNIQUE_ID_BYTES = 128
NCCL_VERSION = 23203

# ncclResult_t
SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, \
    REMOTE_ERROR = range(7)
_RESULT_NAMES = {
    0: "NCCL_ERROR_SUCCESS", 1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR",
    3: "NCCL_ERROR_INTERNAL_ERROR", 4: "NCCL_ERROR_INVALID_ARGUMENT",
    5: "NCCL_ERROR_INVALID_USAGE", 6: "NCCL_ERROR_REMOTE_ERROR",
}

# ncclDataType_t and ncclRedOp_t, values from nccl.h
NCCL_CONSTANTS = {
    "NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4,
    "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8,
    "NCCL_BFLOAT16": 9,
    "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4,
}
_DTYPES: Dict[int, Any] = {0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32),
                           3: np.dtype(np.uint32), 4: np.dtype(np.int64), 5: np.dtype(np.uint64),
                           6: np.dtype(np.float16), 7: np.dtype(np.float32),
                           8: np.dtype(np.float64)}
if ml_dtypes is not None:
    _DTYPES[9] = np.dtype(ml_dtypes.bfloat16)
_OP_NAMES = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}

_DLPACK_CUDA = 2
MEMCPY_HOST_TO_HOST, MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_DEVICE_TO_DEVICE, \
    MEMCPY_DEFAULT = range(5)


class NcclError(RuntimeError):
    """Raised as ``cupy.cuda.nccl.NcclError`` is: ``status`` is the ncclResult_t."""

    def __init__(self, status: int, detail: str = ""):
        self.status = status
        super().__init__(f"{_RESULT_NAMES.get(status, status)}: {detail}")

    def __reduce__(self):
        return (type(self), (self.status, str(self)))


CUDA_ERROR_NAMES = {600: "cudaErrorNotReady: device not ready",
                    700: "cudaErrorIllegalAddress: an illegal memory access was encountered",
                    719: "cudaErrorLaunchFailure: unspecified launch failure",
                    900: "cudaErrorStreamCaptureUnsupported: operation not permitted when "
                         "stream is capturing",
                    901: "cudaErrorStreamCaptureInvalidated: operation failed due to a "
                         "previous error during capture",
                    907: "cudaErrorCapturedEvent: operation not permitted on an event last "
                         "recorded in a capturing stream"}


class CUDARuntimeError(RuntimeError):
    """Stands for ``cupy.cuda.runtime.CUDARuntimeError``: built from a status code (its
    message is the CUDA error's name and text, as CuPy's) or from a message."""

    def __init__(self, status_or_message):
        if isinstance(status_or_message, int):
            self.status = status_or_message
            message = CUDA_ERROR_NAMES.get(status_or_message, f"cudaError {status_or_message}")
        else:
            self.status, message = 999, str(status_or_message)
        super().__init__(message)


def _index(value: Any, what: str) -> int:
    """An int argument as Cython converts it (TypeError for None, floats, objects)."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: an integer is required, got {type(value).__name__}") from None


def _size_t(value: Any, what: str) -> int:
    value = _index(value, what)
    if value < 0:
        raise OverflowError(f"{what}: can't convert negative value to size_t")
    return value


def _shape(shape: Any) -> Tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(int(d) for d in shape)


def _cuda_error(status: int, detail: str) -> CUDARuntimeError:
    return CUDARuntimeError(f"cudaErrorInvalidValue: {detail}")
