"""The two table layouts of ``gpucoll bench``.

``nccl-tests`` (the default): size, count, type, redop, root, then time, algbw, busbw and
#wrong for out-of-place and in-place (per transport when several are measured), Gloo's columns
and the ratio. ``side-by-side``: one table per collective and case, size and count, then the
same four columns for every variant (each gpucoll transport, Gloo) and the ratios, with wider
numbers; what ``bench/bench_cpu.py`` prints. A row whose slowest round took more than twice
its best (``--rounds``) ends with ``~``: the machine was busy during that size.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .engine import variant_keys
from .specs import COLLECTIVES

_PLACE = {"out": "out-of-place", "in": "in-place"}
_DEFAULT_GROUPS = (("out", "out-of-place"), ("in", "in-place"))


# ---------------------------------------------------------------- nccl-tests layout
def _fmt_time(us: float) -> str:
    return f"{us:8.2f}" if us < 1e4 else f"{us:8.0f}"


def _fmt_mode(entry: Optional[Dict[str, Any]]) -> str:
    if entry is None:
        return f"{'N/A':>8}  {'N/A':>7}  {'N/A':>7}  {'N/A':>6}"
    wrong = "N/A" if entry["wrong"] is None else str(entry["wrong"])
    return f"{_fmt_time(entry['time_us'])}  {entry['algbw']:7.2f}  {entry['busbw']:7.2f}  {wrong:>6}"


def _ratio_cell(ratio: Optional[float], width: int) -> str:
    return f"{'N/A':>{width}}" if ratio is None else f"{ratio:{width}.2f}"


def table_header(compare: Optional[str], groups: Sequence[Tuple[str, str]] = _DEFAULT_GROUPS,
                 ratio_names: Sequence[str] = ("ratio",)) -> List[str]:
    """The three header lines: group titles, column names, units."""
    block = 8 + 2 + 7 + 2 + 7 + 2 + 6  # one mode's columns
    labels = [title for _, title in groups] + ([compare] if compare else [])
    columns = f"{'time':>8}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}"
    units_of = f"{'(us)':>8}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}"
    group = "#" + " " * 48 + "  ".join(label.center(block) for label in labels)
    names = (f"#{'size':>11}  {'count':>12}  {'type':>6}  {'redop':>5}  {'root':>4}  "
             + "  ".join([columns] * len(groups)))
    units = (f"#{'(B)':>11}  {'(elements)':>12}  {'':>6}  {'':>5}  {'':>4}  "
             + "  ".join([units_of] * len(groups)))
    if compare:
        names += f"  {columns}" + "".join(f"  {name:>{max(6, len(name))}}" for name in ratio_names)
        units += f"  {units_of}" + "".join(f"  {'':>{max(6, len(name))}}" for name in ratio_names)
    return [group, names, units]


def row_cells(row: Dict[str, Any], compare: Optional[str],
              groups: Sequence[Tuple[str, str]] = _DEFAULT_GROUPS,
              ratios: Sequence[Tuple[Optional[str], str]] = ((None, "ratio"),)) -> str:
    """One table line in nccl-tests' layout (plus Gloo's columns and the ratios)."""
    line = (f"{row['size']:12d}  {row['count']:12d}  {row['type']:>6}  {row['redop']:>5}  "
            f"{row['root']:4d}  " + "  ".join(_fmt_mode(row.get(key)) for key, _ in groups))
    if compare:
        line += f"  {_fmt_mode(row['gloo'])}"
        for label, name in ratios:
            value = row["ratio"] if label is None else (row.get("ratios") or {}).get(label)
            line += f"  {_ratio_cell(value, max(6, len(name)))}"
    return line


def _unsteady(row: Dict[str, Any]) -> bool:
    return any(isinstance(entry, dict) and entry.get("unsteady") for entry in row.values())


class NcclTestsTable:
    """nccl-tests' columns; several transports get a pair of mode groups each."""

    def __init__(self, opts, info: Dict[str, Any]):
        self.opts, self.labels = opts, info.get("labels") or [None]

    def groups(self, name: str) -> List[Tuple[str, str]]:
        coll = COLLECTIVES[name]
        if len(self.labels) == 1:
            modes = ("out", "in") if self.opts.modes == "all" else (coll.gloo_mode,)
            return [(mode, _PLACE[mode]) for mode in modes]
        modes = ("out", "in") if self.opts.modes == "all" else (coll.gloo_mode,)
        return [(key, f"{label} {_PLACE[mode]}") for key, label, mode in variant_keys(self.labels, modes)]

    def ratio_names(self) -> List[Tuple[Optional[str], str]]:
        if len(self.labels) == 1:
            return [(None, "ratio")]
        return [(label, f"ratio {label}") for label in self.labels]

    def start(self, name: str) -> List[str]:
        lines = ["#", f"# Collective test starting: {name}"]
        compare = self.opts.compare
        if compare:
            mode = _PLACE[COLLECTIVES[name].gloo_mode]
            lines.append(f"# ratio = {compare} time / gpucoll {mode} time "
                         f"(= gpucoll busbw / {compare} busbw)")
        return lines + table_header(compare, self.groups(name), [n for _, n in self.ratio_names()])

    def case(self, row: Dict[str, Any]) -> List[str]:
        return []

    def line(self, row: Dict[str, Any]) -> str:
        text = row_cells(row, self.opts.compare, self.groups(row["collective"]), self.ratio_names())
        return text + ("  ~" if _unsteady(row) else "")


# ---------------------------------------------------------------- side-by-side layout
class SideBySideTable:
    """Every variant's time, algbw, busbw and #wrong side by side, then gloo time / gpucoll time."""

    def __init__(self, opts, info: Dict[str, Any]):
        self.opts, self.info = opts, info
        self.labels = info.get("labels") or [None]

    def variants(self, name: str) -> List[Tuple[str, str, str]]:
        """(row key, title, description) of each column group."""
        coll = COLLECTIVES[name]
        modes = self.opts.modes_of(coll)
        out = []
        for key, label, mode in variant_keys(self.labels, modes):
            title = f"gpucoll-{label or 'default'}" + ("" if len(modes) == 1 else f" {_PLACE[mode]}")
            out.append((key, title, self.info["variants"].get(label, "")))
        if self.opts.compare:
            out.append(("gloo", self.opts.compare, self.info.get("compare_version", "")))
        return out

    def ratio_keys(self, name: str) -> List[Tuple[Optional[str], str]]:
        if not self.opts.compare:
            return []
        return [(label, label or "default") for label in self.labels]

    def start(self, name: str) -> List[str]:
        return []

    def case(self, row: Dict[str, Any]) -> List[str]:
        name, nranks = row["collective"], self.info.get("nranks", 1)
        root = f"  root {row['root']}" if row["root"] >= 0 else ""
        lines = ["", f"# {name}  world_size={nranks}  {row['type']}  {row['redop']}{root}  "
                     f"(busbw factor {COLLECTIVES[name].bus_factor(nranks):.3f})"]
        variants = self.variants(name)
        lines += [f"#   {title}: {text}" for _, title, text in variants]
        ratios = self.ratio_keys(name)
        head1, head2 = f"#{'':>11} {'':>11}", f"#{'size':>11} {'count':>11}"
        head3 = f"#{'(B)':>11} {'(elements)':>11}"
        for _, title, _ in variants:
            head1 += f"  {title:^37}"
            head2 += f"  {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>8}"
            head3 += f"  {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>8}"
        if ratios:
            head1 += f"  {'ratio: ' + self.opts.compare + ' time / gpucoll time':>{max(17, 9 * len(ratios))}}"
            head2 += "".join(f"  {name:>7}" for _, name in ratios)
        return lines + [head1, head2, head3]

    def line(self, row: Dict[str, Any]) -> str:
        text = f" {row['size']:>11} {row['count']:>11}"
        for key, _, _ in self.variants(row["collective"]):
            entry = row.get(key)
            if entry is None:
                text += f"  {'-':>10} {'-':>8} {'-':>8} {'-':>8}"
                continue
            wrong = "-" if entry["wrong"] is None else entry["wrong"]
            text += (f"  {entry['time_us']:10.1f} {entry['algbw']:8.3f} {entry['busbw']:8.3f} "
                     f"{wrong:>8}")
        for label, _ in self.ratio_keys(row["collective"]):
            value = row["ratio"] if len(self.labels) == 1 else (row.get("ratios") or {}).get(label)
            text += "  " + (f"{'-':>7}" if value is None else f"{value:7.2f}")
        return text + ("  ~" if _unsteady(row) else "")


LAYOUTS = {"nccl-tests": NcclTestsTable, "side-by-side": SideBySideTable}
