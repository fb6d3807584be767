"""Where a ``gpucoll bench`` run happened: host, date, CPU and GPU model, software versions.

Written into the bench JSON so that runs can be compared later. CuPy and NCCL are asked only
when the communicator's backend is ``nccl`` (CuPy is already imported then); otherwise the
installed CuPy's version is read from its package metadata, without importing it.
"""

from __future__ import annotations

import datetime
import platform
import socket
from typing import Any, Dict, Optional

import numpy as np


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _installed_cupy_version() -> Optional[str]:
    from importlib import metadata

    try:
        names = metadata.packages_distributions().get("cupy", [])
    except AttributeError:  # Python 3.9: no packages_distributions
        names = ["cupy"]
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _gpu_facts(comm) -> Dict[str, Any]:
    """GPU model, CuPy and NCCL versions of a rank on device memory (CuPy is loaded there)."""
    facts: Dict[str, Any] = {"gpu": None, "cupy": None, "nccl": None}
    try:
        import cupy

        facts["cupy"] = cupy.__version__
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props.get("name", b"")
        facts["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        from .. import cuda_env

        facts["nccl"] = cuda_env.decode_nccl_version(cuda_env.nccl_version_code())
    except Exception:  # a partial report beats none; the bench itself already ran on this GPU
        pass
    return facts


def describe_machine(comm) -> Dict[str, Any]:
    """Host, UTC date, CPU/GPU model and versions, as seen by this rank (rank 0 calls it)."""
    from .. import __version__

    facts = {"host": socket.gethostname(),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "cpu": cpu_model(), "cpus": _cpu_count(), "platform": platform.platform(),
             "python": platform.python_version(), "numpy": np.__version__,
             "gpucoll": __version__, "backend": comm.backend}
    if comm.memory == "cuda":
        facts.update(_gpu_facts(comm))
    else:
        facts.update(gpu=None, cupy=_installed_cupy_version(), nccl=None)
    return facts


def _cpu_count() -> Optional[int]:
    import os

    return os.cpu_count()
