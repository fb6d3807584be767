"""The parameter server: owns a shard of the parameters, applies workers' gradients.

Workers never wait on each other through the server's receive order: the server keeps one
``irecv`` of a fixed-size header posted for every worker it is not holding back, services
whichever completes first (``Work.is_completed()``), and reads the gradient that follows the
header from that worker. Synchronous mode (``staleness=0``) averages one push from every
active worker, updates, and answers them all; asynchronous mode applies each push at once
(scaled by 1 / workers, so a round of pushes moves the weights as far as one synchronous step)
and answers a worker only while it is at most ``staleness`` steps ahead of the slowest active
worker. A worker that dies or falls silent for longer than the communicator's timeout fails its
posted receive; the server then aborts its communicator (so every other rank fails fast too)
and raises ``PeerError`` naming that worker's rank.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import kernels
from ..ddp.optim import SGD, make_optimizer
from ..errors import CommAbortedError, PeerError
from ..hostarrays import array_module as _array_module
from .layout import DONE, PULL, PUSH, TAG_GRAD, TAG_HEADER, TAG_INIT, TAG_PARAMS, PSLayout

__all__ = ["ParameterServer"]

CULPRIT_WAIT = 1.0  # seconds to wait for the failure that aborted the communicator to be recorded


class ParameterServer:
    """One server rank of a parameter-server group (ranks ``0 .. num_servers - 1``).

    Args:
        comm: servers and workers together.
        params: the initial parameters (only this server's shard is kept; workers start from
            the server's values, whatever they passed).
        num_servers: how many ranks serve (the shards are split among them).
        staleness: 0 for synchronous training; S > 0 lets a worker run up to S steps ahead
            of the slowest one (asynchronous, bounded staleness).
        optimizer: "sgd" or "adam" (or an object), applied to this shard on the server.
        **optimizer_kwargs: the optimizer's settings (``lr``, ``momentum``...).

    Example (three ranks: one server, two workers)::

        if comm.rank < 1:
            stats = ParameterServer(comm, params, num_servers=1, lr=0.05).serve()
        else:
            worker = PSWorker(comm, params, num_servers=1)
            for batch in batches:
                worker.push_pull(grads_of(params, batch))   # params updated in place
            worker.close()
    """

    def __init__(self, comm, params: Sequence[Any], *, num_servers: int = 1, staleness: int = 0,
                 optimizer: Any = "sgd", **optimizer_kwargs):
        self.layout = PSLayout(comm, params, num_servers, staleness)
        if comm.rank not in self.layout.servers:
            raise ValueError(f"rank {comm.rank} is a worker (servers are ranks "
                             f"{self.layout.servers}); use PSWorker there")
        self.comm = comm
        self.optimizer: SGD = make_optimizer(optimizer, **optimizer_kwargs)
        self.xp = _array_module(params[0])
        flat = self.xp.zeros(self.layout.total, dtype=self.layout.dtype)
        kernels.pack(list(params), flat, offsets=self.layout.offsets)
        mine = self.layout.shard(comm.rank)
        self.param = flat[mine].copy()
        self.version = 0                      # updates applied
        self.stats: Dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers
    def _culprit(self, worker: Optional[int], what: str, exc: BaseException):
        """When ``exc`` only says the communicator was aborted, the worker whose own failure
        aborted it (its pending receive or send holds that error; it is recorded just after
        the abort, so wait for it briefly): (worker, what, exc)."""
        if not isinstance(exc, CommAbortedError):
            return worker, what, exc
        deadline = time.monotonic() + CULPRIT_WAIT
        while True:
            for other, work in list(self._pending.items()) + list(self._sends.items()):
                if other != worker and work.is_completed():
                    error = work.exception()
                    if error is not None and not isinstance(error, CommAbortedError):
                        return other, "died or stopped answering", error
            if time.monotonic() >= deadline:
                return worker, what, exc
            time.sleep(0.01)

    def _fail(self, worker: int, what: str, exc: BaseException) -> None:
        worker, what, exc = self._culprit(worker, what, exc)
        message = (f"parameter server rank {self.comm.rank}: worker rank {worker} {what} "
                   f"(after {self._pushes[worker]} pushes): {exc}")
        try:
            self.comm.abort()   # the other workers' receives from this server fail at once
        except Exception:
            pass
        raise PeerError(message, rank=self.comm.rank, peer=worker) from exc

    def _post(self, worker: int) -> None:
        self._pending[worker] = self.comm.irecv(self._headers[worker], worker, tag=TAG_HEADER)

    def _reply(self, worker: int) -> None:
        """Send the current shard to ``worker`` from its own snapshot buffer."""
        previous = self._sends.get(worker)
        if previous is not None:
            previous.wait()
        snapshot = self._snapshots[worker]
        snapshot[...] = self.param
        self._sent_version[worker] = self.version
        self._sends[worker] = self.comm.isend(snapshot, worker, tag=TAG_PARAMS)
        self.bytes_sent += snapshot.nbytes
        self._post(worker)

    def _next_completed(self) -> int:
        """Rank of a worker whose posted header has arrived (polls; no arrival order)."""
        pause = 20e-6
        while True:
            # start after the worker serviced last, so a fast worker cannot starve the others
            order = sorted(self._pending, key=lambda w: (w <= self._last_serviced, w))
            for worker in order:
                work = self._pending[worker]
                if work.is_completed():
                    self._last_serviced = worker
                    del self._pending[worker]
                    error = work.exception()
                    if error is not None:
                        self._fail(worker, "died or stopped answering", error)
                    return worker
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    # ------------------------------------------------------------------ the loop
    def serve(self) -> Dict[str, Any]:
        """Serve until every worker has closed; return statistics.

        Returns:
            dict with ``updates`` (versions applied), ``pushes`` (per worker rank),
            ``max_staleness`` / ``mean_staleness`` (versions between a worker's pull and
            the application of its gradient), ``max_lead`` (most steps an answered worker was
            ahead of the slowest active one; never above ``staleness``), ``arrivals`` (the
            worker rank of each push, in service order), ``bytes_received``, ``bytes_sent``, ``seconds``.

        Raises:
            PeerError: a worker died, timed out or broke the protocol (its rank is named).
        """
        layout, comm, xp = self.layout, self.comm, self.xp
        workers, size = layout.workers, self.param.size
        # headers are host arrays whatever the parameters are: read at once, no device sync
        self._headers = {w: np.zeros(2, dtype=np.int64) for w in workers}
        self._snapshots = {w: xp.empty(size, dtype=layout.dtype) for w in workers}
        self._pending: Dict[int, Any] = {}
        self._last_serviced = -1
        self._sends: Dict[int, Any] = {}
        self._sent_version: Dict[int, int] = {}
        self._pushes = {w: 0 for w in workers}
        self._arrivals: List[int] = []       # worker rank of each push, in service order
        self._max_lead = 0                   # most steps a released worker was ahead
        self.bytes_sent = self.bytes_received = 0
        grad = xp.empty(size, dtype=layout.dtype)
        total = xp.zeros(size, dtype=layout.dtype)
        active = set(workers)
        held: List[int] = []                  # pushed, waiting for their answer
        staleness_seen: List[int] = []
        start = time.perf_counter()
        for worker in workers:                # everyone starts from the server's values
            self._snapshots[worker][...] = self.param
            self._sent_version[worker] = 0
            self._sends[worker] = comm.isend(self._snapshots[worker], worker, tag=TAG_INIT)
            self.bytes_sent += self.param.nbytes
            self._post(worker)
        scale = 1.0 / len(workers)
        try:
            while active or self._pending:
                worker = self._next_completed()
                header = self._headers[worker]
                kind, step = int(header[0]), int(header[1])
                self.bytes_received += header.nbytes
                if kind == DONE:
                    active.discard(worker)
                elif kind == PULL:
                    self._reply(worker)
                elif kind == PUSH:
                    if step != self._pushes[worker]:
                        self._fail(worker, "broke the protocol",
                                   ValueError(f"pushed step {step}, expected {self._pushes[worker]}"))
                    try:
                        comm.recv(grad, worker, tag=TAG_GRAD)
                    except Exception as exc:
                        self._fail(worker, "died while sending its gradient", exc)
                    self.bytes_received += grad.nbytes
                    self._pushes[worker] += 1
                    self._arrivals.append(worker)
                    staleness_seen.append(self.version - self._sent_version[worker])
                    if layout.staleness == 0:
                        total += grad
                    else:
                        grad *= scale
                        self._update(grad)
                    held.append(worker)
                else:
                    self._fail(worker, "broke the protocol", ValueError(f"unknown message {kind}"))
                held = self._release(held, active, total, scale)
            for work in self._sends.values():
                work.wait()
        except CommAbortedError as exc:  # an isend or the abort itself, outside _fail
            culprit, what, error = self._culprit(None, "", exc)
            if culprit is None:
                raise
            self._fail(culprit, what, error)
        self.stats = {
            "updates": self.version, "pushes": dict(self._pushes),
            "max_staleness": max(staleness_seen, default=0),
            "mean_staleness": float(np.mean(staleness_seen)) if staleness_seen else 0.0,
            "max_lead": self._max_lead, "arrivals": list(self._arrivals),
            "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent,
            "seconds": time.perf_counter() - start}
        return self.stats

    def _update(self, grad: Any) -> None:
        self.optimizer.update(0, self.param, grad)
        self.version += 1

    def _release(self, held: List[int], active: set, total: Any, scale: float) -> List[int]:
        """Answer the held workers that may go on; return those still held."""
        if not held:
            return held
        if self.layout.staleness == 0:
            # synchronous: one push from every active worker, then one averaged update
            if not active.issubset(held):
                return held
            total *= scale if len(held) == len(self.layout.workers) else 1.0 / len(held)
            self._update(total)
            total[...] = 0
            for worker in held:
                self._reply(worker)
            return []
        slowest = min((self._pushes[w] for w in active), default=None)
        still = []
        for worker in held:
            lead = 0 if slowest is None else self._pushes[worker] - slowest
            if lead <= self.layout.staleness:
                self._max_lead = max(self._max_lead, lead)
                self._reply(worker)
            else:
                still.append(worker)
        return still

    def state_bytes(self) -> int:
        """Bytes of optimizer state this server holds (its shard only)."""
        return self.optimizer.state_bytes()
