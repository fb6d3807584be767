"""Back to full size after a lost rank: gpucoll's replacement (``gpucoll run --elastic
--replace 1`` and ``comm.grow()``) beside torchrun's restart (``--max-restarts 1``).

Usage (from the repository root; torch for the torchrun side)::

    python bench/bench_replace.py [--rounds 5] [--ranks 4]

Both rank programs all-reduce 256 KiB of float64 in a loop (gpucoll's CPU backend; torch's
Gloo); the last rank writes the wall-clock time to a file and SIGKILLs itself at step 50.

- gpucoll: the survivors shrink and go on all-reducing on one rank fewer, calling
  ``grow()`` after every step; the launcher starts a new process in the dead rank's place,
  whose ``init()`` waits to be let in. Timed: fault to the first all-reduce on the grown
  communicator (every rank of it), and how many steps the survivors took meanwhile.
- torchrun: the agent stops every worker and starts them all again (restart 1), which
  rendezvous, make a new Gloo group and all-reduce. Timed: fault to that first all-reduce.

One host, one clock. Each side's time includes starting Python and importing its library.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_STEP = 50
ELEMENTS = 32 << 10   # 256 KiB of float64


def gpucoll_rank(fault_file: str) -> None:
    import numpy as np

    import gpucoll
    from gpucoll.errors import CommAbortedError, CommTimeoutError, PeerError

    comm = gpucoll.init(backend="cpu", timeout=60)
    x = np.ones(ELEMENTS)
    if not comm.joined:
        victim = comm.size - 1
        for step in range(10_000):
            if comm.rank == victim and step == KILL_STEP:
                with open(fault_file, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), 9)
            try:
                comm.all_reduce(x)
            except (PeerError, CommTimeoutError, CommAbortedError):
                break
        old, comm = comm, comm.shrink()
        old.close()
        steps = 0
        while True:   # training goes on on the survivors until the replacement is in
            comm.all_reduce(x)
            steps += 1
            bigger = comm.grow()
            if bigger is not comm:
                comm.close()
                comm = bigger
                break
    else:
        steps = 0
    comm.all_reduce(x)
    done = time.time()
    with open(fault_file) as f:
        fault = float(f.read())
    print("BACK " + json.dumps({"seconds": done - fault, "steps": steps, "size": comm.size}),
          flush=True)
    comm.close()


def torch_rank(fault_file: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.ones(ELEMENTS, dtype=torch.float64)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        for step in range(10_000):
            if rank == size - 1 and step == KILL_STEP:
                with open(fault_file, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), 9)
            dist.all_reduce(x)
    dist.all_reduce(x)
    done = time.time()
    with open(fault_file) as f:
        fault = float(f.read())
    print("BACK " + json.dumps({"seconds": done - fault, "steps": 0, "size": size}), flush=True)
    dist.destroy_process_group()


def _reports(stdout: str) -> list:
    return [json.loads(line.split("BACK ", 1)[1]) for line in stdout.splitlines() if "BACK " in line]


def one_round(side: str, ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        fault_file = os.path.join(folder, "fault")
        me = os.path.abspath(__file__)
        if side == "gpucoll":
            command = [sys.executable, "-m", "gpucoll", "run", "-n", str(ranks), "--elastic",
                       "--replace", "1", me, "--rank-program", "gpucoll", fault_file]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                       str(ranks), "--max-restarts", "1", "--monitor-interval", "0.1",
                       "--standalone", me,
                       "--rank-program", "torch", fault_file]
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        try:
            run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=90)
        except subprocess.TimeoutExpired as exc:
            return {"failed": f"no result within {exc.timeout:g} s"}
        reports = _reports(run.stdout)
        if run.returncode != 0 or len(reports) != ranks:
            errors = [line.strip() for line in run.stderr.splitlines()
                      if "Error" in line and "debug_logger" not in line]
            restart = [line for line in errors if "connectFullMesh" in line]  # the new round's
            return {"failed": f"exit {run.returncode}, {len(reports)} of {ranks} ranks back; "
                              f"last error: {(restart or errors or [run.stderr[-300:]])[-1]}"}
        assert all(r["size"] == ranks for r in reports), reports
        return {"seconds": max(r["seconds"] for r in reports),
                "steps": max(r["steps"] for r in reports)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rank-program", choices=["gpucoll", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("fault_file", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_program == "gpucoll":
        gpucoll_rank(args.fault_file)
        return 0
    if args.rank_program == "torch":
        torch_rank(args.fault_file)
        return 0
    results = {"gpucoll": [], "torchrun": []}
    for _ in range(args.rounds):   # alternate, so both sides see the same machine
        results["gpucoll"].append(one_round("gpucoll", args.ranks))
        results["torchrun"].append(one_round("torchrun", args.ranks))
    print(f"back to {args.ranks} ranks after SIGKILL of one, {args.rounds} rounds "
          f"(median, max):")
    medians = {}
    for side, rounds in results.items():
        done = [r for r in rounds if "failed" not in r]
        for r in rounds:
            if "failed" in r:
                print(f"  {side:9s} round failed: {r['failed']}")
        if not done:
            continue
        seconds = [r["seconds"] for r in done]
        medians[side] = statistics.median(seconds)
        print(f"  {side:9s} {medians[side]:6.2f} s  {max(seconds):6.2f} s   ({len(done)} of "
              f"{len(rounds)} rounds; steps on the survivors meanwhile: median "
              f"{statistics.median(r['steps'] for r in done):.0f})")
    if len(medians) == 2:
        print(f"  torchrun time / gpucoll time: {medians['torchrun'] / medians['gpucoll']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
