"""What each rank of ``gpucoll run`` (and ``gc.spawn``) runs, and the environment defaults.

A Python script (``.py``-like name, a ``python`` shebang, or non-executable text that compiles)
or ``-m module`` runs with ``sys.executable``; anything else executable (``python3 -u x.py``, a
shell script, a binary) runs as it is, as mpiexec and torchrun's ``--no-python`` do. When
several ranks share a node and the user set none of :data:`THREAD_VARIABLES`, each rank gets
them at 1 (torchrun's default), so the ranks' math libraries do not oversubscribe the cores.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Mapping, Sequence, Tuple

from .cliutil import UsageError

__all__ = ["THREAD_VARIABLES", "program_command", "limits_threads", "thread_notice"]

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
"""Set to 1 for each rank when several share a node and the user set none of them."""

_PYTHON_SUFFIXES = (".py", ".pyw", ".pyc", ".pyz")


def _is_python_source(path: str) -> bool:
    """A ``.py``-like name, a ``python`` shebang, or (not executable) text that compiles."""
    if path.endswith(_PYTHON_SUFFIXES):
        return True
    try:
        with open(path, "rb") as handle:
            head = handle.read(1 << 16)
    except OSError:
        return False
    if head.startswith(b"#!"):
        return b"python" in head.split(b"\n", 1)[0]
    if b"\0" in head or os.access(path, os.X_OK):
        return False
    try:
        compile(head.decode("utf-8"), path, "exec")
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return False
    return True


def program_command(program: str, args: Sequence[str] = (), *, module: bool = False,
                    no_python: bool = False) -> Tuple[str, ...]:
    """The command line of one rank: Python for scripts and modules, else the executable.

    Raises:
        UsageError: the program does not exist, or is neither Python nor executable.
    """
    args = tuple(args)
    if module:
        return (sys.executable, "-m", program, *args)
    if os.path.isdir(program):
        if os.path.isfile(os.path.join(program, "__main__.py")) and not no_python:
            return (sys.executable, program, *args)
        raise UsageError(f"program {program!r} is a directory without __main__.py")
    if os.path.isfile(program):
        if not no_python and _is_python_source(program):
            return (sys.executable, program, *args)
        if os.access(program, os.X_OK):
            return (os.path.abspath(program), *args)
        raise UsageError(f"program {program!r} is neither a Python script nor an executable "
                         f"file (chmod +x it, or run an interpreter: gpucoll run -n N bash "
                         f"{program})")
    found = shutil.which(program) if os.sep not in program else None
    if found is None:
        raise UsageError(f"program {program!r} does not exist (no such file, and not a command "
                         f"on PATH)")
    return (found, *args)


def limits_threads(local_ranks: int, env: Mapping[str, str]) -> bool:
    """Several ranks on this node and none of the thread variables set by the user."""
    return local_ranks > 1 and not any(name in env for name in THREAD_VARIABLES)


def thread_notice(local_ranks: int) -> str:
    """The one line said on stderr when :func:`limits_threads` holds."""
    return (f"setting OMP_NUM_THREADS=1 (and {', '.join(THREAD_VARIABLES[1:])}) for each of the "
            f"{local_ranks} ranks so that their math libraries do not oversubscribe the cores; "
            f"set OMP_NUM_THREADS to choose")
