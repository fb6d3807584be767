"""What this machine offers the GPU side: CuPy, NCCL, the CUDA driver and the GPUs.

The one probe of the CUDA/NCCL environment, used by the NCCL backend, ``init``'s backend
choice, ``gpucoll doctor`` and ``gpucoll topo``: which CuPy and ``nvidia-nccl-cu*`` wheels are
installed and whether they clash, the pip commands that fix them, NCCL's version, which
``libnccl`` was loaded, whether a GPU is usable and what the GPUs are. It is library knowledge,
never a command-line report.

Importing this module does not import CuPy: :func:`load` does, once, and says what to install
when it cannot.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import BackendUnavailableError

__all__ = ["load", "cupy_module", "fix_hint", "device_count", "nccl_version_code", "nccl_unavailable_reason",
           "gpu_unavailable_reason", "gpu_inventory", "decode_nccl_version", "cuda_version_text",
           "version_tuple", "normalize_name", "is_cupy_distribution", "cupy_cuda_major",
           "nccl_cuda_major", "installed_distributions", "wheel_clashes", "nccl_fix_hint",
           "classify_nccl_path", "loaded_library", "kernel_module_version", "nccl_wheel_dirs",
           "preload_config", "as_cupy_stream"]

_DIST_PREFIXES = ("cupy", "nvidia-nccl-cu")
_GPUCOLL_EXTRAS = (12, 13)  # CUDA majors with a gpucoll[cuNN] extra

# ---------------------------------------------------------------- versions and wheels
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


def cuda_version_text(code: int) -> str:
    """CUDA's integer version (12090) as ``"12.9"``."""
    return f"{code // 1000}.{code % 1000 // 10}"


def version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def normalize_name(name: str) -> str:
    """PEP 503 name normalization: ``Cupy_CUDA12x`` -> ``cupy-cuda12x``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_cupy_distribution(name: str) -> bool:
    """Whether a distribution installs the ``cupy`` package (not a CuPy add-on)."""
    return name == "cupy" or name.startswith(("cupy-cuda", "cupy-rocm"))


def cupy_cuda_major(name: str) -> Optional[int]:
    """CUDA major of a CuPy wheel: ``cupy-cuda12x`` -> 12, ``cupy-cuda117`` -> 11."""
    match = re.fullmatch(r"cupy-cuda(\d+)(x?)", name)
    if not match:
        return None
    digits = match.group(1)
    return int(digits) if match.group(2) else int(digits[:-1] or "0")


def nccl_cuda_major(name: str) -> Optional[int]:
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
    cupys = sorted(name for name in dists if is_cupy_distribution(name))
    nccls = sorted(name for name in dists if nccl_cuda_major(name) is not None)
    cupy_majors = sorted({m for m in map(cupy_cuda_major, cupys) if m is not None})
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
        major = cupy_cuda_major(name)
        want = f"nvidia-nccl-cu{major}"
        if major is None or not nccls or want in nccls:
            continue
        problems.append(
            f"{name} (CUDA {major}) is installed with {_listed(dists, nccls)} only; it pairs "
            f"with {want}: pip uninstall -y {' '.join(nccls)} && pip install {want}")
    return problems


def _target_major(dists: Dict[str, str], driver_cuda_major: Optional[int]) -> Optional[int]:
    """The CUDA major whose gpucoll extra to install, or None when nothing tells."""
    cupy_majors = sorted({m for m in map(cupy_cuda_major, (n for n in dists if is_cupy_distribution(n)))
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
    nccl_majors = sorted({m for m in map(nccl_cuda_major, dists) if m in _GPUCOLL_EXTRAS})
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
    cupys = sorted(name for name in dists if is_cupy_distribution(name))
    nccls = sorted(name for name in dists if nccl_cuda_major(name) is not None)
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
            if not normalize_name(stem).startswith(_DIST_PREFIXES):
                continue
            try:
                dist = PathDistribution(Path(directory, name))
                dist_name, version = dist.metadata["Name"], dist.version
            except Exception:  # unreadable metadata: not an installed distribution
                continue
            if not dist_name or not version:
                continue
            normalized = normalize_name(dist_name)
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


def kernel_module_version() -> Optional[str]:
    """The NVIDIA kernel module's version from /proc/driver/nvidia/version, or None."""
    try:
        with open("/proc/driver/nvidia/version") as handle:
            first = handle.readline().strip()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(\S+)", first)
    return match.group(1) if match else first or None


def nccl_wheel_dirs(names: Sequence[str]) -> List[str]:
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



def preload_config() -> Dict[str, Any]:
    from cupy import _environment

    config = _environment.get_preload_config() if hasattr(
        _environment, "get_preload_config") else None
    return config if isinstance(config, dict) else {}


# ---------------------------------------------------------------- CuPy, NCCL and the GPUs
_LOADED: Optional[Tuple[Any, Any]] = None


def load() -> Tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)``, imported once.

    Raises:
        BackendUnavailableError: CuPy or its NCCL binding cannot be loaded; the message gives
            the pip command that fixes it (and names clashing wheels).
    """
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    try:
        import cupy
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend 'nccl' needs CuPy, which is not importable ({type(exc).__name__}: {exc}). "
            f"Fix: {fix_hint()}") from None
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend 'nccl': CuPy {cupy.__version__} cannot load NCCL ({type(exc).__name__}: "
            f"{exc}). Fix: {fix_hint()}") from None
    if not getattr(nccl, "available", False):
        raise BackendUnavailableError(
            f"backend 'nccl': CuPy {cupy.__version__} was built without NCCL support. "
            f"Fix: {fix_hint()}")
    _LOADED = (cupy, nccl)
    return _LOADED


def cupy_module() -> Any:
    """CuPy itself (the module :func:`load` was handed, when it was), without needing NCCL:
    for staging device arrays through host memory. Raises ImportError without CuPy."""
    if _LOADED is not None:
        return _LOADED[0]
    import cupy

    return cupy


def is_cupy_array(x: Any) -> bool:
    """Whether ``x`` is an array of the CuPy in use (a device array), without importing CuPy.
    Cheaper than asking for ``__cuda_array_interface__``, which CuPy builds anew (a dict, the
    dtype's description, the current stream) on every read: the check a training step makes
    for each of its gradients."""
    cupy = _LOADED[0] if _LOADED is not None else sys.modules.get("cupy")
    return cupy is not None and isinstance(x, getattr(cupy, "ndarray", ()))


class _StreamHandle:
    """A raw stream pointer in the CUDA stream protocol (what ``Stream.from_external`` takes)."""

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


def as_cupy_stream(cupy: Any, stream: Any) -> Any:
    """``stream=`` of a call (a CuPy stream, an object with ``cuda_stream`` or
    ``__cuda_stream__``, or a raw pointer) as a CuPy stream; None stays None (the current one)."""
    if stream is None or isinstance(stream, cupy.cuda.Stream):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        handle = stream
    else:
        ptr = stream if isinstance(stream, int) else getattr(stream, "cuda_stream", None)
        if ptr is None and hasattr(stream, "ptr"):
            ptr = stream.ptr
        if ptr is None:
            raise TypeError(f"stream must be a CuPy stream, an object with cuda_stream or "
                            f"__cuda_stream__, or a pointer; got {type(stream).__name__}")
        handle = _StreamHandle(ptr)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14; ExternalStream is deprecated there
        return from_external(handle)
    return cupy.cuda.ExternalStream(handle.__cuda_stream__()[1])


def fix_hint() -> str:
    """The pip command(s) that give a working NCCL backend here (never raises)."""
    try:
        return nccl_fix_hint(installed_distributions())
    except Exception:  # the hint must never hide the real error
        return "pip install 'gpucoll[cu12]' (CUDA 12 drivers) or 'gpucoll[cu13]' (CUDA 13)"


def device_count() -> int:
    """Number of GPUs CuPy sees (0 when CuPy or the driver is missing)."""
    try:
        cupy, _ = load()
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def nccl_version_code() -> int:
    """NCCL's runtime version code (0 when NCCL cannot be loaded)."""
    try:
        return int(load()[1].get_version())
    except Exception:
        return 0


def _device_reason(cupy: Any) -> Optional[str]:
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "CUDA reports no device"


def driver_missing_reason() -> Optional[str]:
    """Why this Linux host has no CUDA driver (``libcuda.so.1`` cannot be loaded), or None.

    A ``dlopen`` of a few milliseconds: on a host without a driver, ``backend="auto"`` rules
    NCCL out before CuPy is imported, which costs most of a second per rank and could not find
    a GPU there (an explicit ``backend="nccl"`` still probes in full, for the fix). Not
    asked once :func:`load` has loaded CuPy (or the tests' emulation stands in for it), nor off
    Linux."""
    if _LOADED is not None or not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no CUDA driver on this host ({exc})"
    return None


def nccl_unavailable_reason() -> Optional[str]:
    """None when CuPy, NCCL and a GPU are usable (the NCCL backend can run), else why not."""
    try:
        cupy, _ = load()
    except BackendUnavailableError as exc:
        return str(exc)
    return _device_reason(cupy)


def gpu_unavailable_reason() -> Optional[str]:
    """None when CuPy sees a CUDA device (NCCL not needed); otherwise why not, in words."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA install CuPy cannot load
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    return _device_reason(cupy)


_GTS_TO_GEN = {"2.5": 1, "5": 2, "5.0": 2, "8": 3, "8.0": 3, "16": 4, "16.0": 4, "32": 5,
               "32.0": 5, "64": 6, "64.0": 6}


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def sysfs_pci(bus_id: str) -> Dict[str, Any]:
    """NUMA node and PCIe link of a PCI device from sysfs (Linux)."""
    base = f"/sys/bus/pci/devices/{bus_id.lower()}"
    if not os.path.isdir(base) and bus_id.count(":") == 2 and len(bus_id.split(":")[0]) == 8:
        base = f"/sys/bus/pci/devices/{bus_id.lower()[4:]}"  # NVML's 8-digit domain
    numa = _read(f"{base}/numa_node")
    speed = _read(f"{base}/current_link_speed") or ""
    width = _read(f"{base}/current_link_width")
    gts = speed.split()[0] if speed else ""
    return {"numa_node": int(numa) if numa not in (None, "") and int(numa) >= 0 else None,
            "pcie_gen": _GTS_TO_GEN.get(gts), "pcie_width": int(width) if width and width.isdigit() else None}


def gpu_inventory(cupy: Any) -> List[Dict[str, Any]]:
    """Every GPU CuPy sees: index, name, memory, PCI bus id, compute capability, NUMA node and
    PCIe link (from sysfs)."""
    runtime = cupy.cuda.runtime
    devices = []
    for index in range(runtime.getDeviceCount()):
        props = runtime.getDeviceProperties(index)
        bus_id = runtime.deviceGetPCIBusId(index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        entry = {"index": index, "name": name, "pci_bus_id": bus_id,
                 "memory_bytes": int(props["totalGlobalMem"]),
                 "compute_capability": f"{props['major']}.{props['minor']}"}
        entry.update(sysfs_pci(bus_id))
        devices.append(entry)
    return devices
