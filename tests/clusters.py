"""Where the one conformance suite runs: a backend, an array module and a world size.

A *cluster* runs a module-level function ``fn(comm, arrays, *args)`` on every rank and returns
the per-rank results (host NumPy values, so the test can compare them with NumPy). ``arrays``
is the rank's array module adapter (:class:`Arrays`): ``dev`` puts a NumPy array where the
backend wants it, ``host`` brings a result back, ``zeros`` allocates an output.

Clusters (``CLUSTERS``; ids as in ``pytest -k``):

- ``cpu-unix`` / ``cpu-tcp``: real processes (``mp_harness.RankPool``), the CPU backend over
  Unix or TCP sockets, NumPy arrays.
- ``cpu-shm``: the same over shared memory, with 64 KiB slots so that the multi-chunk sizes
  take many slot-sized steps (and the sliced all-reduce), large messages read straight from
  the peers' arrays (single copy); ``cpu-shmcopy`` keeps every byte in the segment.
- ``nccl-emulated``: ranks are threads, the real NCCL backend over ``tests/emulated_cuda``
  (gpucoll's bookkeeping, not NCCL's numerics).
- ``nccl-gpu``: the real NCCL backend on a real GPU with CuPy (one rank per GPU; skipped
  without one).
- ``mpi``: the MPI backend in ranks started by a real ``mpirun`` (Open MPI from PyPI: the
  ``mpi`` extra); each rank connects back to the test process and runs the functions it is
  sent (``tests/scripts/mpi_rank_server.py``). Skipped without mpi4py or mpirun.

``cluster.reduces(op, dtype)`` says whether the backend reduces that pair (NCCL has no
bitwise ops and does not reduce bool or 16-bit integers); data movement works for every dtype.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, List

import numpy as np
import pytest

from mp_harness import RankFailure, RankPool
from reference import op_valid

_NCCL_OPS = ("sum", "prod", "min", "max", "avg")
_NCCL_REDUCIBLE = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
                   "float64")


class Arrays:
    """The rank's array module: ``numpy``, ``cupy`` or the emulation's CuPy."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "numpy":
            self.xp = np
        elif kind == "cupy":
            import cupy

            self.xp = cupy
        else:  # "emulated": the module the NCCL backend was handed
            from gpucoll import cuda_env

            self.xp = cuda_env._LOADED[0]

    def dev(self, host: np.ndarray):
        return host if self.xp is np else self.xp.asarray(host)

    def host(self, x) -> Any:
        if x is None or self.xp is np:
            return x
        return self.xp.asnumpy(x)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype) if self.xp is np else self.xp.zeros(shape, dtype)


def _call(comm, kind: str, fn: Callable, *args):
    return fn(comm, Arrays(kind), *args)


class ProcessCluster:
    """Ranks in real processes (see module doc)."""

    def __init__(self, name: str, world_size: int, backend: str, transport: str, kind: str,
                 env=None):
        self.name, self.world_size, self.backend, self.kind = name, world_size, backend, kind
        self.pool = RankPool(world_size, env={"GPUCOLL_TRANSPORT": transport, **(env or {})},
                             backend=backend)

    def run(self, fn: Callable, *args, timeout: float = 120.0) -> List[Any]:
        return self.pool.run(_call, self.kind, fn, *args, timeout=timeout)

    def reduces(self, op: str, dtype: str) -> bool:
        if self.backend == "nccl":
            return op in _NCCL_OPS and (dtype in _NCCL_REDUCIBLE or (
                dtype.startswith("complex") and op in ("sum", "avg")))
        return op_valid(op, dtype)

    def close(self) -> None:
        self.pool.close()


class ThreadCluster(ProcessCluster):
    """Ranks as threads of this process on the emulated NCCL backend (see module doc)."""

    def __init__(self, name: str, world_size: int, emulation):
        import gpucoll

        self.name, self.world_size, self.backend, self.kind = name, world_size, "nccl", "emulated"
        self._emu = emulation
        self._tmp = tempfile.TemporaryDirectory()
        url = f"file://{self._tmp.name}/store"
        self._tasks = [queue.Queue() for _ in range(world_size)]
        self._results: "queue.Queue" = queue.Queue()
        self.comms: List[Any] = [None] * world_size

        def body(rank: int) -> None:
            try:
                comm = self.comms[rank] = gpucoll.init(
                    backend="nccl", rank=rank, world_size=world_size, url=url, timeout=10)
            except BaseException as exc:
                self._results.put((rank, "error", exc))
                return
            self._results.put((rank, "ok", None))
            while True:
                task = self._tasks[rank].get()
                if task is None:
                    break
                fn, args = task
                try:
                    self._results.put((rank, "ok", fn(comm, Arrays("emulated"), *args)))
                except BaseException as exc:  # reported by run()
                    self._results.put((rank, "error", exc))
            comm.close()

        self._threads = [threading.Thread(target=body, args=(r,), daemon=True,
                                          name=f"rank-{r}") for r in range(world_size)]
        for thread in self._threads:
            thread.start()
        self._collect(60.0)

    def _collect(self, timeout: float) -> List[Any]:
        values, deadline = {}, time.monotonic() + timeout
        while len(values) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RankFailure(f"ranks {sorted(set(range(self.world_size)) - set(values))} did "
                                  f"not answer within {timeout:g} s") from None
            if status == "error":
                for comm in self.comms:
                    if comm is not None:
                        comm.abort()
                self._emu.release_all()
                raise RankFailure(f"rank {rank} failed: {type(value).__name__}: {value}") from value
            values[rank] = value
        return [values[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout: float = 120.0) -> List[Any]:
        for tasks in self._tasks:
            tasks.put((fn, args))
        return self._collect(timeout)

    def close(self) -> None:
        for tasks in self._tasks:
            tasks.put(None)
        for thread in self._threads:
            thread.join(10)
        self._tmp.cleanup()


_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def mpirun_command(nranks: int):
    """``mpirun -n N`` with what a test host needs (root, few cores, no binding), or None
    with the reason when mpi4py or mpirun is missing."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install '.[mpi]')"
    mpirun = (shutil.which("mpirun")
              or shutil.which("mpirun", path=os.path.dirname(sys.executable)))
    if mpirun is None:
        return None, "no mpirun on PATH (pip install '.[mpi]' brings Open MPI)"
    command = [mpirun, "-n", str(nranks), "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-run-as-root")
    return command, None


def mpirun_env(extra=None):
    """The environment of an mpirun job started by the tests (the tree importable)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(_SCRIPTS))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


class MPICluster:
    """Ranks started by a real ``mpirun`` on the MPI backend (see module doc)."""

    kind = "numpy"
    backend = "mpi"

    def __init__(self, name: str, world_size: int, start_timeout: float = 90.0, env=None):
        from multiprocessing.connection import Listener

        self.name, self.world_size = name, world_size
        command, reason = mpirun_command(world_size)
        if command is None:
            pytest.skip(reason)
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        self._proc = subprocess.Popen(
            command + [sys.executable, os.path.join(_SCRIPTS, "mpi_rank_server.py"),
                       f"{host}:{port}", key.hex()],
            env=mpirun_env({"GPUCOLL_TIMEOUT": "60", **(env or {})}), stdin=subprocess.DEVNULL,
            start_new_session=True)
        accepted: "queue.Queue" = queue.Queue()

        def accept() -> None:
            for _ in range(world_size):
                try:
                    accepted.put(self._listener.accept())
                except Exception as exc:  # the listener was closed: give up
                    accepted.put(exc)
                    return

        threading.Thread(target=accept, daemon=True, name="mpi-cluster-accept").start()
        self.conns: List[Any] = [None] * world_size
        deadline = time.monotonic() + start_timeout
        for _ in range(world_size):
            try:
                conn = accepted.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.kill()
                raise RankFailure(f"mpirun -n {world_size}: not every rank connected within "
                                  f"{start_timeout:g} s") from None
            if isinstance(conn, Exception) or not conn.poll(max(deadline - time.monotonic(), 0.01)):
                self.kill()
                raise RankFailure(f"mpirun -n {world_size}: a rank connected but never said ready")
            status, value = conn.recv()
            if status != "ready":
                self.kill()
                raise RankFailure(f"an MPI rank failed to start:\n{value}")
            self.conns[value] = conn

    def run(self, fn: Callable, *args, timeout: float = 120.0) -> List[Any]:
        for conn in self.conns:
            conn.send((_call, (self.kind, fn) + args))
        values, deadline = [], time.monotonic() + timeout
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(deadline - time.monotonic(), 0.01)):
                self.kill()
                raise RankFailure(f"MPI rank {rank} did not answer within {timeout:g} s")
            status, value = conn.recv()
            if status != "ok":
                self.kill()
                raise RankFailure(f"MPI rank {rank} failed:\n{value}")
            values.append(value)
        return values

    def reduces(self, op: str, dtype: str) -> bool:
        return op_valid(op, dtype)

    def kill(self) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        self._proc.wait(10)
        self._listener.close()

    def close(self) -> None:
        for conn in self.conns:
            if conn is not None:
                try:
                    conn.send(None)
                except OSError:
                    pass
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


CLUSTERS = [("cpu-unix", n) for n in (1, 2, 3, 4)] + [("cpu-tcp", n) for n in (2, 3)] + \
           [("cpu-shm", n) for n in (2, 3, 4)] + [("cpu-shmcopy", n) for n in (2, 3)] + \
           [("nccl-emulated", n) for n in (1, 2, 3)] + [("nccl-gpu", 1)] + \
           [("mpi", n) for n in (2, 3, 4)]


def cluster_id(param) -> str:
    return f"{param[0]}-world{param[1]}"


def cluster_marks(param):
    return [pytest.mark.gpu] if param[0] == "nccl-gpu" else []


def make_cluster(name: str, world_size: int):
    """Start the cluster ``name`` of ``world_size`` ranks; call ``close()`` when done."""
    if name in ("cpu-unix", "cpu-tcp"):
        return ProcessCluster(name, world_size, "cpu", name.split("-")[1], "numpy")
    if name in ("cpu-shm", "cpu-shmcopy"):
        single_copy = "1" if name == "cpu-shm" else "0"
        return ProcessCluster(name, world_size, "cpu", "shm", "numpy",
                              env={"GPUCOLL_SHM_BYTES": "64KiB",
                                   "GPUCOLL_SHM_SINGLE_COPY": single_copy})
    if name == "nccl-gpu":
        return ProcessCluster(name, world_size, "nccl", "auto", "cupy")
    if name == "mpi":
        return MPICluster(name, world_size)
    from emulated_cuda import Emulation
    from gpucoll import cuda_env

    emulation = Emulation(device_count=4, timeout=5.0)
    patch = pytest.MonkeyPatch()
    patch.setattr(cuda_env, "_LOADED", (emulation.cupy, emulation.nccl))
    patch.setenv("GPUCOLL_WATCHDOG_INTERVAL", "0.01")
    patch.delenv("GPUCOLL_DEBUG", raising=False)
    try:
        cluster = ThreadCluster(name, world_size, emulation)
    except BaseException:
        patch.undo()
        raise
    close = cluster.close

    def close_and_restore() -> None:
        try:
            close()
            emulation.release_all()
        finally:
            patch.undo()

    cluster.close = close_and_restore
    return cluster


def cluster_pools(clusters=None):
    """A module-scoped ``pool`` fixture over ``clusters`` (default: all of them), each started
    once for the module and closed after it. Use as ``pool = cluster_pools()`` at module level."""
    @pytest.fixture(scope="module", params=[pytest.param(c, marks=cluster_marks(c))
                                            for c in (CLUSTERS if clusters is None else clusters)],
                    ids=cluster_id)
    def pool(request):
        cluster = make_cluster(*request.param)
        yield cluster
        cluster.close()

    return pool
