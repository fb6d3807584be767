"""A parameter-server worker: push gradients to every server, pull the parameters back."""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from .. import kernels
from ..hostarrays import array_module as _array_module
from .layout import DONE, PULL, PUSH, TAG_GRAD, TAG_HEADER, TAG_INIT, TAG_PARAMS, PSLayout

__all__ = ["PSWorker"]


class PSWorker:
    """One worker rank (ranks ``num_servers ..``) of a parameter-server group.

    The constructor receives the servers' initial parameters into ``params`` (in place).
    Every ``push_pull`` sends this rank's gradients, one shard to each server, and writes the
    parameters the servers answer with into ``params``; how long that answer takes is the
    server's mode (synchronous: after every worker pushed; asynchronous: at once unless this
    worker is ``staleness`` steps ahead of the slowest).

    Args:
        comm, params, num_servers, staleness: as for ``ParameterServer`` (the same on every
            rank; ``staleness`` is only checked here).

    Attributes:
        step: pushes made. bytes_sent, bytes_received: payload bytes moved by this worker.
    """

    def __init__(self, comm, params: Sequence[Any], *, num_servers: int = 1, staleness: int = 0):
        self.layout = PSLayout(comm, params, num_servers, staleness)
        if comm.rank in self.layout.servers:
            raise ValueError(f"rank {comm.rank} is a server (ranks {self.layout.servers}); use "
                             f"ParameterServer there")
        self.comm, self.params = comm, list(params)
        self.xp = _array_module(self.params[0])
        self._flat = self.xp.zeros(self.layout.total, dtype=self.layout.dtype)
        self._header = np.zeros(2, dtype=np.int64)   # host memory, like the server's
        self.step = 0
        self.bytes_sent = self.bytes_received = 0
        self._closed = False
        self._receive(TAG_INIT)

    def _views(self) -> List[Any]:
        return [self._flat[self.layout.shard(s)] for s in self.layout.servers]

    def _receive(self, tag: int) -> None:
        works = [self.comm.irecv(view, server, tag=tag)
                 for server, view in zip(self.layout.servers, self._views())]
        for work in works:
            work.wait()
        self.bytes_received += self._flat.nbytes
        kernels.unpack(self._flat, self.params, offsets=self.layout.offsets)

    def _send_header(self, kind: int) -> List[Any]:
        self._header[:] = (kind, self.step)
        self.bytes_sent += self._header.nbytes * self.layout.num_servers
        return [self.comm.isend(self._header, server, tag=TAG_HEADER)
                for server in self.layout.servers]

    def push_pull(self, grads: Sequence[Any]) -> List[Any]:
        """Push ``grads`` (registration order, the params' shapes), then pull the parameters.

        Returns:
            ``params``, updated in place.

        Raises:
            ValueError: wrong number or shapes of gradients; the worker was closed.
            PeerError / CommTimeoutError: a server died or did not answer in time.
        """
        if self._closed:
            raise ValueError("push_pull() after close()")
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        self.layout.check(grads)
        kernels.pack(list(grads), self._flat, offsets=self.layout.offsets)
        works = self._send_header(PUSH)
        for server, view in zip(self.layout.servers, self._views()):
            works.append(self.comm.isend(view, server, tag=TAG_GRAD))
        for work in works:          # the buffer is reused by the pull below
            work.wait()
        self.bytes_sent += self._flat.nbytes
        self.step += 1
        self._receive(TAG_PARAMS)
        return self.params

    def pull(self) -> List[Any]:
        """The servers' current parameters, without pushing (no staleness wait)."""
        if self._closed:
            raise ValueError("pull() after close()")
        for work in self._send_header(PULL):
            work.wait()
        self._receive(TAG_PARAMS)
        return self.params

    def close(self) -> None:
        """Tell every server this worker is done (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for work in self._send_header(DONE):
            work.wait()
