"""gpucoll: GPU-native collectives for Python.

NCCL through CuPy on GPUs; a NumPy-over-sockets backend with the same API everywhere else.

    import gpucoll as gc
    comm = gc.init()            # under `gpucoll run -n 4 script.py`, torchrun, mpiexec or srun
    comm.all_reduce(x)          # in place, sum

Importing gpucoll never imports CuPy.
"""

from .api import init
from .backends.registry import available_backends, register_backend
from .communicator import Communicator
from .errors import (AuthenticationError, BackendUnavailableError, CollectiveMismatchError,
                     CommAbortedError, CommTimeoutError, GpucollError, PeerError, StoreError,
                     UnsupportedOperationError)
from .types import ReduceOp
from .work import Work

__version__ = "0.1.0"

__all__ = [
    "init", "Communicator", "Work", "ReduceOp", "GpucollError", "CommTimeoutError", "PeerError",
    "CollectiveMismatchError", "CommAbortedError", "BackendUnavailableError",
    "AuthenticationError", "StoreError", "UnsupportedOperationError", "register_backend",
    "available_backends", "__version__",
]
