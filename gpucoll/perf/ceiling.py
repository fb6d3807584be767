"""The raw two-way socket rate of this host: the ceiling a ring's busbw can reach.

Two processes exchange ``nbytes`` in both directions at once over one Unix domain stream socket
and over loopback TCP, with 4 MiB socket buffers and one non-blocking socket polled for both
directions. Each way's rate (best and median of ``reps`` exchanges, after one to warm up) is what
one link of a ring carries on this machine; ``gpucoll bench --ceiling SIZE`` prints it before the
sweep and divides the largest all_reduce's busbw by it. Loopback only (127.0.0.1).
"""

from __future__ import annotations

import os
import queue
import select
import shutil
import socket
import statistics
import tempfile
import time
from typing import Dict, List, Sequence

import numpy as np

SOCKET_BUFFER = 4 << 20
_STEP = 1 << 20


def _exchange_once(sock: socket.socket, outgoing: memoryview, incoming: memoryview,
                   timeout: float) -> float:
    """Send ``outgoing`` while receiving ``incoming`` on one non-blocking socket; seconds taken."""
    total = len(outgoing)
    sock.setblocking(True)
    sock.settimeout(timeout)
    sock.sendall(b"s")  # both sides start together
    if sock.recv(1) != b"s":
        raise RuntimeError("raw exchange lost its sync byte")
    sock.setblocking(False)
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLOUT)
    sent = received = 0
    start = time.perf_counter()
    while sent < total or received < total:
        events = poller.poll(1000)
        if not events and time.perf_counter() - start > timeout:
            raise RuntimeError(f"raw exchange stalled: {sent} of {total} bytes sent, "
                               f"{received} received after {timeout:g} s")
        for _, mask in events:
            if mask & select.POLLOUT and sent < total:
                try:
                    sent += sock.send(outgoing[sent:sent + _STEP])
                except BlockingIOError:
                    pass
                if sent == total:
                    poller.modify(sock, select.POLLIN)
            if mask & (select.POLLIN | select.POLLHUP) and received < total:
                try:
                    got = sock.recv_into(incoming[received:], min(_STEP, total - received))
                except BlockingIOError:
                    continue
                if not got:
                    raise RuntimeError("raw exchange: the peer closed the connection")
                received += got
    return time.perf_counter() - start


def _peer(kind: str, role: int, address, nbytes: int, reps: int, timeout: float, results) -> None:
    """One side: ``reps`` + 1 exchanges of ``nbytes`` each way at once (the first warms up)."""
    try:
        if role == 0:
            listener = address  # a listening socket, handed over by the parent
            listener.settimeout(timeout)
            sock, _ = listener.accept()
            listener.close()
        else:
            sock = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET,
                                 socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(address)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        if kind == "tcp":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        outgoing = memoryview(np.ones(nbytes, np.uint8)).cast("B")
        incoming = memoryview(np.zeros(nbytes, np.uint8)).cast("B")
        times = [_exchange_once(sock, outgoing, incoming, timeout) for _ in range(reps + 1)]
        sock.close()
        results.put((role, times[1:], None))
    except Exception as exc:  # reported to the parent, which says which transport failed
        results.put((role, None, f"{type(exc).__name__}: {exc}"))


def _one_kind(ctx, kind: str, nbytes: int, reps: int, timeout: float) -> Dict[str, object]:
    tmpdir = None
    if kind == "unix":
        tmpdir = tempfile.mkdtemp(prefix="gpucoll-ceiling-")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(tmpdir, "raw.sock"))
    else:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    address = listener.getsockname()
    results = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(kind, role, listener if role == 0 else address,
                                             nbytes, reps, timeout, results), daemon=True)
             for role in (0, 1)]
    try:
        for proc in procs:
            proc.start()
        listener.close()
        per_role: Dict[int, List[float]] = {}
        deadline = time.monotonic() + timeout
        while len(per_role) < 2:
            try:
                role, times, error = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    return {"error": f"raw {kind} exchange died or took over {timeout:g} s"}
                continue
            if error:
                return {"error": f"raw {kind} exchange failed: {error}"}
            per_role[role] = times
        slowest = [max(a, b) for a, b in zip(per_role[0], per_role[1])]
        each_way = [nbytes / t / 1e9 for t in slowest]
        return {"bytes": nbytes, "reps": reps, "gbps_best": max(each_way),
                "gbps_median": statistics.median(each_way), "gbps_all": each_way}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join(5)
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)


def raw_exchange(kinds: Sequence[str], nbytes: int, reps: int = 10,
                 timeout: float = 120.0) -> Dict[str, Dict[str, object]]:
    """``{kind: rates}`` for each of ``kinds`` (``"unix"``, ``"tcp"``).

    Returns:
        Per kind ``bytes``, ``reps``, ``gbps_best``, ``gbps_median`` and ``gbps_all`` (GB/s each
        way, 1e9 bytes per second), or ``error`` saying why it could not be measured.

    Raises:
        ValueError: an unknown kind or a size below 1 byte.
    """
    import multiprocessing

    unknown = [kind for kind in kinds if kind not in ("unix", "tcp")]
    if unknown or nbytes < 1 or reps < 1:
        raise ValueError(f"raw_exchange: kinds must be unix or tcp and nbytes, reps >= 1; got "
                         f"kinds={list(kinds)}, nbytes={nbytes}, reps={reps}")
    ctx = multiprocessing.get_context("spawn")
    return {kind: _one_kind(ctx, kind, nbytes, reps, timeout) for kind in kinds}
