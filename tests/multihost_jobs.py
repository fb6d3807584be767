"""``gpucoll run --nnodes N`` jobs on test hosts (tests/netns.py), and the fault scenarios.

:class:`HostJob` starts one launcher per test host, all running tests/scripts/multihost_worker.py,
and collects their output lines as they come. :func:`run_fault_scenario` runs the worker's
``loop`` mode, injects one fault once every rank is busy, and returns, per surviving rank, the
error it raised and how long after the fault (the workers print wall-clock times; test hosts
share the machine's clock). Used by tests/test_multihost.py and bench/bench_faults.py.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from netns import TestHosts

__all__ = ["HostJob", "FaultReport", "SCENARIOS", "NAMED_ERRORS", "run_fault_scenario"]

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "scripts" / "multihost_worker.py"
NAMED_ERRORS = ("CommTimeoutError", "PeerError", "CommAbortedError")
_INIT = re.compile(r"^\[rank (\d+)\] INIT (\d+) ([\d.]+)$")
_FAULT = re.compile(r"^\[rank (\d+)\] FAULT (\d+) (\w+) ([\d.]+) ?(.*)$")


class HostJob:
    """One launcher per host: ``gpucoll run -n NPROC --nnodes len(hosts) --node-rank K``.

    Args:
        hosts: the test hosts; host 0 serves the store.
        args: the worker's arguments (mode, timeout, ...).
        tokens: GPUCOLL_AUTH_TOKEN of each host's launcher (default: one shared token).
        nproc: ranks per host.
        port: the store's port on host 0.
    """

    def __init__(self, hosts: TestHosts, args: Sequence[str], *, tokens: Optional[Sequence[str]] = None,
                 nproc: int = 2, port: int = 29500, job_timeout: float = 60.0):
        self.hosts = hosts
        count = len(hosts.names)
        tokens = list(tokens) if tokens is not None else ["multihost-test-token"] * count
        self.lines: List[List[str]] = [[] for _ in range(count)]
        self._cond = threading.Condition()
        self.procs = []
        self._readers: List[threading.Thread] = []
        self.started = time.time()
        for k in range(count):
            env = dict(os.environ)
            env.update({"PYTHONPATH": str(ROOT), "GPUCOLL_AUTH_TOKEN": tokens[k],
                        "PYTHONUNBUFFERED": "1",
                        # a cut link silences a node: node 0's launcher waits this long for it
                        "GPUCOLL_NODE_SILENCE": "2"})
            env.pop("GPUCOLL_HOST", None)
            argv = [sys.executable, "-m", "gpucoll", "run", "-n", str(nproc), "--nnodes", str(count),
                    "--node-rank", str(k), "--master-addr", hosts.addrs[0], "--master-port",
                    str(port), "--timeout", str(job_timeout), str(WORKER), *args]
            proc = hosts.popen(k, argv, env=env, cwd=str(ROOT))
            self.procs.append(proc)
            for stream in (proc.stdout, proc.stderr):
                reader = threading.Thread(target=self._read, args=(k, stream), daemon=True)
                reader.start()
                self._readers.append(reader)

    def _read(self, host: int, stream) -> None:
        for line in iter(stream.readline, ""):
            with self._cond:
                self.lines[host].append(line.rstrip("\n"))
                self._cond.notify_all()
        stream.close()

    def output(self, host: Optional[int] = None) -> str:
        with self._cond:
            hosts = range(len(self.lines)) if host is None else [host]
            return "\n".join(line for k in hosts for line in self.lines[k])

    def wait_for(self, pattern: str, count: int, timeout: float) -> bool:
        """Wait until ``count`` lines (all hosts) match ``pattern``; False on timeout."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(1 for lines in self.lines for line in lines if regex.search(line)) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or all(p.poll() is not None for p in self.procs):
                    return sum(1 for lines in self.lines for line in lines
                               if regex.search(line)) >= count
                self._cond.wait(min(remaining, 0.2))
        return True

    def wait(self, timeout: float, hosts: Optional[Sequence[int]] = None) -> Dict[int, Optional[int]]:
        """Wait (at most ``timeout`` in all) for the launchers; host -> exit code (None: still
        running, then killed with everything on its host)."""
        deadline = time.monotonic() + timeout
        codes: Dict[int, Optional[int]] = {}
        for k in (range(len(self.procs)) if hosts is None else hosts):
            try:
                codes[k] = self.procs[k].wait(max(deadline - time.monotonic(), 0.01))
            except Exception:  # subprocess.TimeoutExpired
                codes[k] = None
                self.hosts.kill_all(k)
                self.procs[k].wait(5)
        for reader in self._readers:
            reader.join(2.0)
        return codes

    def stop(self) -> None:
        """Kill every launcher and rank still running (bounded)."""
        for k, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.hosts.kill_all(k)
        for proc in self.procs:
            try:
                proc.wait(5)
            except Exception:
                pass

    def init_times(self) -> Dict[int, float]:
        """rank -> wall-clock time its ``init`` began (the ``loop`` workers' INIT lines)."""
        return {int(m.group(1)): float(m.group(3)) for m in
                (_INIT.match(line) for line in self.output().splitlines()) if m}

    def faults(self) -> Dict[int, tuple]:
        """rank -> (error class, wall-clock time, message) from the workers' FAULT lines."""
        found = {}
        for line in self.output().splitlines():
            match = _FAULT.match(line)
            if match:
                found[int(match.group(1))] = (match.group(3), float(match.group(4)), match.group(5))
        return found


@dataclass
class FaultReport:
    """What one fault scenario did: the survivors, each one's error and delay."""

    scenario: str
    ranks: int
    survivors: List[int]
    timeout: float
    fault_time: float
    errors: Dict[int, tuple] = field(default_factory=dict)  # rank -> (class, seconds, message)
    launchers: Dict[int, Optional[int]] = field(default_factory=dict)  # surviving host -> exit code
    output: str = ""

    @property
    def missing(self) -> List[int]:
        return [r for r in self.survivors if r not in self.errors]

    @property
    def worst(self) -> Optional[float]:
        delays = [self.errors[r][1] for r in self.survivors if r in self.errors]
        return max(delays) if delays else None

    @property
    def all_named(self) -> bool:
        return not self.missing and all(self.errors[r][0] in NAMED_ERRORS for r in self.survivors)


def _link_cut(hosts: TestHosts) -> List[int]:
    hosts.link_down(1)
    return []


def _host_killed(hosts: TestHosts) -> List[int]:
    hosts.kill_all(1)
    return [1]


def _store_host_killed(hosts: TestHosts) -> List[int]:
    hosts.kill_all(0)
    return [0]


def _store_host_lost(hosts: TestHosts) -> List[int]:
    hosts.link_down(0)  # first: nothing the dying processes send (FIN, RST) gets out
    hosts.kill_all(0)
    return [0]


# name -> (inject(hosts) -> lost hosts, what it does, what the ranks loop on)
SCENARIOS = {
    "link cut": (_link_cut, "host 1's link set down (ip link set ... down) mid-all_reduce",
                 "all_reduce"),
    "host killed": (_host_killed, "every process of host 1 (launcher, ranks) SIGKILLed",
                    "all_reduce"),
    "store host killed": (_store_host_killed, "every process of host 0 (the store's launcher, "
                                              "its ranks) SIGKILLed", "all_reduce"),
    "store host lost": (_store_host_lost, "host 0 cut off, then its processes SIGKILLed "
                                          "(as a power loss: no FIN or RST reaches the others)",
                        "all_reduce"),
    "link cut in split": (_link_cut, "host 1's link set down while the ranks split (a new "
                                     "communicator's rendezvous through the store)", "split"),
}


def run_fault_scenario(hosts: TestHosts, scenario: str, timeout: float, *, nproc: int = 2,
                       port: int = 29500, start_limit: float = 40.0) -> FaultReport:
    """Run the worker's all_reduce loop on every host, inject ``scenario`` once every rank
    printed READY, and collect the survivors' errors.

    Raises:
        RuntimeError: the job did not get going (the message carries its output).
    """
    inject, _, op = SCENARIOS[scenario]
    count = len(hosts.names)
    ranks = count * nproc
    job = HostJob(hosts, ["loop", str(timeout), op], nproc=nproc, port=port)
    try:
        if not job.wait_for(r"\] READY ", ranks, start_limit):
            raise RuntimeError(f"the job did not start within {start_limit:g} s:\n{job.output()}")
        fault_time = time.time()
        lost_hosts = inject(hosts)
        survivors = [r for r in range(ranks) if r // nproc not in lost_hosts]
        living = [k for k in range(count) if k not in lost_hosts]
        codes = job.wait(timeout + 15.0, living)
    finally:
        job.stop()
    report = FaultReport(scenario, ranks, survivors, timeout, fault_time, launchers=codes,
                         output=job.output())
    for rank, (name, when, message) in job.faults().items():
        if rank in survivors:
            report.errors[rank] = (name, when - fault_time, message)
    return report
