"""``gpucoll run --nnodes 2``: the nodes' launchers agree on when the job is over
(gpucoll/launch_nodes.py). Two launchers on this host (loopback), one rank each.

- A replacement on node 1 that nobody can admit any more (node 0's rank finished without
  growing) is stopped, and both launchers exit 0, instead of node 1 failing the job when node
  0's store went away.
- A replacement on node 1 that node 0's rank admits is not stopped while that member runs.
- Node 0's launcher serves the store until node 1's ranks are done with it.
- Node 0 does not wait for a node whose launcher went silent (SIGKILLed) longer than
  GPUCOLL_NODE_SILENCE (shortened here).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from gpucoll.launch import LaunchConfig, run_job
from test_grow import NOBODY_GROWS   # a rank dies; the other finishes without grow()
from test_launch import ROOT, _env, _free_port, _start, _stop_launcher

pytestmark = pytest.mark.timeout(90)

TOKEN = "two-node-secret"


def _launcher(node: int, port: int, script, *extra: str) -> subprocess.Popen:
    return _start(["run", "--nnodes", "2", "-n", "1", "--master-addr", "127.0.0.1",
                   "--master-port", str(port), "--node-rank", str(node), *extra, str(script)],
                  _env({"GPUCOLL_AUTH_TOKEN": TOKEN}))


def _finish(procs, timeout: float = 40):
    """(returncode, stdout, stderr) of each launcher; stragglers are stopped."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            _stop_launcher(proc)
    return results


ELASTIC = ["--elastic", "--replace", "1"]


def test_a_replacement_nobody_can_admit_on_another_node_is_stopped(tmp_path):
    script = tmp_path / "nobody_grows.py"
    script.write_text(NOBODY_GROWS)
    port = _free_port()
    (code0, out0, err0), (code1, out1, err1) = _finish(
        [_launcher(0, port, script, *ELASTIC), _launcher(1, port, script, *ELASTIC)])
    assert code0 == 0, err0
    assert code1 == 0, err1
    assert "[rank 0] DONE 0" in out0
    assert ("gpucoll run: the other ranks of every node finished before the replacement(s) for "
            "rank(s) 1 were admitted (nobody called comm.grow()): stopping them") in err1, err1
    assert ("gpucoll run: elastic job finished: 0 of 1 ranks exited 0; lost rank(s) 1 (signal "
            "SIGKILL); 1 replacement(s) started") in err1, err1


GROWS = """
import json, os, signal, time
import numpy as np
import gpucoll
comm = gpucoll.init(backend="cpu", timeout=20)
if not comm.joined:
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    old, comm = comm, comm.shrink()
    old.close()
    deadline = time.monotonic() + 30
    while comm.size < 2 and time.monotonic() < deadline:
        time.sleep(0.7)   # longer than the launchers' asks: node 1 sees it idle meanwhile
        bigger = comm.grow()
        if bigger is not comm:
            comm.close()
            comm = bigger
total = comm.all_reduce(np.array([comm.to_world(comm.rank) + 1.0]))
print("SUM " + json.dumps([comm.rank, comm.size, list(comm.joined), float(total[0])]), flush=True)
comm.close()
"""


def test_a_replacement_on_another_node_is_admitted_not_stopped(tmp_path):
    script = tmp_path / "grows.py"
    script.write_text(GROWS)
    port = _free_port()
    (code0, out0, err0), (code1, out1, err1) = _finish(
        [_launcher(0, port, script, *ELASTIC), _launcher(1, port, script, *ELASTIC)])
    assert code0 == 0, err0
    assert code1 == 0, err1
    assert "stopping them" not in err1, err1
    sums = sorted(json.loads(line.split(" ", 3)[3]) for line in (out0 + out1).splitlines()
                  if line.split(" ")[2:3] == ["SUM"])
    assert sums == [[0, 2, [1], 3.0], [1, 2, [1], 3.0]], out0 + out1
    assert ("elastic job finished: 1 of 1 ranks exited 0; lost rank(s) 1 (signal SIGKILL); "
            "1 replacement(s) started") in err1, err1


LATE_READER = """
import os, time
from gpucoll.rendezvous.tcp_store import TCPStore
rank = int(os.environ["RANK"])
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                 token=os.environ["GPUCOLL_AUTH_TOKEN"], timeout=15)
if rank == 0:
    store.set("result", b"from rank 0")
    print("SET", flush=True)
else:
    store.wait(["gpucoll/launch/exited/0"], timeout=30)  # node 0's launcher: its ranks are done
    time.sleep(3)      # longer than node 0 waits before it says it serves on for node 1
    print("READ", store.get("result").decode(), "at", f"{time.time():.3f}", flush=True)
store.close()
"""


def test_node_zero_serves_the_store_until_the_other_node_is_done(tmp_path):
    script = tmp_path / "late_reader.py"
    script.write_text(LATE_READER)
    port = _free_port()
    (code0, out0, err0), (code1, out1, err1) = _finish(
        [_launcher(0, port, script), _launcher(1, port, script)])
    ended = time.time()
    assert code0 == 0, err0
    assert code1 == 0, err1
    read = re.search(r"^\[rank 1\] READ from rank 0 at ([\d.]+)$", out1, re.MULTILINE)
    assert read, out1 + err1
    assert ("this node's ranks are done; serving the store until the launcher(s) of node(s) 1 "
            "are done too") in err0, err0
    # node 0 ends once node 1's launcher says it is done, not after GPUCOLL_NODE_SILENCE (10 s)
    # of silence; timed from rank 1's read, as the launchers' start-up varies with the load
    assert ended - float(read.group(1)) < 8, (ended, read.group(0))


SLEEPER = """
import os, time
if os.environ["RANK"] == "1":
    open(os.environ["SLEEPER_RUNNING"], "w").close()  # its launcher beats before it starts
    time.sleep(60)
"""


def test_node_zero_stops_waiting_for_a_node_gone_silent(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCOLL_NODE_SILENCE", "2")
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    port = _free_port()
    running = tmp_path / "rank1.running"
    monkeypatch.setenv("SLEEPER_RUNNING", str(running))
    node1 = _launcher(1, port, script)
    err = io.StringIO()
    killer = threading.Timer(2.5, os.kill, (node1.pid, signal.SIGKILL))
    try:
        # node 1 beats once its rank runs (its first beats may find no store yet); waited for,
        # as starting it takes seconds on a loaded machine
        deadline = time.monotonic() + 30
        while not running.exists():
            assert time.monotonic() < deadline and node1.poll() is None, "node 1 did not start"
            time.sleep(0.05)
        cfg = LaunchConfig(str(script), nproc=1, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                           master_port=port, stdout=io.StringIO(), stderr=err,
                           env={**os.environ, "GPUCOLL_AUTH_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)})
        started = time.monotonic()
        killer.start()  # a timer here, not a process whose own start-up would delay the kill
        code = run_job(cfg)
        took = time.monotonic() - started
    finally:
        killer.cancel()
        if killer.ident is not None:
            killer.join(5)
        _finish([node1], timeout=15)
    assert code == 0, err.getvalue()
    assert ("no word from the launcher(s) of node(s) 1 for 2 s (host lost? "
            "GPUCOLL_NODE_SILENCE): closed the store without them") in err.getvalue(), \
        err.getvalue()
    # node 1 beat until it was killed (2.5 s after node 0 started), then 2 s of silence
    assert 2.5 <= took < 15, took
