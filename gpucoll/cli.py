"""The ``gpucoll`` command line (``python -m gpucoll`` runs the same).

Subcommands:
    run: start N ranks of a Python program on this node; see :mod:`gpucoll.launch`.
    bench: nccl-tests-style bandwidth sweep of one or all collectives; see :mod:`gpucoll.perf`.
    topo: GPUs, links and measured copy bandwidths (or the host's, without a GPU); see
        :mod:`gpucoll.topo`.
    doctor: environment report for the NCCL backend (CuPy, CUDA, NCCL wheels, GPUs, which
        backend ``auto`` picks); see :mod:`gpucoll.doctor`.
    trace: which rank is behind, from the flight recorder's dumps of all ranks (and a Chrome
        trace-event timeline of them); see :mod:`gpucoll.trace_report`.

Example::

    gpucoll run -n 4 train.py --epochs 3
    gpucoll run -n 2 -m mypackage.worker --size 1024
    GPUCOLL_AUTH_TOKEN=... gpucoll run -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
    gpucoll bench all_reduce -g 4 -b 8 -e 64M -f 4 --json ar.json
    gpucoll topo --json topo.json
    gpucoll doctor --strict
    gpucoll trace traces/ --chrome timeline.json
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, Tuple

from . import __version__

__all__ = ["main", "build_parser"]

_RUN_USAGE = "gpucoll run [options] (script.py | -m module | program) [args ...]"

# Launcher options that take a value; everything from the first other word on is the program.
_RUN_VALUE_OPTIONS = frozenset({
    "-n", "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
    "--timeout", "--min-ranks", "--replace",
})


def build_parser() -> Tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the ``run`` subparser (``bench``, ``topo``, ``doctor`` and
    ``trace`` are added too)."""
    parser = argparse.ArgumentParser(
        prog="gpucoll", description="GPU-native collectives for Python: launcher and tools.",
        allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"gpucoll {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command")

    run = commands.add_parser(
        "run", usage=_RUN_USAGE, allow_abbrev=False,
        help="start N ranks of a program on this node",
        description="Start N ranks of a Python script, module or any executable on this node "
                    "with RANK, WORLD_SIZE, "
                    "LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and "
                    "GPUCOLL_AUTH_TOKEN set; node 0 serves the rendezvous store. Every output line "
                    "is prefixed with [rank R]. The first rank to fail stops all the others and "
                    "its exit code becomes gpucoll's (with --elastic the others go on).",
        epilog="Everything after the script or module goes to the program untouched. With "
               "several nodes, run the same command on each (changing --node-rank) after "
               "exporting the same GPUCOLL_AUTH_TOKEN on all of them.")
    run.add_argument("-n", "--nproc-per-node", dest="nproc", type=int, default=1,
                     metavar="N", help="ranks to start on this node (default: 1)")
    run.add_argument("--nnodes", type=int, default=1, metavar="M",
                     help="nodes in the job, each running gpucoll run (default: 1)")
    run.add_argument("--node-rank", dest="node_rank", type=int, default=0, metavar="K",
                     help="this node's index in [0, M-1]; node 0 serves the store (default: 0)")
    run.add_argument("--master-addr", dest="master_addr", default=None, metavar="ADDR",
                     help="address of node 0 (default with one node: 127.0.0.1; needed with several)")
    run.add_argument("--master-port", dest="master_port", type=int, default=None,
                     metavar="PORT",
                     help="port of the store (default: a free port with one node, 29500 with several)")
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="stop every rank and exit 124 when the job runs longer than this")
    run.add_argument("--elastic", action="store_true",
                     help="a rank that dies does not stop the others; the job succeeds when the "
                          "survivors exit 0 (they continue with comm.shrink())")
    run.add_argument("--min-ranks", dest="min_ranks", type=int, default=1, metavar="N",
                     help="with --elastic: stop the job when fewer than N ranks of this node "
                          "remain (default: 1)")
    run.add_argument("--replace", type=int, default=0, metavar="N",
                     help="with --elastic: start a new process in a lost rank's place, at most N "
                          "times on this node; it joins when the survivors call comm.grow() "
                          "(default: 0)")
    run.add_argument("-m", dest="module", default=None, metavar="MODULE",
                     help="run a module, as python -m MODULE does, instead of a script")
    run.add_argument("--no-python", dest="no_python", action="store_true",
                     help="run the program as an executable even when it is a Python script "
                          "(without this, Python scripts run with this interpreter and any "
                          "other executable, e.g. python3 -u x.py or a shell script, as it is)")
    run.add_argument("program", nargs="?", metavar="script.py", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")
    _add_bench_parser(commands)
    _add_topo_parser(commands)
    _add_doctor_parser(commands)
    _add_trace_parser(commands)
    return parser, run


_BENCH_CHOICES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                  "all_to_all", "sendrecv", "halo", "all")


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", allow_abbrev=False, help="nccl-tests-style bandwidth sweep of the collectives",
        description="Time a collective over a range of sizes, check every result, and print "
                    "nccl-tests' table: size, count, type, redop, root, then time, algbw, busbw "
                    "and #wrong for out-of-place and in-place. Starts -g ranks itself, or runs "
                    "as one rank when started by gpucoll run, torchrun, mpiexec or srun.",
        epilog="busbw = algbw x factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, "
               "all_to_all (n-1)/n; broadcast, reduce, sendrecv, halo 1. Exit status: 0 when every "
               "result was right, 1 when some were wrong or a rank failed, 2 for usage errors.")
    add = bench.add_argument
    add("collective", nargs="?", default="all_reduce", choices=_BENCH_CHOICES,
        help="what to measure (default: all_reduce)")
    add("-g", "--nprocs", dest="nprocs", type=int, default=None, metavar="NRANKS",
        help="ranks to start (default: 1; under a launcher: its world size)")
    add("-b", "--minbytes", default="32M", metavar="SIZE", help="smallest size (default: 32M)")
    add("-e", "--maxbytes", default="32M", metavar="SIZE", help="largest size (default: 32M)")
    add("-f", "--stepfactor", type=int, default=None, metavar="F",
        help="multiply the size by F each step (default: 2)")
    add("-i", "--stepbytes", default=None, metavar="SIZE",
        help="add SIZE bytes each step instead of multiplying")
    add("-n", "--iters", type=int, default=20, metavar="N", help="timed iterations (default: 20)")
    add("-w", "--warmup_iters", dest="warmup", type=int, default=5, metavar="N",
        help="untimed warm-up iterations (default: 5)")
    add("-c", "--check", type=int, default=1, choices=(0, 1), metavar="0|1",
        help="check every result (default: 1)")
    add("-d", "--datatype", dest="dtype", default="float", metavar="TYPE",
        help="int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16 (or "
             "NumPy names), a comma-separated list, or all (default: float)")
    add("-o", "--op", default="sum", metavar="OP",
        help="sum, prod, min, max, avg, band, bor, bxor, a list, or all (default: sum)")
    add("-r", "--root", type=int, default=0, metavar="RANK",
        help="root of broadcast and reduce (default: 0)")
    add("-T", "--timeout", type=float, default=300.0, metavar="SECONDS",
        help="limit of every blocking call; a stuck rank fails the run (default: 300)")
    from .backends.registry import backend_names

    add("--backend", default=None, choices=("auto", *backend_names()),
        help="gpucoll backend, auto or a registered one (default: GPUCOLL_BACKEND, i.e. auto)")
    add("--compare", default=None, choices=("gloo", "mpi"),
        help="also time torch.distributed's Gloo backend, or mpi4py's MPI (the bench re-runs "
             "itself under mpirun), in the same ranks; adds a ratio column")
    add("-a", "--average", type=int, default=1, choices=(0, 1, 2, 3), metavar="0|1|2|3",
        help="time of a size over the ranks: 0 rank 0, 1 mean, 2 fastest, 3 slowest (default: 1)")
    add("--rounds", type=int, default=1, metavar="N",
        help="split the timed iterations into N rounds, variants taking turns; show the best")
    add("--iter-bytes", default=None, metavar="SIZE",
        help="time SIZE / size iterations per size, at least --min-iters and at most -n")
    add("--min-iters", type=int, default=1, metavar="N", help="see --iter-bytes (default: 1)")
    add("--transport", default=None, metavar="LIST",
        help="measure one cpu-backend communicator per GPUCOLL_TRANSPORT value, e.g. unix,tcp")
    add("--modes", default="all", choices=("all", "matched"),
        help="matched: only the mode torch.distributed's call has (default: all)")
    add("--ceiling", default=None, metavar="SIZE",
        help="first measure the raw two-way socket rate of each transport with SIZE bytes")
    add("--table", default="nccl-tests", choices=("nccl-tests", "side-by-side"),
        help="table layout (default: nccl-tests)")
    add("--json", default=None, metavar="FILE",
        help="write every row, the summary and the machine as JSON (-: to stdout)")
    add("--csv", default=None, metavar="FILE", help="write every row as CSV")
    add("--plot", default=None, metavar="FILE.png",
        help="plot busbw against size (needs matplotlib: pip install 'gpucoll[plot]')")
    add("--from-json", default=None, metavar="FILE",
        help="measure nothing: write --plot / --csv from a saved --json document")
    bench.set_defaults(handler=_cmd_bench, subparser=bench)


def _add_topo_parser(commands) -> None:
    topo = commands.add_parser(
        "topo", allow_abbrev=False, help="GPUs, links and measured copy bandwidths",
        description="List the GPUs with PCI bus id, NUMA node, NVLink and PCIe links and the "
                    "peer-access matrix, and measure GPU-to-GPU, host-device and device memory "
                    "copy bandwidth. Without a GPU it says so and measures the host: memory copy, "
                    "loopback TCP and Unix-socket bandwidth and latency.")
    topo.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    topo.add_argument("--plot", default=None, metavar="FILE.png",
                      help="heat map of the GPU bandwidth matrix (bar chart of the host figures "
                           "without a GPU); needs matplotlib")
    topo.add_argument("--size", default="64M", metavar="SIZE",
                      help="bytes per bandwidth measurement (default: 64M)")
    topo.add_argument("--quick", action="store_true",
                      help="fewer repetitions and smaller sizes (for smoke tests)")
    topo.set_defaults(handler=_cmd_topo, subparser=topo)


def _add_doctor_parser(commands) -> None:
    from . import doctor

    parser = commands.add_parser(
        "doctor", allow_abbrev=False, help="environment report for the NCCL backend",
        description="Report gpucoll, Python, CuPy, CUDA runtime and driver, and NCCL versions; "
                    "which libnccl.so.2 was loaded (pip wheel or system); the GPUs and their "
                    "peer access; and which backend 'auto' picks. Warns about clashing CuPy or "
                    "NCCL wheels and prints the pip commands that fix them.",
        epilog="Exit status: 0 when the report was produced (also without a GPU); with "
               "--strict, 1 when there is a warning.")
    doctor.add_arguments(parser)
    parser.set_defaults(handler=_cmd_doctor, subparser=parser)


def _add_trace_parser(commands) -> None:
    from . import trace_report

    parser = commands.add_parser(
        "trace", allow_abbrev=False, help="which rank is behind, from the flight recorder's dumps",
        description="Read every flight-recorder dump (trace-rank*.json, written where "
                    "GPUCOLL_TRACE_DIR pointed) in DIR and below it, group them by communicator, "
                    "and print each rank's last finished call and its calls pending or failed, "
                    "then one line per finding: a rank behind (never issued the call the others "
                    "waited in, or issued it after another timed out in it), a mismatch (different "
                    "collectives at one number), a rank with no dump, the rank that failed first.",
        epilog="Exit status: 0 when nothing was found, 1 when there is a finding, 2 on bad input "
               "(no dumps, a file that is not a readable dump).")
    trace_report.add_arguments(parser)
    parser.set_defaults(handler=_cmd_trace, subparser=parser)


def _cmd_trace(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> int:
    from . import trace_report

    return trace_report.run(namespace.directory, as_json=namespace.json, chrome=namespace.chrome)


def _cmd_doctor(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> int:
    from . import doctor

    return doctor.main((["--json"] if namespace.json else [])
                       + (["--strict"] if namespace.strict else []))


def _cmd_bench(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> int:
    from . import perf

    try:
        if namespace.from_json:
            return perf.from_document(namespace.from_json, namespace.csv, namespace.plot)
        names = (list(perf.COLLECTIVES) if namespace.collective == "all"
                 else [namespace.collective])
        step = perf.parse_size(namespace.stepbytes) if namespace.stepbytes else 0
        if step and namespace.stepfactor is not None:
            raise perf.UsageError("give -f (multiply) or -i (add), not both")
        opts = perf.BenchOptions(
            collectives=names, nranks=namespace.nprocs,
            min_bytes=perf.parse_size(namespace.minbytes),
            max_bytes=perf.parse_size(namespace.maxbytes),
            factor=2 if namespace.stepfactor is None else namespace.stepfactor, step_bytes=step,
            iters=namespace.iters, warmup=namespace.warmup, check=bool(namespace.check),
            dtypes=perf.parse_dtypes(namespace.dtype), ops=perf.parse_ops(namespace.op),
            root=namespace.root, timeout=namespace.timeout, backend=namespace.backend,
            compare=namespace.compare, average=namespace.average, rounds=namespace.rounds,
            iter_bytes=perf.parse_size(namespace.iter_bytes) if namespace.iter_bytes else 0,
            min_iters=namespace.min_iters, modes=namespace.modes, table=namespace.table,
            transports=perf.parse_transports(namespace.transport) if namespace.transport else (),
            ceiling_bytes=perf.parse_size(namespace.ceiling) if namespace.ceiling else 0)
        if namespace.nprocs is not None and not 0 <= namespace.root < namespace.nprocs:
            raise perf.UsageError(f"-r {namespace.root} is out of range for -g {namespace.nprocs}")
        if opts.compare == "mpi":
            from .api import detect_environment
            from .perf import mpi

            from .perf.ranks import check_options

            check_options(opts, namespace.plot)
            if detect_environment().source == "none":
                return mpi.relaunch_under_mpirun(namespace.words[1:], namespace.nprocs or 1)
        return perf.run_bench(opts, namespace.json, namespace.csv, namespace.plot)
    except perf.UsageError as exc:
        parser.error(str(exc))
    except RuntimeError as exc:  # a rank failed; its traceback is in the message
        print(f"gpucoll bench: {exc}", file=sys.stderr)
        return 1
    return 2  # not reached: error() exits


def _cmd_topo(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> int:
    from . import topo

    try:
        return topo.main(json_path=namespace.json, plot_path=namespace.plot,
                         size=topo.parse_size(namespace.size), quick=namespace.quick)
    except topo.UsageError as exc:
        parser.error(str(exc))
    return 2  # not reached: error() exits


def _split_run_argv(argv: Sequence[str]) -> Tuple[List[str], Optional[str], bool, List[str]]:
    """Split ``run``'s words into (launcher options, program, is_module, program args).

    The program starts at the first word that is neither a launcher option nor an option's
    value; ``-m MODULE`` and ``--`` also end the launcher's options.
    """
    words = list(argv)
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--":
            rest = words[index + 1:]
            if rest[:1] == ["-m"]:
                return words[:index], (rest[1] if len(rest) > 1 else None), True, rest[2:]
            return words[:index], (rest[0] if rest else None), False, rest[1:]
        if word == "-m":
            module = words[index + 1] if index + 1 < len(words) else None
            return words[:index], module, True, words[index + 2:]
        if word.startswith("-m") and not word.startswith("--"):
            return words[:index], word[2:], True, words[index + 1:]
        if word.startswith("-") and word != "-":
            index += 2 if word in _RUN_VALUE_OPTIONS else 1
            continue
        return words[:index], word, False, words[index + 1:]
    return words, None, False, []


def _cmd_run(run_parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    from .launch import LaunchConfig, UsageError, run_job

    options, program, is_module, program_args = _split_run_argv(argv)
    namespace = run_parser.parse_args(options)
    if program is None:
        run_parser.error("-m needs a module name" if is_module else
                         "missing the program to run: give script.py or -m module")
    cfg = LaunchConfig(
        program=program, args=tuple(program_args), nproc=namespace.nproc, module=is_module,
        no_python=namespace.no_python,
        nnodes=namespace.nnodes, node_rank=namespace.node_rank, master_addr=namespace.master_addr,
        master_port=namespace.master_port, timeout=namespace.timeout,
        elastic=namespace.elastic, min_ranks=namespace.min_ranks, replace=namespace.replace)
    try:
        return run_job(cfg)
    except UsageError as exc:
        run_parser.error(str(exc))
        return 2  # not reached: error() exits


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``gpucoll`` command line.

    Args:
        argv: the words after the program name (None: ``sys.argv[1:]``).

    Returns:
        The exit code: the job's for ``run``; for ``bench`` 0 when every result was right and
        1 otherwise; 0 for ``topo``; 0 for ``doctor`` (1 for warnings under ``--strict``);
        for ``trace`` 0 when nothing was found, 1 for findings, 2 for bad dumps; 2 for a usage
        error; 0 after ``--help``.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    parser, run_parser = build_parser()
    try:
        if words and words[0] == "run":
            return _cmd_run(run_parser, words[1:])
        namespace = parser.parse_args(words)
        namespace.words = words
        if namespace.command is None:
            parser.print_help(sys.stderr)
            return 2
        if namespace.command in ("bench", "topo", "doctor", "trace"):
            return namespace.handler(namespace.subparser, namespace)
        parser.error(f"unknown command {namespace.command!r}")
    except SystemExit as exc:  # argparse's --help, --version and usage errors
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 2
    return 2
