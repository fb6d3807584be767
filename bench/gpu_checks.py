"""Every GPU check of gpucoll in one go, each step under a hard time limit, logs kept.

The GPU half of gpucoll (the NCCL backend, the bucketing kernels, ``gpucoll topo``'s GPU
figures, the GPU benchmarks) can only be judged on a machine with a GPU, and such time is
often short. This script runs the whole list in a few calls, never hangs, and leaves one log
per step plus ``summary.md`` / ``summary.json`` in ``--out``, so a cut-short run says exactly
what ran, what failed (with the tail of its output) and what is left.

Phases (``--phase``, comma-separated; default all, in this order):

- ``env``: ``nvidia-smi``, the versions (Python, NumPy, CuPy, CUDA runtime and driver, NCCL,
  torch, mpi4py, ml_dtypes) and ``gpucoll doctor``.
- ``tests``: ``pytest tests -m gpu -x``; only when that fails, again without ``-x`` to list
  every failure.
- ``ranks``: two ranks on the one GPU, through NCCL (``NCCL_MULTI_RANK_GPU_ENABLE=1``,
  ``NCCL_MAX_CTAS`` capped) and through the CPU backend with CuPy arrays (staged through host
  memory): the all-reduce example and the digits training example.
- ``bench``: ``bench_nccl.py`` (gpucoll against direct ``cupy.cuda.nccl`` calls, 1 rank and 2
  ranks), ``bench_bucket.py`` (fused pack / unpack against a device-to-device copy and a
  per-array loop), ``bench_ddp_graph.py`` (a DDP step eager against captured into a CUDA
  graph, 1 rank and 2 ranks) and ``gpucoll topo``.
- ``sweep``: ``gpucoll bench all_reduce -g 1 -b 8 -e 1G -f 4`` and ``-g 2`` (to 256 MiB: two
  processes time-slice the one GPU, milliseconds per call), as JSON (plot it anywhere with
  ``gpucoll bench --from-json FILE --plot FILE.png``).

``--only`` and ``--skip`` take comma-separated step names (``--list`` shows them), to run some
steps alone or all but some: a check whose needs change between runs (NCCL >= 2.30 for two
ranks on one GPU) can run where they are met.

``--budget SECONDS`` keeps the whole run inside a caller's hard wall-clock limit: a step's limit
is cut to what is left of the budget, and no step starts with less than ``MIN_START`` seconds
left, so the summary is always written. ``--workers N`` runs the GPU tests in N pytest-xdist
processes (the GPU has room; most of a test's time is process start-up and kernel compiles).
A step that exits 0 without writing its JSON (a benchmark that found no GPU says so and exits
0) counts as failed. The re-run of the GPU tests leaves out the tests the first run passed.
The training steps need scikit-learn's digits: without scikit-learn and without ``--digits``
they are not run (and say so) rather than failing.
Without a GPU it says so and exits 3 (``--list`` shows the steps anywhere; ``--force`` runs them
anyway, to try their command lines).

    python bench/gpu_checks.py --out logs --phase env,tests --budget 560
    python bench/gpu_checks.py --only bench-nccl-1-rank,bench-bucket,topo
    python bench/gpu_checks.py --list

Exit status: 0 every step run passed, 1 some failed or timed out, 2 usage, 3 no GPU here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
PHASES = ("env", "tests", "ranks", "bench", "sweep")
TWO_RANKS_ON_ONE_GPU = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "4",
                        "GPUCOLL_TIMEOUT": "120"}
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL of a step that ran out of time
MIN_START = 20.0  # seconds of budget a step needs to be started at all

VERSIONS = r"""
import platform, numpy
print("python", platform.python_version(), "numpy", numpy.__version__)
import cupy
from cupy.cuda import runtime
print("cupy", cupy.__version__, "cuda runtime", runtime.runtimeGetVersion(),
      "driver", runtime.driverGetVersion(), "devices", runtime.getDeviceCount())
for i in range(runtime.getDeviceCount()):
    p = runtime.getDeviceProperties(i)
    print("device", i, p["name"].decode() if isinstance(p["name"], bytes) else p["name"],
          "cc", f"{p['major']}.{p['minor']}", "memory", p["totalGlobalMem"])
from cupy.cuda import nccl
print("nccl", nccl.get_version())
for name in ("torch", "mpi4py", "ml_dtypes", "sklearn", "matplotlib", "pytest_timeout"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", type(exc).__name__, exc)
"""


@dataclass
class Step:
    """One command of a phase, with its wall-clock limit and extra environment."""

    phase: str
    name: str
    limit_s: float
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    only_if_failed: Optional[str] = None  # run only when the named step failed
    # pytest: leave out the tests that the named step's log shows PASSED
    skip_passed_of: Optional[str] = None
    outputs: List[str] = field(default_factory=list)  # files a step that exits 0 must write
    needs_module: Optional[str] = None  # not run (and not failed) where it is not importable

    def line(self) -> str:
        """The command as one line (a multi-line ``-c`` script shows as its line count)."""
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        words = [f"'<{word.count(chr(10))}-line script>'" if "\n" in word else word
                 for word in self.argv]
        return f"{env + ' ' if env else ''}{' '.join(words)}"


def _gpucoll(*args: str) -> List[str]:
    return [PY, "-m", "gpucoll", *args]


def plan(out: str, digits: Optional[str] = None, workers: int = 0) -> List[Step]:
    """The steps, in order. ``digits``: an .npz of the digits data for hosts without scikit-learn;
    ``workers``: pytest-xdist processes for the GPU tests (0: none)."""
    j = lambda name: os.path.join(out, name)  # noqa: E731
    digits_args = ["--data", digits] if digits else []
    digits_need = None if digits else "sklearn"
    # -v names each test as it starts, and faulthandler_timeout dumps the stacks of a test that
    # runs long, so a step killed at its limit still says where it hung
    pytest = [PY, "-m", "pytest", "tests", "-m", "gpu", "-v", "-rfEs", "-p", "no:cacheprovider",
              "-o", "faulthandler_timeout=120"] + (["-n", str(workers)] if workers else [])
    return [
        Step("env", "nvidia-smi", 30, ["nvidia-smi"]),
        Step("env", "nvidia-smi-topo", 30, ["nvidia-smi", "topo", "-m"]),
        Step("env", "versions", 60, [PY, "-c", VERSIONS]),
        Step("env", "doctor", 60, _gpucoll("doctor")),
        Step("tests", "gpu-tests-x", 300, pytest + ["-x", f"--junitxml={j('gpu-tests-x.xml')}"]),
        Step("tests", "gpu-tests-all", 420, pytest + [f"--junitxml={j('gpu-tests-all.xml')}"],
             only_if_failed="gpu-tests-x", skip_passed_of="gpu-tests-x"),
        Step("ranks", "allreduce-nccl-2-ranks", 120,
             _gpucoll("run", "-n", "2", "-m", "gpucoll.examples.allreduce", "--max-bytes", "256MiB"),
             {**TWO_RANKS_ON_ONE_GPU, "GPUCOLL_BACKEND": "nccl"}),
        Step("ranks", "allreduce-cpu-staging-2-ranks", 120,
             _gpucoll("run", "-n", "2", "-m", "gpucoll.examples.allreduce", "--max-bytes", "64MiB",
                      "--arrays", "cupy"), {"GPUCOLL_BACKEND": "cpu"}),
        Step("ranks", "train-digits-nccl-2-ranks", 150,
             _gpucoll("run", "-n", "2", "-m", "gpucoll.examples.train_digits", "--epochs", "3",
                      *digits_args), {**TWO_RANKS_ON_ONE_GPU, "GPUCOLL_BACKEND": "nccl"},
             needs_module=digits_need),
        Step("ranks", "train-digits-cpu-staging-2-ranks", 150,
             _gpucoll("run", "-n", "2", "-m", "gpucoll.examples.train_digits", "--epochs", "3",
                      *digits_args), {"GPUCOLL_BACKEND": "cpu"}, needs_module=digits_need),
        Step("ranks", "train-cp-ring-nccl-2-ranks", 120,
             _gpucoll("run", "-n", "2", "-m", "gpucoll.examples.train_cp", "--layer", "ring",
                      "--sharding", "zigzag"),
             {**TWO_RANKS_ON_ONE_GPU, "GPUCOLL_BACKEND": "nccl"}),
        Step("ranks", "train-ps-nccl-host-group-3-ranks", 150,
             _gpucoll("run", "-n", "3", "-m", "gpucoll.examples.train_ps", "--mode", "async",
                      "--epochs", "2", *digits_args),
             {**TWO_RANKS_ON_ONE_GPU, "GPUCOLL_BACKEND": "nccl"}, needs_module=digits_need),
        Step("bench", "bench-nccl-1-rank", 150,
             [PY, "bench/bench_nccl.py", "--parts", "--json", j("nccl_overhead_1rank.json")],
             outputs=[j("nccl_overhead_1rank.json")]),
        Step("bench", "bench-nccl-2-ranks", 200,
             # two processes time-slice the one GPU (milliseconds per call): few calls
            _gpucoll("run", "-n", "2", "bench/bench_nccl.py", "-e", "256M", "--iters", "10",
                     "--rounds", "3", "--warmup", "3", "--json", j("nccl_overhead_2ranks.json")),
             TWO_RANKS_ON_ONE_GPU, outputs=[j("nccl_overhead_2ranks.json")]),
        Step("bench", "bench-bucket", 120,
             [PY, "bench/bench_bucket.py", "--skip-cpu", "--skip-e2e", "--json", j("bucket.json")],
             outputs=[j("bucket.json")]),
        Step("bench", "bench-ddp-graph-1-rank", 120,
             [PY, "bench/bench_ddp_graph.py", "--json", j("ddp_graph_1rank.json")],
             outputs=[j("ddp_graph_1rank.json")]),
        Step("bench", "bench-ddp-graph-2-ranks", 150,
             _gpucoll("run", "-n", "2", "bench/bench_ddp_graph.py", "--steps", "20", "--json",
                      j("ddp_graph_2ranks.json")),
             TWO_RANKS_ON_ONE_GPU, outputs=[j("ddp_graph_2ranks.json")]),
        Step("bench", "topo", 90, _gpucoll("topo", "--json", j("topo.json")), outputs=[j("topo.json")]),
        Step("sweep", "bench-all-reduce-g1", 200,
             _gpucoll("bench", "all_reduce", "-g", "1", "-b", "8", "-e", "1G", "-f", "4",
                      "--backend", "nccl", "--json", j("all_reduce_g1.json")),
             outputs=[j("all_reduce_g1.json")]),
        Step("sweep", "bench-all-reduce-g2", 200,
             # time-sliced like bench-nccl-2-ranks: up to 256 MiB fits the limit
            _gpucoll("bench", "all_reduce", "-g", "2", "-b", "8", "-e", "256M", "-f", "4",
                      "--backend", "nccl", "--json", j("all_reduce_g2.json")),
             TWO_RANKS_ON_ONE_GPU, outputs=[j("all_reduce_g2.json")]),
    ]


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return ""


#: a test that passed, as ``pytest -v`` names it: ``tests/test_x.py::test_y[a-b] PASSED  [ 5%]``,
#: or with pytest-xdist ``[gw0] [  5%] PASSED tests/test_x.py::test_y[a-b]``
_PASSED = re.compile(r"^(\S+::.*?) PASSED +\[ *\d+%\]$", re.MULTILINE)
_PASSED_XDIST = re.compile(r"^\[gw\d+\] \[ *\d+%\] PASSED (\S+::.*?)\s*$", re.MULTILINE)


def passed_tests(log_path: str) -> List[str]:
    """The node ids that a ``pytest -v`` log shows PASSED (none when the log is missing)."""
    try:
        with open(log_path, errors="replace") as handle:
            text = handle.read()
    except OSError:
        return []
    return sorted(set(_PASSED.findall(text)) | set(_PASSED_XDIST.findall(text)))


def run_step(step: Step, log_path: str, extra: Sequence[str] = (),
             limit_s: Optional[float] = None) -> Dict[str, object]:
    """Run one step in its own session; on time-out stop its whole process group.

    ``extra``: arguments appended to the step's command line for this run; ``limit_s``: a limit
    below the step's own (what is left of the budget). A step that exits 0 but leaves one of its
    ``outputs`` unwritten has failed.
    """
    limit = step.limit_s if limit_s is None else min(step.limit_s, limit_s)
    env = dict(os.environ, **step.env)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for path in step.outputs:  # a file left by an earlier run must not pass for this one's
        if os.path.exists(path):
            os.remove(path)
    argv = list(step.argv) + list(extra)
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {step.line()}{' (+ ' + str(len(extra)) + ' arguments)' if extra else ''}\n")
        log.flush()
        try:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            log.write(f"could not start: {exc}\n")
            return {"status": "error", "rc": None, "seconds": 0.0}
        status = "passed"
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            status = "timed out"
            for signum, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, 30.0)):
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
        if status == "passed" and rc != 0:
            status = "failed"
        missing = [path for path in step.outputs if not os.path.exists(path)]
        if status == "passed" and missing:
            status = "failed"
            log.write(f"gpu_checks: exited 0 but did not write {', '.join(missing)}\n")
    return {"status": status, "rc": rc, "seconds": round(time.monotonic() - start, 1)}


def write_summary(out: str, results: List[Dict[str, object]], started: float) -> None:
    with open(os.path.join(out, "summary.json"), "w") as handle:
        json.dump({"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)),
                   "steps": results}, handle, indent=1)
    lines = ["| phase | step | status | rc | seconds | limit s |", "|---|---|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['phase']} | {r['name']} | {r['status']} | "
                     f"{'' if r['rc'] is None else r['rc']} | {r['seconds']} | {r['limit_s']} |")
    for r in results:
        if r["status"] in ("failed", "timed out", "error"):
            lines += ["", f"## {r['name']}: {r['status']}", "```", f"$ {r['command']}",
                      _tail(os.path.join(out, r["log"])).rstrip(), "```"]
    with open(os.path.join(out, "summary.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")


def run(steps: Sequence[Step], out: str, budget: Optional[float], echo=print) -> int:
    """Run ``steps`` in order; write the summary after each. Returns the exit status."""
    os.makedirs(out, exist_ok=True)
    started = time.time()
    deadline = None if budget is None else time.monotonic() + budget
    results: List[Dict[str, object]] = []
    outcome: Dict[str, str] = {}
    logs: Dict[str, str] = {}
    for index, step in enumerate(steps):
        record = {"phase": step.phase, "name": step.name, "command": step.line(),
                  "limit_s": step.limit_s, "log": f"{index:02d}-{step.name}.log", "rc": None,
                  "seconds": 0.0}
        logs[step.name] = os.path.join(out, str(record["log"]))
        if step.only_if_failed and outcome.get(step.only_if_failed) == "passed":
            record["status"] = f"not needed ({step.only_if_failed} passed)"
        elif step.needs_module and importlib.util.find_spec(step.needs_module) is None:
            record["status"] = f"not run ({step.needs_module} is not installed)"
        elif deadline is not None and deadline - time.monotonic() < MIN_START:
            record["status"] = "not run (budget)"
        else:
            extra: List[str] = []
            if step.skip_passed_of and step.skip_passed_of in logs:
                for node in passed_tests(logs[step.skip_passed_of]):
                    extra += ["--deselect", node]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left < step.limit_s:
                record["limit_s"] = round(left, 1)
            echo(f"[{step.phase}] {step.name} (limit {record['limit_s']:g} s) ...", flush=True)
            record.update(run_step(step, logs[step.name], extra, left))
            if extra:
                record["deselected"] = len(extra) // 2
        outcome[step.name] = str(record["status"])
        echo(f"[{step.phase}] {step.name}: {record['status']} ({record['seconds']} s)", flush=True)
        results.append(record)
        write_summary(out, results, started)
    bad = [r for r in results if r["status"] in ("failed", "timed out", "error")]
    return 1 if bad else 0


def _names(text: str) -> set:
    return {name.strip() for name in text.split(",") if name.strip()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-checks",
                        help="folder for the logs and summary (default: $OUT, else gpu-checks)")
    parser.add_argument("--phase", default=",".join(PHASES),
                        help=f"comma-separated phases out of {', '.join(PHASES)} (default: all)")
    parser.add_argument("--budget", type=float, help="seconds; start no step that would not fit")
    parser.add_argument("--digits", help="the digits data as .npz (x, y) where scikit-learn is missing")
    parser.add_argument("--workers", type=int, default=0,
                        help="pytest-xdist processes for the GPU tests (default: 0, none)")
    parser.add_argument("--only", default="",
                        help="comma-separated step names: run these alone (see --list)")
    parser.add_argument("--skip", default="", help="comma-separated step names to leave out")
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    parser.add_argument("--force", action="store_true",
                        help="run even without a GPU (to try the steps' command lines)")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phase.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        parser.error(f"unknown phase(s) {unknown or args.phase!r}; choose from {', '.join(PHASES)}")
    if args.workers < 0:
        parser.error(f"--workers must be 0 or more, got {args.workers}")
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget:g}")
    digits = os.path.abspath(args.digits) if args.digits else None
    if digits and not os.path.isfile(digits):
        parser.error(f"--digits {args.digits}: no such file")
    out = os.path.abspath(args.out)
    every = plan(out, digits, args.workers)
    only, skip = (_names(text) for text in (args.only, args.skip))
    unknown = sorted((only | skip) - {s.name for s in every})
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; --list names them")
    steps = [s for s in every if s.phase in phases and (not only or s.name in only)
             and s.name not in skip]
    if not steps:
        parser.error("no step left to run: --phase, --only and --skip exclude them all")
    if args.list:
        for step in steps:
            extra = f"  (only if {step.only_if_failed} failed)" if step.only_if_failed else ""
            if step.skip_passed_of:
                extra += f"  (without the tests {step.skip_passed_of} passed)"
            if step.needs_module and importlib.util.find_spec(step.needs_module) is None:
                extra += f"  (not run here: {step.needs_module} is not installed; see --digits)"
            print(f"[{step.phase}] {step.name}, limit {step.limit_s:g} s: {step.line()}{extra}")
        return 0
    sys.path.insert(0, ROOT)
    from gpucoll.cuda_env import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason and not args.force:
        print(f"gpu_checks: no GPU here ({reason}); nothing run", file=sys.stderr)
        return 3
    return run(steps, out, args.budget)


if __name__ == "__main__":
    sys.exit(main())
