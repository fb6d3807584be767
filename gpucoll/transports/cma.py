"""Single-copy reads from another process's memory (Linux cross-memory attach).

``process_vm_readv`` copies straight from a peer's array into ours: one copy instead of two
through a shared segment, which is what makes large broadcasts, all-gathers and all-reduces
among ranks of one host as fast as Open MPI's (its ``smsc/cma`` component does the same).
The kernel allows it between processes of the same user unless ptrace is restricted (Yama
``ptrace_scope`` >= 2, some container profiles), so it is probed once per segment and every
local rank must succeed before any collective uses it.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Optional

import numpy as np

__all__ = ["available", "read_into"]


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                     ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    return call


_READV = _load()
_MAX_CALL = 1 << 30  # bytes per call (the kernel may also return less; the loop goes on)


def available() -> Optional[str]:
    """None when this process can call process_vm_readv at all, else why not."""
    return None if _READV is not None else "process_vm_readv is not available (not Linux?)"


def read_into(target: np.ndarray, pid: int, address: int) -> None:
    """Copy ``target.nbytes`` bytes at ``address`` in process ``pid`` into ``target``.

    Raises:
        OSError: the peer is gone (ESRCH), its memory is not readable (EFAULT) or ptrace
            rules forbid it (EPERM).
    """
    total = target.nbytes
    if total == 0:
        return
    base = target.ctypes.data
    local, remote = _IOVec(), _IOVec()
    done = 0
    while done < total:
        size = min(total - done, _MAX_CALL)
        local.iov_base, local.iov_len = base + done, size
        remote.iov_base, remote.iov_len = address + done, size
        got = _READV(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        done += got
