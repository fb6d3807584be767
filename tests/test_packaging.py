"""What pyproject.toml promises is what the extras and the README need.

The ``cu12`` / ``cu13`` extras must bring NVRTC and the CUDA headers (CuPy's ``ctk`` extra: without
it no kernel compiles on a host that has only the driver), NumPy >= 2 and ml_dtypes (CuPy 14's and
bfloat16's needs), and the Python floor must be one that CuPy 14 supports and the README states.
"""

import os
import re

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]


def _floor(spec: str) -> tuple:
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert match, f"requires-python should be a plain floor, got {spec!r}"
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("extra, cupy", [("cu12", "cupy-cuda12x"), ("cu13", "cupy-cuda13x")])
def test_cuda_extras_bring_the_compiler_and_their_floors(extra, cupy):
    requirements = [r.replace(" ", "") for r in _project()["optional-dependencies"][extra]]
    assert f"{cupy}[ctk]>=14" in requirements, requirements
    assert f"nvidia-nccl-{extra}" in requirements
    assert "numpy>=2" in requirements and "ml_dtypes" in requirements


def test_python_floor_fits_cupy_14_and_the_readme():
    floor = _floor(_project()["requires-python"])
    assert floor >= (3, 10), "CuPy 14 (the cu12 / cu13 extras) needs Python 3.10"
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        stated = re.findall(r"Python (\d+)\.(\d+)\+", handle.read())
    assert stated and all((int(a), int(b)) == floor for a, b in stated), stated
