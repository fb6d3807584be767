"""Parameter servers over any gpucoll ``Communicator``, point to point only.

* :class:`ParameterServer` - ranks ``0 .. K-1`` each own one shard of the flat parameters and
  run the optimizer on it; synchronous (``staleness=0``: average one push from every worker
  per step) or asynchronous with a staleness bound (a worker runs at most S steps ahead of
  the slowest). Workers are serviced in whatever order they arrive.
* :class:`PSWorker` - the other ranks: ``push_pull(grads)`` sends gradients and receives the
  updated parameters; ``pull()``; ``close()``.
* :class:`PSLayout` - roles and shard bounds (validates the server count).

A server takes whichever worker's message comes first, so the communicator's receives must
complete in any order: on NCCL, whose operations run in issue order, pass ``comm.host_group()``
(CuPy arrays are then staged through host memory); the NCCL communicator itself is refused.

Importing this package never imports CuPy.
"""

from .layout import PSLayout
from .server import ParameterServer
from .worker import PSWorker

__all__ = ["ParameterServer", "PSWorker", "PSLayout"]
