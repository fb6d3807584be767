"""The ``gpucoll bench`` engine: the timing loop, the Gloo comparison and the rank processes.

:func:`run_rank` runs the whole sweep on one rank through the Communicator API and emits rows
to rank 0's reporter. :func:`run_bench` either spawns the ranks itself or, when a launcher
(``gpucoll run``, torchrun, mpiexec, srun) started this process, runs as one of them.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Optional

import numpy as np

from ..types import ReduceOp
from .devices import _device_for, _Host
from .options import _SHOWN_TYPE, BenchOptions, UsageError
from .report import Reporter, finish, require_matplotlib
from .specs import COLLECTIVES, Collective


# ---------------------------------------------------------------- measuring (every rank)
def _timed(run: Callable[[], None], sync: Callable[[], None], barrier: Callable[[], None],
           iters: int, warmup: int) -> float:
    """Seconds per iteration of ``run`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    sync()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    return (time.perf_counter() - start) / iters


def _stats(comm, dev, seconds: float, wrong: Optional[int]) -> Dict[str, Any]:
    """Mean time over ranks and the total wrong count (one small all_reduce, outside timing)."""
    values = np.array([seconds, wrong or 0], np.float64)
    if comm.size > 1:
        buf = dev.empty(2, np.float64)
        dev.put(buf, values)
        comm.all_reduce(buf)
        values = np.array(dev.get(buf), np.float64)
    return {"time_us": values[0] / comm.size * 1e6,
            "wrong": None if wrong is None else int(round(values[1]))}


def _bandwidths(entry: Dict[str, Any], nbytes: int, factor: float) -> Dict[str, Any]:
    seconds = entry["time_us"] / 1e6
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    entry.update(algbw=algbw, busbw=algbw * factor)
    return entry


class _GlooSide:
    """torch.distributed's Gloo backend in the same rank processes (a second process group)."""

    _OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "band": "BAND",
            "bor": "BOR", "bxor": "BXOR"}

    def __init__(self, comm, dev, timeout: float):
        import datetime
        import warnings

        import torch
        import torch.distributed as dist
        from ..api import detect_environment

        warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
        self.torch, self.dist = torch, dist
        host = detect_environment().master_addr or "127.0.0.1"
        wait = datetime.timedelta(seconds=timeout)
        store = (dist.TCPStore(host, 0, comm.size, True, timeout=wait, wait_for_workers=False)
                 if comm.rank == 0 else None)
        port = np.array([store.port if store is not None else 0], np.int64)
        if comm.size > 1:  # publish rank 0's port through gpucoll itself
            buf = dev.empty(1, np.int64)
            dev.put(buf, port)
            comm.broadcast(buf, 0)
            port = dev.get(buf)
        if store is None:
            store = dist.TCPStore(host, int(port[0]), comm.size, False, timeout=wait)
        dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size,
                                timeout=wait)

    def op(self, op: Optional[ReduceOp]):
        if op is None:
            return None
        name = self._OPS.get(op.value)
        if name is None:
            raise NotImplementedError(f"Gloo has no {op.value} reduction")
        return getattr(self.dist.ReduceOp, name)

    def close(self) -> None:
        self.dist.destroy_process_group()


def _measure(comm, dev, coll: Collective, opts: BenchOptions, dtype, op, root, nbytes: int,
             seed: int, gloo: Optional[_GlooSide]) -> Dict[str, Any]:
    """One table row: every mode of ``coll`` at one size (and Gloo's, when compared)."""
    nranks, rank = comm.size, comm.rank
    count = coll.count_for(nbytes, dtype.itemsize, nranks)
    size = coll.size_of(count, dtype.itemsize, nranks)
    factor = coll.bus_factor(nranks)
    row: Dict[str, Any] = {"collective": coll.name, "size": size, "count": count,
                           "type": _SHOWN_TYPE.get(dtype.name, dtype.name),
                           "redop": op.value if op is not None else "none", "root": root,
                           "out": None, "in": None, "gloo": None, "ratio": None}
    bufs = coll.buffers(dev, count, dtype, nranks)
    for index, mode in enumerate(coll.modes):
        mode_seed = seed * 4 + index
        coll.fill(dev, bufs, mode, mode_seed, rank, nranks, op, root)
        seconds = _timed(lambda: coll.run(comm, bufs, mode, op, root), dev.sync, comm.barrier,
                         opts.iters, opts.warmup)
        wrong = None
        if opts.check:
            coll.fill(dev, bufs, mode, mode_seed + 2, rank, nranks, op, root)
            coll.run(comm, bufs, mode, op, root)
            dev.sync()
            wrong = coll.wrong(dev, bufs, mode, mode_seed + 2, rank, nranks, op, root)
        row[mode] = _bandwidths(_stats(comm, dev, seconds, wrong), size, factor)
    del bufs
    if gloo is not None:
        row["gloo"] = _measure_gloo(comm, dev, coll, opts, dtype, op, root, count, size, factor,
                                    seed, gloo)
        mine = row[coll.gloo_mode]
        if row["gloo"] is not None and mine is not None and row["gloo"]["busbw"] > 0:
            row["ratio"] = mine["busbw"] / row["gloo"]["busbw"]
    return row


def _measure_gloo(comm, dev, coll, opts, dtype, op, root, count, size, factor, seed, gloo):
    host = _Host()
    bufs = coll.buffers(host, count, dtype, comm.size)
    torch = gloo.torch
    mode = coll.gloo_mode
    try:
        send, recv = torch.from_numpy(bufs.send), torch.from_numpy(bufs.recv)
        torch_op = gloo.op(op)
    except (TypeError, NotImplementedError):
        return None  # e.g. a dtype torch cannot wrap, or an op Gloo lacks: N/A on every rank
    call = lambda: coll.gloo(gloo.dist, send, recv, torch_op, root, comm.rank, comm.size)  # noqa: E731
    coll.fill(host, bufs, mode, seed * 4 + 3, comm.rank, comm.size, op, root)
    seconds = _timed(call, lambda: None, gloo.dist.barrier, opts.iters, opts.warmup)
    wrong = None
    if opts.check:
        coll.fill(host, bufs, mode, seed * 4 + 3, comm.rank, comm.size, op, root)
        call()
        wrong = coll.wrong(host, bufs, mode, seed * 4 + 3, comm.rank, comm.size, op, root)
    return _bandwidths(_stats(comm, dev, seconds, wrong), size, factor)


def run_rank(comm, opts: BenchOptions, emit: Optional[Callable[[str, Any], None]]) -> None:
    """Run the whole sweep on this rank; rank 0 passes ``emit`` to receive the events.

    Events: ``("begin", info)`` once, ``("start", name)`` before each collective's rows,
    ``("row", row)``, ``("skip", (name, reason))`` and ``("end", name)``.
    """
    dev = _device_for(comm)
    say = emit if comm.rank == 0 and emit is not None else (lambda kind, value: None)
    pids = np.array([os.getpid()], np.int64)
    if comm.size > 1:
        buf = dev.empty(1, np.int64)
        dev.put(buf, pids)
        out = dev.empty((comm.size, 1), np.int64)
        comm.all_gather(buf, out=out)
        pids = dev.get(out).reshape(-1)
    say("begin", {"nranks": comm.size, "backend": comm.backend, "pids": [int(p) for p in pids]})
    gloo = _GlooSide(comm, dev, opts.timeout) if opts.compare == "gloo" else None
    try:
        seed = opts.seed
        for name in opts.collectives:
            coll = COLLECTIVES[name]
            if name == "sendrecv" and comm.size < 2:
                say("skip", (name, "sendrecv needs at least 2 ranks"))
                continue
            say("start", name)
            for dtype, op, root in opts.cases(coll, comm.size):
                for nbytes in opts.sizes:
                    seed += 1
                    say("row", _measure(comm, dev, coll, opts, dtype, op, root, nbytes, seed, gloo))
            say("end", name)
    finally:
        if gloo is not None:
            gloo.close()


# ---------------------------------------------------------------- running the ranks
def _launched_rank(opts: BenchOptions, reporter_factory: Callable[[], Reporter], files) -> int:
    """Under ``gpucoll run`` / torchrun / mpiexec / srun: this process is one rank."""
    import gpucoll
    from ..api import detect_environment

    env = detect_environment()
    if opts.nranks is not None and opts.nranks != env.world_size:
        raise UsageError(f"-g {opts.nranks} does not match the launcher's world size "
                         f"{env.world_size} ({env.source}); leave -g out under a launcher")
    comm = gpucoll.init(backend=opts.backend, timeout=opts.timeout)
    try:
        reporter = reporter_factory() if comm.rank == 0 else None
        run_rank(comm, opts, reporter)
        status = finish(reporter, *files) if reporter is not None else 0
        codes = np.array([status], np.int64)
        if comm.size > 1:  # every rank exits with the same code
            dev = _device_for(comm)
            buf = dev.empty(1, np.int64)
            dev.put(buf, codes)
            comm.broadcast(buf, 0)
            codes = dev.get(buf)
        comm.close()
        return int(codes[0])
    except BaseException:
        comm.abort()
        raise


def _spawned_rank(rank: int, nranks: int, url: str, env: Dict[str, str], opts: BenchOptions,
                  events) -> None:
    """Entry point of a rank started by :func:`run_bench` (multiprocessing, spawn)."""
    import traceback

    os.environ.update(env)
    comm = None
    try:
        import gpucoll

        from ..backends.registry import get_backend

        if opts.backend not in (None, "auto") and get_backend(opts.backend).memory == "cuda":
            import cupy

            cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        comm = gpucoll.init(backend=opts.backend, rank=rank, world_size=nranks, url=url,
                            timeout=opts.timeout)
        run_rank(comm, opts, lambda kind, value: events.put((kind, rank, value)))
        comm.close()
        events.put(("done", rank, None))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
        if comm is not None:
            comm.abort()
        raise SystemExit(1)


def _spawn_all(opts: BenchOptions, reporter: Reporter) -> None:
    """Start ``opts.nranks`` rank processes; relay rank 0's events to ``reporter``.

    Raises:
        RuntimeError: a rank failed or died (with its traceback); every rank is stopped.
    """
    import multiprocessing
    import queue
    import secrets

    from ..rendezvous import TCPStoreServer

    nranks = opts.nranks or 1
    token = secrets.token_hex(16)
    server = TCPStoreServer("127.0.0.1", 0, token=token)
    env = {"GPUCOLL_AUTH_TOKEN": token, "GPUCOLL_LAUNCHER_STORE": "1"}
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    url = f"tcp://127.0.0.1:{server.port}"
    procs = [ctx.Process(target=_spawned_rank, args=(r, nranks, url, env, opts, events),
                         name=f"gpucoll-bench-rank{r}", daemon=True) for r in range(nranks)]
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


def run_bench(opts: BenchOptions, json_path: Optional[str] = None, csv_path: Optional[str] = None,
              plot_path: Optional[str] = None, out=None, err=None) -> int:
    """Run ``gpucoll bench``: spawn the ranks, or be one rank when a launcher started us.

    Returns:
        0 when every result was right, 1 when some were wrong or a rank failed.

    Raises:
        UsageError: bad options, or a missing optional dependency (the CLI exits 2).
    """
    import importlib.util

    from ..api import detect_environment

    opts.validate()
    if opts.compare == "gloo" and importlib.util.find_spec("torch") is None:
        raise UsageError("--compare gloo needs PyTorch (torch.distributed's Gloo backend): "
                         "pip install torch")
    if plot_path:
        require_matplotlib()
    files = (json_path, csv_path, plot_path)
    make = lambda: Reporter(opts, out, err)  # noqa: E731
    if detect_environment().source != "none":
        return _launched_rank(opts, make, files)
    if "sendrecv" in opts.collectives and (opts.nranks or 1) < 2 and len(opts.collectives) == 1:
        raise UsageError("sendrecv needs at least 2 ranks: pass -g 2 or more")
    reporter = make()
    _spawn_all(opts, reporter)
    return finish(reporter, *files)
