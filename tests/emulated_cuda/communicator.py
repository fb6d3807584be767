"""``cupy.cuda.nccl.NcclCommunicator``: rendezvous, collectives, send/recv, split, abort."""

from __future__ import annotations

import collections
import ctypes
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .basics import (_DTYPES, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, _OP_NAMES,
                     REMOTE_ERROR, SYSTEM_ERROR, UNHANDLED_CUDA_ERROR, UNIQUE_ID_BYTES,
                     CUDARuntimeError, NcclError, _index, _size_t)
from .cuda_objects import _StreamState

if TYPE_CHECKING:
    from .emulation import Emulation


#: the first NCCL whose one-rank AVG writes every element (NVIDIA/nccl#1950)
ONE_RANK_AVG_FIXED = 22907


def _one_rank_avg_of_old_nccl(data: np.ndarray) -> np.ndarray:
    """What NCCL before 2.29.7 leaves of a one-rank float AVG: its kernel splits the elements
    over 32 blocks rounding down, so the last ``count % 32`` are never written (a real H100 with
    NCCL 2.28.9 left 3 of 100003). Integer AVG (a sum, then a division) is not affected."""
    if data.dtype.kind in "iu" or data.size < 32 or data.size % 32 == 0:
        return data
    return data[:data.size - data.size % 32]


def _read(ptr: int, nbytes: int, dtype) -> np.ndarray:
    """A copy of ``nbytes`` at ``ptr`` as a flat array of ``dtype``."""
    if nbytes == 0:
        return np.empty(0, dtype=dtype)
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    return np.frombuffer(raw, dtype=np.uint8).copy().view(dtype)


def _write(ptr: int, data: np.ndarray) -> None:
    if data.nbytes:
        data = np.ascontiguousarray(data)
        ctypes.memmove(ptr, data.ctypes.data, data.nbytes)


def _reduce(arrays: List[np.ndarray], op: int, dtype) -> np.ndarray:
    """NCCL's reduction of same-length flat arrays, with NCCL's numerics (not NumPy's):

    - one rank's contribution at a time, rounded to ``dtype`` after every step (float16 and
      bfloat16 sums round at each step of the ring; they are computed in float32);
    - float AVG multiplies each input by 1/n, rounded to the dtype, before summing (NCCL's
      ``ncclAvg`` is a pre-multiplied sum); integer AVG sums, then truncates toward zero;
    - MIN and MAX ignore NaN (``fmin`` / ``fmax``) where NumPy would propagate it.
    """
    n = len(arrays)
    half = dtype.itemsize == 2 and dtype.kind not in "iu"  # float16, bfloat16
    compute = np.dtype(np.float32) if half else dtype
    floating = dtype.kind not in "iu"
    combine = {0: np.add, 4: np.add, 1: np.multiply, 2: np.fmax, 3: np.fmin}[op]
    inputs = [np.asarray(a) for a in arrays]
    if op == 4 and floating:
        scale = np.asarray(1.0 / n).astype(dtype).astype(compute)
        inputs = [(a.astype(compute) * scale).astype(dtype) for a in inputs]
    result = inputs[0].astype(dtype)
    for other in inputs[1:]:
        with np.errstate(over="ignore", invalid="ignore"):
            result = combine(result.astype(compute), other.astype(compute),
                             dtype=compute).astype(dtype)
    if op == 4 and not floating:
        if dtype.kind == "u":
            result = result // n
        else:
            result = np.where(result < 0, -((-result) // n), result // n)
    return np.asarray(result).astype(dtype)


class _Round:
    """One collective (or split) of a clique: what each rank passed, then the outcome."""

    def __init__(self):
        self.parts: Dict[int, Tuple[str, dict]] = {}
        self.done = False
        self.results: Dict[int, Any] = {}
        self.error: Optional[NcclError] = None
        self.finished = 0


class _Message:
    def __init__(self, ptr: int, nbytes: int, src: int, dst: int):
        self.ptr, self.nbytes, self.src, self.dst = ptr, nbytes, src, dst
        self.consumed = False
        self.error: Optional[str] = None


class _Clique:
    """Every rank of one NCCL communicator."""

    def __init__(self, uid: bytes, size: int):
        self.uid, self.size = uid, size
        self.members: Dict[int, Any] = {}
        self.devices: Dict[int, int] = {}
        self.rounds: Dict[Any, _Round] = {}
        self.channels: Dict[Tuple[int, int], collections.deque] = \
            collections.defaultdict(collections.deque)
        self.aborted: Optional[str] = None
        self.refused: Optional[str] = None  # why ncclCommInitRank failed for every rank
        # lazy point-to-point connections: the sides asked for, ("send" | "recv", src, dst),
        # and the links (src, dst) whose both sides were asked for
        self.sides: set = set()
        self.links: set = set()


# ---------------------------------------------------------------------- NCCL communicator
class NcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator`` (CuPy 14 signatures)."""

    _emu: "Emulation"

    def __init__(self, ndev: int, commId: bytes, rank: int):
        emu = self._emu
        if not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(commId).__name__})")
        ndev, rank = _index(ndev, "ndev"), _index(rank, "rank")
        emu.calls["NcclCommunicator"] += 1
        if len(commId) != UNIQUE_ID_BYTES:
            raise NcclError(INVALID_ARGUMENT, f"unique id of {len(commId)} bytes, expected "
                                              f"{UNIQUE_ID_BYTES}")
        if ndev < 1 or not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT, f"rank {rank} is out of range for ndev={ndev}")
        device = emu.current_device()
        with emu.cond:
            if commId not in emu._issued_ids:
                raise NcclError(INVALID_ARGUMENT, f"rank {rank}: the unique id was not made by "
                                                  f"get_unique_id() (mangled on its way?)")
            clique = emu._cliques.get(commId)
            if clique is None:
                clique = emu._cliques[commId] = _Clique(commId, ndev)
            if clique.size != ndev:
                raise NcclError(INVALID_ARGUMENT, f"rank {rank} passed ndev={ndev}, but another "
                                                  f"rank passed ndev={clique.size} with this id")
            if rank in clique.members:
                raise NcclError(INVALID_ARGUMENT, f"rank {rank} joined this unique id twice")
            shared_ok = (emu.nccl_version >= 23000
                         and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1")
            for other, other_device in clique.devices.items():
                if other_device == device and not shared_ok:
                    # NCCL finds it once every rank has joined, so each of them fails
                    clique.refused = (f"Duplicate GPU detected: rank {rank} and rank {other} "
                                      f"both on CUDA device {device}")
                    emu.cond.notify_all()
                    raise NcclError(INVALID_USAGE, clique.refused)
            self._setup(clique, rank, device)
            emu.cond.notify_all()
            emu.cond.wait_for(lambda: len(clique.members) == ndev or clique.refused, emu.timeout)
            if clique.refused:
                raise NcclError(INVALID_USAGE, clique.refused)
            if len(clique.members) != ndev:
                missing = sorted(set(range(ndev)) - set(clique.members))
                raise NcclError(SYSTEM_ERROR, f"ncclCommInitRank: ranks {missing} did not join "
                                              f"within {emu.timeout:g} s (did every rank pass "
                                              f"the same unique id?)")

    def _setup(self, clique: _Clique, rank: int, device: int) -> None:
        self._clique, self._rank, self._device = clique, rank, device
        self._ncoll = 0
        self._nsplit = 0
        self._status = "ok"  # "aborted", "destroyed"
        self._async_error: Optional[NcclError] = None
        self._queries = 0  # check_async_error() calls in flight (on any thread)
        self._in_call = 0  # calls held inside NCCL by emu.call_hold (on any thread)
        self._tearing_down = False  # abort() under way
        clique.members[rank] = self
        clique.devices[rank] = device

    # -------------------------------------------------------------- checks
    def _usable(self) -> None:
        """The checks every call into NCCL starts with: a call while ``abort()`` frees the
        communicator on another thread would use freed memory (recorded as an error); after it
        CuPy's handle is NULL. With ``emu.call_hold`` set, the call is held here first, inside
        NCCL, as a slow enqueue is."""
        emu = self._emu
        hold = emu.call_hold
        if hold is not None:
            with emu.cond:
                self._in_call += 1
            try:
                hold.wait(30)
            finally:
                with emu.cond:
                    self._in_call -= 1
        if self._tearing_down:
            emu.errors.append(NcclError(INVALID_USAGE, (
                f"rank {self._rank}: a call into NCCL while abort() ran on another thread "
                f"(real NCCL frees the communicator under it)")))
        if self._status != "ok":
            raise NcclError(INVALID_ARGUMENT, f"the communicator was {self._status} (NULL comm)")

    def _dtype(self, datatype: Any):
        datatype = _index(datatype, "datatype")
        if datatype not in _DTYPES:
            raise NcclError(INVALID_ARGUMENT, f"invalid datatype {datatype}")
        return datatype, _DTYPES[datatype]

    def _op(self, op: Any) -> int:
        op = _index(op, "op")
        if op not in _OP_NAMES:
            raise NcclError(INVALID_ARGUMENT, f"invalid reduction op {op}")
        return op

    def _rank_arg(self, value: Any, what: str) -> int:
        value = _index(value, what)
        if not 0 <= value < self._clique.size:
            raise NcclError(INVALID_ARGUMENT, f"{what} {value} is out of range for "
                                              f"{self._clique.size} ranks")
        return value

    def _buffer(self, ptr: Any, nbytes: int, what: str) -> int:
        ptr = _index(ptr, what)
        if nbytes:
            self._emu._check_range(ptr, nbytes, self._device, what, NcclError)
        return ptr

    def _stream(self, stream: Any) -> _StreamState:
        stream = _index(stream, "stream")
        try:
            state = self._emu._state(stream, self._device)
        except CUDARuntimeError as exc:
            raise NcclError(UNHANDLED_CUDA_ERROR, str(exc)) from None
        if state.device != self._device:
            raise NcclError(UNHANDLED_CUDA_ERROR, f"{state.name} belongs to GPU {state.device}, "
                                                  f"the communicator to GPU {self._device}")
        return state

    # -------------------------------------------------------------- collectives
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        op, count = self._op(op), _size_t(count, "count")
        nbytes = count * dtype.itemsize
        self._collective("allReduce", self._stream(stream), datatype=datatype, count=count,
                         op=op, root=-1, send=self._buffer(sendbuf, nbytes, "sendbuff"),
                         recv=self._buffer(recvbuf, nbytes, "recvbuff"))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        op, count = self._op(op), _size_t(count, "count")
        root = self._rank_arg(root, "root")
        nbytes = count * dtype.itemsize
        send = self._buffer(sendbuf, nbytes, "sendbuff")
        recv = self._buffer(recvbuf, nbytes, "recvbuff") if self._rank == root \
            else _index(recvbuf, "recvbuff")
        self._collective("reduce", self._stream(stream), datatype=datatype, count=count, op=op,
                         root=root, send=send, recv=recv)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        count = _size_t(count, "count")
        root = self._rank_arg(root, "root")
        nbytes = count * dtype.itemsize
        send = self._buffer(sendbuff, nbytes, "sendbuff") if self._rank == root \
            else _index(sendbuff, "sendbuff")
        self._collective("broadcast", self._stream(stream), datatype=datatype, count=count,
                         op=-1, root=root, send=send,
                         recv=self._buffer(recvbuff, nbytes, "recvbuff"))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        count = _size_t(count, "count")
        nbytes = count * dtype.itemsize
        self._collective("allGather", self._stream(stream), datatype=datatype, count=count,
                         op=-1, root=-1, send=self._buffer(sendbuf, nbytes, "sendbuff"),
                         recv=self._buffer(recvbuf, nbytes * self._clique.size, "recvbuff"))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream) -> None:
        self._usable()
        datatype, dtype = self._dtype(datatype)
        op, count = self._op(op), _size_t(recvcount, "recvcount")
        nbytes = count * dtype.itemsize
        self._collective("reduceScatter", self._stream(stream), datatype=datatype, count=count,
                         op=op, root=-1,
                         send=self._buffer(sendbuf, nbytes * self._clique.size, "sendbuff"),
                         recv=self._buffer(recvbuf, nbytes, "recvbuff"))

    def _collective(self, name: str, state: _StreamState, **args) -> None:
        emu = self._emu
        if emu._group_depth() > 0:
            raise NcclError(INVALID_USAGE, f"emulation: {name} inside groupStart()/groupEnd() "
                                           f"is not emulated")
        if emu._captured(state, lambda target: self._collective(name, target, **args)):
            return  # a kernel node: each launch issues the collective anew
        number = self._ncoll
        self._ncoll += 1
        emu.calls[name] += 1
        emu.history.append((self, name, dict(args)))
        emu._submit(state, lambda: self._run_collective(number, name, args),
                    on_error=self._set_async_error)

    def _run_collective(self, number: int, name: str, args: dict) -> None:
        emu, clique = self._emu, self._clique
        with emu.cond:
            if self._status != "ok":
                return  # aborted: the kernel exits
            rnd = clique.rounds.setdefault(number, _Round())
            rnd.parts[self._rank] = (name, args)
            if len(rnd.parts) == clique.size:
                try:
                    rnd.results = _compute(number, rnd.parts, clique.size)
                except NcclError as exc:
                    rnd.error = exc
                rnd.done = True
                emu.cond.notify_all()
            emu.cond.wait_for(lambda: rnd.done or clique.aborted is not None
                              or self._status != "ok", emu.timeout)
            if not rnd.done:
                if self._status != "ok":
                    return
                if clique.aborted is not None:
                    raise NcclError(REMOTE_ERROR, f"{name} #{number} on rank {self._rank}: "
                                                  f"{clique.aborted}")
                missing = sorted(set(range(clique.size)) - set(rnd.parts))
                raise NcclError(SYSTEM_ERROR, f"emulated {name} #{number} on rank {self._rank}: "
                                              f"ranks {missing} did not issue it within "
                                              f"{emu.timeout:g} s")
            if rnd.error is not None:
                raise NcclError(rnd.error.status, f"rank {self._rank}: {rnd.error}")
            writes = rnd.results.get(self._rank, [])
            rnd.finished += 1
            if rnd.finished == clique.size:
                del clique.rounds[number]
        if clique.size == 1 and args["op"] == 4 and emu.nccl_version < ONE_RANK_AVG_FIXED:
            writes = [(ptr, _one_rank_avg_of_old_nccl(data)) for ptr, data in writes]
        for ptr, data in writes:
            _write(ptr, data)

    # -------------------------------------------------------------- point to point
    def send(self, sendbuf, count, datatype, peer, stream) -> None:
        self._p2p("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf, count, datatype, peer, stream) -> None:
        self._p2p("recv", recvbuf, count, datatype, peer, stream)

    def _p2p(self, kind: str, buf, count, datatype, peer, stream) -> None:
        emu = self._emu
        try:
            self._usable()
            datatype, dtype = self._dtype(datatype)
            count = _size_t(count, "count")
            peer = self._rank_arg(peer, "peer")
            nbytes = count * dtype.itemsize
            ptr = self._buffer(buf, nbytes, "sendbuff" if kind == "send" else "recvbuff")
            state = self._stream(stream)
        except Exception:
            if emu._group_depth() > 0:
                emu._local.group_failed = True
            raise
        emu.calls[kind] += 1
        emu.history.append((self, kind, {"ptr": ptr, "nbytes": nbytes, "peer": peer,
                                         "datatype": datatype, "count": count}))
        op = (kind, ptr, nbytes, peer)
        if emu._group_depth() > 0:
            emu._local.group.append((self, state, op))
        else:
            self._connect([op])  # at capture too: the host call connects
            run = lambda target: emu._submit(target, lambda: self._run_p2p([op]),  # noqa: E731
                                             on_error=self._set_async_error)
            if not emu._captured(state, run):
                run(state)

    def _connect(self, ops: List[tuple]) -> None:
        """NCCL connects two ranks lazily, one direction at a time, inside the host call of
        their first send or receive that way (the lone call, or ``groupEnd``): the call waits
        until the peer's host call for the other side has been made, whatever else either
        rank has enqueued (NVIDIA/nccl#783). An abort ends the wait with an error."""
        clique, me = self._clique, self._rank
        links = []
        with self._emu.cond:
            for kind, _, _, peer in ops:
                link = (me, peer) if kind == "send" else (peer, me)
                clique.sides.add((kind,) + link)
                if link not in clique.links:
                    links.append(link)
            self._emu.cond.notify_all()
            for src, dst in links:
                both = lambda: {("send", src, dst), ("recv", src, dst)} <= clique.sides  # noqa: E731
                self._wait(both, f"connection {src}->{dst}")
                if not both():  # aborted meanwhile: NCCL's blocked call returns an error
                    raise NcclError(INTERNAL_ERROR, f"rank {me}: aborted while connecting "
                                                    f"{src}->{dst}")
                clique.links.add((src, dst))

    def _run_p2p(self, ops: List[tuple]) -> None:
        emu, clique, me = self._emu, self._clique, self._rank
        with emu.cond:
            if self._status != "ok":
                return
            posted = []
            for kind, ptr, nbytes, peer in ops:
                if kind == "send":
                    message = _Message(ptr, nbytes, me, peer)
                    clique.channels[(me, peer)].append(message)
                    posted.append(message)
            emu.cond.notify_all()
            for kind, ptr, nbytes, peer in ops:
                if kind != "recv":
                    continue
                channel = clique.channels[(peer, me)]
                self._wait(lambda: bool(channel), f"recv from rank {peer}")
                if self._status != "ok":
                    return
                message = channel.popleft()
                if message.nbytes != nbytes:
                    message.error = (f"rank {peer} sent {message.nbytes} bytes, rank {me} "
                                     f"receives {nbytes}")
                    emu.cond.notify_all()
                    raise NcclError(INVALID_USAGE, message.error)
                if nbytes:
                    ctypes.memmove(ptr, message.ptr, nbytes)
                message.consumed = True
                emu.cond.notify_all()
            for message in posted:
                self._wait(lambda: message.consumed or message.error is not None,
                           f"send to rank {message.dst}")
                if self._status != "ok":
                    return
                if message.error is not None:
                    raise NcclError(INVALID_USAGE, message.error)

    def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait (emulation lock held) for ``predicate``, an abort, or the timeout."""
        emu, clique = self._emu, self._clique
        emu.cond.wait_for(lambda: predicate() or clique.aborted is not None
                          or self._status != "ok", emu.timeout)
        if predicate() or self._status != "ok":
            return
        if clique.aborted is not None:
            raise NcclError(REMOTE_ERROR, f"{what} on rank {self._rank}: {clique.aborted}")
        raise NcclError(SYSTEM_ERROR, f"emulated {what} on rank {self._rank}: no match within "
                                      f"{emu.timeout:g} s")

    # -------------------------------------------------------------- split and lifetime
    def commSplit(self, color, key):
        emu, clique = self._emu, self._clique
        self._usable()
        color, key = _index(color, "color"), _index(key, "key")
        if color < -1:
            raise NcclError(INVALID_ARGUMENT, f"color {color} (use >= 0, or -1 for no color)")
        emu.calls["commSplit"] += 1
        number = ("split", self._nsplit)
        self._nsplit += 1
        with emu.cond:
            rnd = clique.rounds.setdefault(number, _Round())
            rnd.parts[self._rank] = ("commSplit", {"color": color, "key": key})
            if len(rnd.parts) == clique.size:
                groups: Dict[int, list] = collections.defaultdict(list)
                for r, (_, part) in rnd.parts.items():
                    if part["color"] != -1:
                        groups[part["color"]].append((part["key"], r))
                for members in groups.values():
                    members.sort()
                    uid = os.urandom(UNIQUE_ID_BYTES)
                    emu._issued_ids.add(uid)
                    new = _Clique(uid, len(members))
                    for new_rank, (_, r) in enumerate(members):
                        rnd.results[r] = (new, new_rank)
                rnd.done = True
                emu.cond.notify_all()
            self._wait(lambda: rnd.done, f"commSplit #{number[1]}")
            if not rnd.done:
                raise NcclError(INVALID_ARGUMENT, "the communicator was aborted during commSplit")
            result = rnd.results.get(self._rank)
            rnd.finished += 1
            if rnd.finished == clique.size:
                del clique.rounds[number]
            if result is None:
                return None
            new_clique, new_rank = result
            comm = type(self).__new__(type(self))
            comm._setup(new_clique, new_rank, self._device)
            return comm

    def _teardown_check(self, name: str) -> None:
        """``ncclCommAbort`` / ``ncclCommDestroy`` free the communicator; CuPy does not lock,
        so a ``check_async_error`` in flight on another thread would read freed memory. The
        emulation records that as an error (the tests' fixture fails on it)."""
        if self._queries and self._status == "ok":
            self._emu.errors.append(NcclError(INVALID_USAGE, (
                f"rank {self._rank}: {name} while check_async_error() ran on another thread "
                f"(real NCCL frees the communicator under it)")))
        if self._in_call and self._status == "ok":
            self._emu.errors.append(NcclError(INVALID_USAGE, (
                f"rank {self._rank}: {name} while another thread was inside a call into NCCL "
                f"(real NCCL frees the communicator under it)")))

    def abort(self) -> None:
        emu = self._emu
        emu.calls["abort"] += 1
        with emu.cond:
            self._teardown_check("abort()")
            self._tearing_down = self._status == "ok"
        try:
            if emu.abort_hold is not None:
                emu.abort_hold.wait(30)
            with emu.cond:
                if self._status != "ok":
                    return
                self._status = "aborted"
                self._clique.aborted = f"rank {self._rank} aborted the communicator"
                emu.cond.notify_all()
        finally:
            self._tearing_down = False

    def destroy(self) -> None:
        emu = self._emu
        emu.calls["destroy"] += 1
        with emu.cond:
            self._teardown_check("destroy()")
            if self._status == "ok":
                self._status = "destroyed"
                emu.cond.notify_all()

    def check_async_error(self) -> None:
        emu = self._emu
        with emu.lock:
            self._queries += 1
        try:
            if emu.query_delay:
                time.sleep(emu.query_delay)
            self._usable()
            error = self._async_error
            if error is not None:
                raise error
        finally:
            with emu.lock:
                self._queries -= 1

    def _set_async_error(self, exc: BaseException) -> None:
        if self._async_error is None:
            self._async_error = exc if isinstance(exc, NcclError) else \
                NcclError(INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")

    def rank_id(self) -> int:
        self._usable()
        return self._rank

    def size(self) -> int:
        self._usable()
        return self._clique.size

    def device_id(self) -> int:
        self._usable()
        return self._device


def _compute(number: int, parts: Dict[int, Tuple[str, dict]], size: int) -> Dict[int, list]:
    """Each rank's writes ``[(ptr, data)]`` for collective #``number`` (all ranks arrived)."""
    signatures = {r: (name, args["count"], args["datatype"], args["op"], args["root"])
                  for r, (name, args) in parts.items()}
    if len(set(signatures.values())) > 1:
        described = "; ".join(f"rank {r}: {s[0]}(count={s[1]}, datatype={s[2]}, op={s[3]}, "
                              f"root={s[4]})" for r, s in sorted(signatures.items()))
        raise NcclError(INVALID_USAGE, f"ranks issued different collectives as #{number}: "
                                       f"{described}")
    name, count, datatype, op, root = signatures[0]
    dtype = _DTYPES[datatype]
    nbytes = count * dtype.itemsize
    args = {r: a for r, (_, a) in parts.items()}
    ranks = range(size)
    if name in ("allReduce", "reduce"):
        result = _reduce([_read(args[r]["send"], nbytes, dtype) for r in ranks], op, dtype)
        targets = ranks if name == "allReduce" else [root]
        return {r: [(args[r]["recv"], result)] for r in targets}
    if name == "broadcast":
        data = _read(args[root]["send"], nbytes, dtype)
        return {r: [(args[r]["recv"], data)] for r in ranks}
    if name == "allGather":
        data = np.concatenate([_read(args[r]["send"], nbytes, dtype) for r in ranks])
        return {r: [(args[r]["recv"], data)] for r in ranks}
    if name == "reduceScatter":
        result = _reduce([_read(args[r]["send"], nbytes * size, dtype) for r in ranks], op,
                         dtype)
        return {r: [(args[r]["recv"], result[r * count:(r + 1) * count])] for r in ranks}
    raise NcclError(INTERNAL_ERROR, f"unknown collective {name}")
