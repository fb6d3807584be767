"""Multi-process test harness: real processes, real sockets on loopback, hard timeouts.

* ``RankPool(world_size, backend="cpu")`` keeps ``world_size`` rank processes alive, each with one
  communicator, and runs a module-level function ``fn(comm, *args)`` on every rank per call, so
  a sweep of hundreds of cases costs one process start per world size. ``rank_pools(...,
  shared=True)`` goes further: test modules that ask for the same pool share it for the
  whole session.
* ``run_ranks(fn, world_size, ...)`` starts fresh processes for one call; use it for tests
  that break communicators on purpose (dead ranks, timeouts, wrong tokens).

Both kill every rank on the first failure or at the deadline and raise ``RankFailure``
carrying the failing rank's traceback; a rank that hangs in a task dumps its threads' stacks
(faulthandler) to stderr before it is killed. An idle rank waits for its next task for as
long as the test process lives, and ends within a second or so of it.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import secrets
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

_CTX = mp.get_context("spawn")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RankFailure(AssertionError):
    """A rank raised, died or hung; the message carries its traceback."""


def _worker(rank: int, size: int, url: Optional[str], env: Dict[str, str], tasks, results,
            do_init: bool, hang_timeout: float, backend: str = "cpu") -> None:
    os.environ.update(env)
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    faulthandler.dump_traceback_later(hang_timeout, exit=True)
    comm = None
    try:
        if do_init:
            import gpucoll

            comm = gpucoll.init(backend=backend, rank=rank, world_size=size, url=url,
                                timeout=float(env.get("GPUCOLL_TIMEOUT", "30")))
        results.put(("ready", rank, None))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        return
    faulthandler.cancel_dump_traceback_later()
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone: do not outlive it
                break
            continue
        if task is None:
            break
        fn, args = task
        faulthandler.dump_traceback_later(hang_timeout, exit=True)
        try:
            value = fn(comm, *args) if do_init else fn(rank, size, url, *args)
            results.put(("ok", rank, value))
        except BaseException:
            results.put(("error", rank, traceback.format_exc()))
        faulthandler.cancel_dump_traceback_later()  # idle between tasks is no hang
    if comm is not None:
        try:
            comm.close(timeout=10)
        except Exception:
            pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """``world_size`` live rank processes with a communicator each (see module doc)."""

    def __init__(self, world_size: int, env: Optional[Dict[str, str]] = None,
                 timeout: float = 60.0, do_init: bool = True, serve_store: bool = True,
                 backend: str = "cpu"):
        from gpucoll.rendezvous import TCPStoreServer

        self.world_size = world_size
        self.backend = backend
        self.token = secrets.token_hex(8)
        self.server = TCPStoreServer("127.0.0.1", 0, token=self.token) if serve_store else None
        port = self.server.port if self.server else _free_port()
        self.url = f"tcp://127.0.0.1:{port}"
        child_env = {"GPUCOLL_AUTH_TOKEN": self.token, "GPUCOLL_TIMEOUT": "30"}
        if serve_store:
            child_env["GPUCOLL_LAUNCHER_STORE"] = "1"
        child_env.update(env or {})
        self.env = child_env
        self.results = _CTX.Queue()
        self.tasks = [_CTX.Queue() for _ in range(world_size)]
        self.procs = [
            _CTX.Process(target=_worker, daemon=True,
                         args=(r, world_size, self.url, child_env, self.tasks[r], self.results,
                               do_init, timeout, backend))
            for r in range(world_size)]
        for proc in self.procs:
            proc.start()
        self.alive = True
        if do_init:
            self._collect("ready", timeout)

    def _collect(self, kind: str, timeout: float, expect: Optional[List[int]] = None) -> List[Any]:
        expect = list(range(self.world_size)) if expect is None else expect
        values: Dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(values) < len(expect):
            remaining = deadline - time.monotonic()
            try:
                status, rank, value = self.results.get(timeout=max(min(remaining, 1.0), 0.01))
            except queue.Empty:
                dead = [r for r in expect if not self.procs[r].is_alive() and r not in values]
                if dead or remaining <= 0:
                    self.kill()
                    what = (f"rank(s) {dead} died (exit codes "
                            f"{[self.procs[r].exitcode for r in dead]})" if dead else
                            f"ranks {sorted(set(expect) - set(values))} did not answer within "
                            f"{timeout:g} s (stacks were dumped to stderr)")
                    raise RankFailure(what) from None
                continue
            if status != kind and status != "error":
                continue  # e.g. "ready" from ranks that set up nothing
            if status == "error":
                self.kill()
                raise RankFailure(f"rank {rank} failed:\n{value}")
            if rank in expect:  # a rank not waited for may still answer first
                values[rank] = value
        return [values[r] for r in expect]

    def run(self, fn: Callable, *args, timeout: float = 60.0) -> List[Any]:
        """Run ``fn(comm, *args)`` on every rank; return the per-rank results (rank order)."""
        if not self.alive:
            raise RankFailure("the rank pool was killed by an earlier failure")
        for q in self.tasks:
            q.put((fn, args))
        return self._collect("ok", timeout)

    def kill(self) -> None:
        self.alive = False
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        if self.server is not None:
            self.server.close()

    def close(self) -> None:
        if self.alive:
            for q in self.tasks:
                q.put(None)
            for proc in self.procs:
                proc.join(15)
        self.kill()


def run_ranks(fn: Callable, world_size: int, *args, env: Optional[Dict[str, str]] = None,
              timeout: float = 60.0, init: bool = True, serve_store: bool = True,
              ranks: Optional[List[int]] = None, backend: str = "cpu") -> List[Any]:
    """Run ``fn`` once in fresh processes and return per-rank results.

    With ``init=True`` ranks call ``fn(comm, *args)``; with ``init=False`` they call
    ``fn(rank, world_size, url, *args)`` and set up (or fail to set up) gpucoll themselves.
    ``ranks`` lists the ranks expected to answer (default all); others may die on purpose.
    ``backend`` is what ``init=True`` ranks pass to ``gpucoll.init``.
    """
    pool = RankPool(world_size, env=env, timeout=timeout, do_init=False, serve_store=serve_store)
    try:
        if init:
            for q in pool.tasks:
                q.put((_init_then, (backend, fn) + args))
        else:
            for q in pool.tasks:
                q.put((fn, args))
        for q in pool.tasks:
            q.put(None)
        return pool._collect("ok", timeout, expect=ranks)
    finally:
        pool.kill()


def _init_then(rank: int, size: int, url: str, backend: str, fn: Callable, *args) -> Any:
    import gpucoll

    comm = gpucoll.init(backend=backend, rank=rank, world_size=size, url=url)
    try:
        return fn(comm, *args)
    finally:
        try:
            comm.close(timeout=10)
        except Exception:
            pass


def rank_pools(sizes, ids=lambda n: f"{n}ranks", shared: bool = False, **pool_args):
    """A module-scoped ``pool`` fixture: a :class:`RankPool` for each world size in ``sizes``
    (``pool_args`` go to it), closed when the module's tests are done. Use as
    ``pool = rank_pools([2, 3])`` at module level.

    With ``shared=True`` the pool comes from :func:`shared_pool` instead: every module that
    asks for the same world size and ``pool_args`` gets the same live ranks, which stay up
    until the session ends (conftest.py closes them) or until more than
    ``SHARED_RANKS_LIMIT`` ranks would be up, so each costs about one start per session.
    Only for modules whose rank functions leave the communicator as they found it (groups
    closed, nothing aborted)."""
    import pytest

    @pytest.fixture(scope="module", params=list(sizes), ids=ids)
    def pool(request):
        if shared:
            yield shared_pool(request.param, **pool_args)
            return
        ranks = RankPool(request.param, **pool_args)
        yield ranks
        ranks.close()

    return pool


_SHARED: Dict[str, Any] = {}  # least recently used first
SHARED_RANKS_LIMIT = 24  # ranks kept up between modules at most (memory, /dev/shm segments)


def share_for_session(key: str, world_size: int, start: Callable[[], Any],
                      alive: Callable[[Any], bool]) -> Any:
    """The session's object under ``key`` (a rank pool, a cluster: anything with ``close()``
    and ``world_size``): ``start()`` on first use, and again when ``alive(it)`` says a failure
    killed it. The least recently used ones are closed first to keep at most
    ``SHARED_RANKS_LIMIT`` ranks up."""
    found = _SHARED.pop(key, None)
    if found is not None and not alive(found):
        found.close()
        found = None
    if found is None:
        while _SHARED and (sum(item.world_size for item in _SHARED.values()) + world_size
                           > SHARED_RANKS_LIMIT):
            _SHARED.pop(next(iter(_SHARED))).close()
        found = start()
    _SHARED[key] = found
    return found


def close_shared() -> None:
    """Close everything :func:`share_for_session` started (at the end of the session)."""
    while _SHARED:
        _SHARED.popitem()[1].close()


def pool_alive(pool: RankPool) -> bool:
    """Whether every rank of ``pool`` is up and no failure killed it."""
    return pool.alive and all(proc.is_alive() for proc in pool.procs)


def shared_pool(world_size: int, **pool_args) -> RankPool:
    """The session's :class:`RankPool` of ``world_size`` ranks made with ``pool_args``."""
    key = repr(("pool", world_size, sorted(
        (name, sorted(value.items()) if isinstance(value, dict) else value)
        for name, value in pool_args.items())))
    return share_for_session(key, world_size, lambda: RankPool(world_size, **pool_args),
                             pool_alive)


def error_text(call: Callable, kinds=(TypeError, ValueError)) -> str:
    """``"ValueError: message"`` for what ``call()`` raises of ``kinds``, else ``"no error"``:
    a rank's bad-input checks, returned as text so that one rank's expected error does not end
    the run."""
    try:
        call()
    except kinds as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
