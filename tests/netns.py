"""Test hosts made of Linux network namespaces: real hosts to the library, on one machine.

:class:`TestHosts` builds ``count`` namespaces, each with loopback up and one end of a veth
pair to the next (two hosts: one pair ``h0 <-> h1``; more: every host joined to a bridge in a
namespace of its own), each with a link-local address ``169.254.<net>.<host + 1>``. Those
addresses exist only inside the namespaces: nothing a test sends can leave the machine.

It runs commands inside a host (``ip netns exec``), cuts and restores a host's link, adds a
``tc`` qdisc (netem delay/loss, a tbf rate limit), and kills every process of a host. Names
carry this process's id, so concurrent runs never clash; :meth:`close` kills what still runs
inside and deletes every namespace (deleting one also deletes its veth ends).

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; :func:`unavailable_reason`
says why not where it cannot work.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = ["TestHosts", "unavailable_reason", "qdisc_unavailable_reason", "PREFIX"]

PREFIX = "gcmh"              # every namespace this module makes is named gcmh<pid>n<k>...
_IP_TIMEOUT = 10.0           # seconds any one ip / tc command may take
_counter = itertools.count()
_probe_cache: Dict[str, Optional[str]] = {}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Delete namespaces of this module whose creating process is gone (a killed test run)."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        match = re.match(rf"({PREFIX}(\d+)n\S*)", line.strip())
        if match and not _pid_alive(int(match.group(2))):
            _kill_inside(match.group(1))
            _ip("netns", "del", match.group(1), check=False)


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be made here (None: they can); probed once per process."""
    if "netns" in _probe_cache:
        return _probe_cache["netns"]
    reason: Optional[str] = None
    if not shutil.which("ip"):
        reason = "iproute2's `ip` is not installed (apt-get install iproute2)"
    elif hasattr(os, "geteuid") and os.geteuid() != 0:
        reason = "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    else:
        name = f"{PREFIX}{os.getpid()}nprobe"
        try:
            made = _ip("netns", "add", name, check=False)
            if made.returncode != 0:
                reason = f"cannot create a network namespace: {made.stderr.strip()}"
            else:
                veth = _ip("link", "add", f"{PREFIX}p{os.getpid()}"[:15], "netns", name, "type",
                           "veth", "peer", "name", "pr", "netns", name, check=False)
                if veth.returncode != 0:
                    reason = f"cannot create a veth pair: {veth.stderr.strip()}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            reason = f"cannot run ip: {exc}"
        finally:
            _ip("netns", "del", name, check=False)
    _probe_cache["netns"] = reason
    return reason


def qdisc_unavailable_reason(hosts: "TestHosts", kind: str) -> Optional[str]:
    """Why ``tc qdisc add ... <kind>`` fails here (e.g. no sch_netem module); None: it works."""
    key = f"qdisc:{kind}"
    if key not in _probe_cache:
        if not shutil.which("tc"):
            _probe_cache[key] = "iproute2's `tc` is not installed"
        else:
            spec = {"netem": ["delay", "1ms"], "tbf": ["rate", "1gbit", "burst", "64kb",
                                                      "latency", "50ms"]}[kind]
            name, dev = hosts.names[0], hosts.devices[0]
            added = subprocess.run(["tc", "-n", name, "qdisc", "add", "dev", dev, "root", kind,
                                    *spec], capture_output=True, text=True, timeout=_IP_TIMEOUT)
            subprocess.run(["tc", "-n", name, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=_IP_TIMEOUT)
            _probe_cache[key] = (None if added.returncode == 0 else
                                 f"tc qdisc {kind} is unavailable here (kernel module sch_{kind}?): "
                                 f"{added.stderr.strip()}")
    return _probe_cache[key]


def _kill_inside(name: str) -> List[int]:
    """SIGKILL every process in namespace ``name``; their ids."""
    listed = _ip("netns", "pids", name, check=False).stdout.split()
    pids = [int(p) for p in listed if p.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


class TestHosts:
    """``count`` test hosts (network namespaces) on one link-local network; see module doc.

    Attributes:
        names: the namespace of each host.
        addrs: each host's address (``169.254.<net>.<k + 1>``).
        devices: each host's veth end (its one network interface besides loopback).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, count: int = 2):
        if count < 2:
            raise ValueError(f"count must be at least 2, got {count}")
        tag = f"{PREFIX}{os.getpid()}n{next(_counter)}"
        net = 1 + (os.getpid() + next(_counter)) % 250
        self.names = [f"{tag}h{k}" for k in range(count)]
        self.addrs = [f"169.254.{net}.{k + 1}" for k in range(count)]
        self.devices = [f"gv{os.getpid() % 100000}x{k}" for k in range(count)]
        self._switch = f"{tag}sw" if count > 2 else None
        self._made: List[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        for name in self.names:
            self._add_ns(name)
        if self._switch is None:  # two hosts: one veth pair between them
            _ip("link", "add", self.devices[0], "netns", self.names[0], "type", "veth",
                "peer", "name", self.devices[1], "netns", self.names[1])
        else:  # a bridge in its own namespace, one veth pair per host
            self._add_ns(self._switch)
            _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._switch, "link", "set", "br0", "up")
            for k, (name, dev) in enumerate(zip(self.names, self.devices)):
                port = f"p{k}"
                _ip("link", "add", dev, "netns", name, "type", "veth",
                    "peer", "name", port, "netns", self._switch)
                _ip("-n", self._switch, "link", "set", port, "master", "br0")
                _ip("-n", self._switch, "link", "set", port, "up")
        for name, dev, addr in zip(self.names, self.devices, self.addrs):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")

    # -- running things -----------------------------------------------------------------------

    def command(self, host: int, argv: Sequence[str]) -> List[str]:
        """``argv`` wrapped to run inside host ``host``."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` (stdout and stderr piped unless given)."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(self.command(host, argv), env=None if env is None else dict(env),
                                stdin=subprocess.DEVNULL, text=True, **kwargs)

    def run_everywhere(self, argv_of, env: Mapping[str, str], timeout: float,
                       **kwargs) -> List[str]:
        """Run ``argv_of(k)`` on every host ``k`` at once and return their stdouts; every
        process is killed at ``timeout``. SystemExit names the hosts that failed, with the
        end of their stderr (the benchmarks' ``--test-hosts`` runs)."""
        procs = [self.popen(k, argv_of(k), env=env, **kwargs) for k in range(len(self.names))]
        try:
            outputs = [proc.communicate(timeout=timeout) for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
        failed = [k for k, proc in enumerate(procs) if proc.returncode != 0]
        if failed:
            raise SystemExit(f"host(s) {failed} failed:\n" + "\n".join(
                outputs[k][1][-2000:] for k in failed))
        return [out for out, _ in outputs]

    def pids(self, host: int) -> List[int]:
        """The processes running inside host ``host``."""
        listed = _ip("netns", "pids", self.names[host], check=False).stdout.split()
        return [int(p) for p in listed if p.isdigit()]

    def kill_all(self, host: int) -> List[int]:
        """SIGKILL every process of host ``host`` at once (a host that lost power)."""
        return _kill_inside(self.names[host])

    # -- network faults -----------------------------------------------------------------------

    def link_down(self, host: int) -> None:
        """Cut host ``host`` off the network (its interface down; nothing is sent or received,
        and no connection is reset: the peers see silence)."""
        _ip("-n", self.names[host], "link", "set", self.devices[host], "down")

    def link_up(self, host: int) -> None:
        _ip("-n", self.names[host], "link", "set", self.devices[host], "up")

    def qdisc(self, host: int, kind: str, *spec: str) -> None:
        """``tc qdisc add dev <host's interface> root <kind> <spec...>`` (e.g. ``netem delay
        20ms loss 1%`` or ``tbf rate 50mbit burst 64kb latency 100ms``) on what the host sends."""
        result = subprocess.run(["tc", "-n", self.names[host], "qdisc", "add", "dev",
                                 self.devices[host], "root", kind, *spec],
                                capture_output=True, text=True, timeout=_IP_TIMEOUT)
        if result.returncode != 0:
            raise RuntimeError(f"tc qdisc add {kind} {' '.join(spec)}: {result.stderr.strip()}")

    def qdisc_sent_bytes(self, host: int) -> int:
        """Bytes that went through the root qdisc of host ``host``'s interface (``tc -s``)."""
        result = subprocess.run(["tc", "-s", "-n", self.names[host], "qdisc", "show", "dev",
                                 self.devices[host], "root"],
                                capture_output=True, text=True, timeout=_IP_TIMEOUT)
        match = re.search(r"Sent (\d+) bytes", result.stdout)
        return int(match.group(1)) if match else 0

    # -- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs inside and delete every namespace (bounded; safe to call twice)."""
        made, self._made = self._made, []
        for name in made:
            _kill_inside(name)
        for name in made:
            deadline = time.monotonic() + 5.0
            while _ip("netns", "pids", name, check=False).stdout.split() and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            _ip("netns", "del", name, check=False)

    def __enter__(self) -> "TestHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
