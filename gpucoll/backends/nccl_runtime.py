"""The NCCL backend's runtime bookkeeping: dtype and op tables, communicator creation through
the store, bounded blocking calls, and the progress records that name late ranks.

Nothing here imports CuPy at module import time (``cuda_env.load`` does).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional

from .. import config
from ..cuda_env import load
from ..errors import BackendUnavailableError, CommTimeoutError
from ..types import ReduceOp

__all__ = ["nccl_dtype", "nccl_op", "create_communicator", "run_bounded", "publish_progress",
           "ranks_behind", "REDUCIBLE", "NCCL_DTYPES"]

log = logging.getLogger("gpucoll")

# NumPy dtype name -> attribute of cupy.cuda.nccl
NCCL_DTYPES: Dict[str, str] = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16",
}
# dtypes NCCL can reduce; others move as bytes (broadcast, gathers, send/recv). Complex SUM and
# AVG reduce as their real component type (two floats per element).
REDUCIBLE = frozenset(NCCL_DTYPES)
_NCCL_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.PROD: "NCCL_PROD", ReduceOp.MIN: "NCCL_MIN",
             ReduceOp.MAX: "NCCL_MAX", ReduceOp.AVG: "NCCL_AVG"}


def nccl_dtype(nccl: Any, dtype_name: str) -> int:
    return getattr(nccl, NCCL_DTYPES[dtype_name])


def nccl_op(nccl: Any, op: ReduceOp) -> int:
    try:
        return getattr(nccl, _NCCL_OPS[op])
    except KeyError:
        raise TypeError(f"op {op.value} is not supported by NCCL (sum, prod, min, max, avg); "
                        f"use the cpu backend for bitwise reductions") from None


#: The first NCCL that lets several ranks share a GPU (with NCCL_MULTI_RANK_GPU_ENABLE=1).
MULTI_RANK_GPU_NCCL = 23000


def shared_gpu_reason(local_size: Optional[int], count: int, nccl_code: int) -> Optional[str]:
    """Why NCCL cannot give each of ``local_size`` ranks on a host with ``count`` GPUs a GPU
    of its own or let them share (None: it can), with NCCL version code ``nccl_code``."""
    if local_size is None or local_size <= count:
        return None
    if config.get("NCCL_MULTI_RANK_GPU_ENABLE") and nccl_code >= MULTI_RANK_GPU_NCCL:
        return None
    return (f"{local_size} ranks on this host share {count} GPU(s); NCCL needs one GPU per rank "
            f"(or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1)")


def create_communicator(store, rank: int, size: int, device: int, timeout: float,
                        key: str = "nccl/unique_id") -> Any:
    """A ``cupy.cuda.nccl.NcclCommunicator`` for ``rank`` of ``size`` on GPU ``device``.

    Rank 0 makes the unique id and publishes it under ``key``; every rank then enters a store
    barrier (``CommTimeoutError`` naming how many arrived), so ``ncclCommInitRank``, which
    blocks until every rank has called it, starts only when all of them are there. The call
    itself runs on a helper thread and is bounded by ``timeout`` too.
    """
    _, nccl = load()
    # connect the collectives' peers now, inside this bounded call, not lazily inside a later
    # collective where a missing peer would block the host (the user's value wins). NCCL may
    # still connect a pair at its first send/recv; the watchdog bounds that host call.
    config.set_default("NCCL_RUNTIME_CONNECT", "0")
    if rank == 0:
        store.set(key, bytes(nccl.get_unique_id()))
    store.barrier(f"{key}/barrier", size, timeout)
    unique_id = store.get(key, timeout)
    try:
        return run_bounded(lambda: nccl.NcclCommunicator(size, unique_id, rank), device, timeout,
                           f"rank {rank}: ncclCommInitRank", "init", rank)
    except CommTimeoutError:
        raise
    except Exception as error:
        hint = ""
        if "INVALID_USAGE" in str(error):  # NCCL's answer to two ranks on one GPU, among others
            enabled = "set" if config.get("NCCL_MULTI_RANK_GPU_ENABLE") else "unset"
            hint = (f"; if two ranks share GPU {device}: NCCL allows that from 2.30 with "
                    f"NCCL_MULTI_RANK_GPU_ENABLE=1 (this is NCCL code {nccl.get_version()}, "
                    f"the variable is {enabled})")
        raise BackendUnavailableError(
            f"rank {rank}: ncclCommInitRank failed on GPU {device}: {error}{hint} (run with "
            f"NCCL_DEBUG=INFO for NCCL's own log; `gpucoll doctor` checks the installation)") \
            from error


def run_bounded(fn: Callable[[], Any], device: int, timeout: float, what: str, op: str,
                rank: int) -> Any:
    """``fn()`` on a helper thread with GPU ``device`` current, waited for at most ``timeout``.

    For NCCL calls that block until every rank has made them (communicator creation, split),
    so a rank that dies at the wrong moment cannot hang the others forever. Raises what
    ``fn`` raised, or ``CommTimeoutError`` (the thread is left behind, blocked in NCCL).
    """
    cupy, _ = load()
    result: Dict[str, Any] = {}

    def call() -> None:
        try:
            cupy.cuda.Device(device).use()
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            result["error"] = exc

    thread = threading.Thread(target=call, name=f"gpucoll-{op}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CommTimeoutError(
            f"{what} did not finish within {timeout:g} s (every rank had reached the store "
            f"barrier before it; run with NCCL_DEBUG=INFO to see where NCCL waits)",
            rank=rank, op=op)
    if "error" in result:
        raise result["error"]
    return result["value"]


ABORT_WAIT = 5.0  # seconds a failing call waits for ncclCommAbort before it raises anyway
HOST_CALL_GRACE = 1.0  # seconds an abort waits for a call another thread is making into NCCL


def abort_bounded(nccl_comm: Any, lock: threading.Lock, device: int, rank: int) -> None:
    """``ncclCommAbort`` (under ``lock``, see the NCCL backend's teardown), waited for at most
    :data:`ABORT_WAIT` seconds. Within a node NCCL's abort may wait until the node's other
    ranks abort too (NVIDIA/nccl#863), and the call that failed must still raise its error on
    time: the abort then goes on, on its helper thread. Errors of the abort are dropped (the
    communicator is given up either way)."""
    def abort() -> None:
        with lock:
            nccl_comm.abort()

    try:
        run_bounded(abort, device, ABORT_WAIT, f"rank {rank}: ncclCommAbort", "abort", rank)
    except Exception:
        pass


def publish_progress(store, rank: int, issued: int) -> None:
    """Record in ``store`` that ``rank`` has issued collectives up to sequence number ``issued``."""
    store.set(f"progress/{rank}", str(int(issued)).encode())


def ranks_behind(store, size: int, rank: int, seq: int) -> Optional[List[int]]:
    """The ranks (other than ``rank``) whose published progress is below ``seq``: those that
    had not reached collective #``seq``. None when the store cannot be read."""
    try:
        keys = [f"progress/{r}" for r in range(size) if r != rank]
        missing = set(store.missing(keys))
        behind = []
        for r in range(size):
            key = f"progress/{r}"
            if r == rank:
                continue
            issued = 0 if key in missing else int(store.get(key, 1.0))
            if issued < seq:
                behind.append(r)
        return behind
    except Exception:
        return None
