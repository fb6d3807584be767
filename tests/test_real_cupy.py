"""gpucoll against the real CuPy and NCCL wheels on a machine with no GPU.

``pip install 'cupy-cuda12x[ctk]' nvidia-nccl-cu12`` installs and imports without a device (CI
does it; see .ci/run). Then:

* every module attribute, constant, class and method that ``tests/emulated_cuda/`` offers in
  place of ``cupy`` / ``cupy.cuda`` / ``cupy.cuda.runtime`` / ``cupy.cuda.nccl`` exists in the
  real modules, constants have the real values, and call signatures agree (from ``inspect`` or,
  for CuPy's Cython functions, the signature line Cython embeds in ``__doc__``), so the emulation
  the NCCL backend's tests run on cannot drift from the API it stands for;
* ``gpucoll doctor`` reports CuPy and the missing driver and picks the CPU backend;
* ``init(backend="auto")`` falls back to the CPU backend and ``init(backend="nccl")`` raises
  ``BackendUnavailableError`` saying why.

Skipped, with the reason, where CuPy is not importable; the no-GPU cases skip where a GPU is.
"""

import inspect
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

import gpucoll as gc
from gpucoll.topo import gpu_unavailable_reason

try:
    import cupy
    import cupy.cuda.nccl
    import cupy.cuda.runtime
except Exception as exc:  # ImportError, or a CUDA install CuPy cannot load
    pytest.skip(f"CuPy is not importable ({type(exc).__name__}: {exc}); "
                f"pip install 'cupy-cuda12x[ctk]' nvidia-nccl-cu12", allow_module_level=True)

from emulated_cuda import Emulation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DUNDERS = {"__cuda_array_interface__", "__dlpack__", "__dlpack_device__"}
NO_VALUE_CHECK = {"__version__", "available"}  # emulated on purpose ("14.0.0 (emulated)", True)
no_gpu = pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU is present")


# ------------------------------------------------------------------------------ signatures
def _doc_signature(obj):
    """The parameters of Cython's embedded signature line, e.g.
    ``memcpyAsync(intptr_t dst, intptr_t src, size_t size, int kind, intptr_t stream)``."""
    first = (getattr(obj, "__doc__", None) or "").lstrip().split("\n", 1)[0]
    name = re.sub(r"^cupy_", "", getattr(obj, "__name__", ""))  # a ufunc's is "cupy_add"
    match = re.match(rf"(?:[\w.]*\.)?{re.escape(name)}\((.*)\)(?:\s*->.*)?$", first)
    if not match:
        return None
    params, depth, current = [], 0, ""
    for char in match.group(1).replace("\\*", "*") + ",":  # ufunc docs escape the *
        if char == "," and depth == 0:
            if current.strip():
                params.append(current.strip())
            current = ""
            continue
        depth += char in "([{"
        depth -= char in ")]}"
        current += char
    out, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for param in params:
        if param == "/":
            out = [p.replace(kind=inspect.Parameter.POSITIONAL_ONLY) for p in out]
            continue
        if param == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        head, _, default = param.partition("=")
        token = head.split()[-1].lstrip("*")
        if head.strip().startswith("**"):
            out.append(inspect.Parameter(token, inspect.Parameter.VAR_KEYWORD))
        elif head.strip().startswith("*"):
            out.append(inspect.Parameter(token, inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            out.append(inspect.Parameter(token, kind, default=default.strip() if default
                                         else inspect.Parameter.empty))
    return inspect.Signature(out)


def _signature(obj, constructor=False):
    """inspect's signature, else Cython's embedded one; None where neither says anything."""
    target = obj.__init__ if constructor and "__init__" in vars(obj) else obj
    try:
        signature = inspect.signature(target)
        if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in signature.parameters.values()):
            return signature
    except (TypeError, ValueError):
        pass
    return _doc_signature(obj)


def _parameters(signature):
    params = list(signature.parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return params


def _incompatible(emulated, real):
    """Why a call that suits the emulated signature would not suit the real one (or None)."""
    e, r = _parameters(emulated), _parameters(real)
    if any(p.kind == p.VAR_POSITIONAL for p in r) or any(p.kind == p.VAR_KEYWORD for p in r):
        return None  # the real one takes anything
    positional = [p for p in r if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in r}
    for index, param in enumerate(e):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            if index >= len(positional):
                return f"takes {param.name!r} at position {index}; the real one stops at " \
                       f"{len(positional)} positional parameters"
            if positional[index].name != param.name:
                return f"position {index} is {param.name!r}, really {positional[index].name!r}"
        elif param.name not in by_name:
            return f"keyword {param.name!r} does not exist"
    names = {p.name for p in e}
    takes_more = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in e)
    for param in r:
        if param.default is param.empty and param.kind not in (param.VAR_POSITIONAL,
                                                               param.VAR_KEYWORD):
            if param.name not in names and not takes_more:
                return f"lacks the required parameter {param.name!r}"
    return None


# ------------------------------------------------------------------------------ the walk
def _public(namespace):
    if isinstance(namespace, types.ModuleType):
        names = vars(namespace)
    else:  # a class: what its own classes define, not object's
        names = {}
        for klass in reversed(namespace.__mro__[:-1]):
            names.update(vars(klass))
    return {name: value for name, value in names.items()
            if not name.startswith("_") or name in DUNDERS or name == "__version__"}


def _compare(emulated, real, path, report):
    for name, value in sorted(_public(emulated).items()):
        where = f"{path}.{name}"
        if not hasattr(real, name):
            report["missing"].append(where)
            continue
        actual = getattr(real, name)
        if isinstance(value, types.ModuleType):
            _compare(value, actual, where, report)
        elif isinstance(value, type) and issubclass(value, BaseException):
            if not (isinstance(actual, type) and issubclass(actual, BaseException)):
                report["wrong"].append(f"{where}: not an exception class in CuPy")
        elif isinstance(value, type) and (value.__module__.split(".")[0] == "emulated_cuda"
                                          or "_emu" in vars(value)):  # ndarray says "cupy"
            if not isinstance(actual, type):
                report["wrong"].append(f"{where}: {type(actual).__name__} in CuPy, not a class")
                continue
            _signatures(value, actual, where, report, constructor=True)
            _compare(value, actual, where, report)
        elif isinstance(value, (bool, int, float, str, np.dtype, type)):
            if name not in NO_VALUE_CHECK and actual != value:
                report["wrong"].append(f"{where} = {value!r}, CuPy has {actual!r}")
            report["checked"] += 1
        elif callable(value):
            if not callable(actual):
                report["wrong"].append(f"{where}: not callable in CuPy")
                continue
            _signatures(value, actual, where, report)
        else:  # a property or an instance (Stream.null): that CuPy has it is the check
            report["checked"] += 1


def _signatures(emulated, real, where, report, constructor=False):
    mine = _signature(emulated, constructor)
    theirs = _signature(real, constructor)
    if mine is None or theirs is None:
        report["opaque"].append(where)
        return
    why = _incompatible(mine, theirs)
    if why:
        report["wrong"].append(f"{where}{mine} vs CuPy's {theirs}: {why}")
    report["signatures"] += 1


def test_emulation_matches_real_cupy_and_nccl():
    emu = Emulation(device_count=2)
    report = {"missing": [], "wrong": [], "opaque": [], "checked": 0, "signatures": 0}
    _compare(emu.cupy, cupy, "cupy", report)
    assert not report["missing"], f"the emulation offers what CuPy lacks: {report['missing']}"
    assert not report["wrong"], "emulation differs from CuPy:\n" + "\n".join(report["wrong"])
    assert report["signatures"] >= 30, report  # the walk really compared signatures
    assert report["checked"] >= 20, report
    assert len(report["opaque"]) <= report["signatures"] // 4, report["opaque"]


def test_signature_reader_reads_cython_lines():
    sig = _doc_signature(cupy.cuda.runtime.memcpyAsync)
    assert [p.name for p in sig.parameters.values()] == ["dst", "src", "size", "kind", "stream"]
    sig = _doc_signature(cupy.cuda.nccl.NcclCommunicator.commSplit)
    assert [p.name for p in sig.parameters.values()] == ["self", "color", "key", "config"]
    assert sig.parameters["config"].default == "None"

    def emulated(stream, event): ...
    assert _incompatible(inspect.signature(emulated),
                         _doc_signature(cupy.cuda.runtime.streamWaitEvent)) is None

    def drifted(event, stream): ...
    assert "position 0" in _incompatible(inspect.signature(drifted),
                                         _doc_signature(cupy.cuda.runtime.streamWaitEvent))


# ------------------------------------------------------------------------------ no GPU
@no_gpu
def test_doctor_reports_cupy_and_no_driver():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GPUCOLL_BACKEND", None)
    proc = subprocess.run([sys.executable, "-m", "gpucoll", "doctor"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert cupy.__version__ in proc.stdout
    assert re.search(r"auto\s*->\s*cpu", proc.stdout), proc.stdout
    proc = subprocess.run([sys.executable, "-m", "gpucoll", "doctor", "--json"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert cupy.__version__ in proc.stdout


@no_gpu
def test_auto_falls_back_to_cpu_and_nccl_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUCOLL_BACKEND", raising=False)
    url = f"file://{tmp_path / 'store'}"
    with gc.init(backend="auto", rank=0, world_size=1, url=url, timeout=30) as comm:
        assert comm.backend == "cpu"
        x = np.arange(5.0)
        np.testing.assert_array_equal(comm.all_reduce(x), np.arange(5.0))
    with pytest.raises(gc.BackendUnavailableError, match="nccl") as info:
        gc.init(backend="nccl", rank=0, world_size=1, url=f"file://{tmp_path / 'store2'}",
                timeout=30)
    assert "device" in str(info.value).lower() or "driver" in str(info.value).lower()


def test_the_attributes_the_fast_paths_read_mean_the_same_in_the_emulation():
    """The NCCL backend's one-pass all_reduce and the bucket kernels read CuPy's own
    ``ndarray._c_contiguous`` and ``data.device_id`` / ``data.ptr`` (no Flags or Device object
    per call). Private names are not in the walk above: here a real CuPy array over host memory
    (no GPU needed) and the emulation's array of the same layout answer alike."""
    from cupy.cuda import memory

    emu = Emulation(device_count=2)
    host = np.zeros((4, 6), np.float32)
    owner = memory.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=1)
    real = cupy.ndarray(host.shape, host.dtype, memptr=memory.MemoryPointer(owner, 0))
    with emu.cupy.cuda.Device(1):
        emulated = emu.cupy.zeros((4, 6), np.float32)
    for name, view in (("whole", lambda a: a), ("rows", lambda a: a[1:3]),
                       ("strided", lambda a: a[:, ::2]), ("reversed", lambda a: a[::-1])):
        ours, theirs = view(emulated), view(real)
        assert ours._c_contiguous == theirs._c_contiguous == theirs.flags.c_contiguous, name
        assert ours.data.device_id == theirs.data.device_id == 1, name
        assert ours.data.ptr - emulated.data.ptr == theirs.data.ptr - real.data.ptr, name
    assert real[1:3]._c_contiguous and not real[:, ::2]._c_contiguous
