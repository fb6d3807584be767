"""The flight recorder (``comm.trace()``, ``GPUCOLL_TRACE_BUFFER``, ``GPUCOLL_TRACE_DIR``):
the records a sequence of operations leaves, async states, the buffer bound, usage errors left
out, and the dumps of a real hang.

The conformance part runs on the CPU backend over Unix sockets (1 and 3 ranks), the NCCL
backend over the CUDA emulation (2 ranks, threads) and the MPI backend under mpirun (2 ranks).
Each rank function works on a fresh ``split(0)`` of the cluster's communicator, whose trace
starts empty and whose buffer size is read at its first operation (a barrier).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import pytest

from clusters import cluster_pools
from mp_harness import run_ranks

pytestmark = pytest.mark.timeout(300)

pool = cluster_pools([("cpu-unix", 1), ("cpu-unix", 3), ("nccl-emulated", 2), ("mpi", 2)])

FIELDS = ("number", "op", "state", "bytes", "dtype", "shape", "root", "peer", "tag")


def _fresh(comm, buffer: int):
    """A new communicator of the same ranks that remembers ``buffer`` operations: the setting
    is read at its first operation (the barrier: record #1). Rank threads share the test's
    environment, which the test restores (``buffer_setting``)."""
    os.environ["GPUCOLL_TRACE_BUFFER"] = str(buffer)
    sub = comm.split(0)
    sub.barrier()
    return sub


@pytest.fixture
def buffer_setting(monkeypatch):
    """Restores GPUCOLL_TRACE_BUFFER in this process after the test (ranks run as threads of
    it on the emulated NCCL cluster)."""
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "256")


def _fields(entry):
    return tuple(entry[name] for name in FIELDS)


# ---------------------------------------------------------------- rank-side functions
def rank_sequence(comm, arr):
    import gpucoll

    n, r = comm.size, comm.rank
    sub = _fresh(comm, 256)
    # the arrays and peers go by name here: the records read them either way
    sub.all_reduce(x=arr.dev(np.ones(5, np.float32)))
    sub.broadcast(x=arr.dev(np.arange(3, dtype=np.int64)), root=n - 1)
    # usage errors raise before anything is issued: not recorded, no number used
    usage = []
    for call in (lambda: sub.all_reduce(arr.dev(np.ones(2)), op="bogus"),
                 lambda: sub.broadcast(arr.dev(np.ones(2)), root=n),
                 lambda: sub.all_reduce([1.0, 2.0])):
        try:
            call()
        except (TypeError, ValueError) as exc:
            usage.append(type(exc).__name__)
    if n > 1:
        if r == 0:
            sub.send(x=arr.dev(np.arange(4, dtype=np.int32)), dst=1, tag=7)
        elif r == 1:
            sub.recv(out=arr.zeros((4,), "int32"), src=0, tag=7)
        right, left = (r + 1) % n, (r - 1) % n
        sub.sendrecv(x=arr.dev(np.ones(6, np.float64)), dst=right,
                     out=arr.zeros((6,), "float64"), src=left, tag=3)
        works = sub.batch_isend_irecv([
            gpucoll.P2POp("recv", arr.zeros((2,), "float32"), left),
            gpucoll.P2POp("send", arr.dev(np.ones(2, np.float32)), right)])
        for work in works:
            work.wait()
    sub.barrier()
    # an async op, pending while the other ranks have not joined it (rank 0 looks at once)
    if r != 0:
        time.sleep(0.5)
    work = sub.all_reduce(arr.dev(np.ones((2, 3), np.float64)), async_op=True)
    before = sub.trace()[-1]["state"]
    work.wait()
    if hasattr(work, "synchronize"):
        work.synchronize()
    after = sub.trace()[-1]
    trace = sub.trace()
    sub.close()
    return [_fields(e) for e in trace], usage, before, after["state"], after["duration_s"]


def rank_objects(comm, arr):
    sub = _fresh(comm, 256)
    values = sub.all_gather_object({"rank": comm.rank})
    trace = sub.trace()
    sub.close()
    return values, [(e["number"], e["op"], e["state"], e["bytes"]) for e in trace]


def rank_bounded(comm, arr, buffer):
    sub = _fresh(comm, buffer)
    x = arr.dev(np.ones(3, np.float32))
    for _ in range(6):
        sub.all_reduce(x)
    trace = sub.trace()
    sub.close()
    return [(e["number"], e["op"], e["state"]) for e in trace]


# ---------------------------------------------------------------- tests
def test_a_sequence_leaves_its_records(pool, buffer_setting):
    n = pool.world_size
    results = pool.run(rank_sequence)
    for r, (records, usage, before, after, duration) in enumerate(results):
        assert usage == ["ValueError", "ValueError", "TypeError"]
        expected = [(1, "barrier", "done", None, None, None, None, None, None),
                    (2, "all_reduce", "done", 20, "float32", [5], None, None, None),
                    (3, "broadcast", "done", 24, "int64", [3], n - 1, None, None)]
        if n > 1:
            right, left = (r + 1) % n, (r - 1) % n
            if r == 0:
                expected.append((4, "send", "done", 16, "int32", [4], None, 1, 7))
            elif r == 1:
                expected.append((4, "recv", "done", 16, "int32", [4], None, 0, 7))
            number = len(expected) + 1
            expected += [
                (number, "sendrecv", "done", 48, "float64", [6], None, [right, left], [3, 3]),
                (number + 1, "batch_isend_irecv", "done", 16, None, None, None,
                 sorted({left, right}), None)]
        number = len(expected) + 1
        expected += [(number, "barrier", "done", None, None, None, None, None, None),
                     (number + 1, "all_reduce", "done", 48, "float64", [2, 3], None, None,
                      None)]
        assert records == expected, f"rank {r}"
        assert after == "done" and duration is not None and duration >= 0
        if n > 1 and r == 0 and pool.kind == "numpy":  # the others joined 0.5 s later
            assert before == "pending"  # (the CUDA emulation runs the launch to its end)


def test_object_collectives_show_their_steps(pool, buffer_setting):
    n = pool.world_size
    for r, (values, records) in enumerate(pool.run(rank_objects)):
        assert values == [{"rank": i} for i in range(n)]
        assert records[0] == (1, "barrier", "done", None)
        assert records[1] == (2, "all_gather_object", "done", None)
        assert records[2] == (3, "all_gather", "done", 8)  # the lengths: one int64
        assert [e[1] for e in records[3:]] == ["all_gather_v", "all_gather"]
        assert all(e[2] == "done" for e in records)
        assert [e[0] for e in records] == list(range(1, len(records) + 1))


def test_the_buffer_keeps_the_last_operations(pool, buffer_setting):
    # a barrier and six all-reduces: the last four remain
    for records in pool.run(rank_bounded, 4):
        assert records == [(number, "all_reduce", "done") for number in (4, 5, 6, 7)]
    for records in pool.run(rank_bounded, 0):
        assert records == []


def rank_async_records_keep_no_arrays(comm, arr):
    """Async operations of every kind, their Works waited for and dropped with the arrays:
    what are the arrays' weak references, and the records' states, after that?"""
    import gc
    import weakref

    import gpucoll

    n, r = comm.size, comm.rank
    sub = _fresh(comm, 256)
    refs = []

    def issue():
        x = arr.dev(np.ones(1000, np.float32))
        gathered = arr.zeros((n, 1000), "float32")
        works = [sub.all_reduce(x, async_op=True),
                 sub.all_gather(x, out=gathered, async_op=True)]
        if n > 1:
            right, left = (r + 1) % n, (r - 1) % n
            sent, got = arr.dev(np.full(8, r, np.int64)), arr.zeros((8,), "int64")
            works += sub.batch_isend_irecv([gpucoll.P2POp("recv", got, left),
                                            gpucoll.P2POp("send", sent, right)])
            refs.extend([weakref.ref(sent), weakref.ref(got)])
        refs.extend([weakref.ref(x), weakref.ref(gathered)])
        for work in works:
            work.wait()
            if hasattr(work, "synchronize"):
                work.synchronize()

    issue()  # its arrays and Works are gone with its frame
    sub.barrier()
    gc.collect()
    alive = [ref() is not None for ref in refs]
    states = [(e["op"], e["state"]) for e in sub.trace()]
    sub.close()
    return alive, states


def test_async_records_do_not_keep_the_arrays_alive(pool, buffer_setting):
    """A record keeps its Work's probe, not the Work with its result: once the caller drops
    an async operation's arrays and Work, nothing of gpucoll keeps them (the trace buffer
    holds hundreds of records, which would otherwise hold as many arrays)."""
    n = pool.world_size
    for r, (alive, states) in enumerate(pool.run(rank_async_records_keep_no_arrays)):
        assert alive == [False] * (4 if n > 1 else 2), f"rank {r}: {alive}"
        ops = ["barrier", "all_reduce", "all_gather"] + \
            (["batch_isend_irecv"] if n > 1 else []) + ["barrier"]
        assert states == [(op, "done") for op in ops], f"rank {r}: {states}"


# ---------------------------------------------------------------- a real hang, dumped
def rank_dumps_a_healthy_run(comm, arr, directory):
    sub = _fresh(comm, 256)
    sub.all_reduce(arr.dev(np.ones(4, np.float32)))
    sub.all_gather(arr.dev(np.arange(2, dtype=np.int64)))
    path = sub.dump_trace(directory)
    records = [(e["number"], e["op"], e["state"]) for e in sub.trace()]
    sub.close()
    return os.path.basename(path), records


def test_a_healthy_run_dumps_on_request_for_the_report_and_timeline(pool, buffer_setting,
                                                                   tmp_path):
    """``comm.dump_trace(DIR)``: the same file a failure writes, now; ``gpucoll trace`` finds
    nothing wrong in a healthy run, and its timeline has one bar per call of every rank."""
    from gpucoll.trace_report import analyze, read_dumps
    from gpucoll.trace_timeline import chrome_trace

    n = pool.world_size
    results = pool.run(rank_dumps_a_healthy_run, str(tmp_path))
    names = sorted(name for name, _ in results)
    assert [name.split("-")[1] for name in names] == [f"rank{r}" for r in range(n)]
    assert len({name.split("-", 2)[2] for name in names}) == 1   # one communicator
    for _, records in results:
        assert records == [(1, "barrier", "done"), (2, "all_reduce", "done"),
                           (3, "all_gather", "done")]
    report = analyze(str(tmp_path))
    assert report["findings"] == [], report["findings"]
    (communicator,) = report["communicators"]
    assert [rank["last_finished"] for rank in communicator["ranks"]] == [3] * n
    bars = [event for event in chrome_trace(read_dumps(str(tmp_path)))["traceEvents"]
            if event["ph"] == "X"]
    assert sorted((event["pid"], event["name"].split()[0]) for event in bars) == sorted(
        (rank, op) for rank in range(n) for op in ("all_gather", "all_reduce", "barrier"))


def _dumps(directory: str, rank: int):
    """The files rank ``rank`` wrote: ``trace-rank<world rank>-<communicator id>.json``."""
    return [name for name in os.listdir(directory)
            if name.startswith(f"trace-rank{rank}-") and name.endswith(".json")]


def _dump_of(directory: str, rank: int) -> dict:
    names = _dumps(directory, rank)
    assert len(names) == 1, names  # one communicator, one file (rewritten, not added to)
    with open(os.path.join(directory, names[0]), encoding="utf-8") as file:
        return json.load(file)


def rank_skips_one(comm, directory):
    """Rank 1 skips the third all_reduce: rank 0's times out. Rank 1 then (once rank 0's dump
    is written) calls it late, and fails on the aborted peer."""
    import gpucoll

    x = np.ones(4)
    comm.all_reduce(x)
    comm.all_reduce(x)
    if comm.rank == 1:
        deadline = time.monotonic() + 30
        while not _dumps(directory, 0):
            assert time.monotonic() < deadline, "rank 0 wrote no trace"
            time.sleep(0.05)
    try:
        comm.all_reduce(x)
    except (gpucoll.CommTimeoutError, gpucoll.PeerError, gpucoll.CommAbortedError) as exc:
        return type(exc).__name__
    return "no error"


def test_a_hang_leaves_each_ranks_dump():
    with tempfile.TemporaryDirectory() as directory:
        _check_hang_dumps(directory)
        _check_the_report_names_the_rank_behind(directory)


def _check_hang_dumps(directory: str) -> None:
    env = {"GPUCOLL_TIMEOUT": "3", "GPUCOLL_TRACE_DIR": directory, "GPUCOLL_TRANSPORT": "unix",
           "GPUCOLL_TRACE_BUFFER": "256"}
    errors = run_ranks(rank_skips_one, 2, directory, env=env, timeout=60)
    assert errors[0] == "CommTimeoutError"
    assert errors[1] in ("PeerError", "CommAbortedError")
    first, second = _dump_of(directory, 0), _dump_of(directory, 1)
    for rank, dump in enumerate((first, second)):
        assert (dump["rank"], dump["comm_rank"], dump["size"], dump["backend"]) == \
            (rank, rank, 2, "cpu")
        assert dump["pid"] > 0 and dump["host"]
        records = dump["trace"]
        assert [(e["number"], e["op"]) for e in records] == \
            [(1, "all_reduce"), (2, "all_reduce"), (3, "all_reduce")]
        assert [e["state"] for e in records[:2]] == ["done", "done"]
        assert records[2]["bytes"] == 32 and records[2]["finished"] is not None
    # rank 0 waited on #3 for its timeout; rank 1 issued #3 only after that
    assert first["trace"][2]["state"].startswith("failed: CommTimeoutError: rank 0: all_reduce")
    assert first["trace"][2]["duration_s"] >= 2.5
    assert second["trace"][2]["state"].startswith(("failed: PeerError", "failed: CommAbortedError"))
    assert second["trace"][2]["issued"] >= first["trace"][2]["finished"]
    assert second["trace"][1]["finished"] < first["trace"][2]["finished"]
    assert "CommTimeoutError" in first["reason"]
    assert not [name for name in os.listdir(directory) if name.endswith(".tmp")]


def _check_the_report_names_the_rank_behind(directory: str) -> None:
    """``gpucoll trace`` on the same dumps: rank 1 is behind, in all_reduce #3."""
    import io

    from gpucoll import trace_report

    out = io.StringIO()
    assert trace_report.main([directory], out=out) == 1
    report = trace_report.analyze(directory)
    assert [(f["kind"], f["ranks"], f["op"], f["number"]) for f in report["findings"]] == \
        [("behind", [1], "all_reduce", 3)]
    assert [(row["rank"], row["last_finished"], [r["number"] for r in row["open"]])
            for row in report["communicators"][0]["ranks"]] == [(0, 2, [3]), (1, 2, [3])]
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("behind: world1: rank 1 issued all_reduce #3 ")
    assert lines[-1].endswith(" s after rank 0, once rank 0 had timed out in it")


# ---------------------------------------------------------------- dumps, in this process
def _world_of_one(monkeypatch, **env):
    import gpucoll

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUCOLL_QUIET", "1")
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "256")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return gpucoll.init(backend="cpu", rank=0, world_size=1, timeout=30)


def test_abort_writes_the_trace(monkeypatch):
    with tempfile.TemporaryDirectory() as directory:
        comm = _world_of_one(monkeypatch, GPUCOLL_TRACE_DIR=directory)
        comm.all_reduce(np.ones(2, np.int32))
        comm.broadcast_object("hello")
        comm.abort()
        names = _dumps(directory, 0)
        assert len(names) == 1 and names[0].startswith("trace-rank0-world")
        dump = _dump_of(directory, 0)
        comm.close()
    assert dump["reason"] == "abort() called on rank 0"
    assert (dump["rank"], dump["size"], dump["backend"]) == (0, 1, "cpu")
    assert [(e["number"], e["op"], e["state"]) for e in dump["trace"]][:3] == \
        [(1, "all_reduce", "done"), (2, "broadcast_object", "done"), (3, "broadcast", "done")]


def test_a_dump_that_cannot_be_written_is_no_error(monkeypatch):
    with tempfile.NamedTemporaryFile() as not_a_directory:
        comm = _world_of_one(monkeypatch, GPUCOLL_TRACE_DIR=not_a_directory.name)
        comm.all_reduce(np.ones(2))
        comm.abort()  # the dump fails quietly
        comm.close()
        assert os.path.getsize(not_a_directory.name) == 0


def test_dump_trace_needs_a_directory(monkeypatch, tmp_path):
    comm = _world_of_one(monkeypatch)
    try:
        with pytest.raises(ValueError, match="dump_trace: pass a directory, or set "
                                             "GPUCOLL_TRACE_DIR"):
            comm.dump_trace()
        monkeypatch.setenv("GPUCOLL_TRACE_DIR", str(tmp_path / "from-env"))
        comm.barrier()
        path = comm.dump_trace()
        assert os.path.dirname(path) == str(tmp_path / "from-env")
        dump = json.load(open(path))
        assert dump["reason"] == "dump_trace()" and dump["trace"][-1]["op"] == "barrier"
        blocked = tmp_path / "a-file"
        blocked.write_text("")
        with pytest.raises(OSError):
            comm.dump_trace(blocked / "below")
    finally:
        comm.close()


def test_no_directory_no_dump_and_the_trace_stays_readable(monkeypatch):
    import gpucoll

    monkeypatch.delenv("GPUCOLL_TRACE_DIR", raising=False)
    comm = _world_of_one(monkeypatch)
    comm.all_reduce(np.ones(1))
    comm.abort()
    with pytest.raises(gpucoll.CommAbortedError):
        comm.all_reduce(np.ones(1))
    states = [e["state"] for e in comm.trace()]
    comm.close()
    assert states[0] == "done"
    assert states[1].startswith("failed: CommAbortedError: rank 0: communicator was aborted")


def test_a_negative_buffer_is_named(monkeypatch):
    comm = _world_of_one(monkeypatch, GPUCOLL_TRACE_BUFFER="-1")
    with pytest.raises(ValueError, match="GPUCOLL_TRACE_BUFFER=-1"):
        comm.all_reduce(np.ones(1))
    comm.close()


def test_a_call_held_on_the_gpu_stays_pending_until_it_runs(monkeypatch):
    """NCCL returns a blocking call once it is enqueued: on a stalled stream (the CUDA
    emulation) its record stays pending, and says done once the stream has run it."""
    import threading

    import gpucoll
    from gpucoll import cuda_env
    from emulated_cuda import Emulation

    emu = Emulation(device_count=2, timeout=5.0)
    monkeypatch.setattr(cuda_env, "_LOADED", (emu.cupy, emu.nccl))
    monkeypatch.setenv("GPUCOLL_TRACE_BUFFER", "8")
    monkeypatch.delenv("GPUCOLL_TRACE_DIR", raising=False)
    store = tempfile.mkdtemp(prefix="gpucoll-trace-")
    states, errors = {}, []

    def rank(r):
        try:
            comm = gpucoll.init(backend="nccl", rank=r, world_size=2, url=f"file://{store}/s",
                                timeout=10, set_default=False)
            stream = emu.cupy.cuda.Stream(non_blocking=True)
            emu.stall(stream)
            x = emu.cupy.ones(4, np.float32)
            comm.all_reduce(x, stream=stream)           # returns: enqueued, not run
            held = comm.trace()[-1]
            emu.release(stream)                         # runs here and meets the other rank
            comm.synchronize()
            states[r] = (held["op"], held["state"], held["duration_s"],
                         comm.trace()[-1]["state"], x.get().tolist())
            comm.close()
        except BaseException as exc:  # reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    emu.release_all()
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    for r in range(2):
        assert states[r] == ("all_reduce", "pending", None, "done", [2.0] * 4), states[r]
