"""The one table of backends: ``init``, ``GPUCOLL_BACKEND``, ``gpucoll bench --backend``,
``backend="auto"`` and ``gpucoll doctor`` all read it.

A backend is one :func:`register_backend` call: a factory that builds its communicator, a
probe that says why it cannot run here (None when it can), the memory its arrays live in, the
``init()`` options it takes, and, when ``auto`` may pick it, a priority. ``auto`` takes the
usable backend of highest priority.

Example::

    from gpucoll.backends.registry import register_backend

    register_backend("mine", lambda store, rank, size, **common: MyCommunicator(...),
                     unavailable_reason=lambda: None, memory="host")
    gpucoll.init(backend="mine")          # or GPUCOLL_BACKEND=mine
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional

from ..errors import BackendUnavailableError

__all__ = ["BackendSpec", "register_backend", "unregister_backend", "get_backend",
           "backend_names", "available_backends", "resolve_backend", "MEMORY_KINDS"]

log = logging.getLogger("gpucoll")

MEMORY_KINDS = ("host", "cuda")

# Settings every factory receives from init(): factory(store, rank, world_size, **COMMON).
COMMON_SETTINGS = ("comm_id", "token", "timeout", "debug", "owns_store")


def _always_available() -> Optional[str]:
    return None


@dataclass(frozen=True)
class BackendSpec:
    """One registered backend.

    Attributes:
        name: what ``init(backend=)`` and ``GPUCOLL_BACKEND`` say.
        factory: ``factory(store, rank, world_size, *, comm_id, token, timeout, debug,
            owns_store, **options) -> Communicator``.
        unavailable_reason: ``() -> None`` when the backend can run here, else why not (with
            the fix); may import heavy modules, so it is called only when needed.
        memory: where the arrays it takes live: ``"host"`` or ``"cuda"``.
        options: the ``init()`` keyword options it accepts besides the common ones
            (e.g. ``"device"``, ``"transport"``); others are refused before anything starts.
        auto_priority: ``auto`` tries backends of higher priority first; None: never auto.
        auto_reason: for ``auto`` only, ``(local_size) -> None or why not`` on top of
            ``unavailable_reason`` (e.g. more ranks on this host than GPUs).
        description: one line for ``gpucoll doctor`` and the CLI help.
        unavailable_hint: what to do instead when it cannot run (said in the error).
        needs_store: False for a backend that brings its own rendezvous (MPI): ``init()``
            then opens no store and passes ``store=None`` to the factory.
        details: ``() -> {name: value}`` of facts ``gpucoll doctor`` shows when the backend
            is available (library versions, CUDA-awareness...); None: nothing more.
        auto_precheck: for ``auto`` only, a cheap ``() -> None or why not`` asked before
            ``unavailable_reason``: a reason rules the backend out without the full probe
            (NCCL's: no CUDA driver, said before CuPy is imported).
    """

    name: str
    factory: Callable
    unavailable_reason: Callable[[], Optional[str]] = _always_available
    memory: str = "host"
    options: FrozenSet[str] = field(default_factory=frozenset)
    auto_priority: Optional[int] = None
    auto_reason: Optional[Callable[[Optional[int]], Optional[str]]] = None
    description: str = ""
    unavailable_hint: str = ""
    needs_store: bool = True
    details: Optional[Callable[[], Dict[str, Any]]] = None
    auto_precheck: Optional[Callable[[], Optional[str]]] = None


_REGISTRY: Dict[str, BackendSpec] = {}


def register_backend(name: str, factory: Callable,
                     unavailable_reason: Optional[Callable[[], Optional[str]]] = None, *,
                     memory: str = "host", options: Iterable[str] = (),
                     auto_priority: Optional[int] = None,
                     auto_reason: Optional[Callable[[Optional[int]], Optional[str]]] = None,
                     description: str = "", unavailable_hint: str = "",
                     needs_store: bool = True,
                     details: Optional[Callable[[], Dict[str, Any]]] = None,
                     auto_precheck: Optional[Callable[[], Optional[str]]] = None) -> BackendSpec:
    """Add (or replace) a backend; see :class:`BackendSpec` for the arguments.

    Raises:
        ValueError: a bad name ("auto" is reserved) or memory kind.
    """
    name = str(name).strip().lower()
    if not name or name == "auto" or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"register_backend: bad backend name {name!r} (letters, digits, - and "
                         f"_; 'auto' is reserved)")
    if memory not in MEMORY_KINDS:
        raise ValueError(f"register_backend({name!r}): memory must be one of {MEMORY_KINDS}, "
                         f"got {memory!r}")
    spec = BackendSpec(name, factory, unavailable_reason or _always_available, memory,
                       frozenset(options), auto_priority, auto_reason, description,
                       unavailable_hint, bool(needs_store), details, auto_precheck)
    _REGISTRY[name] = spec
    return spec


def unregister_backend(name: str) -> None:
    """Remove a backend (tests; a plug-in being unloaded)."""
    _REGISTRY.pop(name, None)


def backend_names() -> List[str]:
    """Registered backend names, in registration order (without "auto")."""
    return list(_REGISTRY)


def get_backend(name: str) -> BackendSpec:
    """The spec registered under ``name``.

    Raises:
        ValueError: no such backend (the message lists the registered ones).
    """
    spec = _REGISTRY.get(str(name).strip().lower())
    if spec is None:
        raise ValueError(f"unknown backend {name!r}; registered: auto, "
                         f"{', '.join(_REGISTRY)}")
    return spec


def available_backends() -> Dict[str, str]:
    """backend name -> "available" or the reason it is not (probes each backend)."""
    result = {}
    for name, spec in _REGISTRY.items():
        try:
            result[name] = spec.unavailable_reason() or "available"
        except Exception as exc:  # a probe must not break the report
            result[name] = f"probe failed ({type(exc).__name__}: {exc})"
    return result


def _auto_choice(local_size: Optional[int]) -> str:
    ranked = sorted((spec for spec in _REGISTRY.values() if spec.auto_priority is not None),
                    key=lambda spec: -spec.auto_priority)
    reasons = []
    for spec in ranked:
        reason = spec.auto_precheck() if spec.auto_precheck is not None else None
        if reason is None:
            reason = spec.unavailable_reason()
        if reason is None and spec.auto_reason is not None:
            reason = spec.auto_reason(local_size)
        if reason is None:
            return spec.name
        reasons.append(f"{spec.name}: {reason}")
        log.info("backend auto: not %s (%s)", spec.name, reason)
    raise BackendUnavailableError("backend 'auto' found no usable backend (" + "; ".join(reasons)
                                  + ")")


def resolve_backend(backend: Optional[str], local_size: Optional[int] = None) -> str:
    """The backend name ``init(backend=...)`` uses: ``auto`` becomes the usable backend of
    highest priority (NCCL when CuPy, NCCL and a GPU are usable and each of the
    ``local_size`` ranks on this host can have a GPU, else ``cpu``).

    Raises:
        ValueError: unknown backend name.
        BackendUnavailableError: the named backend cannot run here (says how to fix it).
    """
    name = str(backend).strip().lower()
    if name == "auto":
        return _auto_choice(local_size)
    spec = get_backend(name)
    reason = spec.unavailable_reason()
    if reason is not None:
        hint = spec.unavailable_hint or "use another backend or backend='auto'"
        raise BackendUnavailableError(
            f"backend {name!r} cannot run here: {reason}. {hint[0].upper() + hint[1:]}; "
            f"`gpucoll doctor` shows what is installed")
    return name
