"""The one place that reads environment variables.

Every runtime option is declared once in :data:`SETTINGS` with its type, default and
documentation; the README's table is generated from it (``python -m gpucoll.config``).
Launcher variables (torchrun, Slurm, Open MPI, MPICH/PMI) are declared here too, so that
no other module touches ``os.environ``.

Values are read at call time, so a test (or a launcher) can set a variable and the next
``get`` sees it. An unknown ``GPUCOLL_*`` name in the environment is reported by
:func:`unknown_names` (``gpucoll.init`` warns about it), which catches typos such as
``GPUCOLL_TIMOUT``.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

__all__ = ["Setting", "SETTINGS", "parse_bytes", "set_default", "get", "get_raw", "is_set",
           "unknown_names", "closest_name", "unknown_name_warnings", "markdown_table"]


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _parse_bytes(text: str) -> int:
    """Parse '4194304', '4MiB', '256KiB', '1G' into a byte count (binary multiples)."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
             "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
             "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
             "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
    stripped = text.strip().lower()
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number):].strip()
    if unit not in units or not number:
        raise ValueError(f"expected a byte count such as 4194304, 256KiB or 4MiB, got {text!r}")
    value = float(number) * units[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


parse_bytes = _parse_bytes  # the one byte-count grammar (settings and command lines)


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return value

    parse.__name__ = " / ".join(choices)
    return parse


def _name(text: str) -> str:
    """A lower-case name, checked by whoever owns the list of names (e.g. the backend registry)."""
    value = text.strip().lower()
    if not value:
        raise ValueError("expected a name, got an empty value")
    return value


_name.__name__ = "name"


@dataclass(frozen=True)
class Setting:
    """One environment variable: name, parser, default and documentation."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    group: str = "gpucoll"

    @property
    def type_name(self) -> str:
        names = {str: "str", int: "int", float: "float", _parse_bool: "bool", _parse_bytes: "bytes"}
        return names.get(self.parse, getattr(self.parse, "__name__", "str"))


_GPUCOLL = [
    Setting("GPUCOLL_BACKEND", _name, "auto",
            "Backend for `init()` when none is passed: `auto` picks NCCL when CuPy, NCCL and a GPU "
            "are usable, else `cpu`; or the name of any registered backend (`cpu`, `nccl`, or "
            "one added with `register_backend`)."),
    Setting("GPUCOLL_INIT_URL", str, "env://",
            "Rendezvous URL for `init()` when none is passed: `env://`, `tcp://host:port` or "
            "`file:///path`."),
    Setting("GPUCOLL_TIMEOUT", float, 300.0,
            "Seconds any blocking call (rendezvous, collective, point-to-point, barrier) may wait "
            "before it raises `CommTimeoutError`."),
    Setting("GPUCOLL_AUTH_TOKEN", str, "",
            "Shared secret that authenticates every store and transport connection (HMAC "
            "challenge; the token itself never crosses the wire). `gpucoll run` makes a fresh "
            "one per job. Empty: connections are checked against the empty key."),
    Setting("GPUCOLL_TRANSPORT", _choice("auto", "shm", "socket", "tcp", "unix"), "auto",
            "Peer transport of the CPU backend: `auto` runs collectives among ranks on one host "
            "through shared memory (sockets, with a warning, when it cannot be set up), Unix "
            "domain sockets for their point-to-point and TCP across hosts; `shm` is `auto` "
            "that raises instead of falling back; `socket` never uses shared memory; `tcp` "
            "forces TCP; `unix` forbids TCP (both socket-only)."),
    Setting("GPUCOLL_SHM_BYTES", _parse_bytes, 2 << 20,
            "Shared-memory slot per rank (twice: two buffer sets; at least 64 KiB); a host's "
            "segment in /dev/shm holds 2 x this x its ranks. Larger messages go in slot-sized steps."),
    Setting("GPUCOLL_SHM_SINGLE_COPY", _parse_bool, True,
            "Large shared-memory collectives read peers' arrays directly (Linux "
            "process_vm_readv, one copy instead of two) when every local rank can; 0 keeps "
            "every byte in the shared segment."),
    Setting("GPUCOLL_HOST_ID", str, "",
            "Override this rank's host id (which ranks share a host, hence shared memory and "
            "node-aware collectives); for tests that pretend to be several hosts."),
    Setting("GPUCOLL_HOST", str, "",
            "Address this rank publishes for TCP peers. Empty: the address of the interface "
            "that routes to the store (MASTER_ADDR)."),
    Setting("GPUCOLL_SOCKET_BUFFER", _parse_bytes, 0,
            "SO_SNDBUF / SO_RCVBUF for peer sockets (capped by net.core.wmem_max / rmem_max). "
            "0: the kernel's autotuning for TCP, 4 MiB for Unix sockets."),
    Setting("GPUCOLL_CHUNK_BYTES", _parse_bytes, 256 << 10,
            "Pipelining granularity of the ring: bytes received before they are reduced."),
    Setting("GPUCOLL_RING_THRESHOLD", _parse_bytes, 256 << 10,
            "All-reduces whose per-rank share (bytes / world size) is at least this use the "
            "ring; smaller ones use recursive doubling. Broadcast and reduce switch to their "
            "bandwidth algorithms at 16x and 64x this share."),
    Setting("GPUCOLL_ALGORITHM", str, "auto",
            "Force algorithms, e.g. `all_reduce=ring` or `all_reduce=recursive_doubling,"
            "broadcast=ring` (`auto`: chosen by size and world size)."),
    Setting("GPUCOLL_DEBUG", _parse_bool, False,
            "Check before every collective that all ranks called the same op with the same "
            "dtype, shape, root and sequence number; raise `CollectiveMismatchError` otherwise."),
    Setting("GPUCOLL_LAUNCHER_STORE", _parse_bool, False,
            "Set by `gpucoll run`: the launcher serves the store at MASTER_ADDR:MASTER_PORT, so "
            "rank 0 does not start one."),
    Setting("GPUCOLL_LAUNCHER_PID", int, None,
            "Set by `gpucoll run`, `gc.spawn` and `gpucoll bench`: the launcher's process id. "
            "`init()` in a rank then stops the rank when that process dies, even by SIGKILL "
            "(SIGTERM, then SIGKILL after `GPUCOLL_ORPHAN_GRACE`); unset (torchrun, mpiexec, "
            "srun): no such guard."),
    Setting("GPUCOLL_LAUNCHER_PID_NAMESPACE", str, "",
            "Set with `GPUCOLL_LAUNCHER_PID`: the launcher's pid namespace (`pid:[4026531836]`). "
            "A rank in another one (a container with its own pids) is not guarded."),
    Setting("GPUCOLL_ORPHAN_GRACE", float, 3.0,
            "Seconds between the SIGTERM and the SIGKILL a rank gets when its launcher died "
            "(time for a SIGTERM handler to save a checkpoint); under `gpucoll run` the same "
            "for each rank's process group (the launcher's orphan reaper)."),
    Setting("GPUCOLL_NODE_SILENCE", float, 10.0,
            "`gpucoll run --nnodes N`: seconds without word from another node's launcher (a "
            "lost host, a cut link) after which node 0's launcher, its own ranks done, stops "
            "serving the store for that node; 0 closes the store as soon as this node's ranks "
            "are done."),
    Setting("GPUCOLL_TRACE_BUFFER", int, 256,
            "Operations each communicator remembers for `comm.trace()` and the failure dumps "
            "(the flight recorder), read at its first operation; 0 records nothing."),
    Setting("GPUCOLL_TRACE_DIR", str, "",
            "When set, a rank writes its communicator's trace as JSON here "
            "(`trace-rank<world rank>-<communicator id>.json`) when the communicator is aborted "
            "(every timeout, dead peer and mismatch aborts it) and when the failed operation "
            "raises; best effort, never an error of its own. `gpucoll trace DIR` compares "
            "the ranks' dumps."),
    Setting("GPUCOLL_LOG_LEVEL", _choice("debug", "info", "warning", "error"), "warning",
            "Level of the `gpucoll` logger."),
    Setting("GPUCOLL_JOIN", str, "",
            "When set (to any id), `init()` joins a running job instead of starting one: it "
            "waits until the members of a communicator call `grow()`, then records the id as "
            "admitted in the store. `gpucoll run --elastic --replace N` sets it for the ranks "
            "it starts in place of lost ones."),
    Setting("GPUCOLL_QUIET", _parse_bool, False,
            "Do not print the one line `init()` writes to stderr when it finds no launcher and "
            "runs as a world of one (rank 0 of 1, CPU backend)."),
    Setting("GPUCOLL_DEVICE", int, None,
            "NCCL backend: the GPU this rank uses. Default: the local rank modulo the number of "
            "visible GPUs."),
    Setting("GPUCOLL_MPI_BLOCKING", _parse_bool, False,
            "MPI backend: blocking calls on NumPy arrays use MPI's blocking collectives (2-3x "
            "faster from 4 KiB to a few MiB on Open MPI); a call still blocked at the timeout "
            "cannot raise, so the process prints the error and exits with status 124."),
    Setting("GPUCOLL_WATCHDOG_INTERVAL", float, 0.05,
            "NCCL backend: seconds between the watchdog's checks of outstanding GPU work and "
            "of NCCL's asynchronous errors."),
]

_LAUNCHERS = [
    # torchrun / gpucoll run
    Setting("RANK", int, None, "Global rank (torchrun, `gpucoll run`).", "torchrun"),
    Setting("WORLD_SIZE", int, None, "Number of ranks (torchrun, `gpucoll run`).", "torchrun"),
    Setting("LOCAL_RANK", int, None, "Rank on this host (torchrun, `gpucoll run`).", "torchrun"),
    Setting("LOCAL_WORLD_SIZE", int, None, "Ranks on this host (torchrun, `gpucoll run`).", "torchrun"),
    Setting("MASTER_ADDR", str, None, "Host of the rendezvous store.", "torchrun"),
    Setting("MASTER_PORT", int, None, "Port of the rendezvous store.", "torchrun"),
    Setting("TORCHELASTIC_USE_AGENT_STORE", _parse_bool, False,
            "Set by torchrun when its agent serves torch's store on MASTER_PORT: rank 0 then "
            "serves gpucoll's store on a free port and publishes it there.", "torchrun"),
    Setting("TORCHELASTIC_RUN_ID", str, "none", "torchrun's job id (names the published store "
            "address).", "torchrun"),
    Setting("TORCHELASTIC_RESTART_COUNT", int, 0, "torchrun's restart count (names the published "
            "store address).", "torchrun"),
    # Slurm
    Setting("SLURM_PROCID", int, None, "Global rank under `srun`.", "slurm"),
    Setting("SLURM_NTASKS", int, None, "Number of ranks under `srun`.", "slurm"),
    Setting("SLURM_LOCALID", int, None, "Rank on this node under `srun`.", "slurm"),
    Setting("SLURM_NTASKS_PER_NODE", str, None, "Tasks per node under `srun` (e.g. `4` or `4(x2)`).", "slurm"),
    Setting("SLURM_JOB_NODELIST", str, None, "Nodes of the job; the first one hosts the store when "
            "MASTER_ADDR is unset.", "slurm"),
    Setting("SLURM_JOB_ID", int, None, "Job id; MASTER_PORT defaults to 29500 + id % 1000 under Slurm.", "slurm"),
    # Open MPI
    Setting("OMPI_COMM_WORLD_RANK", int, None, "Global rank under Open MPI's `mpiexec`.", "openmpi"),
    Setting("OMPI_COMM_WORLD_SIZE", int, None, "Number of ranks under Open MPI.", "openmpi"),
    Setting("OMPI_COMM_WORLD_LOCAL_RANK", int, None, "Rank on this host under Open MPI.", "openmpi"),
    Setting("OMPI_COMM_WORLD_LOCAL_SIZE", int, None, "Ranks on this host under Open MPI.", "openmpi"),
    # MPICH / Hydra / PMI
    Setting("PMI_RANK", int, None, "Global rank under MPICH (PMI).", "pmi"),
    Setting("PMI_SIZE", int, None, "Number of ranks under MPICH (PMI).", "pmi"),
    Setting("MPI_LOCALRANKID", int, None, "Rank on this host under MPICH (Hydra).", "pmi"),
    Setting("MPI_LOCALNRANKS", int, None, "Ranks on this host under MPICH (Hydra).", "pmi"),
    # NCCL's own variables: NCCL_MULTI_RANK_GPU_ENABLE is read to decide whether backend "auto"
    # may put several local ranks on one GPU; NCCL_RUNTIME_CONNECT is given a default
    Setting("NCCL_MULTI_RANK_GPU_ENABLE", _parse_bool, False,
            "NCCL >= 2.30: allow several ranks on one GPU (experimental).", "nccl"),
    Setting("NCCL_RUNTIME_CONNECT", str, None,
            "NCCL: `1` connects peers lazily inside the first call that needs them (NCCL's "
            "default); `0` at communicator creation. The NCCL backend sets `0` when unset, so a "
            "missing peer shows at `init()`, within the timeout.", "nccl"),
]

SETTINGS: Dict[str, Setting] = {s.name: s for s in _GPUCOLL + _LAUNCHERS}


def set_default(name: str, value: str) -> bool:
    """Give a declared variable a value in this process's environment unless it is set, for
    libraries that read it themselves (NCCL). Returns whether it was set now."""
    _lookup(name)
    if name in os.environ:
        return False
    os.environ[name] = str(value)
    return True


def _lookup(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a declared gpucoll setting; add it to gpucoll.config.SETTINGS") from None


def get_raw(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The variable's text, or None when it is unset (declared names only)."""
    _lookup(name)
    env = os.environ if environ is None else environ
    return env.get(name)


def is_set(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    text = get_raw(name, environ)
    return text is not None and text.strip() != ""


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The typed value of a declared variable, or its default when unset or empty.

    Raises:
        KeyError: the name is not declared.
        ValueError: the value does not parse; the message names the variable.
    """
    setting = _lookup(name)
    text = get_raw(name, environ)
    if text is None or text.strip() == "":
        return setting.default
    try:
        return setting.parse(text)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={text!r}: {exc}") from None


def unknown_names(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """GPUCOLL_* variables in the environment that no setting declares (likely typos)."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("GPUCOLL_") and k not in SETTINGS)


def closest_name(name: str) -> Optional[str]:
    """The declared GPUCOLL_* setting ``name`` most likely misspells, or None."""
    prefix = "GPUCOLL_"
    suffixes = {s.name[len(prefix):]: s.name for s in _GPUCOLL}  # the shared prefix says nothing
    typed = name[len(prefix):] if name.startswith(prefix) else name
    found = difflib.get_close_matches(typed.upper(), list(suffixes), n=1, cutoff=0.6)
    return suffixes[found[0]] if found else None


def unknown_name_warnings(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """One message per unknown GPUCOLL_* variable, suggesting the closest real name."""
    messages = []
    for name in unknown_names(environ):
        suggestion = closest_name(name)
        hint = f"did you mean {suggestion}?" if suggestion else \
            "`python -m gpucoll.config` lists the settings"
        messages.append(f"unknown environment variable {name} (not a gpucoll setting; {hint})")
    return messages


def markdown_table() -> str:
    """The README's table of variables."""
    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for setting in SETTINGS.values():
        if setting.group != "gpucoll":
            continue
        default = "" if setting.default in (None, "") else f"`{setting.default}`"
        lines.append(f"| `{setting.name}` | {setting.type_name} | {default} | {setting.doc} |")
    lines.append("")
    lines.append("Other variables read by `init()` (launchers: rank, size, local rank, store "
                 "address; NCCL: whether ranks may share a GPU):")
    lines.append("")
    groups: Dict[str, List[str]] = {}
    for setting in SETTINGS.values():
        if setting.group != "gpucoll":
            groups.setdefault(setting.group, []).append(f"`{setting.name}`")
    for group, names in groups.items():
        lines.append(f"- {group}: {', '.join(names)}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - documentation helper
    sys.stdout.write(markdown_table() + "\n")
