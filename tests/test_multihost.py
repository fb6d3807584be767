"""Several hosts for real: ``gpucoll run --nnodes 2`` on two test hosts (network namespaces
joined by a veth pair, link-local addresses; see tests/netns.py), 2 ranks on each.

Correct results across the hosts (every collective, split, new_group against NumPy), the
auth token (a node with another token is refused, with an error naming the token), and
faults: a link cut mid-collective or mid-split (a rendezvous through the store), a host's
processes killed, the store's host killed or lost. After each fault every surviving rank must raise a named gpucoll error within the
communicator's timeout + 2 s of the fault. Added latency and loss (tc netem) or a slow link
(tc tbf), where the kernel has them, leave results correct.

Needs root (CAP_NET_ADMIN) and iproute2; skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

import netns
from multihost_jobs import NAMED_ERRORS, SCENARIOS, HostJob, run_fault_scenario

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(90)]

TIMEOUT = 4.0   # the communicators' timeout (init(timeout=))
SLACK = 2.0     # what the bound allows past it


@pytest.fixture
def hosts():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    netns.remove_stale()
    test_hosts = netns.TestHosts(2)
    try:
        yield test_hosts
    finally:
        test_hosts.close()


def _run_collectives(hosts, *args: str, limit: float = 60.0) -> HostJob:
    job = HostJob(hosts, ["collectives", str(TIMEOUT), *args])
    try:
        codes = job.wait(limit)
    finally:
        job.stop()
    assert codes == {0: 0, 1: 0}, f"launchers exited {codes}:\n{job.output()}"
    return job


def _check_checked(job: HostJob) -> None:
    counts = re.findall(r"^\[rank (\d+)\] CHECKED (\d+)$", job.output(), re.M)
    assert sorted(int(r) for r, _ in counts) == [0, 1, 2, 3], job.output()
    assert all(int(n) > 50 for _, n in counts), counts


def test_every_collective_split_and_new_group_across_two_hosts(hosts):
    job = _run_collectives(hosts)
    _check_checked(job)
    links = {int(r): json.loads(text) for r, text in
             re.findall(r"^\[rank (\d+)\] LINKS (.*)$", job.output(), re.M)}
    # the hosts really are two hosts: TCP to the other one, shared memory inside each
    for rank, kinds in links.items():
        for peer, kind in kinds.items():
            same_host = int(peer) // 2 == rank // 2
            assert kind == ("shm" if same_host else "tcp"), (rank, peer, kind)


def test_a_node_with_another_token_is_refused_on_both_sides(hosts):
    job = HostJob(hosts, ["loop", str(TIMEOUT)], tokens=["the-job-token", "another-token"])
    try:
        codes = job.wait(TIMEOUT + 20)
    finally:
        job.stop()
    faults, began = job.faults(), job.init_times()
    assert sorted(began) == [0, 1, 2, 3], job.output()
    # node 1's ranks: refused by the store at once, with an error about the token (timed from
    # each rank's own init: on a loaded machine starting Python alone can take seconds)
    for rank in (2, 3):
        name, when, message = faults[rank]
        assert name == "AuthenticationError", (rank, faults[rank])
        assert "token" in message.lower(), message
        assert when - began[rank] < TIMEOUT, (rank, when - began[rank])
    # node 0: its store reports the connections it refused from node 1, and its ranks fail
    # within seconds (not the timeout) of node 1's tries, naming the ranks that cannot join
    # and the token
    assert re.search(rf"store .*{re.escape(hosts.addrs[1])}", job.output(0)), job.output(0)
    refused = max(began[2], began[3])
    for rank in (0, 1):
        name, when, message = faults[rank]
        assert name == "AuthenticationError", (rank, faults[rank])
        assert "[2, 3]" in message and "token differs" in message, message
        assert when - max(began[rank], refused) < TIMEOUT, (rank, when - refused)
    assert None not in codes.values(), job.output()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_survivor_raises_a_named_error_within_the_timeout(hosts, scenario):
    report = run_fault_scenario(hosts, scenario, TIMEOUT)
    assert not report.missing, f"ranks {report.missing} raised nothing:\n{report.output}"
    for rank in report.survivors:
        name, delay, message = report.errors[rank]
        assert name in NAMED_ERRORS, f"rank {rank}: {name}: {message}"
        assert 0 <= delay < TIMEOUT + SLACK, (
            f"rank {rank} raised {name} {delay:.1f} s after the fault:\n{report.output}")
    # the surviving hosts' launchers end with their ranks (each rank exits 0 once it reported)
    assert all(code == 0 for code in report.launchers.values()), (report.launchers, report.output)


@pytest.mark.parametrize("kind, spec", [
    ("netem", ("delay", "10ms", "loss", "1%")),
    ("tbf", ("rate", "200mbit", "burst", "256kb", "latency", "50ms")),
], ids=["netem-delay-loss", "tbf-slow-link"])
def test_results_stay_correct_on_an_impaired_link(hosts, kind, spec):
    reason = netns.qdisc_unavailable_reason(hosts, kind)
    if reason:
        pytest.skip(reason)
    for host in (0, 1):  # qdiscs shape what a host sends: both directions
        hosts.qdisc(host, kind, *spec)
    job = _run_collectives(hosts, "3000")
    _check_checked(job)
    for host in (0, 1):  # the traffic between the hosts went through the impaired link
        assert hosts.qdisc_sent_bytes(host) > 1 << 20, host


def _reaches(hosts, src: int, dst: int) -> bool:
    """Whether host ``src`` reaches host ``dst`` (a TCP connect to a closed port is refused)."""
    probe = ("import socket, sys\n"
             "s = socket.socket(); s.settimeout(1.0)\n"
             "try:\n    s.connect((sys.argv[1], 9))\n"
             "except ConnectionRefusedError:\n    print('refused')\n"
             "except OSError as exc:\n    print(type(exc).__name__)\n")
    proc = hosts.popen(src, [sys.executable, "-c", probe, hosts.addrs[dst]])
    out, _ = proc.communicate(timeout=10)
    return out.strip() == "refused"


def test_three_test_hosts_on_a_bridge_and_a_cut_isolates_one():
    """The fixture's own check: three hosts on a bridge reach each other; cutting one host's
    link isolates that host only; restoring it reconnects it."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    with netns.TestHosts(3) as hosts:
        assert len(set(hosts.addrs)) == 3
        assert all(_reaches(hosts, src, dst) for src, dst in [(0, 1), (1, 2), (2, 0)])
        hosts.link_down(2)
        assert _reaches(hosts, 0, 1) and not _reaches(hosts, 2, 0) and not _reaches(hosts, 1, 2)
        hosts.link_up(2)
        deadline = time.monotonic() + 5
        while not _reaches(hosts, 2, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _reaches(hosts, 2, 0)
        names = list(hosts.names)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=10).stdout
    assert not any(name in listed for name in names), listed  # all deleted
