"""``init()``: find rank and world size, rendezvous through a store, build a communicator.

Where rank and size come from, first match wins: the arguments; torchrun / ``gpucoll run``
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); Open MPI
(OMPI_COMM_WORLD_*); MPICH / PMI (PMI_RANK, PMI_SIZE); Slurm (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID). Under MPI or Slurm without MASTER_ADDR, the store lives on the first node of
the job (Slurm) or on 127.0.0.1 when all ranks are on one host (MPI).
"""

from __future__ import annotations

import logging
import re
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional
from urllib.parse import urlparse

from . import config, default_comm
from .communicator import Communicator
from .errors import BackendUnavailableError, CommTimeoutError, StoreError

__all__ = ["init", "register_backend", "detect_environment", "LaunchEnv", "available_backends",
           "resolve_backend"]

log = logging.getLogger("gpucoll")

_BackendFactory = Callable[..., Communicator]
_BACKENDS: Dict[str, _BackendFactory] = {}
_SERVERS: Dict[tuple, object] = {}  # stores this process serves, kept for re-initialisation


@dataclass
class LaunchEnv:
    """What the launcher told this process."""

    rank: Optional[int] = None
    world_size: Optional[int] = None
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    source: str = "none"


def _first_slurm_node(nodelist: str) -> str:
    """First host of a Slurm hostlist such as ``gpu[003-010,012],cpu01`` -> ``gpu003``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return nodelist
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_environment(environ=None) -> LaunchEnv:
    """Read rank, size, local rank and store address from launcher variables (see module doc)."""
    get = lambda name: config.get(name, environ)  # noqa: E731
    has = lambda name: config.is_set(name, environ)  # noqa: E731
    env = LaunchEnv(master_addr=get("MASTER_ADDR"), master_port=get("MASTER_PORT"))
    if has("RANK") and has("WORLD_SIZE"):
        env.rank, env.world_size, env.source = get("RANK"), get("WORLD_SIZE"), "torchrun"
        env.local_rank, env.local_size = get("LOCAL_RANK"), get("LOCAL_WORLD_SIZE")
    elif has("OMPI_COMM_WORLD_RANK") and has("OMPI_COMM_WORLD_SIZE"):
        env.rank, env.world_size, env.source = (get("OMPI_COMM_WORLD_RANK"),
                                                get("OMPI_COMM_WORLD_SIZE"), "openmpi")
        env.local_rank, env.local_size = get("OMPI_COMM_WORLD_LOCAL_RANK"), get("OMPI_COMM_WORLD_LOCAL_SIZE")
    elif has("PMI_RANK") and has("PMI_SIZE"):
        env.rank, env.world_size, env.source = get("PMI_RANK"), get("PMI_SIZE"), "pmi"
        env.local_rank, env.local_size = get("MPI_LOCALRANKID"), get("MPI_LOCALNRANKS")
    elif has("SLURM_PROCID") and has("SLURM_NTASKS"):
        env.rank, env.world_size, env.source = get("SLURM_PROCID"), get("SLURM_NTASKS"), "slurm"
        env.local_rank = get("SLURM_LOCALID")
        per_node = get("SLURM_NTASKS_PER_NODE")
        if per_node:
            env.local_size = int(re.match(r"\d+", per_node).group(0))
    if env.master_addr is None and env.source == "slurm" and has("SLURM_JOB_NODELIST"):
        env.master_addr = _first_slurm_node(get("SLURM_JOB_NODELIST"))
    if env.master_addr is None and env.source in ("openmpi", "pmi") and env.local_size == env.world_size:
        env.master_addr = "127.0.0.1"
    if env.master_port is None and env.source in ("slurm", "openmpi", "pmi"):
        job = get("SLURM_JOB_ID") if has("SLURM_JOB_ID") else None
        env.master_port = 29500 + (job % 1000 if job is not None else 0)
    return env


def register_backend(name: str, factory: _BackendFactory) -> None:
    """Add a backend: ``factory(store, rank, world_size, **settings) -> Communicator``."""
    _BACKENDS[name] = factory


def _cpu_factory(store, rank, world_size, **settings) -> Communicator:
    from .backends.cpu import CPUCommunicator

    return CPUCommunicator(store, rank, world_size, **settings)


def _nccl_factory(store, rank, world_size, device=None, **settings) -> Communicator:
    from .backends.nccl import NCCLCommunicator

    return NCCLCommunicator(store, rank, world_size,
                            device=config.get("GPUCOLL_DEVICE") if device is None else device,
                            watchdog_interval=config.get("GPUCOLL_WATCHDOG_INTERVAL"), **settings)


register_backend("cpu", _cpu_factory)
register_backend("nccl", _nccl_factory)


def _nccl_unavailable() -> Optional[str]:
    from .transports.nccl import unavailable_reason

    return unavailable_reason()


def available_backends() -> Dict[str, str]:
    """backend name -> "available" or the reason it is not (imports CuPy to find out)."""
    result = {name: "available" for name in _BACKENDS}
    if "nccl" in result:
        result["nccl"] = _nccl_unavailable() or "available"
    return result


def _shared_gpu_reason(local_size: Optional[int]) -> Optional[str]:
    """Why NCCL cannot give each of ``local_size`` ranks on this host a GPU (None: it can)."""
    from .transports.nccl import device_count, nccl_version_code

    count = device_count()
    if local_size is None or local_size <= count:
        return None
    if config.get("NCCL_MULTI_RANK_GPU_ENABLE") and nccl_version_code() >= 23000:
        return None
    return (f"{local_size} ranks on this host share {count} GPU(s); NCCL needs one GPU per rank "
            f"(or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1)")


def resolve_backend(backend: Optional[str] = None, local_size: Optional[int] = None) -> str:
    """The backend ``init(backend=...)`` would use: "auto" becomes "nccl" when CuPy, NCCL and
    a GPU are usable and each of the ``local_size`` ranks on this host can have a GPU of its
    own (or NCCL may share one), else "cpu".

    Raises:
        BackendUnavailableError: "nccl" was asked for and cannot run here (says how to fix it).
        ValueError: unknown backend name.
    """
    backend = (backend or config.get("GPUCOLL_BACKEND")).lower()
    if backend == "auto":
        if "nccl" not in _BACKENDS:
            return "cpu"
        reason = _nccl_unavailable() or _shared_gpu_reason(local_size)
        if reason is not None:
            log.info("backend auto: cpu (NCCL is not usable: %s)", reason)
        return "cpu" if reason is not None else "nccl"
    if backend not in _BACKENDS:
        raise ValueError(f"init(): unknown backend {backend!r}; available: {sorted(_BACKENDS)}")
    if backend == "nccl":
        reason = _nccl_unavailable()
        if reason is not None:
            raise BackendUnavailableError(
                f"backend 'nccl' cannot run here: {reason}. Use backend='cpu' (CuPy arrays are "
                f"staged through host memory) or backend='auto'; `gpucoll doctor` shows what "
                f"is installed")
    return backend


def _route_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (what TCP peers should connect to)."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, port or 9))
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def _resolve_url(url: str, env: LaunchEnv) -> str:
    if url.startswith("env://"):
        if env.master_addr is None or env.master_port is None:
            raise ValueError(
                "init(url='env://') needs MASTER_ADDR and MASTER_PORT (torchrun and `gpucoll run` "
                "set them); or pass url='tcp://host:port' / 'file:///path'")
        return f"tcp://{env.master_addr}:{env.master_port}"
    return url


def init(backend: Optional[str] = None, *, rank: Optional[int] = None,
         world_size: Optional[int] = None, url: Optional[str] = None,
         timeout: Optional[float] = None, store=None,
         device: Optional[int] = None, set_default: bool = True) -> Communicator:
    """Create the communicator of this job.

    Args:
        backend: "auto" (default: NCCL when CuPy, NCCL and a GPU are usable, else "cpu"),
            "cpu" or "nccl"; default from GPUCOLL_BACKEND.
        rank, world_size: override what the launcher variables say.
        url: rendezvous: "env://" (MASTER_ADDR/MASTER_PORT), "tcp://host:port" (rank 0
            serves the store unless a launcher does) or "file:///path" (one host).
        timeout: seconds for this and every later blocking call (GPUCOLL_TIMEOUT).
        store: an existing ``gpucoll.rendezvous.Store`` to use instead of ``url``.
        device: NCCL backend: the GPU to use (default GPUCOLL_DEVICE, else the local rank
            modulo the number of GPUs).
        set_default: make the communicator the default one (``gpucoll.get_rank()``,
            ``gpucoll.default()``...; see ``gpucoll.default_comm``).

    With no launcher variables and no rank or size given, the world is this process alone:
    rank 0 of 1 on the CPU backend (for backend "auto"), with one line on stderr saying so
    (GPUCOLL_QUIET=1 silences it). A world of one needs no URL.

    Returns:
        A ``Communicator``.

    Raises:
        ValueError: rank/size missing or inconsistent, bad URL.
        BackendUnavailableError: the backend cannot run here (the message says what to install).
        CommTimeoutError: not every rank joined in time (the missing ranks are named).

    Example::

        comm = gpucoll.init()                        # under `gpucoll run -n 2 script.py`
        comm = gpucoll.init(backend="cpu", rank=r, world_size=2, url="tcp://127.0.0.1:29500")
    """
    log.setLevel(config.get("GPUCOLL_LOG_LEVEL").upper())
    for message in config.unknown_name_warnings():
        warnings.warn(message, stacklevel=2)
    env = detect_environment()
    alone = rank is None and world_size is None and env.source == "none"
    rank = env.rank if rank is None else rank
    world_size = env.world_size if world_size is None else world_size
    if alone:
        rank, world_size = 0, 1
    elif rank is None and world_size is not None and int(world_size) == 1:
        rank = 0
    if rank is None or world_size is None:
        raise ValueError("init(): rank and world_size are unknown; run under `gpucoll run`, "
                         "torchrun, mpiexec or srun, or pass rank= and world_size=")
    rank, world_size = int(rank), int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"init(): rank={rank} is out of range for world_size={world_size}")
    timeout = float(config.get("GPUCOLL_TIMEOUT") if timeout is None else timeout)
    if not timeout > 0:
        raise ValueError(f"init(): timeout must be positive, got {timeout}")

    if alone and (backend or config.get("GPUCOLL_BACKEND")).lower() == "auto":
        backend = "cpu"
    backend = resolve_backend(backend, env.local_size if env.world_size == world_size else None)
    if alone and not config.get("GPUCOLL_QUIET"):
        sys.stderr.write(f"gpucoll: no launcher found (no RANK/WORLD_SIZE, Slurm, Open MPI or "
                         f"PMI variables): running as rank 0 of 1 on the {backend} backend "
                         f"(GPUCOLL_QUIET=1 hides this line)\n")
    if device is not None and backend != "nccl":
        raise ValueError(f"init(device={device}) applies to the nccl backend, not {backend!r}")

    token = config.get("GPUCOLL_AUTH_TOKEN")
    url = url or config.get("GPUCOLL_INIT_URL")
    advertise = config.get("GPUCOLL_HOST") or "127.0.0.1"
    owns_store = store is None
    if store is None and world_size == 1 and url.startswith("env://") and (
            env.master_addr is None or env.master_port is None):
        from .rendezvous.memory_store import MemoryStore

        store, url = MemoryStore(timeout), "memory:// (a world of one)"
    elif store is None:
        url = _resolve_url(url, env)
        parsed = urlparse(url)
        if parsed.scheme == "tcp" and not config.get("GPUCOLL_HOST"):
            advertise = _route_address(parsed.hostname or "127.0.0.1", parsed.port or 0)
        store = _connect(url, rank, world_size, timeout, token)
    generation = store.add(f"gpucoll/generation/{rank}", 1)
    settings = dict(
        comm_id=f"world{generation}", token=token, timeout=timeout,
        transport_mode=config.get("GPUCOLL_TRANSPORT"), advertise_host=advertise,
        socket_buffer=config.get("GPUCOLL_SOCKET_BUFFER"), chunk_bytes=config.get("GPUCOLL_CHUNK_BYTES"),
        ring_threshold=config.get("GPUCOLL_RING_THRESHOLD"),
        algorithm_override=_algorithm_override(), debug=config.get("GPUCOLL_DEBUG"),
        owns_store=owns_store)
    log.info("rank %d of %d: backend %s, store %s, comm %s", rank, world_size, backend,
             url if owns_store else type(store).__name__, settings["comm_id"])
    if device is not None:
        settings["device"] = int(device)
    try:
        comm = _BACKENDS[backend](store, rank, world_size, **settings)
    except BaseException as exc:
        if owns_store:
            store.close()
        if isinstance(exc, CommTimeoutError):
            exc.add_limit(timeout)
        raise
    if set_default:
        default_comm.set_default(comm)
    return comm


def _algorithm_override() -> dict:
    from . import algorithms

    text = config.get("GPUCOLL_ALGORITHM")
    return {} if text in ("", "auto") else algorithms.parse_override(text)


def _connect(url: str, rank: int, world_size: int, timeout: float, token: str):
    from .rendezvous import TCPStore, connect_store

    parsed = urlparse(url)
    serve = parsed.scheme == "tcp" and rank == 0 and not config.get("GPUCOLL_LAUNCHER_STORE")
    if serve:
        key = (parsed.hostname, parsed.port)
        server = _SERVERS.get(key)
        if server is not None:  # re-initialisation in a process that already serves
            return TCPStore(parsed.hostname, server.port, token=token, timeout=timeout)
    try:
        store = connect_store(url, rank=rank, world_size=world_size, timeout=timeout,
                              token=token, serve=serve)
    except (CommTimeoutError, StoreError) as exc:
        raise CommTimeoutError(
            f"rank {rank}: cannot reach the rendezvous store at {url} within {timeout:g} s "
            f"(rank 0 or the launcher serves it): {exc}", rank=rank, op="init",
            limit=timeout) from None
    if serve:
        server = getattr(store, "server", None)
        if server is not None:
            _SERVERS[(parsed.hostname, parsed.port)] = server
            store.server = None  # the server outlives this communicator, for re-init after abort
    return store
