"""torch.distributed's Gloo backend beside gpucoll in the same rank processes (``--compare gloo``).

PyTorch is imported only when a run compares with Gloo; a CPU build is enough.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import numpy as np

from ..types import ReduceOp


class GlooSide:
    """A Gloo process group of the same ranks; its store's port travels through gpucoll."""

    _OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "band": "BAND",
            "bor": "BOR", "bxor": "BXOR"}

    def __init__(self, comm, dev, timeout: float):
        import datetime
        import warnings

        import torch
        import torch.distributed as dist
        from ..api import detect_environment

        warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
        self.torch, self.dist = torch, dist
        self.version = f"torch {torch.__version__}"
        host = detect_environment().master_addr or "127.0.0.1"
        if host == "127.0.0.1" and sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks of one host: loopback
        wait = datetime.timedelta(seconds=timeout)
        store = (dist.TCPStore(host, 0, comm.size, True, timeout=wait, wait_for_workers=False)
                 if comm.rank == 0 else None)
        port = np.array([store.port if store is not None else 0], np.int64)
        if comm.size > 1:  # publish rank 0's port through gpucoll itself
            buf = dev.empty(1, np.int64)
            dev.put(buf, port)
            comm.broadcast(buf, 0)
            port = dev.get(buf)
        if store is None:
            store = dist.TCPStore(host, int(port[0]), comm.size, False, timeout=wait)
        dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size,
                                timeout=wait)

    def op(self, op: Optional[ReduceOp]):
        """Gloo's reduce op for ``op`` (NotImplementedError when Gloo has none)."""
        if op is None:
            return None
        name = self._OPS.get(op.value)
        if name is None:
            raise NotImplementedError(f"Gloo has no {op.value} reduction")
        return getattr(self.dist.ReduceOp, name)

    def tensor(self, array: np.ndarray):
        """A torch view of a host array (TypeError for dtypes torch cannot wrap)."""
        if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: same bits as torch's
            return self.torch.from_numpy(array.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(array)

    def close(self) -> None:
        self.dist.destroy_process_group()
