"""gpucoll: GPU-native collectives for Python.

NCCL through CuPy on GPUs; with the same API, a CPU backend for NumPy arrays (shared memory
between ranks of one host, sockets between hosts) and MPI through mpi4py.

    import gpucoll as gc
    comm = gc.init()            # under `gpucoll run -n 4 script.py`, torchrun, mpiexec or srun
    comm.all_reduce(x)          # in place, sum
    gc.get_rank()               # the default communicator: the one init() made

Importing gpucoll never imports CuPy. ``init`` and ``spawn`` are imported on first use, so that
importing the package does not import ``gpucoll.config`` (``python -m gpucoll.config`` then runs
cleanly).
"""

from .batch_p2p import P2POp
from .communicator import Communicator
from .default_comm import default, destroy, get_rank, get_world_size, is_initialized
from .errors import (AuthenticationError, BackendUnavailableError, CollectiveMismatchError,
                     CommAbortedError, CommTimeoutError, GpucollError, NotInitializedError,
                     PeerError, StoreError, UnsupportedOperationError)
from .mesh import Mesh
from .types import ReduceOp
from .work import Work

__version__ = "0.1.0"

__all__ = [
    "init", "Communicator", "Work", "ReduceOp", "GpucollError", "CommTimeoutError", "PeerError",
    "CollectiveMismatchError", "CommAbortedError", "BackendUnavailableError",
    "AuthenticationError", "StoreError", "NotInitializedError", "UnsupportedOperationError",
    "default", "destroy", "get_rank", "get_world_size", "is_initialized", "register_backend",
    "available_backends", "spawn", "SpawnError", "Mesh", "P2POp", "__version__",
]


def __getattr__(name: str):
    if name == "init":
        from .api import init

        return init
    if name in ("spawn", "SpawnError"):
        from . import spawning

        return getattr(spawning, name)
    if name in ("register_backend", "available_backends"):
        from .backends import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'gpucoll' has no attribute {name!r}")
