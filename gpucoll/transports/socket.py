"""Full-mesh socket transport: framed messages between every pair of ranks.

Connection set-up (``SocketTransport.connect``), over the rendezvous store:

1. The caller (``gpucoll.transports.select``) says which links each peer may use, in order
   of preference (``links``: peer -> ``("unix", "tcp")``, ``("tcp",)``...). Each rank opens
   the listeners those links need (a Unix domain socket in the abstract namespace, a TCP
   socket on port 0) and publishes ``addr/<rank>`` = JSON ``{"tcp": [ip, port], "unix": name}``.
2. It waits (with the timeout) until every rank has published; a rank that never joins is
   named in the ``CommTimeoutError``.
3. It connects to every lower rank, trying that peer's links in order (a failed Unix connect
   falls back to TCP), and accepts every higher rank. Every connection runs the HMAC
   handshake of ``gpucoll.auth`` and then says which communicator and rank it is for; a
   stranger (wrong token, garbage, another job) is closed and the rank goes on accepting.

Data path: sockets stay non-blocking; :meth:`exchange` drives every send and receive of one
algorithm step from one ``poll`` loop in the calling thread (no helper threads, no hidden
copies): sends use ``sendmsg([header, payload])``, receives ``recv_into`` the caller's buffer,
or, for reductions, into a per-peer scratch chunk that is folded into the destination as soon
as it is full, while the kernel keeps receiving the rest (pipelining).
"""

from __future__ import annotations

import errno
import json
import select
import socket
import struct
import threading
import time
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import auth
from ..errors import CollectiveMismatchError, CommTimeoutError, GpucollError, PeerError
from ..rendezvous.hosts import wait_for_join
from ..rendezvous.store import Store
from .base import HEADER, HEADER_BYTES, KIND_CLOSE, Frame, Recv, Transport, check_header

__all__ = ["SocketTransport", "SOCKET_LINKS"]

SOCKET_LINKS = ("unix", "tcp")  # the link kinds this transport speaks

_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_POLLOUT = select.POLLOUT | select.POLLHUP | select.POLLERR
_HELLO = struct.Struct("<II")  # rank, len(comm_id)
_CLOSE_FRAME = Frame("close", 0)


UNIX_BUFFER_BYTES = 4 << 20


def _tune(sock: socket.socket, buffer_bytes: int, is_tcp: bool) -> None:
    """TCP_NODELAY, and socket buffers: ``buffer_bytes`` when positive; otherwise the kernel's
    autotuning for TCP (measured faster on loopback than fixed 4 MiB buffers, which turn it
    off) and 4 MiB for Unix sockets (which do not autotune)."""
    if buffer_bytes <= 0:
        buffer_bytes = 0 if is_tcp else UNIX_BUFFER_BYTES
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass
    if is_tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Send:
    __slots__ = ("peer", "sock", "views", "total", "done")

    def __init__(self, peer: int, sock: socket.socket, header: bytes, payload: memoryview):
        self.peer, self.sock = peer, sock
        self.views = [memoryview(header), payload] if len(payload) else [memoryview(header)]
        self.total = HEADER_BYTES + len(payload)
        self.done = 0

    def progress(self) -> bool:
        """Write as much as the socket takes; True when everything is sent."""
        sock, views = self.sock, self.views
        while views:
            try:
                n = sock.sendmsg(views) if len(views) > 1 else sock.send(views[0])
            except (BlockingIOError, InterruptedError):
                return False
            self.done += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        return True


class _Recv:
    __slots__ = ("spec", "sock", "header", "header_got", "got", "nbytes", "scratch", "fill",
                 "chunk")

    def __init__(self, spec: Recv, sock: socket.socket, header_buf: memoryview,
                 scratch: Optional[memoryview]):
        self.spec, self.sock = spec, sock
        self.header, self.header_got = header_buf, 0
        self.got, self.nbytes = 0, len(spec.buf)
        self.scratch = scratch
        self.fill = 0
        self.chunk = 0 if scratch is None else len(scratch)


class SocketTransport(Transport):
    """Framed full-duplex messages over one socket per peer.

    Attributes:
        rank, size: this rank and the number of ranks.
        kinds: peer -> "unix" or "tcp", the link each peer uses.
    """

    def __init__(self, rank: int, size: int, socks: Dict[int, socket.socket],
                 kinds: Dict[int, str], chunk_bytes: int = 256 << 10):
        self.rank, self.size = rank, size
        self.socks = socks
        self.kinds = kinds
        self.chunk_bytes = max(int(chunk_bytes), 64)
        self._header_bufs = {peer: memoryview(bytearray(HEADER_BYTES)) for peer in socks}
        self._scratch: Dict[int, memoryview] = {}
        self._closed = False
        for sock in socks.values():
            sock.setblocking(False)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def connect(cls, store: Store, rank: int, size: int, *, comm_id: str, token: str,
                timeout: float, links: Dict[int, Tuple[str, ...]],
                advertise_host: str = "127.0.0.1", buffer_bytes: int = 0,
                chunk_bytes: int = 256 << 10) -> "SocketTransport":
        """Build the full mesh among ``size`` ranks through ``store`` (see module doc).

        Args:
            store: rendezvous store shared by the ranks (already scoped to this communicator).
            comm_id: identifies the communicator; connections for another one are refused.
            token: shared secret for the handshake.
            timeout: seconds for the whole set-up.
            links: peer -> the link kinds to try, in order ("unix", "tcp").
            advertise_host: address published for TCP peers.

        Raises:
            CommTimeoutError: ranks that did not publish or connect in time are named.
        """
        deadline = time.monotonic() + timeout
        if size == 1:
            return cls(rank, size, {}, {}, chunk_bytes)
        listeners: List[Tuple[str, socket.socket]] = []
        me = {"tcp": None, "unix": None}
        needed = {kind for peer, kinds in links.items() if peer != rank for kind in kinds}
        try:
            if "unix" in needed:
                name = f"\0gpucoll-{uuid.uuid4().hex}"
                unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                unix_listener.bind(name)
                unix_listener.listen(size)
                listeners.append(("unix", unix_listener))
                me["unix"] = name[1:]
            if "tcp" in needed:
                loopback = advertise_host.startswith("127.") or advertise_host == "localhost"
                tcp_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                tcp_listener.bind(("127.0.0.1" if loopback else "0.0.0.0", 0))
                tcp_listener.listen(size)
                listeners.append(("tcp", tcp_listener))
                me["tcp"] = [advertise_host, tcp_listener.getsockname()[1]]
            socks: Dict[int, socket.socket] = {}
            kinds: Dict[int, str] = {}
            accepted: Dict[int, Tuple[socket.socket, str]] = {}
            accept_error: List[BaseException] = []
            expected = set(range(rank + 1, size))
            stop = threading.Event()
            # Accept from the start: strangers knocking early are turned away while we wait.
            acceptor = threading.Thread(
                target=cls._accept_peers,
                args=(listeners, expected, accepted, accept_error, comm_id, token, deadline, stop),
                name=f"gpucoll-accept-{rank}", daemon=True)
            acceptor.start()
            try:
                store.set(f"addr/{rank}", json.dumps(me).encode())
                keys = [f"addr/{r}" for r in range(size)]
                wait_for_join(store, keys, max(deadline - time.monotonic(), 0.001), rank, size)
                peers = {r: json.loads(store.get(f"addr/{r}", 1.0)) for r in range(size) if r != rank}
                for peer in range(rank):
                    sock, kind = cls._connect_peer(peers[peer], links[peer], peer, rank, comm_id,
                                                   token, deadline)
                    socks[peer], kinds[peer] = sock, kind
            except BaseException:
                stop.set()
                for sock in socks.values():
                    sock.close()
                raise
            finally:
                acceptor.join(max(deadline - time.monotonic(), 0) + 1.0)
            if accept_error:
                raise accept_error[0]
            missing = sorted(expected - set(accepted))
            if missing:
                raise CommTimeoutError(
                    f"rank {rank}: rank(s) {missing} did not connect within {timeout:g} s",
                    rank=rank, op="init")
            for peer, (sock, kind) in accepted.items():
                socks[peer], kinds[peer] = sock, kind
            for peer, sock in socks.items():
                _tune(sock, buffer_bytes, kinds[peer] == "tcp")
            return cls(rank, size, socks, kinds, chunk_bytes)
        finally:
            for _, listener in listeners:
                listener.close()

    @staticmethod
    def _connect_peer(info: dict, kinds: Tuple[str, ...], peer: int, rank: int, comm_id: str,
                      token: str, deadline: float) -> Tuple[socket.socket, str]:
        attempts = []
        for kind in kinds:
            if kind == "unix" and info.get("unix"):
                attempts.append(("unix", socket.AF_UNIX, "\0" + info["unix"]))
            elif kind == "tcp" and info.get("tcp"):
                attempts.append(("tcp", socket.AF_INET, tuple(info["tcp"])))
        if not attempts:
            raise GpucollError(
                f"rank {rank}: no usable link to peer {peer} (links {list(kinds)}, peer "
                f"published {info}); peers must agree on GPUCOLL_TRANSPORT")
        last: Optional[BaseException] = None
        for kind, family, address in attempts:
            while True:
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    sock.connect(address)
                    auth.client_handshake(sock, token, auth.KIND_TRANSPORT, deadline,
                                          f"peer {peer}")
                    cid = comm_id.encode()
                    sock.sendall(_HELLO.pack(rank, len(cid)) + cid)
                    if auth.recv_exact(sock, 1, deadline) != auth.ACCEPTED:
                        raise PeerError(f"peer {peer} refused the connection")
                    return sock, kind
                except (ConnectionRefusedError, FileNotFoundError) as exc:
                    sock.close()
                    last = exc
                    if kind == "unix" or time.monotonic() > deadline:
                        break  # fall back to TCP
                    time.sleep(0.01)
                except (OSError, GpucollError) as exc:
                    sock.close()
                    last = exc
                    break
        if isinstance(last, GpucollError):
            raise last
        raise PeerError(f"rank {rank}: cannot connect to peer {peer} at {info}: {last}",
                        rank=rank, peer=peer, op="init")

    @staticmethod
    def _accept_peers(listeners, expected, accepted, errors, comm_id, token, deadline, stop):
        """Accept until every expected peer has connected. Each connection's handshake runs
        in a thread of its own, so a stranger that connects and stays silent delays nobody."""
        lock = threading.Lock()
        finished = []  # set (non-empty) when this returns: late handshakes then close
        wake_reader, wake_writer = socket.socketpair()  # a handshake done wakes the poll

        def handshake(sock, kind, remaining):
            try:
                sock.setblocking(True)
                limit = min(auth.HANDSHAKE_TIMEOUT, max(remaining, 0.1))
                auth.server_handshake(sock, token, auth.KIND_TRANSPORT, limit)
                hello_deadline = time.monotonic() + limit
                peer, cid_len = _HELLO.unpack(auth.recv_exact(sock, _HELLO.size, hello_deadline))
                if cid_len > 4096:
                    raise auth.HandshakeError("comm id too long")
                cid = auth.recv_exact(sock, cid_len, hello_deadline).decode(errors="replace")
                with lock:
                    if finished or cid != comm_id or peer not in expected or peer in accepted:
                        raise auth.HandshakeError(
                            f"unexpected connection (rank {peer}, comm {cid!r})")
                    sock.sendall(auth.ACCEPTED)
                    accepted[peer] = (sock, kind)
            except (auth.HandshakeError, OSError, struct.error):
                sock.close()
                return
            try:
                wake_writer.send(b"!")
            except OSError:  # closed: the accept loop is over
                pass

        try:
            selector_map = {listener.fileno(): (kind, listener) for kind, listener in listeners}
            poller = select.poll()
            for fd in list(selector_map) + [wake_reader.fileno()]:
                poller.register(fd, select.POLLIN)
            while True:
                with lock:
                    if not expected - set(accepted):
                        finished.append(True)
                        return
                remaining = deadline - time.monotonic()
                if remaining <= 0 or stop.is_set():
                    with lock:
                        finished.append(True)
                        for sock, _ in accepted.values():
                            sock.close()
                    return
                for fd, _ in poller.poll(min(remaining, 0.5) * 1000):
                    if fd == wake_reader.fileno():
                        wake_reader.recv(4096)
                        continue
                    kind, listener = selector_map[fd]
                    try:
                        sock, _ = listener.accept()
                    except OSError:
                        continue
                    threading.Thread(target=handshake, args=(sock, kind, remaining),
                                     name="gpucoll-handshake", daemon=True).start()
        except BaseException as exc:  # reported to the connecting thread
            errors.append(exc)
        finally:
            wake_reader.close()
            wake_writer.close()

    # ------------------------------------------------------------------ data path
    def _peer_sock(self, peer: int, frame: Frame) -> socket.socket:
        sock = self.socks.get(peer)
        if sock is None:
            if self._closed:
                raise PeerError(f"rank {self.rank}: transport is closed ({frame.op} #{frame.seq})",
                                rank=self.rank, peer=peer, op=frame.op, seq=frame.seq)
            raise ValueError(f"rank {self.rank}: no connection to peer {peer} (size {self.size})")
        return sock

    def _scratch_for(self, peer: int, itemsize: int) -> memoryview:
        chunk = self.chunk_bytes - self.chunk_bytes % itemsize if itemsize <= self.chunk_bytes else itemsize
        view = self._scratch.get(peer)
        if view is None or len(view) < chunk:
            view = memoryview(np.empty(max(chunk, 1), dtype=np.uint8)).cast("B")
            self._scratch[peer] = view
        return view[:chunk]

    def exchange(self, sends: Sequence[Tuple[int, memoryview]], recvs: Sequence[Recv],
                 frame: Frame, deadline: float) -> None:
        send_states = [_Send(peer, self._peer_sock(peer, frame), frame.pack(len(buf)), buf)
                       for peer, buf in sends]
        recv_states = [_Recv(spec, self._peer_sock(spec.peer, frame), self._header_bufs[spec.peer],
                             self._scratch_for(spec.peer, spec.itemsize) if spec.reduce else None)
                       for spec in recvs]
        try:
            pending_sends = [s for s in send_states if not s.progress()]
            pending_recvs = [r for r in recv_states if not self._progress_recv(r, frame)]
            if not pending_sends and not pending_recvs:
                return
            self._poll_loop(pending_sends, pending_recvs, frame, deadline)
        except OSError as exc:
            self._link_failed(exc, send_states, recv_states, frame)

    def start_send(self, peer: int, buf: memoryview, frame: Frame
                   ) -> Optional[Callable[[float], None]]:
        """Write what the socket takes now (a message that fits its buffer: all of it); the
        rest, if any, is sent by the returned function (see ``Transport.start_send``)."""
        state = _Send(peer, self._peer_sock(peer, frame), frame.pack(len(buf)), buf)
        try:
            if state.progress():
                return None
        except OSError as exc:
            self._link_failed(exc, [state], [], frame)

        def rest(deadline: float) -> None:
            try:
                self._poll_loop([state], [], frame, deadline)
            except OSError as exc:
                self._link_failed(exc, [state], [], frame)

        return rest

    def _link_failed(self, exc: OSError, sends: List[_Send], recvs: List[_Recv],
                     frame: Frame) -> None:
        """Raise what a socket error during ``frame`` means: a lost peer or a closed transport
        is a ``PeerError`` naming them; anything else as it is."""
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
            peer = self._peer_of_error(sends, recvs)
            raise PeerError(
                f"rank {self.rank}: connection to peer {peer} lost during {frame.op} "
                f"#{frame.seq} ({exc.strerror or exc}); peer {peer} likely died or aborted",
                rank=self.rank, peer=peer, op=frame.op, seq=frame.seq) from None
        if exc.errno in (errno.EBADF, errno.ENOTCONN) or self._closed:
            raise PeerError(f"rank {self.rank}: transport closed during {frame.op} #{frame.seq}",
                            rank=self.rank, op=frame.op, seq=frame.seq) from None
        raise exc

    @staticmethod
    def _peer_of_error(sends: List[_Send], recvs: List[_Recv]) -> Optional[int]:
        for state in list(sends) + list(recvs):
            sock = state.sock
            try:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            except OSError:
                err = 1
            if err:
                return state.peer if isinstance(state, _Send) else state.spec.peer
        if sends:
            return sends[0].peer
        return recvs[0].spec.peer if recvs else None

    def _poll_loop(self, sends: List[_Send], recvs: List[_Recv], frame: Frame,
                   deadline: float) -> None:
        poller = select.poll()
        by_fd: Dict[int, List] = {}
        for state in sends:
            by_fd.setdefault(state.sock.fileno(), [None, None])[0] = state
        for state in recvs:
            by_fd.setdefault(state.sock.fileno(), [None, None])[1] = state
        for fd, (s, r) in by_fd.items():
            poller.register(fd, (_POLLOUT if s else 0) | (_POLLIN if r else 0))
        left = len(sends) + len(recvs)
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._raise_timeout(by_fd, frame)
            events = poller.poll(remaining * 1000.0)
            for fd, event in events:
                if event & select.POLLNVAL:  # closed (abort on another thread) since registered
                    raise OSError(errno.EBADF, "socket closed while waiting on it")
                pair = by_fd[fd]
                s, r = pair
                if r is not None and event & _POLLIN:
                    if self._progress_recv(r, frame):
                        pair[1] = None
                        left -= 1
                if s is not None and event & _POLLOUT:
                    if event & (select.POLLHUP | select.POLLERR) and not event & select.POLLOUT:
                        s.sock.send(b"")  # raises the pending socket error
                    if s.progress():
                        pair[0] = None
                        left -= 1
                if pair[0] is None and pair[1] is None:
                    poller.unregister(fd)
                    del by_fd[fd]
                else:
                    poller.modify(fd, (_POLLOUT if pair[0] else 0) | (_POLLIN if pair[1] else 0))

    def _raise_timeout(self, by_fd: Dict[int, List], frame: Frame) -> None:
        waiting = []
        peers = []
        for s, r in by_fd.values():
            if s is not None:
                waiting.append(f"send to peer {s.peer}: {s.done} of {s.total} bytes")
                peers.append(s.peer)
            if r is not None:
                got = r.header_got + r.got
                waiting.append(f"receive from peer {r.spec.peer}: {got} of "
                               f"{HEADER_BYTES + r.nbytes} bytes")
                peers.append(r.spec.peer)
        peer = peers[0] if len(set(peers)) == 1 else None
        raise CommTimeoutError(
            f"rank {self.rank}: {frame.op} #{frame.seq} timed out waiting for peer(s) "
            f"{sorted(set(peers))} ({'; '.join(waiting)})",
            rank=self.rank, peer=peer, op=frame.op, seq=frame.seq)

    def _progress_recv(self, state: _Recv, frame: Frame) -> bool:
        """Read what is available; True when the whole message is in (and reduced)."""
        sock = state.sock
        peer = state.spec.peer
        while state.header_got < HEADER_BYTES:
            try:
                n = sock.recv_into(state.header[state.header_got:])
            except (BlockingIOError, InterruptedError):
                return False
            if n == 0:
                self._eof(peer, frame)
            state.header_got += n
            if state.header_got == HEADER_BYTES:
                header = HEADER.unpack(state.header)
                problem = check_header(header, frame, state.nbytes, self.rank, peer)
                if problem and header[2] == KIND_CLOSE:
                    raise PeerError(problem, rank=self.rank, peer=peer, op=frame.op, seq=frame.seq)
                if problem:
                    raise CollectiveMismatchError(problem, rank=self.rank, peer=peer, op=frame.op,
                                                  seq=frame.seq)
        spec = state.spec
        if spec.reduce is None:
            buf = spec.buf
            while state.got < state.nbytes:
                try:
                    n = sock.recv_into(buf[state.got:])
                except (BlockingIOError, InterruptedError):
                    return False
                if n == 0:
                    self._eof(peer, frame)
                state.got += n
            return True
        scratch, chunk = state.scratch, state.chunk
        while state.got < state.nbytes:
            want = min(chunk, state.nbytes - state.got + state.fill)
            try:
                n = sock.recv_into(scratch[state.fill:want])
            except (BlockingIOError, InterruptedError):
                return False
            if n == 0:
                self._eof(peer, frame)
            state.fill += n
            state.got += n
            if state.fill == want:
                spec.reduce(state.got - state.fill, scratch[:state.fill])
                state.fill = 0
        return True

    def _eof(self, peer: int, frame: Frame) -> None:
        raise PeerError(
            f"rank {self.rank}: peer {peer} closed its connection during {frame.op} #{frame.seq}; "
            f"it exited, crashed or aborted", rank=self.rank, peer=peer, op=frame.op, seq=frame.seq)

    def hung_up(self, peers: Sequence[int]) -> List[int]:
        """The peers among ``peers`` whose connection is closed (they died or aborted).

        Non-blocking; unread data from a live peer is left where it is (MSG_PEEK). Used by
        waits that do not read from the sockets themselves (shared memory).
        """
        gone = []
        for peer in peers:
            sock = self.socks.get(peer)
            if sock is None:
                gone.append(peer)
                continue
            try:
                if not select.select([sock], [], [], 0)[0]:
                    continue
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    gone.append(peer)
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):
                gone.append(peer)
        return gone

    # ------------------------------------------------------------------ shutdown
    def close_handshake(self, deadline: float) -> Tuple[List[str], List[int]]:
        """Tell every peer we are closing and read their close frames.

        Returns:
            Descriptions of unread data found (a peer sent something nobody received, e.g.
            after ranks disagreed on a broadcast root), and the peers whose connection stayed
            open but silent until ``deadline`` (a peer that already went away is not a
            problem here; a silent one may be cut off, or late).
        """
        problems: List[str] = []
        silent: List[int] = []
        header = _CLOSE_FRAME.pack(0, KIND_CLOSE)
        for peer, sock in list(self.socks.items()):
            try:
                _Send(peer, sock, header, memoryview(b"")).progress()
            except OSError:
                pass
        for peer, sock in list(self.socks.items()):
            buf = bytearray(HEADER_BYTES)
            got = 0
            try:
                while got < HEADER_BYTES:
                    # past the deadline, still take what has already arrived
                    remaining = max(deadline - time.monotonic(), 0.0)
                    if not select.select([sock], [], [], remaining)[0]:
                        silent.append(peer)
                        break
                    n = sock.recv_into(memoryview(buf)[got:])
                    if n == 0:
                        break
                    got += n
            except OSError:
                continue
            if got == HEADER_BYTES:
                op, _, kind, tag, seq, nbytes = HEADER.unpack(buf)
                if kind != KIND_CLOSE:
                    from .base import OP_NAMES
                    problems.append(f"peer {peer} sent {OP_NAMES.get(op, op)} #{seq} "
                                    f"({nbytes} bytes) that rank {self.rank} never received")
        return problems, silent

    def close(self) -> None:
        """Shut down and close every socket (idempotent; wakes threads blocked on them)."""
        self._closed = True
        socks, self.socks = self.socks, {}
        for sock in socks.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for sock in socks.values():
            sock.close()
