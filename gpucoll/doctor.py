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
import re
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from . import __version__

__all__ = ["collect", "format_text", "main", "add_arguments", "decode_nccl_version",
           "installed_distributions", "wheel_clashes", "nccl_fix_hint", "classify_nccl_path",
           "loaded_library"]

_DIST_PREFIXES = ("cupy", "nvidia-nccl-cu")
_GPUCOLL_EXTRAS = (12, 13)  # CUDA majors with a gpucoll[cuNN] extra
_NO_GPU_PREFIX = "No usable GPU: "


# ---------------------------------------------------------------- pure helpers
def decode_nccl_version(code: int) -> str:
    """NCCL's integer version as ``major.minor.patch``.

    From NCCL 2.9 on the code is ``major*10000 + minor*100 + patch`` (23203 -> ``"2.32.3"``);
    before that ``major*1000 + minor*100 + patch`` (2708 -> ``"2.7.8"``).

    Raises:
        ValueError: ``code`` is not a positive integer.
    """
    code = int(code)
    if code <= 0:
        raise ValueError(f"not an NCCL version code: {code}")
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _cuda_version(code: int) -> str:
    """CUDA's integer version (12090) as ``"12.9"``."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _normalize(name: str) -> str:
    """PEP 503 name normalization: ``Cupy_CUDA12x`` -> ``cupy-cuda12x``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_cupy(name: str) -> bool:
    """Whether a distribution installs the ``cupy`` package (not a CuPy add-on)."""
    return name == "cupy" or name.startswith(("cupy-cuda", "cupy-rocm"))


def _cupy_cuda_major(name: str) -> Optional[int]:
    """CUDA major of a CuPy wheel: ``cupy-cuda12x`` -> 12, ``cupy-cuda117`` -> 11."""
    match = re.fullmatch(r"cupy-cuda(\d+)(x?)", name)
    if not match:
        return None
    digits = match.group(1)
    return int(digits) if match.group(2) else int(digits[:-1] or "0")


def _nccl_cuda_major(name: str) -> Optional[int]:
    """CUDA major of an NCCL wheel: ``nvidia-nccl-cu13`` -> 13."""
    match = re.fullmatch(r"nvidia-nccl-cu(\d+)", name)
    return int(match.group(1)) if match else None


def _listed(dists: Dict[str, str], names: Sequence[str]) -> str:
    return ", ".join(f"{name} {dists[name]}" for name in names)


def wheel_clashes(dists: Dict[str, str]) -> List[str]:
    """Clashes among the installed CuPy and NCCL wheels, in words, from ``dists`` alone.

    Args:
        dists: normalized distribution name -> version, as :func:`installed_distributions`.

    Returns:
        One message per problem: several CuPy distributions; several ``nvidia-nccl-cu*``
        wheels (they install the same ``nvidia/nccl/lib/libnccl.so.2``); a ``cupy-cudaNNx``
        whose matching ``nvidia-nccl-cuNN`` is missing while another one is installed.
        Each names the pair to keep and the pip command. ``[]`` when nothing clashes.
    """
    cupys = sorted(name for name in dists if _is_cupy(name))
    nccls = sorted(name for name in dists if _nccl_cuda_major(name) is not None)
    cupy_majors = sorted({m for m in map(_cupy_cuda_major, cupys) if m is not None})
    problems: List[str] = []
    if len(cupys) > 1:
        problems.append(
            f"several CuPy distributions are installed ({_listed(dists, cupys)}); they install "
            "the same cupy package over each other: keep one (see the fix below)")
    if len(nccls) > 1:
        message = (f"several NCCL wheels are installed ({_listed(dists, nccls)}); they install "
                   "the same nvidia/nccl/lib/libnccl.so.2, so the last one installed wins")
        if len(cupy_majors) == 1 and f"nvidia-nccl-cu{cupy_majors[0]}" in nccls:
            keep = f"nvidia-nccl-cu{cupy_majors[0]}"
            others = " ".join(name for name in nccls if name != keep)
            message += (f"; cupy-cuda{cupy_majors[0]}x pairs with {keep}: "
                        f"pip uninstall -y {others} && pip install --force-reinstall "
                        f"--no-deps {keep}=={dists[keep]}")
        else:
            message += "; keep the one matching your CUDA driver's major version"
        problems.append(message)
    for name in cupys:
        major = _cupy_cuda_major(name)
        want = f"nvidia-nccl-cu{major}"
        if major is None or not nccls or want in nccls:
            continue
        problems.append(
            f"{name} (CUDA {major}) is installed with {_listed(dists, nccls)} only; it pairs "
            f"with {want}: pip uninstall -y {' '.join(nccls)} && pip install {want}")
    return problems


def _target_major(dists: Dict[str, str], driver_cuda_major: Optional[int]) -> Optional[int]:
    """The CUDA major whose gpucoll extra to install, or None when nothing tells."""
    cupy_majors = sorted({m for m in map(_cupy_cuda_major, (n for n in dists if _is_cupy(n)))
                          if m in _GPUCOLL_EXTRAS})
    driver = None
    if driver_cuda_major is not None and driver_cuda_major >= _GPUCOLL_EXTRAS[0]:
        driver = min(driver_cuda_major, _GPUCOLL_EXTRAS[-1])
    if driver is not None:
        # The installed CuPy wheel wins unless the driver is too old to run it.
        fitting = [m for m in cupy_majors if m <= driver]
        return fitting[-1] if fitting else driver
    if len(cupy_majors) == 1:
        return cupy_majors[0]
    nccl_majors = sorted({m for m in map(_nccl_cuda_major, dists) if m in _GPUCOLL_EXTRAS})
    if len(cupy_majors) > 1:
        both = [m for m in cupy_majors if m in nccl_majors]
        return both[-1] if len(both) == 1 else None
    return nccl_majors[0] if len(nccl_majors) == 1 else None


def nccl_fix_hint(dists: Dict[str, str], driver_cuda_major: Optional[int] = None) -> str:
    """The pip commands (one per line) that give a working NCCL backend.

    The CUDA major comes from the installed ``cupy-cudaNNx`` wheel, or from the driver's CUDA
    major when no CuPy wheel is installed (or the driver is too old for the installed one).
    Clashing CuPy and NCCL wheels are uninstalled first; a kept wheel that shared files with
    an uninstalled one is reinstalled (the uninstall deleted those files).

    Args:
        dists: normalized distribution name -> version, as :func:`installed_distributions`.
        driver_cuda_major: the CUDA major the driver supports (12 for 12.x), when known.

    Returns:
        For example ``"pip install 'gpucoll[cu12]'"``, or several lines.
    """
    major = _target_major(dists, driver_cuda_major)
    if major is None:
        if driver_cuda_major is not None and 0 < driver_cuda_major < _GPUCOLL_EXTRAS[0]:
            return (f"# the driver supports CUDA {driver_cuda_major} only; gpucoll's NCCL "
                    "backend needs CUDA 12 or 13: update the NVIDIA driver, then\n"
                    "pip install 'gpucoll[cu12]'")
        return "pip install 'gpucoll[cu12]'  # or 'gpucoll[cu13]' with a CUDA 13 driver"
    keep_cupy, keep_nccl = f"cupy-cuda{major}x", f"nvidia-nccl-cu{major}"
    cupys = sorted(name for name in dists if _is_cupy(name))
    nccls = sorted(name for name in dists if _nccl_cuda_major(name) is not None)
    remove = ([name for name in cupys if name != keep_cupy]
              + [name for name in nccls if name != keep_nccl])
    lines: List[str] = []
    if remove:
        lines.append("pip uninstall -y " + " ".join(remove))
        reinstall = [name for name, family in ((keep_cupy, cupys), (keep_nccl, nccls))
                     if name in dists and len(family) > 1]
        if reinstall:
            pins = " ".join(f"{name}=={dists[name]}" for name in reinstall)
            lines.append(f"pip install --force-reinstall --no-deps {pins}")
    lines.append(f"pip install 'gpucoll[cu{major}]'")
    return "\n".join(lines)


def classify_nccl_path(path: str, wheel_dirs: List[str]) -> str:
    """``"wheel"`` when ``path`` lies in one of ``wheel_dirs`` (the ``nvidia/nccl/lib``
    directories of installed ``nvidia-nccl-cu*`` wheels), else ``"system"``."""
    where = os.path.normpath(path)
    for directory in wheel_dirs:
        base = os.path.normpath(directory)
        if where.startswith(base + os.sep):
            return "wheel"
    return "system"


# ---------------------------------------------------------------- probes without CuPy
def installed_distributions() -> Dict[str, str]:
    """Installed distributions whose names start with ``cupy`` or ``nvidia-nccl-cu``.

    Scans the ``*.dist-info`` / ``*.egg-info`` entries of ``sys.path`` (first one wins, as
    for imports) and reads only the matching ones, so it takes milliseconds and imports
    nothing.

    Returns:
        Normalized name (``cupy-cuda12x``, ``nvidia-nccl-cu12``) -> version.
    """
    from importlib.metadata import PathDistribution
    from pathlib import Path

    found: Dict[str, str] = {}
    for entry in sys.path:
        directory = entry or "."
        try:
            names = os.listdir(directory)
        except OSError:  # a zip file, or gone
            continue
        for name in names:
            stem, _, suffix = name.rpartition(".")
            if suffix not in ("dist-info", "egg-info"):
                continue
            if not _normalize(stem).startswith(_DIST_PREFIXES):
                continue
            try:
                dist = PathDistribution(Path(directory, name))
                dist_name, version = dist.metadata["Name"], dist.version
            except Exception:  # unreadable metadata: not an installed distribution
                continue
            if not dist_name or not version:
                continue
            normalized = _normalize(dist_name)
            if normalized.startswith(_DIST_PREFIXES):
                found.setdefault(normalized, version)
    return found


def loaded_library(prefix: str) -> Optional[str]:
    """Path of the first file mapped into this process whose name starts with ``prefix``.

    Reads ``/proc/self/maps`` (Linux). Returns None when no such file is mapped or the maps
    cannot be read.
    """
    try:
        with open("/proc/self/maps") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path.endswith(" (deleted)"):
            path = path[:-len(" (deleted)")]
        if path.startswith("/") and os.path.basename(path).startswith(prefix):
            return path
    return None


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


def _kernel_module_version() -> Optional[str]:
    """The NVIDIA kernel module's version from /proc/driver/nvidia/version, or None."""
    try:
        with open("/proc/driver/nvidia/version") as handle:
            first = handle.readline().strip()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(\S+)", first)
    return match.group(1) if match else first or None


def _nccl_wheel_dirs(names: Sequence[str]) -> List[str]:
    """The directories holding ``libnccl.so*`` of the given installed NCCL wheels."""
    from importlib.metadata import distribution

    dirs: List[str] = []
    for name in names:
        dist = distribution(name)
        files = [f for f in (dist.files or []) if f.name.startswith("libnccl.so")]
        located = ([str(dist.locate_file(f).parent) for f in files]
                   or [str(dist.locate_file("nvidia/nccl/lib"))])
        for directory in located:
            real = os.path.realpath(directory)
            if real not in dirs:
                dirs.append(real)
    return dirs


# ---------------------------------------------------------------- the report
def _cupy_section(dists: Dict[str, str]) -> Tuple[Dict[str, Any], Any, Dict[str, Any]]:
    """The ``cupy`` section, the imported module (None when it does not import) and CuPy's
    preload config (``{}`` when it has none)."""
    section: Dict[str, Any] = {
        "installed": any(_is_cupy(name) for name in dists), "importable": False,
        "version": None, "distributions": {n: v for n, v in dists.items() if _is_cupy(n)},
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
    config = _attempt(section["errors"], "CuPy preload config", _preload_config, {})
    section["cuda"], section["packaging"] = config.get("cuda"), config.get("packaging")
    return section, module, config


def _preload_config() -> Dict[str, Any]:
    from cupy import _environment

    config = _environment.get_preload_config() if hasattr(
        _environment, "get_preload_config") else None
    return config if isinstance(config, dict) else {}


def _cuda_section(cupy: Any) -> Dict[str, Any]:
    section: Dict[str, Any] = {
        "runtime_version": None, "runtime_version_code": None, "driver_version": None,
        "driver_version_code": None, "kernel_module_version": _kernel_module_version(),
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
        section["runtime_version"] = _cuda_version(int(code))
    code = _attempt(errors, "driverGetVersion (no CUDA driver)", runtime.driverGetVersion)
    if code is not None:
        section["driver_version_code"] = int(code)
        if code:
            section["driver_version"] = _cuda_version(int(code))
        else:
            errors.append("driverGetVersion returned 0: no CUDA driver (libcuda.so.1) found")
    return section


def _nccl_section(cupy: Any, dists: Dict[str, str], preload: Dict[str, Any]) -> Dict[str, Any]:
    wheels = {name: dists[name] for name in sorted(dists) if _nccl_cuda_major(name) is not None}
    floor = preload.get("nccl") if isinstance(preload.get("nccl"), dict) else {}
    section: Dict[str, Any] = {
        "available": False, "version": None, "version_code": None, "build_version": None,
        "build_version_code": None, "min_version": floor.get("min_pypi_version"),
        "library": None, "source": None, "wheels": wheels, "wheel_dirs": [], "errors": []}
    errors = section["errors"]
    section["wheel_dirs"] = _attempt(errors, "locating the NCCL wheels' files",
                                     lambda: _nccl_wheel_dirs(list(wheels)), [])
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
    from . import topo

    reason = topo.gpu_unavailable_reason()
    section: Dict[str, Any] = {"available": reason is None, "unavailable_reason": reason,
                               "count": 0, "devices": [], "peer_access": [], "errors": []}
    if reason is not None:
        return section
    errors = section["errors"]
    runtime = cupy.cuda.runtime
    count = _attempt(errors, "getDeviceCount", runtime.getDeviceCount, 0)
    section["count"] = int(count)
    keys = ("index", "name", "memory_bytes", "pci_bus_id", "compute_capability", "numa_node")
    devices = _attempt(errors, "device properties", lambda: topo._gpu_devices(cupy), [])
    section["devices"] = [{key: device.get(key) for key in keys} for device in devices]

    def can_access(i: int, j: int) -> bool:
        return i == j or bool(runtime.deviceCanAccessPeer(i, j))

    section["peer_access"] = _attempt(
        errors, "deviceCanAccessPeer",
        lambda: [[can_access(i, j) for j in range(count)] for i in range(count)], [])
    return section


def _backend_section(report: Dict[str, Any]) -> Dict[str, Any]:
    from . import config
    from .api import available_backends

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
        if _version_tuple(nccl["version"]) < _version_tuple(str(nccl["min_version"])):
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
