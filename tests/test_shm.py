"""Shared memory among ranks of one host: chosen automatically, node-aware across (pretend)
hosts, never leaks a segment, falls back (or refuses, in ``shm`` mode) when /dev/shm is too
small. The collectives themselves run the whole conformance suite (``cpu-shm`` clusters)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from mp_harness import run_ranks

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_kinds_and_sum(rank, size, url, host_ids, transport):
    import gpucoll

    os.environ["GPUCOLL_HOST_ID"] = host_ids[rank]
    os.environ["GPUCOLL_TRANSPORT"] = transport
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=20)
    results = {}
    for count in (1, 13, 300_007):  # small (one sync) and sliced (several steps)
        x = (np.arange(count) % 97 + rank).astype(np.float64)
        comm.all_reduce(x)
        results[count] = x
    y = np.full(5, rank, np.int32)
    comm.all_reduce(y, op="max")
    b = np.full(7, rank, np.float32)
    comm.broadcast(b, root=size - 1)
    half = comm.split(color=rank % 2)
    z = half.all_reduce(np.full(3, rank, np.int64))
    kinds = comm.transport_kinds
    half_kinds = half.transport_kinds
    half.close()
    comm.close()
    return (kinds, half_kinds, results, y.tolist(), b.tolist(), z.tolist(),
            [str(w.message) for w in caught])


def _expected_sum(count, size):
    return sum((np.arange(count) % 97 + r).astype(np.float64) for r in range(size))


@pytest.mark.parametrize("host_ids", [("a", "a", "a"), ("a", "a", "b", "b"), ("a", "b", "a")],
                         ids=["one-host", "two-hosts", "interleaved"])
def test_chosen_by_host_and_node_aware_across_hosts(host_ids):
    size = len(host_ids)
    results = run_ranks(rank_kinds_and_sum, size, list(host_ids), "auto", init=False, timeout=90)
    for rank, (kinds, half_kinds, sums, y, b, z, caught) in enumerate(results):
        for peer, kind in kinds.items():
            same = host_ids[peer] == host_ids[rank]
            assert kind == ("shm" if same else "tcp"), (rank, kinds)
        for count, got in sums.items():
            np.testing.assert_array_equal(got, _expected_sum(count, size))
        assert y == [size - 1] * 5 and b == [size - 1.0] * 7
        assert z == [sum(r for r in range(size) if r % 2 == rank % 2)] * 3
        assert not caught, caught
        if len(set(host_ids)) == 1 and half_kinds:  # the split has a segment of its own
            assert set(half_kinds.values()) == {"shm"}, half_kinds


@pytest.mark.parametrize("transport", ["socket", "tcp", "unix"])
def test_socket_modes_never_use_shared_memory(transport):
    results = run_ranks(rank_kinds_and_sum, 2, ["a", "a"], transport, init=False, timeout=60)
    for kinds, *_ in results:
        assert set(kinds.values()) == {"tcp" if transport == "tcp" else "unix"}


def rank_too_small(rank, size, url, transport):
    import gpucoll

    os.environ["GPUCOLL_TRANSPORT"] = transport
    os.environ["GPUCOLL_SHM_BYTES"] = "64TiB"  # a segment no /dev/shm holds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=20)
        except OSError as exc:
            return "error", type(exc).__name__, str(exc)
    x = np.full(4, rank + 1.0)
    comm.all_reduce(x)
    kinds = comm.transport_kinds
    comm.close()
    return "ok", kinds, x.tolist(), [str(w.message) for w in caught]


def test_dev_shm_too_small_falls_back_with_a_warning():
    results = run_ranks(rank_too_small, 2, "auto", init=False, timeout=60)
    for status, kinds, values, caught in results:
        assert status == "ok" and set(kinds.values()) == {"unix"}
        assert values == [3.0] * 4
        assert any("--shm-size" in w and "using sockets" in w for w in caught), caught


def test_dev_shm_too_small_is_an_error_in_shm_mode():
    results = run_ranks(rank_too_small, 2, "shm", init=False, timeout=60)
    for status, name, message in results:
        assert status == "error" and name == "SharedMemoryUnavailable", message
        assert "--shm-size" in message and "--ipc=host" in message and "/dev/shm" in message


_KILLED_JOB = """
import os, signal, numpy as np, gpucoll
comm = gpucoll.init(backend="cpu")
x = np.ones(1 << 20, np.float32)
comm.all_reduce(x)
if comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
comm.all_reduce(x)
"""


def test_sigkilled_job_leaves_nothing_in_dev_shm(tmp_path):
    from gpucoll.transports import shm

    token = "shm-leak-test-" + os.urandom(4).hex()
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_JOB)
    env = dict(os.environ, GPUCOLL_AUTH_TOKEN=token, GPUCOLL_TIMEOUT="20",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GPUCOLL_TRANSPORT", None)
    done = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "3", str(script)],
                          env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode != 0, done.stderr  # rank 1 died: the job failed
    assert "rank 1" in done.stderr, done.stderr
    left = glob.glob(os.path.join(shm.SHM_DIR, shm.job_prefix(token) + "*"))
    assert left == []


def rank_dies_in_shared_memory(comm):
    from gpucoll import PeerError

    x = np.ones(8, np.float32)
    comm.all_reduce(x)
    if comm.rank == 1:
        os._exit(3)
    try:
        comm.barrier()
        comm.all_reduce(x)
    except PeerError as exc:
        return exc.peer, str(exc)
    return None


def test_dead_peer_is_named_by_a_rank_waiting_in_shared_memory():
    results = run_ranks(rank_dies_in_shared_memory, 3, env={"GPUCOLL_TRANSPORT": "shm",
                                                            "GPUCOLL_TIMEOUT": "20"},
                        timeout=60, ranks=[0, 2])
    for peer, message in results:
        assert peer == 1 and "peer 1" in message and "barrier #" in message, message


def test_launcher_sweeps_what_a_job_left_in_dev_shm(tmp_path):
    from gpucoll.transports import shm

    token = "shm-sweep-test-" + os.urandom(4).hex()
    leftover = os.path.join(shm.SHM_DIR, shm.job_prefix(token) + "deadbeef")
    other = os.path.join(shm.SHM_DIR, shm.job_prefix(token + "-other") + "deadbeef")
    for path in (leftover, other):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        script = tmp_path / "ok.py"
        script.write_text("print('done')\n")
        env = dict(os.environ, GPUCOLL_AUTH_TOKEN=token,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        done = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "1", str(script)],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert not os.path.exists(leftover)  # this job's leftovers are swept
        assert os.path.exists(other)  # another job's segment is not touched
    finally:
        for path in (leftover, other):
            if os.path.exists(path):
                os.unlink(path)


def rank_cupy_staged(comm):
    import cupy

    x = cupy.full(1000, comm.rank + 1.0, dtype=cupy.float32)
    comm.all_reduce(x)
    b = cupy.arange(10, dtype=cupy.int64) * (comm.rank == 0)
    comm.broadcast(b, root=0)
    return comm.transport_kinds, cupy.asnumpy(x).tolist(), cupy.asnumpy(b).tolist()


@pytest.mark.gpu
def test_cupy_arrays_staged_through_shared_memory():
    results = run_ranks(rank_cupy_staged, 2, env={"GPUCOLL_TRANSPORT": "shm"}, timeout=90)
    for kinds, x, b in results:
        assert set(kinds.values()) == {"shm"}
        assert x == [3.0] * 1000 and b == list(range(10))
