"""``gpucoll trace DIR --chrome FILE``: the flight recorder's dumps as a Chrome trace-event timeline.

The document loads in chrome://tracing and Perfetto (ui.perfetto.dev): a process per rank (its
world rank), a thread per communicator, and one complete event (``"ph": "X"``) per recorded
call, from when it was issued to when it finished. A call still pending when the rank dumped
its trace runs to the dump's time and is marked (``cat`` and ``args.state`` ``"pending"``, its
name ending in ``(pending)``). Times are microseconds from the earliest issued call of all the
dumps. A rank of a communicator that left no dump gets a named, empty process where its world
rank is known.

It reads dumps as :func:`gpucoll.trace_report.read_dumps` returns them (anything with
``header``, ``records``, ``communicator`` and ``rank``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

__all__ = ["chrome_trace"]

_MICROSECONDS = 1e6
_ARGS = ("op", "number", "bytes", "dtype", "shape", "state", "root", "peer", "tag")
_COLOURS = {"failed": "terrible", "pending": "bad"}  # chrome://tracing's reserved colour names


def _category(state: str) -> str:
    return "failed" if state.startswith("failed") else state


def chrome_trace(dumps: Sequence[Any]) -> Dict[str, Any]:
    """The dumps' calls as a Chrome trace-event document (JSON-ready).

    Args:
        dumps: one communicator's dump per rank, of one or several communicators.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``; ``otherData``
        holds ``origin`` (the epoch seconds that time 0 stands for).
    """
    issued = [record["issued"] for dump in dumps for record in dump.records]
    origin = min(issued, default=0.0)
    threads = {name: index for index, name in
               enumerate(sorted({dump.communicator for dump in dumps}), 1)}
    events: List[Dict[str, Any]] = []
    named = set()
    for dump in sorted(dumps, key=lambda d: (d.header["rank"], threads[d.communicator])):
        pid, tid = dump.header["rank"], threads[dump.communicator]
        if pid not in named:
            named.add(pid)
            where = ", ".join(str(dump.header[key]) for key in ("host", "pid")
                              if dump.header.get(key) is not None)
            events += _process(pid, f"rank {pid}" + (f" ({where})" if where else ""))
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": f"{dump.communicator} (rank {dump.rank} of "
                                        f"{dump.header['size']})"}})
        for record in dump.records:
            events.append(_call(record, dump, pid, tid, origin))
    for pid in sorted(_missing_world_ranks(dumps) - named):
        events += _process(pid, f"rank {pid} (no dump)")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin": origin, "source": "gpucoll flight recorder"}}


def _process(pid: int, name: str) -> List[Dict[str, Any]]:
    return [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]


def _call(record: Dict[str, Any], dump: Any, pid: int, tid: int, origin: float) -> Dict[str, Any]:
    state = record["state"]
    pending = record.get("finished") is None
    end = record["finished"] if not pending else (dump.header.get("written") or record["issued"])
    args = {key: record.get(key) for key in _ARGS}
    args.update(communicator=dump.communicator, pending=pending)
    event = {"name": f"{record['op']} #{record['number']}" + (" (pending)" if pending else ""),
             "cat": _category(state), "ph": "X", "pid": pid, "tid": tid,
             "ts": (record["issued"] - origin) * _MICROSECONDS,
             "dur": max(end - record["issued"], 0.0) * _MICROSECONDS, "args": args}
    colour = _COLOURS.get(event["cat"])
    if colour:
        event["cname"] = colour
    return event


def _missing_world_ranks(dumps: Sequence[Any]) -> set:
    """World ranks of communicators' ranks without a dump, where a communicator's ranks are
    the world's (every dump's rank equals its world rank)."""
    missing = set()
    communicators: Dict[str, List[Any]] = {}
    for dump in dumps:
        communicators.setdefault(dump.communicator, []).append(dump)
    for members in communicators.values():
        if all(dump.header["rank"] == dump.rank for dump in members):
            size = max(dump.header["size"] for dump in members)
            missing |= set(range(size)) - {dump.rank for dump in members}
    return missing
