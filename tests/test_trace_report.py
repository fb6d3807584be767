"""``gpucoll trace DIR`` (gpucoll.trace_report, gpucoll.trace_timeline): the findings from the
dumps of real failing runs (a mismatch, a killed rank; the skipped call is checked on the run of
tests/test_trace.py), then every finding, the exit codes, bad input and the Chrome timeline on
small dumps written here.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from gpucoll import cli, trace_report
from gpucoll.trace_timeline import chrome_trace
from mp_harness import run_ranks

pytestmark = pytest.mark.timeout(120)

REAL_RUN_ENV = {"GPUCOLL_TIMEOUT": "3", "GPUCOLL_TRANSPORT": "unix", "GPUCOLL_TRACE_BUFFER": "256"}
T0 = 1_795_700_000.0  # the synthetic dumps' clock


def _trace(directory, *args):
    """``gpucoll trace DIR ARGS`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    status = trace_report.main([str(directory), *args], out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def _kinds(report):
    return sorted(finding["kind"] for finding in report["findings"])


# ---------------------------------------------------------------- real runs
def rank_calls_the_wrong_collective(comm):
    """Rank 1 broadcasts where the others all-reduce, at call #2."""
    import gpucoll

    x = np.ones(4)
    comm.all_reduce(x)
    try:
        if comm.rank == 1:
            comm.broadcast(np.ones(4, np.float32), root=0)
        else:
            comm.all_reduce(x)
    except gpucoll.GpucollError as exc:
        return type(exc).__name__
    return "no error"


def rank_one_is_killed(comm):
    import gpucoll

    x = np.ones(4)
    comm.all_reduce(x)
    if comm.rank == 1:
        os._exit(3)
    try:
        comm.all_reduce(x)
    except gpucoll.GpucollError as exc:
        return type(exc).__name__
    return "no error"


def _real_run(tmp_path_factory, fn, size, survivors=None):
    directory = tmp_path_factory.mktemp("traces")
    errors = run_ranks(fn, size, env={**REAL_RUN_ENV, "GPUCOLL_TRACE_DIR": str(directory)},
                       timeout=60, ranks=survivors)
    assert "no error" not in errors, errors
    return directory


@pytest.fixture(scope="module")
def mismatch_run(tmp_path_factory):
    return _real_run(tmp_path_factory, rank_calls_the_wrong_collective, 3)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    return _real_run(tmp_path_factory, rank_one_is_killed, 3, survivors=[0, 2])


def test_a_real_mismatch_names_both_collectives(mismatch_run):
    status, text, err = _trace(mismatch_run)
    assert (status, err) == (1, "")
    report = trace_report.analyze(str(mismatch_run))
    mismatches = [f for f in report["findings"] if f["kind"] == "mismatch"]
    assert len(mismatches) == 1, report["findings"]
    finding = mismatches[0]
    assert (finding["number"], finding["ranks"], finding["op"]) == (2, [0, 1, 2],
                                                                    "all_reduce/broadcast")
    assert [(call["ranks"], call["op"], call["dtype"], call["bytes"], call["root"])
            for call in finding["calls"]] == [([0, 2], "all_reduce", "float64", 32, None),
                                              ([1], "broadcast", "float32", 16, 0)]
    assert ("mismatch: world1: at #2: ranks 0, 2 called all_reduce (float64 [4], "
            "32 bytes); rank 1 called broadcast (float32 [4], 16 bytes, root 0)") in text
    assert [row["last_finished"] for row in report["communicators"][0]["ranks"]] == [1, 1, 1]


def test_a_real_killed_rank_has_no_dump_and_is_named(killed_run):
    status, text, _ = _trace(killed_run)
    assert status == 1
    report = trace_report.analyze(str(killed_run))
    (communicator,) = report["communicators"]
    assert (communicator["size"], communicator["missing_ranks"]) == (3, [1])
    assert [row["rank"] for row in communicator["ranks"]] == [0, 2]
    missing = [f for f in report["findings"] if f["kind"] == "missing"]
    assert [f["ranks"] for f in missing] == [[1]]
    assert "missing: world1: rank 1 of 3 left no dump" in text
    assert "the others were in all_reduce #2" in text
    for row in communicator["ranks"]:
        assert row["last_finished"] == 1
        assert [(r["op"], r["number"]) for r in row["open"]] == [("all_reduce", 2)]
        assert row["open"][0]["state"].startswith("failed: PeerError")


def test_the_real_runs_make_chrome_timelines(killed_run, tmp_path):
    timeline = tmp_path / "timeline.json"
    status, _, _ = _trace(killed_run, "--chrome", str(timeline))
    assert status == 1
    events = json.loads(timeline.read_text())["traceEvents"]
    calls = [(e["pid"], e["name"], e["cat"]) for e in events if e["ph"] == "X"]
    assert calls == [(0, "all_reduce #1", "done"), (0, "all_reduce #2", "failed"),
                     (2, "all_reduce #1", "done"), (2, "all_reduce #2", "failed")]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[1] == "rank 1 (no dump)" and names[0].startswith("rank 0 (")


# ---------------------------------------------------------------- synthetic dumps
def _record(number, op="all_reduce", state="done", issued=None, finished=None, **fields):
    issued = T0 + number if issued is None else issued
    if finished is None and state != "pending":
        finished = issued + 0.25
    record = {"number": number, "op": op, "state": state, "bytes": 32, "dtype": "float64",
              "shape": [4], "root": None, "peer": None, "tag": None, "issued": issued,
              "finished": finished,
              "duration_s": None if finished is None else finished - issued}
    record.update(fields)
    return record


def _done(count, op="all_reduce"):
    return [_record(number, op) for number in range(1, count + 1)]


def _write(directory, rank, records, *, size, comm="world1", comm_rank=None, written=None,
           folder=""):
    comm_rank = rank if comm_rank is None else comm_rank
    path = os.path.join(str(directory), folder, f"trace-rank{rank}-{comm}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    document = {"rank": rank, "comm_rank": comm_rank, "size": size, "backend": "cpu",
                "comm_id": comm, "host": "node", "pid": 100 + rank, "reason": "test",
                "written": T0 + 100 if written is None else written, "trace": records}
    with open(path, "w", encoding="utf-8") as file:
        json.dump(document, file)
    return path


TIMED_OUT = "failed: CommTimeoutError: rank 0: all_reduce #3 timed out waiting for peer(s)"
PEER_LOST = "failed: PeerError: connection to peer lost during all_reduce #3"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ranks_that_finished_the_same_calls_are_fine(tmp_path, size):
    for rank in range(size):
        _write(tmp_path, rank, _done(5), size=size)
    status, text, err = _trace(tmp_path)
    assert (status, err) == (0, "")
    assert text.splitlines()[-1] == "nothing wrong found: no rank behind, missing or mismatched"
    report = trace_report.analyze(str(tmp_path))
    assert report["findings"] == []
    assert [(row["rank"], row["last_finished"], row["last_issued"], row["open"])
            for row in report["communicators"][0]["ranks"]] == \
        [(rank, 5, 5, []) for rank in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_rank_that_never_issued_the_call_is_behind(tmp_path, size):
    late = size - 1
    for rank in range(size):
        records = _done(2) if rank == late else _done(2) + [_record(3, state=TIMED_OUT)]
        _write(tmp_path, rank, records, size=size)
    status, text, _ = _trace(tmp_path)
    report = trace_report.analyze(str(tmp_path))
    assert status == 1 and _kinds(report) == ["behind"]
    finding = report["findings"][0]
    assert (finding["ranks"], finding["op"], finding["number"]) == ([late], "all_reduce", 3)
    waiting = trace_report._names(list(range(late)))
    assert (f"behind: world1: rank {late} never issued all_reduce #3, which {waiting} "
            f"waited in (finished up to #2)") in text
    assert text.count("all_reduce #3 issued at +0.000 s: failed: CommTimeoutError") == late


def test_several_ranks_behind_are_named_together(tmp_path):
    for rank in range(4):
        records = _done(2 + rank % 2) if rank in (1, 2) else _done(3) + [_record(4, state=TIMED_OUT)]
        _write(tmp_path, rank, records, size=4)
    (finding,) = trace_report.analyze(str(tmp_path))["findings"]
    assert (finding["kind"], finding["ranks"], finding["number"]) == ("behind", [1, 2], 4)
    assert "behind: world1: ranks 1, 2 never issued all_reduce #4, which ranks 0, 3 waited in " \
           "(finished up to #2, #3)" in finding["message"]


def test_only_the_peers_of_a_waiting_receive_can_be_behind(tmp_path):
    # rank 0 waits to receive from rank 2 at #3; ranks 1 and 2 finished #2 and went no further
    _write(tmp_path, 0, _done(2) + [_record(3, "recv", state=TIMED_OUT, peer=2, tag=0)], size=3)
    for rank in (1, 2):
        _write(tmp_path, rank, _done(2), size=3)
    (finding,) = trace_report.analyze(str(tmp_path))["findings"]
    assert (finding["kind"], finding["ranks"], finding["op"], finding["number"]) == \
        ("behind", [2], "recv", 3)


def test_a_rank_that_issued_the_call_after_a_timeout_is_behind(tmp_path):
    # rank 0 timed out in #3 at T0+6; rank 1 issued #3 at T0+6.5, rank 2 in time
    _write(tmp_path, 0, _done(2) + [_record(3, state=TIMED_OUT, issued=T0 + 3, finished=T0 + 6)],
           size=3)
    _write(tmp_path, 1, _done(2) + [_record(3, state=PEER_LOST, issued=T0 + 6.5)], size=3)
    _write(tmp_path, 2, _done(2) + [_record(3, state=PEER_LOST, issued=T0 + 3.1)], size=3)
    (finding,) = trace_report.analyze(str(tmp_path))["findings"]
    assert (finding["kind"], finding["ranks"], finding["op"], finding["number"]) == \
        ("behind", [1], "all_reduce", 3)
    assert finding["message"] == ("behind: world1: rank 1 issued all_reduce #3 3.500 s after "
                                  "rank 0, once rank 0 had timed out in it")


def test_joining_after_a_peer_error_is_not_being_behind(tmp_path):
    # rank 0 lost a peer (not a timeout) before rank 1 issued: the first failure is the cause
    _write(tmp_path, 0, _done(2) + [_record(3, state=PEER_LOST, issued=T0 + 3, finished=T0 + 3.5)],
           size=2)
    _write(tmp_path, 1, _done(2) + [_record(3, state=PEER_LOST, issued=T0 + 4, finished=T0 + 4.1)],
           size=2)
    (finding,) = trace_report.analyze(str(tmp_path))["findings"]
    assert (finding["kind"], finding["ranks"], finding["number"]) == ("failed first", [0], 3)
    assert finding["message"].startswith("failed first: world1: rank 0 in all_reduce #3: "
                                         "failed: PeerError")


def test_the_earliest_failure_is_named_when_every_rank_issued_the_call(tmp_path):
    failures = {0: T0 + 9, 1: T0 + 7, 2: T0 + 8}  # rank 1's transport failed first
    for rank, when in failures.items():
        state = "failed: GpucollError: link down" if rank == 1 else PEER_LOST
        _write(tmp_path, rank, _done(2) + [_record(3, state=state, finished=when)], size=3)
    report = trace_report.analyze(str(tmp_path))
    assert [(f["kind"], f["ranks"], f["op"], f["number"]) for f in report["findings"]] == \
        [("failed first", [1], "all_reduce", 3)]
    first = report["communicators"][0]["first_failure"]
    assert (first["rank"], first["finished"]) == (1, T0 + 7)


def test_every_rank_waiting_in_the_same_call_is_stuck(tmp_path):
    for rank in range(3):
        _write(tmp_path, rank, _done(4) + [_record(5, "barrier", state="pending")], size=3)
    status, text, _ = _trace(tmp_path)
    report = trace_report.analyze(str(tmp_path))
    assert status == 1
    assert [(f["kind"], f["ranks"], f["op"], f["number"]) for f in report["findings"]] == \
        [("stuck", [0, 1, 2], "barrier", 5)]
    assert text.count("barrier #5 issued at +0.000 s: pending") == 3


@pytest.mark.parametrize("field,value,shown", [
    ("op", "reduce", "reduce (float64 [4], 32 bytes)"),
    ("dtype", "float32", "all_reduce (float32 [4], 32 bytes)"),
    ("shape", [2, 2], "all_reduce (float64 [2, 2], 32 bytes)"),
    ("bytes", 64, "all_reduce (float64 [4], 64 bytes)"),
    ("root", 1, "all_reduce (float64 [4], 32 bytes, root 1)"),
])
def test_each_field_of_a_collective_can_mismatch(tmp_path, field, value, shown):
    for rank in range(4):
        odd = {field: value} if rank == 2 else {}
        _write(tmp_path, rank, _done(2) + [_record(3, **odd), _record(4)], size=4)
    report = trace_report.analyze(str(tmp_path))
    (finding,) = report["findings"]
    assert (finding["kind"], finding["number"], finding["ranks"]) == ("mismatch", 3, [0, 1, 2, 3])
    assert finding["message"] == ("mismatch: world1: at #3: ranks 0, 1, 3 called all_reduce "
                                  f"(float64 [4], 32 bytes); rank 2 called {shown}")
    assert [call["ranks"] for call in finding["calls"]] == [[0, 1, 3], [2]]


def test_uneven_gathers_and_objects_may_differ_in_size(tmp_path):
    for rank in range(3):
        records = [_record(1, "all_gather_v", bytes=8 * (rank + 1), shape=[rank + 1]),
                   _record(2, "broadcast_object", bytes=None, dtype=None, shape=None, root=0),
                   _record(3, "scatter", shape=[3, 4] if rank == 0 else [4], root=0),
                   _record(4, "scatter_v", bytes=24 if rank == 0 else None,
                           dtype="float64" if rank == 0 else None,
                           shape=[3] if rank == 0 else None, root=0)]
        _write(tmp_path, rank, records, size=3)
    assert trace_report.analyze(str(tmp_path))["findings"] == []


def test_a_send_and_a_receive_that_do_not_pair_up_mismatch(tmp_path):
    # rank 0 sends to 1 with tag 5; rank 1 receives from 0 with tag 6: both pending
    _write(tmp_path, 0, _done(1) + [_record(2, "send", state="pending", peer=1, tag=5)], size=2)
    _write(tmp_path, 1, _done(1) + [_record(2, "recv", state="pending", peer=0, tag=6)], size=2)
    findings = trace_report.analyze(str(tmp_path))["findings"]
    assert [(f["kind"], f["ranks"], f["op"], f["number"]) for f in findings] == \
        [("mismatch", [0, 1], "send/recv", 2)]  # which explains the hang: not "stuck"
    assert findings[0]["message"] == ("mismatch: world1: at #2: rank 0 called send (float64 [4], "
                                      "32 bytes, peer 1, tag 5); rank 1 called recv (float64 [4], "
                                      "32 bytes, peer 0, tag 6)")


def test_calls_after_point_to_point_between_some_ranks_are_not_compared(tmp_path):
    # ranks 0 and 1 exchange a message at #2; rank 2 does not: their numbers shift by one
    _write(tmp_path, 0, _done(1) + [_record(2, "send", peer=1, tag=0), _record(3, "barrier")],
           size=3)
    _write(tmp_path, 1, _done(1) + [_record(2, "recv", peer=0, tag=0), _record(3, "barrier")],
           size=3)
    _write(tmp_path, 2, _done(1) + [_record(2, "barrier"), _record(3, "all_reduce")], size=3)
    assert trace_report.analyze(str(tmp_path))["findings"] == []


@pytest.mark.parametrize("size,present", [(2, [1]), (3, [0, 2]), (4, [0, 2])])
def test_ranks_without_a_dump_are_missing(tmp_path, size, present):
    for rank in present:
        _write(tmp_path, rank, _done(3) + [_record(4, state=PEER_LOST)], size=size)
    report = trace_report.analyze(str(tmp_path))
    absent = [rank for rank in range(size) if rank not in present]
    assert report["communicators"][0]["missing_ranks"] == absent
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("missing", absent)]
    assert report["findings"][0]["message"].endswith("the others were in all_reduce #4")


def test_communicators_are_reported_apart_with_world_ranks(tmp_path):
    for rank in range(4):  # the world is fine; in the group of ranks 1, 3, rank 3 is behind
        _write(tmp_path, rank, _done(3), size=4, folder=f"host{rank // 2}")
    _write(tmp_path, 1, _done(1, "barrier") + [_record(2, state=TIMED_OUT)], size=2,
           comm="world1.g1", comm_rank=0, folder="host0")
    _write(tmp_path, 3, _done(1, "barrier"), size=2, comm="world1.g1", comm_rank=1,
           folder="host1")
    status, text, _ = _trace(tmp_path)
    report = trace_report.analyze(str(tmp_path))
    assert status == 1
    assert [c["id"] for c in report["communicators"]] == ["world1", "world1.g1"]
    group = report["communicators"][1]
    assert [(row["rank"], row["world_rank"]) for row in group["ranks"]] == [(0, 1), (1, 3)]
    assert [(f["kind"], f["communicator"], f["ranks"], f["number"]) for f in report["findings"]] \
        == [("behind", "world1.g1", [1], 2)]
    assert "  rank 1 (world rank 3): finished up to #1" in text


def test_json_is_the_report_and_the_command_line_runs_it(tmp_path, capsys):
    _write(tmp_path, 0, _done(2) + [_record(3, state=TIMED_OUT)], size=2)
    _write(tmp_path, 1, _done(2), size=2)
    status, text, _ = _trace(tmp_path, "--json")
    assert status == 1
    assert json.loads(text) == json.loads(json.dumps(trace_report.analyze(str(tmp_path))))
    assert cli.main(["trace", str(tmp_path)]) == 1
    assert "behind: world1: rank 1 never issued all_reduce #3" in capsys.readouterr().out


@pytest.mark.parametrize("content,named", [
    (None, "no flight-recorder dumps"),
    ("{not json", "cannot read it as a flight-recorder dump"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"rank": 0, "size": 2, "trace": [{"number": 1}]}', "record 0 lacks"),
    ('{"rank": 3, "size": 2, "trace": []}', "rank 3 is out of range for size 2"),
    ('{"rank": 0, "size": "two", "trace": []}', "'size' is 'two'"),
])
def test_bad_input_exits_2_naming_the_file(tmp_path, content, named):
    path = tmp_path / "trace-rank0-world1.json"
    if content is not None:
        path.write_text(content)
    status, out, err = _trace(tmp_path)
    assert (status, out) == (2, "")
    assert err.startswith("gpucoll trace: ") and named in err
    if content is not None:
        assert str(path) in err
    with pytest.raises(trace_report.DumpError, match=named):
        trace_report.analyze(str(tmp_path))


def test_two_dumps_of_one_rank_and_a_missing_directory_are_bad_input(tmp_path):
    first = _write(tmp_path, 0, _done(1), size=1, folder="a")
    second = _write(tmp_path, 0, _done(1), size=1, folder="b")
    status, _, err = _trace(tmp_path)
    assert status == 2 and first in err and second in err and "two dumps of rank 0" in err
    status, _, err = _trace(tmp_path / "nowhere")
    assert status == 2 and f"{tmp_path / 'nowhere'}: not a directory" in err
    status, _, err = _trace(tmp_path / "a", "--chrome", str(tmp_path / "no" / "such" / "x.json"))
    assert status == 2 and "--chrome" in err and "cannot write it" in err


# ---------------------------------------------------------------- the Chrome timeline
def test_the_timeline_has_one_event_per_call_at_its_times(tmp_path):
    written = T0 + 20
    ranks = {0: _done(2) + [_record(3, state=TIMED_OUT, finished=T0 + 9)],
             2: _done(2) + [_record(3, state="pending", issued=T0 + 4)]}
    for rank, records in ranks.items():
        _write(tmp_path, rank, records, size=4, written=written)
    _write(tmp_path, 2, [_record(1, "barrier", issued=T0 + 0.5, finished=T0 + 0.75)], size=1,
           comm="solo", comm_rank=0, written=written)
    timeline_path = tmp_path / "timeline.json"
    assert _trace(tmp_path, "--chrome", str(timeline_path))[0] == 1
    document = json.loads(timeline_path.read_text())
    assert document["displayTimeUnit"] == "ms" and document["otherData"]["origin"] == T0 + 0.5
    events = document["traceEvents"]
    calls = [e for e in events if e["ph"] == "X"]
    expected = [(0, 2, rec) for rec in ranks[0]] + [(2, 1, _record(1, "barrier", issued=T0 + 0.5,
                                                                    finished=T0 + 0.75))] + \
        [(2, 2, rec) for rec in ranks[2]]
    assert len(calls) == len(expected) == 7
    for event, (pid, tid, record) in zip(calls, expected):
        pending = record["finished"] is None
        end = written if pending else record["finished"]
        assert (event["pid"], event["tid"]) == (pid, tid)
        assert event["name"] == f"{record['op']} #{record['number']}" + \
            (" (pending)" if pending else "")
        assert event["ts"] == pytest.approx((record["issued"] - T0 - 0.5) * 1e6)
        assert event["dur"] == pytest.approx((end - record["issued"]) * 1e6)
        assert event["cat"] == ("pending" if pending else record["state"].split(":")[0])
        assert event["args"]["pending"] is pending
        assert {key: event["args"][key] for key in ("op", "number", "bytes", "dtype", "shape",
                                                    "state")} == \
            {key: record[key] for key in ("op", "number", "bytes", "dtype", "shape", "state")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {(0, 2): "world1 (rank 0 of 4)", (2, 1): "solo (rank 0 of 1)",
                       (2, 2): "world1 (rank 2 of 4)"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "rank 0 (node, 100)", 1: "rank 1 (no dump)", 2: "rank 2 (node, 102)",
                         3: "rank 3 (no dump)"}
    assert chrome_trace(trace_report.read_dumps(str(tmp_path))) == document
