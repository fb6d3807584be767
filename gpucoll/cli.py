"""The ``gpucoll`` command line (``python -m gpucoll`` runs the same).

Subcommands:
    run: start N ranks of a Python program on this node; see :mod:`gpucoll.launch`.

Example::

    gpucoll run -n 4 train.py --epochs 3
    gpucoll run -n 2 -m mypackage.worker --size 1024
    GPUCOLL_AUTH_TOKEN=... gpucoll run -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, Tuple

from . import __version__

__all__ = ["main", "build_parser"]

_RUN_USAGE = "gpucoll run [options] (script.py | -m module) [args ...]"

# Launcher options that take a value; everything from the first other word on is the program.
_RUN_VALUE_OPTIONS = frozenset({
    "-n", "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
    "--timeout",
})


def build_parser() -> Tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the ``run`` subparser."""
    parser = argparse.ArgumentParser(
        prog="gpucoll", description="GPU-native collectives for Python: launcher and tools.",
        allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"gpucoll {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command")

    run = commands.add_parser(
        "run", usage=_RUN_USAGE, allow_abbrev=False,
        help="start N ranks of a Python program on this node",
        description="Start N ranks of a Python program on this node with RANK, WORLD_SIZE, "
                    "LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and "
                    "GPUCOLL_AUTH_TOKEN set; node 0 serves the rendezvous store. Every output line "
                    "is prefixed with [rank R]. The first rank to fail stops all the others and "
                    "its exit code becomes gpucoll's.",
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
    run.add_argument("-m", dest="module", default=None, metavar="MODULE",
                     help="run a module, as python -m MODULE does, instead of a script")
    run.add_argument("program", nargs="?", metavar="script.py", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")
    return parser, run


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
        nnodes=namespace.nnodes, node_rank=namespace.node_rank, master_addr=namespace.master_addr,
        master_port=namespace.master_port, timeout=namespace.timeout)
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
        The exit code: the job's for ``run``; 2 for a usage error; 0 after ``--help``.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    parser, run_parser = build_parser()
    try:
        if words and words[0] == "run":
            return _cmd_run(run_parser, words[1:])
        namespace = parser.parse_args(words)
        if namespace.command is None:
            parser.print_help(sys.stderr)
            return 2
        parser.error(f"unknown command {namespace.command!r}")
    except SystemExit as exc:  # argparse's --help, --version and usage errors
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 2
    return 2
