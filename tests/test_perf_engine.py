"""``gpucoll.perf`` pieces without processes: the shared reference, rounds, ``-a``, layouts, plot."""

import numpy as np
import pytest

from gpucoll import ReduceOp, perf
from gpucoll.perf import engine, reference

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


# ---------------------------------------------------------------- the shared reference
def test_pattern_catches_a_block_moved_by_any_distance():
    values = reference.pattern(0, 0, 1 << 18, np.int64, "sum")
    assert values.min() == -8 and values.max() == 8
    # the 7 i term alone repeats every 17 elements; the block hash breaks that period, so data
    # moved by any distance (a multiple of 17 included) differs from what belongs there
    for distance in (1, 16, 17, 34, 17 * 64, 4096, 65536, 17 * 4913):
        same = np.mean(values[distance:] == values[:-distance])
        assert same < 0.2, (distance, same)


def test_pattern_slices_agree_with_the_whole():
    whole = reference.pattern(5, 2, 1000, np.float32, ReduceOp.PROD)
    np.testing.assert_array_equal(whole[333:444], reference.pattern(5, 2, 111, np.float32, "prod", 333))
    assert set(np.unique(whole)) <= {-1.0, 1.0, 2.0}
    assert set(np.unique(reference.pattern(5, 2, 1000, np.uint8, "prod"))) <= {1, 2, 3}


def test_make_input_covers_every_dtype_of_the_suite():
    for dtype in reference.ALL_DTYPES + ["bfloat16"]:
        dt = reference.as_dtype(dtype)
        x = reference.make_input(3, 1, (4, 5), dt, "sum")
        assert x.shape == (4, 5) and x.dtype == dt and x.flags.c_contiguous
        assert len(np.unique(x.astype(np.complex128) if dt.kind == "c" else x.astype(np.float64))) > 1


def test_reduce_reference_against_a_python_loop():
    stacked = np.stack([reference.pattern(1, r, 50, np.int32, "sum") for r in range(3)])
    for op, fn in (("sum", lambda a, b: a + b), ("max", max), ("min", min)):
        expected = [stacked[0, i] for i in range(50)]
        for r in (1, 2):
            expected = [fn(expected[i], stacked[r, i]) for i in range(50)]
        np.testing.assert_array_equal(reference.reduce_reference(stacked, op), expected)
    # integer avg truncates toward zero
    avg = reference.reduce_reference(np.array([[-3], [0]], np.int32), "avg")
    np.testing.assert_array_equal(avg, [-1])


def test_bfloat16_reference_and_checker():
    expected = reference.expected_reduction(ReduceOp.SUM, 2, 4, 100, BF16)
    exact = sum(reference.pattern(2, r, 100, np.int64, "sum") for r in range(4))
    assert expected.dtype == BF16
    np.testing.assert_array_equal(expected.astype(np.int64), exact)
    got = expected.copy()
    assert reference.count_wrong(got, expected, 4) == 0
    got[[3, 50]] = got[[3, 50]] + BF16.type(1)
    assert reference.count_wrong(got, expected, 4) == 2
    assert perf.parse_dtypes("bfloat16") == [BF16] and perf.parse_dtypes("bf16") == [BF16]


# ---------------------------------------------------------------- options
def test_iteration_budget():
    opts = perf.BenchOptions(iters=300, min_iters=6, warmup=50, iter_bytes=1 << 30)
    assert opts.iterations(8) == (300, 50)          # capped at -n, warm-up capped at -w
    assert opts.iterations(8 << 20) == (128, 25)    # 1 GiB / 8 MiB, a fifth of it warm-up
    assert opts.iterations(256 << 20) == (6, 1)     # at least --min-iters
    assert perf.BenchOptions(iters=20, warmup=5).iterations(1 << 30) == (20, 5)  # nccl-tests


@pytest.mark.parametrize("field, value, message", [
    ("rounds", 0, "--rounds"), ("average", 4, "-a"), ("modes", "some", "--modes"),
    ("transports", ["carrier-pigeon"], "--transport"), ("min_iters", 0, "--min-iters"),
    ("table", "wide", "--table"), ("ceiling_bytes", -1, "--ceiling")])
def test_bad_options(field, value, message):
    opts = perf.BenchOptions(**{field: value})
    with pytest.raises(perf.UsageError, match=message):
        opts.validate()


def test_parse_transports():
    assert perf.parse_transports("unix, tcp") == ["unix", "tcp"]
    for text in ("", "unix,unix", "udp"):
        with pytest.raises(perf.UsageError, match="--transport"):
            perf.parse_transports(text)


# ---------------------------------------------------------------- rounds and ranks
class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def variant(self):
        return engine._Variant(self.name, lambda: self.log.append(("run", self.name)),
                               lambda: self.log.append(("barrier", self.name)), lambda: None,
                               lambda seed: self.log.append(("fill", self.name)),
                               lambda seed: self.log.append(("check", self.name)) or 0, 0)


def test_rounds_take_turns_and_check_once():
    log = []
    variants = [_Recorder(name, log).variant() for name in "abc"]
    seconds, wrong = engine._play(variants, iters=6, warmup=1, rounds=3, shift=1, check=True)
    assert [len(s) for s in seconds] == [3, 3, 3] and wrong == [0, 0, 0]
    turns = [name for kind, name in log if kind == "barrier"]
    assert turns == list("bca") + list("cab") + list("abc")  # rotated round by round
    assert [name for kind, name in log if kind == "check"] == list("abc")
    assert sum(1 for kind, _ in log if kind == "run") == 3 * (1 + 6)  # warm-up, timed (2 per round)


def test_one_round_is_nccl_tests_order():
    log = []
    variants = [_Recorder(name, log).variant() for name in "ab"]
    engine._play(variants, iters=2, warmup=1, rounds=1, shift=1, check=True)
    kinds = [(kind, name) for kind, name in log if kind != "run"]
    assert kinds == [("fill", "a"), ("barrier", "a"), ("check", "a"),
                     ("fill", "b"), ("barrier", "b"), ("check", "b")]


class _GatherComm:
    """all_gather returns the tables given for each rank (as the ranks would send them)."""

    def __init__(self, tables):
        self.tables, self.size, self.rank = tables, len(tables), 0

    def all_gather(self, buf, out):
        np.copyto(out, np.stack(self.tables))


def test_combine_ranks_as_nccl_tests_average():
    # 2 variants, 3 rounds; per rank [round seconds..., wrong]
    rank0 = [[1.0, 2.0, 3.0, 0], [4.0, 4.0, 4.0, 1]]
    rank1 = [[3.0, 1.0, 9.0, 0], [2.0, 8.0, 4.0, -1]]
    comm = _GatherComm([np.array(rank0), np.array(rank1)])
    local_seconds, local_wrong = [r[:3] for r in rank0], [0, 1]
    times = {a: [e["time_us"] / 1e6 for e in engine._combine(comm, perf._Host(), local_seconds,
                                                            local_wrong, a)]
             for a in (0, 1, 2, 3)}
    assert times[0] == [1.0, 4.0]            # rank 0's best round
    assert times[1] == [1.5, 3.0]            # best of the means (2, 1.5, 6) and (3, 6, 4)
    assert times[2] == [1.0, 2.0]            # best of the fastest ranks
    assert times[3] == [2.0, 4.0]            # best of the slowest ranks (3, 2, 9) and (4, 8, 4)
    entries = engine._combine(comm, perf._Host(), local_seconds, local_wrong, 3)
    assert entries[0]["wrong"] == 0 and entries[1]["wrong"] is None  # a rank did not check
    assert entries[0]["round_time_us"] == [3e6, 2e6, 9e6] and entries[0]["unsteady"]
    single = engine._combine(_GatherComm([np.array([[2.0, 0]])]), perf._Host(), [[2.0]], [0], 1)
    assert set(single[0]) == {"time_us", "wrong"}  # one round: nccl-tests' entry, nothing more


# ---------------------------------------------------------------- layouts and plot
def _row(**extra):
    entry = {"time_us": 1500.0, "algbw": 2.0, "busbw": 2.0, "wrong": 0}
    row = {"collective": "all_reduce", "size": 3 << 20, "count": 786432, "type": "float",
           "redop": "sum", "root": -1, "out": None, "in": entry, "gloo": None, "ratio": None}
    row.update(extra)
    return row


def test_side_by_side_layout_columns():
    opts = perf.BenchOptions(transports=["unix", "tcp"], compare="gloo", modes="matched",
                             table="side-by-side")
    info = {"nranks": 2, "labels": ["unix", "tcp"],
            "variants": {"unix": "gpucoll 0.1.0, links: unix", "tcp": "gpucoll 0.1.0, links: tcp"}}
    entry = {"time_us": 1500.0, "algbw": 2.0, "busbw": 2.0, "wrong": 0}
    row = _row(**{"unix/in": entry, "tcp/in": dict(entry, time_us=3000.0, unsteady=True),
                  "gloo": dict(entry, time_us=6000.0), "ratios": {"unix": 4.0, "tcp": 2.0}})
    layout = perf.report.LAYOUTS["side-by-side"](opts, info)
    header = layout.case(row)
    assert "# all_reduce  world_size=2  float  sum  (busbw factor 1.000)" in header
    assert header[-2].split() == (["#", "size", "count"] + ["time", "algbw", "busbw", "#wrong"] * 3
                                  + ["unix", "tcp"])
    cells = layout.line(row).split()
    assert cells[:6] == ["3145728", "786432", "1500.0", "2.000", "2.000", "0"]
    assert cells[-3:] == ["4.00", "2.00", "~"]  # ratios, then the unsteady mark


def test_size_labels_and_plot_title():
    assert [perf.size_label(n) for n in (8, 1024, 3 << 19, 64 << 20, 1 << 30)] == [
        "8 B", "1 KiB", "1.5 MiB", "64 MiB", "1 GiB"]
    info = {"nranks": 4, "backend": "cpu", "labels": ["unix", "tcp"], "machine": {"host": "node7"}}
    assert perf.plot_title(info) == "gpucoll bench: 4 ranks, backend cpu (unix, tcp), host node7"


def test_plot_axis_reads_binary_units():
    pytest.importorskip("matplotlib")
    rows = [_row(size=size, backend="cpu") for size in (8, 1 << 10, 1 << 20, 64 << 20)]
    info = {"nranks": 2, "backend": "cpu", "labels": [None], "machine": {"host": "node7"}}
    figure = perf.make_figure(rows, None, info)
    try:
        axes = figure.axes[0]
        figure.canvas.draw()
        low, high = axes.get_xlim()
        labels = [tick.get_text() for tick in axes.get_xticklabels()
                  if tick.get_text() and low <= tick.get_position()[0] <= high]
        assert axes.get_title() == "gpucoll bench: 2 ranks, backend cpu, host node7"
        assert "1 KiB" in labels and any(label.endswith(" MiB") for label in labels), labels
        assert all(label.endswith(("B", "KiB", "MiB", "GiB")) for label in labels)
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


def test_a_one_rank_plot_shows_the_out_of_place_algorithm_bandwidth():
    """One rank: busbw is 0 by definition and in-place moves nothing; the plot shows what the
    out-of-place call copies per second."""
    pytest.importorskip("matplotlib")
    sizes = (8, 1 << 10, 1 << 20)
    rows = [_row(size=size, backend="nccl", out={"time_us": 10.0, "algbw": size / 1e4,
                                                 "busbw": 0.0, "wrong": 0},
                 **{"in": {"time_us": 5.0, "algbw": size / 5e3, "busbw": 0.0, "wrong": 0}})
            for size in sizes]
    for nranks, ys, ylabel in ((1, [size / 1e4 for size in sizes], "algorithm bandwidth"),
                               (2, [0.0] * 3, "bus bandwidth")):
        info = {"nranks": nranks, "backend": "nccl", "labels": [None], "machine": {"host": "h"}}
        figure = perf.make_figure(rows, None, info)
        try:
            axes = figure.axes[0]
            (line,) = axes.get_lines()
            assert list(line.get_ydata()) == ys
            assert axes.get_ylabel().startswith(ylabel)
            assert ("out-of-place" if nranks == 1 else "in-place") in line.get_label()
        finally:
            import matplotlib.pyplot as plt

            plt.close(figure)


def test_bfloat16_avg_divides_instead_of_truncating():
    from gpucoll.types import finish_avg

    total = np.array([3, -3, 5, 0], BF16)
    finish_avg(total, 2)  # bfloat16's NumPy kind is "V": it must not take the integer path
    np.testing.assert_array_equal(total.astype(np.float64), [1.5, -1.5, 2.5, 0])
