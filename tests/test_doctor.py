"""``gpucoll doctor``: the report with and without CuPy / a GPU, JSON keys, ``--strict``, the
pure helpers (version decoding, wheel clashes, fix hints, path classification), and that
importing the module leaves CuPy alone.

Nothing here needs a GPU or CuPy: the GPU paths run against a small fake ``cupy`` package
written into a temporary directory and put first on ``PYTHONPATH`` of a subprocess.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from gpucoll import __version__, doctor
from gpucoll.cuda_env import (classify_nccl_path, decode_nccl_version, installed_distributions,
                            loaded_library, nccl_fix_hint, wheel_clashes)
from gpucoll.topo import gpu_unavailable_reason

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)

TOP_KEYS = {"gpucoll_version", "python", "platform", "distributions", "cupy", "cuda", "nccl",
            "gpus", "backend", "backends", "warnings", "fix"}
SECTION_KEYS = {
    "python": {"version", "implementation", "executable"},
    "cupy": {"installed", "importable", "version", "distributions", "cuda", "packaging",
             "errors"},
    "cuda": {"runtime_version", "runtime_version_code", "driver_version", "driver_version_code",
             "kernel_module_version", "errors"},
    "nccl": {"available", "version", "version_code", "build_version", "build_version_code",
             "min_version", "library", "source", "wheels", "wheel_dirs", "errors"},
    "gpus": {"available", "unavailable_reason", "count", "devices", "peer_access", "errors"},
    "backend": {"auto", "reason", "configured", "nccl_backend"},
}


def _doctor(*args: str, extra_path: Optional[List[Path]] = None,
            timeout: float = 90) -> subprocess.CompletedProcess:
    """``python -m gpucoll doctor ARGS`` with this checkout (and ``extra_path``) first."""
    paths = [str(p) for p in (extra_path or [])] + [str(ROOT)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = {k: v for k, v in os.environ.items() if k != "GPUCOLL_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run([sys.executable, "-m", "gpucoll", "doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _fake_dist(site: Path, name: str, version: str) -> None:
    """A minimal installed distribution: ``NAME-VERSION.dist-info/METADATA``."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


# A CuPy stand-in: CUDA 12.9 runtime, driver 12.8, two GPUs with peer access, NCCL 2.32.3.
_FAKE_CUPY = {
    "cupy/__init__.py": """
        __version__ = "14.99.0"
        from . import cuda  # noqa: F401
        """,
    "cupy/_environment.py": """
        def get_preload_config():
            return {"cuda": "12.x", "packaging": "pip",
                    "nccl": {"version": "2.25.1", "min_pypi_version": "2.18.1"}}
        """,
    "cupy/cuda/__init__.py": """
        from . import runtime  # noqa: F401
        """,
    "cupy/cuda/runtime.py": """
        def runtimeGetVersion():
            return 12090
        def driverGetVersion():
            return 12080
        def getDeviceCount():
            return 2
        def getDeviceProperties(index):
            return {"name": b"Fake GPU", "totalGlobalMem": 80 << 30, "major": 9, "minor": 0}
        def deviceGetPCIBusId(index):
            return "0000:%02x:00.0" % (0x40 + index)
        def deviceCanAccessPeer(i, j):
            return 1
        """,
    "cupy/cuda/nccl.py": """
        available = True
        def get_version():
            return 23203
        def get_build_version():
            return 22501
        """,
}


def _write_fake_cupy(site: Path, broken: bool = False) -> None:
    if broken:  # a CuPy whose import fails the way a broken CUDA install does
        (site / "cupy").mkdir(parents=True)
        (site / "cupy" / "__init__.py").write_text(
            "raise RuntimeError('CUDA environment is not set correctly (fake)')\n")
        return
    for relative, source in _FAKE_CUPY.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip())


# ---------------------------------------------------------------- the command
def test_doctor_exits_0_and_reports_the_gpu_state():
    proc = _doctor()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"gpucoll   {__version__}" in out and "Python" in out and "Platform" in out
    assert "CuPy" in out and "NCCL" in out and "Backend   auto -> " in out
    assert "Traceback" not in out + proc.stderr
    reason = gpu_unavailable_reason()
    if reason is not None:  # CI: no CuPy, or no GPU
        no_gpu = [line for line in out.splitlines() if line.startswith("No usable GPU: ")]
        assert no_gpu == [f"No usable GPU: {reason}; the cpu backend will be used"], out
        assert "Backend   auto -> cpu: " in out
    else:
        assert "No usable GPU" not in out and "GPU 0: " in out and "Peer access" in out


def test_json_has_the_documented_keys_and_agrees_with_the_probe():
    proc = _doctor("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == TOP_KEYS
    for section, keys in SECTION_KEYS.items():
        assert set(report[section]) == keys, section
    assert report["gpucoll_version"] == __version__
    assert report["python"]["executable"] == sys.executable
    assert report["distributions"] == installed_distributions()
    reason = gpu_unavailable_reason()
    assert report["gpus"]["available"] is (reason is None)
    assert report["gpus"]["unavailable_reason"] == reason
    assert report["backend"]["auto"] in ("cpu", "nccl")
    if reason is not None:
        assert report["backend"]["auto"] == "cpu" and report["gpus"]["count"] == 0
    else:
        count = report["gpus"]["count"]
        assert count >= 1 and len(report["gpus"]["devices"]) == count
        assert len(report["gpus"]["peer_access"]) == count
    assert isinstance(report["warnings"], list)
    assert report["fix"] is None or "pip install 'gpucoll[cu" in report["fix"]


def test_strict_exits_1_only_on_warnings(tmp_path: Path):
    proc = _doctor("--json", "--strict")
    report = json.loads(proc.stdout)
    assert proc.returncode == (1 if report["warnings"] else 0), proc.stderr

    _fake_dist(tmp_path, "nvidia-nccl-cu12", "2.27.7")
    _fake_dist(tmp_path, "nvidia-nccl-cu13", "2.28.3")
    relaxed = _doctor(extra_path=[tmp_path])
    assert relaxed.returncode == 0, relaxed.stderr
    assert "several NCCL wheels are installed (nvidia-nccl-cu12 2.27.7, nvidia-nccl-cu13 " \
           "2.28.3)" in relaxed.stdout
    strict = _doctor("--strict", "--json", extra_path=[tmp_path])
    assert strict.returncode == 1, strict.stderr
    report = json.loads(strict.stdout)
    assert report["nccl"]["wheels"] == {"nvidia-nccl-cu12": "2.27.7",
                                        "nvidia-nccl-cu13": "2.28.3"}
    assert any("several NCCL wheels" in warning for warning in report["warnings"])
    assert "gpucoll[cu1" in report["fix"]


def test_main_exit_status_and_formats(monkeypatch: pytest.MonkeyPatch):
    report = _fake_report(warnings=["something is off"], fix="pip install 'gpucoll[cu12]'")
    monkeypatch.setattr(doctor, "collect", lambda: report)
    out = io.StringIO()
    assert doctor.main([], out=out) == 0
    assert "Warnings (1):\n  - something is off" in out.getvalue()
    assert "Fix:\n  pip install 'gpucoll[cu12]'" in out.getvalue()
    assert doctor.main(["--strict"], out=io.StringIO()) == 1
    out = io.StringIO()
    assert doctor.main(["--json", "--strict"], out=out) == 1
    assert json.loads(out.getvalue()) == report
    monkeypatch.setattr(doctor, "collect", lambda: _fake_report())
    assert doctor.main(["--strict"], out=io.StringIO()) == 0


def test_fake_cupy_with_two_gpus_is_listed(tmp_path: Path):
    _write_fake_cupy(tmp_path)
    proc = _doctor("--json", extra_path=[tmp_path])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["cupy"]["importable"] and report["cupy"]["version"] == "14.99.0"
    assert report["cuda"]["runtime_version"] == "12.9"
    assert report["cuda"]["driver_version"] == "12.8"
    nccl = report["nccl"]
    assert nccl["available"] and nccl["version"] == "2.32.3" and nccl["version_code"] == 23203
    assert nccl["build_version"] == "2.25.1" and nccl["min_version"] == "2.18.1"
    gpus = report["gpus"]
    assert gpus["available"] and gpus["count"] == 2
    assert [d["pci_bus_id"] for d in gpus["devices"]] == ["0000:40:00.0", "0000:41:00.0"]
    assert gpus["devices"][1]["compute_capability"] == "9.0"
    assert gpus["devices"][0]["memory_bytes"] == 80 << 30
    assert gpus["peer_access"] == [[True, True], [True, True]]
    if report["backend"]["nccl_backend"] == "available":
        assert report["backend"]["auto"] == "nccl"
    else:  # this gpucoll has no nccl backend yet: auto says so
        assert report["backend"]["auto"] == "cpu"
        assert "nccl backend" in report["backend"]["reason"]
    if not report["nccl"]["wheels"]:  # the fake CuPy is a pip build without an NCCL wheel
        assert any("no NCCL wheel" in warning for warning in report["warnings"])
        assert report["fix"] == "pip install 'gpucoll[cu12]'"

    text = _doctor(extra_path=[tmp_path]).stdout
    assert "GPUs      2" in text and "GPU 1: Fake GPU  80.0 GiB  bus 0000:41:00.0  cc 9.0" in text
    assert "Peer access (1: yes" in text and "No usable GPU" not in text
    assert "GPU    0   1\n" in text and "  1    1   1\n" in text
    assert "NCCL      2.32.3 loaded; CuPy built against 2.25.1, CuPy's floor 2.18.1" in text


def test_a_cupy_that_fails_to_import_is_reported_not_raised(tmp_path: Path):
    _write_fake_cupy(tmp_path, broken=True)
    proc = _doctor(extra_path=[tmp_path])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "CUDA environment is not set correctly (fake)" in proc.stdout
    assert ("No usable GPU: CuPy is not importable (RuntimeError: CUDA environment is not set "
            "correctly (fake)); the cpu backend will be used") in proc.stdout
    report = json.loads(_doctor("--json", extra_path=[tmp_path]).stdout)
    assert not report["cupy"]["importable"] and report["backend"]["auto"] == "cpu"


def test_importing_doctor_does_not_import_cupy(tmp_path: Path):
    _write_fake_cupy(tmp_path, broken=True)  # importing it would raise
    code = ("import sys, gpucoll.doctor, gpucoll.cli; gpucoll.cli.build_parser(); "
            "gpucoll.cuda_env.installed_distributions(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cupy'))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _fake_report(warnings: Optional[List[str]] = None, fix: Optional[str] = None) -> Dict:
    return {
        "gpucoll_version": __version__,
        "python": {"version": "3.11.7", "implementation": "CPython", "executable": "python"},
        "platform": "Linux", "distributions": {},
        "cupy": {"installed": False, "importable": False, "version": None, "distributions": {},
                 "cuda": None, "packaging": None, "errors": []},
        "cuda": {"runtime_version": None, "runtime_version_code": None, "driver_version": None,
                 "driver_version_code": None, "kernel_module_version": None, "errors": []},
        "nccl": {"available": False, "version": None, "version_code": None,
                 "build_version": None, "build_version_code": None, "min_version": None,
                 "library": None, "source": None, "wheels": {}, "wheel_dirs": [], "errors": []},
        "gpus": {"available": False, "unavailable_reason": "CuPy is not importable", "count": 0,
                 "devices": [], "peer_access": [], "errors": []},
        "backend": {"auto": "cpu", "reason": "CuPy is not importable", "configured": "auto",
                    "nccl_backend": "available"},
        "warnings": warnings or [], "fix": fix,
    }


def test_warnings_for_a_system_nccl_an_old_nccl_and_an_old_driver():
    report = _fake_report()
    report["distributions"] = {"cupy-cuda13x": "14.2.0", "nvidia-nccl-cu13": "2.28.3"}
    report["cupy"].update(installed=True, importable=True, version="14.2.0",
                          distributions={"cupy-cuda13x": "14.2.0"}, packaging="pip")
    report["cuda"].update(runtime_version="13.0", runtime_version_code=13000,
                          driver_version="12.4", driver_version_code=12040)
    report["nccl"].update(available=True, version="2.17.1", min_version="2.18.1",
                          wheels={"nvidia-nccl-cu13": "2.28.3"}, source="system",
                          library="/usr/lib/x86_64-linux-gnu/libnccl.so.2")
    found, needs_fix = doctor._warnings(report)
    assert len(found) == 3 and needs_fix
    assert found[0].startswith("libnccl was loaded from the system "
                               "(/usr/lib/x86_64-linux-gnu/libnccl.so.2) instead of the "
                               "installed wheel (nvidia-nccl-cu13)")
    assert found[1] == "the loaded NCCL 2.17.1 is older than CuPy's floor 2.18.1"
    assert "driver supports CUDA 12.4 only" in found[2]
    # The fix for that driver: the CUDA 12 wheels instead of the CUDA 13 ones.
    assert nccl_fix_hint(report["distributions"], 12).splitlines() == [
        "pip uninstall -y cupy-cuda13x nvidia-nccl-cu13", "pip install 'gpucoll[cu12]'"]


# ---------------------------------------------------------------- pure helpers
@pytest.mark.parametrize("code, text", [(23203, "2.32.3"), (22501, "2.25.1"), (2708, "2.7.8"),
                                        (21803, "2.18.3"), (20900, "2.9.0")])
def test_decode_nccl_version(code: int, text: str):
    assert decode_nccl_version(code) == text


@pytest.mark.parametrize("code", [0, -1])
def test_decode_nccl_version_rejects_non_positive_codes(code: int):
    with pytest.raises(ValueError, match=str(code)):
        decode_nccl_version(code)


def test_wheel_clashes_both_nccl_wheels_names_the_pair_and_the_command():
    dists = {"cupy-cuda12x": "14.2.0", "nvidia-nccl-cu12": "2.32.3", "nvidia-nccl-cu13": "2.28.3"}
    (clash,) = wheel_clashes(dists)
    assert "nvidia-nccl-cu12 2.32.3, nvidia-nccl-cu13 2.28.3" in clash
    assert "cupy-cuda12x pairs with nvidia-nccl-cu12" in clash
    assert ("pip uninstall -y nvidia-nccl-cu13 && pip install --force-reinstall --no-deps "
            "nvidia-nccl-cu12==2.32.3") in clash


def test_wheel_clashes_cupy_with_the_other_cuda_majors_nccl_only():
    (clash,) = wheel_clashes({"cupy-cuda12x": "14.2.0", "nvidia-nccl-cu13": "2.28.3"})
    assert clash.startswith("cupy-cuda12x (CUDA 12) is installed with nvidia-nccl-cu13 2.28.3")
    assert "pip uninstall -y nvidia-nccl-cu13 && pip install nvidia-nccl-cu12" in clash


def test_wheel_clashes_two_cupy_wheels_and_clean_pairs():
    (clash,) = wheel_clashes({"cupy-cuda12x": "14.2.0", "cupy-cuda13x": "14.2.0"})
    assert "several CuPy distributions" in clash and "cupy-cuda13x 14.2.0" in clash
    assert wheel_clashes({"cupy-cuda12x": "14.2.0", "nvidia-nccl-cu12": "2.32.3"}) == []
    assert wheel_clashes({"cupy-cuda13x": "14.2.0", "nvidia-nccl-cu13": "2.28.3"}) == []
    assert wheel_clashes({"cupy-cuda12x": "14.2.0"}) == []
    assert wheel_clashes({}) == []
    # Both NCCL wheels without a CuPy wheel: still a clash, but nothing says which to keep.
    (clash,) = wheel_clashes({"nvidia-nccl-cu12": "2.32.3", "nvidia-nccl-cu13": "2.28.3"})
    assert "keep the one matching your CUDA driver" in clash


def test_nccl_fix_hint_follows_the_cupy_wheel_then_the_driver():
    assert nccl_fix_hint({"cupy-cuda13x": "14.2.0"}) == "pip install 'gpucoll[cu13]'"
    assert nccl_fix_hint({}, driver_cuda_major=12) == "pip install 'gpucoll[cu12]'"
    assert nccl_fix_hint({}, driver_cuda_major=14) == "pip install 'gpucoll[cu13]'"
    # cupy-cuda12x runs on a CUDA 13 driver: keep it.
    assert nccl_fix_hint({"cupy-cuda12x": "14.2.0"}, 13) == "pip install 'gpucoll[cu12]'"
    # cupy-cuda13x cannot run on a CUDA 12 driver: switch to cu12.
    assert nccl_fix_hint({"cupy-cuda13x": "14.2.0"}, 12) == \
        "pip uninstall -y cupy-cuda13x\npip install 'gpucoll[cu12]'"
    unknown = nccl_fix_hint({})
    assert unknown.startswith("pip install 'gpucoll[cu12]'") and "'gpucoll[cu13]'" in unknown
    assert "update the NVIDIA driver" in nccl_fix_hint({}, driver_cuda_major=11)


def test_nccl_fix_hint_uninstalls_clashing_wheels_and_restores_the_shared_files():
    dists = {"cupy-cuda12x": "14.2.0", "nvidia-nccl-cu12": "2.32.3", "nvidia-nccl-cu13": "2.28.3"}
    assert nccl_fix_hint(dists).splitlines() == [
        "pip uninstall -y nvidia-nccl-cu13",
        "pip install --force-reinstall --no-deps nvidia-nccl-cu12==2.32.3",
        "pip install 'gpucoll[cu12]'"]
    # Only the wrong wheel: nothing shared to restore.
    assert nccl_fix_hint({"cupy-cuda12x": "14.2.0", "nvidia-nccl-cu13": "2.28.3"}) == \
        "pip uninstall -y nvidia-nccl-cu13\npip install 'gpucoll[cu12]'"
    lines = nccl_fix_hint({"cupy-cuda12x": "14.2.0", "cupy": "14.0.0"}).splitlines()
    assert lines == ["pip uninstall -y cupy",
                     "pip install --force-reinstall --no-deps cupy-cuda12x==14.2.0",
                     "pip install 'gpucoll[cu12]'"]


def test_classify_nccl_path():
    wheel_dir = "/opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib"
    assert classify_nccl_path(wheel_dir + "/libnccl.so.2", [wheel_dir]) == "wheel"
    assert classify_nccl_path(wheel_dir + "/libnccl.so.2", [wheel_dir + "/"]) == "wheel"
    assert classify_nccl_path("/usr/lib/x86_64-linux-gnu/libnccl.so.2", [wheel_dir]) == "system"
    assert classify_nccl_path(wheel_dir + "/libnccl.so.2", []) == "system"
    # A wheel of another environment is not this environment's wheel.
    other = "/home/u/other-venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
    assert classify_nccl_path(other, [wheel_dir]) == "system"


def test_installed_distributions_reads_dist_info_by_normalized_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_dist(tmp_path, "nvidia-nccl-cu13", "2.28.3")
    _fake_dist(tmp_path, "Cupy_CUDA13x", "14.1.0")
    _fake_dist(tmp_path, "numpy-extra", "1.0")
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    found = installed_distributions()
    assert found["nvidia-nccl-cu13"] == "2.28.3" and found["cupy-cuda13x"] == "14.1.0"
    assert "numpy-extra" not in found
    assert all(name.startswith(("cupy", "nvidia-nccl-cu")) for name in found)


def _mapped_files() -> List[str]:
    with open("/proc/self/maps") as handle:
        fields = [line.split(None, 5) for line in handle.read().splitlines()]
    return [f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_loaded_library_finds_a_mapped_library_and_none_for_others():
    libraries = [path for path in _mapped_files() if ".so" in os.path.basename(path)]
    assert libraries, "this Python maps no shared library"
    libc = [path for path in libraries if os.path.basename(path).startswith("libc.so")]
    path = (libc or libraries)[0]
    name = os.path.basename(path)
    found = loaded_library(name)
    assert found is not None and os.path.basename(found).startswith(name)
    assert found in libraries
    assert loaded_library("libgpucoll-surely-not-loaded.so") is None
