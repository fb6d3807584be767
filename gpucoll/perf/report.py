"""What ``gpucoll bench`` prints and writes: the table, progress, summaries, JSON and CSV.

Runs where the output goes: in the parent of spawned ranks, or on rank 0 under a launcher.
The table's layout lives in :mod:`.table`, the plot in :mod:`.plot`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..cliutil import UsageError, require_matplotlib  # noqa: F401  (re-exported)
from .options import AVERAGES, BenchOptions
from .plot import write_plot  # noqa: F401 (re-exported)
from .specs import COLLECTIVES
from .table import LAYOUTS, row_cells, table_header  # noqa: F401 (re-exported)

MIB = 1 << 20


def human_bytes(nbytes: int) -> str:
    """``8 B``, ``64 KiB``, ``256 MiB``, ``1 GiB`` (sizes that are not whole units stay in B)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


class Reporter:
    """Prints the table as rows arrive; keeps them for ``--json``, ``--csv`` and ``--plot``."""

    def __init__(self, opts: BenchOptions, out=None, err=None):
        import sys

        self.opts, self.out, self.err = opts, out or sys.stdout, err or sys.stderr
        self.rows: List[Dict[str, Any]] = []
        self.info: Dict[str, Any] = {}
        self.skipped: List[List[str]] = []
        self.ceiling: Dict[str, Dict[str, Any]] = {}
        self._current: List[Dict[str, Any]] = []
        self._case: Optional[Tuple] = None
        self.layout = None
        self.progress = bool(getattr(self.err, "isatty", lambda: False)())
        self._total = 0

    def _print(self, text: str = "") -> None:
        if self.progress:
            self.err.write("\r\033[K")
            self.err.flush()
        self.out.write(text + "\n")
        self.out.flush()

    def __call__(self, kind: str, value: Any) -> None:
        getattr(self, "_on_" + kind)(value)

    def gpucoll_keys(self, name: str) -> List[str]:
        """Row keys of the gpucoll entries of ``name``'s rows."""
        from .engine import variant_keys

        labels = self.info.get("labels") or [None]
        return [key for key, _, _ in variant_keys(labels, self.opts.modes_of(COLLECTIVES[name]))]

    def _on_begin(self, info: Dict[str, Any]) -> None:
        opts = self.opts
        self.info = info
        self.layout = LAYOUTS[getattr(opts, "table", "nccl-tests")](opts, info)
        cases = sum(len(list(opts.cases(COLLECTIVES[n], info["nranks"]))) for n in opts.collectives)
        self._total = cases * len(opts.sizes)
        step = f"{opts.step_bytes}(bytes)" if opts.step_bytes > 0 else f"{opts.factor}(factor)"
        iters = (f"iters: {opts.iters}" if opts.iter_bytes <= 0 else
                 f"iters: {human_bytes(opts.iter_bytes)} / size in [{opts.min_iters}, {opts.iters}]")
        self._print(f"# gpucoll bench  nRanks {info['nranks']}  backend {info['backend']}  "
                    f"minBytes {opts.min_bytes} maxBytes {opts.max_bytes} step: {step} "
                    f"warmup iters: {opts.warmup} {iters} validation: {int(opts.check)}"
                    + (f"  compare: {opts.compare}" if opts.compare else ""))
        if opts.rounds > 1 or opts.average != 1:
            self._print(f"# time: the best of {opts.rounds} round(s), each the "
                        f"{AVERAGES[opts.average]}'s mean per call; the variants take turns "
                        "round by round")
        machine = info.get("machine") or {}
        if machine:
            self._print(f"# host {machine.get('host')}  {machine.get('cpus')} CPUs "
                        f"({machine.get('cpu')})  python {machine.get('python')}  numpy "
                        f"{machine.get('numpy')}  {machine.get('date')}")
        for label, text in (info.get("variants") or {}).items():
            if label is not None:
                self._print(f"# transport {label}: {text}")
        self._print("#")
        self._print("# Using devices")
        for rank, pid in enumerate(info["pids"]):
            self._print(f"#  Rank {rank:2d} Pid {pid:7d} backend {info['backend']}")
        self._print_ceiling()

    def _print_ceiling(self) -> None:
        if not self.ceiling:
            return
        first = next(iter(self.ceiling.values()))
        size = human_bytes(first.get("bytes", self.opts.ceiling_bytes))
        self._print("#")
        self._print(f"# Raw two-way exchange, 2 processes, {size} each way at once, 4 MiB socket "
                    "buffers, one non-blocking socket polled for both directions")
        for kind, rate in self.ceiling.items():
            if "error" in rate:
                self._print(f"#   {kind:<4}: {rate['error']}")
            else:
                self._print(f"#   {kind:<4}: {rate['gbps_median']:.3f} GB/s each way (median of "
                            f"{rate['reps']}; best {rate['gbps_best']:.3f})")

    def _on_start(self, name: str) -> None:
        self._current = []
        self._case = None
        for line in self.layout.start(name):
            self._print(line)

    def _on_row(self, row: Dict[str, Any]) -> None:
        row = dict(row, backend=self.info.get("backend"), nranks=self.info.get("nranks"))
        case = (row["collective"], row["type"], row["redop"], row["root"])
        if case != self._case:
            self._case = case
            for line in self.layout.case(row):
                self._print(line)
        self.rows.append(row)
        self._current.append(row)
        self._print(self.layout.line(row))
        if self.progress and self._total > 1:
            self.err.write(f"\r[gpucoll bench] {len(self.rows)}/{self._total} done, last "
                           f"{row['collective']} {row['size']} B")
            self.err.flush()

    def _on_skip(self, value) -> None:
        self.skipped.append(list(value))
        self._print(f"# {value[0]} skipped: {value[1]}")

    def _on_end(self, name: str) -> None:
        summary = summarize(self._current, self.gpucoll_keys(name))
        self._print(f"# Out of bounds values : {summary['wrong']} "
                    f"{'OK' if summary['wrong'] == 0 else 'FAILED'}")
        self._print(f"# Avg bus bandwidth    : {summary['avg_busbw']:.4g}")
        if self.opts.compare:
            self._print(f"# Avg bus bandwidth ({self.opts.compare}) : "
                        f"{summary['avg_compare_busbw']:.4g}")
            for entry in ratio_summary(self._current, self.info.get("labels") or [None]):
                self._print(f"# ratio {entry['label'] or ''}".rstrip() + f": {entry['smallest']:.2f} "
                            f"at {human_bytes(entry['smallest_bytes'])}; from 1 MiB up "
                            + (f"min {entry['min']:.2f} at {human_bytes(entry['min_bytes'])}, max "
                               f"{entry['max']:.2f} at {human_bytes(entry['max_bytes'])}"
                               if entry["min"] is not None else "-"))
        for entry in ceiling_fractions(self._current, self.ceiling, self.info):
            self._print(f"# largest busbw over {entry['kind']} ({entry['key']}): "
                        f"{entry['busbw']:.3f} GB/s at {human_bytes(entry['bytes'])} = "
                        f"{entry['fraction']:.2f} of the raw {entry['raw_gbps']:.3f} GB/s")

    @property
    def wrong(self) -> int:
        return sum(summarize([r for r in self.rows if r["collective"] == name],
                             self.gpucoll_keys(name))["wrong"]
                   for name in self.opts.collectives)

    @property
    def unsteady(self) -> int:
        return sum(1 for row in self.rows
                   if any(isinstance(e, dict) and e.get("unsteady") for e in row.values()))

    def document(self) -> Dict[str, Any]:
        """The ``--json`` document: settings, where it ran, every row and the summaries."""
        from .. import __version__

        opts = self.opts
        machine = dict(self.info.get("machine") or {})
        labels = self.info.get("labels") or [None]
        machine["transports"] = {label or "default": text
                                 for label, text in (self.info.get("variants") or {}).items()}
        return {
            "gpucoll_version": __version__, "backend": self.info.get("backend"),
            "nranks": self.info.get("nranks"), "compare": opts.compare,
            "compare_version": self.info.get("compare_version"),
            "machine": machine,
            "settings": {"collectives": list(opts.collectives), "min_bytes": opts.min_bytes,
                         "max_bytes": opts.max_bytes, "factor": opts.factor,
                         "step_bytes": opts.step_bytes, "iters": opts.iters,
                         "warmup": opts.warmup, "check": opts.check,
                         "dtypes": [d.name for d in opts.dtypes],
                         "ops": [o.value for o in opts.ops], "root": opts.root,
                         "transports": list(opts.transports), "rounds": opts.rounds,
                         "average": opts.average, "iter_bytes": opts.iter_bytes,
                         "min_iters": opts.min_iters, "modes": opts.modes,
                         "ceiling_bytes": opts.ceiling_bytes, "sizes": list(opts.sizes)},
            "bus_factors": {name: COLLECTIVES[name].bus_factor(self.info.get("nranks") or 1)
                            for name in opts.collectives},
            "ceiling": self.ceiling,
            "rows": self.rows,
            "summary": {name: dict(summarize([r for r in self.rows if r["collective"] == name],
                                             self.gpucoll_keys(name)),
                                   ratios=ratio_summary([r for r in self.rows
                                                         if r["collective"] == name], labels),
                                   ceiling=ceiling_fractions([r for r in self.rows
                                                              if r["collective"] == name],
                                                             self.ceiling, self.info))
                        for name in opts.collectives},
            "skipped": self.skipped,
            "unsteady_rows": self.unsteady,
            "wrong": self.wrong,
        }


def summarize(rows: Sequence[Dict[str, Any]], keys: Sequence[str] = ("out", "in")) -> Dict[str, Any]:
    """Wrong elements and average bus bandwidth over every measured entry (as nccl-tests)."""
    wrong, bws, compare = 0, [], []
    for row in rows:
        for key in keys:
            entry = row.get(key)
            if entry is not None:
                bws.append(entry["busbw"])
                wrong += entry["wrong"] or 0
        if row.get("gloo") is not None:
            compare.append(row["gloo"]["busbw"])
            wrong += row["gloo"]["wrong"] or 0
    return {"wrong": wrong, "avg_busbw": sum(bws) / len(bws) if bws else 0.0,
            "avg_compare_busbw": sum(compare) / len(compare) if compare else 0.0}


def ratio_summary(rows: Sequence[Dict[str, Any]], labels: Sequence[Optional[str]]) -> List[Dict[str, Any]]:
    """Per transport: the ratio at the smallest size, and its min and max from 1 MiB up."""
    out = []
    for label in labels:
        points = []
        for row in rows:
            value = row.get("ratio") if len(labels) == 1 else (row.get("ratios") or {}).get(label)
            if value is not None:
                points.append((row["size"], value))
        if not points:
            continue
        large = [(value, size) for size, value in points if size >= MIB]
        low, high = (min(large), max(large)) if large else ((None, None), (None, None))
        out.append({"label": label, "smallest": points[0][1], "smallest_bytes": points[0][0],
                    "min": low[0], "min_bytes": low[1], "max": high[0], "max_bytes": high[1]})
    return out


def ceiling_fractions(rows: Sequence[Dict[str, Any]], ceiling: Dict[str, Dict[str, Any]],
                      info: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The largest all_reduce busbw of each transport over the best raw rate of its links."""
    if not ceiling or not rows or rows[0]["collective"] != "all_reduce":
        return []
    out = []
    labels = info.get("labels") or [None]
    for label in labels:
        links = (info.get("variants") or {}).get(label, "")
        kind = "unix" if links.endswith("links: unix") else "tcp" if links.endswith("links: tcp") else None
        rate = (ceiling.get(kind) or {}).get("gbps_best") if kind else None
        if not rate:
            continue
        for mode in ("in", "out"):
            key = mode if len(labels) == 1 else f"{label}/{mode}"
            measured = [r for r in rows if r.get(key)]
            if measured:
                largest = max(measured, key=lambda r: r["size"])
                busbw = largest[key]["busbw"]
                out.append({"key": key, "kind": kind, "bytes": largest["size"], "busbw": busbw,
                            "raw_gbps": rate, "fraction": busbw / rate})
                break
    return out


_CSV_FIELDS = ("collective", "backend", "nranks", "size", "count", "type", "redop", "root")


def write_csv(path: str, rows: Sequence[Dict[str, Any]]) -> None:
    """One line per row; ``out_*``, ``in_*``, ``gloo_*`` (and per transport) columns, empty where N/A."""
    import csv

    parts = ("time_us", "algbw", "busbw", "wrong")
    extra = sorted({key for row in rows for key in row if "/" in key})
    groups = ["out", "in", "gloo"] + extra
    header = list(_CSV_FIELDS) + [f"{m}_{p}" for m in groups for p in parts] + ["ratio"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for row in rows:
            line = [row.get(name) for name in _CSV_FIELDS]
            for mode in groups:
                entry = row.get(mode) or {}
                line += ["" if entry.get(p) is None else entry[p] for p in parts]
            line.append("" if row.get("ratio") is None else row["ratio"])
            writer.writerow(line)


def finish(reporter: Reporter, json_path: Optional[str], csv_path: Optional[str],
           plot_path: Optional[str]) -> int:
    """Write the requested files (``json_path`` ``"-"``: stdout); 0 when every check passed."""
    import json
    import sys

    if json_path == "-":
        json.dump(reporter.document(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        sys.stdout.flush()
    elif json_path:
        with open(json_path, "w") as handle:
            json.dump(reporter.document(), handle, indent=1)
    if csv_path:
        write_csv(csv_path, reporter.rows)
    if plot_path:
        write_plot(plot_path, reporter.rows, reporter.opts.compare, reporter.info)
    return 0 if reporter.wrong == 0 else 1


def from_document(json_path: str, csv_path: Optional[str], plot_path: Optional[str]) -> int:
    """``--from-json``: write ``--csv`` / ``--plot`` from a saved ``--json`` document, measuring
    nothing (plot a run from a machine without matplotlib, such as a GPU node, elsewhere)."""
    import json

    if not (csv_path or plot_path):
        raise UsageError("--from-json needs --plot FILE.png or --csv FILE (what to write)")
    try:
        with open(json_path) as handle:
            doc = json.load(handle)
        rows = doc["rows"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and "collective" in r
                                                 for r in rows):
            raise ValueError("its rows are not gpucoll bench rows")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--from-json {json_path}: not a gpucoll bench --json document "
                         f"({type(exc).__name__}: {exc})") from exc
    machine = doc.get("machine") or {}
    labels = [None if label == "default" else label for label in machine.get("transports") or {}]
    info = {"nranks": doc.get("nranks"), "backend": doc.get("backend"),
            "labels": labels or [None], "machine": machine}
    if csv_path:
        write_csv(csv_path, rows)
    if plot_path:
        write_plot(plot_path, rows, doc.get("compare"), info)
    return 0
