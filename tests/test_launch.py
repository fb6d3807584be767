"""Tests of ``gpucoll run`` (gpucoll/launch.py, gpucoll/cli.py) with real processes.

The launcher runs as ``python -m gpucoll run ...`` in a subprocess; its ranks are the small
programs in tests/scripts/. Every test has a hard timeout, and every process a test may leave
behind (launcher, ranks, their children) is killed in a ``finally`` block.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from gpucoll.launch import THREAD_VARIABLES, LaunchConfig, UsageError, run_job

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
ENV_SCRIPT = str(SCRIPTS / "launch_env.py")
STORE_SCRIPT = str(SCRIPTS / "launch_store.py")
WORKER_SCRIPT = str(SCRIPTS / "launch_worker.py")

# Variables an outer launcher may have set; the launcher under test must set its own.
_OUTER = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE", "OMP_NUM_THREADS",
          "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
          "NUMEXPR_NUM_THREADS"]

pytestmark = pytest.mark.timeout(30)


def _env(extra: Optional[Dict[str, str]] = None, pythonpath: Sequence[Path] = (ROOT,)) -> Dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _OUTER}
    env["PYTHONPATH"] = os.pathsep.join(str(path) for path in pythonpath)
    env.update(extra or {})
    return env


def _start(args: Sequence[str], env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpucoll", *args], cwd=ROOT,
                            env=env if env is not None else _env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop_launcher(proc: subprocess.Popen) -> None:
    """Leftover launcher: SIGTERM lets it stop its ranks; SIGKILL if it does not end."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _run(args: Sequence[str], env: Optional[Dict[str, str]] = None,
         timeout: float = 20) -> subprocess.CompletedProcess:
    proc = _start(args, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _stop_launcher(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _is_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids(piddir: Path) -> Dict[str, int]:
    return {path.name: int(path.read_text()) for path in piddir.glob("*.pid")}


def _wait_for_pids(piddir: Path, count: int, timeout: float = 10) -> Dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _pids(piddir)
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"only {sorted(_pids(piddir))} of {count} pid files appeared")


def _wait_dead(pids: Dict[str, int], timeout: float = 5) -> List[str]:
    """Names of the pids still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [name for name, pid in pids.items() if _is_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _kill_leftovers(piddir: Path) -> None:
    for pid in _pids(piddir).values():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"launch_worker" in cmdline or b"time.sleep(60)" in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _rank_lines(text: str, tag: str) -> Dict[int, str]:
    """``{rank: rest}`` of the lines ``[rank R] TAG rest``; asserts one line per rank."""
    found: Dict[int, str] = {}
    for line in text.splitlines():
        match = re.fullmatch(rf"\[rank (\d+)\] {tag} (.*)", line)
        if match:
            rank = int(match.group(1))
            assert rank not in found, f"rank {rank} printed {tag} twice:\n{text}"
            found[rank] = match.group(2)
    return found


def _env_reports(result: subprocess.CompletedProcess) -> Dict[int, dict]:
    assert result.returncode == 0, result.stderr
    return {rank: json.loads(rest) for rank, rest in _rank_lines(result.stdout, "ENV").items()}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def piddir(tmp_path: Path):
    directory = tmp_path / "pids"
    directory.mkdir()
    try:
        yield directory
    finally:
        _kill_leftovers(directory)


# -- environment, output, token -------------------------------------------------------------


def test_three_ranks_get_their_environment_and_prefixed_output():
    result = _run(["run", "-n", "3", ENV_SCRIPT])
    reports = _env_reports(result)
    assert sorted(reports) == [0, 1, 2]
    tokens = set()
    for rank, report in reports.items():
        assert report["RANK"] == str(rank)  # the prefix names the rank that printed the line
        assert report["LOCAL_RANK"] == str(rank)
        assert report["WORLD_SIZE"] == "3"
        assert report["LOCAL_WORLD_SIZE"] == "3"
        assert report["GROUP_RANK"] == "0"
        assert report["MASTER_ADDR"] == "127.0.0.1"
        assert 0 < int(report["MASTER_PORT"]) < 65536
        assert report["GPUCOLL_LAUNCHER_STORE"] == "1"
        assert report["PYTHONUNBUFFERED"] == "1"
        assert report["argv"] == [] and report["name"] == "__main__"
        tokens.add(report["GPUCOLL_AUTH_TOKEN"])
    assert len({report["pid"] for report in reports.values()}) == 3
    assert len({report["MASTER_PORT"] for report in reports.values()}) == 1
    assert len(tokens) == 1
    token = tokens.pop()
    assert re.fullmatch(r"[0-9a-f]{32}", token), token
    # stderr lines go to stderr, stdout lines to stdout, each with its prefix
    assert sorted(_rank_lines(result.stderr, "ERR").items()) == [(0, "rank 0"), (1, "rank 1"), (2, "rank 2")]
    assert "ERR rank" not in result.stdout
    for rank in range(3):  # a last line without a newline still comes out whole
        assert f"[rank {rank}] partial line of rank {rank}\n" in result.stdout
    assert "ENV" not in result.stderr

    second = _env_reports(_run(["run", "-n", "3", ENV_SCRIPT]))
    assert {report["GPUCOLL_AUTH_TOKEN"] for report in second.values()} != {token}
    assert len({report["GPUCOLL_AUTH_TOKEN"] for report in second.values()}) == 1


def test_token_from_the_environment_is_used():
    result = _run(["run", "-n", "2", ENV_SCRIPT], env=_env({"GPUCOLL_AUTH_TOKEN": "shared-secret-42"}))
    reports = _env_reports(result)
    assert sorted(reports) == [0, 1]
    assert [report["GPUCOLL_AUTH_TOKEN"] for report in reports.values()] == ["shared-secret-42"] * 2


def test_module_form_and_arguments_pass_through():
    args = ["--foo", "bar", "-n", "7", "--", "a b", "-m", "x", "--timeout=3"]
    result = _run(["run", "-n", "2", "-m", "launch_env", *args], env=_env(pythonpath=(ROOT, SCRIPTS)))
    reports = _env_reports(result)
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert report["argv"] == args
        assert report["name"] == "__main__" and report["file"] == "launch_env.py"
        assert report["WORLD_SIZE"] == "2"


def test_script_arguments_pass_through_and_double_dash():
    args = ["-n", "5", "--nnodes", "9", "--help", "x y", "--"]
    reports = _env_reports(_run(["run", "-n", "1", ENV_SCRIPT, *args]))
    assert reports[0]["argv"] == args
    reports = _env_reports(_run(["run", "--nproc-per-node=2", "--", ENV_SCRIPT, "--flag"]))
    assert sorted(reports) == [0, 1]
    assert [report["argv"] for report in reports.values()] == [["--flag"], ["--flag"]]


# -- the launcher's store -------------------------------------------------------------------


def test_ranks_reach_the_launcher_store_and_a_wrong_token_is_refused():
    result = _run(["run", "-n", "3", STORE_SCRIPT])
    assert result.returncode == 0, result.stderr
    stores = {rank: json.loads(rest) for rank, rest in _rank_lines(result.stdout, "STORE").items()}
    assert sorted(stores) == [0, 1, 2]
    expected = [f"from rank {peer}" for peer in range(3)]
    for rank, report in stores.items():
        assert report["rank"] == rank and report["values"] == expected
    assert sorted(report["arrived"] for report in stores.values()) == [1, 2, 3]
    refused = _rank_lines(result.stdout, "WRONG_TOKEN")
    assert refused == {rank: "refused AuthenticationError" for rank in range(3)}


def test_two_nodes_share_node_zero_store():
    port = _free_port()
    env = _env({"GPUCOLL_AUTH_TOKEN": "two-node-secret"})
    common = ["--nnodes", "2", "-n", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node0 = _start(["run", *common, "--node-rank", "0", STORE_SCRIPT], env)
    node1 = _start(["run", *common, "--node-rank", "1", STORE_SCRIPT], env)
    try:
        out0, err0 = node0.communicate(timeout=20)
        out1, err1 = node1.communicate(timeout=20)
    finally:
        _stop_launcher(node1)
        _stop_launcher(node0)
    assert node0.returncode == 0, err0
    assert node1.returncode == 0, err1
    expected = ["from rank 0", "from rank 1"]
    assert json.loads(_rank_lines(out0, "STORE")[0])["values"] == expected
    assert json.loads(_rank_lines(out1, "STORE")[1])["values"] == expected
    assert _rank_lines(out1, "WRONG_TOKEN") == {1: "refused AuthenticationError"}


# -- failures, signals, timeout ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_first_failure_stops_the_others_and_reports_the_traceback(piddir: Path):
    # the sleepers sleep 60 s: the job must end well before, timed from rank 1's failure (not
    # from the launcher's start, which on a loaded machine can take seconds)
    result = _run(["run", "-n", "3", WORKER_SCRIPT, str(piddir), "1", "exit3"], timeout=45)
    ended = time.time()
    assert result.returncode == 3, result.stderr
    failing = [line for line in result.stdout.splitlines()
               if line.startswith("[rank 1] rank 1 is about to fail at ")]
    assert len(failing) == 1, result.stdout
    assert ended - float(failing[0].split()[-1]) < 15, failing
    pids = _pids(piddir)
    assert sorted(pids) == ["rank0.child.pid", "rank0.pid", "rank1.pid",
                            "rank2.child.pid", "rank2.pid"]
    assert _wait_dead(pids) == []  # ranks and the children they started
    lines = result.stderr.splitlines()
    failed_at = lines.index("gpucoll run: root cause (first observed failure): rank 1 failed "
                            "(exit code 3); stopped ranks 0, 2")
    tail = lines[failed_at + 1:]
    assert tail[0] == "gpucoll run: last 4 stderr lines of rank 1:"
    assert tail[1] == "[rank 1] Traceback (most recent call last):"
    assert tail[-1] == "[rank 1] RuntimeError: rank 1 broke on purpose"


def test_rank_killed_by_a_signal_is_reported_by_name(piddir: Path):
    result = _run(["run", "-n", "2", WORKER_SCRIPT, str(piddir), "0", "sigkill"])
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert ("gpucoll run: root cause (first observed failure): rank 0 failed (signal SIGKILL); "
            "stopped ranks 1") in result.stderr
    assert "gpucoll run: rank 0 wrote nothing to stderr" in result.stderr
    assert _wait_dead(_pids(piddir)) == []


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_stops_every_rank(piddir: Path, signum: int, code: int):
    proc = _start(["run", "-n", "2", WORKER_SCRIPT, str(piddir), "0", "sleep"])
    try:
        pids = _wait_for_pids(piddir, 4)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=10)
    finally:
        _stop_launcher(proc)
    assert proc.returncode == code, err
    assert f"gpucoll run: interrupted by {signal.Signals(signum).name}; stopped ranks 0, 1" in err
    assert _wait_dead(pids) == []
    assert sorted(_rank_lines(out, "rank")) == [0, 1]  # "[rank R] rank R sleeping" came through


def test_timeout_stops_the_job_and_names_the_running_ranks(piddir: Path):
    start = time.monotonic()
    result = _run(["run", "-n", "2", "--timeout", "1.5", WORKER_SCRIPT, str(piddir), "1", "exit0"])
    elapsed = time.monotonic() - start
    assert result.returncode == 124, result.stderr
    assert 1.5 <= elapsed < 10
    assert "gpucoll run: timed out after 1.5 s; ranks still running: 0 (stopped)" in result.stderr
    assert _wait_dead(_pids(piddir)) == []


def test_in_process_sigkill_after_the_grace_period(piddir: Path):
    out, err = io.StringIO(), io.StringIO()
    cfg = LaunchConfig(WORKER_SCRIPT, [str(piddir), "1", "exit3", "--ignore-term"], nproc=2,
                       kill_grace=0.5, env=_env(), stdout=out, stderr=err)
    start = time.monotonic()
    code = run_job(cfg)
    elapsed = time.monotonic() - start
    assert code == 3, err.getvalue()
    assert 0.5 <= elapsed < 10  # rank 0 ignores SIGTERM: only SIGKILL after the grace stops it
    assert "rank 1 failed (exit code 3); stopped ranks 0" in err.getvalue()
    assert "[rank 0] rank 0 sleeping\n" in out.getvalue()
    assert _wait_dead(_pids(piddir)) == []


# -- usage errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["run", "-n", "0", "MARKER"], "nproc (-n) must be an integer >= 1, got 0"),
    (["run", "-n", "2"], "missing the program to run"),
    (["run", "-n", "2", "-m"], "-m needs a module name"),
    (["run", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "MARKER"],
     "node_rank must be in [0, 1] for nnodes=2, got 2"),
    (["run", "--node-rank", "-1", "MARKER"], "node_rank must be an integer >= 0, got -1"),
    (["run", "--timeout", "0", "MARKER"], "timeout must be > 0 seconds"),
    (["run", "--nnodes", "2", "MARKER"], "needs --master-addr"),
    (["run", "--bogus", "MARKER"], "unrecognized arguments: --bogus"),
    (["run", "no_such_script.py"], "program 'no_such_script.py' does not exist"),
    (["run", "DATA"], "is neither a Python script nor an executable file"),
])
def test_usage_errors_exit_2_before_spawning(tmp_path: Path, args: List[str], message: str):
    marker = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    data = tmp_path / "weights.bin"
    data.write_bytes(b"\x00\x01binary")
    args = [str(script) if word == "MARKER" else str(data) if word == "DATA" else word
            for word in args]
    result = _run(args, env=_env({"GPUCOLL_AUTH_TOKEN": "t"}))
    assert result.returncode == 2, result.stderr
    assert "usage: gpucoll run" in result.stderr
    assert message in result.stderr
    assert not marker.exists()
    assert result.stdout == ""


def test_several_nodes_without_a_token_exit_2_with_the_export_command(tmp_path: Path):
    marker = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = _run(["run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                   "-n", "1", str(script)])
    assert result.returncode == 2, result.stderr
    assert "needs GPUCOLL_AUTH_TOKEN" in result.stderr
    assert "export the same secret on every node" in result.stderr
    assert re.search(r"^ +export GPUCOLL_AUTH_TOKEN=[0-9a-f]{32}$", result.stderr, re.MULTILINE)
    assert not marker.exists()


def test_run_job_raises_usage_error_without_spawning(tmp_path: Path):
    with pytest.raises(UsageError, match="nproc"):
        run_job(LaunchConfig(ENV_SCRIPT, nproc=0))
    with pytest.raises(UsageError, match="master_port 0"):
        run_job(LaunchConfig(ENV_SCRIPT, nnodes=2, master_addr="127.0.0.1", master_port=0,
                             env={"GPUCOLL_AUTH_TOKEN": "t"}))
    with pytest.raises(UsageError, match="needs GPUCOLL_AUTH_TOKEN"):
        run_job(LaunchConfig(ENV_SCRIPT, nnodes=2, master_addr="127.0.0.1", env={}))


# -- what people type, defaults, root cause ------------------------------------------------


def test_thread_variables_default_to_one_per_rank_unless_the_user_set_one():
    result = _run(["run", "-n", "2", ENV_SCRIPT])
    for report in _env_reports(result).values():
        assert report["OMP_NUM_THREADS"] == "1" and report["OPENBLAS_NUM_THREADS"] == "1"
        assert report["MKL_NUM_THREADS"] == "1"
    assert result.stderr.count("setting OMP_NUM_THREADS=1") == 1  # said once
    mine = _run(["run", "-n", "2", ENV_SCRIPT], env=_env({"OMP_NUM_THREADS": "3"}))
    for report in _env_reports(mine).values():
        assert report["OMP_NUM_THREADS"] == "3" and report["OPENBLAS_NUM_THREADS"] is None
    assert "setting OMP_NUM_THREADS" not in mine.stderr
    alone = _run(["run", "-n", "1", ENV_SCRIPT])
    assert _env_reports(alone)[0]["OMP_NUM_THREADS"] is None  # one rank: its threads are its own
    assert set(THREAD_VARIABLES) >= {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}


def test_progress_with_carriage_returns_shows_before_the_line_ends(tmp_path: Path):
    go = tmp_path / "go"
    script = tmp_path / "progress.py"
    script.write_text(
        "import os, sys, time\n"
        "sys.stdout.write('progress 50%\\r'); sys.stdout.flush()\n"
        f"deadline = time.monotonic() + 10\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "print('done')\n")
    proc = _start(["run", "-n", "1", str(script)])
    try:
        seen, deadline = b"", time.monotonic() + 8
        fd = proc.stdout.fileno()
        while b"progress 50%\r" not in seen and time.monotonic() < deadline:
            import select

            if select.select([fd], [], [], 0.1)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                seen += chunk
        go.touch()  # only now may the rank finish its line
        rest, err = proc.communicate(timeout=15)
    finally:
        _stop_launcher(proc)
    assert b"[rank 0] progress 50%\r" in seen, (seen, err)
    assert proc.returncode == 0, err
    assert "[rank 0] done\n" in rest


def test_programs_as_people_type_them(tmp_path: Path):
    script = tmp_path / "demo.py"
    script.write_text("import os, sys\nprint('RAN', os.environ['RANK'], sys.argv[1:])\n")
    plain = tmp_path / "demo_without_suffix"  # Python source, not executable
    plain.write_text(script.read_text())
    shell = tmp_path / "job.sh"
    shell.write_text("#!/bin/sh\necho RAN $RANK sh \"$@\"\n")
    shell.chmod(0o755)
    shebang = tmp_path / "tool"
    shebang.write_text(f"#!{sys.executable}\nimport os, sys\nprint('RAN', os.environ['RANK'], "
                       f"'shebang', sys.argv[1:])\n")
    shebang.chmod(0o755)
    cases = [
        ([sys.executable, str(script), "a"], "['a']"),               # the interpreter's full path
        ([Path(sys.executable).name, str(script), "a"], "['a']"),    # python script.py (on PATH)
        ([sys.executable, "-u", str(script), "b"], "['b']"),         # python3 -u x.py
        ([str(plain), "c"], "['c']"),
        ([str(shell), "d"], "sh d"),
        (["--no-python", str(shebang), "e"], "shebang ['e']"),
    ]
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    for words, expected in cases:
        result = _run(["run", "-n", "2", *words], env=_env({"PATH": path}))
        assert result.returncode == 0, (words, result.stderr)
        assert _rank_lines(result.stdout, "RAN") == {0: f"0 {expected}", 1: f"1 {expected}"}, words


CRASH_SCRIPT = str(SCRIPTS / "launch_crash.py")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 4])
def test_root_cause_is_the_rank_that_raised_every_time(nproc: int, tmp_path: Path):
    """Rank 1 raises inside ``with gc.init() as comm:``; the others fail in the all-reduce
    because of it. In each of 8 runs the launcher names rank 1, its error last."""
    env = _env()
    for attempt in range(8):
        out, err = io.StringIO(), io.StringIO()
        code = run_job(LaunchConfig(CRASH_SCRIPT, nproc=nproc, env=env, stdout=out, stderr=err,
                                    timeout=60))
        text = err.getvalue()
        lines = text.rstrip("\n").splitlines()
        assert code == 1, text
        assert re.search(r"^gpucoll run: root cause \(first observed failure\): rank 1 failed "
                         r"\(exit code 1\)", text, re.MULTILINE), (attempt, text)
        assert lines[-1] == "[rank 1] RuntimeError: boom", (attempt, text)
        if nproc == 2:  # the abort told rank 0 why
            assert "(peer 1 reported: rank 1 raised RuntimeError: boom)" in text, text
