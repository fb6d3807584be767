"""Running the ranks of ``gpucoll bench``: spawn them, or be one of a launcher's.

:func:`run_bench` (``gpucoll bench``) either spawns the ranks itself (multiprocessing, spawn
context) or, when a launcher (``gpucoll run``, torchrun, mpiexec, srun) started this process,
runs as one of them; :func:`measure` (what bench presets call) always spawns them and returns
the reporter holding the rows. SIGTERM stops the spawned ranks as Ctrl-C does.
With ``--transport`` each rank opens one communicator per GPUCOLL_TRANSPORT value, each through
the same rendezvous (every ``gpucoll.init`` call there makes a new communicator).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .devices import _device_for
from .engine import run_rank
from .options import BenchOptions, UsageError
from .report import Reporter, finish, require_matplotlib
from .specs import COLLECTIVES


def open_communicators(opts: BenchOptions, **init_args) -> List[Tuple[Optional[str], Any]]:
    """[(transport, Communicator)]: one per ``opts.transports``, or [(None, the default one)]."""
    import gpucoll

    comms: List[Tuple[Optional[str], Any]] = []
    try:
        for name in (opts.transports or [None]):
            extra = {} if name is None else {"transport": name}
            comm = gpucoll.init(backend=opts.backend, timeout=opts.timeout, **init_args, **extra)
            comms.append((name, comm))
            if name is not None and comm.backend != "cpu":
                raise UsageError(f"--transport applies to the cpu backend, not {comm.backend}")
    except BaseException:
        for _, comm in comms:
            comm.abort()
        raise
    return comms


def _launched_rank(opts: BenchOptions, reporter_factory: Callable[[], Reporter], files) -> int:
    """Under ``gpucoll run`` / torchrun / mpiexec / srun: this process is one rank."""
    from ..api import detect_environment

    env = detect_environment()
    if opts.nranks is not None and opts.nranks != env.world_size:
        raise UsageError(f"-g {opts.nranks} does not match the launcher's world size "
                         f"{env.world_size} ({env.source}); leave -g out under a launcher")
    if opts.ceiling_bytes:
        raise UsageError("--ceiling runs only when gpucoll bench starts the ranks itself "
                         "(not under a launcher)")
    comms = open_communicators(opts)
    try:
        reporter = reporter_factory() if comms[0][1].rank == 0 else None
        run_rank(comms, opts, reporter)
        status = finish(reporter, *files) if reporter is not None else 0
        status = _agree_on_status(comms[0][1], status)
        for _, comm in comms:
            comm.close()
        return status
    except BaseException:
        for _, comm in comms:
            comm.abort()
        raise


def _agree_on_status(comm, status: int) -> int:
    """Rank 0's exit status on every rank (every rank exits with the same code)."""
    codes = np.array([status], np.int64)
    if comm.size > 1:
        dev = _device_for(comm)
        buf = dev.empty(1, np.int64)
        dev.put(buf, codes)
        comm.broadcast(buf, 0)
        codes = dev.get(buf)
    return int(codes[0])


def _spawned_rank(rank: int, nranks: int, url: str, env: Dict[str, str], opts: BenchOptions,
                  events) -> None:
    """Entry point of a rank started by :func:`measure` (multiprocessing, spawn)."""
    import traceback

    os.environ.update(env)
    comms: List[Tuple[Optional[str], Any]] = []
    try:
        from ..backends.registry import get_backend

        if opts.backend not in (None, "auto") and get_backend(opts.backend).memory == "cuda":
            import cupy

            cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        comms = open_communicators(opts, rank=rank, world_size=nranks, url=url)
        run_rank(comms, opts, lambda kind, value: events.put((kind, rank, value)))
        for _, comm in comms:
            comm.close()
        events.put(("done", rank, None))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
        for _, comm in comms:
            comm.abort()
        raise SystemExit(1)


def _spawn_all(opts: BenchOptions, reporter: Reporter) -> None:
    """Start ``opts.nranks`` rank processes; relay rank 0's events to ``reporter``.

    Raises:
        RuntimeError: a rank failed or died (with its traceback); every rank is stopped.
    """
    import multiprocessing
    import secrets

    from ..orphan_guard import launcher_variables
    from ..rendezvous import TCPStoreServer

    nranks = opts.nranks or 1
    token = secrets.token_hex(16)
    server = TCPStoreServer("127.0.0.1", 0, token=token)
    # the ranks stop if this process is killed outright (started from this thread, which
    # waits for them: see gpucoll.orphan_guard)
    env = {"GPUCOLL_AUTH_TOKEN": token, "GPUCOLL_LAUNCHER_STORE": "1", **launcher_variables()}
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    url = f"tcp://127.0.0.1:{server.port}"
    procs = [ctx.Process(target=_spawned_rank, args=(r, nranks, url, env, opts, events),
                         name=f"gpucoll-bench-rank{r}", daemon=True) for r in range(nranks)]
    with _terminate_as_exit():
        _relay(procs, events, reporter, server)


@contextlib.contextmanager
def _terminate_as_exit():
    """SIGTERM raises SystemExit here, so the ranks are stopped as on Ctrl-C (main thread only)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _relay(procs, events, reporter: Reporter, server) -> None:
    """Start the ranks and pass rank 0's events on; stop every rank on the way out."""
    import queue

    nranks = len(procs)
    try:
        for proc in procs:
            proc.start()
        done = set()
        while len(done) < nranks:
            try:
                kind, rank, value = events.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # let a dying rank's error report arrive first
                    if events.empty():
                        raise RuntimeError(f"rank {dead[0]} died (exit code "
                                           f"{procs[dead[0]].exitcode}) without reporting an error")
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value.rstrip()}")
            if kind == "done":
                done.add(rank)
            else:
                reporter(kind, value)
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(5)
        server.close()


def _ceiling_kinds(opts: BenchOptions) -> List[str]:
    """The socket kinds the measured communicators use between ranks of this host."""
    from .. import config

    names = opts.transports or [config.get("GPUCOLL_TRANSPORT")]
    return list(dict.fromkeys("tcp" if name == "tcp" else "unix" for name in names))


def check_options(opts: BenchOptions, plot_path: Optional[str] = None) -> None:
    """Validate ``opts`` and the optional dependencies before any rank starts (UsageError)."""
    import importlib.util

    opts.validate()
    if opts.compare == "mpi":
        from .mpi import require_mpi4py

        require_mpi4py()
    if opts.compare == "gloo" and importlib.util.find_spec("torch") is None:
        raise UsageError("--compare gloo needs PyTorch (torch.distributed's Gloo backend): "
                         "pip install torch")
    if opts.transports and opts.backend not in (None, "auto"):
        from ..backends.registry import get_backend

        if "transport" not in get_backend(opts.backend).options:
            raise UsageError(f"--transport applies to backends over gpucoll's own transports "
                             f"(cpu; GPUCOLL_TRANSPORT), not {opts.backend}")
    if plot_path:
        require_matplotlib()


def measure(opts: BenchOptions, out=None, err=None) -> Reporter:
    """Spawn ``opts.nranks`` ranks, run the sweep; the reporter holding every row.

    What bench presets (``bench/bench_cpu.py``) call; ``gpucoll bench`` calls :func:`run_bench`.

    Raises:
        UsageError: bad options, a missing optional dependency, or a launcher started us.
        RuntimeError: a rank failed (its traceback is in the message).
    """
    from ..api import detect_environment

    check_options(opts)
    if detect_environment().source != "none":
        raise UsageError("measure() spawns its own ranks; under a launcher use run_bench()")
    if len(opts.collectives) == 1:
        needed = COLLECTIVES[opts.collectives[0]].min_ranks
        if (opts.nranks or 1) < needed:
            raise UsageError(f"{opts.collectives[0]} needs at least {needed} ranks: pass "
                             f"-g {needed} or more")
    reporter = Reporter(opts, out, err)
    with _terminate_as_exit():
        if opts.ceiling_bytes:
            from .ceiling import raw_exchange

            reporter.ceiling = raw_exchange(_ceiling_kinds(opts), opts.ceiling_bytes,
                                            timeout=opts.timeout)
        _spawn_all(opts, reporter)
    return reporter


def run_bench(opts: BenchOptions, json_path: Optional[str] = None, csv_path: Optional[str] = None,
              plot_path: Optional[str] = None, out=None, err=None) -> int:
    """Run ``gpucoll bench``: spawn the ranks, or be one rank when a launcher started us.

    ``json_path`` ``"-"`` prints the JSON document to stdout; the table then goes to stderr.

    Returns:
        0 when every result was right, 1 when some were wrong or a rank failed.

    Raises:
        UsageError: bad options, or a missing optional dependency (the CLI exits 2).
    """
    import sys

    from ..api import detect_environment

    check_options(opts, plot_path)
    if json_path == "-":  # stdout carries the JSON alone, so that it can be piped
        out = err or sys.stderr
    files = (json_path, csv_path, plot_path)
    if detect_environment().source != "none":
        return _launched_rank(opts, lambda: Reporter(opts, out, err), files)
    return finish(measure(opts, out, err), *files)
