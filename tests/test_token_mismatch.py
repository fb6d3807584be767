"""Two nodes of one job with different auth tokens: both sides say so within seconds, naming
the cause, instead of one side waiting out the whole timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "launcher_allreduce.py")

pytestmark = pytest.mark.timeout(60)

_OUTER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE")


def _node(node_rank: int, port: int, token: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in _OUTER}
    env.update(PYTHONPATH=str(ROOT), GPUCOLL_AUTH_TOKEN=token, GPUCOLL_TIMEOUT="120")
    return subprocess.Popen(
        [sys.executable, "-m", "gpucoll", "run", "--nnodes", "2", "--node-rank", str(node_rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "-n", "1", SCRIPT],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=ROOT)


def test_different_tokens_are_named_on_both_nodes_within_seconds():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    nodes = [_node(0, port, "token-of-node-0"), _node(1, port, "token-of-node-1")]
    try:
        outputs = [node.communicate(timeout=45) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait(10)
    elapsed = time.monotonic() - start
    for node_rank, (node, (_, err)) in enumerate(zip(nodes, outputs)):
        assert node.returncode != 0, (node_rank, err)
        assert "the authentication token differs from node 0's" in err, (node_rank, err)
    assert "rank(s) [1] of 2 cannot join: a process at 127.0.0.1:" in outputs[0][1]
    assert elapsed < 30, elapsed  # the limit is 120 s: nobody waited it out
