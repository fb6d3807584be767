"""NCCL backend pieces that run without a GPU: backend choice and its errors, the dtype and op
tables, progress records in the store, and the watchdog (real threads, work items whose
completion the test controls). The NCCL calls themselves are in test_nccl_gpu.py."""

import re
import sys
import threading
import time

import numpy as np
import pytest

import gpucoll
from gpucoll import api
from gpucoll.backends import signature
from gpucoll.errors import BackendUnavailableError, CollectiveMismatchError
from gpucoll.rendezvous import FileStore
from gpucoll import cuda_env
from gpucoll.backends import builtin, nccl_runtime, watchdog
from gpucoll.types import ReduceOp

NCCL_REASON = cuda_env.nccl_unavailable_reason()


# ---------------------------------------------------------------- backend choice
@pytest.mark.skipif(NCCL_REASON is None, reason="NCCL is usable here")
def test_backend_nccl_without_nccl_says_how_to_fix():
    with pytest.raises(BackendUnavailableError) as info:
        gpucoll.init(backend="nccl", rank=0, world_size=1, url="tcp://127.0.0.1:1")
    message = str(info.value)
    assert "backend='cpu'" in message and "gpucoll doctor" in message
    assert NCCL_REASON in message


@pytest.mark.skipif(NCCL_REASON is None, reason="NCCL is usable here")
def test_auto_falls_back_to_cpu(tmp_path):
    assert api.resolve_backend("auto") == "cpu"
    assert api.available_backends()["nccl"] == NCCL_REASON
    comm = gpucoll.init(backend="auto", rank=0, world_size=1, url=f"file://{tmp_path}/store")
    try:
        assert comm.backend == "cpu"
        assert comm.all_reduce(np.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
    finally:
        comm.close()


@pytest.mark.skipif(NCCL_REASON is not None, reason=f"NCCL is not usable: {NCCL_REASON}")
def test_auto_picks_nccl_when_usable():
    assert api.resolve_backend("auto") == "nccl"


def test_missing_cupy_names_the_pip_extra(monkeypatch):
    monkeypatch.setattr(cuda_env, "_LOADED", None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"CuPy.*pip install 'gpucoll\[cu1[23]\]'"):
        cuda_env.load()
    reason = cuda_env.nccl_unavailable_reason()
    assert reason is not None and "gpucoll[cu1" in reason
    with pytest.raises(BackendUnavailableError, match="cannot run here: backend 'nccl' needs CuPy"):
        api.resolve_backend("nccl")
    assert api.resolve_backend("auto") == "cpu"


def test_clashing_nccl_wheels_are_named_in_the_fix(monkeypatch):
    from gpucoll import doctor

    monkeypatch.setattr(cuda_env, "_LOADED", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(cuda_env, "installed_distributions", lambda: {
        "cupy-cuda12x": "14.2.0", "nvidia-nccl-cu12": "2.32.3", "nvidia-nccl-cu13": "2.32.3"})
    with pytest.raises(BackendUnavailableError, match="nvidia-nccl-cu13"):
        cuda_env.load()


def test_auto_needs_a_gpu_per_local_rank_unless_nccl_may_share(monkeypatch):
    monkeypatch.setattr(cuda_env, "nccl_unavailable_reason", lambda: None)  # as on a 1-GPU machine
    monkeypatch.setattr(cuda_env, "device_count", lambda: 1)
    monkeypatch.setattr(cuda_env, "nccl_version_code", lambda: 22903)
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    assert api.resolve_backend("auto", local_size=1) == "nccl"
    assert api.resolve_backend("auto", local_size=None) == "nccl"
    assert api.resolve_backend("auto", local_size=2) == "cpu"
    assert "2 ranks on this host share 1 GPU(s)" in builtin.shared_gpu_reason(2)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    assert api.resolve_backend("auto", local_size=2) == "cpu"  # NCCL 2.29 cannot share
    monkeypatch.setattr(cuda_env, "nccl_version_code", lambda: 23000)
    assert api.resolve_backend("auto", local_size=2) == "nccl"
    assert api.resolve_backend("nccl", local_size=4) == "nccl"  # asked for explicitly


def test_device_is_for_the_nccl_backend_only():
    with pytest.raises(ValueError, match=r"init\(device=1\) applies to backend\(s\) nccl, not 'cpu'"):
        gpucoll.init(backend="cpu", rank=0, world_size=1, url="tcp://127.0.0.1:1", device=1)


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown backend 'gloo'"):
        api.resolve_backend("gloo")


# ---------------------------------------------------------------- tables
class _FakeNcclModule:
    """The constants cupy.cuda.nccl defines (values from nccl.h)."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = range(6)
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4


def test_dtype_table_covers_what_nccl_reduces():
    mod = _FakeNcclModule
    assert [nccl_runtime.nccl_dtype(mod, n) for n in ("int8", "uint8", "int32", "uint32", "int64",
                                            "uint64", "float16", "float32", "float64",
                                            "bfloat16")] == list(range(10))
    assert "int16" not in nccl_runtime.REDUCIBLE and "bool" not in nccl_runtime.REDUCIBLE
    assert {op: nccl_runtime.nccl_op(mod, op) for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX,
                                               ReduceOp.MIN, ReduceOp.AVG)} == \
        {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}
    for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        with pytest.raises(TypeError, match=f"op {op.value} is not supported by NCCL"):
            nccl_runtime.nccl_op(mod, op)


def test_ops_parse_from_members_and_names_in_any_case():
    for member in ReduceOp:
        for spelling in (member, member.value, member.value.upper(), f" {member.value.title()} "):
            assert ReduceOp.parse(spelling) is member
    for bad in ("mean", "", 0, None, ["sum"], {"op": "sum"}):  # the last two are unhashable
        with pytest.raises(ValueError, match=f"unknown reduction op {re.escape(repr(bad))}; "
                                             f"expected one of sum, prod"):
            ReduceOp.parse(bad)


def test_op_dtype_check_short_path_agrees_with_the_full_check():
    """check_op_dtype returns at once for sum/prod of a np.dtype and caches the rest; every
    (op, dtype) gets what the full check gives, which the rule below states independently."""
    from gpucoll import types

    def rule_raises(op, kind):
        return (op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind not in "biu"
                or op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c"
                or op is ReduceOp.AVG and kind == "b")

    def outcome(check, op, dtype):
        try:
            check(op, dtype)
            return None
        except TypeError as exc:
            return str(exc)

    dtypes = [np.dtype(name) for name in ("bool", "int8", "uint8", "int16", "int32", "uint32",
                                          "int64", "uint64", "float16", "float32", "float64",
                                          "complex64", "complex128", ">f4", "<i8")]
    likes = ["float32", np.complex64, bool, "not-a-dtype"]
    types._VALID_OP_DTYPE.clear()
    for _ in range(2):  # then from the cache
        for op in ReduceOp:
            for dtype in dtypes + likes:
                expected = outcome(types._check_op_dtype, op, dtype)
                assert outcome(types.check_op_dtype, op, dtype) == expected, (op, dtype)
                if dtype in likes[-1:]:
                    assert expected is not None  # np.dtype() refuses it, whatever the op
                else:
                    assert (expected is not None) == rule_raises(op, np.dtype(dtype).kind)


# ---------------------------------------------------------------- progress in the store
def test_ranks_behind_reads_published_progress(tmp_path):
    store = FileStore(tmp_path / "store", timeout=5)
    nccl_runtime.publish_progress(store, 0, 7)
    nccl_runtime.publish_progress(store, 2, 6)
    nccl_runtime.publish_progress(store, 3, 9)
    # rank 1 never published (never issued a collective), rank 2 stopped at 6
    assert nccl_runtime.ranks_behind(store, 4, 0, 7) == [1, 2]
    assert nccl_runtime.ranks_behind(store, 4, 3, 6) == [1]
    assert nccl_runtime.ranks_behind(store, 4, 0, 1) == [1]


def test_ranks_behind_without_a_store_is_none():
    class Broken:
        def missing(self, keys):
            raise OSError("store gone")

    assert nccl_runtime.ranks_behind(Broken(), 2, 0, 1) is None


# ---------------------------------------------------------------- watchdog
class _Pool(list):
    """The event pool; records that an event came back."""

    def __init__(self, released):
        super().__init__()
        self.released = released

    def append(self, item):
        super().append(item)
        self.released.set()


class _Item:
    """A work item (an event with ``done``) whose completion the test sets."""

    def __init__(self):
        self.finished = threading.Event()
        self.released = threading.Event()

    @property
    def done(self):
        return self.finished.is_set()

    def pending(self, op, seq, deadline, **kw):
        return watchdog.Pending(op, seq, deadline, self, pool=_Pool(self.released), **kw)


def _watchdog(**kw):
    failures = []
    published = []
    fired = threading.Event()

    def on_failure(kind, message, pending):
        failures.append((kind, message, pending))
        fired.set()

    options = dict(check_error=lambda: None, on_failure=on_failure, publish=published.append,
                   interval=0.01)
    options.update(kw)
    return watchdog.Watchdog(0, **options), failures, published, fired


def test_watchdog_retires_completed_work_and_publishes_progress():
    dog, failures, published, _ = _watchdog()
    try:
        items = [_Item() for _ in range(3)]
        for seq, item in enumerate(items, start=1):
            dog.track(item.pending("all_reduce", seq, time.monotonic() + 30))
        items[0].finished.set()
        assert items[0].released.wait(5)
        assert not items[1].released.is_set()  # still pending: kept, and in order
        for item in items[1:]:
            item.finished.set()
        assert items[2].released.wait(5)
        deadline = time.monotonic() + 5
        while (dog.outstanding() or dog.completed != 3) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dog.outstanding() == [] and dog.completed == 3
        assert published and published[-1] == 3 and published == sorted(published)
        assert failures == []
    finally:
        dog.stop()
    assert not dog.alive


def test_watchdog_fires_once_on_overdue_work():
    dog, failures, _, fired = _watchdog()
    try:
        done, stuck, later = _Item(), _Item(), _Item()
        done.finished.set()
        now = time.monotonic()
        dog.track(done.pending("broadcast", 1, now + 30))
        dog.track(stuck.pending("all_reduce", 2, now + 0.2))
        dog.track(later.pending("all_gather", 3, now + 0.2))
        assert fired.wait(5)
        time.sleep(0.1)
        assert len(failures) == 1
        kind, _, pending = failures[0]
        assert kind == "timeout" and (pending.op, pending.seq) == ("all_reduce", 2)
        assert time.monotonic() - now >= 0.2
        assert done.released.is_set() and not stuck.released.is_set()
    finally:
        dog.stop()
    assert not dog.alive  # the thread ends after a failure


def test_watchdog_follows_each_stream_in_order():
    dog, failures, _, fired = _watchdog()
    try:
        now = time.monotonic()
        a = [_Item() for _ in range(40)]
        b = [_Item() for _ in range(5)]
        for i, item in enumerate(a):
            dog.track(item.pending("all_reduce", i + 1, now + 0.3, stream="A"))
        for i, item in enumerate(b):
            dog.track(item.pending("send", i + 1, now + 30, peer=1, collective=False,
                                   stream="B"))
        for item in a[:17] + b:  # stream A completed a prefix; stream B everything
            item.finished.set()
        deadline = time.monotonic() + 5
        while len(dog.outstanding()) != 23 and time.monotonic() < deadline:
            time.sleep(0.01)
        left = dog.outstanding()
        assert [p.seq for p in left] == list(range(18, 41)) and dog.completed == 17
        assert all(item.released.is_set() for item in a[:17] + b)
        assert not any(item.released.is_set() for item in a[17:])
        assert fired.wait(5)  # stream A's operation #18 is overdue
        assert failures[0][0] == "timeout" and failures[0][2].seq == 18
    finally:
        dog.stop()


def test_watchdog_reports_asynchronous_errors():
    errors = []

    def check_error():
        if errors:
            raise RuntimeError(errors[0])

    dog, failures, _, fired = _watchdog(check_error=check_error)
    try:
        item = _Item()
        dog.track(item.pending("reduce", 4, time.monotonic() + 30))
        time.sleep(0.05)
        assert failures == []
        errors.append("NCCL_ERROR_REMOTE_ERROR: remote process exited")
        assert fired.wait(5)
        kind, message, pending = failures[0]
        assert kind == "error" and "remote process exited" in message
        assert (pending.op, pending.seq) == ("reduce", 4)
    finally:
        dog.stop()


def test_watchdog_point_to_point_does_not_move_collective_progress():
    dog, _, published, _ = _watchdog()
    try:
        item = _Item()
        dog.track(item.pending("all_reduce", 5, time.monotonic() + 30))
        dog.track(item.pending("send", 1, time.monotonic() + 30, peer=1, collective=False))
        assert dog.issued == 5
        item.finished.set()
        deadline = time.monotonic() + 5
        while dog.outstanding() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dog.completed == 5 and published[-1] == 5
    finally:
        dog.stop()


def test_watchdog_survives_an_unavailable_store():
    def publish(_):
        raise OSError("store unreachable")

    dog, failures, _, _ = _watchdog(publish=publish)
    try:
        item = _Item()
        dog.track(item.pending("all_reduce", 1, time.monotonic() + 30))
        item.finished.set()
        assert item.released.wait(5)
        assert failures == [] and dog.alive
    finally:
        dog.stop()


# ---------------------------------------------------------------- debug signatures
def test_mismatch_error_names_the_odd_rank():
    same = signature.pack("all_reduce", 3, np.float32, (4,), ReduceOp.SUM)
    odd = signature.pack("all_reduce", 3, np.float32, (5,), ReduceOp.SUM)
    assert signature.mismatch_error({0: same, 1: same, 2: same}, 0, "all_reduce", 3) is None
    error = signature.mismatch_error({0: same, 1: odd, 2: same}, 0, "all_reduce", 3)
    assert isinstance(error, CollectiveMismatchError) and error.peer == 1
    assert "rank 1 called all_reduce #3(dtype=float32, shape=(5,), op=sum)" in str(error)
    assert "rank 0 (and 1 more) called all_reduce #3(dtype=float32, shape=(4,), op=sum)" \
        in str(error)
    root = signature.describe(signature.pack("broadcast", 9, np.int64, (2, 3), root=1))
    assert root == "broadcast #9(dtype=int64, shape=(2, 3), root=1)"
