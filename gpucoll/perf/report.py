"""What ``gpucoll bench`` prints and writes: the nccl-tests table, progress, JSON, CSV and plot.

Runs where the output goes: in the parent of spawned ranks, or on rank 0 under a launcher.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..cliutil import UsageError, require_matplotlib  # noqa: F401  (re-exported)
from .options import BenchOptions
from .specs import COLLECTIVES


# ---------------------------------------------------------------- formatting (rank 0 / parent)
def _fmt_time(us: float) -> str:
    return f"{us:8.2f}" if us < 1e4 else f"{us:8.0f}"


def _fmt_mode(entry: Optional[Dict[str, Any]]) -> str:
    if entry is None:
        return f"{'N/A':>8}  {'N/A':>7}  {'N/A':>7}  {'N/A':>6}"
    wrong = "N/A" if entry["wrong"] is None else str(entry["wrong"])
    return f"{_fmt_time(entry['time_us'])}  {entry['algbw']:7.2f}  {entry['busbw']:7.2f}  {wrong:>6}"


def table_header(compare: Optional[str]) -> List[str]:
    block = 8 + 2 + 7 + 2 + 7 + 2 + 6  # one mode's columns
    labels = ["out-of-place", "in-place"] + ([compare] if compare else [])
    group = "#" + " " * 48 + "  ".join(label.center(block) for label in labels)
    names = (f"#{'size':>11}  {'count':>12}  {'type':>6}  {'redop':>5}  {'root':>4}  "
             + "  ".join([f"{'time':>8}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}"] * 2))
    units = (f"#{'(B)':>11}  {'(elements)':>12}  {'':>6}  {'':>5}  {'':>4}  "
             + "  ".join([f"{'(us)':>8}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}"] * 2))
    if compare:
        names += f"  {'time':>8}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}  {'ratio':>6}"
        units += f"  {'(us)':>8}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}  {'':>6}"
    return [group, names, units]


def row_cells(row: Dict[str, Any], compare: Optional[str]) -> str:
    """One table line in nccl-tests' layout (plus Gloo's columns and the ratio)."""
    line = (f"{row['size']:12d}  {row['count']:12d}  {row['type']:>6}  {row['redop']:>5}  "
            f"{row['root']:4d}  {_fmt_mode(row['out'])}  {_fmt_mode(row['in'])}")
    if compare:
        ratio = "N/A" if row["ratio"] is None else f"{row['ratio']:.2f}"
        line += f"  {_fmt_mode(row['gloo'])}  {ratio:>6}"
    return line


class Reporter:
    """Prints the table as rows arrive; keeps them for ``--json``, ``--csv`` and ``--plot``.

    Runs where the output goes: in the parent of spawned ranks, or on rank 0 under a launcher.
    """

    def __init__(self, opts: BenchOptions, out=None, err=None):
        import sys

        self.opts, self.out, self.err = opts, out or sys.stdout, err or sys.stderr
        self.rows: List[Dict[str, Any]] = []
        self.info: Dict[str, Any] = {}
        self.skipped: List[List[str]] = []
        self._current: List[Dict[str, Any]] = []
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

    def _on_begin(self, info: Dict[str, Any]) -> None:
        opts = self.opts
        self.info = info
        cases = sum(len(list(opts.cases(COLLECTIVES[n], info["nranks"]))) for n in opts.collectives)
        self._total = cases * len(opts.sizes)
        step = f"{opts.step_bytes}(bytes)" if opts.step_bytes > 0 else f"{opts.factor}(factor)"
        self._print(f"# gpucoll bench  nRanks {info['nranks']}  backend {info['backend']}  "
                    f"minBytes {opts.min_bytes} maxBytes {opts.max_bytes} step: {step} "
                    f"warmup iters: {opts.warmup} iters: {opts.iters} validation: {int(opts.check)}"
                    + (f"  compare: {opts.compare}" if opts.compare else ""))
        self._print("#")
        self._print("# Using devices")
        for rank, pid in enumerate(info["pids"]):
            self._print(f"#  Rank {rank:2d} Pid {pid:7d} backend {info['backend']}")

    def _on_start(self, name: str) -> None:
        self._current = []
        self._print("#")
        self._print(f"# Collective test starting: {name}")
        if self.opts.compare:
            mode = "in-place" if COLLECTIVES[name].gloo_mode == "in" else "out-of-place"
            self._print(f"# ratio = gpucoll {mode} busbw / {self.opts.compare} busbw")
        for line in table_header(self.opts.compare):
            self._print(line)

    def _on_row(self, row: Dict[str, Any]) -> None:
        row = dict(row, backend=self.info.get("backend"), nranks=self.info.get("nranks"))
        self.rows.append(row)
        self._current.append(row)
        self._print(row_cells(row, self.opts.compare))
        if self.progress and self._total > 1:
            self.err.write(f"\r[gpucoll bench] {len(self.rows)}/{self._total} done, last "
                           f"{row['collective']} {row['size']} B")
            self.err.flush()

    def _on_skip(self, value) -> None:
        self.skipped.append(list(value))
        self._print(f"# {value[0]} skipped: {value[1]}")

    def _on_end(self, name: str) -> None:
        summary = summarize(self._current)
        self._print(f"# Out of bounds values : {summary['wrong']} "
                    f"{'OK' if summary['wrong'] == 0 else 'FAILED'}")
        self._print(f"# Avg bus bandwidth    : {summary['avg_busbw']:.4g}")
        if self.opts.compare:
            self._print(f"# Avg bus bandwidth ({self.opts.compare}) : "
                        f"{summary['avg_compare_busbw']:.4g}")

    @property
    def wrong(self) -> int:
        return summarize(self.rows)["wrong"]

    def document(self) -> Dict[str, Any]:
        """The ``--json`` document."""
        from .. import __version__

        opts = self.opts
        return {
            "gpucoll_version": __version__, "backend": self.info.get("backend"),
            "nranks": self.info.get("nranks"), "compare": opts.compare,
            "settings": {"collectives": list(opts.collectives), "min_bytes": opts.min_bytes,
                         "max_bytes": opts.max_bytes, "factor": opts.factor,
                         "step_bytes": opts.step_bytes, "iters": opts.iters,
                         "warmup": opts.warmup, "check": opts.check,
                         "dtypes": [d.name for d in opts.dtypes],
                         "ops": [o.value for o in opts.ops], "root": opts.root},
            "bus_factors": {name: COLLECTIVES[name].bus_factor(self.info.get("nranks") or 1)
                            for name in opts.collectives},
            "rows": self.rows,
            "summary": {name: summarize([r for r in self.rows if r["collective"] == name])
                        for name in opts.collectives},
            "skipped": self.skipped,
            "wrong": self.wrong,
        }


def summarize(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Wrong elements and average bus bandwidth over every measured entry (as nccl-tests)."""
    wrong, bws, compare = 0, [], []
    for row in rows:
        for mode in ("out", "in"):
            entry = row.get(mode)
            if entry is not None:
                bws.append(entry["busbw"])
                wrong += entry["wrong"] or 0
        if row.get("gloo") is not None:
            compare.append(row["gloo"]["busbw"])
            wrong += row["gloo"]["wrong"] or 0
    return {"wrong": wrong, "avg_busbw": sum(bws) / len(bws) if bws else 0.0,
            "avg_compare_busbw": sum(compare) / len(compare) if compare else 0.0}


_CSV_FIELDS = ("collective", "backend", "nranks", "size", "count", "type", "redop", "root")


def write_csv(path: str, rows: Sequence[Dict[str, Any]]) -> None:
    """One line per row; ``out_*``, ``in_*`` and ``gloo_*`` columns, empty where N/A."""
    import csv

    parts = ("time_us", "algbw", "busbw", "wrong")
    header = list(_CSV_FIELDS) + [f"{m}_{p}" for m in ("out", "in", "gloo") for p in parts] + ["ratio"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for row in rows:
            line = [row.get(name) for name in _CSV_FIELDS]
            for mode in ("out", "in", "gloo"):
                entry = row.get(mode) or {}
                line += ["" if entry.get(p) is None else entry[p] for p in parts]
            line.append("" if row.get("ratio") is None else row["ratio"])
            writer.writerow(line)


def write_plot(path: str, rows: Sequence[Dict[str, Any]], compare: Optional[str]) -> None:
    """busbw against size (log x): one line per collective, and per compared backend."""
    plt = require_matplotlib()
    figure, axes = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r["collective"] for r in rows):
        coll = COLLECTIVES[name]
        mine = [r for r in rows if r["collective"] == name and r.get(coll.gloo_mode) and r["size"] > 0]
        if not mine:
            continue
        label = f"{name} ({mine[0].get('backend')}, {'in' if coll.gloo_mode == 'in' else 'out-of'}-place)"
        axes.plot([r["size"] for r in mine], [r[coll.gloo_mode]["busbw"] for r in mine],
                  marker="o", label=label)
        theirs = [r for r in mine if r.get("gloo")]
        if compare and theirs:
            axes.plot([r["size"] for r in theirs], [r["gloo"]["busbw"] for r in theirs],
                      marker="x", linestyle="--", label=f"{name} ({compare})")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title("gpucoll bench")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def finish(reporter: Reporter, json_path: Optional[str], csv_path: Optional[str],
           plot_path: Optional[str]) -> int:
    """Write the requested files; 0 when every check passed, 1 otherwise (as nccl-tests)."""
    import json

    if json_path:
        with open(json_path, "w") as handle:
            json.dump(reporter.document(), handle, indent=1)
    if csv_path:
        write_csv(csv_path, reporter.rows)
    if plot_path:
        write_plot(plot_path, reporter.rows, reporter.opts.compare)
    return 0 if reporter.wrong == 0 else 1
