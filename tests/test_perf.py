"""``gpucoll bench``: bus-bandwidth factors, inputs and checker, and real sweeps through the CLI."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpucoll import ReduceOp, perf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_KEYS = {"collective", "size", "count", "type", "redop", "root", "out", "in", "gloo", "ratio",
            "backend", "nranks"}
ENTRY_KEYS = {"time_us", "algbw", "busbw", "wrong"}


def _cli(*args, timeout=90, cwd=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "gpucoll", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd or ROOT)


# ---------------------------------------------------------------- factors and sizes
@pytest.mark.parametrize("name, nranks, factor", [
    ("all_reduce", 1, 0.0), ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 3, 4 / 3),
    ("all_gather", 4, 0.75), ("reduce_scatter", 2, 0.5), ("all_to_all", 3, 2 / 3),
    ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("sendrecv", 2, 1.0), ("halo", 3, 1.0)])
def test_bus_factor_matches_nccl_tests(name, nranks, factor):
    assert perf.COLLECTIVES[name].bus_factor(nranks) == pytest.approx(factor)


def test_blocked_collectives_report_total_bytes_and_block_count():
    gather, reduce = perf.COLLECTIVES["all_gather"], perf.COLLECTIVES["all_reduce"]
    # 1 MiB of float32 over 4 ranks: a block of 65536 elements, 1 MiB in the size column
    assert gather.count_for(1 << 20, 4, 4) == 65536
    assert gather.size_of(65536, 4, 4) == 1 << 20
    # 100 bytes over 3 ranks: 8 whole elements per block, 96 bytes in all
    assert gather.count_for(100, 4, 3) == 8 and gather.size_of(8, 4, 3) == 96
    assert reduce.count_for(100, 4, 3) == 25 and reduce.size_of(25, 4, 3) == 100


def test_bandwidth_from_time():
    entry = perf._bandwidths({"time_us": 1000.0, "wrong": 0}, 10**6, 1.5)
    assert entry["algbw"] == pytest.approx(1.0) and entry["busbw"] == pytest.approx(1.5)


@pytest.mark.parametrize("text, value", [("8", 8), ("1K", 1024), ("64M", 64 << 20), ("1g", 1 << 30),
                                         ("4KB", 4096), ("2MiB", 2 << 20), ("1.5M", 3 << 19),
                                         ("1T", 1 << 40), ("256KiB", 256 << 10)])
def test_parse_size(text, value):
    assert perf.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "1X", "-8", "1.3", "M"])
def test_parse_size_rejects(text):
    with pytest.raises(perf.UsageError, match="bad size"):
        perf.parse_size(text)


def test_size_sweep():
    assert perf.size_sweep(8, 64 << 20, 4)[:3] == [8, 32, 128]
    assert perf.size_sweep(8, 64 << 20, 4)[-1] == 32 << 20
    assert perf.size_sweep(1024, 4096, step=1024) == [1024, 2048, 3072, 4096]
    assert perf.size_sweep(0, 16, 2) == [0, 1, 2, 4, 8, 16]
    with pytest.raises(perf.UsageError):
        perf.size_sweep(64, 8)


# ---------------------------------------------------------------- inputs and checker
def test_pattern_depends_on_seed_rank_and_index_only():
    whole = perf.pattern(3, 1, 100, np.float32, ReduceOp.SUM)
    part = perf.pattern(3, 1, 10, np.float32, ReduceOp.SUM, offset=40)
    np.testing.assert_array_equal(whole[40:50], part)
    assert not np.array_equal(whole, perf.pattern(3, 2, 100, np.float32, ReduceOp.SUM))
    assert not np.array_equal(whole, perf.pattern(4, 1, 100, np.float32, ReduceOp.SUM))


def test_expected_reduction_hand_computed():
    # element i of rank r is ((7 i + 13 r) % 17) - 8 at seed 0
    np.testing.assert_array_equal(perf.pattern(0, 0, 3, np.float32, ReduceOp.SUM), [-8, -1, 6])
    np.testing.assert_array_equal(perf.pattern(0, 1, 3, np.float32, ReduceOp.SUM), [5, -5, 2])
    np.testing.assert_array_equal(
        perf.expected_reduction(ReduceOp.SUM, 0, 2, 3, np.float32), [-3, -6, 8])
    np.testing.assert_array_equal(
        perf.expected_reduction(ReduceOp.MAX, 0, 2, 3, np.int32), [5, -1, 6])
    # integer avg truncates toward zero: -3/2 -> -1, -6/2 -> -3, 8/2 -> 4
    np.testing.assert_array_equal(
        perf.expected_reduction(ReduceOp.AVG, 0, 2, 3, np.int32), [-1, -3, 4])
    # prod maps (7 i + 13 r) % 17 % 3 to {-1, 1, 2}: rank 0 [0, 7, 14] -> [-1, 1, 2],
    # rank 1 [13, 3, 10] -> [1, -1, 1]
    np.testing.assert_array_equal(
        perf.expected_reduction(ReduceOp.PROD, 0, 2, 3, np.float64), [-1, -1, 2])
    # unsigned sums use 0..16 (no negative values)
    np.testing.assert_array_equal(
        perf.expected_reduction(ReduceOp.SUM, 0, 2, 3, np.uint8), [13, 10, 24])


def test_count_wrong_finds_each_corrupted_element():
    expected = perf.expected_reduction(ReduceOp.SUM, 5, 3, 1000, np.float32)
    got = expected.copy()
    assert perf.count_wrong(got, expected, 3) == 0
    got[[0, 17, 999]] += 1
    assert perf.count_wrong(got, expected, 3) == 3
    got[500] = np.nan
    assert perf.count_wrong(got, expected, 3) == 4
    ints = perf.expected_reduction(ReduceOp.SUM, 5, 3, 10, np.int64)
    bad = ints.copy()
    bad[2] -= 1
    assert perf.count_wrong(ints, ints) == 0 and perf.count_wrong(bad, ints) == 1
    assert perf.count_wrong(expected[:5], expected) == 1000  # wrong shape: all wrong


def test_count_wrong_tolerates_rounding_of_avg():
    expected = np.array([1 / 3, 2 / 3, 100.0], np.float32)
    rounded = np.nextafter(expected, np.float32(np.inf))  # one ulp off
    assert perf.count_wrong(rounded, expected, 3) == 0
    assert perf.count_wrong(expected * np.float32(1.001), expected, 3) == 3


def _check(name, result_of, nranks=3, count=5, op=ReduceOp.SUM, root=0):
    """Fill a rank's buffers with the right answer, then corrupt it: wrong() must see it."""
    coll, host = perf.COLLECTIVES[name], perf._Host()
    for rank in range(nranks):
        bufs = coll.buffers(host, count, np.dtype(np.float32), nranks)
        np.copyto(bufs.recv, result_of(rank).reshape(bufs.recv.shape))
        assert coll.wrong(host, bufs, coll.modes[0], 9, rank, nranks, op, root) == 0
        bufs.recv.reshape(-1)[-1] += 2
        expect = 0 if name == "reduce" and rank != root else 1
        assert coll.wrong(host, bufs, coll.modes[0], 9, rank, nranks, op, root) == expect


def test_checkers_of_every_collective():
    n, c = 3, 5
    gen = lambda rank, count, offset=0: perf.pattern(9, rank, count, np.float32, None, offset)  # noqa: E731
    red = lambda count, offset=0: perf.expected_reduction(ReduceOp.SUM, 9, n, count, np.float32, offset)  # noqa: E731
    _check("all_reduce", lambda r: red(c))
    _check("reduce", lambda r: red(c))
    _check("broadcast", lambda r: gen(0, c))
    _check("all_gather", lambda r: np.concatenate([gen(j, c) for j in range(n)]))
    _check("reduce_scatter", lambda r: red(c, r * c))
    _check("all_to_all", lambda r: np.concatenate([gen(j, c, r * c) for j in range(n)]))
    _check("sendrecv", lambda r: gen((r - 1) % n, c))
    # halo, 5 elements: [0, 2) from the right neighbour's [0, 2), [2, 5) from the left's [2, 5)
    _check("halo", lambda r: np.concatenate([gen((r + 1) % n, 2), gen((r - 1) % n, 3, 2)]))


def test_checker_hand_computed_all_to_all_layout():
    # rank 1 of 2, blocks of 2: block j of the result is elements [2, 4) of rank j's input
    coll, host = perf.COLLECTIVES["all_to_all"], perf._Host()
    bufs = coll.buffers(host, 2, np.dtype(np.float32), 2)
    rank0 = perf.pattern(0, 0, 4, np.float32)  # [-8, -1, 6, -4]
    rank1 = perf.pattern(0, 1, 4, np.float32)  # [5, -5, 2, -8]
    bufs.recv[:] = [rank0[2:], rank1[2:]]
    np.testing.assert_array_equal(bufs.recv.reshape(-1), [6, -4, 2, -8])
    assert coll.wrong(host, bufs, "out", 0, 1, 2, None, -1) == 0
    bufs.recv[0, 0] = -8
    assert coll.wrong(host, bufs, "out", 0, 1, 2, None, -1) == 1


def test_table_line_layout():
    entry = {"time_us": 12.5, "algbw": 1.25, "busbw": 2.5, "wrong": 0}
    row = {"size": 1024, "count": 256, "type": "float", "redop": "sum", "root": -1,
           "out": entry, "in": None, "gloo": dict(entry, busbw=1.25), "ratio": 2.0}
    line = perf.row_cells(row, None)
    assert line.split()[:9] == ["1024", "256", "float", "sum", "-1", "12.50", "1.25", "2.50", "0"]
    assert line.split()[9:] == ["N/A"] * 4
    assert perf.row_cells(row, "gloo").split()[-1] == "2.00"
    header = perf.table_header(None)
    assert "out-of-place" in header[0] and "in-place" in header[0] and "#wrong" in header[1]


# ---------------------------------------------------------------- real sweeps (CPU backend)
def _assert_document(doc, nranks, collectives):
    assert doc["nranks"] == nranks and doc["backend"] == "cpu" and doc["wrong"] == 0
    assert {"gpucoll_version", "settings", "bus_factors", "rows", "summary"} <= set(doc)
    assert [r["collective"] for r in doc["rows"]] == [c for c in collectives for _ in range(3)]
    for row in doc["rows"]:
        assert ROW_KEYS <= set(row)
        coll = perf.COLLECTIVES[row["collective"]]
        for mode in ("out", "in"):
            if mode in coll.modes:
                assert set(row[mode]) == ENTRY_KEYS and row[mode]["wrong"] == 0
                assert row[mode]["busbw"] == pytest.approx(
                    row[mode]["algbw"] * coll.bus_factor(nranks))
            else:
                assert row[mode] is None


def test_sweep_all_collectives_three_ranks(tmp_path):
    out = tmp_path / "bench.json"
    proc = _cli("bench", "all", "-g", "3", "-b", "8", "-e", "4K", "-f", "16", "-n", "2", "-w", "1",
                "-r", "2", "-T", "30", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    _assert_document(doc, 3, list(perf.COLLECTIVES))
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert "# Avg bus bandwidth" in proc.stdout
    broadcast = [r for r in doc["rows"] if r["collective"] == "broadcast"]
    assert {r["root"] for r in broadcast} == {2}
    gathers = [r for r in doc["rows"] if r["collective"] == "all_gather"]
    assert [r["size"] for r in gathers] == [0, 120, 2040]  # 8, 128, 2048 B in whole blocks of 3


def test_sweep_two_ranks_writes_csv(tmp_path):
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    proc = _cli("bench", "all_reduce", "-g", "2", "-b", "8", "-e", "64K", "-f", "64", "-n", "2",
                "-w", "1", "-d", "int32,half", "-o", "max", "--json", str(out), "--csv", str(table))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [r["type"] for r in doc["rows"]] == ["int32"] * 3 + ["half"] * 3
    with open(table) as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 6 and rows[0]["collective"] == "all_reduce" and rows[0]["redop"] == "max"
    assert rows[0]["out_wrong"] == "0" and rows[0]["gloo_busbw"] == "" and float(rows[-1]["in_busbw"]) >= 0


def test_sweep_inside_gpucoll_run(tmp_path):
    out = tmp_path / "bench.json"
    proc = _cli("run", "-n", "2", "-m", "gpucoll", "bench", "reduce_scatter", "-b", "1K", "-e", "4K",
                "-f", "4", "-n", "2", "-w", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "[rank 0] # Out of bounds values : 0 OK" in proc.stdout
    assert "[rank 1] #" not in proc.stdout  # only rank 0 prints the table
    doc = json.loads(out.read_text())
    assert doc["nranks"] == 2 and doc["wrong"] == 0 and len(doc["rows"]) == 2


def test_rank_failure_is_reported(tmp_path):
    # the backend name is checked inside the ranks: the error comes back with its traceback
    proc = _cli("bench", "-g", "2", "-b", "8", "-e", "8", "--backend", "nccl", "-T", "20")
    assert proc.returncode == 1
    assert "rank 0 failed" in proc.stderr or "rank 1 failed" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["bogus"], "invalid choice"),
    (["-b", "1X"], "bad size"),
    (["-b", "64M", "-e", "8"], "bad size range"),
    (["-o", "band", "-d", "float"], "band"),
    (["-d", "bfloat8"], "unknown data type"),
    (["-o", "mean"], "unknown reduction op"),
    (["-n", "0"], "-n must be"),
    (["-g", "2", "-r", "2"], "out of range"),
    (["sendrecv", "-g", "1"], "at least 2 ranks"),
    (["halo", "-g", "1"], "halo needs at least 2 ranks"),
    (["-f", "4", "-i", "1K"], "not both"),
    (["-c", "2"], "invalid choice"),
    (["--compare", "nccl"], "invalid choice"),
])
def test_usage_errors_exit_2(args, message):
    proc = _cli("bench", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr


def test_compare_gloo_without_torch_exits_2():
    try:
        import torch  # noqa: F401
        pytest.skip("torch is importable here")
    except ImportError:
        pass
    proc = _cli("bench", "-g", "2", "--compare", "gloo")
    assert proc.returncode == 2 and "needs PyTorch" in proc.stderr


@pytest.mark.parametrize("collective, ranks", [("all_reduce", "2"), ("halo", "3")])
def test_compare_gloo_adds_ratio(tmp_path, collective, ranks):
    """torch's result is checked like gpucoll's (halo: its own batch_isend_irecv)."""
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    proc = _cli("bench", collective, "-g", ranks, "-b", "1K", "-e", "4K", "-f", "4", "-n", "2",
                "-w", "1", "--compare", "gloo", "--json", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert all(r["gloo"]["wrong"] == 0 and r["ratio"] > 0 for r in doc["rows"])


def test_plot_without_matplotlib_exits_2(tmp_path):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is importable here")
    except ImportError:
        pass
    proc = _cli("bench", "-g", "2", "--plot", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "needs matplotlib" in proc.stderr


@pytest.mark.gpu
def test_cuda_buffers_round_trip():
    dev = perf._Cuda()
    buf = dev.empty(7, np.float32)
    host = perf.pattern(1, 2, 7, np.float32)
    dev.put(buf, host)
    dev.sync()
    np.testing.assert_array_equal(dev.get(buf), host)
