"""Roles and the shard layout shared by parameter servers and their workers.

Ranks ``0 .. num_servers - 1`` are servers, the rest workers. The parameters are flattened
(``kernels.bucket_offsets`` order, arrays back to back on 16-byte boundaries) into one vector
of ``total`` elements, cut into ``num_servers`` contiguous shards whose sizes differ by at most
one element; server ``s`` owns shard ``s``.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from .. import kernels

__all__ = ["PSLayout", "TAG_INIT", "TAG_HEADER", "TAG_GRAD", "TAG_PARAMS", "PUSH", "PULL", "DONE"]

# point-to-point tags (a receive checks the sender used the same one)
TAG_INIT, TAG_HEADER, TAG_GRAD, TAG_PARAMS = 0x5001, 0x5002, 0x5003, 0x5004
# header kinds: int64[2] = (kind, step)
PUSH, PULL, DONE = 1, 2, 3


class PSLayout:
    """Who serves what: validated server count, flat offsets and shard bounds.

    Args:
        comm: the communicator of servers and workers together.
        params: the model's arrays (float32 or float64, one dtype).
        num_servers: server ranks (1 <= num_servers < comm.size).
        staleness: steps a worker may run ahead of the slowest (0 = synchronous).

    Raises:
        ValueError: a communicator of GPU memory (NCCL: pass its ``host_group()``), more
            servers than ranks allow, fewer elements than servers, a negative staleness (the
            numbers are named). TypeError: unsupported or mixed dtypes.
    """

    def __init__(self, comm, params: Sequence[Any], num_servers: int, staleness: int):
        memory = getattr(comm, "memory", "host")
        if memory != "host":
            # a server takes whichever worker's message comes first; on NCCL a receive posted
            # early holds back every later operation of the rank until its message arrives
            raise ValueError(
                f"parameter servers need a communicator whose receives complete in any order; "
                f"backend {comm.backend!r} ({memory} memory) runs each rank's operations in "
                f"issue order. Pass comm.host_group() instead (CuPy arrays are then staged "
                f"through host memory)")
        size = comm.size
        if isinstance(num_servers, bool) or int(num_servers) != num_servers or num_servers < 1:
            raise ValueError(f"num_servers must be an int >= 1, got {num_servers!r}")
        if num_servers >= size:
            raise ValueError(f"num_servers={num_servers} leaves no worker among {size} ranks: "
                             f"a parameter server group needs num_servers < {size}")
        if isinstance(staleness, bool) or int(staleness) != staleness or staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
        if not params:
            raise ValueError("params is empty")
        dtypes = {np.dtype(p.dtype).name for p in params}
        if len(dtypes) != 1 or not dtypes <= {"float32", "float64"}:
            raise TypeError(f"parameter servers need parameters of one dtype, float32 or "
                            f"float64; got {sorted(dtypes)}")
        self.num_servers, self.staleness = int(num_servers), int(staleness)
        self.servers = list(range(self.num_servers))
        self.workers = list(range(self.num_servers, size))
        self.dtype = np.dtype(params[0].dtype)
        self.shapes = [tuple(p.shape) for p in params]
        self.offsets, self.total = kernels.bucket_offsets([int(p.size) for p in params],
                                                          self.dtype.itemsize)
        if self.total < self.num_servers:
            raise ValueError(f"{self.total} parameter elements cannot be sharded across "
                             f"{self.num_servers} servers")
        base, extra = divmod(self.total, self.num_servers)
        self.bounds: List[int] = [0]
        for server in self.servers:
            self.bounds.append(self.bounds[-1] + base + (1 if server < extra else 0))

    def shard(self, server: int) -> slice:
        """Flat elements server ``server`` owns."""
        return slice(self.bounds[server], self.bounds[server + 1])

    def shard_size(self, server: int) -> int:
        return self.bounds[server + 1] - self.bounds[server]

    def check(self, params: Sequence[Any]) -> None:
        """Raise ValueError when ``params`` do not have the layout's shapes."""
        shapes = [tuple(p.shape) for p in params]
        if shapes != self.shapes:
            raise ValueError(f"params have shapes {shapes}, the layout has {self.shapes}")
