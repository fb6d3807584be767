"""``gpucoll trace DIR``: which rank is behind, read from the flight recorder's dumps of all ranks.

With ``GPUCOLL_TRACE_DIR`` set, every rank writes ``trace-rank<world rank>-<communicator id>.json``
when its communicator is aborted (see :mod:`gpucoll.flight_recorder`). This tool reads every such
file in a directory and below it, groups them by communicator, and for each one reports every
rank's last finished operation number and the operations it still had pending or that failed,
then its findings, one line each:

- ``behind``: a rank that never issued the operation the others were waiting in (for a
  point-to-point call, one of its peers), or issued it only after another rank had timed out
  in it.
- ``mismatch``: ranks that called different collectives at the same number (op, dtype, shape,
  bytes or root), or a send and a receive at the same number that do not pair up (peer, tag,
  bytes).
- ``missing``: ranks of the communicator (its size is in every dump) that left no dump: dead, or
  never reached the point of dumping.
- ``failed first``: when no rank is behind, missing or mismatched, the earliest failure, which
  the others' errors followed.
- ``stuck``: every rank issued the operation and none failed, yet it never finished.

Point-to-point calls between some of the ranks number the calls of those ranks only, so the
collectives are compared number by number until the first number where some ranks made a
point-to-point call and others a collective; after it the numbers no longer line up.

Exit status: 0 when nothing was found, 1 when there is a finding, 2 on bad input (no dumps, a
file that is not a readable dump: the message names it).

Example::

    gpucoll trace traces/                   # the findings, one line each
    gpucoll trace traces/ --json            # the report as JSON (see analyze())
    gpucoll trace traces/ --chrome run.json # a timeline for chrome://tracing or Perfetto
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, TextIO

from .trace_timeline import chrome_trace

__all__ = ["DumpError", "Dump", "read_dumps", "analyze", "report_of", "format_text",
           "chrome_trace", "add_arguments", "main", "run"]

_FILE_NAME = re.compile(r"^trace-rank(\d+)-(.+)\.json$")
_FINISHED = ("done", "captured")
_POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "sendrecv", "batch_isend_irecv",
                             "send_object", "recv_object"})
_SENDS, _RECEIVES = frozenset({"send", "isend"}), frozenset({"recv", "irecv"})
# collectives whose array differs between ranks by design: compared by op and root only
_UNEVEN = frozenset({"all_gather_v", "gather_v", "all_to_all_v", "scatter", "scatter_v"})
_STATE_CHARS = 120  # of a state, in the text report
_TIMED_OUT = "failed: CommTimeoutError"


class DumpError(ValueError):
    """No dumps, or a file that is not a readable flight-recorder dump (the message names it)."""


class Dump:
    """One rank's dump of one communicator: its header fields and its records, by number."""

    __slots__ = ("path", "header", "records", "communicator")

    def __init__(self, path: str, header: Dict[str, Any], records: List[Dict[str, Any]],
                 communicator: str):
        self.path = path
        self.header = header
        self.records = sorted(records, key=lambda record: record["number"])
        self.communicator = communicator

    @property
    def rank(self) -> int:
        """The rank in the communicator (``comm_rank``)."""
        return self.header["comm_rank"]


def read_dumps(directory: str) -> List["Dump"]:
    """Every ``trace-rank*.json`` in ``directory`` and its subdirectories, read and checked.

    Raises:
        DumpError: ``directory`` is not a directory, holds no dump, or a file is not a readable
            dump (the message names the file).
    """
    if not os.path.isdir(directory):
        raise DumpError(f"{directory}: not a directory")
    dumps = []
    for folder, subfolders, names in os.walk(directory):
        subfolders.sort()
        for name in sorted(names):
            match = _FILE_NAME.match(name)
            if match:
                dumps.append(_read_dump(os.path.join(folder, name), match.group(2)))
    if not dumps:
        raise DumpError(f"{directory}: no flight-recorder dumps (trace-rank*.json) in it or below "
                        f"it; ranks write them there when GPUCOLL_TRACE_DIR names it")
    return dumps


def _read_dump(path: str, name_in_file: str) -> "Dump":
    try:
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DumpError(f"{path}: cannot read it as a flight-recorder dump: {exc}") from None

    def bad(what: str) -> DumpError:
        return DumpError(f"{path}: not a flight-recorder dump: {what}")

    if not isinstance(document, dict):
        raise bad(f"a JSON {type(document).__name__}, not an object")
    header = {key: value for key, value in document.items() if key != "trace"}
    header.setdefault("comm_rank", header.get("rank"))
    for key in ("rank", "comm_rank", "size"):
        if not _is_int(header.get(key)) or header[key] < 0:
            raise bad(f"{key!r} is {header.get(key)!r}, not a rank or size")
    if not 0 <= header["comm_rank"] < header["size"]:
        raise bad(f"rank {header['comm_rank']} is out of range for size {header['size']}")
    if not _is_number(header.get("written")):
        header["written"] = None
    records = document.get("trace")
    if not isinstance(records, list):
        raise bad(f"'trace' is {type(records).__name__}, not a list of records")
    for index, record in enumerate(records):
        if not (isinstance(record, dict) and _is_int(record.get("number"))
                and isinstance(record.get("op"), str) and isinstance(record.get("state"), str)
                and _is_number(record.get("issued"))
                and (record.get("finished") is None or _is_number(record["finished"]))):
            raise bad(f"record {index} lacks a number, op, state or issued time: {record!r}")
    communicator = header.get("comm_id")
    if not isinstance(communicator, str) or not communicator:
        communicator = name_in_file
    return Dump(path, header, records, communicator)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------- the diagnosis
def analyze(directory: str) -> Dict[str, Any]:
    """Read the dumps under ``directory`` and say which rank is behind (``gpucoll trace``).

    Args:
        directory: where the ranks wrote their dumps (``GPUCOLL_TRACE_DIR``); its
            subdirectories are read too (one per host, say).

    Returns:
        ``{"directory", "communicators": [...], "findings": [...]}``. Each communicator:
        ``id``, ``size``, ``backend``, ``missing_ranks``, ``first_failure`` (a record with its
        ``rank``, or None), ``findings`` and ``ranks``: per rank that left a dump ``rank``,
        ``world_rank``, ``host``, ``pid``, ``file``, ``reason``, ``written``,
        ``last_finished`` and ``last_issued`` (numbers; 0: none) and ``open`` (its records not
        finished: pending or failed, as the dump has them). Each finding: ``kind``
        (``"behind"``, ``"mismatch"``, ``"missing"``, ``"failed first"``, ``"stuck"``),
        ``communicator``, ``ranks``, ``op`` and ``number`` (None where none applies), ``message``
        (the line the text report prints); a mismatch also has ``calls``: each group of ranks
        that agreed, with the fields of their call. The top-level ``findings`` are all of them.

    Raises:
        DumpError: no dumps, or a file that is not a readable dump (named in the message).

    Example::

        from gpucoll.trace_report import analyze

        for finding in analyze("traces")["findings"]:
            print(finding["message"])  # behind: world1: rank 1 never issued all_reduce #3...
    """
    report = report_of(read_dumps(directory))
    report["directory"] = directory
    return report


def report_of(dumps: Sequence["Dump"]) -> Dict[str, Any]:
    """:func:`analyze`'s report from dumps already read (:func:`read_dumps`)."""
    groups: Dict[str, List[Dump]] = collections.defaultdict(list)
    for dump in dumps:
        groups[dump.communicator].append(dump)
    communicators = [_communicator_report(name, groups[name]) for name in sorted(groups)]
    return {"directory": None, "communicators": communicators,
            "findings": [finding for c in communicators for finding in c["findings"]]}


def _by_rank(dumps: Sequence["Dump"]) -> Dict[int, "Dump"]:
    """One communicator's dumps by rank; two dumps of one rank are a :class:`DumpError`."""
    ranks: Dict[int, Dump] = {}
    for dump in dumps:
        if dump.rank in ranks:
            raise DumpError(f"two dumps of rank {dump.rank} of communicator {dump.communicator}: "
                            f"{ranks[dump.rank].path} and {dump.path} (dumps of several runs? "
                            f"give one run's directory)")
        ranks[dump.rank] = dump
    return ranks


def _communicator_report(name: str, dumps: List["Dump"]) -> Dict[str, Any]:
    ranks = _by_rank(dumps)
    size = max(dump.header["size"] for dump in dumps)
    missing = [rank for rank in range(size) if rank not in ranks]
    rows = {rank: _rank_row(dump) for rank, dump in sorted(ranks.items())}
    first_failure = _first_failure(ranks)
    findings = []
    if missing:
        findings.append(_missing(name, size, missing, ranks, rows))
    mismatch = _first_mismatch(name, ranks)
    if mismatch:
        findings.append(mismatch)
    stuck = min((row["open"][0]["number"] for row in rows.values() if row["open"]), default=None)
    if stuck is not None:
        findings += _behind(name, stuck, ranks, rows)
        if not findings:
            findings.append(_failed_first(name, first_failure) if first_failure
                            else _stuck(name, stuck, ranks, rows))
    backends = sorted({str(dump.header.get("backend")) for dump in dumps})
    return {"id": name, "size": size, "backend": ", ".join(backends),
            "missing_ranks": missing, "first_failure": first_failure,
            "ranks": list(rows.values()), "findings": findings}


def _rank_row(dump: "Dump") -> Dict[str, Any]:
    finished = [r["number"] for r in dump.records if r["state"] in _FINISHED]
    header = dump.header
    return {"rank": dump.rank, "world_rank": header["rank"], "host": header.get("host"),
            "pid": header.get("pid"), "file": dump.path, "reason": header.get("reason"),
            "written": header["written"], "last_finished": max(finished, default=0),
            "last_issued": max((r["number"] for r in dump.records), default=0),
            "open": [r for r in dump.records if r["state"] not in _FINISHED]}


def _finding(kind: str, communicator: str, ranks: Sequence[int], op: Optional[str],
             number: Optional[int], message: str, **extra: Any) -> Dict[str, Any]:
    return {"kind": kind, "communicator": communicator, "ranks": list(ranks), "op": op,
            "number": number, "message": f"{kind}: {communicator}: {message}", **extra}


def _names(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _record_at(dump: "Dump", number: int) -> Optional[Dict[str, Any]]:
    for record in dump.records:
        if record["number"] == number:
            return record
    return None


def _missing(name, size, missing, ranks, rows) -> Dict[str, Any]:
    waiting = sorted({(row["open"][0]["op"], row["open"][0]["number"])
                      for row in rows.values() if row["open"]}, key=lambda item: item[1])
    where = (f"; the others were in {', '.join(f'{op} #{n}' for op, n in waiting)}"
             if waiting else "")
    return _finding("missing", name, missing, None, None,
                    f"{_names(missing)} of {size} left no dump: dead, or never reached the point "
                    f"of dumping (dumps of {_names(sorted(ranks))}){where}")


def _behind(name, stuck, ranks, rows) -> List[Dict[str, Any]]:
    """Ranks that never issued call #stuck, or issued it after another rank timed out in it.
    When the ranks that issued it made point-to-point calls, only their peers were awaited."""
    issued = {rank: _record_at(dump, stuck) for rank, dump in ranks.items()}
    issued = {rank: record for rank, record in issued.items() if record is not None}
    ops = collections.Counter(record["op"] for record in issued.values())
    op = ops.most_common(1)[0][0]
    findings = []
    awaited = set(rows)
    if all(record["op"] in _POINT_TO_POINT for record in issued.values()):
        awaited = {peer for record in issued.values() for peer in _peers(record)}
    never = [rank for rank, row in rows.items() if row["last_issued"] < stuck and rank in awaited]
    if never:
        finished = sorted({rows[rank]["last_finished"] for rank in never})
        findings.append(_finding(
            "behind", name, never, op, stuck,
            f"{_names(never)} never issued {op} #{stuck}, which "
            f"{_names(sorted(issued))} waited in (finished up to "
            f"{', '.join(f'#{n}' for n in finished)})"))
    timeouts = [(record["finished"], rank) for rank, record in issued.items()
                if record["state"].startswith(_TIMED_OUT) and record["finished"] is not None]
    if timeouts:
        gave_up, who = min(timeouts)
        late = sorted(rank for rank, record in issued.items()
                      if rank != who and record["issued"] >= gave_up)
        for rank in late:
            lag = issued[rank]["issued"] - issued[who]["issued"]
            findings.append(_finding(
                "behind", name, [rank], issued[rank]["op"], stuck,
                f"rank {rank} issued {issued[rank]['op']} #{stuck} {lag:.3f} s after "
                f"rank {who}, once rank {who} had timed out in it"))
    return findings


def _peers(record: Dict[str, Any]) -> List[int]:
    peer = record.get("peer")
    return [p for p in (peer if isinstance(peer, list) else [peer]) if _is_int(p)]


def _first_failure(ranks) -> Optional[Dict[str, Any]]:
    failures = [(record["finished"], rank, record) for rank, dump in ranks.items()
                for record in dump.records
                if record["state"].startswith("failed") and record["finished"] is not None]
    if not failures:
        return None
    _, rank, record = min(failures, key=lambda item: (item[0], item[1]))
    return {"rank": rank, **record}


def _failed_first(name, failure) -> Dict[str, Any]:
    return _finding("failed first", name, [failure["rank"]], failure["op"], failure["number"],
                    f"rank {failure['rank']} in {failure['op']} "
                    f"#{failure['number']}: {_clip(failure['state'])}")


def _stuck(name, stuck, ranks, rows) -> Dict[str, Any]:
    waiting = sorted(rank for rank, row in rows.items()
                     if row["open"] and row["open"][0]["number"] == stuck)
    op = _record_at(ranks[waiting[0]], stuck)["op"]
    return _finding("stuck", name, waiting, op, stuck,
                    f"{_names(waiting)} still in {op} #{stuck}, which every rank issued; none "
                    f"failed and none is behind")


# ---------------------------------------------------------------- mismatches
def _signature(record: Dict[str, Any]) -> tuple:
    """What every rank must agree on in a collective."""
    op = record["op"]
    if op in _UNEVEN or op.endswith("_object"):
        return op, record.get("root")
    shape = record.get("shape")
    return (op, record.get("root"), record.get("dtype"), record.get("bytes"),
            tuple(shape) if isinstance(shape, list) else shape)


def _describe(record: Dict[str, Any]) -> str:
    parts = []
    if record.get("dtype") is not None:
        parts.append(f"{record['dtype']} {record.get('shape')}")
    if record.get("bytes") is not None:
        parts.append(f"{record['bytes']} bytes")
    for key in ("root", "peer", "tag"):
        if record.get(key) is not None:
            parts.append(f"{key} {record[key]}")
    return f"{record['op']} ({', '.join(parts)})" if parts else record["op"]


def _first_mismatch(name, ranks) -> Optional[Dict[str, Any]]:
    """The first number at which the ranks' calls disagree (see the module doc)."""
    by_number = {rank: {record["number"]: record for record in dump.records}
                 for rank, dump in ranks.items()}
    for number in sorted({number for records in by_number.values() for number in records}):
        calls = {rank: records[number] for rank, records in by_number.items()
                 if number in records}
        if len(calls) < 2:
            continue
        kinds = {record["op"] in _POINT_TO_POINT for record in calls.values()}
        if kinds == {True, False}:
            return None  # from here on the ranks number their calls differently
        finding = (_unpaired(name, number, calls) if kinds == {True}
                   else _collective_mismatch(name, number, calls))
        if finding:
            return finding
    return None


def _collective_mismatch(name, number, calls) -> Optional[Dict[str, Any]]:
    groups: Dict[tuple, List[int]] = collections.defaultdict(list)
    for rank, record in sorted(calls.items()):
        groups[_signature(record)].append(rank)
    if len(groups) < 2:
        return None
    described = "; ".join(f"{_names(members)} called {_describe(calls[members[0]])}"
                          for members in groups.values())
    ops = sorted({record["op"] for record in calls.values()})
    return _finding("mismatch", name, sorted(calls), "/".join(ops), number,
                    f"at #{number}: {described}",
                    calls=[{"ranks": members, **_fields(calls[members[0]])}
                           for members in groups.values()])


def _unpaired(name, number, calls) -> Optional[Dict[str, Any]]:
    """A send to a rank whose call at the same number is a receive from another rank, or of
    another tag or size; only among calls not finished (finished ones evidently paired)."""
    for sender, send in sorted(calls.items()):
        receiver = send.get("peer")
        receive = calls.get(receiver) if _is_int(receiver) else None
        if send["op"] not in _SENDS or receive is None or receive["op"] not in _RECEIVES:
            continue
        if send["state"] in _FINISHED and receive["state"] in _FINISHED:
            continue
        if (receive.get("peer"), receive.get("tag"), receive.get("bytes")) != \
                (sender, send.get("tag"), send.get("bytes")):
            return _finding(
                "mismatch", name, sorted({sender, receiver}), f"{send['op']}/{receive['op']}",
                number, f"at #{number}: rank {sender} called {_describe(send)}; "
                        f"rank {receiver} called {_describe(receive)}",
                calls=[{"ranks": [sender], **_fields(send)},
                       {"ranks": [receiver], **_fields(receive)}])
    return None


def _fields(record: Dict[str, Any]) -> Dict[str, Any]:
    return {key: record.get(key) for key in ("op", "dtype", "shape", "bytes", "root", "peer",
                                              "tag", "state")}


# ---------------------------------------------------------------- text
def _clip(text: str) -> str:
    return text if len(text) <= _STATE_CHARS else text[:_STATE_CHARS - 3] + "..."


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + \
        f".{int(seconds % 1 * 1000):03d} UTC"


def format_text(report: Dict[str, Any]) -> str:
    """The report as ``gpucoll trace`` prints it: per communicator a line per rank and per call
    not finished, then a line per finding."""
    lines = []
    for communicator in report["communicators"]:
        opens = [record for row in communicator["ranks"] for record in row["open"]]
        origin = min((record["issued"] for record in opens), default=None)
        present = [row["rank"] for row in communicator["ranks"]]
        lines.append(f"{communicator['id']}: {communicator['size']} ranks "
                     f"({communicator['backend']}), dumps of {_names(present)}"
                     + (f"; times from {_clock(origin)}" if origin is not None else ""))
        for row in communicator["ranks"]:
            world = f" (world rank {row['world_rank']})" if row["world_rank"] != row["rank"] else ""
            lines.append(f"  rank {row['rank']}{world}: finished up to #{row['last_finished']}")
            for record in row["open"]:
                lines.append(f"    {record['op']} #{record['number']} issued at "
                             f"+{record['issued'] - origin:.3f} s: {_clip(record['state'])}")
    for finding in report["findings"]:
        lines.append(finding["message"])
    if not report["findings"]:
        lines.append("nothing wrong found: no rank behind, missing or mismatched")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``trace``'s arguments (shared by :func:`main` and ``gpucoll trace``)."""
    parser.add_argument("directory", metavar="DIR",
                        help="where the ranks wrote their dumps (GPUCOLL_TRACE_DIR); "
                             "subdirectories are read too")
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object (see gpucoll.trace_report)")
    parser.add_argument("--chrome", default=None, metavar="FILE",
                        help="also write a timeline of every rank's calls as Chrome trace "
                             "events (chrome://tracing, Perfetto)")


def main(argv: Optional[Sequence[str]] = None, out: Optional[TextIO] = None,
         err: Optional[TextIO] = None) -> int:
    """Print the report; returns the exit status: 0 nothing found, 1 findings, 2 bad input.

    Args:
        argv: ``DIR [--json] [--chrome FILE]`` (None: ``sys.argv[1:]``).
        out: where the report goes (default: stdout); err: where errors go (default: stderr).
    """
    parser = argparse.ArgumentParser(prog="gpucoll trace", allow_abbrev=False,
                                     description="Which rank is behind, from the flight "
                                                 "recorder's dumps.")
    add_arguments(parser)
    namespace = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return run(namespace.directory, as_json=namespace.json, chrome=namespace.chrome, out=out,
               err=err)


def run(directory: str, *, as_json: bool = False, chrome: Optional[str] = None,
        out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    """``gpucoll trace``'s work once its arguments are parsed; returns the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        dumps = read_dumps(directory)
        report = report_of(dumps)
        report["directory"] = directory
        if chrome:
            try:
                with open(chrome, "w", encoding="utf-8") as file:
                    json.dump(chrome_trace(dumps), file)
            except OSError as exc:
                raise DumpError(f"--chrome {chrome}: cannot write it: {exc}") from None
    except DumpError as exc:
        err.write(f"gpucoll trace: {exc}\n")
        err.flush()
        return 2
    out.write(json.dumps(report, indent=1, default=str) + "\n" if as_json
              else format_text(report) + "\n")
    out.flush()
    return 1 if report["findings"] else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
