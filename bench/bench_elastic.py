"""Elastic training and shrink: time to shrink after a SIGKILLed rank, and what an elastic
digits run loses against an undisturbed one.

Usage (from the repository root)::

    python bench/bench_elastic.py [--rounds 5] [--ranks 4] [--epochs 10]

Time to shrink: ``gpucoll run -n RANKS --elastic`` of this file's rank program, once per round.
The ranks all-reduce 256 KiB in a loop; the last rank writes the wall-clock time to the store
and SIGKILLs itself. Every survivor notes when its error came, when ``shrink()`` returned and
when the first all-reduce on the new communicator completed (all on one host, one clock).

Training: ``gpucoll.examples.train_digits`` on RANKS ranks, undisturbed and ``--elastic`` with
world rank 1 SIGKILLed mid-epoch, for global batches of 64 and 48 (48 splits evenly over 4 and
3 ranks, so the survivors average the same samples per step). Steps lost = the step the rank
died at minus the step the survivors continued from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_program(kill_step: int) -> None:
    import numpy as np

    import gpucoll
    from gpucoll.errors import CommAbortedError, CommTimeoutError, PeerError

    comm = gpucoll.init(backend="cpu", timeout=60)
    store, victim = comm._root_store, comm.size - 1
    x = np.ones(32 << 10)  # 256 KiB of float64
    for step in range(10_000):
        if comm.rank == victim and step == kill_step:
            store.set("bench/fault", repr(time.time()).encode())
            os.kill(os.getpid(), 9)
        try:
            comm.all_reduce(x)
        except (PeerError, CommTimeoutError, CommAbortedError):
            error = time.time()
            break
    new = comm.shrink()
    shrunk = time.time()
    comm.close()
    y = new.all_reduce(np.ones(32 << 10))
    first = time.time()
    assert float(y[0]) == new.size
    fault = float(store.get("bench/fault", 10).decode())
    print("SHRINK " + json.dumps({"error": error - fault, "shrunk": shrunk - fault,
                                  "first": first - fault, "size": new.size}), flush=True)
    new.close()


def _gpucoll_run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "gpucoll", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def time_to_shrink(rounds: int, ranks: int) -> None:
    worst = {"error": [], "shrunk": [], "first": []}
    for _ in range(rounds):
        out = _gpucoll_run("-n", str(ranks), "--elastic", __file__, "--rank-program", "20")
        if out.returncode != 0:
            raise SystemExit(out.stdout + out.stderr)
        reports = [json.loads(line.split("SHRINK ", 1)[1]) for line in out.stdout.splitlines()
                   if "SHRINK " in line]
        assert len(reports) == ranks - 1 and all(r["size"] == ranks - 1 for r in reports)
        for key in worst:
            worst[key].append(max(r[key] for r in reports))
    print(f"time to shrink, {ranks} ranks, one SIGKILLed, {rounds} rounds "
          f"(worst survivor per round; median / max over rounds, ms):")
    for key, what in (("error", "fault -> error raised"), ("shrunk", "fault -> shrink() returned"),
                      ("first", "fault -> first all_reduce on the new communicator done")):
        values = worst[key]
        print(f"  {what:58s} {1e3 * statistics.median(values):7.1f} / {1e3 * max(values):7.1f}")


def training(ranks: int, epochs: int) -> None:
    kill_step = 2 * 22 + 11  # mid-epoch 3 at batch 64 (22 steps per epoch on 4 ranks)
    print(f"digits, {ranks} ranks, {epochs} epochs, world rank 1 SIGKILLed at step {kill_step}:")
    for batch in (64, 48):
        train = ["-m", "gpucoll.examples.train_digits", "--cpu", "--epochs", str(epochs),
                 "--batch-size", str(batch)]
        plain = _gpucoll_run("-n", str(ranks), *train)
        elastic = _gpucoll_run("-n", str(ranks), "--elastic", *train, "--elastic",
                               "--kill-rank", "1", "--kill-step", str(kill_step))
        for out in (plain, elastic):
            if out.returncode != 0:
                raise SystemExit(out.stdout + out.stderr)
        accuracy = [float(re.findall(r"test acc ([0-9.]+)", out.stdout)[-1])
                    for out in (plain, elastic)]
        resumed = int(re.search(r"continued on \d+ ranks from step (\d+)", elastic.stdout).group(1))
        print(f"  global batch {batch}: steps lost {kill_step - resumed}, final test accuracy "
              f"{accuracy[1]:.4f} elastic vs {accuracy[0]:.4f} undisturbed "
              f"({100 * (accuracy[1] - accuracy[0]):+.2f} points)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rank-program", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_program is not None:
        rank_program(args.rank_program)
        return 0
    time_to_shrink(args.rounds, args.ranks)
    training(args.ranks, args.epochs)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())
