"""The flight recorder: every communicator remembers its recent operations, for debugging hangs.

Each public operation of a :class:`gpucoll.Communicator` leaves one record in a ring buffer of
the last ``GPUCOLL_TRACE_BUFFER`` operations (0: nothing is recorded or allocated): its call
number on this communicator (1, 2, ...), op, bytes, dtype and shape of its main array, root or
peer, tag, when it was issued and finished, and its state: ``"done"``, ``"pending"``,
``"failed: <ErrorType>: <message>"`` or ``"captured"`` (a GPU call recorded into a CUDA graph,
run by the graph's launches). ``comm.trace()`` reads it; with ``GPUCOLL_TRACE_DIR`` set,
a rank writes it as JSON when its communicator is aborted (every timeout, dead peer and
mismatch aborts it) and again when the operation that failed returns its error. Comparing the
ranks' traces shows which rank is behind, and at which call.

- A composite operation (``broadcast_object``, ``all_gather_v``, ``all_to_all_v``, ``scan``...)
  is recorded under the name the caller used, followed by the collectives (or sends and
  receives) it is built on: a hang inside one shows both the call and the step.
- A usage error (``ValueError``, ``TypeError``, ``UnsupportedOperationError``) raised before
  anything was issued is not an operation: its record is withdrawn and its number reused.
- An asynchronous operation keeps its ``Work``'s probe (``Work._trace_probe()``: the Work's
  ``is_completed()`` and ``exception()`` without its result, so a record never keeps the
  caller's arrays alive); its state is read when the trace is read (never blocking), and the
  first read that sees it finished sets its finish time. No thread, no callback.
- A blocking call is done or failed when it returns or raises. On a GPU backend, where a call
  returns once it is enqueued on the stream, the backend leaves ``comm._enqueued`` (with a
  Work's ``is_completed()`` / ``exception()``; None otherwise) during the call, which the
  record takes and clears; the record stays pending until the GPU has finished it: a
  collective stuck on the GPU shows as pending.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import re
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from .errors import GpucollError, UnsupportedOperationError
from .work import Work

__all__ = ["Recorder", "NOT_STARTED", "CAPTURED", "recorder_of", "record_failure", "RECORD_WORK",
           "RECORD_PENDING", "traced", "read", "dump"]

# a record is a list (the cheapest thing to build on every call); its fields:
_NUMBER, _OP, _ARGS, _ISSUED, _FINISHED, _STATE, _WORK = range(7)
_PENDING, _DONE = "pending", "done"
# for a backend that leaves a record itself, as the NCCL backend's one-pass calls do
RECORD_WORK, RECORD_PENDING = _WORK, _PENDING
# what a GPU backend leaves in ``comm._enqueued`` for a call captured into a CUDA graph: its
# record says "captured" (the graph's launches run it; ``launch_graph`` records each launch)
CAPTURED = object()
_CAPTURED = "captured"
_USAGE_ERRORS = (TypeError, ValueError, UnsupportedOperationError)
_MESSAGE_CHARS = 200  # of an error message, in a failed record's state
_DUMPS_PER_COMMUNICATOR = 2  # the abort, then the failed operation's error
_unnamed_communicators = itertools.count(1)
_now = time.time
NOT_STARTED = object()  # a communicator's recorder before its first operation


class Recorder:
    """One communicator's records: a bounded deque, oldest first. The hot path takes no lock:
    ``next()`` on the counter and ``deque.append`` are atomic."""

    __slots__ = ("records", "numbers", "lock")

    def __init__(self, capacity: int):
        self.records: collections.deque = collections.deque(maxlen=capacity)
        self.numbers = itertools.count(1)
        self.lock = threading.Lock()  # withdrawals among themselves

    def withdraw(self, record: list, exc: BaseException) -> None:
        """Forget a call that raised a usage error and give its number back, unless other
        operations were issued since (it is then a failure among them)."""
        with self.lock:
            if self.records and self.records[-1] is record:
                self.records.remove(record)  # not pop(): another thread may append meanwhile
                self.numbers = itertools.count(record[_NUMBER])
                return
        _fail(record, exc)

    def snapshot(self) -> List[list]:
        """The records now, oldest first."""
        for _ in range(100):
            try:
                return list(self.records)
            except RuntimeError:  # appended to while copied: try again
                continue
        return []


def recorder_of(comm: Any) -> Optional[Recorder]:
    """The communicator's recorder, made at its first operation (None: recording is off)."""
    recorder = comm.__dict__.get("_recorder", NOT_STARTED)
    if recorder is NOT_STARTED:
        from . import config  # not at import: `import gpucoll` reads no settings

        capacity = config.get("GPUCOLL_TRACE_BUFFER")
        if capacity < 0:
            raise ValueError(f"environment variable GPUCOLL_TRACE_BUFFER={capacity}: expected "
                             f"a number of operations, 0 or more (0: record nothing)")
        recorder = comm.__dict__.setdefault("_recorder", Recorder(capacity) if capacity else None)
    return recorder


def _fail(record: list, exc: BaseException) -> None:
    record[_FINISHED] = time.time()
    record[_STATE] = f"failed: {type(exc).__name__}: {_short(exc)}"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    text = text[0] if text else ""
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS - 3] + "..."


def record_failure(comm: Any, recorder: Recorder, record: list, exc: BaseException) -> None:
    """The operation of ``record`` raised ``exc``: a usage error withdraws the record, any other
    error fails it (a gpucoll error also dumps the trace)."""
    if isinstance(exc, _USAGE_ERRORS):
        recorder.withdraw(record, exc)
        return
    _fail(record, exc)
    if isinstance(exc, GpucollError):
        dump(comm, f"{record[_OP]} #{record[_NUMBER]} failed: {type(exc).__name__}: {exc}")


def traced(describe: Callable[..., tuple], *, returns_works: bool = False,
           op: Optional[str] = None):
    """Record every call of a public operation (see the module doc).

    Args:
        describe: takes the method's arguments (without self) and returns
            ``(shape, dtype, root, peer, tag, extra fields or None)``; must not raise.
        returns_works: the method returns a list of Works standing for one operation
            (``batch_isend_irecv``).
        op: the operation's name in the records (default: the method's).
    """
    def decorate(method: Callable) -> Callable:
        name = op or method.__name__

        @functools.wraps(method)
        def traced_method(self, *args, **kwargs):
            recorder = self._recorder
            if recorder is NOT_STARTED:
                recorder = recorder_of(self)
            if recorder is None:
                return method(self, *args, **kwargs)
            try:
                fields = describe(*args, **kwargs)
            except Exception:  # arguments it cannot read: the method itself names the error
                fields = _UNKNOWN
            record = [next(recorder.numbers), name, fields, _now(), None, _PENDING, None]
            recorder.records.append(record)
            try:
                result = method(self, *args, **kwargs)
            except BaseException as exc:
                record_failure(self, recorder, record, exc)
                raise
            enqueued = self._enqueued  # read and cleared: no dict pop per call (hot path)
            if enqueued is not None:
                self._enqueued = None
            if isinstance(result, Work):
                record[_WORK] = result._trace_probe()  # not the Work: it holds the arrays
            elif returns_works and result:
                record[_WORK] = result[0]._trace_probe()  # each stands for the whole batch
            elif enqueued is CAPTURED:
                record[_FINISHED] = _now()
                record[_STATE] = _CAPTURED
            elif enqueued is not None:  # a GPU call that returned once enqueued
                record[_WORK] = enqueued
            else:
                record[_FINISHED] = _now()
                record[_STATE] = _DONE
            return result

        return traced_method

    return decorate


# ---------------------------------------------------------------- what each op records
# From the method's own arguments, passed by position or by name: (shape, dtype, root, peer,
# tag, extra fields or None); shape and dtype of the main array, None for objects. Read from the
# arguments as passed (an array is never kept: that would keep its memory alive).
_UNKNOWN = (None, None, None, None, None, None)


def describe_nothing(*args: Any, **kwargs: Any) -> tuple:
    return _UNKNOWN


def describe_array(x: Any = None, *args: Any, **kwargs: Any) -> tuple:
    try:  # an array (hot path: no getattr with a default)
        return x.shape, x.dtype, None, None, None, None
    except AttributeError:
        x = kwargs.get("x") if x is None else x
        return getattr(x, "shape", None), getattr(x, "dtype", None), None, None, None, None


def describe_rooted(x: Any = None, root: Any = 0, *args: Any, **kwargs: Any) -> tuple:
    x = kwargs.get("x", kwargs.get("obj")) if x is None else x
    return getattr(x, "shape", None), getattr(x, "dtype", None), root, None, None, None


def describe_rooted_object(obj: Any = None, root: Any = 0, *args: Any, **kwargs: Any) -> tuple:
    return None, None, root, None, None, None


def describe_scatter(x: Any = None, root: Any = 0, *, out: Any = None, **kwargs: Any) -> tuple:
    array = x if x is not None else out  # x is read on the root only
    return getattr(array, "shape", None), getattr(array, "dtype", None), root, None, None, None


def describe_p2p(x: Any = None, peer: Any = None, *, tag: Any = 0, **kwargs: Any) -> tuple:
    """``send(x, dst)`` / ``recv(out, src)`` and their async forms, names or positions."""
    x = kwargs.get("x", kwargs.get("out")) if x is None else x
    peer = kwargs.get("dst", kwargs.get("src")) if peer is None else peer
    return getattr(x, "shape", None), getattr(x, "dtype", None), None, peer, tag, None


def describe_object_p2p(first: Any = None, second: Any = None, *, tag: Any = 0,
                        **kwargs: Any) -> tuple:
    """``send_object(obj, dst)`` / ``recv_object(src)``: the peer and the tag."""
    if "dst" in kwargs or "src" in kwargs:
        peer = kwargs.get("dst", kwargs.get("src"))
    else:
        peer = first if second is None else second
    return None, None, None, peer, tag, None


def describe_sendrecv(x: Any = None, dst: Any = None, out: Any = None, src: Any = None, *,
                      tag: Any = 0, recv_tag: Any = None, **kwargs: Any) -> tuple:
    """The array sent; peer ``[dst, src]``, tag ``[send tag, receive tag]``."""
    return (getattr(x, "shape", None), getattr(x, "dtype", None), None, [dst, src],
            [tag, tag if recv_tag is None else recv_tag], None)


def describe_batch(ops: Any, *args: Any, **kwargs: Any) -> tuple:
    """The number of ops, their total bytes and their peers."""
    try:
        ops = list(ops)
        nbytes = sum(int(getattr(op.array, "nbytes", 0)) for op in ops)
        peers = sorted({op.peer for op in ops})
    except Exception:  # not a list of P2POp: a usage error follows
        return None, None, None, None, None, None
    return None, None, None, peers, None, {"ops": len(ops), "bytes": nbytes}


# ---------------------------------------------------------------- reading
def _resolve(record: list) -> None:
    """An async record's state, from its Work (never blocks)."""
    work = record[_WORK]
    try:
        if not work.is_completed():
            return
        error = work.exception()
    except Exception:  # a backend that cannot tell now: still pending
        return
    record[_FINISHED] = time.time()
    record[_STATE] = _DONE if error is None else \
        f"failed: {type(error).__name__}: {_short(error)}"


def _as_int(value: Any) -> Any:
    if isinstance(value, list):
        return [_as_int(v) for v in value]
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return repr(value)


def _entry(record: list) -> Dict[str, Any]:
    shape, dtype, root, peer, tag, extra = record[_ARGS]
    nbytes = None
    if shape is not None and dtype is not None:
        try:
            shape = [int(d) for d in shape]
            nbytes = int(getattr(dtype, "itemsize"))
            for dim in shape:
                nbytes *= dim
        except (TypeError, ValueError, AttributeError):
            nbytes = None
    finished = record[_FINISHED]
    entry = {"number": record[_NUMBER], "op": record[_OP], "state": record[_STATE],
             "bytes": nbytes, "dtype": None if dtype is None else str(dtype),
             "shape": shape if isinstance(shape, list) else None,
             "root": _as_int(root), "peer": _as_int(peer), "tag": _as_int(tag),
             "issued": record[_ISSUED], "finished": finished,
             "duration_s": None if finished is None else finished - record[_ISSUED]}
    if extra:
        entry.update(extra)
    return entry


def read(comm: Any) -> List[Dict[str, Any]]:
    """``comm.trace()``: the records as dicts, oldest first."""
    recorder = recorder_of(comm)
    if recorder is None:
        return []
    records = recorder.snapshot()
    for record in records:
        if record[_WORK] is not None and record[_FINISHED] is None:
            _resolve(record)
    return [_entry(record) for record in records]


# ---------------------------------------------------------------- dumps
def _file_name(comm: Any) -> str:
    """``trace-rank{world rank}-{communicator id}.json``."""
    name = getattr(comm, "comm_id", None)
    if not isinstance(name, str) or not name:
        name = comm.__dict__.get("_trace_name")
        if name is None:
            name = comm.__dict__.setdefault("_trace_name",
                                            f"comm{next(_unnamed_communicators)}")
    name = re.sub(r"[^A-Za-z0-9_.-]+", ".", name).strip(".") or "comm"
    try:
        world_rank = comm.to_world(comm.rank)
    except Exception:
        world_rank = comm.rank
    return f"trace-rank{world_rank}-{name}.json"


def _write(comm: Any, directory: str, reason: str) -> str:
    """Write ``comm``'s trace as ``directory/trace-rank<R>-<id>.json``; return the path."""
    path = os.path.join(directory, _file_name(comm))
    header = {"rank": comm.to_world(comm.rank), "comm_rank": comm.rank, "size": comm.size,
              "backend": comm.backend, "comm_id": getattr(comm, "comm_id", None),
              "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
              "written": time.time()}
    records = [json.dumps(entry, default=str) for entry in read(comm)]
    # one record per line: readable as it is, and with grep
    text = json.dumps(header, indent=1, default=str)[:-2] + ',\n "trace": [' + \
        (("\n  " + ",\n  ".join(records) + "\n ") if records else "") + "]\n}\n"
    os.makedirs(directory, exist_ok=True)
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(partial, "w", encoding="utf-8") as file:
        file.write(text)
    os.replace(partial, path)
    return path


def dump(comm: Any, reason: str) -> Optional[str]:
    """Write ``comm``'s trace under ``GPUCOLL_TRACE_DIR`` (unset: nothing); return the path.

    Best effort and bounded: never raises, writes at most twice per communicator (its abort,
    then the failed operation's error), each time one small file replaced whole.
    """
    try:
        from . import config

        directory = config.get("GPUCOLL_TRACE_DIR")
        if not directory or comm.__dict__.get("_recorder") is None:
            return None
        with _dump_lock:
            written = comm.__dict__.get("_trace_dumps", 0)
            if written >= _DUMPS_PER_COMMUNICATOR:
                return None
            comm.__dict__["_trace_dumps"] = written + 1
        return _write(comm, directory, reason)
    except Exception:  # a debugging aid must never turn into the failure
        return None


class FlightRecorded:
    """Mixin of :class:`gpucoll.Communicator`: reading and writing its flight recorder."""

    def trace(self) -> List[Dict[str, Any]]:
        """This communicator's last operations (``GPUCOLL_TRACE_BUFFER`` of them), oldest first.

        One dict per public call: ``number`` (1, 2, ... on this communicator), ``op``,
        ``bytes``, ``dtype`` and ``shape`` of its main array (None for objects), ``root``,
        ``peer`` and ``tag`` where it has them, ``issued`` / ``finished`` (``time.time()``),
        ``duration_s`` (None while pending) and ``state``: "done", "pending" or
        "failed: <ErrorType>: <message>". Usage errors are not recorded. Comparing the ranks'
        traces after a hang shows which rank is behind (see :mod:`gpucoll.flight_recorder`).
        """
        return read(self)

    def dump_trace(self, directory: Optional[str] = None) -> str:
        """Write this communicator's trace now, as a failure would (``trace-rank<world
        rank>-<communicator id>.json``, replaced whole), for ``gpucoll trace DIR`` (its
        ``--chrome`` timeline of a healthy run, too). Local: no other rank is involved.

        Args:
            directory: where to write; None: ``GPUCOLL_TRACE_DIR``.

        Returns:
            The file's path.

        Raises:
            ValueError: no ``directory`` and ``GPUCOLL_TRACE_DIR`` is not set.
            OSError: the file could not be written.

        Example::

            comm.dump_trace("traces")    # then: gpucoll trace traces --chrome timeline.json
        """
        if directory is None:
            from . import config

            directory = config.get("GPUCOLL_TRACE_DIR")
            if not directory:
                raise ValueError("dump_trace: pass a directory, or set GPUCOLL_TRACE_DIR")
        return _write(self, os.fspath(directory), "dump_trace()")

    def _trace_dump(self, reason: str) -> None:
        """Write the trace where ``GPUCOLL_TRACE_DIR`` says; a backend's abort path calls it.
        Best effort: never raises."""
        dump(self, reason)


_dump_lock = threading.Lock()
