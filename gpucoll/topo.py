"""``gpucoll topo``: what the GPUs are, how they are linked, and how fast copies between them go.

With CuPy and a CUDA device: each GPU's name, PCI bus id, NUMA node, memory, PCIe generation
and width, NVLink links (count and version, through NVML's ``pynvml`` when installed), the
peer-access matrix, and measured matrices like CUDA's p2pBandwidthLatencyTest (GPU-to-GPU copy
bandwidth and latency) and bandwidthTest (host-to-device and device-to-host, pinned and
pageable; device memory copy). Without a GPU it says why and measures the host instead: memory
copy bandwidth with NumPy, and loopback TCP and Unix-socket bandwidth and latency between two
processes. GB/s are 1e9 bytes per second of bytes copied (each byte counted once).

Example::

    gpucoll topo
    gpucoll topo --json topo.json --plot topo.png
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import struct
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from . import cliutil
from .cliutil import UsageError
from .cuda_env import gpu_inventory, gpu_unavailable_reason

__all__ = ["UsageError", "parse_size", "gpu_unavailable_reason", "host_report", "gpu_report",
           "report", "format_report", "main"]


def parse_size(text: str) -> int:
    """``--size``: a byte count of at least 4 KiB."""
    size = cliutil.parse_size(text)
    if size < 4096:
        raise UsageError(f"--size must be at least 4K, got {text}")
    return size


# ---------------------------------------------------------------- host
def _read(path: str) -> Optional[str]:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _host_info() -> Dict[str, Any]:
    cpuinfo = _read("/proc/cpuinfo") or ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    meminfo = _read("/proc/meminfo") or ""
    total = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.MULTILINE)
    nodes = sorted(name for name in (os.listdir("/sys/devices/system/node")
                                     if os.path.isdir("/sys/devices/system/node") else [])
                   if re.fullmatch(r"node\d+", name))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cpu_model": model.group(1) if model else platform.processor() or None,
            "cpus": os.cpu_count(), "cpus_usable": usable,
            "numa_nodes": len(nodes) or None,
            "memory_bytes": int(total.group(1)) * 1024 if total else None}


def _best_seconds(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _memcpy_bandwidth(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    return nbytes / _best_seconds(lambda: np.copyto(dst, src), repeats) / 1e9


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _sink(sock: socket.socket) -> None:
    """Peer process: answer pings and swallow bulk transfers until told to stop."""
    header = bytearray(9)
    buffer = bytearray(1 << 20)
    try:
        while True:
            _recv_exact(sock, memoryview(header))
            kind, value = header[:1], struct.unpack("!Q", header[1:])[0]
            if kind == b"q":
                return
            if kind == b"p":  # value one-byte round trips
                one = bytearray(1)
                for _ in range(value):
                    _recv_exact(sock, memoryview(one))
                    sock.sendall(one)
            else:  # b"b": value bytes, then a one-byte acknowledgement
                left = value
                while left:
                    n = sock.recv_into(buffer, min(left, len(buffer)))
                    if n == 0:
                        return
                    left -= n
                sock.sendall(b"k")
    finally:
        sock.close()


def _socket_figures(sock: socket.socket, nbytes: int, pings: int, repeats: int) -> Dict[str, float]:
    one = bytearray(1)

    def ping():
        sock.sendall(b"p" + struct.pack("!Q", pings))
        for _ in range(pings):
            sock.sendall(one)
            _recv_exact(sock, memoryview(one))

    payload = memoryview(bytearray(nbytes))

    def bulk():
        sock.sendall(b"b" + struct.pack("!Q", nbytes))
        sock.sendall(payload)
        _recv_exact(sock, memoryview(one))

    latency = _best_seconds(ping, repeats) / pings / 2
    bulk()  # warm-up (socket buffers, page faults)
    bandwidth = nbytes / _best_seconds(bulk, repeats) / 1e9
    sock.sendall(b"q" + struct.pack("!Q", 0))
    return {"bandwidth_gbps": bandwidth, "latency_us": latency * 1e6}


def _between_processes(kind: str, nbytes: int, pings: int, repeats: int) -> Dict[str, float]:
    """One-way bandwidth and half round-trip latency to a forked peer over ``kind`` sockets."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    if kind == "unix":
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        theirs = socket.create_connection(listener.getsockname())
        mine, _ = listener.accept()
        listener.close()
        for sock in (mine, theirs):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for sock in (mine, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    peer = ctx.Process(target=_sink, args=(theirs,), daemon=True)
    peer.start()
    theirs.close()
    try:
        mine.settimeout(60)
        return _socket_figures(mine, nbytes, pings, repeats)
    finally:
        mine.close()
        peer.join(10)
        if peer.is_alive():
            peer.kill()
            peer.join(5)


def host_report(nbytes: int = 64 << 20, quick: bool = False) -> Dict[str, Any]:
    """The host's figures: memory copy, loopback TCP and Unix-socket bandwidth and latency."""
    repeats, pings = (2, 200) if quick else (5, 2000)
    measured = {"memcpy_gbps": _memcpy_bandwidth(nbytes, repeats)}
    for kind in ("tcp", "unix"):
        figures = _between_processes(kind, nbytes, pings, repeats)
        measured[f"{kind}_bandwidth_gbps"] = figures["bandwidth_gbps"]
        measured[f"{kind}_latency_us"] = figures["latency_us"]
    return {"info": _host_info(), "bytes": nbytes, "measured": measured}


# ---------------------------------------------------------------- GPUs (CuPy, NVML)
#: NVML's nvmlNvlinkVersion_t (what nvmlDeviceGetNvLinkVersion returns) -> NVLink version:
#: A100 links report 4 (NVLink 3.0), H100 6 (NVLink 4.0), B200 7 (NVLink 5.0).
NVLINK_VERSIONS = {1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0",
                   8: "6.0"}


def nvlink_version_name(nvml_enum: int) -> str:
    """The NVLink version ("4.0") of NVML's version enum (6), or what NVML said if unknown."""
    return NVLINK_VERSIONS.get(int(nvml_enum), f"unknown (NVML version enum {nvml_enum})")


def _nvml_links(bus_id: str) -> Dict[str, Any]:
    """NVLink count and version and PCIe link through NVML (``pynvml``), when installed."""
    try:
        import pynvml
    except ImportError:
        return {"nvml": "pynvml not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode() if isinstance(bus_id, str) else bus_id)
        out: Dict[str, Any] = {"nvml": "ok"}
        try:
            out["pcie_gen"] = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
            out["pcie_width"] = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
            out["pcie_gen_max"] = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
            out["pcie_width_max"] = pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
        except pynvml.NVMLError:
            pass
        links, versions = 0, set()
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    links += 1
                    versions.add(pynvml.nvmlDeviceGetNvLinkVersion(handle, link))
            except pynvml.NVMLError:
                break
        out["nvlink_count"] = links
        out["nvlink_version"] = nvlink_version_name(max(versions)) if versions else None
        out["nvlink_nvml_enum"] = max(versions) if versions else None
        return out
    except Exception as exc:  # NVML missing from the driver, or no permission
        return {"nvml": f"NVML unavailable ({type(exc).__name__}: {exc})"}


def _gpu_devices(cupy) -> List[Dict[str, Any]]:
    """``cuda_env.gpu_inventory`` with NVLink and PCIe details from NVML where it has them."""
    devices = gpu_inventory(cupy)
    for entry in devices:
        links = _nvml_links(entry["pci_bus_id"])
        entry.update({k: v for k, v in links.items() if v is not None or k not in entry})
    return devices


def _event_seconds(cupy, run, repeats: int) -> float:
    """Mean seconds of ``run()`` (enqueued on the current stream) over ``repeats`` calls."""
    run()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        run()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / repeats


def _peer_matrices(cupy, count: int, nbytes: int, repeats: int):
    runtime = cupy.cuda.runtime
    access = [[i == j or bool(runtime.deviceCanAccessPeer(i, j)) for j in range(count)]
              for i in range(count)]
    bandwidth = [[0.0] * count for _ in range(count)]
    latency = [[0.0] * count for _ in range(count)]
    for i in range(count):
        with cupy.cuda.Device(i):
            for j in range(count):
                if i != j and access[i][j]:
                    try:
                        runtime.deviceEnablePeerAccess(j)
                    except cupy.cuda.runtime.CUDARuntimeError:
                        pass  # already enabled
    for i in range(count):
        with cupy.cuda.Device(i):
            src, tiny_src = cupy.empty(nbytes, cupy.uint8), cupy.empty(4, cupy.uint8)
        for j in range(count):
            with cupy.cuda.Device(j):
                dst, tiny_dst = cupy.empty(nbytes, cupy.uint8), cupy.empty(4, cupy.uint8)
            with cupy.cuda.Device(i):
                stream = cupy.cuda.get_current_stream().ptr
                copy = lambda d, s, n: runtime.memcpyPeerAsync(d.data.ptr, j, s.data.ptr, i, n, stream)  # noqa: E731
                bandwidth[i][j] = nbytes / _event_seconds(cupy, lambda: copy(dst, src, nbytes), repeats) / 1e9
                latency[i][j] = _event_seconds(cupy, lambda: copy(tiny_dst, tiny_src, 4), 100) * 1e6
    return access, bandwidth, latency


def _host_device(cupy, index: int, nbytes: int, repeats: int) -> Dict[str, float]:
    runtime = cupy.cuda.runtime
    with cupy.cuda.Device(index):
        device = cupy.empty(nbytes, cupy.uint8)
        pinned_mem = cupy.cuda.alloc_pinned_memory(nbytes)
        pinned = np.frombuffer(pinned_mem, np.uint8, nbytes)
        pageable = np.ones(nbytes, np.uint8)
        pinned[:] = 1
        stream = cupy.cuda.get_current_stream()
        h2d, d2h = runtime.memcpyHostToDevice, runtime.memcpyDeviceToHost
        figures = {}
        for label, host in (("pinned", pinned), ("pageable", pageable)):
            host_ptr = host.ctypes.data
            up = lambda: runtime.memcpyAsync(device.data.ptr, host_ptr, nbytes, h2d, stream.ptr)  # noqa: E731
            down = lambda: runtime.memcpyAsync(host_ptr, device.data.ptr, nbytes, d2h, stream.ptr)  # noqa: E731
            figures[f"h2d_{label}_gbps"] = nbytes / _event_seconds(cupy, up, repeats) / 1e9
            figures[f"d2h_{label}_gbps"] = nbytes / _event_seconds(cupy, down, repeats) / 1e9
        other = cupy.empty(nbytes, cupy.uint8)
        d2d = lambda: runtime.memcpyAsync(other.data.ptr, device.data.ptr, nbytes,  # noqa: E731
                                          runtime.memcpyDeviceToDevice, stream.ptr)
        figures["d2d_gbps"] = nbytes / _event_seconds(cupy, d2d, repeats) / 1e9
        return figures


def gpu_report(nbytes: int = 64 << 20, quick: bool = False) -> Dict[str, Any]:
    """GPUs, links, peer access and measured copy matrices (needs CuPy and a CUDA device)."""
    import cupy

    repeats = 3 if quick else 20
    devices = _gpu_devices(cupy)
    access, bandwidth, latency = _peer_matrices(cupy, len(devices), nbytes, repeats)
    for device in devices:
        device["copies"] = _host_device(cupy, device["index"], nbytes, repeats)
    return {"devices": devices, "bytes": nbytes, "peer_access": access,
            "p2p_bandwidth_gbps": bandwidth, "p2p_latency_us": latency}


def report(nbytes: int = 64 << 20, quick: bool = False) -> Dict[str, Any]:
    """The whole ``gpucoll topo`` document: GPUs when there are any, the host in every case."""
    from . import __version__

    reason = gpu_unavailable_reason()
    doc: Dict[str, Any] = {"gpucoll_version": __version__, "gpu_available": reason is None,
                           "gpu_unavailable_reason": reason, "gpu": None}
    # the host figures fork their socket peers: before any CUDA context (and the driver's
    # threads) exists in this process, which a forked child must not inherit
    doc["host"] = host_report(nbytes, quick)
    doc["gpu"] = gpu_report(nbytes, quick) if reason is None else None
    return doc


# ---------------------------------------------------------------- output
def _matrix(title: str, values, fmt: str) -> List[str]:
    count = len(values)
    lines = [title, "   D\\D" + "".join(f"{j:>9d}" for j in range(count))]
    for i, row in enumerate(values):
        lines.append(f"{i:6d} " + "".join(f"{fmt.format(v):>9}" for v in row))
    return lines


def format_report(doc: Dict[str, Any]) -> str:
    lines: List[str] = []
    host = doc["host"]
    info, measured = host["info"], host["measured"]
    if doc["gpu_available"]:
        gpu = doc["gpu"]
        lines.append(f"# {len(gpu['devices'])} GPU(s)")
        for d in gpu["devices"]:
            nvlink = (f"NVLink {d['nvlink_version']}, {d['nvlink_count']} link(s)"
                      if d.get("nvlink_count") else f"NVLink: {'none' if 'nvlink_count' in d else d.get('nvml')}")
            lines.append(f"GPU {d['index']}: {d['name']}  bus {d['pci_bus_id']}  NUMA {d['numa_node']}  "
                         f"{d['memory_bytes'] / 2**30:.1f} GiB  cc {d['compute_capability']}  "
                         f"PCIe gen {d.get('pcie_gen')} x{d.get('pcie_width')}  {nvlink}")
        lines += _matrix("# Peer access (1: yes)", [[int(v) for v in row] for row in gpu["peer_access"]], "{}")
        lines += _matrix("# GPU-to-GPU copy bandwidth (GB/s; diagonal: within one GPU)",
                         gpu["p2p_bandwidth_gbps"], "{:.1f}")
        lines += _matrix("# GPU-to-GPU copy latency (us, 4-byte copies)", gpu["p2p_latency_us"], "{:.2f}")
        lines.append(f"# Host <-> device bandwidth (GB/s, {gpu['bytes']} B copies)")
        lines.append(f"{'GPU':>4} {'H2D pinned':>11} {'D2H pinned':>11} {'H2D pageable':>13} "
                     f"{'D2H pageable':>13} {'D2D':>8}")
        for d in gpu["devices"]:
            c = d["copies"]
            lines.append(f"{d['index']:4d} {c['h2d_pinned_gbps']:11.1f} {c['d2h_pinned_gbps']:11.1f} "
                         f"{c['h2d_pageable_gbps']:13.1f} {c['d2h_pageable_gbps']:13.1f} {c['d2d_gbps']:8.1f}")
    else:
        lines.append(f"# No GPU: {doc['gpu_unavailable_reason']}. Measuring the host instead.")
    lines.append(f"# Host {info['hostname']}: {info['cpu_model']}, {info['cpus_usable']} of "
                 f"{info['cpus']} CPUs usable, NUMA nodes {info['numa_nodes']}, memory "
                 f"{(info['memory_bytes'] or 0) / 2**30:.1f} GiB")
    lines.append(f"# Host figures ({host['bytes']} B transfers; latency is half a 1-byte round trip)")
    lines.append(f"memory copy (NumPy)      {measured['memcpy_gbps']:9.2f} GB/s")
    lines.append(f"loopback TCP             {measured['tcp_bandwidth_gbps']:9.2f} GB/s  "
                 f"{measured['tcp_latency_us']:8.1f} us")
    lines.append(f"Unix domain socket       {measured['unix_bandwidth_gbps']:9.2f} GB/s  "
                 f"{measured['unix_latency_us']:8.1f} us")
    return "\n".join(lines)


def write_plot(path: str, doc: Dict[str, Any]) -> None:
    """Heat map of the GPU-to-GPU bandwidth matrix; bar chart of the host figures without a GPU."""
    plt = cliutil.require_matplotlib()
    figure, axes = plt.subplots(figsize=(7, 5))
    if doc["gpu_available"]:
        matrix = np.array(doc["gpu"]["p2p_bandwidth_gbps"])
        image = axes.imshow(matrix, cmap="viridis")
        for (i, j), value in np.ndenumerate(matrix):
            axes.text(j, i, f"{value:.0f}", ha="center", va="center", color="w")
        axes.set_xlabel("destination GPU")
        axes.set_ylabel("source GPU")
        axes.set_title("GPU-to-GPU copy bandwidth (GB/s)")
        figure.colorbar(image, ax=axes)
    else:
        m = doc["host"]["measured"]
        labels = ["memory copy", "loopback TCP", "Unix socket"]
        values = [m["memcpy_gbps"], m["tcp_bandwidth_gbps"], m["unix_bandwidth_gbps"]]
        axes.bar(labels, values)
        axes.set_ylabel("GB/s")
        axes.set_title(f"host {doc['host']['info']['hostname']} (no GPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(json_path: Optional[str] = None, plot_path: Optional[str] = None,
         size: int = 64 << 20, quick: bool = False, out=None) -> int:
    """Print the report (and write ``--json`` / ``--plot``). Returns 0, also without a GPU."""
    out = out or sys.stdout
    if plot_path:
        cliutil.require_matplotlib()
    doc = report(min(size, 8 << 20) if quick else size, quick)
    out.write(format_report(doc) + "\n")
    out.flush()
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(doc, handle, indent=1)
    if plot_path:
        write_plot(plot_path, doc)
    return 0
