"""The backends gpucoll ships, registered in :mod:`gpucoll.backends.registry`.

``cpu``: NumPy arrays over the transports of ``gpucoll.transports`` (CuPy arrays staged
through host memory); always available; ``auto``'s fallback. ``nccl``: GPU arrays through
NCCL (CuPy); ``auto`` prefers it when CuPy, NCCL and a GPU are usable and every rank on this
host can have a GPU of its own (or NCCL >= 2.30 may share one). ``mpi``: host arrays through
mpi4py under an MPI launcher (device arrays directly when MPI is CUDA-aware, else staged);
never picked by ``auto`` (a job started by mpiexec may well want NCCL for its GPUs), so it is
chosen by name: ``backend="mpi"`` or ``GPUCOLL_BACKEND=mpi``.

Each factory reads its own settings from ``gpucoll.config``; ``init()`` passes only the
common ones and the options the backend declares.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .. import config, cuda_env
from .registry import register_backend

__all__ = ["cpu_factory", "nccl_factory", "mpi_factory", "shared_gpu_reason"]


def cpu_factory(store, rank: int, world_size: int, *, transport: Optional[str] = None,
                **common):
    """A ``CPUCommunicator``; socket and algorithm settings from GPUCOLL_* (see config)."""
    from .cpu_settings import cpu_communicator

    return cpu_communicator(store, rank, world_size, transport=transport, **common)


def nccl_factory(store, rank: int, world_size: int, *, device: Optional[int] = None, **common):
    """An ``NCCLCommunicator`` on GPU ``device`` (default GPUCOLL_DEVICE, else the local rank
    modulo the number of GPUs)."""
    from .nccl import NCCLCommunicator

    return NCCLCommunicator(store, rank, world_size,
                            device=config.get("GPUCOLL_DEVICE") if device is None else int(device),
                            watchdog_interval=config.get("GPUCOLL_WATCHDOG_INTERVAL"), **common)


def mpi_factory(store, rank: int, world_size: int, **common):
    """An ``MPICommunicator`` over a duplicate of ``MPI.COMM_WORLD`` (no store);
    GPUCOLL_MPI_BLOCKING picks MPI's blocking collectives under a watchdog."""
    from .mpi import mpi_factory as factory

    return factory(store, rank, world_size, blocking=config.get("GPUCOLL_MPI_BLOCKING"),
                   **common)


def _mpi_unavailable_reason() -> Optional[str]:
    from .mpi_types import mpi_unavailable_reason

    return mpi_unavailable_reason()


def _mpi_details() -> Dict[str, Any]:
    """What ``gpucoll doctor`` says of MPI: mpi4py, the library, whether it is CUDA-aware
    (device arrays handed to MPI directly; staged through host memory otherwise)."""
    import mpi4py

    from .mpi_types import cuda_aware, library_version

    return {"mpi4py": mpi4py.__version__, "library": library_version(),
            "cuda_aware": cuda_aware()}


def shared_gpu_reason(local_size: Optional[int]) -> Optional[str]:
    """Why NCCL cannot give each of ``local_size`` ranks on this host a GPU (None: it can)."""
    from .nccl_runtime import shared_gpu_reason as reason

    return reason(local_size, cuda_env.device_count(), cuda_env.nccl_version_code())


register_backend(
    "cpu", cpu_factory, memory="host", options=("transport",), auto_priority=0,
    description="NumPy arrays over sockets (CuPy arrays staged through host memory); runs anywhere")
register_backend(
    "nccl", nccl_factory, lambda: cuda_env.nccl_unavailable_reason(), memory="cuda",
    options=("device",), auto_priority=10, auto_reason=lambda local: shared_gpu_reason(local),
    auto_precheck=lambda: cuda_env.driver_missing_reason(),
    description="GPU arrays through NCCL (CuPy); one GPU per rank",
    unavailable_hint="use backend='cpu' (CuPy arrays are staged through host memory) or "
                     "backend='auto'")
register_backend(
    "mpi", mpi_factory, _mpi_unavailable_reason, memory="host", auto_priority=None,
    needs_store=False, details=_mpi_details,
    description="host arrays through mpi4py under mpiexec / mpirun / srun --mpi (device arrays "
                "directly when MPI is CUDA-aware, else staged)",
    unavailable_hint="install the mpi extra (pip install 'gpucoll[mpi]') and start the job with "
                     "mpiexec, or use backend='cpu'")
