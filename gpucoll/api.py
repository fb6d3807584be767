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
import sys
import warnings
from dataclasses import dataclass
from typing import Dict, Optional, Tuple
from urllib.parse import urlparse

from . import config, default_comm
from .backends import registry
from .backends.registry import available_backends, register_backend
from .communicator import Communicator
from .errors import CommTimeoutError, StoreError

__all__ = ["init", "register_backend", "detect_environment", "LaunchEnv", "available_backends",
           "resolve_backend"]

log = logging.getLogger("gpucoll")

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


def resolve_backend(backend: Optional[str] = None, local_size: Optional[int] = None) -> str:
    """The backend ``init(backend=...)`` would use (default GPUCOLL_BACKEND): ``auto`` becomes
    the usable registered backend of highest priority (NCCL when CuPy, NCCL and a GPU are
    usable and each of the ``local_size`` ranks on this host can have a GPU, else ``cpu``).

    Raises:
        BackendUnavailableError: the named backend cannot run here (says how to fix it).
        ValueError: unknown backend name.
    """
    return registry.resolve_backend(backend or config.get("GPUCOLL_BACKEND"), local_size)


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
         timeout: Optional[float] = None, store=None, device: Optional[int] = None,
         transport: Optional[str] = None, set_default: bool = True) -> Communicator:
    """Create the communicator of this job.

    Args:
        backend: "auto" (default: NCCL when CuPy, NCCL and a GPU are usable, else "cpu"),
            "cpu", "nccl" or any name given to ``register_backend``; default from
            GPUCOLL_BACKEND.
        rank, world_size: override what the launcher variables say.
        url: rendezvous: "env://" (MASTER_ADDR/MASTER_PORT), "tcp://host:port" (rank 0
            serves the store unless a launcher does) or "file:///path" (one host).
        timeout: seconds for this and every later blocking call (GPUCOLL_TIMEOUT).
        store: an existing ``gpucoll.rendezvous.Store`` to use instead of ``url``.
        device: NCCL backend: the GPU to use (default GPUCOLL_DEVICE, else the local rank
            modulo the number of GPUs).
        transport: CPU backend: how to reach peers, "auto", "shm", "socket", "tcp" or "unix"
            (default GPUCOLL_TRANSPORT; see ``gpucoll.transports.select``).
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
        AuthenticationError: the store refused this rank's GPUCOLL_AUTH_TOKEN.
        SharedMemoryUnavailable: transport "shm" and this host's segment could not be set up
            (an ``OSError``; "auto" falls back to sockets with a warning instead).

    Example::

        comm = gpucoll.init()                        # under `gpucoll run -n 2 script.py`
        comm = gpucoll.init(backend="cpu", rank=r, world_size=2, url="tcp://127.0.0.1:29500")
    """
    log.setLevel(config.get("GPUCOLL_LOG_LEVEL").upper())
    for message in config.unknown_name_warnings():
        warnings.warn(message, stacklevel=2)
    from .orphan_guard import guard_rank

    guard_rank()  # started by `gpucoll run` or gc.spawn: stop when that launcher dies
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
    spec = registry.get_backend(backend)
    options = {name: value for name, value in (("device", device), ("transport", transport))
               if value is not None}
    for name, value in options.items():
        if name not in spec.options:
            takers = [n for n in registry.backend_names() if name in registry.get_backend(n).options]
            raise ValueError(f"init({name}={value!r}) applies to backend(s) {', '.join(takers)}, "
                             f"not {backend!r}")

    token = config.get("GPUCOLL_AUTH_TOKEN")
    if not spec.needs_store and config.get("GPUCOLL_JOIN"):
        raise ValueError(f"GPUCOLL_JOIN: backend {backend!r} cannot add ranks to a running job "
                         f"(its communicators do not meet through gpucoll's store)")
    if store is None and not spec.needs_store:  # the backend rendezvouses itself (MPI)
        return spec.factory(None, rank, world_size, comm_id="world", token=token,
                            timeout=timeout, debug=config.get("GPUCOLL_DEBUG"),
                            owns_store=False, **options)
    url = url or config.get("GPUCOLL_INIT_URL")
    owns_store = store is None
    if store is None and world_size == 1 and url.startswith("env://") and (
            env.master_addr is None or env.master_port is None):
        from .rendezvous.memory_store import MemoryStore

        store, url = MemoryStore(timeout), "memory:// (a world of one)"
    elif store is None:
        url = _resolve_url(url, env)
        store = _connect(url, rank, world_size, timeout, token)
    joining = config.get("GPUCOLL_JOIN")
    if joining:   # a replacement: its place comes from the members' grow()
        admission = _admitted(store, rank, timeout, owns_store)
        rank, world_size, comm_id = admission.rank, len(admission.world_ranks), admission.comm_id
    else:
        comm_id = f"world{store.add(f'gpucoll/generation/{rank}', 1)}"
    common = dict(comm_id=comm_id, token=token, timeout=timeout,
                  debug=config.get("GPUCOLL_DEBUG"), owns_store=owns_store)
    log.info("rank %d of %d: backend %s, store %s, comm %s", rank, world_size, backend,
             url if owns_store else type(store).__name__, common["comm_id"])
    try:
        comm = spec.factory(store, rank, world_size, **common, **options)
    except BaseException as exc:
        if owns_store:
            store.close()
        if isinstance(exc, CommTimeoutError):
            exc.add_limit(timeout)
        raise
    if joining:
        comm._world_ranks, comm.joined = admission.world_ranks, admission.joined
    if set_default:
        default_comm.set_default(comm)
    return comm


def _admitted(store, world_rank: int, timeout: float, owns_store: bool):
    """GPUCOLL_JOIN: wait for the members' ``grow()`` to admit this rank."""
    from .rendezvous.joiners import request_to_join

    join_id = config.get("GPUCOLL_JOIN")
    log.info("world rank %d: asking to join the running job (GPUCOLL_JOIN=%s)", world_rank,
             join_id)
    try:
        return request_to_join(store, world_rank, timeout, join_id)
    except BaseException:
        if owns_store:
            store.close()
        raise


def _connect(url: str, rank: int, world_size: int, timeout: float, token: str):
    from .rendezvous import TCPStore, connect_store

    served = False
    if config.get("TORCHELASTIC_USE_AGENT_STORE"):
        url, served = _beside_torchrun_agent(url, rank, world_size, timeout, token)
    parsed = urlparse(url)
    serve = (parsed.scheme == "tcp" and rank == 0 and not served
             and not config.get("GPUCOLL_LAUNCHER_STORE"))
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


def _beside_torchrun_agent(url: str, rank: int, world_size: int, timeout: float,
                           token: str) -> Tuple[str, bool]:
    """Under torchrun, whose agent already serves torch's own store on MASTER_PORT: rank 0
    serves gpucoll's store on a free port and publishes its address in the agent's store
    (through torch, which torchrun implies); the other ranks read it there.

    Returns:
        (the ``tcp://`` URL of gpucoll's store, whether this process serves it); ``url``
        unchanged when it is not MASTER_ADDR:MASTER_PORT.
    """
    env = detect_environment()
    parsed = urlparse(url)
    if parsed.scheme != "tcp" or (parsed.hostname, parsed.port) != (env.master_addr,
                                                                     env.master_port):
        return url, False
    import datetime

    import torch.distributed as dist

    from .rendezvous import TCPStoreServer
    from .rendezvous.hosts import route_address

    key = (f"gpucoll/store/{config.get('TORCHELASTIC_RUN_ID')}/"
           f"{config.get('TORCHELASTIC_RESTART_COUNT')}")
    agent = dist.TCPStore(env.master_addr, env.master_port, world_size, False,
                          timeout=datetime.timedelta(seconds=timeout))
    if rank == 0:
        one_host = env.local_size == world_size
        host = "127.0.0.1" if one_host else route_address(env.master_addr, env.master_port)
        server = _SERVERS.get(("torchrun", key))
        if server is None:  # not re-initialising: serve and publish
            server = TCPStoreServer("127.0.0.1" if one_host else "0.0.0.0", 0, token=token)
            _SERVERS[("torchrun", key)] = server  # lives as long as this process
            agent.set(key, f"{host}:{server.port}")
        found = f"{host}:{server.port}"
    else:
        try:
            found = agent.get(key).decode()
        except Exception as exc:  # torch raises its own timeout types
            raise CommTimeoutError(f"rank {rank}: rank 0 did not publish gpucoll's store in "
                                   f"torchrun's store within {timeout:g} s ({exc})", rank=rank,
                                   op="init") from None
    log.info("rank %d: gpucoll store at %s (beside torchrun's agent store)", rank, found)
    return f"tcp://{found}", rank == 0
