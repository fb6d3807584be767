"""Backends: each turns the Communicator API into work on some memory over some wire.

The registry (:mod:`.registry`) is the one list of them; :mod:`.builtin` registers ``cpu``
and ``nccl``. A new backend plugs in with one ``register_backend`` call.
"""

from .registry import (BackendSpec, available_backends, backend_names, get_backend,  # noqa: F401
                       register_backend, resolve_backend, unregister_backend)
from . import builtin  # noqa: F401,E402  (registers cpu and nccl)
