"""The NCCL backend's grouped point-to-point launches, and ``sendrecv`` and
``batch_isend_irecv`` as such launches.

NCCL runs the ``ncclSend`` and ``ncclRecv`` calls between one ``groupStart`` and ``groupEnd``
as one operation, so none of them waits for another: that is how gather, scatter, all_to_all
and the exact all_to_all_v move their blocks, how ``sendrecv`` sends to one rank while it
receives from another, and how ``batch_isend_irecv`` issues a whole list of sends and
receives. Issued separately on one stream, a large ``ncclSend`` waits for its receiver, so
neighbours in a ring that all send first would deadlock on the GPU.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from ..batch_p2p import batch_works

__all__ = ["GroupedPointToPoint"]


class GroupedPointToPoint:
    """Mixin of :class:`~gpucoll.backends.nccl.NCCLCommunicator` (uses its ``nccl_comm``,
    ``_nccl``, ``_cupy``, ``_bytes_type``, ``_empty`` and ``_enqueue``)."""

    _connected_peers: frozenset = frozenset()  # peers connect_peers() has connected
    _connect_buffer: Any = None  # its bytes, alive until the next one (stream-ordered reuse)

    def _connect_peers(self, peers: List[int]) -> None:
        """One group of a one-byte send to and receive from each new peer: its ``groupEnd``
        makes NCCL connect both directions with all of them while they do the same."""
        new = [peer for peer in peers if peer not in self._connected_peers]
        if not new:
            return
        buffer = self._empty((2 * len(new),), dtype="uint8")
        base = buffer.data.ptr
        sends = [(base + i, 1, peer) for i, peer in enumerate(new)]
        recvs = [(base + len(new) + i, 1, peer) for i, peer in enumerate(new)]
        self._enqueue("connect_peers", self._grouped(sends, recvs, []), None, False, None,
                      peer=new[0])
        self._connect_buffer = buffer
        self._connected_peers = self._connected_peers | frozenset(new)

    def _grouped(self, sends: List[Tuple[int, int, int]], recvs: List[Tuple[int, int, int]],
                 copies: List[Tuple[int, int, int]]) -> Callable[[int], None]:
        """A launch of grouped sends/recvs ((ptr, nbytes, peer)) plus local device copies."""
        comm, nccl, kind = self.nccl_comm, self._nccl, self._bytes_type
        runtime = self._cupy.cuda.runtime

        def launch(s: int) -> None:
            for dst, src, nbytes in copies:
                if nbytes:
                    runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToDevice, s)
            if not sends and not recvs:
                return
            nccl.groupStart()
            try:
                for ptr, nbytes, peer in sends:
                    comm.send(ptr, nbytes, kind, peer, s)
                for ptr, nbytes, peer in recvs:
                    comm.recv(ptr, nbytes, kind, peer, s)
            finally:
                nccl.groupEnd()

        return launch

    def _sendrecv(self, x: Any, dst: int, out: Any, src: int, tag: int, async_op: bool,
                  stream: Any = None, recv_tag: Optional[int] = None) -> Any:
        """One group of one ``ncclSend`` of ``x`` and one ``ncclRecv`` into ``out``, enqueued as
        one point-to-point operation: one event, one ``CudaWork`` (the stream contract of
        every NCCL operation). A timeout names ``src``, whose data it waits for."""
        launch = self._grouped([(x.data.ptr, x.nbytes, dst)], [(out.data.ptr, out.nbytes, src)],
                               [])
        return self._enqueue("sendrecv", launch, stream, async_op, out, peer=src)

    def _batch_isend_irecv(self, items: List[Any], stream: Any = None) -> List[Any]:
        """One group of every ``ncclSend`` and ``ncclRecv`` of the batch, enqueued as one
        point-to-point operation: one event, one ``CudaWork`` that the per-operation Works
        share. A timeout names the peer of the first receive (else of the first send)."""
        sends = [(item.array.data.ptr, item.array.nbytes, item.peer)
                 for item in items if item.kind == "send"]
        recvs = [(item.array.data.ptr, item.array.nbytes, item.peer)
                 for item in items if item.kind == "recv"]
        peer = next((item.peer for item in items if item.kind == "recv"), items[0].peer)
        work = self._enqueue("batch_isend_irecv", self._grouped(sends, recvs, []), stream, True,
                             None, peer=peer)
        return batch_works(work, items)
