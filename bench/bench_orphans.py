"""How long the processes of a SIGKILLed launcher's job live on (gpucoll/orphan_guard.py,
gpucoll/orphan_reaper.py), and what the orphan reaper costs at start-up.

Each trial starts a 2-rank job, waits until every process of it wrote its pid file (the ranks
in their loop), SIGKILLs the launcher, and measures from just before the SIGKILL to the moment
the last of those processes is gone (``/proc`` polled every millisecond; a zombie counts as
gone), capped at ``--cap`` seconds. Cases:

- ``gpucoll run`` with Python ranks that initialise gpucoll and all-reduce in a loop
  (tests/scripts/orphan_rank.py: the kernel's parent-death signal, and the reaper);
- the same ranks each with a ``sleep`` child (``--child``, as a data-loader worker);
- ``gpucoll run ./job.sh``, the rank a child of a shell (a pidfd on the launcher), and the
  same with ``os.pidfd_open`` hidden (polling the ancestry every 0.5 s);
- ``gpucoll run ./tree.sh``: a shell that never calls ``gc.init()``, with a ``sleep`` child
  (tests/scripts/orphan_tree.sh): only the reaper can stop it;
- ``gc.spawn`` (the caller is SIGKILLed);
- the peers, with the same rank programs (no gpucoll launcher variables there, so no guard:
  what the launcher itself does): ``torchrun --nproc-per-node 2`` and Open MPI's
  ``mpirun -n 2``, each when installed.

``--baseline TREE`` runs the gpucoll cases a second time with the package of another source
tree (an export of an earlier commit: ``git archive REV | tar -x -C TREE``), for a before and
after in one run. ``--launch-overhead N`` instead times ``gpucoll run -n 2 python -c pass`` N
times (median, interleaved): the command line of this tree (and of ``--baseline``), and
``run_job`` in this process with ``orphan_reaper`` on and off (2N times each).

Usage::

    python bench/bench_orphans.py               # 5 trials per case
    python bench/bench_orphans.py --trials 3 --cap 10 --baseline ../before
    python bench/bench_orphans.py --launch-overhead 11 --baseline ../before
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import socket
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from clusters import mpirun_command, mpirun_env  # noqa: E402

SCRIPTS = ROOT / "tests" / "scripts"
RANK_SCRIPT = str(SCRIPTS / "orphan_rank.py")
JOB_SCRIPT = str(SCRIPTS / "orphan_job.sh")
TREE_SCRIPT = str(SCRIPTS / "orphan_tree.sh")
_OUTER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "GPUCOLL_AUTH_TOKEN", "GPUCOLL_LAUNCHER_STORE", "GPUCOLL_LAUNCHER_PID",
          "GPUCOLL_LAUNCHER_PID_NAMESPACE")

SPAWN_CALLER = str(SCRIPTS / "orphan_spawn_caller.py")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(piddir: str) -> Dict[str, int]:
    return {name: int(Path(piddir, name).read_text()) for name in os.listdir(piddir)
            if name.endswith(".pid")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trial(command: List[str], processes: int, cap: float,
          extra_env: Optional[Dict[str, str]] = None, tree: Path = ROOT) -> Optional[float]:
    """Seconds from the launcher's SIGKILL until the ``processes`` processes that wrote pid
    files are all gone; None past ``cap``."""
    env = {key: value for key, value in (extra_env or os.environ).items() if key not in _OUTER}
    env.update(PYTHONPATH=str(tree), ORPHAN_PYTHON=sys.executable)
    with tempfile.TemporaryDirectory() as piddir:
        argv = [part.replace("PIDDIR", piddir) for part in command]
        launcher = subprocess.Popen(argv, cwd=piddir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        job_pids: List[int] = []
        try:
            deadline = time.monotonic() + 60
            while len(job_pids) < processes:
                if time.monotonic() > deadline or launcher.poll() is not None:
                    raise RuntimeError(f"the processes of {argv} never started")
                time.sleep(0.05)
                job_pids = list(_pids(piddir).values())
            time.sleep(0.3)  # in the all-reduce loop
            start = time.monotonic()
            launcher.send_signal(signal.SIGKILL)
            while any(_alive(pid) for pid in job_pids):
                if time.monotonic() - start > cap:
                    return None
                time.sleep(0.001)
            return time.monotonic() - start
        finally:
            for pid in [launcher.pid, *_pids(piddir).values()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            launcher.wait(5)


def launch_overhead(repeats: int, baseline: Optional[Path]) -> None:
    """Wall time of ``gpucoll run -n 2 python -c pass``, each variant ``repeats`` times,
    interleaved; median and min."""
    pass_job = ["run", "-n", "2", sys.executable, "-c", "pass"]
    variants = {"gpucoll run -n 2 python -c pass": ([sys.executable, "-m", "gpucoll", *pass_job],
                                                    ROOT)}
    if baseline is not None:
        variants["before: gpucoll run -n 2 python -c pass"] = (
            [sys.executable, "-m", "gpucoll", *pass_job], baseline)
    times: Dict[str, List[float]] = {name: [] for name in variants}
    env = {key: value for key, value in os.environ.items() if key not in _OUTER}
    with tempfile.TemporaryDirectory() as cwd:  # not the tree: python -m would import it
        for _ in range(repeats):
            for name, (command, tree) in variants.items():
                start = time.monotonic()
                subprocess.run(command, cwd=cwd, env={**env, "PYTHONPATH": str(tree)},
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, check=True, timeout=120)
                times[name].append(time.monotonic() - start)
    # The same job from run_job in this process: no interpreter start or import in the time.
    from gpucoll.launch import LaunchConfig, run_job

    for flag in (True, False):
        times[f"run_job in-process, orphan_reaper={flag}"] = []
    for _ in range(2 * repeats):
        for flag in (True, False):
            start = time.monotonic()
            code = run_job(LaunchConfig(sys.executable, ("-c", "pass"), nproc=2, env=env,
                                        orphan_reaper=flag, stdout=io.StringIO(),
                                        stderr=io.StringIO()))
            times[f"run_job in-process, orphan_reaper={flag}"].append(time.monotonic() - start)
            assert code == 0
    print(f"{'launch':<44} {'median ms':>10} {'min ms':>10}  trials (ms)")
    for name, values in times.items():
        listed = " ".join(f"{t * 1e3:.0f}" for t in values)
        print(f"{name:<44} {statistics.median(values) * 1e3:>10.1f} {min(values) * 1e3:>10.1f}"
              f"  {listed}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--cap", type=float, default=10.0,
                        help="seconds after which a process counts as orphaned for good")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a source tree whose gpucoll package runs the gpucoll cases again")
    parser.add_argument("--launch-overhead", type=int, default=0, metavar="N",
                        help="time N launches of 'python -c pass' instead")
    parser.add_argument("--cases", default="",
                        help="run only the cases whose name contains this text")
    opts = parser.parse_args()
    if opts.baseline is not None and not (opts.baseline / "gpucoll" / "__init__.py").is_file():
        parser.error(f"--baseline {opts.baseline}: no gpucoll package there")
    if opts.launch_overhead:
        launch_overhead(opts.launch_overhead, opts.baseline)
        return
    run = [sys.executable, "-m", "gpucoll", "run", "-n", "2"]
    # name: (command, processes that write a pid file, runs with --baseline too)
    cases: Dict[str, Tuple[List[str], int, bool]] = {
        "gpucoll run, Python ranks": (run + [RANK_SCRIPT, "PIDDIR"], 2, True),
        "gpucoll run, Python ranks + a child each": (run + [RANK_SCRIPT, "PIDDIR", "--child"],
                                                     4, True),
        "gpucoll run ./job.sh (shell runs Python)": (run + [JOB_SCRIPT, "PIDDIR"], 4, True),
        "gpucoll run ./job.sh, no pidfd": (run + [JOB_SCRIPT, "PIDDIR", "--no-pidfd"], 4, True),
        "gpucoll run ./tree.sh (no gc.init) + sleep child": (run + [TREE_SCRIPT, "PIDDIR"], 4,
                                                             True),
        "gc.spawn (caller SIGKILLed)": ([sys.executable, SPAWN_CALLER, "PIDDIR"], 2, True),
    }
    envs: Dict[str, Dict[str, str]] = {}
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun:
        torch_run = [torchrun, "--nproc-per-node", "2"]
        cases["peer: torchrun, Python ranks"] = (torch_run + [RANK_SCRIPT, "PIDDIR"], 2, False)
        cases["peer: torchrun, Python ranks + a child each"] = (
            torch_run + [RANK_SCRIPT, "PIDDIR", "--child"], 4, False)
        cases["peer: torchrun --no-python ./tree.sh"] = (
            torch_run + ["--no-python", TREE_SCRIPT, "PIDDIR"], 4, False)
    mpirun, _ = mpirun_command(2)
    if mpirun:
        for name, command, processes in [
                ("peer: mpirun, Python ranks", [sys.executable, RANK_SCRIPT, "PIDDIR"], 2),
                ("peer: mpirun, Python ranks + a child each",
                 [sys.executable, RANK_SCRIPT, "PIDDIR", "--child"], 4),
                ("peer: mpirun ./tree.sh", [TREE_SCRIPT, "PIDDIR"], 4)]:
            cases[name] = ([*mpirun, *command], processes, False)
            envs[name] = mpirun_env()
    runs = []
    for name, (command, processes, also_before) in cases.items():
        if opts.cases in name:
            runs.append((name, command, processes, envs.get(name), ROOT))
            if also_before and opts.baseline is not None:
                runs.append((f"before: {name}", command, processes, None, opts.baseline))
    print(f"{'case':<58} {'median ms':>10} {'max ms':>10}  trials (ms; '-' = alive after "
          f"{opts.cap:g} s)")
    for name, command, processes, base_env, tree in runs:
        times = []
        for _ in range(opts.trials):
            env = None if base_env is None else {**base_env, "MASTER_PORT": str(_free_port())}
            times.append(trial(command, processes, opts.cap, env, tree))
        done = [t for t in times if t is not None]
        median = f"{statistics.median(done) * 1e3:.1f}" if len(done) == len(times) else "-"
        worst = f"{max(done) * 1e3:.1f}" if len(done) == len(times) else "-"
        listed = " ".join("-" if t is None else f"{t * 1e3:.1f}" for t in times)
        print(f"{name:<58} {median:>10} {worst:>10}  {listed}", flush=True)


if __name__ == "__main__":
    main()
