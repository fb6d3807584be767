"""The README's runnable examples run as written.

A ```python block is runnable when its first line names the file and the command, e.g.
``# save as demo.py, run with: gpucoll run -n 2 demo.py`` or ``# ps_demo.py: run with gpucoll
run -n 4 ps_demo.py``. Each is saved under that name and run with that command (loopback, this
checkout on PYTHONPATH); it must exit 0, and where the README shows output right after the
block (a plain ``` block), every ``[rank R] ...`` and ``gpucoll run: ...`` line shown must appear
in what the run printed. Blocks that import CuPy skip without a GPU.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# Variables an outer launcher may have set; the launcher under test sets its own.
_OUTER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE")
_HEADER = re.compile(r"^# (?:save as )?(?P<name>\w+\.py)[:,] .*?run with:? "
                     r"(?P<command>gpucoll run [^#()]*?(?P=name))")
_BLOCK = re.compile(r"```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
_RUN_SECONDS = 90  # per example; they take a few seconds


class Example(NamedTuple):
    name: str
    command: List[str]
    code: str
    shown: List[str]  # output lines the README shows for it


def _examples() -> List[Example]:
    text = README.read_text(encoding="utf-8")
    blocks = list(_BLOCK.finditer(text))
    found = []
    for index, block in enumerate(blocks):
        if block["lang"] != "python":
            continue
        match = _HEADER.match(block["body"])
        if match is None:
            continue
        shown: List[str] = []
        after = blocks[index + 1] if index + 1 < len(blocks) else None
        if after is not None and after["lang"] == "" and not text[block.end():after.start()].strip():
            shown = [line for line in after["body"].splitlines()
                     if line.startswith(("[rank ", "gpucoll run: "))]
        found.append(Example(match["name"], shlex.split(match["command"]), block["body"], shown))
    return found


EXAMPLES = _examples()


def test_the_readme_has_runnable_examples():
    names = {example.name for example in EXAMPLES}
    assert {"demo.py", "survive.py", "zero_demo.py", "fsdp_demo.py", "tp_demo.py", "moe_demo.py",
            "ps_demo.py", "cp_demo.py", "hsdp_demo.py"} <= names, names


def _gpu_reason() -> str:
    from gpucoll.cuda_env import gpu_unavailable_reason

    return gpu_unavailable_reason() or ""


def _stop(proc: subprocess.Popen) -> None:
    """A launcher still running: SIGTERM lets it stop its ranks; then SIGKILL its group."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.timeout(_RUN_SECONDS + 30)
@pytest.mark.parametrize("example", EXAMPLES, ids=[example.name for example in EXAMPLES])
def test_readme_example_runs_as_written(example: Example, tmp_path: Path):
    if re.search(r"^import cupy", example.code, re.M):
        reason = _gpu_reason()
        if reason:
            pytest.skip(f"GPU example: {reason}")
    (tmp_path / example.name).write_text(example.code, encoding="utf-8")
    assert example.command[:2] == ["gpucoll", "run"], example.command
    env = {key: value for key, value in os.environ.items() if key not in _OUTER}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "gpucoll", *example.command[1:]],
                            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=_RUN_SECONDS)
    except subprocess.TimeoutExpired:
        _stop(proc)
        output, _ = proc.communicate()
        pytest.fail(f"{example.name} did not finish within {_RUN_SECONDS} s:\n{output}")
    finally:
        _stop(proc)
    assert proc.returncode == 0, f"{' '.join(example.command)} exited {proc.returncode}:\n{output}"
    printed = output.splitlines()
    for line in example.shown:
        assert line in printed, f"the README shows {line!r}; the run printed:\n{output}"


_MARKDOWN = [README, *sorted((ROOT / "bench").glob("*.md")), *sorted((ROOT / "docker").glob("*.md"))]


@pytest.mark.parametrize("path", _MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_code_fences_are_closed(path: Path):
    """An unclosed ``` turns the rest of a page into one code block."""
    fences = [number for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
              if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, (f"{path.name}: {len(fences)} fence lines, an odd number: a "
                                  f"block is never closed (fences on lines {fences})")
