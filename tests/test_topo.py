"""``gpucoll topo``: a sane report without a GPU, JSON keys, the GPU layout, usage errors."""

import json
import os
import subprocess
import sys

import pytest

from gpucoll import topo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "gpucoll", "topo", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def test_topo_reports_the_host_and_writes_json(tmp_path):
    out = tmp_path / "topo.json"
    proc = _cli("--quick", "--size", "1M", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert {"gpucoll_version", "gpu_available", "gpu_unavailable_reason", "gpu", "host"} <= set(doc)
    measured = doc["host"]["measured"]
    assert set(measured) == {"memcpy_gbps", "tcp_bandwidth_gbps", "tcp_latency_us",
                             "unix_bandwidth_gbps", "unix_latency_us"}
    assert all(value > 0 for value in measured.values())
    assert 0 < measured["tcp_latency_us"] < 1e5 and 0 < measured["unix_latency_us"] < 1e5
    assert doc["host"]["info"]["cpus"] >= 1
    assert "memory copy (NumPy)" in proc.stdout and "Unix domain socket" in proc.stdout
    if not doc["gpu_available"]:
        assert doc["gpu"] is None and doc["gpu_unavailable_reason"]
        assert proc.stdout.startswith("# No GPU: ")


def test_gpu_layout_formats_matrices():
    copies = {"h2d_pinned_gbps": 25.0, "d2h_pinned_gbps": 26.0, "h2d_pageable_gbps": 10.0,
              "d2h_pageable_gbps": 9.0, "d2d_gbps": 1500.0}
    device = {"index": 0, "name": "GPU", "pci_bus_id": "0000:04:00.0", "numa_node": 0,
              "memory_bytes": 80 << 30, "compute_capability": "9.0", "pcie_gen": 5,
              "pcie_width": 16, "nvlink_count": 18, "nvlink_version": "4.0", "copies": copies}
    doc = {"gpu_available": True, "gpu_unavailable_reason": None,
           "gpu": {"devices": [device, dict(device, index=1, pci_bus_id="0000:05:00.0")],
                   "bytes": 1 << 26, "peer_access": [[True, True], [True, True]],
                   "p2p_bandwidth_gbps": [[1500.0, 370.0], [371.0, 1501.0]],
                   "p2p_latency_us": [[2.0, 3.0], [3.0, 2.0]]},
           "host": {"info": {"hostname": "h", "cpu_model": "cpu", "cpus": 2, "cpus_usable": 2,
                             "numa_nodes": 1, "memory_bytes": 1 << 30}, "bytes": 1 << 26,
                    "measured": {"memcpy_gbps": 10.0, "tcp_bandwidth_gbps": 2.0,
                                 "tcp_latency_us": 10.0, "unix_bandwidth_gbps": 3.0,
                                 "unix_latency_us": 8.0}}}
    text = topo.format_report(doc)
    assert "GPU 1: GPU  bus 0000:05:00.0  NUMA 0" in text and "NVLink 4.0, 18 link(s)" in text
    assert "PCIe gen 5 x16" in text and "370.0" in text and "1500.0" in text
    assert "No GPU" not in text


class _FakeNvml:
    """pynvml with two enabled links of one NVML NVLink version enum."""
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 4

    class NVMLError(Exception):
        pass

    def __init__(self, version_enum):
        self.version_enum = version_enum

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        return bus_id

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        raise self.NVMLError("not supported")

    def nvmlDeviceGetNvLinkState(self, handle, link):
        return 1 if link < 2 else 0

    def nvmlDeviceGetNvLinkVersion(self, handle, link):
        return self.version_enum


@pytest.mark.parametrize("version_enum, name", [(4, "3.0"), (6, "4.0"), (7, "5.0"),
                                                (99, "unknown (NVML version enum 99)")])
def test_nvlink_version_is_named_not_nvmls_enum(monkeypatch, version_enum, name):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(version_enum))
    links = topo._nvml_links("0000:04:00.0")
    assert links["nvlink_count"] == 2 and links["nvlink_version"] == name
    assert links["nvlink_nvml_enum"] == version_enum


@pytest.mark.parametrize("args, message", [(["--size", "1X"], "bad size"),
                                           (["--size", "100"], "at least 4K"),
                                           (["--bogus"], "unrecognized")])
def test_topo_usage_errors_exit_2(args, message):
    proc = _cli(*args)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.gpu
def test_gpu_report_has_matrices():
    doc = topo.gpu_report(1 << 20, quick=True)
    count = len(doc["devices"])
    assert count >= 1 and len(doc["p2p_bandwidth_gbps"]) == count
    assert all(len(row) == count for row in doc["peer_access"])
    assert all(d["copies"]["h2d_pinned_gbps"] > 0 and d["pci_bus_id"] for d in doc["devices"])


def test_host_figures_are_measured_before_any_gpu_work(monkeypatch):
    """The host figures fork socket peers; forking after CUDA made its contexts (and the
    driver's threads) is what must not happen, so the GPU part comes second."""
    order = []
    monkeypatch.setattr(topo, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(topo, "host_report", lambda nbytes, quick: order.append("host") or {})
    monkeypatch.setattr(topo, "gpu_report", lambda nbytes, quick: order.append("gpu") or {})
    doc = topo.report(1 << 10, quick=True)
    assert order == ["host", "gpu"] and doc["gpu_available"] and doc["gpu"] == {}
