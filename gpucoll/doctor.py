"""``gpucoll doctor``: is this environment ready for the NCCL backend, and if not, why not.

It reports the gpucoll, Python and platform versions; the CuPy distributions installed (more
than one is a clash) and the CuPy version; the CUDA runtime and driver versions; NCCL as CuPy
sees it (available or not, the runtime version, the version CuPy was built against, CuPy's
floor, which ``libnccl.so.2`` was loaded and whether it came from an ``nvidia-nccl-cu*`` wheel
or the system); the GPUs with their peer-access matrix; and which backend ``backend="auto"``
picks, with the reason. Mismatched wheels (``nvidia-nccl-cu12`` next to ``nvidia-nccl-cu13``,
``cupy-cuda12x`` with only ``nvidia-nccl-cu13``, two CuPy wheels), a system NCCL loaded in
place of the installed wheel, an NCCL older than CuPy's floor and a missing NCCL wheel are
warnings, each with the exact ``pip`` commands that fix it.

Every probe is wrapped: a failure becomes text in the report, never a traceback. Importing
this module does not import CuPy; :func:`collect` does.

Exit status: 0 whenever the report was produced (warnings included); with ``--strict``, 1 when
there is a warning.

``gpucoll doctor --json`` prints one JSON object with these keys (all always present):

- ``gpucoll_version`` (str), ``platform`` (str).
- ``python``: ``version``, ``implementation``, ``executable``.
- ``distributions``: installed distribution name (normalized, e.g. ``cupy-cuda12x``) ->
  version, for names starting with ``cupy`` or ``nvidia-nccl-cu``.
- ``cupy``: ``installed`` (a CuPy distribution is installed), ``importable``, ``version``,
  ``distributions`` (the CuPy ones: name -> version), ``cuda`` and ``packaging`` (from CuPy's
  preload config, e.g. ``"12.x"`` and ``"pip"``), ``errors`` (list of str).
- ``cuda``: ``runtime_version`` / ``driver_version`` (``"12.9"`` or null; a driver version of
  0 means no driver), ``runtime_version_code`` / ``driver_version_code`` (the raw ints),
  ``kernel_module_version`` (the NVIDIA kernel module's, from /proc, or null), ``errors``.
- ``nccl``: ``available``, ``version`` / ``version_code`` (the library loaded at run time),
  ``build_version`` / ``build_version_code`` (what CuPy was built against), ``min_version``
  (CuPy's floor from its preload config, or null), ``library`` (path of the loaded
  ``libnccl.so*``, or null), ``source`` (``"wheel"``, ``"system"`` or null), ``wheels``
  (``nvidia-nccl-cu*`` name -> version), ``wheel_dirs`` (their ``libnccl`` directories),
  ``errors``.
- ``gpus``: ``available``, ``unavailable_reason`` (null when a GPU is usable), ``count``,
  ``devices`` (``index``, ``name``, ``memory_bytes``, ``pci_bus_id``, ``compute_capability``,
  ``numa_node``), ``peer_access`` (count x count booleans; true on the diagonal), ``errors``.
- ``backend``: ``auto`` (``"nccl"`` or ``"cpu"``), ``reason``, ``configured`` (the value of
  ``GPUCOLL_BACKEND``), ``nccl_backend`` (``"available"`` or why gpucoll cannot offer it).
- ``backends``: every registered backend's name -> ``status`` (``"available"`` or why not),
  ``details`` where the backend reports more (MPI: mpi4py, the library, ``cuda_aware``),
  ``memory`` (``"host"`` / ``"cuda"``) and ``description``.
- ``warnings`` (list of str) and ``fix`` (the pip commands, one per line, or null).

Example::

    gpucoll doctor
    gpucoll doctor --json | python -m json.tool
    gpucoll doctor --strict        # exit 1 on any warning (CI, container builds)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from . import __version__
from .cuda_env import (classify_nccl_path, cuda_version_text, decode_nccl_version,
                       gpu_inventory, gpu_unavailable_reason, installed_distributions,
                       is_cupy_distribution, kernel_module_version, loaded_library,
                       nccl_cuda_major, nccl_fix_hint, nccl_wheel_dirs, preload_config,
                       version_tuple, wheel_clashes)

__all__ = ["collect", "format_text", "main", "add_arguments"]

_NO_GPU_PREFIX = "No usable GPU: "


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _attempt(errors: List[str], what: str, probe: Callable[[], Any], default: Any = None) -> Any:
    """``probe()``, or ``default`` with ``"what: Error: message"`` appended to ``errors``."""
    try:
        return probe()
    except Exception as exc:
        errors.append(f"{what}: {_describe(exc)}")
        return default


# ---------------------------------------------------------------- the report
def _cupy_section(dists: Dict[str, str]) -> Tuple[Dict[str, Any], Any, Dict[str, Any]]:
    """The ``cupy`` section, the imported module (None when it does not import) and CuPy's
    preload config (``{}`` when it has none)."""
    section: Dict[str, Any] = {
        "installed": any(is_cupy_distribution(name) for name in dists), "importable": False,
        "version": None, "distributions": {n: v for n, v in dists.items() if is_cupy_distribution(n)},
        "cuda": None, "packaging": None, "errors": []}
    module = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import cupy as module
        except Exception as exc:  # ImportError, or a CUDA install CuPy cannot load
            section["errors"].append(f"import cupy: {_describe(exc)}")
    section["errors"] += [f"warning: {_describe(w.message)}" for w in caught]
    if module is None:
        return section, None, {}
    section["importable"] = True
    section["version"] = str(getattr(module, "__version__", None))
    config = _attempt(section["errors"], "CuPy preload config", preload_config, {})
    section["cuda"], section["packaging"] = config.get("cuda"), config.get("packaging")
    return section, module, config


def _cuda_section(cupy: Any) -> Dict[str, Any]:
    section: Dict[str, Any] = {
        "runtime_version": None, "runtime_version_code": None, "driver_version": None,
        "driver_version_code": None, "kernel_module_version": kernel_module_version(),
        "errors": []}
    if cupy is None:
        return section
    runtime = cupy.cuda.runtime
    if getattr(runtime, "is_hip", False):
        section["errors"].append("CuPy is built for ROCm (HIP), not CUDA")
        return section
    errors = section["errors"]
    code = _attempt(errors, "runtimeGetVersion", runtime.runtimeGetVersion)
    if code:
        section["runtime_version_code"] = int(code)
        section["runtime_version"] = cuda_version_text(int(code))
    code = _attempt(errors, "driverGetVersion (no CUDA driver)", runtime.driverGetVersion)
    if code is not None:
        section["driver_version_code"] = int(code)
        if code:
            section["driver_version"] = cuda_version_text(int(code))
        else:
            errors.append("driverGetVersion returned 0: no CUDA driver (libcuda.so.1) found")
    return section


def _nccl_section(cupy: Any, dists: Dict[str, str], preload: Dict[str, Any]) -> Dict[str, Any]:
    wheels = {name: dists[name] for name in sorted(dists) if nccl_cuda_major(name) is not None}
    floor = preload.get("nccl") if isinstance(preload.get("nccl"), dict) else {}
    section: Dict[str, Any] = {
        "available": False, "version": None, "version_code": None, "build_version": None,
        "build_version_code": None, "min_version": floor.get("min_pypi_version"),
        "library": None, "source": None, "wheels": wheels, "wheel_dirs": [], "errors": []}
    errors = section["errors"]
    section["wheel_dirs"] = _attempt(errors, "locating the NCCL wheels' files",
                                     lambda: nccl_wheel_dirs(list(wheels)), [])
    nccl = None
    if cupy is None:
        errors.append("CuPy is not importable, so CuPy's NCCL is not either")
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                from cupy.cuda import nccl
            except Exception as exc:
                errors.append(f"import cupy.cuda.nccl: {_describe(exc)}")
        errors += [f"warning: {_describe(w.message)}" for w in caught]
    if nccl is not None:
        section["available"] = bool(getattr(nccl, "available", False))
        if not section["available"]:
            errors.append("cupy.cuda.nccl.available is False (libnccl.so.2 could not be "
                          "loaded, or CuPy was built without NCCL)")
        else:
            code = _attempt(errors, "nccl.get_version", nccl.get_version)
            if code:
                section["version_code"] = int(code)
                section["version"] = _attempt(errors, "decoding the NCCL version",
                                              lambda: decode_nccl_version(code))
            code = _attempt(errors, "nccl.get_build_version", nccl.get_build_version)
            if code:
                section["build_version_code"] = int(code)
                section["build_version"] = _attempt(errors, "decoding the build version",
                                                    lambda: decode_nccl_version(code))
    path = loaded_library("libnccl.so")
    if path is None and section["available"]:
        errors.append("no libnccl.so* is mapped into this process (linked statically, or "
                      "/proc/self/maps is unreadable)")
    if path is not None:
        section["library"] = path
        section["source"] = classify_nccl_path(os.path.realpath(path), section["wheel_dirs"])
    return section


def _gpu_section(cupy: Any) -> Dict[str, Any]:
    reason = gpu_unavailable_reason()
    section: Dict[str, Any] = {"available": reason is None, "unavailable_reason": reason,
                               "count": 0, "devices": [], "peer_access": [], "errors": []}
    if reason is not None:
        return section
    errors = section["errors"]
    runtime = cupy.cuda.runtime
    count = _attempt(errors, "getDeviceCount", runtime.getDeviceCount, 0)
    section["count"] = int(count)
    keys = ("index", "name", "memory_bytes", "pci_bus_id", "compute_capability", "numa_node")
    devices = _attempt(errors, "device properties", lambda: gpu_inventory(cupy), [])
    section["devices"] = [{key: device.get(key) for key in keys} for device in devices]

    def can_access(i: int, j: int) -> bool:
        return i == j or bool(runtime.deviceCanAccessPeer(i, j))

    section["peer_access"] = _attempt(
        errors, "deviceCanAccessPeer",
        lambda: [[can_access(i, j) for j in range(count)] for i in range(count)], [])
    return section


def _backend_section(report: Dict[str, Any]) -> Dict[str, Any]:
    from . import config
    from .backends.registry import available_backends, resolve_backend

    section: Dict[str, Any] = {"auto": "cpu", "reason": "", "configured": None,
                               "nccl_backend": None}
    try:
        section["configured"] = config.get("GPUCOLL_BACKEND")
    except ValueError as exc:
        section["configured"] = f"invalid ({exc})"
    try:
        section["nccl_backend"] = available_backends().get("nccl", "unknown")
    except Exception as exc:
        section["nccl_backend"] = _describe(exc)
    cupy, nccl, gpus = report["cupy"], report["nccl"], report["gpus"]
    if not cupy["importable"]:
        section["reason"] = "CuPy is not importable" + (
            f" ({cupy['errors'][0]})" if cupy["errors"] else "")
    elif not nccl["available"]:
        section["reason"] = "CuPy's NCCL is not available" + (
            f" ({nccl['errors'][-1]})" if nccl["errors"] else "")
    elif not gpus["available"]:
        section["reason"] = f"no usable GPU ({gpus['unavailable_reason']})"
    elif section["nccl_backend"] != "available":
        section["reason"] = (f"CuPy, NCCL and {gpus['count']} GPU(s) are usable, but gpucoll's "
                             f"nccl backend is not: {section['nccl_backend']}")
    else:
        section["auto"] = "nccl"
        section["reason"] = (f"CuPy {cupy['version']}, NCCL {nccl['version']} and "
                             f"{gpus['count']} GPU(s) are usable")
    try:
        chosen = resolve_backend("auto")
    except Exception as exc:
        chosen, section["reason"] = section["auto"], f"{section['reason']}; auto failed: {_describe(exc)}"
    if chosen not in ("cpu", "nccl"):  # a registered backend ranks above both
        section["auto"] = chosen
        section["reason"] = f"backend {chosen!r} is registered with a higher auto priority and is usable"
    return section


def _backends_section() -> Dict[str, Any]:
    """Every registered backend: whether it can run here, its memory and description."""
    from .backends.registry import available_backends, backend_names, get_backend

    status = available_backends()
    section: Dict[str, Any] = {}
    for name in backend_names():
        spec = get_backend(name)
        entry = section[name] = {"status": status[name], "memory": spec.memory,
                                 "description": spec.description}
        if spec.details is not None and status[name] == "available":
            try:
                entry["details"] = spec.details()
            except Exception as exc:  # a report with the reason beats no report
                entry["details"] = {"error": _describe(exc)}
    return section


def _major(version: Optional[str]) -> Optional[int]:
    return int(version.split(".")[0]) if version else None


def _warnings(report: Dict[str, Any]) -> Tuple[List[str], bool]:
    """The report's warnings, and whether the NCCL install needs the pip fix."""
    dists, cupy, cuda, nccl = (report["distributions"], report["cupy"], report["cuda"],
                               report["nccl"])
    found = wheel_clashes(dists)
    needs_fix = bool(found)
    cupy_present = cupy["installed"] or cupy["importable"]
    via_conda = cupy["packaging"] == "conda"
    if cupy_present and not nccl["wheels"] and not via_conda:
        loaded = (f"; the system's {nccl['library']} is in use" if nccl["library"]
                  else "" if nccl["available"] else "; CuPy cannot load NCCL")
        found.append(f"no NCCL wheel (nvidia-nccl-cu12 / nvidia-nccl-cu13) is installed{loaded}")
        needs_fix = True
    elif cupy["importable"] and not nccl["available"]:
        found.append("CuPy is installed but its NCCL is not available: "
                     + "; ".join(nccl["errors"] or ["no reason given"]))
        needs_fix = True
    if nccl["source"] == "system" and nccl["wheels"]:
        found.append(f"libnccl was loaded from the system ({nccl['library']}) instead of the "
                     f"installed wheel ({', '.join(nccl['wheels'])}); check LD_LIBRARY_PATH and "
                     "LD_PRELOAD")
    if nccl["version"] and nccl["min_version"]:
        if version_tuple(nccl["version"]) < version_tuple(str(nccl["min_version"])):
            found.append(f"the loaded NCCL {nccl['version']} is older than CuPy's floor "
                         f"{nccl['min_version']}")
            needs_fix = True
    runtime_major, driver_major = _major(cuda["runtime_version"]), _major(cuda["driver_version"])
    if runtime_major and driver_major and runtime_major > driver_major:
        found.append(f"CuPy uses the CUDA {cuda['runtime_version']} runtime but the driver "
                     f"supports CUDA {cuda['driver_version']} only: update the NVIDIA driver or "
                     f"install the CUDA {driver_major} wheels")
        needs_fix = True
    if cuda["kernel_module_version"]:
        if not cupy["importable"]:
            found.append(f"the NVIDIA driver {cuda['kernel_module_version']} is loaded but CuPy "
                         "is not importable, so the GPUs go unused")
            needs_fix = True
        elif cuda["driver_version_code"] == 0:
            found.append(f"the NVIDIA kernel module {cuda['kernel_module_version']} is loaded but "
                         "libcuda.so.1 was not found (in a container: start it with --gpus all "
                         "and the NVIDIA Container Toolkit)")
    configured = report["backend"]["configured"]
    if configured == "nccl" and report["backend"]["auto"] != "nccl":
        found.append(f"GPUCOLL_BACKEND=nccl, but {report['backend']['reason']}: init() will "
                     "raise BackendUnavailableError")
    elif isinstance(configured, str) and configured.startswith("invalid"):
        found.append(f"GPUCOLL_BACKEND is {configured}")
    return found, needs_fix


def collect() -> Dict[str, Any]:
    """Probe the environment and return the whole report (keys in the module docstring).

    Imports CuPy (when installed); never raises for a failed probe: its error is recorded as
    text in the section's ``errors``.
    """
    early: List[str] = []
    dists = _attempt(early, "listing distributions", installed_distributions, {})
    report: Dict[str, Any] = {
        "gpucoll_version": __version__,
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": _attempt(early, "platform", platform.platform, sys.platform),
        "distributions": dists,
    }
    report["cupy"], cupy, preload = _cupy_section(dists)
    report["cupy"]["errors"][:0] = early
    report["cuda"] = _cuda_section(cupy)
    report["nccl"] = _nccl_section(cupy, dists, preload)
    gpu_errors: List[str] = []
    report["gpus"] = _attempt(gpu_errors, "GPU probe", lambda: _gpu_section(cupy)) or {
        "available": False, "unavailable_reason": f"the GPU probe failed ({gpu_errors[0]})",
        "count": 0, "devices": [], "peer_access": [], "errors": gpu_errors}
    report["backend"] = _backend_section(report)
    backend_errors: List[str] = []
    report["backends"] = _attempt(backend_errors, "backend registry", _backends_section, {})
    report["warnings"], needs_fix = _warnings(report)
    report["fix"] = (nccl_fix_hint(dists, _major(report["cuda"]["driver_version"]))
                     if needs_fix else None)
    return report


# ---------------------------------------------------------------- output
def _gib(nbytes: Optional[int]) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes else "? GiB"


def format_text(report: Dict[str, Any]) -> str:
    """The human-readable report."""
    label = "{:<10}".format
    lines = [label("gpucoll") + report["gpucoll_version"]]
    python = report["python"]
    lines.append(label("Python") + f"{python['version']} ({python['implementation']}) "
                 f"{python['executable']}")
    lines.append(label("Platform") + str(report["platform"]))

    cupy = report["cupy"]
    dists = ", ".join(f"{n} {v}" for n, v in cupy["distributions"].items()) or "none"
    if cupy["importable"]:
        built = f", CUDA {cupy['cuda']} {cupy['packaging']} build" if cupy["cuda"] else ""
        lines.append(label("CuPy") + f"{cupy['version']} (distributions: {dists}{built})")
    else:
        lines.append(label("CuPy") + f"not importable (distributions: {dists})")
    indent = " " * 10
    lines += [indent + error for error in cupy["errors"]]
    if not cupy["installed"] and not report["fix"]:
        lines.append(indent + "for GPUs: pip install 'gpucoll[cu12]' (CUDA 12 driver) or "
                     "'gpucoll[cu13]' (CUDA 13)")

    cuda = report["cuda"]
    if cupy["importable"]:
        driver = cuda["driver_version"] or "none"
        lines.append(label("CUDA") + f"runtime {cuda['runtime_version'] or '?'}, driver {driver}"
                     + (f" (kernel module {cuda['kernel_module_version']})"
                        if cuda["kernel_module_version"] else ""))
    else:
        module = cuda["kernel_module_version"]
        lines.append(label("CUDA") + (f"NVIDIA kernel module {module}" if module
                                      else "no NVIDIA kernel module"))
    lines += [indent + error for error in cuda["errors"]]

    nccl = report["nccl"]
    if nccl["available"]:
        floor = f", CuPy's floor {nccl['min_version']}" if nccl["min_version"] else ""
        lines.append(label("NCCL") + f"{nccl['version'] or '?'} loaded; CuPy built against "
                     f"{nccl['build_version'] or '?'}{floor}")
    else:
        lines.append(label("NCCL") + "not available")
    if nccl["library"]:
        where = ("wheel " + ", ".join(f"{n} {v}" for n, v in nccl["wheels"].items())
                 if nccl["source"] == "wheel" else "system")
        lines.append(indent + f"{nccl['library']} ({where})")
    if nccl["wheels"] and nccl["source"] != "wheel":
        lines.append(indent + "wheels: " + ", ".join(f"{n} {v}" for n, v in
                                                     nccl["wheels"].items()))
    if cupy["importable"]:
        lines += [indent + error for error in nccl["errors"]]

    gpus = report["gpus"]
    if gpus["available"]:
        lines.append(label("GPUs") + str(gpus["count"]))
        for device in gpus["devices"]:
            numa = f"  NUMA {device['numa_node']}" if device["numa_node"] is not None else ""
            lines.append(indent + f"GPU {device['index']}: {device['name']}  "
                         f"{_gib(device['memory_bytes'])}  bus {device['pci_bus_id']}  "
                         f"cc {device['compute_capability']}{numa}")
        if gpus["peer_access"]:
            lines.append(indent + "Peer access (1: yes; row: from, column: to)")
            lines.append(indent + "GPU " + "".join(f"{j:>4d}" for j in
                                                   range(len(gpus["peer_access"]))))
            lines += [indent + f"{i:>3d} " + "".join(f"{int(v):>4d}" for v in row)
                      for i, row in enumerate(gpus["peer_access"])]
        lines += [indent + error for error in gpus["errors"]]
    else:
        lines.append(f"{_NO_GPU_PREFIX}{gpus['unavailable_reason']}; "
                     "the cpu backend will be used")

    backend = report["backend"]
    # A cpu reason's details (in parentheses) are printed above already.
    reason = backend["reason"].partition(" (")[0] if backend["auto"] == "cpu" else backend["reason"]
    lines.append(label("Backend") + f"auto -> {backend['auto']}: {reason}"
                 + (f" (GPUCOLL_BACKEND={backend['configured']})"
                    if backend["configured"] not in (None, "auto") else ""))
    for name, entry in report.get("backends", {}).items():
        state = "available" if entry["status"] == "available" else "unavailable"
        lines.append(f"  {name:<8} {entry['memory']:<5} {state}: {entry['description']}")
        if entry.get("details"):
            lines.append(" " * 17 + ", ".join(f"{key} {value}"
                                              for key, value in entry["details"].items()))

    if report["warnings"]:
        lines.append(f"Warnings ({len(report['warnings'])}):")
        lines += [f"  - {warning}" for warning in report["warnings"]]
    else:
        lines.append("Warnings: none")
    if report["fix"]:
        lines.append("Fix:")
        lines += [f"  {line}" for line in report["fix"].splitlines()]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``doctor``'s options (shared by :func:`main` and ``gpucoll doctor``)."""
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object (keys: see gpucoll.doctor)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when there is a warning (for CI and container builds)")


def main(argv: Optional[Sequence[str]] = None, out: Optional[TextIO] = None) -> int:
    """Print the report; returns the exit status (0, or 1 for warnings under ``--strict``).

    Args:
        argv: ``["--json"]``, ``["--strict"]``, both or neither (None: ``sys.argv[1:]``).
        out: where to print (default: stdout).
    """
    parser = argparse.ArgumentParser(prog="gpucoll doctor", allow_abbrev=False,
                                     description="Environment report for the NCCL backend.")
    add_arguments(parser)
    namespace = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    out = out or sys.stdout
    report = collect()
    if namespace.json:
        out.write(json.dumps(report, indent=1, default=str) + "\n")
    else:
        out.write(format_text(report) + "\n")
    out.flush()
    return 1 if namespace.strict and report["warnings"] else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
