"""``gpucoll bench --plot``: bus bandwidth against size, one line per collective and variant.

On one rank the bus bandwidth is 0 by definition (no data crosses between ranks) and an
in-place collective moves no data at all, so a one-rank plot shows the algorithm bandwidth of
the out-of-place call (a local copy: what the device or host copies per second).

The title names the ranks, backend, transports and host; the x axis is logarithmic (base 2)
with sizes written as B, KiB, MiB and GiB. matplotlib is optional (``pip install 'gpucoll[plot]'``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from ..cliutil import require_matplotlib  # noqa: F401  (re-exported)
from .specs import COLLECTIVES


def size_label(nbytes: float) -> str:
    """Axis label of a size: ``512 B``, ``4 KiB``, ``1.5 MiB``, ``2 GiB`` (empty below 1 B)."""
    if nbytes < 1:
        return ""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}"
    return f"{nbytes:g} B"


def plot_title(info: Dict[str, Any]) -> str:
    """``gpucoll bench: 4 ranks, backend cpu (unix, tcp), host node7``."""
    nranks = info.get("nranks")
    labels = [label for label in (info.get("labels") or []) if label]
    transports = f" ({', '.join(labels)})" if labels else ""
    host = (info.get("machine") or {}).get("host") or "?"
    return (f"gpucoll bench: {nranks} rank{'s' if nranks != 1 else ''}, backend "
            f"{info.get('backend')}{transports}, host {host}")


def make_figure(rows: Sequence[Dict[str, Any]], compare: Optional[str], info: Dict[str, Any]):
    """The figure (the caller saves and closes it)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    plt = require_matplotlib()
    figure, axes = plt.subplots(figsize=(8, 5))
    labels = info.get("labels") or [None]
    one_rank = info.get("nranks") == 1
    metric = "algbw" if one_rank else "busbw"
    for name in dict.fromkeys(r["collective"] for r in rows):
        coll = COLLECTIVES[name]
        mode = "out" if one_rank else coll.gloo_mode
        place = "in-place" if mode == "in" else "out-of-place"
        for label in labels:
            key = mode if len(labels) == 1 else f"{label}/{mode}"
            mine = [r for r in rows if r["collective"] == name and r.get(key) and r["size"] > 0]
            if mine:
                which = f"{label}, " if label else ""
                axes.plot([r["size"] for r in mine], [r[key][metric] for r in mine], marker="o",
                          label=f"{name} ({which}{mine[0].get('backend')}, {place})")
        theirs = [r for r in rows if r["collective"] == name and r.get("gloo") and r["size"] > 0]
        if compare and theirs:
            axes.plot([r["size"] for r in theirs], [r["gloo"][metric] for r in theirs],
                      marker="x", linestyle="--", label=f"{name} ({compare})")
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(LogLocator(base=4))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: size_label(value)))
    axes.set_xlabel("size")
    axes.set_ylabel("algorithm bandwidth, one rank (GB/s)" if one_rank
                    else "bus bandwidth (GB/s)")
    axes.set_title(plot_title(info))
    axes.grid(True, which="both", alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    axes.tick_params(axis="x", labelrotation=30)
    figure.tight_layout()
    return figure


def write_plot(path: str, rows: Sequence[Dict[str, Any]], compare: Optional[str],
               info: Optional[Dict[str, Any]] = None) -> None:
    """Save busbw (one rank: algbw) against size as ``path`` (PNG, or any format matplotlib
    knows by suffix)."""
    plt = require_matplotlib()
    figure = make_figure(rows, compare, info or {})
    figure.savefig(path, dpi=120)
    plt.close(figure)
