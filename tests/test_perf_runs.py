"""``gpucoll bench`` runs with the newer options, and ``bench/bench_cpu.py`` as its preset.

Real rank processes over loopback; small sizes and few iterations, so each run takes seconds.
"""

import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MACHINE_KEYS = {"host", "date", "cpu", "gpu", "python", "numpy", "gpucoll", "cupy", "nccl",
                "backend", "transports"}


def _run(*args, timeout=120, cwd=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                 "GPUCOLL_TRANSPORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd or ROOT)


def test_bfloat16_sweep_prints_json_to_stdout(tmp_path):
    pytest.importorskip("ml_dtypes")
    proc = _run("-m", "gpucoll", "bench", "all_reduce", "-g", "2", "-b", "8", "-e", "8K", "-f", "32",
                "-n", "2", "-w", "1", "-d", "bfloat16", "-o", "sum,avg,max", "--json", "-",
                cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # stdout is the JSON alone; the table went to stderr
    assert not (tmp_path / "-").exists()
    assert "# Out of bounds values : 0 OK" in proc.stderr
    assert [(r["type"], r["redop"]) for r in doc["rows"]] == [
        ("bfloat16", op) for op in ("sum", "avg", "max") for _ in range(3)]
    assert all(r[m]["wrong"] == 0 for r in doc["rows"] for m in ("out", "in"))
    assert doc["wrong"] == 0 and doc["settings"]["dtypes"] == ["bfloat16"]


def test_json_names_the_machine_and_versions(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run("-m", "gpucoll", "bench", "broadcast", "-g", "2", "-b", "1K", "-e", "1K", "-n", "1",
                "-w", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    machine = json.loads(out.read_text())["machine"]
    assert MACHINE_KEYS <= set(machine)
    import platform
    import socket

    import numpy as np

    import gpucoll

    assert machine["host"] == socket.gethostname() and machine["backend"] == "cpu"
    assert machine["python"] == platform.python_version() and machine["numpy"] == np.__version__
    assert machine["gpucoll"] == gpucoll.__version__
    assert machine["date"][:4].isdigit() and machine["date"].endswith("+00:00")
    assert machine["cpu"] and machine["gpu"] is None and machine["nccl"] is None
    assert machine["transports"]["default"].startswith("gpucoll ")


def test_transports_rounds_and_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    compare = ["--compare", "gloo"] if _has("torch") else []
    proc = _run("-m", "gpucoll", "bench", "all_reduce", "-g", "2", "-b", "1K", "-e", "16K", "-f",
                "16", "-n", "4", "-w", "1", "--transport", "unix,tcp", "--rounds", "2", "-a", "3",
                "--modes", "matched", "--table", "side-by-side", "--json", str(out), *compare,
                timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["machine"]["transports"] == {"unix": doc["machine"]["transports"]["unix"],
                                            "tcp": doc["machine"]["transports"]["tcp"]}
    assert doc["machine"]["transports"]["unix"].endswith("links: unix")
    assert doc["machine"]["transports"]["tcp"].endswith("links: tcp")
    for row in doc["rows"]:
        for key in ("unix/in", "tcp/in"):
            assert row[key]["wrong"] == 0 and len(row[key]["round_time_us"]) == 2
            assert row[key]["time_us"] == pytest.approx(min(row[key]["round_time_us"]))
        assert "unix/out" not in row and row["in"] == row["unix/in"]  # matched: in place only
        if compare:
            assert row["gloo"]["wrong"] == 0
            assert row["ratios"]["tcp"] == pytest.approx(row["gloo"]["time_us"] / row["tcp/in"]["time_us"])
    assert "gpucoll-unix" in proc.stdout and "gpucoll-tcp" in proc.stdout
    header = [line for line in proc.stdout.splitlines() if line.startswith("#       size")][0]
    assert header.split().count("#wrong") == 2 + bool(compare)


@pytest.mark.parametrize("args, message", [
    (["--transport", "udp"], "--transport"), (["--rounds", "0"], "--rounds"),
    (["-a", "7"], "invalid choice"), (["--ceiling", "1X"], "bad size"),
    (["--modes", "some"], "invalid choice"), (["--iter-bytes", "1G", "--min-iters", "50"],
                                              "--min-iters")])
def test_new_usage_errors_exit_2(args, message):
    proc = _run("-m", "gpucoll", "bench", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr


def test_bench_cpu_preset(tmp_path):
    out = tmp_path / "cpu.json"
    proc = _run("bench/bench_cpu.py", "--quick", "--world-sizes", "2", "--collectives",
                "all_reduce,all_gather", "--max-bytes", "4K", "--raw-bytes", "256K", "--no-gloo",
                "--json", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["settings"]["transports"] == ["unix", "tcp"] and run["settings"]["rounds"] == 3
    assert run["settings"]["average"] == 3 and run["settings"]["modes"] == "matched"
    assert set(run["ceiling"]) == {"unix", "tcp"}
    assert all(rate["gbps_best"] > 0 for rate in run["ceiling"].values())
    keys = {"all_reduce": ("unix/in", "tcp/in"), "all_gather": ("unix/out", "tcp/out")}
    for row in run["rows"]:
        for key in keys[row["collective"]]:
            assert row[key]["wrong"] == 0
    assert "# Raw two-way exchange" in proc.stdout and "0 wrong elements, 0 failures" in proc.stdout


def test_raw_exchange_rejects_unknown_kinds():
    from gpucoll.perf.ceiling import raw_exchange

    with pytest.raises(ValueError, match="udp"):
        raw_exchange(["udp"], 1024)


def _has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_terminating_the_bench_stops_its_ranks():
    import re
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-u", "-m", "gpucoll", "bench", "all_reduce", "-g", "2",
                             "-b", "1M", "-e", "1M", "-n", "100000", "-w", "0", "-T", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            match = re.match(r"#\s+Rank\s+\d+ Pid\s+(\d+)", line)
            if match:
                pids.append(int(match.group(1)))
        assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else "no pid lines"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _running(pid)]
        time.sleep(0.2)
    assert not alive, f"rank processes {alive} outlived the terminated bench"


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        os.kill(pid, 0)
        return True


def test_transports_under_gpucoll_run(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run("-m", "gpucoll", "run", "-n", "2", "-m", "gpucoll", "bench", "all_gather", "-b",
                "1K", "-e", "1K", "-n", "2", "-w", "0", "--transport", "unix,tcp", "--json",
                str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["unix/out"]["wrong"] == 0 and row["tcp/out"]["wrong"] == 0
    assert doc["machine"]["transports"]["tcp"].endswith("links: tcp")


def test_from_json_writes_the_same_csv_and_a_plot_without_measuring(tmp_path):
    saved, live_csv, again_csv = tmp_path / "run.json", tmp_path / "live.csv", tmp_path / "again.csv"
    proc = _run("-m", "gpucoll", "bench", "all_gather", "-g", "2", "-b", "1K", "-e", "4K", "-f", "4",
                "-n", "2", "-w", "1", "--json", str(saved), "--csv", str(live_csv))
    assert proc.returncode == 0, proc.stderr
    args = ["-m", "gpucoll", "bench", "--from-json", str(saved), "--csv", str(again_csv)]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(tmp_path / "run.png")]
    except ImportError:
        pass
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr
    assert "nRanks" not in proc.stdout + proc.stderr, "nothing is measured again"
    assert again_csv.read_text() == live_csv.read_text()
    if "--plot" in args:
        assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content, message", [
    (None, "needs --plot FILE.png or --csv FILE"),
    ("size,count\n1,2\n", "not a gpucoll bench --json document"),
    ('{"rows": [{"size": 8}]}', "not a gpucoll bench --json document"),
])
def test_from_json_usage_errors_exit_2(tmp_path, content, message):
    saved = tmp_path / "saved.json"
    saved.write_text(content if content is not None else '{"rows": []}')
    extra = [] if content is None else ["--csv", str(tmp_path / "out.csv")]
    proc = _run("-m", "gpucoll", "bench", "--from-json", str(saved), *extra)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out.csv").exists()
