"""``gc.spawn``: start the ranks of a job from Python, as ``torch.multiprocessing.spawn`` does.

The calling process serves the rendezvous store (loopback, a fresh auth token) and starts
``nprocs`` processes with the ``spawn`` start method and the variables ``gpucoll run`` sets
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
GPUCOLL_AUTH_TOKEN, GPUCOLL_LAUNCHER_STORE=1, GPUCOLL_LAUNCHER_PID and, for several ranks, the
thread default of :mod:`gpucoll.launch_program`). The processes start from the calling thread,
which returns only after they are reaped, so their parent-death signal
(:mod:`gpucoll.orphan_guard`) fires only when the caller dies: killed outright, it takes its
ranks with it. Each process makes a communicator with ``gc.init`` and calls
``fn(comm, *args)`` inside ``with comm:``; the return values come back in rank order. When a
rank fails, the others are stopped and one :class:`SpawnError` carries the root cause: the
first failure that is not a consequence of another rank's (a ``PeerError`` or
``CommAbortedError`` is), with its traceback text.

``fn`` must be importable by the new processes: a module-level function of a module, or of a
script whose start is guarded by ``if __name__ == "__main__":``. A function typed into a
notebook or an interactive session is not; put it in a module and import it.

Example::

    # train.py
    import gpucoll as gc

    def work(comm, scale):
        x = np.full(4, comm.rank * scale)
        return comm.all_reduce(x).tolist()

    if __name__ == "__main__":
        print(gc.spawn(work, 2, args=(10.0,)))   # [[10.0, ...], [10.0, ...]]
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import secrets
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from .errors import GpucollError
from .launch_program import THREAD_VARIABLES, limits_threads, thread_notice
from .orphan_guard import launcher_variables

__all__ = ["spawn", "SpawnError"]

_CONSEQUENCES = ("PeerError", "CommAbortedError")
_ROOT_CAUSE_WAIT = 3.0  # seconds to wait, after a consequence, for the failure that caused it
_STOP_GRACE = 3.0  # seconds between SIGTERM and SIGKILL for the ranks still running
_ENV_LOCK = threading.Lock()  # os.environ is the children's environment while they start


class SpawnError(GpucollError):
    """A rank of ``gc.spawn`` failed; the others were stopped.

    Attributes:
        rank: the failing rank (the root cause).
        error_type: the name of its exception type, or None when it died without one.
        exit_code: its exit code (negative: killed by that signal), None while unknown.
        traceback_text: its traceback, as the rank printed it ("" when it died without one).
    """

    def __init__(self, message: str, *, rank: int, error_type: Optional[str],
                 exit_code: Optional[int], traceback_text: str):
        super().__init__(message)
        self.rank, self.error_type = rank, error_type
        self.exit_code, self.traceback_text = exit_code, traceback_text


def _rank_main(fn, args, conn, backend, timeout) -> None:
    """The body of each process: init, ``fn(comm, *args)``, report the result or the error."""
    try:
        from .api import init

        comm = init(backend=backend, timeout=timeout)
        with comm:  # an error aborts it and tells the peers why
            result = fn(comm, *args)
        message = ("ok", result)
        try:
            conn.send(message)
        except Exception as exc:  # the result did not pickle
            raise TypeError(f"the return value of {fn.__qualname__} cannot be sent back to the "
                            f"caller: {exc}") from None
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, f"{type(exc).__name__}: {exc}",
                   traceback.format_exc()))
        conn.close()
        os._exit(1)  # no atexit work or lingering threads after a failure
    conn.close()


def _check(fn, nprocs, args, env) -> Dict[str, str]:
    if not callable(fn):
        raise TypeError(f"spawn(): fn must be callable, got {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn(): nprocs must be an int >= 1, got {nprocs!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"spawn(): args must be a tuple, got {type(args).__name__}")
    env = dict(env or {})
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"spawn(): env must map str to str, got {name!r}: {value!r}")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(f"spawn(): {getattr(fn, '__qualname__', fn)!r} is defined in an "
                        f"interactive session or notebook, which new processes cannot import; "
                        f"define it in a module and import it from there")
    for what, value in (("fn", fn), ("args", args)):
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(f"spawn(): {what} cannot be sent to the new processes ({exc}); use "
                            f"a module-level function and picklable arguments") from None
    return env


def _rank_env(rank: int, nprocs: int, port: int, token: str, env: Mapping[str, str],
              threads: bool) -> Dict[str, str]:
    values = {"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
              "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "GPUCOLL_AUTH_TOKEN": token,
              "GPUCOLL_LAUNCHER_STORE": "1", "PYTHONUNBUFFERED": "1", **launcher_variables()}
    if threads:
        values.update({name: "1" for name in THREAD_VARIABLES})
    values.update(env)
    return values


def _start(ctx, fn, args, rank, values, backend, timeout):
    """Start one process with ``values`` in its environment (os.environ is what it inherits)."""
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_rank_main, args=(fn, args, writer, backend, timeout),
                          name=f"gpucoll-rank-{rank}", daemon=False)
    with _ENV_LOCK:
        previous = dict(os.environ)
        os.environ.update(values)
        try:
            process.start()
        finally:
            for name in values:
                if name in previous:
                    os.environ.update({name: previous[name]})
                else:
                    os.environ.pop(name, None)
    writer.close()
    return process, reader


def _stop(processes) -> None:
    """SIGTERM the ranks still running, SIGKILL after the grace, reap them (bounded)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _STOP_GRACE
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.0))
        if process.is_alive():
            process.kill()
            process.join(5.0)


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *,
          backend: Optional[str] = None, timeout: Optional[float] = None,
          env: Optional[Mapping[str, str]] = None) -> List[Any]:
    """Run ``fn(comm, *args)`` in ``nprocs`` new processes, each with its communicator.

    Args:
        fn: a module-level function (see the module doc); its return value must pickle.
        nprocs: ranks to start on this machine.
        args: further arguments of ``fn`` (a tuple; they must pickle).
        backend: passed to ``gc.init`` (default: GPUCOLL_BACKEND, i.e. auto).
        timeout: passed to ``gc.init``: the limit of every blocking call of the ranks.
        env: extra environment variables of every rank (they win over the defaults).

    Returns:
        ``[fn's return value on rank 0, on rank 1, ...]``.

    Raises:
        ValueError, TypeError: bad arguments (before anything starts).
        SpawnError: a rank failed (its traceback is in the message); the others were stopped.

    Example::

        results = gc.spawn(work, 2, args=(10.0,))
    """
    env = _check(fn, nprocs, args, env)
    from .rendezvous import TCPStoreServer

    token = secrets.token_hex(16)
    threads = limits_threads(nprocs, {**os.environ, **env})
    if threads:
        sys.stderr.write(f"gpucoll spawn: {thread_notice(nprocs)}\n")
    ctx = multiprocessing.get_context("spawn")
    server = TCPStoreServer("127.0.0.1", 0, token=token)
    processes, readers = [], []
    try:
        for rank in range(nprocs):
            process, reader = _start(ctx, fn, tuple(args), rank,
                                     _rank_env(rank, nprocs, server.port, token, env, threads),
                                     backend, timeout)
            processes.append(process)
            readers.append(reader)
        return _collect(processes, readers)
    finally:
        _stop(processes)
        for reader in readers:
            reader.close()
        server.close()


def _collect(processes, readers) -> List[Any]:
    """Wait for every rank's report; on a failure, find the root cause and raise it."""
    results: Dict[int, Any] = {}
    failures: Dict[int, tuple] = {}
    order: List[int] = []
    pending = dict(enumerate(readers))
    deadline = None  # set at the first failure: how long to wait for its root cause
    while pending:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or any(failures[r][0] not in _CONSEQUENCES for r in order):
                break
        waitables = list(pending.values()) + [processes[r].sentinel for r in pending]
        ready = wait(waitables, None if deadline is None else max(remaining, 0.0))
        for rank, reader in list(pending.items()):
            if reader not in ready and processes[rank].sentinel not in ready:
                continue
            report = None
            try:
                if reader.poll():
                    report = reader.recv()
            except (EOFError, OSError):
                pass
            if report is None and processes[rank].is_alive():
                continue  # its sentinel is not ready: the report is still coming
            del pending[rank]
            if report is not None and report[0] == "ok":
                results[rank] = report[1]
                continue
            if report is None:
                processes[rank].join(1.0)
                code = processes[rank].exitcode
                failures[rank] = (None, f"exited with code {code} without a result", "")
            else:
                failures[rank] = report[1:]
            order.append(rank)
            if deadline is None:
                deadline = time.monotonic() + _ROOT_CAUSE_WAIT
    if not failures:
        return [results[rank] for rank in range(len(processes))]
    rank = next((r for r in order if failures[r][0] not in _CONSEQUENCES), order[0])
    error_type, summary, text = failures[rank]
    processes[rank].join(1.0)
    others = [r for r in order if r != rank]
    message = f"rank {rank} failed: {summary}"
    if others:
        message += f" (then {'rank' if len(others) == 1 else 'ranks'} " \
                   f"{', '.join(map(str, others))} failed too)"
    if text:
        message += f"\n\nrank {rank}'s traceback:\n{text.rstrip()}"
    raise SpawnError(message, rank=rank, error_type=error_type,
                     exit_code=processes[rank].exitcode, traceback_text=text)
