"""The backend registry and the transport selection point: the extension points of gpucoll.

A backend registered here (a one-rank "toy") can be chosen by ``init(backend=)`` and by
``GPUCOLL_BACKEND``, shows up in ``gpucoll bench --backend`` and ``gpucoll doctor``, and an op
it lacks says so by name. The transport table is checked per mode and over real sockets.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpucoll
from gpucoll import config
from gpucoll.backends import registry
from gpucoll.communicator import Communicator
from gpucoll.errors import BackendUnavailableError, UnsupportedOperationError
from gpucoll.transports import select

from mp_harness import run_ranks

pytestmark = pytest.mark.timeout(60)


class ToyCommunicator(Communicator):
    """A one-rank backend that only all-reduces (the result is the input)."""

    backend = "toy"
    memory = "host"

    def __init__(self, store, rank, size, **common):
        self.rank, self.size, self.local_rank, self.local_size = rank, size, 0, 1
        self.timeout, self.common, self.store = common["timeout"], common, store
        self.released = False

    def _all_reduce(self, x, op, out, async_op, stream=None):
        if out is not None:
            out[...] = x
            return out
        return x

    def abort(self):
        self.released = True
        self.store.close()

    def close(self):
        self.abort()


@pytest.fixture
def toy(monkeypatch):
    state = {"reason": None}
    registry.register_backend("toy", ToyCommunicator, lambda: state["reason"],
                              memory="host", auto_priority=50,
                              description="one rank, all_reduce only")
    yield state
    registry.unregister_backend("toy")


def _init_toy(tmp_path, **kw):
    return gpucoll.init(rank=0, world_size=1, url=f"file://{tmp_path}/store", timeout=5, **kw)


def test_a_registered_backend_is_chosen_by_name_and_by_environment(toy, tmp_path, monkeypatch):
    comm = _init_toy(tmp_path, backend="toy")
    assert isinstance(comm, ToyCommunicator) and comm.backend == "toy"
    assert set(comm.common) == set(registry.COMMON_SETTINGS)  # no socket settings leak in
    comm.close()
    monkeypatch.setenv("GPUCOLL_BACKEND", "toy")
    comm = _init_toy(tmp_path)
    assert isinstance(comm, ToyCommunicator)
    x = np.arange(5.0)
    assert comm.all_reduce(x) is x
    comm.close()


def test_an_op_the_backend_lacks_is_named(toy, tmp_path):
    comm = _init_toy(tmp_path, backend="toy")
    with pytest.raises(UnsupportedOperationError, match="backend 'toy' does not support broadcast"):
        comm.broadcast(np.zeros(3))
    with pytest.raises(UnsupportedOperationError, match="does not support split"):
        comm.split(0)
    with pytest.raises(UnsupportedOperationError, match="backend 'toy' does not support grow"):
        comm.grow()
    with pytest.raises(ValueError, match="out of range"):  # argument checks still come first
        comm.broadcast(np.zeros(3), root=4)
    comm.close()


def test_auto_takes_the_usable_backend_of_highest_priority(toy):
    assert registry.resolve_backend("auto") == "toy"
    toy["reason"] = "the toy is broken"
    assert registry.resolve_backend("auto") in ("cpu", "nccl")
    with pytest.raises(BackendUnavailableError, match="backend 'toy' cannot run here: the toy is broken"):
        registry.resolve_backend("toy")
    assert registry.available_backends()["toy"] == "the toy is broken"


def test_unknown_and_bad_names(toy):
    with pytest.raises(ValueError, match=r"unknown backend 'gloo'; registered: auto, cpu, nccl, mpi, toy"):
        registry.resolve_backend("gloo")
    for bad in ("auto", "", "a b"):
        with pytest.raises(ValueError, match="bad backend name"):
            registry.register_backend(bad, ToyCommunicator)
    with pytest.raises(ValueError, match="memory must be one of"):
        registry.register_backend("toy2", ToyCommunicator, memory="disk")


def test_options_a_backend_does_not_take_are_refused_before_anything_starts(toy, tmp_path):
    with pytest.raises(ValueError, match=r"init\(transport='tcp'\) applies to backend\(s\) cpu, not 'toy'"):
        _init_toy(tmp_path, backend="toy", transport="tcp")
    with pytest.raises(ValueError, match=r"init\(device=0\) applies to backend\(s\) nccl, not 'toy'"):
        _init_toy(tmp_path, backend="toy", device=0)
    assert not (tmp_path / "store").exists()


def test_cli_and_doctor_read_the_registry(toy):
    from gpucoll import doctor
    from gpucoll.cli import build_parser

    parser, _ = build_parser()
    args = parser.parse_args(["bench", "--backend", "toy"])
    assert args.backend == "toy"
    report = doctor.collect()
    assert report["backends"]["toy"] == {"status": "available", "memory": "host",
                                         "description": "one rank, all_reduce only"}
    assert "toy" in doctor.format_text(report)


def test_doctor_shows_what_an_available_backend_reports(toy):
    """A backend's ``details`` (MPI: library, CUDA-awareness) reach doctor's report and text;
    a probe that fails is reported, not fatal; an unavailable backend is not probed."""
    from gpucoll import doctor

    calls = []

    def details():
        calls.append(1)
        return {"library": "Toy MPI 1.2", "cuda_aware": True}

    registry.register_backend("toy", ToyCommunicator, lambda: toy["reason"], details=details,
                              description="one rank, all_reduce only")
    report = doctor.collect()
    assert report["backends"]["toy"]["details"] == {"library": "Toy MPI 1.2", "cuda_aware": True}
    assert "library Toy MPI 1.2, cuda_aware True" in doctor.format_text(report)

    def broken():
        raise RuntimeError("no MPI_Init here")

    registry.register_backend("toy", ToyCommunicator, details=broken)
    assert "no MPI_Init here" in doctor.collect()["backends"]["toy"]["details"]["error"]

    calls.clear()
    toy["reason"] = "not here"
    registry.register_backend("toy", ToyCommunicator, lambda: toy["reason"], details=details)
    assert "details" not in doctor.collect()["backends"]["toy"] and calls == []


def test_memory_says_where_arrays_live(tmp_path):
    comm = gpucoll.init(backend="cpu", rank=0, world_size=1, url=f"file://{tmp_path}/s", timeout=5)
    try:
        assert comm.memory == "host"
    finally:
        comm.close()
    assert registry.get_backend("nccl").memory == "cuda"


# ---------------------------------------------------------------- transports
def test_link_plan_per_mode():
    hosts = ["a", "a", "b"]
    assert select.plan_links("auto", 0, hosts) == {1: ("unix", "tcp"), 2: ("tcp",)}
    assert select.plan_links("tcp", 0, hosts) == {1: ("tcp",), 2: ("tcp",)}
    assert select.plan_links("unix", 1, ["a", "a"]) == {0: ("unix",)}
    with pytest.raises(ValueError, match="transport 'unix' cannot reach peer 2 on another host"):
        select.plan_links("unix", 0, hosts)
    for mode in ("shm", "socket"):  # shared memory adds no link: sockets stay for p2p
        assert select.plan_links(mode, 0, hosts) == {1: ("unix", "tcp"), 2: ("tcp",)}
    with pytest.raises(ValueError, match="unknown transport 'pipe'; expected one of "
                                         "auto, shm, socket, tcp, unix"):
        select.plan_links("pipe", 0, hosts)


def test_the_setting_offers_exactly_the_transport_modes():
    setting = config.SETTINGS["GPUCOLL_TRANSPORT"]
    assert setting.type_name.split(" / ") == list(select.TRANSPORT_MODES)


def _kinds(comm):
    return sorted(set(comm.transport_kinds.values()))


def _init_with_transport(rank, size, url, transport):
    comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url, transport=transport)
    try:
        total = comm.all_reduce(np.full(3, rank + 1.0))
        return _kinds(comm), total.tolist()
    finally:
        comm.close()


@pytest.mark.parametrize("transport, kinds", [("tcp", ["tcp"]), ("unix", ["unix"]), ("auto", ["shm"]),
                                              ("shm", ["shm"]), ("socket", ["unix"])])
def test_init_transport_chooses_the_link(transport, kinds):
    results = run_ranks(_init_with_transport, 3, transport, init=False, timeout=60)
    assert all(r == (kinds, [6.0, 6.0, 6.0]) for r in results), results


def test_gpucoll_transport_chooses_the_link():
    results = run_ranks(_kinds, 2, env={"GPUCOLL_TRANSPORT": "tcp"}, timeout=60)
    assert results == [["tcp"], ["tcp"]]


def test_joining_is_refused_by_a_backend_without_gpucolls_store(monkeypatch):
    """GPUCOLL_JOIN needs the store the members' grow() admits through (MPI has none)."""
    registry.register_backend("toy_own_rendezvous", ToyCommunicator, lambda: None,
                              memory="host", needs_store=False,
                              description="one rank, its own rendezvous")
    monkeypatch.setenv("GPUCOLL_JOIN", "replacement-1")
    try:
        with pytest.raises(ValueError, match="GPUCOLL_JOIN: backend 'toy_own_rendezvous' cannot "
                                             "add ranks to a running job"):
            gpucoll.init(backend="toy_own_rendezvous", rank=0, world_size=1, set_default=False)
    finally:
        registry.unregister_backend("toy_own_rendezvous")


def _driver_loads() -> bool:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_loads(), reason="this host has a CUDA driver")
def test_auto_on_a_host_without_a_driver_picks_cpu_without_importing_cupy():
    """Where libcuda.so.1 cannot be loaded, ``auto`` is "cpu" at once: importing CuPy (most of
    a second per rank, where it is installed) could not have found a GPU."""
    import subprocess
    import sys

    probe = ("import sys; from gpucoll.backends import registry; "
             "print(registry.resolve_backend('auto', 1), 'cupy' in sys.modules); "
             "print(registry.get_backend('nccl').auto_precheck())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    picked, reason = out.stdout.splitlines()
    assert picked == "cpu False"
    assert reason.startswith("no CUDA driver on this host (libcuda.so.1"), reason


def test_a_reason_from_the_precheck_skips_the_full_probe(caplog):
    probed = []
    registry.register_backend("toy", ToyCommunicator, lambda: probed.append(1),
                              auto_priority=100, auto_precheck=lambda: "no toy driver")
    try:
        with caplog.at_level("INFO", logger="gpucoll"):
            assert registry.resolve_backend("auto") in ("cpu", "nccl")
        assert probed == []
        assert "backend auto: not toy (no toy driver)" in caplog.text
    finally:
        registry.unregister_backend("toy")


def test_the_driver_check_is_skipped_once_cupy_is_loaded(monkeypatch):
    """With CuPy loaded (or stood in for, as the emulation does) CuPy itself is asked."""
    from gpucoll import cuda_env

    monkeypatch.setattr(cuda_env, "_LOADED", (object(), object()))
    assert cuda_env.driver_missing_reason() is None
